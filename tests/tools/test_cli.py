"""The `minisgl` command line on the tiny model: generate, the overlap-table scenario, bad config; vLLM's
flags, --version, --quiet, --chat-template, Ctrl-C."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from minisgl_backend import EngineConfig
from minisgl_backend import cli as cli_mod
from minisgl_backend.errors import MiniSGLError
from tests.helpers import run_minisgl as _minisgl


def test_generate_json(tiny_model_dir):
    r = _minisgl("generate", "--model", str(tiny_model_dir), "--max-tokens", "5", "--json", "hello", "world")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [x["prompt"] for x in lines] == ["hello", "world"]
    assert all(x["num_tokens"] == 5 and x["finish_reason"] == "length" for x in lines)


@pytest.mark.slow
def test_overlap_table_scenario_writes_all_four_rows(tiny_model_dir, tmp_path):
    out, trace = tmp_path / "table.json", tmp_path / "trace.json"
    r = _minisgl(
        "bench",
        "--scenario",
        "overlap-table",
        "--model",
        str(tiny_model_dir),
        "--num-requests",
        "8",
        "--output-len",
        "4",
        "--concurrency",
        "4",
        "--json",
        str(out),
        "--trace",
        str(trace),
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["results"]
    assert list(rows) == [
        "serial, no chunking",
        "overlap, chunk too small",
        "overlap, moderate chunk",
        "overlap, over-synchronised",
    ]
    assert all(row["requests"] == 8 and row["req_per_s"] > 0 for row in rows.values())
    # The timeline has the three lanes for all four configs, one complete span per forward pass.
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3} and {e["tid"] for e in spans} == {0, 1, 2}
    assert all(e["dur"] >= 0 for e in spans) and any(e["name"].startswith("forward") for e in spans)
    # A serial engine never plans while a forward pass runs.
    assert rows["serial, no chunking"]["sched_overlap"] < 0.05


def test_seed_table_is_a_deprecated_alias_of_overlap_table(capsys):
    args = cli_mod.build_parser().parse_args(["bench", "--scenario", "seed-table"])
    assert args.scenario == "overlap-table"
    assert "deprecated; use --scenario overlap-table" in capsys.readouterr().err
    bench = cli_mod.build_parser()._subparsers._group_actions[0].choices["bench"]
    assert "overlap-table" in bench.format_help() and "seed-table" not in bench.format_help()


def test_bad_config_key_is_a_clear_error(tiny_model_dir):
    r = _minisgl("generate", "--model", str(tiny_model_dir), "--set", "chunksize=8", "hi")
    assert r.returncode == 2 and "unknown engine config key" in r.stderr and "chunk_size" in r.stderr


# ---------------------------------------------------------------- vLLM's flags, --version, --quiet, Ctrl-C


def _overrides(*argv: str) -> dict:
    return cli_mod._flag_overrides(cli_mod.build_parser().parse_args(list(argv)))


def test_vllm_engine_flags_are_aliases_of_engine_fields():
    flags = ["--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"]
    flags += ["--max-logprobs", "5", "--dtype", "bfloat16", "--no-enable-prefix-caching", "-tp", "1"]
    flags += ["--gpu-memory-utilization", "0.8"]
    want = {
        "gpu_memory_utilization": 0.8,
        "max_model_len": 512,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "max_logprobs": 5,
        "dtype": "bfloat16",
        "prefix_cache": "off",
    }
    for command in ("generate", "bench", "stress", "serve", "bench-serve", "determinism"):
        assert _overrides(command, *flags) == want, command
    args = cli_mod.build_parser().parse_args(["serve", "--seed", "7", *flags])
    cfg = cli_mod._engine_config(args)  # the real fields: an alias naming no field would fail here
    assert (cfg.seed, cfg.max_model_len, cfg.max_num_seqs, cfg.prefix_cache) == (7, 512, 8, "off")
    assert cfg.gpu_memory_utilization == 0.8
    assert _overrides("bench", "--seed", "3") == {"seed": 3}
    # where a command's --seed means something else it keeps that meaning
    gen = cli_mod.build_parser().parse_args(["generate", "--seed", "3", "hi"])
    assert gen.seed == 3 and "seed" not in cli_mod._flag_overrides(gen)
    assert _overrides("stress", "--seed", "3") == {}
    # dtype spellings, prefix caching on over a preset or --set that turned it off, not over sync
    assert _overrides("serve", "--dtype", "float") == {"dtype": "float32"}
    assert _overrides("serve", "--dtype", "auto") == {}
    assert _overrides("serve", "--enable-prefix-caching") == {"prefix_cache": "async"}
    assert (
        _overrides("serve", "--set", "prefix_cache=off", "--enable-prefix-caching")["prefix_cache"] == "async"
    )
    assert (
        _overrides("serve", "--set", "prefix_cache=sync", "--enable-prefix-caching")["prefix_cache"] == "sync"
    )
    args = cli_mod.build_parser().parse_args(["serve", "--config", "serial", "--enable-prefix-caching"])
    assert cli_mod._engine_config(args).prefix_cache == "async"


def test_serve_takes_the_model_positionally_and_the_chat_flags():
    assert _overrides("serve", "my/model") == {"model": "my/model"}
    assert _overrides("serve", "m", "--model", "m") == {"model": "m"}
    with pytest.raises(MiniSGLError, match="two models given"):
        _overrides("serve", "a", "--model", "b")
    args = cli_mod.build_parser().parse_args(
        ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", "t.jinja"]
    )
    assert (args.enable_auto_tool_choice, args.tool_call_parser, args.chat_template) == (
        True,
        "hermes",
        "t.jinja",
    )
    cli_mod._check_tool_call_parser(args)
    args.tool_call_parser = "llama3_json"
    with pytest.raises(MiniSGLError, match="parses one format, hermes"):
        cli_mod._check_tool_call_parser(args)


def test_chat_template_is_a_file_or_an_inline_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}!")
    assert cli_mod._chat_template(str(f)) == "{{ messages[0]['content'] }}!"
    assert cli_mod._chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    with pytest.raises(MiniSGLError, match="no such file"):
        cli_mod._chat_template(str(tmp_path / "missing.jinja"))


def test_flags_without_meaning_here_and_unknown_flags_say_what_to_do(capsys):
    for argv, match in (
        (["serve", "--tensor-parallel-size", "2"], "tensor parallelism is not implemented"),
        (["generate", "-tp", "4", "hi"], "runs a model on one device"),
        (["serve", "--tool-call-parser", "mistral"], "parses one format, hermes"),
    ):
        assert cli_mod.main(argv) == 2, argv
        assert match in capsys.readouterr().err, argv
    for argv in (["serve", "--swap-space", "4"], ["generate", "--enforce-eager", "hi"]):
        with pytest.raises(SystemExit) as e:
            cli_mod.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "unrecognized arguments" in err and "--set KEY=VALUE" in err, argv
        assert "max_num_seqs" in err  # the keys it takes
    with pytest.raises(SystemExit) as e:
        cli_mod.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == cli_mod._version()
    assert cli_mod._version().startswith("minisgl ")


def test_one_shot_generate_has_no_stats_line_unless_asked(monkeypatch):
    seen = []

    class Stop(Exception):
        pass

    def fake_engine(config):
        seen.append(config)
        raise Stop

    monkeypatch.setattr("minisgl_backend.engine.Engine", fake_engine)
    for extra, want in (([], 0.0), (["--set", "stats_interval_s=5"], 5.0)):
        with pytest.raises(Stop):
            cli_mod.main(["generate", *extra, "hi"])
        assert isinstance(seen[-1], EngineConfig) and seen[-1].stats_interval_s == want


@pytest.mark.slow
def test_generate_chat_template_and_quiet(tiny_model_dir, tmp_path):
    """--chat-template replaces the model's template (the reply equals the raw prompt's it renders);
    --quiet leaves stderr without INFO lines or the progress bar."""
    template = tmp_path / "t.jinja"
    template.write_text("<<{{ messages[0]['content'] }}>>")
    common = ["generate", "--model", str(tiny_model_dir), "--max-tokens", "6", "--json"]
    chat = _minisgl(*common, "--chat-template", str(template), "--quiet", "hello")  # implies --chat
    raw = _minisgl(*common, "<<hello>>")
    assert chat.returncode == 0 and raw.returncode == 0, chat.stderr + raw.stderr
    text = lambda r: [json.loads(x)["text"] for x in r.stdout.splitlines() if x.startswith("{")]
    assert text(chat) == text(raw) and len(text(chat)) == 1
    assert "minisgl generate" in raw.stderr  # the progress bar, without --quiet
    assert "minisgl generate" not in chat.stderr and " INFO " not in chat.stderr, chat.stderr


@pytest.mark.slow
def test_determinism_reports_progress_and_ctrl_c_exits_130_in_one_line(tiny_model_dir, tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(
        "fillers: 0\nprefill_check: false\nbase: {stats_interval_s: 0}\naxes:\n  max_inflight: [1, 2, 3, 4]\n"
    )
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text(
        "max_tokens: 200\nlogprobs: 0\nsampling: {greedy: {temperature: 0}}\nprompts: [a, b]\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "minisgl_backend.cli", "determinism", "--model", str(tiny_model_dir)]
        + ["--grid", str(grid), "--prompts", str(prompts)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        if line.startswith("[1/4]"):
            break
    assert lines[0].startswith("4 grid points (1 group(s) x 4)"), lines
    assert "s left" in lines[-1], lines  # each point says how long the rest should take
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "minisgl determinism: interrupted", err


def test_bench_busy_measures_idle_busy_and_one_thread(tiny_model_dir, tmp_path):
    """`minisgl bench --busy 1`: the engine idle, beside one busy process and at one thread beside
    it, and the ratio row; a negative count is a clear error."""
    out = tmp_path / "busy.json"
    args = ("bench", "--model", str(tiny_model_dir), "--no-hf", "--num-requests", "4", "--input-len", "8")
    r = _minisgl(*args, "--output-len", "4", "--busy", "1", "--json", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    rows = result["results"]
    assert {"minisgl", "minisgl, busy", "minisgl 1 thread, busy", "ratio_busy_over_idle"} <= set(rows)
    assert all(rows[k]["requests"] == 4 for k in ("minisgl", "minisgl, busy", "minisgl 1 thread, busy"))
    assert result["config"]["busy_processes"] == 1
    assert "ratio_busy_over_idle" in r.stdout
    bad = _minisgl(*args, "--busy", "-1", timeout=120)
    assert bad.returncode != 0 and "--busy is a count" in bad.stderr


def test_serve_refuses_an_empty_api_key_before_loading(tiny_model_dir):
    """`--api-key ""` (or an empty MINISGL_API_KEY) would serve every client with no auth: a start-up
    error naming the key, before any model loads."""
    r = _minisgl("serve", "--model", str(tiny_model_dir), "--api-key", " ", "--port", "0", timeout=120)
    assert r.returncode == 2, r.stderr
    assert "API key is empty" in r.stderr and "Traceback" not in r.stderr


def test_bench_memory_sets_rss_against_the_weights(tiny_model_dir, tmp_path):
    """`minisgl bench --scenario memory`: the weights' bytes, what the model holds (the packs in
    their place: no more than the weights and the layouts' padding), the KV pool, RSS and its peak
    against the bound, and the batch-1 step against the read rate; flags it cannot use are refused."""
    out = tmp_path / "memory.json"
    args = ("bench", "--scenario", "memory", "--model", str(tiny_model_dir), "--dtype", "bfloat16")
    r = _minisgl(*args, "--set", "num_blocks=64", "--repeat", "1", "--json", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert 0 < result["held_weight_bytes"] <= 1.15 * result["weight_bytes"]
    assert result["kv_cache_bytes"] > 0
    assert result["peak_bytes"] >= result["rss_bytes"] > result["weight_bytes"]
    assert result["batch1"]["step_ms"] > 0
    assert "bound 1.15 x weights + KV pool" in r.stdout and "batch-1 decode" in r.stdout
    bad = _minisgl(*args, "--busy", "1", timeout=120)
    assert bad.returncode != 0 and "--scenario memory takes none of" in bad.stderr


def test_bench_sampling_sets_each_mode_against_greedy(tiny_model_dir, tmp_path):
    """`minisgl bench --scenario sampling`: the engine's tok/s under each sampling mode, its ratio to
    greedy's, and one draw's time per mode with this process's kernels and with numpy alone; flags
    it cannot use are refused."""
    out = tmp_path / "sampling.json"
    args = ("bench", "--scenario", "sampling", "--model", str(tiny_model_dir), "--dtype", "bfloat16")
    r = _minisgl(*args, "--repeat", "1", "--json", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    modes = ["greedy", "temperature 0.8", "temperature 0.8, top_k 50", "temperature 0.8, top_p 0.95"]
    assert list(rows) == modes
    assert rows["greedy"]["vs greedy"] == 1.0
    for row in rows.values():
        assert row["tok/s"] > 0 and row["draw us"] > 0 and row["draw us, numpy"] > 0
    assert "draws over a vocabulary of" in r.stdout
    bad = _minisgl(*args, "--sweep", "chunk_size=32,64", timeout=120)
    assert bad.returncode != 0 and "--scenario sampling takes none of" in bad.stderr


def test_bench_sweep_checks_every_value_before_running_any(tiny_model_dir):
    """`--sweep FIELD=...`: a bad value is refused before the first variant runs (not after minutes
    of the valid ones), and `None` is read as the config's docs write it."""
    args = ("bench", "--sweep", "chunk_size=None,foo", "--model", str(tiny_model_dir), "--num-requests", "2")
    bad = _minisgl(*args, timeout=120)
    assert bad.returncode != 0
    assert "chunk_size must be an int >= 1 or None" in bad.stderr and "got 'foo'" in bad.stderr
    assert "req/s" not in bad.stdout  # no variant ran


