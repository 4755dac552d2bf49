"""The model holds its weights once: packing replaces each weight with its packed layout (a tied
embedding reads its rows from the LM head's pack), and loading reads the checkpoint tensor by
tensor into the model's own parameters, so neither the loaded model nor the peak of loading holds a
second copy."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from minisgl_backend.errors import ModelLoadError
from minisgl_backend.model import checkpoint as ckpt
from minisgl_backend.model import cpu_kernels
from minisgl_backend.model.layers import Linear
from minisgl_backend.model.llama import CausalLM
from tests.helpers import model_spec, random_bf16_model

PACKING = [f for f in ("amx", "avx512bf16") if cpu_kernels.runs_family(f)]
needs_packing = pytest.mark.skipif(not PACKING, reason="this CPU runs no packing kernel family")


def _spec(tied: bool):
    # A vocabulary large enough that the embedding is a fifth of the weights, as in SmolLM2 and
    # the 1B shape: a second copy of it alone breaks the bound below.
    return model_spec(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        head_dim=16,
        tie_word_embeddings=tied,
    )


@needs_packing
@pytest.mark.parametrize("tied", [False, True])
def test_packed_model_holds_its_weights_once(tied):
    model = random_bf16_model(_spec(tied))
    ids = torch.tensor([0, 5, 511, 5])
    with torch.inference_mode():
        embedded = model.embed(ids)
    needed = model.weight_bytes()
    assert needed <= model.held_bytes() <= needed + 1024  # and the RoPE tables
    assert model.pack_weights() == 2 * 4 + 1
    assert model.weight_bytes() == needed
    assert model.held_bytes() <= 1.15 * needed, "a weight is held beside its pack"
    assert model.embeds_from_head() == tied
    with torch.inference_mode():
        assert torch.equal(model.embed(ids), embedded), "the embedding's rows, read back from the pack"
    model.unpack_weights()
    assert model.held_bytes() <= needed + 1024 and not model.embeds_from_head()
    with torch.inference_mode():
        assert torch.equal(model.embed(ids), embedded)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


@needs_packing
def test_int8_after_packing_keeps_the_embedding_exact():
    """quantize_int8 on a packed tied model gives the embedding its own exact rows (the LM head
    turns int8) and packs the head's dequantized weight again."""
    model = random_bf16_model(_spec(True))
    ids = torch.arange(0, 512, 7)
    with torch.inference_mode():
        embedded = model.embed(ids)
    model.pack_weights()
    model.quantize_int8()
    assert not model.embeds_from_head() and model.lm_head.packed is not None
    with torch.inference_mode():
        assert torch.equal(model.embed(ids), embedded)


