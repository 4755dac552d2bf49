"""`minisgl` command line: generate text, run the benchmark, the stress harness and the determinism check."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml

from minisgl_backend.config import EngineConfig, load_preset
from minisgl_backend.errors import MiniSGLError
from minisgl_backend.types import SamplingParams, surface_fields


class _Parser(argparse.ArgumentParser):
    """argparse, with the way to reach any engine field named when a flag is unknown."""

    def error(self, message: str) -> Any:
        if message.startswith("unrecognized arguments"):
            message += (
                "\n  (an engine setting without a flag of its own is --set KEY=VALUE, repeatable; keys: "
                f"{', '.join(EngineConfig.field_names())})"
            )
        return super().error(message)


# vLLM's engine flags that are EngineConfig fields here: flag dest -> field.
_FIELD_FLAGS = {
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_logprobs": "max_logprobs",
    "engine_seed": "seed",
    "gpu_memory_utilization": "gpu_memory_utilization",
}


# `minisgl bench --scenario` values. `seed-table` is the old name of `overlap-table`: still accepted
# so existing scripts keep working, left out of the help and announced as deprecated when used.
SCENARIOS = ["overlap-table", "prefix", "peers", "memory", "sampling"]
_SCENARIO_ALIASES = {"seed-table": "overlap-table"}


def _scenario(value: str) -> str:
    """Maps a deprecated scenario name to its current one, with a warning on stderr."""
    new = _SCENARIO_ALIASES.get(value)
    if new is None:
        return value
    print(f"minisgl: --scenario {value} is deprecated; use --scenario {new}", file=sys.stderr)
    return new


# `minisgl generate`'s defaults where they differ from the engine's: greedy, and room for a sentence.
_GENERATE_DEFAULTS = {"temperature": 0.0, "max_tokens": 64}


def add_sampling_args(
    p: argparse.ArgumentParser, params_cls: type[SamplingParams] = SamplingParams
) -> argparse._ArgumentGroup:
    """A flag for each sampling field the CLI offers (`--top-p` for top_p), with its default, type
    and help from `params_cls`'s fields: a number takes a value, a bool is --x / --no-x, a list is
    repeated (`--stop A --stop B`)."""
    g = p.add_argument_group("sampling (SamplingParams's fields)")
    for name, f in surface_fields("cli", params_cls).items():
        flag = "--" + name.replace("_", "-")
        default = _GENERATE_DEFAULTS.get(name, f.default)
        help = f"{f.doc} Accepts {f.accepts}".replace("%", "%%")
        if f.wire is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help)
        elif f.wire in (int, float, str):
            metavar = {int: "N", float: "X", str: "TEXT"}[f.wire]
            g.add_argument(flag, type=f.wire, default=default, metavar=metavar, help=help)
        elif get_origin(f.wire) is list:
            (item,) = get_args(f.wire)
            metavar = {int: "ID", str: "TEXT"}.get(item, "VALUE")
            g.add_argument(
                flag, type=item, action="append", default=[], metavar=metavar, help=help + "; repeatable"
            )
        else:
            raise TypeError(f"sampling field {name}: no flag form for {f.wire!r} (narrow its surfaces)")
    return g


def sampling_params_from_args(
    args: argparse.Namespace, params_cls: type[SamplingParams] = SamplingParams
) -> SamplingParams:
    """The SamplingParams the sampling flags describe (SamplingParams checks the values)."""
    given: dict[str, Any] = {}
    for k in surface_fields("cli", params_cls):
        v = getattr(args, k)
        given[k] = tuple(v) if isinstance(v, list) else v
    return params_cls(**given)


def _engine_args(p: argparse.ArgumentParser, seed: bool = False) -> None:
    """The engine flags of every command; `seed`: also `--seed` for the engine's seed (commands whose
    own --seed means something else leave it out)."""
    g = p.add_argument_group("engine (vLLM's names where it has the setting; any field: --set)")
    g.add_argument(
        "--config",
        help="engine preset: a YAML path or a name under configs/engine/ (e.g. serial, fast-bf16; an "
        "installed package carries them too)",
    )
    g.add_argument("--model", help="alias, Hugging Face directory or .gguf path")
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "float", "bfloat16"],
        help="weights and activations (float = float32; auto = the preset's, else float32)",
    )
    g.add_argument("--max-model-len", type=int, metavar="N", help="context limit (= max_model_len)")
    g.add_argument("--max-num-seqs", type=int, metavar="N", help="sequences per batch (= max_num_seqs)")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        metavar="N",
        help="tokens per iteration (= max_num_batched_tokens)",
    )
    g.add_argument("--max-logprobs", type=int, metavar="N", help="= max_logprobs")
    if seed:
        g.add_argument(
            "--seed",
            type=int,
            dest="engine_seed",
            help="seeds the requests that bring no seed, reproducibly (= seed; default: fresh seeds)",
        )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="prefix cache on (the default: prefix_cache async unless --set prefix_cache=sync) or off",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        metavar="N",
        help="1 only: minisgl runs a model on one device (more engines: serve --replicas N)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="F",
        help="CUDA: the share of device memory this engine may hold; the KV pool gets what the weights "
        "leave of it (gpu_memory_utilization; kv_cache_memory_gb or num_blocks, when set, win)",
    )
    g.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="only the engine's warnings and errors on stderr (no stats line, no progress bar)",
    )
    g.add_argument(
        "--chunk-size",
        type=lambda s: None if s.lower() == "none" else int(s),
        default=argparse.SUPPRESS,
        help="prefill chunk size, or 'none' for whole-prompt prefill",
    )
    g.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any EngineConfig field (repeatable), value parsed as YAML: --set num_blocks=512",
    )


def _engine_config(args: argparse.Namespace, base: dict[str, Any] | None = None) -> EngineConfig:
    """EngineConfig from --config, then `base` (a command's own defaults), then flags and --set."""
    return EngineConfig.resolve(args.config or None, _flag_overrides(args), defaults=base)


def _flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The engine fields given by flags and --set (not --config)."""
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise MiniSGLError(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key.strip()] = yaml.safe_load(value)
    _check_unsupported(args)
    model_tag = getattr(args, "model_tag", None)
    if model_tag is not None and args.model is not None and model_tag != args.model:
        raise MiniSGLError(f"two models given: {model_tag!r} (positional) and --model {args.model!r}")
    if (model := model_tag or args.model) is not None:
        overrides["model"] = model
    if args.dtype not in (None, "auto"):
        overrides["dtype"] = "float32" if args.dtype == "float" else args.dtype
    for dest, key in _FIELD_FLAGS.items():
        if getattr(args, dest, None) is not None:
            overrides[key] = getattr(args, dest)
    if args.enable_prefix_caching is False:
        overrides["prefix_cache"] = "off"
    elif args.enable_prefix_caching and overrides.get("prefix_cache") in (None, "off", False):
        overrides["prefix_cache"] = "async"
    if hasattr(args, "chunk_size"):  # absent unless given: None is a real value (whole-prompt prefill)
        overrides["chunk_size"] = args.chunk_size
    return overrides


def _check_unsupported(args: argparse.Namespace) -> None:
    """vLLM flags that name something minisgl does not have: a clear error, not a silent no-op."""
    if (args.tensor_parallel_size or 1) != 1:
        raise MiniSGLError(
            f"--tensor-parallel-size {args.tensor_parallel_size}: minisgl runs a model on one device; "
            "tensor parallelism is not implemented (for more throughput run engine replicas: "
            "`minisgl serve --replicas N`, lm-eval `data_parallel_size=N`)"
        )


def _chat_template(ref: str) -> str:
    """vLLM's --chat-template: a Jinja file, or the template itself in one line."""
    path = Path(ref).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in ref or "{%" in ref:
        return ref
    raise MiniSGLError(f"--chat-template: no such file {ref!r} (nor an inline Jinja template)")


def _set_chat_template(engine: Any, args: argparse.Namespace) -> None:
    if getattr(args, "chat_template", None):
        engine.tokenizer.chat_template = _chat_template(args.chat_template)


def _cmd_generate(args: argparse.Namespace) -> int:
    from minisgl_backend.engine import Engine

    params = sampling_params_from_args(args)
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if args.chat_template:
        _chat_template(args.chat_template)  # a bad reference fails before the model loads
        args.chat = True  # a chat template is for rendering the prompts as chat messages
    # One-shot: no periodic stats line (`--set stats_interval_s=10` brings it back).
    with Engine(_engine_config(args, {"stats_interval_s": 0})) as engine:
        _set_chat_template(engine, args)
        if args.chat:
            prompts = [
                engine.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
                )
                for p in prompts
            ]
        if args.stream:
            for prompt in prompts:
                for delta in engine.stream(prompt, params):
                    print(delta.text, end="", flush=True)
                print()
            return 0
        outputs = engine.generate(prompts, params, use_tqdm=not args.quiet)
        for prompt, out in zip(args.prompts or prompts, outputs):
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": prompt,
                            "text": out.text,
                            "finish_reason": out.finish_reason,
                            "seed": out.seed,
                            "num_tokens": len(out.token_ids),
                        }
                    )
                )
            else:
                print(
                    f"### {prompt}\n{out.text}\n[finish_reason={out.finish_reason} "
                    f"tokens={len(out.token_ids)} seed={out.seed}]\n"
                )
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from minisgl_backend.bench.command import run_bench

    return run_bench(args, lambda base: _engine_config(args, base))


