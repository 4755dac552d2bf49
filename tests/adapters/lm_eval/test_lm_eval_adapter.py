"""lm-eval adapter: registration, model_args, each request type against lm-eval's own `hf` backend
(same weights, fp32), and the stock CLI end to end on the local tasks."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the lm-eval adapter needs lm-eval installed")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval_minisgl.model import MiniSGLLM, build_engine_config  # noqa: E402

from minisgl_backend import ConfigError, Engine, EngineConfig, InvalidSamplingParamsError  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
LL_TOL = 1e-3


@pytest.fixture(scope="module")
def engine(smollm_dir):
    with Engine(EngineConfig(model=str(smollm_dir), dtype="float32", seed=0)) as eng:
        yield eng
        counts = eng.drain(timeout=60, flush_cache=True)
        assert counts["FREE"] == eng.num_blocks, counts  # every KV block back once the cache is flushed


@pytest.fixture(scope="module")
def lm(engine):
    return MiniSGLLM(engine=engine)


@pytest.fixture(scope="module")
def hf(smollm_dir):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(smollm_dir), dtype="float32", device="cpu", batch_size=1)


def _ll(*pairs: tuple[str, str]) -> list[Instance]:
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def _gen(*items: tuple[str, dict]) -> list[Instance]:
    return [Instance("generate_until", {}, item, i) for i, item in enumerate(items)]


# ---------------------------------------------------------------------------------------- registration
@pytest.mark.slow
def test_stock_registry_resolves_minisgl_and_keeps_builtins():
    # A fresh interpreter: only the installed .pth hook can have registered the model.
    code = (
        "from lm_eval.api.registry import get_model\n"
        "print(get_model('minisgl').__name__, get_model('hf').__name__, get_model('dummy').__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["MiniSGLLM", "HFLM", "DummyLM"]


def test_entry_point_declared_for_newer_lm_eval():
    eps = importlib.metadata.entry_points(group="lm_eval.models")
    assert {ep.name: ep.value for ep in eps}.get("minisgl") == "lm_eval_minisgl.model:MiniSGLLM"


# ------------------------------------------------------------------------------------------ model_args
def test_unknown_model_arg_is_a_clear_error_listing_valid_keys():
    with pytest.raises(ConfigError) as err:
        MiniSGLLM.create_from_arg_string("pretrained=smollm2-135m-instruct,chunk_sz=64")
    msg = str(err.value)
    assert "chunk_sz" in msg and "chunk_size" in msg and "max_gen_toks" in msg and "pretrained" in msg


def test_engine_knobs_and_presets_reach_the_engine_config(tmp_path):
    cfg = build_engine_config(
        {
            "pretrained": "some/dir",
            "dtype": "bf16",
            "chunk_size": "None",
            "num_blocks": 64,
            "seed": 7,
            "max_num_seqs": 8,
            "mixed_batches": False,
        }
    )
    assert (
        cfg.model,
        cfg.dtype,
        cfg.chunk_size,
        cfg.num_blocks,
        cfg.seed,
        cfg.max_num_seqs,
        cfg.mixed_batches,
    ) == ("some/dir", "bfloat16", None, 64, 7, 8, False)
    preset = tmp_path / "preset.yaml"
    preset.write_text("chunk_size: 128\nmax_num_batched_tokens: 512\n")
    cfg = build_engine_config({"config": str(preset), "chunk_size": 64})
    assert (cfg.chunk_size, cfg.max_num_batched_tokens) == (64, 512)  # model_args override the preset
    with pytest.raises(ConfigError, match="not found"):
        build_engine_config({"config": "no-such-preset"})


def test_deterministic_mode_is_a_model_arg():
    from lm_eval.utils import simple_parse_args_string

    assert (
        build_engine_config(simple_parse_args_string("pretrained=x,deterministic=true")).deterministic is True
    )
    assert build_engine_config({"pretrained": "x"}).deterministic is False
    with pytest.raises(ConfigError, match="deterministic must be true or false"):
        build_engine_config({"pretrained": "x", "deterministic": "yes"})


# --------------------------------------------------------------------------------------- request types
def test_loglikelihood_matches_hf(lm, hf):
    reqs = _ll(
        ("The capital of France is", " Paris"),
        ("The capital of France is", " a small village in the mountains"),
        ("Question: What is 2 plus 2?\nAnswer: ", "4"),  # trailing space moves to the continuation
        ("", "Hello world"),  # empty context: conditioned on the prefix token
        ("The capital of France is", " Paris"),  # a duplicate keeps its place in the output
        ("1, 2, 3, 4,", " 5, 6, 7"),
    )
    ours, ref = lm.loglikelihood(reqs), hf.loglikelihood(reqs)
    assert len(ours) == len(reqs) and ours[0] == ours[4]
    for (a, ga), (b, gb) in zip(ours, ref):
        assert abs(a - b) < LL_TOL and ga == gb
    assert ours[0][0] > ours[1][0]  # the plausible continuation is far more likely
    assert any(g for _, g in ours) and not all(g for _, g in ours)


def test_loglikelihood_rolling_and_truncation_match_hf(engine, hf):
    short = MiniSGLLM(engine=engine, max_length=32)  # forces several windows and left truncation
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 8)
    rolling = [
        Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate([text, "Just one short line."])
    ]
    long_ll = _ll((text, " The end."))
    hf._max_length = 32
    try:
        ref_roll, ref_ll = hf.loglikelihood_rolling(rolling), hf.loglikelihood(long_ll)
    finally:
        hf._max_length = None
    ours_roll, ours_ll = short.loglikelihood_rolling(rolling), short.loglikelihood(long_ll)
    assert len(short.tok_encode(text)) > 2 * 32  # three windows
    for a, b in zip(ours_roll, ref_roll):
        assert abs(a - b) < LL_TOL
    assert abs(ours_ll[0][0] - ref_ll[0][0]) < LL_TOL


def test_generate_until_greedy_matches_hf_and_removes_stops(lm, hf):
    reqs = _gen(
        (
            "Question: What is the capital of France?\nAnswer:",
            {"until": ["\n"], "max_gen_toks": 12, "do_sample": False},
        ),
        ("1, 2, 3, 4,", {"until": [" 7"], "max_gen_toks": 20, "do_sample": False}),
        ("Once upon a time", {"until": ["Question:"], "max_gen_toks": 8, "temperature": 0.0}),
    )
    ours, ref = lm.generate_until(reqs), hf.generate_until(reqs)
    assert ours == ref
    assert ours[1].startswith(" 5, 6,") and " 7" not in ours[1]  # stopped at " 7", which is removed
    assert len(lm.tok_encode(ours[2])) <= 8


def test_sampled_generation_is_seeded_per_request(lm):
    kw = {"until": ["\n\n"], "max_gen_toks": 16, "do_sample": True, "temperature": 1.0, "top_p": 0.95}
    prompt = "Write a word:"
    a = lm.generate_until(
        _gen((prompt, {**kw, "seed": 11}), (prompt, {**kw, "seed": 12}), ("Other prompt", kw))
    )
    b = lm.generate_until(_gen((prompt, {**kw, "seed": 11})))
    assert a[0] == b[0]  # same seed, different batch company: same text
    c = lm.generate_until(_gen(*[(prompt, {**kw, "seed": s}) for s in range(20, 26)]))
    assert len(set(c)) > 1  # sampling really samples


def test_penalty_gen_kwargs_reach_the_sampling_params(lm, caplog):
    """repetition_penalty / presence_penalty / frequency_penalty / logit_bias in a task's gen_kwargs
    are the engine's (vLLM's names, as lm-eval's vllm backend passes them), greedy included."""
    eos = lm.tokenizer.decode(lm.eot_token_id, skip_special_tokens=False)
    kw = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}
    knobs = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": -0.2}
    with caplog.at_level(logging.WARNING, logger="lm_eval_minisgl"):
        params, _, _ = lm._sampling_params({**kw, **knobs, "logit_bias": {42: -100}}, eos)
    assert not [r for r in caplog.records if "not supported" in r.getMessage()]  # nothing dropped
    assert params.greedy and params.logit_bias == ((42, -100.0),)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.3, 0.5, -0.2)
    with pytest.raises(
        InvalidSamplingParamsError, match=r"\['num_beams'\] are not supported.*supported: .*top_p"
    ):
        lm._sampling_params({**kw, "num_beams": 4}, eos)  # an error, not a silently different score
    neutral, _, _ = lm._sampling_params({**kw, "repetition_penalty": None}, eos)
    assert not neutral.penalised
    with pytest.raises(InvalidSamplingParamsError, match="presence_penalty"):
        lm._sampling_params({**kw, "presence_penalty": 3.0}, eos)
    with pytest.raises(InvalidSamplingParamsError, match="logit_bias"):
        lm._sampling_params({**kw, "logit_bias": {-1: 5}}, eos)
    # ... and reach the engine: a repetition penalty changes the greedy continuation of a counting
    # prompt (it repeats ", "), a +100 bias forces its token.
    prompt = "1, 2, 3, 4,"
    plain, penalised = lm.generate_until(_gen((prompt, kw), (prompt, {**kw, "repetition_penalty": 2.0})))
    assert plain.startswith(" 5, 6,") and penalised != plain
    tid = lm.tok_encode(" banana")[0]
    (forced,) = lm.generate_until(_gen((prompt, {**kw, "max_gen_toks": 4, "logit_bias": {tid: 100.0}})))
    assert forced == lm.tokenizer.decode([tid] * 4)