def test_serve_tells_a_port_in_use_before_loading_the_model(monkeypatch, capsys):
    import socket

    pytest.importorskip("fastapi")

    def no_engine(config):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr("minisgl_backend.engine.Engine", no_engine)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli_mod.main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot serve on 127.0.0.1:{port}" in err and "pick another --port" in err, err
    assert "Traceback" not in err


def test_serve_takes_vllm_logging_flags_and_refuses_generation_config_with_the_way(monkeypatch, capsys):
    pytest.importorskip("fastapi")

    class Loaded(Exception):
        pass

    def engine(config):
        raise Loaded  # the flags were accepted: the model would load now

    monkeypatch.setattr("minisgl_backend.engine.Engine", engine)
    args = cli_mod.build_parser().parse_args(
        ["serve", "--uvicorn-log-level", "debug", "--disable-log-requests"]
    )
    assert args.log_level == "debug"
    for extra in (
        ["--uvicorn-log-level", "warning", "--disable-log-requests"],
        ["--generation-config", "vllm"],
    ):
        with pytest.raises(Loaded):
            cli_mod.main(["serve", "--port", "0", *extra])
    for source in ("auto", "/models/llama"):
        assert cli_mod.main(["serve", "--port", "0", "--generation-config", source]) == 2
        err = capsys.readouterr().err
        assert "generation_config.json" in err and "per request" in err, err
        assert "unrecognized arguments" not in err and "--set KEY=VALUE" not in err


