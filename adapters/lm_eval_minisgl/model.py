"""The lm-eval model `minisgl`: every request of a call goes to the engine at once.

Tokenisation, windows and stop handling follow lm-eval's `hf` backend step by step (TemplateLM's
context/continuation split, `get_rolling_token_windows`, `normalize_gen_kwargs`, the same left
truncation), so both backends score exactly the same token sequences; the engine's continuous
batching then replaces hf's padded fixed-size batches.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, cast

from lm_eval_minisgl import missing_extra

try:
    import jinja2
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import (
        handle_stop_sequences,
        has_bos_prefix,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ModuleNotFoundError as e:  # the lm-eval extra is not installed
    raise missing_extra(e) from e

from lm_eval_minisgl.replicas import make_engine
from lm_eval_minisgl.seeds import RequestSeeds
from minisgl_backend import (
    ConfigError,
    Engine,
    EngineConfig,
    InvalidSamplingParamsError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from minisgl_backend.cluster import ReplicaSet
from minisgl_backend.config import load_preset
from minisgl_backend.types import surface_fields

log = logging.getLogger("lm_eval_minisgl")


def _span_logprobs(out: RequestOutput, n: int) -> list[TokenLogprob]:
    """The logprobs of the last `n` prompt tokens, which the request asked for (prompt_logprobs_start)."""
    span = (out.prompt_logprobs or [])[-n:]
    if len(span) != n or any(lp is None for lp in span):
        raise RuntimeError(f"the engine returned no logprobs for the scored span of {n} tokens")
    return [lp for lp in span if lp is not None]


# model_args the adapter consumes itself; every other key must be an EngineConfig field.
ADAPTER_ARGS = {
    "pretrained": "model reference: alias, Hugging Face directory or .gguf file (engine `model`)",
    "config": "engine preset: YAML path or bare name under configs/engine/; other engine keys override it",
    "max_length": "context window used for truncation and rolling windows (default: engine max_model_len)",
    "max_gen_toks": "default generation budget when a task sets none (default 256, like hf)",
    "add_bos_token": "force adding (or not) the tokenizer's BOS token; default: the tokenizer's own setting",
    "prefix_token_id": "token conditioning an empty context (default: BOS, else EOS, like hf)",
    "batch_size": "accepted for CLI compatibility and ignored: the engine batches continuously",
    "max_batch_size": "the engine's max_num_seqs (requests running at once) unless that is set too",
    "device": "engine device; lm-eval's default 'cuda:0' falls back to cpu when CUDA is absent",
    "trust_remote_code": "accepted for CLI compatibility and ignored (no remote code is run)",
    "data_parallel_size": "N > 1: N engine replicas on Ray (each with cores // N threads), requests routed "
    "by shared prefix (default 1: one in-process engine; needs minisgl[ray])",
    "ray_address": "with data_parallel_size > 1: join this Ray cluster (default: start a local one)",
    "replica_timeout_s": "with data_parallel_size > 1: a replica silent this long is declared hung "
    "(ReplicaFailedError; default 120)",
    "think_end_token": "end of a reasoning trace (a string, or a token id): a generation is scored from "
    "after its last occurrence, and task stops apply only there (as lm-eval's vllm / hf backends)",
    "enable_thinking": "passed to the chat template (Qwen3's switch); true needs think_end_token and "
    "refuses loglikelihood tasks",
    "chat_template_args": "extra keyword arguments of the chat template (a dict, or its JSON)",
}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16"}
_DEFAULT_SEED = 1234  # lm-eval's own default seed: sampled generations replay run to run
# The KV block size on the CPU unless the user sets one. A loglikelihood task's requests share their
# context (the few-shot examples and the question) and differ in the continuation; the prefix cache
# reuses whole blocks, so each request computes the context's last partial block again, and a
# smaller block leaves less of it. The CPU's decode and prefill kernels run as fast on either size.
_EVAL_BLOCK_SIZE = 8
_GEN_KWARGS_CAST = {
    "temperature": "temperature",
    "max_gen_toks": "max_tokens",
    "max_new_tokens": "max_tokens",
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
}
# lm-eval's own spellings of SamplingParams fields: `do_sample` with `temperature`, `until` (stop) and
# the max_gen_toks aliases above (max_tokens). Every other sampling field lm-eval is offered is
# passed through under its own name, as given (vLLM's / OpenAI's names, like lm-eval's vllm backend;
# HF's repetition_penalty has the same meaning); None is the engine's default.
_GEN_KWARGS_OWN = ("temperature", "stop", "max_tokens")


def passthrough_gen_kwargs(params_cls: type[SamplingParams] = SamplingParams) -> tuple[str, ...]:
    """The gen_kwargs that go to `params_cls` under their own names."""
    return tuple(k for k in surface_fields("lm_eval", params_cls) if k not in _GEN_KWARGS_OWN)


def accepted_gen_kwargs(params_cls: type[SamplingParams] = SamplingParams) -> set[str]:
    """Every gen_kwargs key the adapter understands; any other fails the call."""
    return {"until", "do_sample", *_GEN_KWARGS_CAST, *passthrough_gen_kwargs(params_cls)}


def sampling_params_from_gen_kwargs(
    gen_kwargs: dict[str, Any],
    eos: str,
    max_gen_toks: int,
    params_cls: type[SamplingParams] = SamplingParams,
) -> tuple[SamplingParams, list[str], int]:
    """A task's gen_kwargs as engine parameters, the task's stop strings and the token budget."""
    # lm-eval's normalisation casts with int()/float() (True -> 1, 2.5 -> 2, "hot" -> ValueError):
    # check the raw values it casts first, so a bad one is a typed error naming the field.
    for key, field in _GEN_KWARGS_CAST.items():
        if gen_kwargs.get(key) is not None:
            params_cls.check_value(field, gen_kwargs[key], f"{field} (gen_kwargs {key!r})")
    kwargs = normalize_gen_kwargs(dict(gen_kwargs), max_gen_toks)
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    unsupported = sorted(set(kwargs) - accepted_gen_kwargs(params_cls))
    if unsupported:  # dropping one would score the task differently from the backend it names
        raise InvalidSamplingParamsError(
            f"generation kwargs {unsupported} are not supported by minisgl; "
            f"supported: {', '.join(sorted(accepted_gen_kwargs(params_cls)))}"
        )
    # Values go to SamplingParams as given (no int()/float() casts that would turn True into 1,
    # 1.7 into 1 or 2**64 into an overflow on the engine): its validation names a bad field.
    temperature = kwargs.get("temperature", 0.0)
    greedy = not kwargs.get("do_sample") or (not isinstance(temperature, bool) and temperature == 0)
    params = params_cls(
        temperature=0.0 if greedy else temperature,
        max_tokens=kwargs["max_gen_toks"],
        stop=tuple(s for s in until if s),
        **{k: kwargs[k] for k in passthrough_gen_kwargs(params_cls) if kwargs.get(k) is not None},
    )
    return params, until, params.max_tokens


def _resolve_device(device: str | None) -> str | None:
    if device is None:
        return None
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            log.info("device %r requested but CUDA is not available: using cpu", device)
            return "cpu"
    return device


def build_engine_config(model_args: dict[str, Any]) -> EngineConfig:
    """Map the engine part of model_args (plus `pretrained`/`config`) to an EngineConfig.

    `config` names the preset (a path, or a bare name under configs/engine/) and the other engine
    keys override it: EngineConfig.resolve does the layering, as for the CLI and LangChain.

    Keys are checked against EngineConfig.field_names() at run time, so engine knobs added later
    (overlap, max_inflight, deterministic, ...) work here without an adapter change.
    """
    args = dict(model_args)
    engine_keys = EngineConfig.field_names()
    unknown = sorted(set(args) - set(engine_keys) - {"pretrained", "config"})
    if unknown:
        raise ConfigError(
            f"unknown model_args {unknown} for --model minisgl; valid keys: adapter "
            f"[{', '.join(sorted(ADAPTER_ARGS))}], engine [{', '.join(engine_keys)}]"
        )
    if "pretrained" in args:
        if "model" in args:
            raise ConfigError("give the model once: `pretrained=...` or `model=...`, not both")
        args["model"] = args.pop("pretrained")
    preset = args.pop("config", None)
    for key, value in list(args.items()):
        if isinstance(value, str) and value.lower() == "none":
            args[key] = None  # e.g. chunk_size=None (whole-prompt prefill)
    if isinstance(args.get("model"), (int, float)):
        args["model"] = str(args["model"])
    if args.get("dtype") == "auto":
        del args["dtype"]  # the preset's / engine's default
    elif isinstance(args.get("dtype"), str):
        args["dtype"] = _DTYPE_ALIASES.get(args["dtype"], args["dtype"])
    return EngineConfig.resolve(None if preset is None else str(preset), args)


class MiniSGLLM(TemplateLM):
    """`lm_eval --model minisgl --model_args pretrained=...,dtype=...,chunk_size=...`"""

    engine: Engine | ReplicaSet  # a ReplicaSet with data_parallel_size > 1: the same interface

    def __init__(
        self,
        pretrained: str | None = None,
        config: str | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        device: str | None = None,
        trust_remote_code: bool | None = None,
        engine: Engine | None = None,
        data_parallel_size: int = 1,
        ray_address: str | None = None,
        replica_timeout_s: float | None = None,
        think_end_token: str | int | None = None,
        enable_thinking: bool | None = None,
        chat_template_args: dict[str, Any] | str | None = None,
        **engine_args: Any,
    ) -> None:
        super().__init__()
        # Checked before an engine starts: a bad value fails at once.
        template_args = _chat_template_args(chat_template_args, enable_thinking)
        think = _think_end_token(think_end_token)
        if template_args.get("enable_thinking") is True and think is None:
            raise ConfigError(
                "enable_thinking=True needs think_end_token (e.g. think_end_token=</think>): without it "
                "the reasoning trace would be scored as part of the answer"
            )
        del batch_size, trust_remote_code  # accepted for CLI compatibility only
        if engine is None:
            args = dict(engine_args)
            if max_batch_size is not None and "max_num_seqs" not in args:
                args["max_num_seqs"] = max_batch_size
            if pretrained is not None:
                args["pretrained"] = pretrained
            if config is not None:
                args["config"] = config
            if "device" not in engine_args and (dev := _resolve_device(device)) is not None:
                args["device"] = dev
            preset = load_preset(config) if config is not None else {}
            on_cpu = str(args.get("device", preset.get("device", "cpu"))).startswith("cpu")
            if "deterministic" not in args and "deterministic" not in preset and on_cpu:
                # Reproducible by default: a score must not depend on batch size, the prefix cache or
                # what else runs (bitwise logits); deterministic=false trades that for speed. On the
                # CPU only: the mode is proven there and refused on CUDA.
                args["deterministic"] = True
            if "block_size" not in args and "block_size" not in preset and on_cpu:
                args["block_size"] = _EVAL_BLOCK_SIZE
            if "stats_interval_s" not in args and "stats_interval_s" not in preset:
                args["stats_interval_s"] = 0  # a scoring run reports through lm-eval, not a 10 s log line
            cfg = build_engine_config(args)
            if "seed" not in engine_args and cfg.seed is None:
                cfg = cfg.replace(seed=_DEFAULT_SEED)
            self.engine = make_engine(cfg, data_parallel_size, ray_address, replica_timeout_s)
        elif data_parallel_size != 1:
            raise ConfigError(
                "data_parallel_size builds its own replicas: pass engine settings, not an Engine"
            )
        elif not isinstance(engine, Engine):
            raise ConfigError(f"engine must be a minisgl Engine instance, got {type(engine).__name__}")
        elif engine_args or pretrained is not None or config is not None:
            raise ConfigError("pass engine settings or an Engine instance, not both")
        else:
            self.engine = engine
        self.tokenizer = self.engine.tokenizer
        self.chat_template_args = template_args
        self.enable_thinking = template_args.get("enable_thinking")
        self.think_end_token = _as_token_id_if_special(think, self.tokenizer)
        if isinstance(self.think_end_token, int) and self.think_end_token >= len(self.tokenizer):
            raise ConfigError(
                f"think_end_token id {self.think_end_token} is not a token of the tokenizer "
                f"(ids [0, {len(self.tokenizer)}))"
            )
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self._max_gen_toks = int(max_gen_toks)
        self._max_length = int(max_length) if max_length else self.engine.max_model_len
        if self._max_length > self.engine.max_model_len:
            raise ConfigError(
                f"max_length={self._max_length} exceeds the engine's context limit "
                f"({self.engine.max_model_len}); "
                "raise max_model_len / the KV capacity or lower max_length"
            )
        self._warned_truncation = False
        # Unseeded requests get seeds from the run seed and their position in lm-eval's order, so
        # sampled generations do not depend on how the work is split (adapters/.../seeds.py).
        self._seeds = RequestSeeds(self.engine.config.seed)

    # ------------------------------------------------------------------ lm-eval plumbing
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def device(self) -> str:
        return self.engine.config.device

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        return {
            "model_dir": str(self.engine.model_dir),
            "engine_config": dataclasses.asdict(self.engine.config),
        }

    def close(self) -> None:
        self.engine.close()

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        # The same rule as hf: the tokenizer's default unless told, and never a second BOS.
        flag = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        special: dict[str, bool] = {} if flag is None else {"add_special_tokens": flag}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        return list(self.tokenizer.encode(string, **special))

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        def render(history: list[dict[str, str]]) -> str:
            return cast(  # tokenize=False: the rendered text
                str,
                self.tokenizer.apply_chat_template(
                    history,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=not add_generation_prompt,
                    **self.chat_template_args,
                ),
            )

        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            log.warning("chat template failed; retrying without the system message")
            return render([m for m in chat_history if m["role"] != "system"])

    def _warn_truncation(self, what: str, original: int, kept: int) -> None:
        if not self._warned_truncation:
            self._warned_truncation = True
            log.warning(
                "%s of %d tokens exceeds max_length=%d: left-truncated to its last %d tokens "
                "(warned once; later truncations are silent)",
                what,
                original,
                self.max_length,
                kept,
            )

    def _run(
        self, prompts: list[list[int]], params: list[SamplingParams], disable_tqdm: bool, desc: str
    ) -> list[RequestOutput]:
        # One call, all requests: the scheduler packs them into batches as KV space allows
        # (with data_parallel_size > 1, `engine` is a ReplicaSet splitting them over the replicas).
        params = self._seeds.assign(params)
        return self.engine.generate(prompts, params, use_tqdm=not disable_tqdm, desc=f"minisgl {desc}")

    # ------------------------------------------------------------------ loglikelihood
    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        if self.enable_thinking:  # as lm-eval's vllm / hf backends: a score needs no reasoning trace
            tasks = sorted({req.task_name for req in requests if req.task_name})
            raise ConfigError(
                "enable_thinking=True is not compatible with loglikelihood tasks; use it with generative "
                f"tasks only (triggered by task(s): {', '.join(tasks) or 'unnamed'})"
            )
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        desc: str = "loglikelihood",
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """Score each continuation in one prefill: the prompt is context + continuation, and the
        engine's prompt logprobs over the continuation give the sum and the greedy check."""
        # hf keeps the last max_length + 1 tokens (the model sees max_length of them); the engine
        # takes the whole sequence as its prompt, capped at its own limit.
        keep = min(self.max_length + 1, self.engine.max_model_len)
        unique: dict[tuple[int, ...], int] = {}  # identical sequences (e.g. repeated docs) are scored once
        spans: list[tuple[int, int]] = []  # (unique index, continuation length)
        for _, ctx, cont in requests:
            if not cont:
                raise ValueError("lm-eval sent an empty continuation")
            if len(cont) >= keep:
                raise ValueError(
                    f"a continuation of {len(cont)} tokens does not fit max_length={self.max_length}"
                )
            seq = ctx + cont
            if len(seq) > keep:
                self._warn_truncation("context + continuation", len(seq), keep)
                seq = seq[-keep:]
            spans.append((unique.setdefault((len(cont), *seq), len(unique)), len(cont)))
        keys = list(unique)
        prompts = [list(k[1:]) for k in keys]
        params = [
            SamplingParams(
                temperature=0.0, max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=len(p) - k[0]
            )
            for p, k in zip(prompts, keys)
        ]
        outs = self._run(prompts, params, disable_tqdm, desc)
        scores: list[tuple[float, bool]] = []
        for out, key in zip(outs, keys):
            lps = _span_logprobs(out, key[0])
            scores.append((float(sum(lp.logprob for lp in lps)), all(lp.rank == 1 for lp in lps)))
        results = [scores[i] for i, _ in spans]
        for (req_key, _, _), res in zip(requests, results):
            if req_key is not None:
                self.cache_hook.add_partial("loglikelihood", req_key, res)
        return results

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Perplexity: disjoint windows of at most max_length tokens (exactly hf's windows), all
        windows of all documents scored in one engine call, summed per document."""
        windows: list[tuple[tuple[str, str] | None, list[int], list[int]]] = []
        counts: list[int] = []
        for (text,) in (req.args for req in requests):
            doc = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            windows.extend((None, ctx, cont) for ctx, cont in doc)
            counts.append(len(doc))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm, desc="loglikelihood_rolling")
        totals: list[float] = []
        start = 0
        for req, n in zip(requests, counts):
            totals.append(sum(s for s, _ in scores[start : start + n]))
            start += n
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, totals[-1])
        return totals

    # ------------------------------------------------------------------ generation
    def _sampling_params(self, gen_kwargs: dict[str, Any], eos: str) -> tuple[SamplingParams, list[str], int]:
        return sampling_params_from_gen_kwargs(gen_kwargs, eos, self.max_gen_toks)

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        eos = cast(str, self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False))  # one id: a str
        prompts: list[list[int]] = []
        params: list[SamplingParams] = []
        stops: list[list[str]] = []
        for context, gen_kwargs in (req.args for req in requests):
            sp, until, max_gen = self._sampling_params(gen_kwargs, eos)
            if self.think_end_token is not None:
                # lm-eval's vllm rule: task stops (a few-shot "\n\n") often occur inside the
                # reasoning, so only EOS stops the engine; the stops cut the answer after it.
                sp = dataclasses.replace(sp, stop=tuple(s for s in until if s == eos))
            max_ctx = self.max_length - max_gen  # room for the whole budget, as hf reserves it
            if max_ctx <= 0:
                raise ValueError(
                    f"max_gen_toks={max_gen} leaves no room for a context in max_length={self.max_length}"
                )
            ids = self.tok_encode(context)
            if len(ids) > max_ctx:
                self._warn_truncation("a generation context", len(ids), max_ctx)
                ids = ids[-max_ctx:]
            prompts.append(ids)
            params.append(sp)
            stops.append(until)
        outs = self._run(prompts, params, disable_tqdm, "generate_until")
        results: list[str] = []
        for req, out, until in zip(requests, outs, stops):
            # The engine already cut at the first stop string; this applies hf's exact rule on top.
            text = self._answer(out, until)
            results.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return results

    def _answer(self, out: RequestOutput, until: list[str]) -> str:
        """The scored text: after the reasoning trace when think_end_token is set (a string: lm-eval's
        own split; a token id: after its last occurrence in the tokens, as the hf backend), then cut
        at the task's stops."""
        think = self.think_end_token
        if not isinstance(think, int):
            return postprocess_generated_text(out.text, until, think)
        text = out.text
        if think in out.token_ids:
            last = len(out.token_ids) - 1 - out.token_ids[::-1].index(think)
            text = cast(
                str, self.tokenizer.decode(out.token_ids[last + 1 :], skip_special_tokens=True)
            ).lstrip()
        return postprocess_generated_text(text, until, None)


def _chat_template_args(value: Any, enable_thinking: Any) -> dict[str, Any]:
    """chat_template_args (a dict, or its JSON as a key=value model_arg gives it) with enable_thinking
    set over it when given (the hf backend's rule)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"chat_template_args must be a dict or its JSON, got {value!r} ({e})") from None
    if value is None:
        value = {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"chat_template_args must be a dict of keyword arguments, got {value!r}")
    if enable_thinking is not None and not isinstance(enable_thinking, bool):
        raise ConfigError(f"enable_thinking must be true or false, got {enable_thinking!r}")
    if "enable_thinking" in value and not isinstance(value["enable_thinking"], bool):
        raise ConfigError(
            f"chat_template_args enable_thinking must be true or false, got {value['enable_thinking']!r}"
        )
    return {**value, **({} if enable_thinking is None else {"enable_thinking": enable_thinking})}


def _think_end_token(value: Any) -> str | int | None:
    """A non-empty string, or a token id (an int, or digits as the hf backend reads them)."""
    if value is None:
        return None
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ConfigError(f"think_end_token must be a non-empty string or a token id (int >= 0), got {value!r}")


def _as_token_id_if_special(think: str | int | None, tokenizer: Any) -> str | int | None:
    """A string marker that is one special token becomes its id: the engine decodes with
    skip_special_tokens, so the string would never appear in the text to split."""
    if not isinstance(think, str):
        return think
    ids = tokenizer.encode(think, add_special_tokens=False)
    if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) != think:
        return ids[0]
    return think