def test_overlong_generation_context_is_left_truncated_with_one_warning(engine, caplog):
    short = MiniSGLLM(engine=engine, max_length=48)
    long_ctx = "word " * 200 + "\nQuestion: What is the capital of France?\nAnswer:"
    kw = {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}
    with caplog.at_level(logging.WARNING, logger="lm_eval_minisgl"):
        out = short.generate_until(_gen((long_ctx, kw), (long_ctx + " ", kw)))
    assert len(out) == 2 and all(isinstance(s, str) for s in out)
    assert sum("left-truncated" in r.getMessage() for r in caplog.records) == 1


def test_chat_template_and_tokenizer_name(lm):
    history = [{"role": "user", "content": "What is 2 + 2?"}]
    rendered = lm.apply_chat_template(history)
    assert rendered == lm.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert rendered.rstrip().endswith("<|im_start|>assistant")
    assert lm.tokenizer_name and "/" not in lm.tokenizer_name
    assert lm.chat_template(True)  # lm-eval's --apply_chat_template finds the template


def test_progress_bars_name_the_request_type_and_no_stats_line_by_default(tiny_model_dir, monkeypatch):
    class Stop(Exception):
        pass

    seen = []

    def capture(cfg, *args):
        seen.append(cfg)
        raise Stop

    with monkeypatch.context() as m:
        m.setattr("lm_eval_minisgl.model.make_engine", capture)
        for kwargs, want in (({}, 0.0), ({"stats_interval_s": 5}, 5.0)):
            with pytest.raises(Stop):
                MiniSGLLM(pretrained=str(tiny_model_dir), **kwargs)
            assert seen[-1].stats_interval_s == want  # a scoring run logs no 10 s stats line unless asked
    with Engine(EngineConfig(model=str(tiny_model_dir), stats_interval_s=0)) as eng:
        lm, labels, generate = MiniSGLLM(engine=eng), [], eng.generate
        monkeypatch.setattr(eng, "generate", lambda *a, **kw: labels.append(kw["desc"]) or generate(*a, **kw))
        lm.loglikelihood(_ll(("a", " b")), disable_tqdm=True)
        rolling = Instance("loglikelihood_rolling", {}, ("some text",), 0)
        lm.loglikelihood_rolling([rolling], disable_tqdm=True)
        until = Instance("generate_until", {}, ("a", {"until": ["\n"], "max_gen_toks": 2}), 0)
        lm.generate_until([until], disable_tqdm=True)
    assert labels == ["minisgl loglikelihood", "minisgl loglikelihood_rolling", "minisgl generate_until"]


