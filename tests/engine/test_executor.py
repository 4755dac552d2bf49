"""Executor pieces that run without a GPU: back-end selection, the device error, the pinned staging
ring's fence rule and the pack/unpack of one iteration's tensors (the CUDA back-end's H2D layout)."""

from __future__ import annotations

import pytest
import torch

from minisgl_backend import Engine, EngineConfig
from minisgl_backend.errors import ConfigError, DeviceUnavailableError
from minisgl_backend.executor import check_device, make_executor
from minisgl_backend.executor.base import forward_batch, index_tensors
from minisgl_backend.executor.cpu import CPUExecutor
from minisgl_backend.executor.staging import StagingRing, StagingSlot
from minisgl_backend.executor.tracker import PyInflightTracker
from minisgl_backend.iteration import IterationInputs, PrefillChunk
from minisgl_backend.metrics import Metrics, Tracer


def test_factory_picks_the_cpu_back_end() -> None:
    metrics = Metrics(exact=True)
    ex = make_executor(EngineConfig(device="cpu"), PyInflightTracker(2), metrics, Tracer(False))
    try:
        assert isinstance(ex, CPUExecutor)
    finally:
        ex.close()
        metrics.close()


@pytest.mark.parametrize("device", ["mps", "tpu", "not-a-device"])
def test_unsupported_device_is_a_config_error(device: str) -> None:
    with pytest.raises(ConfigError, match="device must be"):
        EngineConfig(device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_cuda_without_a_gpu_is_a_typed_error(tiny_model_dir) -> None:
    with pytest.raises(DeviceUnavailableError, match="CUDA is not available"):
        check_device("cuda:0")
    with pytest.raises(DeviceUnavailableError):  # before any model load or thread start
        Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", num_blocks=8))


def test_staging_ring_hands_a_slot_out_again_only_after_its_fence() -> None:
    ring = StagingRing(2, pin=False)
    a = ring.acquire(1, completed=0)
    b = ring.acquire(2, completed=0)
    assert a is not None and b is not None and a is not b
    assert ring.acquire(3, completed=0) is None  # both slots fenced by iterations in flight
    assert ring.oldest_fence() == 1
    assert ring.acquire(3, completed=0) is None and ring.num_free == 0
    c = ring.acquire(3, completed=1)  # iteration 1 completed: its slot, and only its slot, comes back
    assert c is a and ring.oldest_fence() == 2
    assert ring.acquire(4, completed=1) is None
    assert ring.acquire(4, completed=3) is not None and ring.num_free == 1  # 2 and 3 both passed


def test_staging_slot_grows_and_keeps_buffers_it_can_reuse() -> None:
    slot = StagingSlot(pin=False)
    small = slot.buffer("in", torch.int64, 4)
    again = slot.buffer("in", torch.int64, 3)
    assert again.data_ptr() == small.data_ptr()  # reused, not reallocated
    big = slot.buffer("in", torch.int64, 100)
    assert big.numel() == 100 and big.data_ptr() != small.data_ptr()
    assert slot.buffer("in", torch.bool, 4).dtype == torch.bool  # one buffer per dtype


def _inputs() -> tuple[IterationInputs, torch.Tensor]:
    mask = torch.tensor([[True, True, False, False], [True, True, True, False]])[:, None, None, :]
    inp = IterationInputs(
        iteration=7,
        depends_on=6,
        table_rows=torch.tensor([0, 1, 2, 2, 2]),
        positions=torch.tensor([2, 3, 0, 1, 2]),
        slot_mapping=torch.tensor([2, 7, 8, 9, 10]),
        prompt_writes=(),
        num_decode=2,
        decode_block_tables=torch.tensor([[0], [1]]),
        decode_mask=mask,
        prefill_chunks=(PrefillChunk(2, 3, 3, torch.tensor([2])),),
        logits_index=torch.tensor([0, 1, 4]),
        samples=(),
        scores=(),
    )
    return inp, torch.tensor([11, 12, 13, 14, 15])


def test_upload_round_trips_every_index_tensor() -> None:
    inp, ids = _inputs()
    slot = StagingSlot(pin=False)
    direct = forward_batch(inp, index_tensors(inp, ids))
    staged = forward_batch(inp, slot.upload(index_tensors(inp, ids), torch.clone))
    for name in (
        "input_ids",
        "positions",
        "slot_mapping",
        "decode_block_tables",
        "decode_mask",
        "logits_index",
    ):
        want, got = getattr(direct, name), getattr(staged, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert staged.prefill_chunks[0][:3] == direct.prefill_chunks[0][:3]
    assert torch.equal(staged.prefill_chunks[0].block_table, direct.prefill_chunks[0].block_table)
    # A prompt-only iteration has no decode tensors: None passes through in place.
    prompt_only = inp._replace(num_decode=0, decode_block_tables=None, decode_mask=None)
    out = slot.upload(index_tensors(prompt_only, ids), torch.clone)
    assert out[3] is None and out[4] is None and torch.equal(out[0], ids)


def test_download_lands_logits_in_the_slot() -> None:
    slot = StagingSlot(pin=False)
    logits = torch.randn(3, 10)
    host = slot.download(logits, lambda src, dst: dst.copy_(src))
    assert torch.equal(host, logits)
    assert host.data_ptr() == slot.buffer("logits", torch.float32, 30).data_ptr()


def test_the_cpu_executor_tells_the_thread_plan_what_each_step_is(tiny_model_dir, monkeypatch) -> None:
    """A busy machine costs a step of a few decode rows its second thread, not a step with prompt
    tokens (model/cpu_threads.py adapt): the executor says which kind each forward is."""
    from minisgl_backend import SamplingParams
    from minisgl_backend.model import cpu_threads

    seen: list[int | None] = []
    monkeypatch.setattr(cpu_threads, "adapt", lambda decode_rows=None: seen.append(decode_rows))
    with Engine(EngineConfig(model=str(tiny_model_dir), num_blocks=64)) as engine:
        engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert None in seen, "the prefill steps say they carry prompt tokens"
    decode = [n for n in seen if n is not None]
    assert decode and set(decode) <= {1, 2}, seen