def _cmd_stress(args: argparse.Namespace) -> int:
    from minisgl_backend.tools.stress import STRESS_POOL, run_stress
    from minisgl_backend.tools.tiny import make_tiny_llama

    base = {"model": str(make_tiny_llama()), **STRESS_POOL}  # every key overridable
    cfg = _engine_config(args, base)
    report = run_stress(
        cfg,
        args.num_requests,
        abort_prob=args.abort_prob,
        seed=args.seed,
        shared_prefixes=args.shared_prefixes,
        progress=True,
    )
    print(
        f"requests={report.requests} completed={report.completed} aborted={report.aborted} "
        f"mismatches={report.mismatches} wall={report.wall_s:.1f}s "
        f"prefix_hit_tokens={report.prefix_hit_tokens} "
        f"prefix_evicted_blocks={report.prefix_evicted_blocks}"
    )
    print(f"KV after drain: {report.kv_after_drain}")
    for ex in report.examples:
        print("  mismatch:", ex)
    failed = report.leaked or (report.mismatches > 0) != cfg.debug_unsafe_reclaim
    return 1 if failed else 0


def _cmd_determinism(args: argparse.Namespace) -> int:
    from minisgl_backend.tools.determinism import Grid, Workload, print_progress, run_check

    grid = Grid.from_yaml(args.grid)
    workload = Workload.from_yaml(args.prompts)
    # Only what the user gave (--config keys, flags, --set) overrides the grid's base; the grid's
    # compare_within and axes values still win at each point.
    overrides = _flag_overrides(args)
    if args.config:
        EngineConfig.resolve(args.config, overrides)  # validates the preset and the flags together
        overrides = {**load_preset(args.config), **overrides}
    report = run_check(grid, workload, overrides, progress=print_progress)
    print(report.format_table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=2)
        print(f"wrote {args.json}")
    return 0 if report.ok else 1