# -------------------------------------------------------------------------------------- CLI end to end
def _lm_eval(exe: str, args: list[str], out: Path) -> dict:
    cmd = [str(BIN / exe), "--include_path", "configs/tasks", "--output_path", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=OFFLINE, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(out.rglob("results_*.json")).read_text())


# The CLI tests pass deterministic=false: they check the CLI path, not reproducibility (the default,
# checked by test_default_runs_score_the_same_at_max_num_seqs_4_and_64), which would add ~75 s of CPU
# to these two tests (measured: 180 s vs 102 s user time together).
@pytest.mark.slow
def test_stock_cli_runs_all_local_tasks(tmp_path):
    res = _lm_eval(
        "lm_eval",
        [
            "--model",
            "minisgl",
            "--model_args",
            "pretrained=smollm2-135m-instruct,dtype=float32,chunk_size=64,deterministic=false",
            "--tasks",
            "minisgl_mc,minisgl_gen,minisgl_ppl",
            "--limit",
            "8",
        ],
        tmp_path,
    )["results"]
    assert res["minisgl_mc"]["acc,none"] >= 0.5  # chance is 0.25; the first items are easy facts
    assert res["minisgl_gen"]["exact_match,first-number"] >= 0.25
    assert 1.0 < res["minisgl_ppl"]["byte_perplexity,none"] < 3.0


