"""Random-weight Llamas with the embedded model's tokenizer: a tiny one for fast tests and stress
runs, and models of realistic shape for speed measurements (speed does not depend on weight values);
and a tiny "scripted" Llama whose greedy output is a given token chain (`make_scripted_llama`).

Outputs are meaningless text, but every engine path (chunking, preemption, reclaim) runs exactly as
on a real model. `python -m minisgl_backend.tools.tiny --shape 1b OUT` writes a ~1.2B-parameter Llama for
scripts/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from minisgl_backend.errors import MiniSGLError
from minisgl_backend.model.loader import cache_root, resolve_model_dir

# Llama shapes by name. "tiny": 2 layers, hidden 64, large weights so that outputs depend on context
# and greedy choices are well separated. "1b": Llama-3.2-1B-like (≈1.2B parameters untied).
SHAPES: dict[str, dict] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.25,
    ),
    # SmolLM2-135M's widths with 2 of its 30 layers: its matmul shapes, so the default forward's
    # bits depend on the batch as the real model's do (the tiny shape's mostly do not), at ~1/10 the cost.
    "smol2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        initializer_range=0.02,
    ),
    # The peers' 1B shape (../shared/peers/make_1b.py): Llama-3.2-1B's layers, RoPE and tied LM head.
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        initializer_range=0.02,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        initializer_range=0.02,
    ),
    # Llama-3-8B's layers (with SmolLM2's vocabulary, as every shape here): ~7.4B parameters, 14.8 GB
    # in bf16; written tensor by tensor (STREAMED), since the model itself would not fit beside it.
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        initializer_range=0.02,
    ),
}
# Shapes written by write_streamed (one tensor in memory at a time) rather than through transformers'
# model, which would hold all of them in float32 first.
STREAMED = {"8b"}


def make_random_llama(
    out: Path, shape: str, seed: int = 0, dtype: str = "float32", tokenizer: str | Path | None = None
) -> Path:
    """Write (once) and return a Llama directory of `shape` with SmolLM2's tokenizer and vocabulary.
    `tokenizer`: a directory with those tokenizer files (default: from the embedded model)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    base = dict(
        vocab_size=49152, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5
    )
    cfg = LlamaConfig(**(base | SHAPES[shape]))
    torch.manual_seed(seed)
    if shape in STREAMED:
        cfg.dtype = dtype
        write_streamed(out, cfg, getattr(torch, dtype), seed)
    else:
        LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer or resolve_model_dir("smollm2-135m-instruct")).save_pretrained(
        out
    )
    return out


def cached_random_llama(shape: str, root: Path | None = None) -> Path:
    """The bf16 random-weight Llama of `shape` in the model cache (or under `root`), written once by a
    child process. The writer holds the model in memory (the whole of it, for the shapes it does not
    stream) and the allocator keeps much of that after it returns, so written here it would stay in
    this process's RSS and set its peak: the figures `minisgl bench --scenario memory` measures the
    engine by, which then read over the bound on the first run only."""
    out = Path(root if root is not None else cache_root()) / f"random-{shape}"
    if not (out / "config.json").is_file():
        cmd = [
            sys.executable,
            "-m",
            "minisgl_backend.tools.tiny",
            "--shape",
            shape,
            "--dtype",
            "bfloat16",
            str(out),
        ]
        code = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
        if code != 0 or not (out / "config.json").is_file():
            raise MiniSGLError(
                f"writing the random-weight {shape} model into {out} failed (exit status {code})"
            )
    return out


def llama_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes of a Hugging Face Llama checkpoint of `cfg`."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    out["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    return out


def write_streamed(out: Path, cfg, dtype: torch.dtype, seed: int) -> None:
    """A random Llama checkpoint written one tensor at a time (normal(0, initializer_range) weights,
    norms at 1): memory stays at one tensor whatever the model's size."""
    from minisgl_backend.model.checkpoint import write

    shapes = llama_tensors(cfg)
    g = torch.Generator().manual_seed(seed)

    def made() -> Iterator[torch.Tensor]:
        for shape in shapes.values():
            if len(shape) == 1:
                yield torch.ones(shape, dtype=dtype)
            else:
                yield (torch.randn(shape, generator=g) * cfg.initializer_range).to(dtype)

    out.mkdir(parents=True, exist_ok=True)
    write(out / "model.safetensors.tmp", {n: (s, dtype) for n, s in shapes.items()}, made())
    cfg.save_pretrained(out)
    (out / "model.safetensors.tmp").rename(out / "model.safetensors")


def make_tiny_llama(out: Path | None = None, seed: int = 0, tokenizer: str | Path | None = None) -> Path:
    """Write (once) and return the 2-layer, hidden-64 test Llama."""
    return make_random_llama(
        out if out is not None else cache_root() / f"tiny-llama-{seed}", "tiny", seed, tokenizer=tokenizer
    )


def make_scripted_llama(out: Path, tokenizer, next_token: dict[int, int]) -> Path:
    """Write a Llama whose greedy continuation of a token t is next_token[t]: a model that says a
    script, for tests that need a known output (e.g. a reasoning trace) from the real engine path.

    The next token depends on the current one only: every layer's attention and MLP outputs are zero
    (o_proj, down_proj), so the last hidden state is the current token's embedding; each scripted
    token's embedding is its own basis vector, and the LM head row of its successor reads that
    vector (logit 80 against 0 for every other token). At most hidden_size (64) scripted tokens;
    `tokenizer` (saved with the model, added tokens and chat template included) fixes the vocabulary.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SHAPES["tiny"]
    if len(next_token) > shape["hidden_size"]:
        raise ValueError(f"at most {shape['hidden_size']} scripted tokens, got {len(next_token)}")
    vocab = len(tokenizer)
    cfg = LlamaConfig(
        vocab_size=vocab,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        rms_norm_eps=1e-5,
        **shape,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        for k, (tok, nxt) in enumerate(next_token.items()):
            model.model.embed_tokens.weight[tok] = 0.0
            model.model.embed_tokens.weight[tok, k] = 1.0  # RMS-normed: 8 * e_k
            model.lm_head.weight[nxt, k] = 10.0
    out = Path(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m minisgl_backend.tools.tiny", description="write a random-weight Llama"
    )
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="stored weight dtype")
    p.add_argument(
        "--tokenizer", help="directory with SmolLM2's tokenizer files (default: the embedded model)"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(make_random_llama(args.out, args.shape, args.seed, args.dtype, args.tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