def _cmd_serve(args: argparse.Namespace) -> int:
    from minisgl_backend.engine import Engine
    from minisgl_backend.serve.server import _require_extra, bind, run_server

    _require_extra()  # before loading a model
    if args.replicas < 1:
        raise MiniSGLError(f"--replicas must be >= 1, got {args.replicas}")
    limits = _serve_limits(args)  # a bad limit fails before the model loads
    if not args.shutdown_timeout >= 0:
        raise MiniSGLError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        raise MiniSGLError(
            "the API key is empty (--api-key or MINISGL_API_KEY): the server would accept any client; "
            "give a key, or unset MINISGL_API_KEY to serve without one"
        )
    _check_tool_call_parser(args)
    _check_generation_config(args)
    _check_reasoning_parser(args)
    if args.chat_template:
        _chat_template(args.chat_template)  # a bad reference fails before the model loads
    if args.replicas > 1 or args.ray_address:
        if args.chat_template:
            raise MiniSGLError("--chat-template is not supported with --replicas / --ray-address yet")
        return _serve_on_ray(args)
    sock = bind(args.host, args.port)  # a port in use is told now, not after the model has loaded
    try:
        engine = Engine(_engine_config(args))
    except KeyboardInterrupt:  # stopped while loading the model
        sock.close()
        return 130
    except BaseException:
        sock.close()
        raise
    _set_chat_template(engine, args)
    run_server(
        engine,
        sock=sock,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        model_name=args.served_model_name,
        log_level=args.log_level,
        limits=limits,
        access_log=args.access_log,
        extra_hosts=_extra_hosts(args),
        shutdown_timeout=args.shutdown_timeout,
        reasoning_parser=args.reasoning_parser,
    )
    return 0