@needs_packing
def test_engine_holds_the_weights_once(tiny_model_dir):
    from minisgl_backend import Engine, EngineConfig, SamplingParams

    with Engine(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", num_blocks=16, num_threads=1)) as e:
        assert e.held_weight_bytes <= 1.15 * e.weight_bytes
        assert e.kv_cache_bytes > 0
        out = e.generate(["one two three"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
        assert len(out.token_ids) == 4


def _write(path, tensors: dict[str, torch.Tensor]) -> None:
    ckpt.write(path, {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}, tensors.values())


def test_checkpoint_reads_and_converts_in_bounded_chunks(tmp_path, monkeypatch):
    """A float32 checkpoint read into bf16 parameters (through a staging buffer smaller than one
    tensor, so in several chunks) gives what torch's conversion gives; a same-dtype one is read
    straight in."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(37, 11, generator=g), torch.randn(5, generator=g).bfloat16()
    _write(tmp_path / "model.safetensors", {"a": a, "b": b})
    monkeypatch.setattr(ckpt, "STAGING_BYTES", 3 * 11 * 4)  # three rows at a time
    c = ckpt.Checkpoint(tmp_path)
    assert c.shapes == {"a": (37, 11), "b": (5,)}
    dest_a, dest_b = torch.empty(37, 11, dtype=torch.bfloat16), torch.empty(5, dtype=torch.bfloat16)
    c.read_into("a", dest_a)
    c.read_into("b", dest_b)
    assert torch.equal(dest_a, a.bfloat16()) and torch.equal(dest_b, b)
    with pytest.raises(ValueError, match="shape"):
        c.read_into("a", torch.empty(11, 37))


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 64]},  # past the end of the file
        {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 30]},  # not the shape's byte count
        {"dtype": "Q4", "shape": [4], "data_offsets": [0, 8]},  # no such dtype
        {"dtype": "BF16", "shape": "four"},  # malformed
    ],
)
def test_checkpoint_entries_that_do_not_fit_are_load_errors(tmp_path, entry):
    # a good file, then its header rewritten with the bad entry beside the good one
    path = tmp_path / "model.safetensors"
    _write(path, {"ok": torch.zeros(4, 4).bfloat16()})
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length]) | {"bad": entry}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*'bad'"):
        ckpt.Checkpoint(tmp_path)


def _hf_state(ref: CausalLM) -> dict[str, torch.Tensor]:
    """`ref`'s weights as a Hugging Face checkpoint names them: separate q/k/v and gate/up."""
    spec, state = ref.spec, {}
    for name, p in ref.state_dict().items():
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            continue
        if name.endswith("qkv_proj.weight"):
            q, k, v = p.split([spec.num_heads * spec.head_dim, *[spec.num_kv_heads * spec.head_dim] * 2])
            base = name[: -len("qkv_proj.weight")]
            state |= {base + "q_proj.weight": q, base + "k_proj.weight": k, base + "v_proj.weight": v}
        elif name.endswith("gate_up_proj.weight"):
            gate, up = p.chunk(2)
            base = name[: -len("gate_up_proj.weight")]
            state |= {base + "gate_proj.weight": gate, base + "up_proj.weight": up}
        else:
            state[name] = p
    return state


def _meta_built(spec) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(spec).to(torch.bfloat16)
    return model.to_empty(device="cpu")


def test_separate_projections_fill_their_rows_of_the_fused_ones(tmp_path):
    """Hugging Face's q/k/v and gate/up tensors land in the fused parameters' rows in order; a part
    of the wrong size is named."""
    spec = model_spec()
    ref = random_bf16_model(spec)
    state = _hf_state(ref)
    _write(tmp_path / "model.safetensors", state)
    model = _meta_built(spec)
    model.load_checkpoint(ckpt.Checkpoint(tmp_path))
    for name, p in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], p), name
    state["model.layers.0.self_attn.k_proj.weight"] = state["model.layers.0.self_attn.k_proj.weight"][:-1]
    _write(tmp_path / "model.safetensors", state)
    with pytest.raises(ValueError, match="qkv_proj"):
        model.load_checkpoint(ckpt.Checkpoint(tmp_path))


@needs_packing
@pytest.mark.parametrize("tied", [False, True])
def test_packing_as_the_weights_load_gives_the_packs_packing_after_gives(tmp_path, tied):
    """load_checkpoint(pack=True) packs each linear weight from its read buffer: the same packs
    (gated where pack_weights gates) as reading then pack_weights(), which then leaves them as they
    are, and a tied embedding reads its rows from the LM head's pack; the norms and an untied
    embedding are read as before."""
    spec = _spec(tied)
    ref = random_bf16_model(spec)
    _write(tmp_path / "model.safetensors", _hf_state(ref))
    after = _meta_built(spec)
    after.load_checkpoint(ckpt.Checkpoint(tmp_path))
    assert after.pack_weights() == 2 * 4 + 1
    model = _meta_built(spec)
    model.load_checkpoint(ckpt.Checkpoint(tmp_path), pack=True)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4 + 1
    packs = {n: m.packed for n, m in linears}
    for name, lin in linears:
        other = after.get_submodule(name)
        assert lin.packed is not None and lin.weight.is_meta, f"{name} was not packed as it loaded"
        assert lin.gated == other.gated and torch.equal(lin.packed, other.packed), name
    assert model.embeds_from_head() == tied
    assert model.pack_weights() == 2 * 4 + 1
    assert all(m.packed is packs[n] for n, m in linears), "pack_weights packed a loaded pack again"
    ids = torch.tensor([0, 5, 511, 5])
    with torch.inference_mode():
        assert torch.equal(model.embed(ids), after.embed(ids))
    for name, p in after.state_dict().items():
        if not p.is_meta:
            assert torch.equal(model.state_dict()[name], p), name
    assert model.held_bytes() <= 1.15 * model.weight_bytes()


@pytest.mark.parametrize("pack", [False, True])
def test_loading_peaks_at_the_weights_once(tmp_path, pack):
    """load_model's peak resident memory grows by the weights once (a 400 MB bf16 checkpoint with
    separate q/k/v and gate/up tensors), not by a dictionary of them beside the model or a float32
    model before the cast, and so does the address space it reserves (`pack`: weights packed as
    they load reserve none of their own beside the packs). Measured in a fresh process: its
    high-water marks after load_model against those before (the tokenizer is loaded once
    beforehand, so its own memory is in the baseline)."""
    from minisgl_backend.tools.tiny import make_random_llama

    model_dir = make_random_llama(tmp_path / "m", "smol2", dtype="bfloat16")
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(num_hidden_layers=40)  # ~400 MB: the peak's signal far above the allocator's noise
    (model_dir / "config.json").write_text(json.dumps(cfg))
    from transformers import LlamaConfig

    from minisgl_backend.tools.tiny import llama_tensors, write_streamed

    write_streamed(model_dir, LlamaConfig(**cfg), torch.bfloat16, 0)
    weights = sum(torch.Size(s).numel() * 2 for s in llama_tensors(LlamaConfig(**cfg)).values())
    assert weights > 350e6
    script = textwrap.dedent(
        f"""
        import resource, torch
        from minisgl_backend.model.loader import load_model, load_tokenizer
        torch.set_num_threads(1)
        def peak(field):
            for line in open("/proc/self/status"):
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        load_tokenizer({str(model_dir)!r})
        before = peak("VmHWM"), peak("VmPeak")
        loaded = load_model({str(model_dir)!r}, "bfloat16", "cpu", pack={pack})
        print(peak("VmHWM") - before[0], peak("VmPeak") - before[1])
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    grown, reserved = map(int, out.split())
    assert grown <= 1.15 * weights + 100e6, (
        f"loading grew the peak by {grown / 1e6:.0f} MB for {weights / 1e6:.0f} MB"
    )
    # Memory reserved counts too where the machine does not overcommit: a weight packed as it loads
    # reserves no memory of its own beside its pack (the allowance: allocator arenas of threads).
    assert reserved <= 1.15 * weights + 200e6, (
        f"loading reserved {reserved / 1e6:.0f} MB more address space for {weights / 1e6:.0f} MB"
    )


def test_a_random_shape_is_written_outside_the_measuring_process(tmp_path, monkeypatch):
    """`minisgl bench --shape` writes its random model in a child process: written in the bench's own
    process, the writer's float32 model (about 250 MB for this shape) stayed in the RSS and the peak
    the memory scenario measures the engine by, which then read over the bound on the first run.
    Measured in a fresh process: its high-water mark grows by far less than the model. A second
    call finds the model and starts no child; a shape the writer does not know is a clear error."""
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from minisgl_backend.tools.tiny import cached_random_llama
        def peak():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        before = peak()
        out = cached_random_llama("smol2", Path({str(tmp_path)!r}))
        print(peak() - before, out)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    grown, out = proc.stdout.split()
    assert int(grown) < 150e6, f"writing the model grew the caller's peak by {int(grown) / 1e6:.0f} MB"
    assert out == str(tmp_path / "random-smol2")
    assert (tmp_path / "random-smol2" / "model.safetensors").stat().st_size > 100e6

    from minisgl_backend.errors import MiniSGLError
    from minisgl_backend.tools import tiny

    def no_child(*args, **kwargs):
        raise AssertionError("the model is written already")

    monkeypatch.setattr(tiny.subprocess, "run", no_child)
    assert tiny.cached_random_llama("smol2", tmp_path) == tmp_path / "random-smol2"
    monkeypatch.undo()
    with pytest.raises(MiniSGLError, match="random-weight no-such-shape model"):
        tiny.cached_random_llama("no-such-shape", tmp_path)