@pytest.mark.slow
def test_wrapper_script_with_chat_template_and_multiturn_fewshot(tmp_path):
    res = _lm_eval(
        "minisgl-lm-eval",
        [
            "--model",
            "minisgl",
            "--model_args",
            "pretrained=smollm2-135m-instruct,dtype=bfloat16,deterministic=false",
            "--tasks",
            "minisgl_gen",
            "--limit",
            "4",
            "--apply_chat_template",
            "--fewshot_as_multiturn",
            "--log_samples",
        ],
        tmp_path,
    )
    assert "exact_match,first-number" in res["results"]["minisgl_gen"]
    sample = json.loads(next(tmp_path.rglob("samples_minisgl_gen_*.jsonl")).read_text().splitlines()[0])
    prompt = json.dumps(sample["arguments"])  # the rendered context sent to the model
    assert prompt.count("<|im_start|>user") == 4  # 3 few-shot turns + the question, as chat turns


@pytest.mark.slow
def test_max_batch_size_is_the_engines_max_num_seqs(tiny_model_dir):
    lm = MiniSGLLM(pretrained=str(tiny_model_dir), max_batch_size=3, num_threads=1)
    try:
        assert lm.engine.config.max_num_seqs == 3
    finally:
        lm.close()
    assert build_engine_config({"pretrained": str(tiny_model_dir), "max_num_seqs": 5}).max_num_seqs == 5
    both = MiniSGLLM(pretrained=str(tiny_model_dir), max_batch_size=3, max_num_seqs=7, num_threads=1)
    try:
        assert both.engine.config.max_num_seqs == 7  # the engine's own key wins
    finally:
        both.close()


# ------------------------------------------------------------------------------ reasoning models
# Qwen3's chat template, its thinking logic: earlier assistant turns lose their reasoning, and the
# generation prompt pre-fills an empty trace when enable_thinking is false.
QWEN3_TEMPLATE = """{%- for message in messages %}
{%- if message.role == "assistant" %}
{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}"""
# What the scripted model says after the generation prompt: a trace holding the task's stop
# ("\n\n", the few-shot delimiter) and a wrong number, then the answer.
REASONING = "<think>Maybe 13\n\n</think>42"
THINK_TASK = """task: think_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 24
  do_sample: false
filter_list:
  - name: first-number
    filter:
      - function: regex
        regex_pattern: "(-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def thinker(smollm_dir, tmp_path_factory):
    """A scripted tiny Llama with a Qwen3-style tokenizer (<think> and </think> single added tokens,
    Qwen3's template): after the generation prompt it says REASONING, then EOS; after the prompt
    that pre-fills an empty trace (enable_thinking false) it says the answer alone."""
    from transformers import AutoTokenizer

    from minisgl_backend.tools.tiny import make_scripted_llama

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    tok.add_tokens(["<think>", "</think>"])  # Qwen3's: one token each, not special
    tok.chat_template = QWEN3_TEMPLATE
    said = tok.encode(REASONING, add_special_tokens=False)
    history = [{"role": "user", "content": "x"}]
    entry = tok.encode(tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True))
    assert len(set(said)) == len(said) and entry[-1] not in said  # one successor per token
    script = dict(zip([entry[-1], *said], [*said, tok.eos_token_id]))
    path = make_scripted_llama(tmp_path_factory.mktemp("scripted-qwen3"), tok, script)
    with Engine(EngineConfig(model=str(path), num_threads=1, stats_interval_s=0, num_blocks=64)) as eng:
        yield eng


@pytest.mark.slow
def test_think_end_token_strips_the_reasoning_before_scoring(thinker, tmp_path):
    """lm-eval's own pipeline (simple_evaluate, a one-question task, answer 42, chat template).
    Without think_end_token the task's "\\n\\n" stops the engine inside the trace and the regex
    scores its 13; with it (as a string, or as the token id the hf backend also takes) only EOS
    stops the engine, the answer is what follows the trace, and it scores 1."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    data = tmp_path / "think.jsonl"
    data.write_text(json.dumps({"question": "What is 40 + 2?", "answer": "42"}) + "\n")
    (tmp_path / "think_gen.yaml").write_text(THINK_TASK.format(data=data))
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)  # indexing lm-eval's: 12 s

    def run(**model_kwargs) -> tuple[float, str]:
        lm = MiniSGLLM(engine=thinker, **model_kwargs)
        res = simple_evaluate(
            model=lm, tasks=["think_gen"], task_manager=tasks, apply_chat_template=True, log_samples=True
        )
        (sample,) = res["samples"]["think_gen"]
        return res["results"]["think_gen"]["exact_match,first-number"], sample["resps"][0][0]

    assert run() == (0.0, "<think>Maybe 13")
    assert run(think_end_token="</think>") == (1.0, "42")
    end_id = str(thinker.tokenizer.convert_tokens_to_ids("</think>"))
    assert run(think_end_token=end_id, enable_thinking=True) == (1.0, "42")
    # enable_thinking=false reaches the template: its pre-filled trace leaves the model the answer.
    assert run(enable_thinking=False) == (1.0, "</think>42")