def _extra_hosts(args: argparse.Namespace) -> list[str]:
    """--allowed-hosts, repeatable and comma-separated."""
    return [h.strip() for item in args.allowed_hosts for h in item.split(",") if h.strip()]


def _serve_limits(args: argparse.Namespace) -> Any:
    from minisgl_backend.serve.guard import ServeLimits

    limits = ServeLimits(
        max_body_bytes=args.max_body_bytes,
        max_prompts=args.max_prompts,
        max_sequences=args.max_sequences,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
        stream_idle_timeout_s=args.stream_idle_timeout,
        stream_buffer_events=args.stream_buffer,
        cpu_workers=args.cpu_workers,
        max_request_chars=args.max_request_chars,
        max_buffered_bytes=args.max_buffered_bytes,
    )
    limits.check()
    return limits


def _serve_on_ray(args: argparse.Namespace) -> int:
    from minisgl_backend.cluster import import_serve
    from minisgl_backend.serve.ray_app import FEATURE, deploy, serve_until_signalled

    import_serve(FEATURE)  # the missing extra is named before anything starts
    config = _engine_config(args)
    try:
        server = deploy(
            config,
            args.replicas,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            model_name=args.served_model_name,
            ray_address=args.ray_address,
            limits=_serve_limits(args),
            extra_hosts=_extra_hosts(args),
            reasoning_parser=args.reasoning_parser,
        )
        serve_until_signalled(server, str(config.model), args.served_model_name, args.shutdown_timeout)
    except KeyboardInterrupt:  # stopped while Ray started or the replicas loaded
        return 130
    return 0


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from minisgl_backend.bench.command import run_bench_serve

    return run_bench_serve(args, lambda base: _engine_config(args, base))


# The tool-call formats `tool_choice: "auto"` parses out of a reply (minisgl_backend/chat/tools.py).
TOOL_CALL_PARSERS = ("hermes",)


def _check_generation_config(args: argparse.Namespace) -> None:
    """vLLM's --generation-config: 'auto' (its default) or a folder takes the model's sampling
    defaults; 'vllm' ignores them, which is what minisgl always does."""
    if args.generation_config not in (None, "vllm"):
        raise MiniSGLError(
            f"--generation-config {args.generation_config!r}: minisgl takes no sampling defaults from "
            "generation_config.json (it reads only eos_token_id there); a request's temperature, "
            "top_p, top_k, ... are its own, else OpenAI's defaults (temperature 1, top_p 1): send "
            "them per request, or pass --generation-config vllm, which is what minisgl does"
        )


def _check_tool_call_parser(args: argparse.Namespace) -> None:
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_CALL_PARSERS:
        raise MiniSGLError(
            f"--tool-call-parser {args.tool_call_parser!r}: minisgl parses one format, hermes "
            '(<tool_call>{"name": ..., "arguments": {...}}</tool_call>, also Qwen\'s), which is '
            "what it asks of models whose chat template cannot render tools"
        )


