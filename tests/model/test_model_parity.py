"""fp32 parity with Hugging Face transformers on the embedded SmolLM2 weights, and paged attention
with scattered block tables against a contiguous reference."""

from __future__ import annotations

import pytest
import torch

from minisgl_backend import Engine, EngineConfig, SamplingParams
from minisgl_backend.model import cpu_kernels
from tests.helpers import model_spec

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Q: What is 12 times 7?\nA:",
    "The three primary colors are",
    "In machine learning, overfitting means",
    "List three fruits that are red:\n1.",
    "Translate to French: Good morning, how are you?\nFrench:",
    "The mitochondria is the powerhouse of the cell. " * 6 + "Explain why:",
    "import numpy as np\n\nx = np.arange(10)\nprint(",
]
TOP = 20


@pytest.fixture(scope="module")
def hf_model(smollm_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine():
    with Engine(EngineConfig(dtype="float32", chunk_size=64)) as eng:
        yield eng
        assert eng.drain(timeout=60, flush_cache=True)["FREE"] == eng.num_blocks


def _hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [16, 64, None], ids=["chunk16", "chunk64", "whole"])
def test_prompt_logprobs_match_hf_under_every_chunk_size(hf_model, engine, chunk_size):
    with Engine(engine.config.replace(chunk_size=chunk_size, mixed_batches=chunk_size is not None)) as eng:
        worst = _worst_prompt_logprob_error(hf_model, eng)
    print(f"chunk_size={chunk_size}: max |logprob - HF| over prompt tokens and top-{TOP} = {worst:.2e}")
    assert worst < 1e-3


# The kernel families this machine runs beside the process's own (which the tests above use): the
# float32 forward runs the native row-wise ops and attention, or torch's, by family.
OTHER_FAMILIES = [f for f in cpu_kernels.FAMILIES if cpu_kernels.runs_family(f) and f != cpu_kernels.family()]


@pytest.mark.slow
@pytest.mark.parametrize("family", OTHER_FAMILIES or [pytest.param(None, marks=pytest.mark.skip("none"))])
def test_prompt_logprobs_match_hf_under_every_kernel_family(hf_model, engine, family):
    with cpu_kernels.family_override(family), Engine(engine.config) as eng:
        worst = _worst_prompt_logprob_error(hf_model, eng)
    print(f"{family}: max |logprob - HF| over prompt tokens and top-{TOP} = {worst:.2e}")
    assert worst < 1e-3


def _worst_prompt_logprob_error(hf_model, eng: Engine) -> float:
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[8]]  # 5 to 70 tokens: one chunk to several
    outs = eng.generate(
        prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOP), use_tqdm=False
    )
    worst = 0.0
    for out in outs:
        ids = out.prompt_token_ids
        ref = _hf_logprobs(hf_model, ids)
        for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
            worst = max(worst, abs(lp.logprob - ref[i - 1, ids[i]].item()))
            ref_top = ref[i - 1].topk(TOP)
            mine = torch.tensor([v for _, v in lp.top])
            worst = max(worst, (mine - ref_top.values).abs().max().item())
    return worst


@pytest.mark.slow
def test_decode_logprobs_match_hf(hf_model, engine):
    out = engine.generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=16, logprobs=TOP), use_tqdm=False
    )[0]
    ids = out.prompt_token_ids + out.token_ids
    ref = _hf_logprobs(hf_model, ids)
    n = len(out.prompt_token_ids)
    worst = max(
        (torch.tensor([v for _, v in lp.top]) - ref[n - 1 + k].topk(TOP).values).abs().max().item()
        for k, lp in enumerate(out.logprobs)
    )
    print(f"decode: max |logprob - HF| over top-{TOP} = {worst:.2e}")
    assert worst < 1e-3


@pytest.mark.slow
def test_greedy_generations_equal_hf_generate(hf_model, engine):
    # Both stop at EOS (kept as the last token); HF's min_new_tokens would mask EOS, so it is not used.
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert sum(len(o.token_ids) for o in outs) > 200
    for prompt, out in zip(PROMPTS, outs):
        with torch.inference_mode():
            ref = hf_model.generate(
                torch.tensor([out.prompt_token_ids]), max_new_tokens=32, do_sample=False, pad_token_id=2
            )
        assert out.token_ids == ref[0, len(out.prompt_token_ids) :].tolist(), prompt


def test_paged_attention_with_scattered_blocks_equals_contiguous():
    """Chunked prefill and decode read K/V through a shuffled block table; the outputs equal one
    contiguous causal pass over the whole sequence (which touches no cache)."""
    from minisgl_backend.iteration import PrefillChunk
    from minisgl_backend.kvcache.storage import KVCache
    from minisgl_backend.model.batch import ForwardBatch, chunk_mask
    from minisgl_backend.model.layers import Attention

    torch.manual_seed(0)
    spec = model_spec()
    attn = Attention(spec, 0).eval()
    bs, n = 4, 19
    x = torch.randn(n, spec.hidden_size)
    from minisgl_backend.model.rope import RopeSpec, Rotary

    rotary = Rotary(RopeSpec(spec.head_dim, spec.rope_theta))

    def run(kv, rows, num_decode, lo, hi, table, dec_mask=None):
        pos = torch.arange(lo, hi)
        slots = table[pos // bs] * bs + pos % bs
        fb = ForwardBatch(
            pos,
            pos,
            slots,
            num_decode,
            table[None] if num_decode else None,
            dec_mask,
            rows,
            torch.arange(hi - lo),
        )
        with torch.inference_mode():
            return attn(x[lo:hi], rotary(pos, x.dtype), fb, kv, [chunk_mask(r) for r in rows])

    contiguous = torch.arange(5)
    ref = run(
        KVCache(1, 5, bs, 2, 8, torch.float32, "cpu"),
        (PrefillChunk(0, n, n, contiguous),),
        0,
        0,
        n,
        contiguous,
    )
    kv = KVCache(1, 16, bs, 2, 8, torch.float32, "cpu")
    table = torch.randperm(16)[:5]
    first = run(kv, (PrefillChunk(0, 10, 10, table[:3]),), 0, 0, 10, table)
    second = run(kv, (PrefillChunk(0, 8, 18, table),), 0, 10, 18, table)
    dec_mask = (torch.arange(5 * bs) < n)[None, None, None, :]
    last = run(kv, (), 1, 18, 19, table, dec_mask)
    paged = torch.cat([first, second, last])
    assert (paged - ref).abs().max().item() < 1e-5
