"""RoPE variants (llama3, linear, dynamic, yarn, longrope, partial rotary), sliding-window attention
and the Gemma 2, Gemma 3 (text) and Phi-3 architectures against Hugging Face transformers.

Each case is a tiny random-weight model (>= 2 layers, GQA) with its feature switched on and saved
with save_pretrained, loaded through the engine's loader; the contexts (28- and 50-token prompts plus
8 generated tokens) run past the sliding window (8) and the RoPE's original length (16). fp32
prompt logprobs (a whole-prompt prefill and a chunked one) and decode logprobs, with their top-5,
must be within 1e-4 of transformers, and greedy tokens identical. The deterministic mode is checked
bitwise across chunk sizes and batch compositions on Gemma 2, Gemma 3 and Phi-3 (longrope).

`dynamic` and `longrope` depend on the sequence length in transformers; the engine rotates position
p as transformers does when it runs the sequence token by token with a cache (`model/rope.py`), so
those two are compared with that incremental run.
"""

from __future__ import annotations

import pytest
import torch

from minisgl_backend import Engine, EngineConfig, SamplingParams
from tests.helpers import QUIET, hf_tiny_config

WINDOW, ORIG, TOP, NEW = 8, 16, 5, 8
PROMPTS = [[(7 * i + 3) % 40000 + 100 for i in range(28)], [(11 * i + 5) % 40000 + 100 for i in range(50)]]
CHUNK = 32  # prompt 0 is one whole-prompt chunk, prompt 1 two chunks (the second reads a cached prefix)
_COMMON = hf_tiny_config(max_position_embeddings=128)


def _cases():
    import transformers as t

    half = [1.0 + 0.1 * i for i in range(4)]  # longrope factors for a rotary dim of 8 (partial 0.5 of 16)
    return {
        "llama3": (
            t.LlamaConfig,
            t.LlamaForCausalLM,
            dict(
                rope_parameters=dict(
                    rope_type="llama3",
                    rope_theta=10000.0,
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=ORIG,
                )
            ),
        ),
        "linear": (
            t.LlamaConfig,
            t.LlamaForCausalLM,
            dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)),
        ),
        "dynamic": (
            t.LlamaConfig,
            t.LlamaForCausalLM,
            dict(
                max_position_embeddings=ORIG,
                rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0),
            ),
        ),
        "yarn": (
            t.Qwen2Config,
            t.Qwen2ForCausalLM,
            dict(
                max_position_embeddings=4 * ORIG,
                rope_parameters=dict(
                    rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=ORIG
                ),
            ),
        ),
        "mistral_window": (t.MistralConfig, t.MistralForCausalLM, dict(sliding_window=WINDOW)),
        # Qwen2: layers from max_window_layers on slide (here layer 1 of 2), the others attend fully.
        "qwen2_window": (
            t.Qwen2Config,
            t.Qwen2ForCausalLM,
            dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        ),
        "phi3_longrope": (
            t.Phi3Config,
            t.Phi3ForCausalLM,
            dict(
                original_max_position_embeddings=ORIG,
                sliding_window=WINDOW,
                pad_token_id=0,
                rope_parameters=dict(
                    rope_type="longrope",
                    rope_theta=10000.0,
                    partial_rotary_factor=0.5,
                    short_factor=half,
                    long_factor=[2 * f for f in half],
                ),
            ),
        ),
        "gemma2": (
            t.Gemma2Config,
            t.Gemma2ForCausalLM,
            dict(
                head_dim=16,
                sliding_window=WINDOW,
                query_pre_attn_scalar=24,
                attn_logit_softcapping=3.0,
                final_logit_softcapping=8.0,
                tie_word_embeddings=True,
            ),
        ),
        "gemma3": (
            t.Gemma3TextConfig,
            t.Gemma3ForCausalLM,
            dict(
                num_hidden_layers=6,
                head_dim=16,
                sliding_window=WINDOW,
                query_pre_attn_scalar=24,
                tie_word_embeddings=True,
                rope_parameters={
                    "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                    "full_attention": dict(rope_type="linear", rope_theta=1e6, factor=8.0),
                },
            ),
        ),
    }


INCREMENTAL = {"dynamic", "phi3_longrope"}  # compared with transformers run token by token
_built: dict[str, tuple] = {}