def test_the_docs_serve_recipes_wait_for_health_before_the_first_request():
    """A recipe that starts `minisgl serve &` and then sends a request at once fails silently while
    the model loads: each one polls /health in between."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    recipes = [
        ((repo / "README.md").read_text(), "## Quick start 3"),
        ((repo / "docs" / "serving.md").read_text(), "## lm-eval over HTTP"),
    ]
    for page, heading in recipes:
        block = page[page.index(heading) :].split("```bash\n", 1)[1].split("```", 1)[0]
        lines = block.splitlines()
        start = next(i for i, ln in enumerate(lines) if ln.startswith("minisgl serve") and "&" in ln)
        wait = next(i for i, ln in enumerate(lines) if "/health" in ln)
        first = next(i for i, ln in enumerate(lines) if "/v1/" in ln or ln.startswith("lm_eval"))
        assert start < wait < first and lines[wait].startswith("until curl -sf"), block


def test_bench_serve_sets_the_served_run_against_the_same_requests_offline(tmp_path):
    """`minisgl bench-serve --offline-baseline`: the same requests in the same closed loop, on the
    same engine called in-process, and served / offline (what the server's own threads cost); it
    is refused where it cannot compare like with like."""
    pytest.importorskip("fastapi")
    out = tmp_path / "serve.json"
    args = ("bench-serve", "--tiny", "--num-requests", "8", "--concurrency", "4", "--output-len", "4")
    r = _minisgl(*args, "--offline-baseline", "--json", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    row = json.loads(out.read_text())
    assert row["completed"] == 8 and row["offline_req_per_s"] > 0
    ratio = row["output_tok_per_s"] / row["offline_output_tok_per_s"]
    assert row["served_over_offline"] == pytest.approx(ratio)
    assert "served / offline" in r.stdout
    # The clients run in a process of their own: the server's CPU split holds the event loop and
    # the compute thread but no client thread, and the client process's CPU is told apart.
    served = row["served_cpu_s"]
    assert served["event loop"] > 0 and served["compute"] > 0 and served.get("clients", 0.0) < 0.05
    assert row["client_cpu_s"] > 0 and row["offline_cpu_s"].get("event loop", 0.0) < 0.05
    assert row["served_engine"]["iterations"] > 0 and row["offline_engine"]["forward_s"] > 0
    assert "server CPU per 1,000 output tokens" in r.stdout
    bad = _minisgl(*args, "--offline-baseline", "--url", "http://127.0.0.1:9", timeout=120)
    assert bad.returncode != 0 and "--offline-baseline runs the same closed loop" in bad.stderr


def test_bench_serve_accounts_for_every_hung_up_request_of_its_own_server(tmp_path):
    """`minisgl bench-serve --disconnect-prob` against its own server: each hung-up request is found
    aborted (or finished first) on the server, although a server keeps no record of ended requests
    unless asked, and the run exits 0."""
    pytest.importorskip("fastapi")
    out = tmp_path / "serve.json"
    args = ("bench-serve", "--tiny", "--num-requests", "12", "--concurrency", "4", "--output-len", "32")
    r = _minisgl(*args, "--disconnect-prob", "0.5", "--seed", "1", "--json", str(out), timeout=300)
    row = json.loads(out.read_text())
    assert row["disconnected"] > 0, row
    assert row["disconnects_unaccounted"] == 0, r.stdout
    assert row["disconnects_aborted"] + row["disconnects_finished"] == row["disconnected"]
    assert r.returncode == 0, r.stdout + r.stderr
