"""Real clients against `minisgl serve` on the embedded SmolLM2 (fp32, deterministic mode): lm-eval's
`local-completions` (loglikelihood + generation, remote tokenizer) against `--model minisgl`, the
`openai` SDK, and LangChain's `ChatOpenAI`."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from minisgl_backend import Engine, EngineConfig  # noqa: E402
from minisgl_backend.serve import start_in_thread  # noqa: E402
from tests.serve.servers import streamed_chat, streamed_completion  # noqa: E402

pytestmark = pytest.mark.slow  # slow tier: a server of the embedded model, lm-eval runs against it

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-clients"
MODEL = "smollm2"
ENGINE = dict(
    model="smollm2-135m-instruct",
    dtype="float32",
    deterministic=True,
    stats_interval_s=0,
    seed=1234,
    num_threads=1,
)


@pytest.fixture(scope="module")
def server():
    engine = Engine(EngineConfig(**ENGINE))
    srv = start_in_thread(engine, api_key=KEY, model_name=MODEL)
    yield srv
    srv.stop()
    counts = engine.drain(timeout=60, flush_cache=True)
    assert counts["FREE"] == engine.num_blocks and counts["running"] == 0
    engine.close()


def _samples(results: dict, task: str) -> dict[int, list]:
    return {s["doc_id"]: s["resps"] for s in results["samples"][task]}


def test_lm_eval_local_completions_matches_the_in_process_model(server, monkeypatch):
    """The same tasks through HTTP (`local-completions`, `tokenizer_backend=remote`) and in process
    (`minisgl`): per-request loglikelihoods bitwise equal (deterministic mode on both), the same
    is-greedy flags, identical greedy generations, so identical scores."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval_minisgl.model import MiniSGLLM

    monkeypatch.setenv(
        "OPENAI_API_KEY", KEY
    )  # local-completions sends it as the bearer token; auth_token: the tokenizer
    tm = TaskManager(include_path=str(REPO / "configs" / "tasks"))
    tasks = ["minisgl_mc", "minisgl_gen"]
    limit = 8
    seeds = dict(random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    run = dict(tasks=tasks, task_manager=tm, limit=limit, log_samples=True, **seeds)
    http = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url={server.url}/v1/completions,tokenizer_backend=remote,model={MODEL},batch_size=8,num_concurrent=2,auth_token={KEY}",
        **run,
    )
    local_model = MiniSGLLM(
        pretrained=ENGINE["model"], dtype="float32", deterministic=True, stats_interval_s=0, num_threads=1
    )
    try:
        local = lm_eval.simple_evaluate(model=local_model, **run)
    finally:
        local_model.close()
    a, b = _samples(http, "minisgl_mc"), _samples(local, "minisgl_mc")
    assert sorted(a) == sorted(b) == list(range(limit))
    n = 0
    for doc in a:
        for (ll_h, greedy_h), (ll_l, greedy_l) in zip((r[0] for r in a[doc]), (r[0] for r in b[doc])):
            assert ll_h == ll_l and greedy_h == greedy_l, (doc, ll_h, ll_l)
            n += 1
    assert n == 4 * limit
    ga, gb = _samples(http, "minisgl_gen"), _samples(local, "minisgl_gen")
    assert ga == gb and sorted(ga) == list(range(limit))
    for task in tasks:
        assert http["results"][task] == local["results"][task]


def _docs_http_recipe() -> list[str]:
    """The `lm_eval --model local-completions` command of docs/serving.md's "lm-eval over HTTP", as argv."""
    page = (REPO / "docs" / "serving.md").read_text()
    block = page[page.index("## lm-eval over HTTP") :].split("```bash\n", 1)[1].split("```", 1)[0]
    command = block[block.index("lm_eval --model local-completions") :].replace("\\\n", " ")
    return shlex.split(command)


def test_docs_http_recipe_runs_through_the_lm_eval_cli(server, tmp_path):
    """The docs' command as written (server address and key aside), through lm-eval's own CLI,
    from a directory without the tasks: they come from the installed package."""
    argv = _docs_http_recipe()
    assert argv[:3] == ["lm_eval", "--model", "local-completions"] and "--batch_size" in argv
    i = argv.index("--model_args") + 1
    assert "http://127.0.0.1:8000" in argv[i]
    argv[i] = argv[i].replace("http://127.0.0.1:8000", server.url) + f",auth_token={KEY}"
    argv[0] = str(Path(sys.executable).parent / "lm_eval")
    out = tmp_path / "out"
    env = {**os.environ, "OPENAI_API_KEY": KEY, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [*argv, "--limit", "2", "--output_path", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    assert set(results) == {"minisgl_mc", "minisgl_gen"}
    assert 0 <= results["minisgl_mc"]["acc,none"] <= 1
    assert "exact_match,first-number" in results["minisgl_gen"]


def test_openai_sdk_completions_chat_and_streaming(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    assert [m.id for m in client.models.list()] == [MODEL]
    c = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2
    )
    assert c.choices[0].text and c.usage.completion_tokens == len(c.choices[0].logprobs.tokens)
    assert streamed_completion(client, MODEL, "The capital of France is", 8) == c.choices[0].text
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_completion_tokens=16, temperature=0, seed=1
    )
    assert "Paris" in r.choices[0].message.content and r.usage.prompt_tokens > 5
    text, chunks = streamed_chat(client, MODEL, msgs, 16)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong").models.list()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=msgs)


def test_openai_sdk_forced_tool_call_and_json_schema(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[tool],
        tool_choice="required",
        temperature=0,
        max_tokens=64,
    )
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is 2+2?"}],
        temperature=0,
        max_tokens=32,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    assert isinstance(json.loads(r.choices[0].message.content)["answer"], int)


def test_langchain_chat_openai_invoke_stream_and_tools(server):
    lco = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    chat = lco.ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model=MODEL, temperature=0, max_tokens=16)
    m = chat.invoke("What is the capital of France?")
    assert "Paris" in m.content and m.usage_metadata["output_tokens"] > 0
    assert m.response_metadata["model_name"] == MODEL
    chunks = list(chat.stream("What is the capital of France?"))
    assert "".join(c.content for c in chunks) == m.content

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    msg = chat.bind_tools([add], tool_choice="add").invoke("Add 2 and 3.", max_tokens=64)
    assert (
        msg.tool_calls and msg.tool_calls[0]["name"] == "add" and set(msg.tool_calls[0]["args"]) == {"a", "b"}
    )