def _check_reasoning_parser(args: argparse.Namespace) -> None:
    from minisgl_backend.chat.reasoning import REASONING_PARSERS

    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        raise MiniSGLError(
            f"--reasoning-parser {args.reasoning_parser!r}: minisgl splits reasoning traces written as "
            f"<think>...</think> at the start of a reply: {', '.join(REASONING_PARSERS)}"
        )


def _vllm_serve_args(sv: argparse.ArgumentParser) -> None:
    """`vllm serve` habits: the model as a positional argument, a chat template, the tool flags."""
    sv.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model (same as --model)")
    g = sv.add_argument_group("chat (vLLM's flags)")
    g.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template file (or the template inline) in place of the model's own",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: tool_choice auto is always on (calls parsed from the reply)",
    )
    g.add_argument(
        "--reasoning-parser",
        metavar="NAME",
        help="deepseek_r1 or qwen3: a chat reply's leading <think>...</think> goes to the message's "
        "`reasoning` field (streamed as `reasoning` deltas) instead of its content",
    )
    g.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help=f"accepted for vLLM compatibility: {', '.join(TOOL_CALL_PARSERS)} (the one format parsed)",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted for vLLM compatibility: requests are not logged unless --access-log",
    )
    g.add_argument(
        "--generation-config",
        metavar="SOURCE",
        help="only 'vllm' (the requests' own fields or OpenAI's defaults): the model's "
        "generation_config.json gives no sampling defaults here",
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"minisgl {version('minisgl')}"
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "minisgl (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="minisgl", description=__doc__)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts (arguments or stdin lines)")
    gen.add_argument("prompts", nargs="*")
    add_sampling_args(gen)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.add_argument(
        "--chat-template", metavar="FILE", help="--chat with this Jinja template file (or inline template)"
    )
    _engine_args(gen)
    gen.set_defaults(fn=_cmd_generate)

    b = sub.add_parser("bench", help="offline throughput vs HF generate (prints a table)")
    b.add_argument("--num-requests", type=int, default=32)
    b.add_argument("--input-len", type=int, default=100)
    b.add_argument("--output-len", type=int, default=64)
    b.add_argument("--hf-batch-size", type=int, help="HF static batch size (default: all requests)")
    b.add_argument("--no-hf", action="store_true", help="skip the HF baseline")
    b.add_argument("--json", help="also write the results to this JSON file")
    b.add_argument(
        "--shape",
        choices=["llama-1b", "8b"],
        help="bench a random-weight model of this shape instead of --model, bf16, written once into "
        "the model cache (llama-1b: the peers' Llama-3.2-1B shape, ~1 minute, 2.1 GB; 8b: Llama-3-8B's "
        "layers, a few minutes, 15 GB)",
    )
    b.add_argument(
        "--scenario",
        type=_scenario,
        choices=SCENARIOS,
        help="overlap-table: the serial loop against the overlap scheduler with a chunk too small, a "
        "moderate chunk, and a moderate chunk with one iteration in flight, on a mixed-length "
        "closed-loop workload; prefix: prefix_cache "
        "off / sync / async on a shared-prefix (few-shot) workload; peers: output tok/s of the "
        "default and deterministic configs on the peer harness's workloads (batch 1, 8, 32 and a "
        "prefill one; best of --repeat runs, default 3); memory: RSS and its peak against the "
        "weights + KV pool bound, and the batch-1 decode step against the machine's read rate; "
        "sampling: output tok/s under greedy, temperature, top-k and top-p sampling (32 x 100 -> 64) "
        "and one draw's time per mode, with and without the native screen of the keyed draw",
    )
    b.add_argument(
        "--sweep",
        metavar="FIELD=v1,v2,..",
        help="the mixed workload under each value of one field "
        "(e.g. chunk_size=32,128,256,512 or max_inflight=1,2,4,8 or callback_impl=python,native)",
    )
    b.add_argument("--concurrency", type=int, default=16, help="closed-loop clients for --scenario/--sweep")
    b.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="measure again beside N busy processes (each one CPU's worth of work, ended with the "
        "run) and print both: the default run and --scenario peers also at one thread beside them, "
        "--scenario overlap-table|prefix and --sweep every variant",
    )
    b.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="with --scenario/--sweep: run the variants this many times, interleaved (compare "
        "ratios on a noisy machine; default 1); with --scenario peers: runs per workload, best "
        "kept (default 3)",
    )
    b.add_argument(
        "--trace",
        metavar="OUT.json",
        help="with --scenario/--sweep: Chrome-trace timeline "
        "(scheduler, compute, copy lanes per iteration, one process per config)",
    )
    b.add_argument(
        "--plot",
        metavar="OUT.png",
        help="with --scenario/--sweep: utilisation over time per config "
        "(compute busy fraction in small bins: idle gaps show as dips); needs minisgl[plot]",
    )
    _engine_args(b, seed=True)
    b.set_defaults(fn=_cmd_bench)

    st = sub.add_parser(
        "stress",
        help="lifetime stress harness on a tiny random model (aborts, reuse: no reply crosses requests)",
    )
    st.add_argument("--num-requests", type=int, default=20000)
    st.add_argument("--abort-prob", type=float, default=0.1)
    st.add_argument("--seed", type=int, default=0)
    st.add_argument(
        "--shared-prefixes",
        action="store_true",
        help="prompts grow from a few shared stems: the prefix cache hits, evicts and reuses blocks",
    )
    _engine_args(st)
    st.set_defaults(fn=_cmd_stress)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the serve extra)")
    sv.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument(
        "--allowed-hosts",
        action="append",
        default=[],
        metavar="NAME[,NAME...]",
        help="Host header names answered besides the loopback names and --host (others get a 421; "
        "repeatable; '*' answers any). Bound to 0.0.0.0 or :: the Host is checked only if given",
    )
    sv.add_argument(
        "--api-key",
        default=os.environ.get("MINISGL_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but the probes, /metrics and the "
        "docs (env MINISGL_API_KEY)",
    )
    sv.add_argument(
        "--served-model-name", help="the model id clients send and /v1/models lists (default: --model)"
    )
    sv.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engine replicas: 1 (default) serves one engine in this process; N >= 2 runs N replicas "
        "as Ray Serve deployments behind one ingress (needs the ray extra)",
    )
    sv.add_argument(
        "--ray-address",
        help="with --replicas: the Ray cluster to join (auto, HOST:PORT, ray://...; default RAY_ADDRESS, "
        "else a local cluster is started and stopped with the command); given with --replicas 1, "
        "that one replica runs on Ray too ('local' starts a local cluster)",
    )
    sv.add_argument(
        "--log-level",
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level, and the server's own (the start banner is INFO)",
    )
    sv.add_argument(
        "--shutdown-timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="on SIGINT / SIGTERM, new requests get a 503 (and /health) while the requests in flight get "
        "up to S seconds to finish; then the rest are aborted (default 0: at once; a second signal "
        "stops at once)",
    )
    sv.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log one line per request (uvicorn's access log; default off)",
    )
    lim = sv.add_argument_group("limits (per request and per client; docs/serving.md, 'Limits')")
    lim.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024, help="request body cap (413)")
    lim.add_argument(
        "--max-buffered-bytes",
        type=int,
        default=256 * 1024 * 1024,
        help="request body bytes held at once over all requests; past it a request gets a 503",
    )
    lim.add_argument("--max-prompts", type=int, default=1024, help="prompts in one completions request")
    lim.add_argument("--max-sequences", type=int, default=1024, help="n x prompts in one request")
    lim.add_argument("--header-timeout", type=float, default=10.0, help="seconds to send request headers")
    lim.add_argument(
        "--body-timeout", type=float, default=60.0, help="seconds to send the request body (408)"
    )
    lim.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections; more are answered 503 (default 1000, or the open-file limit less 64)",
    )
    lim.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=60.0,
        help="a streaming client that reads nothing this long is cut off and its requests aborted",
    )
    lim.add_argument(
        "--stream-buffer",
        type=int,
        default=256,
        help="undelivered stream events per sequence before a slow reader's requests are aborted",
    )
    lim.add_argument("--cpu-workers", type=int, default=2, help="threads for tokenising and templates")
    lim.add_argument(
        "--max-request-chars",
        type=int,
        default=4 * 1024 * 1024,
        help="characters one request may have tokenised in all (prompts, messages, tool calls, /tokenize)",
    )
    _engine_args(sv, seed=True)
    _vllm_serve_args(sv)
    sv.set_defaults(fn=_cmd_serve)

    bs = sub.add_parser(
        "bench-serve",
        help="concurrent streaming clients against a server (--url) or against "
        "one started in this process; req/s, tok/s, TTFT/TPOT/ITL; --check vs solo references",
    )
    bs.add_argument(
        "--url", help="server root (http://HOST:PORT); default: start one here with the engine flags"
    )
    bs.add_argument("--tiny", action="store_true", help="without --url: serve the tiny random model")
    bs.add_argument("--api-key")
    bs.add_argument("--served-model-name", help="model name to send / serve")
    bs.add_argument("--num-requests", type=int, default=200)
    bs.add_argument("--num-prompts", type=int, default=64, help="distinct prompts, drawn with replacement")
    bs.add_argument(
        "--input-len", type=int, default=64, help="mean prompt length (uniform in [len/2, 3len/2])"
    )
    bs.add_argument("--output-len", type=int, default=32)
    bs.add_argument(
        "--concurrency", type=int, default=32, help="clients (closed loop) or cap on requests in flight"
    )
    bs.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals at this many requests/s (default inf: closed loop)",
    )
    bs.add_argument(
        "--disconnect-prob",
        type=float,
        default=0.0,
        help="chance that a client hangs up after its first chunk",
    )
    bs.add_argument(
        "--check", action="store_true", help="compare every completed response with a solo run of its prompt"
    )
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument(
        "--offline-baseline",
        action="store_true",
        help="without --url: then run the same requests in-process on the same engine (no HTTP, no "
        "server threads) and print served / offline: what the server's own threads cost",
    )
    bs.add_argument("--json", help="also write the results to this JSON file")
    _engine_args(bs)
    bs.set_defaults(fn=_cmd_bench_serve)

    from minisgl_backend.tools.determinism import DEFAULT_GRID, DEFAULT_PROMPTS

    det = sub.add_parser(
        "determinism",
        help="run one request set under a grid of scheduling configs and count "
        "distinct outputs per request (exit 1 if any request has more than one)",
    )
    det.add_argument(
        "--grid", default=str(DEFAULT_GRID), help="grid YAML (default: configs/determinism/default.yaml)"
    )
    det.add_argument(
        "--prompts",
        default=str(DEFAULT_PROMPTS),
        help="request-set YAML (default: configs/determinism/prompts.yaml)",
    )
    det.add_argument("--json", help="also write the report to this JSON file")
    _engine_args(det)
    det.set_defaults(fn=_cmd_determinism)
    return parser


def _quiet() -> None:
    """The `minisgl` logger at WARNING: the stats line and other INFO lines go."""
    from minisgl_backend.metrics import install_logging

    install_logging()  # first, so that an Engine does not set the level back to INFO
    logging.getLogger("minisgl").setLevel(logging.WARNING)


def _flush_logs() -> None:
    """Log lines still buffered go out before the command's last line, which then stays last."""
    from minisgl_backend.metrics import flush_logging

    flush_logging()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "quiet", False):
            _quiet()
        return args.fn(args)
    except MiniSGLError as e:
        _flush_logs()
        print(f"minisgl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT, no traceback
        _flush_logs()
        print(f"minisgl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