def _build(case: str, root, tokenizer_dir):
    """(HF model, saved directory) for a case, built once per session."""
    if case not in _built:
        from transformers import AutoTokenizer

        cfg_cls, model_cls, extra = _cases()[case]
        out = root / case
        torch.manual_seed(0)
        cfg = cfg_cls(**{**_COMMON, **extra})
        cfg._attn_implementation = "eager"  # soft-capping and sliding windows: the plain reference
        model = model_cls(cfg).eval()
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
        _built[case] = (model, out)
    return _built[case]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("rope-models")


def _reference(hf, ids: list[int], incremental: bool) -> torch.Tensor:
    """log-softmax [len(ids), vocab] of transformers' fp32 next-token logits at every position."""
    from transformers import DynamicCache

    with torch.inference_mode():
        if not incremental:
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        cache, rows = DynamicCache(config=hf.config), []
        for i, tok in enumerate(ids):
            out = hf(torch.tensor([[tok]]), position_ids=torch.tensor([[i]]), cache=cache, use_cache=True)
            rows.append(out.logits[0, -1].float())
        return torch.log_softmax(torch.stack(rows), -1)


def _worst(out, ref: torch.Tensor) -> float:
    """max |logprob - reference| over prompt tokens, generated tokens and their top-5 alternatives."""
    n, worst = len(out.prompt_token_ids), 0.0
    entries = [(i - 1, lp) for i, lp in enumerate(out.prompt_logprobs) if lp] + [
        (n - 1 + k, lp) for k, lp in enumerate(out.logprobs)
    ]
    for row, lp in entries:
        worst = max(worst, abs(lp.logprob - ref[row, lp.token_id].item()))
        top = torch.tensor([v for _, v in lp.top])
        worst = max(worst, (top - ref[row].topk(len(top)).values).abs().max().item())
    return worst


def _generate(model_dir, **config) -> list:
    params = SamplingParams(temperature=0, max_tokens=NEW, logprobs=TOP, prompt_logprobs=TOP)
    cfg = EngineConfig(
        model=str(model_dir),
        chunk_size=CHUNK,
        block_size=4,
        num_blocks=64,
        num_threads=1,
        stats_interval_s=0,
        **config,
    )
    with Engine(cfg) as eng:
        return eng.generate(PROMPTS, params, use_tqdm=False)


def _check_against_hf(case: str, hf, outs) -> float:
    worst = 0.0
    for prompt, out in zip(PROMPTS, outs):
        ref = _reference(hf, prompt + out.token_ids, case in INCREMENTAL)
        # Greedy: every generated token is transformers' argmax after the same prefix.
        assert out.token_ids == ref[len(prompt) - 1 : -1].argmax(-1).tolist(), case
        worst = max(worst, _worst(out, ref))
    assert worst < 1e-4, f"{case}: max |logprob - HF| = {worst:.2e}"
    return worst


@pytest.mark.parametrize("case", list(_cases()))
def test_engine_matches_hf(case, root, smollm_dir):
    hf, model_dir = _build(case, root, smollm_dir)
    outs = _generate(model_dir)
    worst = _check_against_hf(case, hf, outs)
    print(f"{case}: max |logprob - HF| = {worst:.2e}")
    if case not in INCREMENTAL:  # transformers' own generate() too (it re-runs the prompt per request)
        with torch.inference_mode():
            greedy = hf.generate(
                torch.tensor([PROMPTS[1]]), max_new_tokens=NEW, do_sample=False, pad_token_id=0
            )
        assert outs[1].token_ids == greedy[0, len(PROMPTS[1]) :].tolist()


def _bits(out) -> tuple:
    lps = list(out.prompt_logprobs[1:]) + list(out.logprobs)
    return tuple(out.token_ids), tuple((lp.token_id, lp.logprob, tuple(lp.top)) for lp in lps)