def test_chat_template_args_and_enable_thinking_reach_the_template(thinker):
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>a</think>b"}]
    history.append({"role": "user", "content": "Again"})

    def render(**kw) -> str:
        return MiniSGLLM(engine=thinker, **kw).apply_chat_template(history)

    on, off = render(), render(enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n") and "a</think>" not in on  # old traces dropped
    assert off == on + "<think>\n\n</think>\n\n"
    assert render(chat_template_args={"enable_thinking": False}) == off
    assert render(chat_template_args='{"enable_thinking": false}') == off  # key=value model_args give JSON
    # enable_thinking overrides the same key in chat_template_args (lm-eval's hf rule)
    assert (
        render(chat_template_args={"enable_thinking": False}, enable_thinking=True, think_end_token="x") == on
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"enable_thinking": True}, "enable_thinking=True needs think_end_token"),
        ({"chat_template_args": {"enable_thinking": True}}, "needs think_end_token"),
        ({"enable_thinking": "yes"}, "enable_thinking must be true or false"),
        ({"think_end_token": ""}, "think_end_token must be a non-empty string or a token id"),
        ({"think_end_token": True}, "think_end_token must be"),
        ({"think_end_token": -1}, "think_end_token must be"),
        ({"think_end_token": 10**9}, "not a token of the tokenizer"),
        ({"chat_template_args": "[1, 2]"}, "chat_template_args must be a dict"),
        ({"chat_template_args": "{oops"}, "chat_template_args must be a dict or its JSON"),
    ],
)
def test_bad_thinking_args_are_config_errors(thinker, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        MiniSGLLM(engine=thinker, **kwargs)


def test_enable_thinking_refuses_loglikelihood_tasks(thinker):
    lm = MiniSGLLM(engine=thinker, enable_thinking=True, think_end_token="</think>")
    with pytest.raises(ConfigError, match="not compatible with loglikelihood tasks"):
        lm.loglikelihood(_ll(("a", " b")))


def test_a_special_token_marker_is_matched_by_its_id(thinker):
    """The engine decodes with skip_special_tokens, so a marker that is one special token would never
    be in the text: it is matched as a token id instead. A plain added token stays a string."""
    eos = thinker.tokenizer.eos_token  # special
    assert MiniSGLLM(engine=thinker, think_end_token=eos).think_end_token == thinker.tokenizer.eos_token_id
    assert MiniSGLLM(engine=thinker, think_end_token="</think>").think_end_token == "</think>"


# ------------------------------------------------------------------------ reproducible by default
@pytest.mark.slow
def test_deterministic_is_the_default_unless_the_user_sets_it(tiny_model_dir, tmp_path):
    base = {"pretrained": str(tiny_model_dir), "num_threads": 1, "stats_interval_s": 0}
    preset = tmp_path / "fast.yaml"
    preset.write_text("deterministic: false\n")
    for kwargs, expected in (({}, True), ({"deterministic": False}, False), ({"config": str(preset)}, False)):
        lm = MiniSGLLM(**base, **kwargs)
        try:
            assert lm.engine.config.deterministic is expected, kwargs
        finally:
            lm.close()


@pytest.mark.slow
def test_default_runs_score_the_same_at_max_num_seqs_4_and_64(tmp_path_factory, monkeypatch):
    """The local tasks (loglikelihood, generation, perplexity) through simple_evaluate, on a random
    model with SmolLM2-135M's widths (2 layers): with the default forward its loglikelihood bits
    change with the batch on this CPU (with deterministic=false, every one of these multiple-choice
    docs between these two runs; SmolLM2's own perplexity in the 7th digit); by default every score
    and every per-request response is the same, bitwise."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from minisgl_backend.tools.tiny import make_random_llama

    path = make_random_llama(tmp_path_factory.mktemp("smol2"), "smol2")
    monkeypatch.chdir(ROOT)  # the tasks' data paths are relative to the repository
    tasks = TaskManager(include_path=str(ROOT / "configs" / "tasks"), include_defaults=False)
    runs = {}
    for seqs in (4, 64):
        lm = MiniSGLLM(
            pretrained=str(path), dtype="float32", num_threads=1, stats_interval_s=0, max_num_seqs=seqs
        )
        try:
            assert lm.engine.config.deterministic is True and lm.engine.config.max_num_seqs == seqs
            res = simple_evaluate(
                model=lm,
                tasks=["minisgl_mc", "minisgl_gen", "minisgl_ppl"],
                task_manager=tasks,
                limit=8,
                log_samples=True,
            )
        finally:
            lm.close()
        resps = {t: [s["resps"] for s in samples] for t, samples in res["samples"].items()}
        runs[seqs] = (res["results"], resps)
    assert sum(len(r) for r in runs[4][1].values()) == 3 * 8
    assert runs[4] == runs[64]


@pytest.mark.parametrize("device, deterministic", [("cpu", True), ("cuda", False)])
def test_the_deterministic_default_is_for_the_cpu(monkeypatch, device, deterministic):
    """The adapter turns the deterministic mode on by default where it is proven (the CPU); on
    CUDA, where the engine refuses it, it leaves the mode off rather than fail every run."""
    import lm_eval_minisgl.model as adapter
    import torch

    seen = {}

    def fake_engine(cfg, *rest):
        seen["cfg"] = cfg
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(adapter, "make_engine", fake_engine)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="stop before loading"):
        MiniSGLLM(pretrained="x", device=device)
    assert seen["cfg"].device == device and seen["cfg"].deterministic is deterministic
    with pytest.raises(ConfigError, match="deterministic: true is proven for the CPU kernels only"):
        EngineConfig(device="cuda", deterministic=True)


def test_the_cpu_block_size_default_shares_more_of_each_context(tiny_model_dir):
    """Unless the user sets a block size, the adapter's KV blocks on the CPU are smaller than the
    engine's: four continuations of one context that ends 12 tokens into a 16-token block compute
    the context once and then only their own tail, with the same loglikelihoods; at 16 tokens a
    block each recomputes those 12 tokens."""
    base = {"pretrained": str(tiny_model_dir), "num_threads": 1, "stats_interval_s": 0, "metrics_exact": True}
    runs = {}
    for kwargs in ({}, {"block_size": 16}):
        lm = MiniSGLLM(**base, **kwargs)
        try:
            tok = lm.tokenizer
            words = ["alpha"]
            while len(tok(" ".join(words))["input_ids"]) % 16 != 12:
                words.append("beta")
            context = " ".join(words)
            reqs = _ll(*[(context, f" {w}") for w in ("red", "green", "blue", "gray")])
            before = lm.engine.metrics().get("prefill_tokens", 0.0)
            scores = [r[0] for r in lm.loglikelihood(reqs)]
            runs[lm.engine.config.block_size] = (lm.engine.metrics()["prefill_tokens"] - before, scores)
        finally:
            lm.close()
    assert set(runs) == {8, 16}
    (small, small_scores), (large, large_scores) = runs[8], runs[16]
    assert small_scores == large_scores
    assert large - small >= 3 * 8, f"prompt tokens computed: {small} at block 8, {large} at block 16"