@pytest.mark.parametrize("case", ["gemma2", "gemma3", "phi3_longrope"])
def test_deterministic_mode_is_bitwise_invariant(case, root, smollm_dir):
    """Same bits with chunk 32 and both prompts batched, and with chunk 5, one sequence at a time;
    decode logprobs equal, bit for bit, the prompt logprobs of a fresh prefill of the same tokens."""
    hf, model_dir = _build(case, root, smollm_dir)
    batched = _generate(model_dir, deterministic=True, prefix_cache="off")
    _check_against_hf(case, hf, batched)
    params = SamplingParams(temperature=0, max_tokens=NEW, logprobs=TOP, prompt_logprobs=TOP)
    one_by_one = dict(chunk_size=5, block_size=4, num_blocks=64, max_num_seqs=1)
    cfg = EngineConfig(model=str(model_dir), **one_by_one, **QUIET, deterministic=True, prefix_cache="off")
    with Engine(cfg) as eng:
        alone = eng.generate(PROMPTS, params, use_tqdm=False)
        full = [p + o.token_ids for p, o in zip(PROMPTS, alone)]
        rescored = eng.generate(
            full, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOP), use_tqdm=False
        )
    assert [_bits(o) for o in batched] == [_bits(o) for o in alone]
    for prompt, out, again in zip(PROMPTS, alone, rescored):
        decode = [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in out.logprobs]
        prefill = [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in again.prompt_logprobs[len(prompt) :]]
        assert decode == prefill


def test_spec_reads_windows_and_ropes(root, smollm_dir):
    """Gemma 3's 5:1 layer pattern and per-layer-type RoPE, Phi-3's partial rotary, Mistral's window."""
    from transformers import AutoConfig

    from minisgl_backend.model.spec import ModelSpec

    g3 = ModelSpec.from_hf_config(AutoConfig.from_pretrained(_build("gemma3", root, smollm_dir)[1]))
    assert [g3.window(i) for i in range(6)] == [WINDOW] * 5 + [None]
    assert [g3.rope_index(i) for i in range(6)] == [1] * 5 + [0]
    assert (g3.rope.rope_type, g3.rope.theta, g3.local_rope.theta) == ("linear", 1e6, 10000.0)
    phi = ModelSpec.from_hf_config(AutoConfig.from_pretrained(_build("phi3_longrope", root, smollm_dir)[1]))
    assert (phi.rope.rope_type, phi.rope.rotary_dim, phi.window(0)) == ("longrope", 8, WINDOW)


def test_rope_frequencies_equal_transformers():
    """Base inverse frequencies and the cos/sin factor of every variant equal transformers' own
    ROPE_INIT_FUNCTIONS, including yarn with mscale and longrope's long factors."""
    import transformers as t
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from minisgl_backend.model.rope import Rotary
    from minisgl_backend.model.spec import _rope_specs

    variants = [
        dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=8.0,
            original_max_position_embeddings=64,
            mscale=0.707,
            mscale_all_dim=1.0,
            beta_fast=16,
            beta_slow=2,
        ),
        dict(
            rope_type="yarn",
            rope_theta=500000.0,
            factor=4.0,
            original_max_position_embeddings=64,
            truncate=False,
        ),
        dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        dict(rope_type="linear", rope_theta=10000.0, factor=2.0, partial_rotary_factor=0.5),
        dict(
            rope_type="longrope",
            rope_theta=10000.0,
            original_max_position_embeddings=64,
            short_factor=[1.0 + i / 8 for i in range(16)],
            long_factor=[2.0 + i / 4 for i in range(16)],
        ),
    ]
    for params in variants:
        cfg = t.LlamaConfig(
            hidden_size=256, num_attention_heads=8, max_position_embeddings=256, rope_parameters=dict(params)
        )
        spec, _ = _rope_specs(cfg, 32)
        rot = Rotary(spec)
        ref, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
        assert torch.allclose(rot.inv_freq, ref, rtol=1e-6, atol=0), params
        assert rot.scale == pytest.approx(scale, rel=1e-12), params
        if params["rope_type"] == "longrope":
            long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=65)
            assert torch.allclose(rot.long_inv_freq, long, rtol=1e-6, atol=0)
            f = rot.inv_freq_at(torch.tensor([62, 63, 64, 65]))
            assert torch.equal(f[:2], rot.inv_freq.expand(2, -1))  # positions 62, 63: short factors
            assert torch.equal(f[2:], rot.long_inv_freq.expand(2, -1))  # 64, 65: past the original 64


def test_unknown_rope_type_and_model_type_are_clear_errors():
    import transformers as t

    from minisgl_backend.model.rope import ROPE_TYPES
    from minisgl_backend.model.spec import SUPPORTED_MODEL_TYPES, ModelSpec

    cfg = t.LlamaConfig(
        hidden_size=64, num_attention_heads=4, rope_parameters=dict(rope_type="proportional", rope_theta=1e4)
    )
    with pytest.raises(Exception, match="rope_type 'proportional'.*" + ", ".join(ROPE_TYPES)):
        ModelSpec.from_hf_config(cfg)
    cfg = t.GPT2Config()
    with pytest.raises(Exception, match="model_type 'gpt2'.*" + ", ".join(SUPPORTED_MODEL_TYPES)):
        ModelSpec.from_hf_config(cfg)


# The RoPE / window / capping fields of real checkpoints' config.json (legacy `rope_scaling` spelling,
# as on the Hub), with small hidden sizes: the spec must read them as transformers does.
_REAL = {
    "Llama-3.2-1B": dict(
        model_type="llama",
        hidden_size=2048,
        num_attention_heads=32,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "Qwen2.5-7B-yarn": dict(
        model_type="qwen2",
        hidden_size=512,
        num_attention_heads=4,
        rope_theta=1e6,
        max_position_embeddings=32768,
        sliding_window=131072,
        use_sliding_window=False,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32768),
    ),
    "Phi-4-mini": dict(
        model_type="phi3",
        hidden_size=3072,
        num_attention_heads=24,
        partial_rotary_factor=0.75,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        sliding_window=262144,
        rope_scaling=dict(
            type="longrope",
            short_factor=[1.0 + i / 48 for i in range(48)],
            long_factor=[1.0 + i for i in range(48)],
        ),
    ),
    "gemma-2-2b": dict(
        model_type="gemma2",
        hidden_size=2304,
        num_attention_heads=8,
        head_dim=256,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        max_position_embeddings=8192,
    ),
    "gemma-3-4b": dict(
        model_type="gemma3_text",
        hidden_size=2560,
        num_attention_heads=8,
        head_dim=256,
        num_hidden_layers=12,
        rope_local_base_freq=10000.0,
        rope_theta=1e6,
        sliding_window=1024,
        rope_scaling=dict(rope_type="linear", factor=8.0),
        max_position_embeddings=131072,
    ),
}
_EXPECT = {  # rope type, rotary dim, context limit, distinct windows, attention / final caps
    "Llama-3.2-1B": ("llama3", None, 131072, {None}, None, None),
    "Qwen2.5-7B-yarn": ("yarn", None, 131072, {None}, None, None),
    "Phi-4-mini": ("longrope", 96, 131072, {262144}, None, None),
    "gemma-2-2b": ("default", None, 8192, {4096, None}, 50.0, 30.0),
    "gemma-3-4b": ("linear", None, 131072, {1024, None}, None, None),
}


@pytest.mark.parametrize("name", list(_REAL))
def test_real_checkpoint_configs_match_transformers_rotary(name):
    """cos/sin of every layer's RoPE equal transformers' own rotary module bitwise, at positions on
    both sides of the original length (one position per call: transformers then sees length p + 1)."""
    import importlib

    from transformers import AutoConfig

    from minisgl_backend.model.llama import build_rotary
    from minisgl_backend.model.spec import ModelSpec

    cfg = AutoConfig.for_model(
        **{
            "vocab_size": 1000,
            "intermediate_size": 64,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            **_REAL[name],
        }
    )
    spec = ModelSpec.from_hf_config(cfg)
    windows = {spec.window(i) for i in range(spec.num_layers)}
    assert (
        spec.rope.rope_type,
        spec.rope.rotary_dim,
        spec.max_position_embeddings,
        windows,
        spec.attn_softcap,
        spec.final_softcap,
    ) == _EXPECT[name]
    family = {"gemma3_text": "gemma3"}.get(cfg.model_type, cfg.model_type)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    hf_rotary = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))(cfg)
    ours = build_rotary(spec)
    x = torch.zeros(1, 1, 8)
    for layer in range(spec.num_layers):
        per_type = family == "gemma3"
        for p in (0, 1, 1000, 4095, 4096, 8191, 8192, 40000):
            ref = hf_rotary(x, torch.tensor([[p]]), *([cfg.layer_types[layer]] if per_type else []))
            mine = ours[spec.rope_index(layer)](torch.tensor([p]), torch.float32)
            assert torch.equal(mine[0][0, 0], ref[0][0, 0]) and torch.equal(mine[1][0, 0], ref[1][0, 0]), (
                layer,
                p,
            )
