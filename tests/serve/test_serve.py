"""`minisgl serve` on the tiny random model: shapes, bad input, auth, overload, disconnects, metrics,
many concurrent streaming clients, health and graceful shutdown. One server for the module, on a
free port of 127.0.0.1, with the engine reachable through the app state for the KV checks."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minisgl_backend import Engine, EngineConfig, SamplingParams  # noqa: E402
from tests.helpers import assert_drained  # noqa: E402
from tests.serve.servers import TINY_ENGINE, assert_serves, checked_bench, serving, start_serve  # noqa: E402

KEY = "sk-test-key"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_WAITING = 48


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), **TINY_ENGINE, max_waiting_requests=MAX_WAITING)
    with serving(config, key=KEY, model=MODEL) as srv:
        srv.state.keep_finished(100_000)  # the tests read which requests finished how
        yield srv


def _engine(server) -> Engine:
    return server.state.engine


def _drained_free(server) -> None:
    assert_drained(_engine(server))


def _greedy(engine: Engine, prompt, n: int, **kw):
    return engine.generate([prompt], SamplingParams(temperature=0, max_tokens=n, **kw), use_tqdm=False)[0]


def _sse_events(lines) -> list:
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ----------------------------------------------------------------------------------------- completions
def test_completion_prompt_forms_give_one_choice_each_and_match_the_engine(server, client):
    eng = _engine(server)
    ids = list(eng.tokenizer.encode("The quick brown fox"))
    ref_text = _greedy(eng, "The quick brown fox", 6).text
    ref_other = _greedy(eng, [5, 6, 7, 8], 6).text
    cases = [
        ("The quick brown fox", [ref_text]),
        (["The quick brown fox", "The quick brown fox"], [ref_text] * 2),
        (ids, [ref_text]),
        ([ids, [5, 6, 7, 8]], [ref_text, ref_other]),
    ]
    for prompt, expected in cases:
        r = client.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == MODEL
        assert [c["index"] for c in body["choices"]] == list(range(len(expected)))
        assert [c["text"] for c in body["choices"]] == expected
        assert body["usage"]["completion_tokens"] == 6 * len(expected)
        assert (
            body["usage"]["total_tokens"]
            == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        )


def test_echo_logprobs_are_what_lm_eval_local_completions_reads(server, client):
    eng = _engine(server)
    ids = list(eng.tokenizer.encode("Question: what is two plus two?\nAnswer: four"))
    ref = eng.generate(
        [ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, logprobs=1), use_tqdm=False
    )[0]
    for max_tokens in (1, 0):
        r = client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": ids,
                "max_tokens": max_tokens,
                "temperature": 0,
                "logprobs": 1,
                "echo": True,
                "seed": 1234,
            },
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        assert (
            len(lp["token_logprobs"]) == len(ids) + max_tokens == len(lp["top_logprobs"]) == len(lp["tokens"])
        )
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for i in range(1, len(ids)):
            assert lp["token_logprobs"][i] == ref.prompt_logprobs[i].logprob  # bitwise through JSON
            top = lp["top_logprobs"][i]
            assert max(top.values()) == ref.prompt_logprobs[i].top[0][1]  # the argmax is in the dict
            assert (lp["token_logprobs"][i] == max(top.values())) == (ref.prompt_logprobs[i].rank == 1)
        if max_tokens:
            assert lp["token_logprobs"][-1] == ref.logprobs[0].logprob
        assert r.json()["usage"]["completion_tokens"] == max_tokens
        assert choice["text"].startswith(eng.tokenizer.decode(ids))


def _streamed_choices(events: list, n: int) -> list[dict]:
    """Per choice index: its text, finish_reason, chunks with logprobs and the logprobs concatenated."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    out = [{"text": "", "finish": None, "lp_chunks": [], **{k: [] for k in keys}} for _ in range(n)]
    for ev in events:
        (c,) = ev["choices"]
        o = out[c["index"]]
        o["text"] += c["text"]
        o["finish"] = c["finish_reason"] or o["finish"]
        if c["logprobs"] is not None:
            o["lp_chunks"].append(c)
            for k in keys:
                o[k] += c["logprobs"][k]
    return out


def test_streaming_completion_equals_the_non_streamed_one(client):
    """Text, finish reasons, usage, and each chunk's own tokens' logprobs (OpenAI's shape, offsets
    into the choice's text) that add up to the non-streamed ones; with echo, the prompt's first."""
    req = {
        "model": MODEL,
        "prompt": ["Once upon a time", "In a galaxy"],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": 2,
    }
    for extra in ({}, {"echo": True, "prompt": "Once upon a time", "max_tokens": 4}):
        whole = client.post("/v1/completions", json={**req, **extra}).json()
        with client.stream(
            "POST",
            "/v1/completions",
            json={**req, **extra, "stream": True, "stream_options": {"include_usage": True}},
        ) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = _sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        usage = events[-2]
        assert usage["choices"] == [] and usage["usage"] == whole["usage"]
        streamed = _streamed_choices(events[:-2], len(whole["choices"]))
        for got, want in zip(streamed, whole["choices"]):
            lp = want["logprobs"]
            assert got["text"] == want["text"] and got["finish"] == want["finish_reason"]
            assert got["tokens"] == lp["tokens"] and got["text_offset"] == lp["text_offset"]
            # the values to rounding: the streamed run reads the prompt from the prefix cache
            near = [v if v is None else pytest.approx(v, abs=1e-5) for v in lp["token_logprobs"]]
            assert got["token_logprobs"] == near
            assert [t and set(t) for t in got["top_logprobs"]] == [t and set(t) for t in lp["top_logprobs"]]
            chunks = got["lp_chunks"]
            if extra:  # the echo first, with the prompt's logprobs (the first token has none)
                assert (
                    chunks[0]["text"] == "Once upon a time"
                    and chunks[0]["logprobs"]["token_logprobs"][0] is None
                )
            assert len(chunks) > 1 and all(c["finish_reason"] is None for c in chunks)  # not all at the end


def test_stop_strings_and_seeded_sampling(server, client):
    base = {"model": MODEL, "prompt": "Tell me", "max_tokens": 16, "temperature": 0.9, "seed": 7}
    a = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    b = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    assert a == b  # seeded: the same sample every time
    ref = _engine(server).generate(
        ["Tell me"], SamplingParams(temperature=0.9, seed=7, max_tokens=16), use_tqdm=False
    )[0]
    assert a == ref.text
    if len(a) > 4:
        stop = a[2:4]
        c = client.post("/v1/completions", json={**base, "stop": stop}).json()["choices"][0]
        assert c["finish_reason"] == "stop" and stop not in c["text"] and a.startswith(c["text"])


def test_penalties_and_logit_bias_reach_the_engine(server, client):
    """OpenAI's presence_penalty / frequency_penalty / logit_bias (string keys) and vLLM's
    repetition_penalty are the engine's SamplingParams fields, on both endpoints and when streamed."""
    eng = _engine(server)
    forced = eng.tokenizer.decode([4242] * 5)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0.9, "seed": 3}
    r = client.post("/v1/completions", json={**body, "logit_bias": {"4242": 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == forced
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
    r = client.post("/v1/chat/completions", json={**chat, "logit_bias": {"4242": 100}, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == forced
    # The tiny model's distribution is flat: a bias makes a few tokens likely for the penalties to act on.
    bias = {13: 8.0, 200: 6.0}
    knobs = {"presence_penalty": 1.0, "frequency_penalty": 1.5, "repetition_penalty": 1.7}
    texts = {}
    for name, extra in (("bias", {}), ("all", knobs)):
        payload = {**body, "max_tokens": 16, "logit_bias": {str(k): v for k, v in bias.items()}, **extra}
        r = client.post("/v1/completions", json=payload)
        assert r.status_code == 200, r.text
        texts[name] = r.json()["choices"][0]["text"]
        ref = eng.generate(
            ["Hello"],
            SamplingParams(temperature=0.9, seed=3, max_tokens=16, logit_bias=bias, **extra),
            use_tqdm=False,
        )[0]
        assert texts[name] == ref.text, name
        with client.stream("POST", "/v1/completions", json={**payload, "stream": True}) as resp:
            events = _sse_events(resp.iter_lines())
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == ref.text
    assert texts["all"] != texts["bias"]


def _choices_by_index(events) -> tuple[dict[int, str], dict[int, str], dict[int, str]]:
    """Streamed chunks folded per choice index: (text / content, finish_reason, role)."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    roles: dict[int, str] = {}
    for ev in events:
        for c in ev["choices"]:
            part = c["text"] if "text" in c else (c["delta"].get("content") or "")
            texts[c["index"]] = texts.get(c["index"], "") + part
            if c["finish_reason"]:
                assert c["index"] not in finish  # one finish per choice
                finish[c["index"]] = c["finish_reason"]
            if "delta" in c and "role" in c["delta"]:
                roles[c["index"]] = c["delta"]["role"]
    return texts, finish, roles


def test_n_gives_n_choices_per_prompt_on_both_endpoints_streamed_or_not(server, client):
    """Completions: choice prompt * n + sample, each the engine's sample; chat: n choices, choice 0
    the n = 1 answer. Streamed chunks carry their choice's index and add up to the whole answer."""
    eng = _engine(server)
    prompts = ["Once upon a time", "In a galaxy"]
    sampling = {"temperature": 0.9, "seed": 5, "max_tokens": 8}
    ref = eng.generate(prompts, SamplingParams(**sampling, n=3, ignore_eos=True), use_tqdm=False)
    body = {"model": MODEL, "prompt": prompts, **sampling, "n": 3, "logprobs": 1, "ignore_eos": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    whole = r.json()
    assert [c["index"] for c in whole["choices"]] == list(range(6))
    assert [c["text"] for c in whole["choices"]] == [s.text for o in ref for s in o.samples]
    assert all(len(c["logprobs"]["tokens"]) == 8 for c in whole["choices"])
    assert whole["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in ref)  # each prompt once
    assert whole["usage"]["completion_tokens"] == 6 * 8
    with client.stream(
        "POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ) as r:
        events = _sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["usage"] == whole["usage"]
    texts, finish, _ = _choices_by_index(events[:-2])
    assert [texts[i] for i in range(6)] == [c["text"] for c in whole["choices"]]
    assert [finish[i] for i in range(6)] == ["length"] * 6

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **sampling}
    one = client.post("/v1/chat/completions", json=chat).json()["choices"]
    two = client.post("/v1/chat/completions", json={**chat, "n": 2}).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][0]["message"] == one[0]["message"]  # sample 0 is the n = 1 answer
    assert two["choices"][0]["message"]["content"] != two["choices"][1]["message"]["content"]
    assert two["usage"]["completion_tokens"] == 16
    with client.stream("POST", "/v1/chat/completions", json={**chat, "n": 2, "stream": True}) as r:
        events = _sse_events(r.iter_lines())
    texts, finish, roles = _choices_by_index(events[:-1])
    assert roles == {0: "assistant", 1: "assistant"}
    assert [texts[i] for i in (0, 1)] == [c["message"]["content"] for c in two["choices"]]
    assert [finish[i] for i in (0, 1)] == [c["finish_reason"] for c in two["choices"]]
    _drained_free(server)


# ------------------------------------------------------------------------------------------------ chat
def test_chat_completion_stream_and_non_stream(server, client):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    req = {
        "model": MODEL,
        "messages": msgs,
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = client.post("/v1/chat/completions", json=req).json()
    (choice,) = whole["choices"]
    assert whole["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert len(choice["logprobs"]["content"]) == whole["usage"]["completion_tokens"] == 10
    assert all(len(e["top_logprobs"]) == 2 for e in choice["logprobs"]["content"])
    eng = _engine(server)
    prompt = eng.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert whole["usage"]["prompt_tokens"] == len(eng.tokenizer.encode(prompt, add_special_tokens=False))
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={**req, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        events = _sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["usage"] == whole["usage"]
    deltas = [ev["choices"][0] for ev in events[:-2]]
    assert deltas[0]["delta"]["role"] == "assistant"
    assert "".join(d["delta"].get("content") or "" for d in deltas) == choice["message"]["content"]
    assert deltas[-1]["finish_reason"] == choice["finish_reason"]
    assert all(ev["object"] == "chat.completion.chunk" for ev in events[:-2])
    # Logprobs stream with their tokens, chunk by chunk, and add up to the non-streamed ones (the
    # values to rounding: the second run reads the prompt from the prefix cache).
    streamed = [e for d in deltas if d["logprobs"] for e in d["logprobs"]["content"]]
    whole_lps = choice["logprobs"]["content"]
    assert [e["token"] for e in streamed] == [e["token"] for e in whole_lps]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in whole_lps], abs=1e-5)
    assert sum(1 for d in deltas if d["logprobs"]) > 1 and deltas[-1]["logprobs"] is None


ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def test_forced_tool_call_parses_even_from_a_random_model(client):
    for i in range(3):
        req = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Add {i} and 2."}],
            "tools": [ADD_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "add"}},
            "temperature": 1.0,
            "seed": i,
            "max_tokens": 160,
        }
        r = client.post("/v1/chat/completions", json=req)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert (
            call["type"] == "function"
            and call["function"]["name"] == "add"
            and call["id"].startswith("call_")
        )
        args = json.loads(call["function"]["arguments"])
        assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    # streamed: the call arrives as one tool_calls delta, then finish_reason tool_calls
    with client.stream(
        "POST", "/v1/chat/completions", json={**req, "tool_choice": "required", "stream": True}
    ) as r:
        events = _sse_events(r.iter_lines())
    deltas = [ev["choices"][0] for ev in events[:-1]]
    calls = [d["delta"]["tool_calls"] for d in deltas if d["delta"].get("tool_calls")]
    assert len(calls) == 1 and calls[0][0]["function"]["name"] == "add" and calls[0][0]["index"] == 0
    json.loads(calls[0][0]["function"]["arguments"])
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_tool_results_in_the_conversation_render(client):
    msgs = [
        {"role": "user", "content": "Add 1 and 2."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": msgs, "tools": [ADD_TOOL], "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text


def test_response_format_json_schema_constrains_the_output(client):
    """A JSON response_format is decoded as a forced call of a tool made from it (the tool-call
    grammar) and answered as plain content, finish_reason "stop"; streamed, that content arrives
    chunk by chunk. Even the random model's reply parses."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "unit": {"enum": ["C", "F"]}},
        "required": ["ok", "unit"],
        "additionalProperties": False,
    }  # bounded: it always terminates
    for fmt in (
        {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        {"type": "json_object"},
    ):
        req = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Reply."}],
            "response_format": fmt,
            "temperature": 1.0,
            "seed": 3,
            "max_tokens": 200,
        }
        r = client.post("/v1/chat/completions", json=req)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        message = choice["message"]
        assert "tool_calls" not in message
        with client.stream("POST", "/v1/chat/completions", json={**req, "stream": True}) as resp:
            deltas = [ev["choices"][0] for ev in _sse_events(resp.iter_lines())[:-1]]
        pieces = [d["delta"]["content"] for d in deltas if d["delta"].get("content")]
        assert "".join(pieces) == message["content"]  # seeded: the same reply, streamed
        assert deltas[-1]["finish_reason"] == choice["finish_reason"]
        assert not any(d["delta"].get("tool_calls") for d in deltas)
        if choice["finish_reason"] == "length" and fmt["type"] == "json_object":
            assert message["content"].startswith("{")  # cut short, but the arguments, not the call
            continue  # a free-form object may run past max_tokens: no grammar can prevent that
        assert choice["finish_reason"] == "stop" and len(pieces) > 1
        obj = json.loads(message["content"])
        assert isinstance(obj, dict)
        if fmt["type"] == "json_schema":
            assert set(obj) == {"ok", "unit"} and isinstance(obj["ok"], bool) and obj["unit"] in ("C", "F")
    # With tools and tool_choice auto, the reply is a call of a bound tool or the format's JSON
    # (these seeds give both on the random model).
    seen = set()
    for seed in range(4):
        req = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Add 1 and 2."}],
            "tools": [ADD_TOOL],
            "response_format": {"type": "json_schema", "json_schema": {"name": "add", "schema": schema}},
            "temperature": 1.0,
            "seed": seed,
            "max_tokens": 200,
        }
        (choice,) = client.post("/v1/chat/completions", json=req).json()["choices"]
        message, finish = choice["message"], choice["finish_reason"]
        seen.add(finish)
        if finish == "tool_calls":
            (call,) = message["tool_calls"]
            assert call["function"]["name"] == "add"
            assert set(json.loads(call["function"]["arguments"])) == {"a", "b"}
        else:  # the format's tool, renamed so as not to shadow the bound "add"
            assert finish == "stop" and set(json.loads(message["content"])) == {"ok", "unit"}
    assert seen == {"tool_calls", "stop"}


# ------------------------------------------------------------------------------------- other endpoints
def test_models_tokenize_detokenize_tokenizer_info(server, client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    info = client.get("/tokenizer_info").json()
    tok = _engine(server).tokenizer
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template
    t = client.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
    assert t["tokens"] == list(tok.encode("hello world", add_special_tokens=False)) and t["count"] == len(
        t["tokens"]
    )
    assert t["max_model_len"] == _engine(server).max_model_len
    t2 = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert t2["count"] > 3
    d = client.post("/detokenize", json={"tokens": t["tokens"]}).json()
    assert d == {"prompt": "hello world"}
    # lm-eval's probe of a remote tokenizer backend
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    url = f"{server.url}/v1/completions"
    assert check_remote_tokenizer_support(url, auth_token=KEY)
    rt = RemoteTokenizer(url, auth_token=KEY)
    assert rt.eos_token_id == tok.eos_token_id and rt.decode(rt.encode("abc def")) == "abc def"


# ------------------------------------------------------------------------------------------- OpenAPI
ENDPOINTS = {
    "/health": {"get"},
    "/ping": {"get", "post"},
    "/version": {"get"},
    "/v1/models": {"get"},
    "/v1/models/{model_id}": {"get"},
    "/tokenizer_info": {"get"},
    "/tokenize": {"post"},
    "/detokenize": {"post"},
    "/metrics": {"get"},
    "/v1/completions": {"post"},
    "/v1/chat/completions": {"post"},
}


def _openapi(server) -> dict:
    with httpx.Client(base_url=server.url, timeout=10) as c:  # no key: the docs are open, as vLLM's
        docs = c.get("/docs")
        assert docs.status_code == 200 and docs.headers["content-type"].startswith("text/html")
        r = c.get("/openapi.json")
    assert r.status_code == 200, r.text
    return r.json()


def _refs(obj) -> set[str]:
    if isinstance(obj, dict):
        return {obj["$ref"]} if "$ref" in obj else set().union(*map(_refs, obj.values()))
    if isinstance(obj, list):
        return set().union(*map(_refs, obj))
    return set()


def test_openapi_lists_every_endpoint_and_every_reference_resolves(server):
    doc = _openapi(server)
    assert {path: set(ops) for path, ops in doc["paths"].items()} == ENDPOINTS
    schemas = doc["components"]["schemas"]
    assert {ref.removeprefix("#/components/schemas/") for ref in _refs(doc)} <= set(schemas)


def test_openapi_request_bodies_are_what_the_server_accepts(server, client):
    from minisgl_backend.serve.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        DetokenizeRequest,
        TokenizeRequest,
    )

    doc = _openapi(server)
    for path, model in [
        ("/v1/completions", CompletionRequest),
        ("/v1/chat/completions", ChatCompletionRequest),
        ("/tokenize", TokenizeRequest),
        ("/detokenize", DetokenizeRequest),
    ]:
        body = doc["paths"][path]["post"]["requestBody"]
        schema = body["content"]["application/json"]["schema"]
        fields = {f.alias or name for name, f in model.model_fields.items()}
        assert body["required"] and set(schema["properties"]) == fields, path
        assert schema["additionalProperties"] is False, path  # unknown fields are a 400
    props = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert props["required"] == ["prompt"]
    assert {"max_tokens", "logprobs", "echo", "n", "stop", "stream_options", "logit_bias", "seed"} <= set(
        props["properties"]
    )
    assert {"top_k", "min_p", "repetition_penalty", "guided_json", "structured_outputs"} <= set(
        props["properties"]
    )
    # Every field at the default the schema documents is accepted.
    defaults = {k: v["default"] for k, v in props["properties"].items() if "default" in v}
    r = client.post("/v1/completions", json={**defaults, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "field,value",
    [
        ("stop", [""]),
        ("stop", ""),
        ("stop", [f"s{i}" for i in range(17)]),
        ("logit_bias", {"00005": 1}),
        ("logit_bias", {"five": 1}),
        ("logit_bias", {"12345678901": 1}),
        ("logit_bias", {"5": 101}),
    ],
)
def test_the_documented_schema_refuses_what_the_server_refuses(server, client, field, value):
    """A client (or a test generator) built from /openapi.json sends no body the server answers
    400: the schema is no looser than the checks."""
    import jsonschema

    doc = _openapi(server)
    documented = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    schema = {**documented["schema"], "components": doc["components"]}
    body = {"prompt": "x", "max_tokens": 1, field: value}
    r = client.post("/v1/completions", json={**body, "model": MODEL})
    assert r.status_code == 400, r.text
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body, schema)
    jsonschema.validate({**body, field: {"stop": ["ok"], "logit_bias": {"5": 1}}[field]}, schema)


def _conforms(doc: dict, model, raw) -> None:
    """`raw` (a JSON text) is an instance of the response model and of its schema in /openapi.json,
    and the model describes all of it (a round trip through the model gives the same JSON)."""
    import jsonschema

    obj = json.loads(raw)
    ref = {"$ref": f"#/components/schemas/{model.__name__}", "components": doc["components"]}
    jsonschema.validate(obj, ref)
    assert json.loads(model.model_validate_json(raw).model_dump_json()) == obj


def test_responses_conform_to_their_response_models(server, client):
    from minisgl_backend.serve import responses

    doc = _openapi(server)
    ops = doc["paths"]
    for path, method, model in [
        ("/v1/completions", "post", responses.CompletionResponse),
        ("/v1/chat/completions", "post", responses.ChatCompletionResponse),
        ("/v1/models", "get", responses.ModelList),
        ("/tokenize", "post", responses.TokenizeResponse),
    ]:
        schema = ops[path][method]["responses"]["200"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{model.__name__}"}, path
    prompt = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    _conforms(doc, responses.CompletionResponse, client.post("/v1/completions", json=prompt).content)
    scored = {**prompt, "echo": True, "logprobs": 2}
    _conforms(doc, responses.CompletionResponse, client.post("/v1/completions", json=scored).content)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24}
    for extra in ({"logprobs": True, "top_logprobs": 2}, {"tools": tools, "tool_choice": "required"}):
        r = client.post("/v1/chat/completions", json={**chat, **extra})
        _conforms(doc, responses.ChatCompletionResponse, r.content)
    _conforms(doc, responses.ModelList, client.get("/v1/models").content)
    _conforms(doc, responses.TokenizeResponse, client.post("/tokenize", json={"prompt": "hi"}).content)
    # Stream chunks (not in the schema: the event stream has none) against their models.
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    for path, body, chunk in [
        ("/v1/completions", {**scored, **usage}, responses.CompletionChunk),
        (
            "/v1/chat/completions",
            {**chat, **usage, "tools": tools, "tool_choice": "required"},
            responses.ChatCompletionChunk,
        ),
    ]:
        with client.stream("POST", path, json=body) as r:
            events = [line[len("data: ") :] for line in r.iter_lines() if line]
        assert events[-1] == "[DONE]"
        *chunks, last = events[:-1]
        for raw in chunks:
            assert json.loads(chunk.model_validate_json(raw).model_dump_json()) == json.loads(raw)
        assert json.loads(responses.UsageChunk.model_validate_json(last).model_dump_json()) == json.loads(
            last
        )


# ------------------------------------------------------------------------------------------- bad input
LONG = "hello " * 2000  # > max_model_len (1024) tokens
BAD_REQUESTS = [
    # (name, method-path-body, expected status, expected param/code fragment)
    ("prompt wrong type", ("/v1/completions", {"prompt": 3}), 400, "prompt"),
    ("prompt list of mixed", ("/v1/completions", {"prompt": [1, "a"]}), 400, "prompt"),
    ("prompt missing", ("/v1/completions", {"max_tokens": 3}), 400, "prompt"),
    ("prompt empty string", ("/v1/completions", {"prompt": ""}), 400, "empty_prompt"),
    ("prompt empty list", ("/v1/completions", {"prompt": []}), 400, None),
    ("prompt empty token list", ("/v1/completions", {"prompt": [[1, 2], []]}), 400, None),
    ("prompt too long", ("/v1/completions", {"prompt": LONG}), 400, "context_length_exceeded"),
    ("token id out of range", ("/v1/completions", {"prompt": [1, 10**9]}), 400, "invalid_request"),
    ("negative token id", ("/v1/completions", {"prompt": [1, -5]}), 400, "invalid_request"),
    ("negative temperature", ("/v1/completions", {"prompt": "x", "temperature": -0.5}), 400, "temperature"),
    ("NaN temperature", ("/v1/completions", '{"prompt": "x", "temperature": NaN}'), 400, "temperature"),
    ("Infinity top_p", ("/v1/completions", '{"prompt": "x", "top_p": Infinity}'), 400, "top_p"),
    ("top_p zero", ("/v1/completions", {"prompt": "x", "top_p": 0}), 400, "top_p"),
    ("top_k float", ("/v1/completions", {"prompt": "x", "top_k": 1.5}), 400, "top_k"),
    ("min_p above 1", ("/v1/completions", {"prompt": "x", "min_p": 2}), 400, "min_p"),
    ("negative max_tokens", ("/v1/completions", {"prompt": "x", "max_tokens": -1}), 400, "max_tokens"),
    ("max_tokens string", ("/v1/completions", {"prompt": "x", "max_tokens": "5"}), 400, "max_tokens"),
    ("max_tokens 0 without echo", ("/v1/completions", {"prompt": "x", "max_tokens": 0}), 400, None),
    ("negative seed", ("/v1/completions", {"prompt": "x", "seed": -1}), 400, "seed"),
    ("logprobs too many", ("/v1/completions", {"prompt": "x", "logprobs": 50}), 400, "logprobs"),
    (
        "presence_penalty above 2",
        ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}),
        400,
        "presence_penalty",
    ),
    (
        "frequency_penalty below -2",
        ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}),
        400,
        "frequency_penalty",
    ),
    (
        "repetition_penalty 0",
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}),
        400,
        "repetition_penalty",
    ),
    (
        "logit_bias above 100",
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 150}}),
        400,
        "logit_bias",
    ),
    (
        "logit_bias bias string",
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": "1"}}),
        400,
        "logit_bias",
    ),
    ("logit_bias key not an id", ("/v1/completions", {"prompt": "x", "logit_bias": {"five": 1}}), 400, None),
    ("logit_bias negative id", ("/v1/completions", {"prompt": "x", "logit_bias": {"-1": 1}}), 400, None),
    (
        "logit_bias id outside the vocabulary",
        ("/v1/completions", {"prompt": "x", "logit_bias": {"10000000": 1}}),
        400,
        "invalid_sampling_params",
    ),
    (
        "chat logit_bias id outside the vocabulary",
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"49152": 1}},
        ),
        400,
        "invalid_sampling_params",
    ),
    ("n above 128", ("/v1/completions", {"prompt": "x", "n": 129}), 400, "n"),
    ("n 0", ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}), 400, "n"),
    ("unknown field", ("/v1/completions", {"prompt": "x", "frobnicate": True}), 400, "frobnicate"),
    ("empty stop string", ("/v1/completions", {"prompt": "x", "stop": [""]}), 400, None),
    ("stream not bool", ("/v1/completions", {"prompt": "x", "stream": "yes"}), 400, "stream"),
    ("bad JSON", ("/v1/completions", '{"prompt": "x",'), 400, "invalid_json"),
    ("body not an object", ("/v1/completions", "[1, 2]"), 400, None),
    ("unknown model", ("/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404, "model_not_found"),
    (
        "chat unknown role",
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
        400,
        "role",
    ),
    ("chat no messages", ("/v1/chat/completions", {"messages": []}), 400, "messages"),
    (
        "chat image part",
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ]
            },
        ),
        400,
        None,
    ),
    ("chat message without content", ("/v1/chat/completions", {"messages": [{"role": "user"}]}), 400, None),
    (
        "chat tool_choice names no tool",
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [ADD_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "mul"}},
            },
        ),
        400,
        "invalid_chat_request",
    ),
    (
        "chat tool_choice without tools",
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
        400,
        None,
    ),
    (
        "chat bad response_format",
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}},
        ),
        400,
        "response_format",
    ),
    (
        "chat json_schema name with spaces",
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
            },
        ),
        400,
        "response_format.json_schema.name",
    ),
    (
        "chat top_logprobs without logprobs",
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
        400,
        None,
    ),
    (
        "chat max_tokens 0",
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
        400,
        "max_tokens",
    ),
    ("detokenize out of range", ("/detokenize", {"tokens": [10**9]}), 400, "tokens"),
    (
        "tokenize both inputs",
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}),
        400,
        None,
    ),
    ("missing auth", ("/v1/completions", {"prompt": "x"}, {}), 401, "invalid_api_key"),
    (
        "wrong auth",
        ("/v1/completions", {"prompt": "x"}, {"Authorization": "Bearer nope"}),
        401,
        "invalid_api_key",
    ),
    ("unknown route", ("/v1/nothing", {}), 404, None),
]


@pytest.mark.parametrize("name,req,status,fragment", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_its_status_and_error_object_and_the_server_keeps_serving(
    client, name, req, status, fragment
):
    path, payload, *hdr = req
    headers = hdr[0] if hdr else AUTH
    kw = (
        {"content": payload, "headers": {**headers, "content-type": "application/json"}}
        if isinstance(payload, str)
        else {"json": payload, "headers": headers}
    )
    with httpx.Client(base_url=client.base_url, timeout=30) as c:
        r = c.post(path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if fragment is not None:
        assert fragment in f"{err['param']} {err['code']}", err
    assert_serves(client, MODEL)


def test_health_and_metrics_need_no_key_and_everything_else_does(server):
    """/metrics is open as vLLM's is: Prometheus and load-aware routers scrape it without a key."""
    with httpx.Client(base_url=server.url, timeout=10) as c:
        assert c.get("/health").status_code == 200
        r = c.get("/metrics")
        assert r.status_code == 200 and "minisgl:num_requests_running" in r.text
        for path in ("/v1/models", "/tokenizer_info"):
            r = c.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            assert c.get(path, headers=AUTH).status_code == 200


# -------------------------------------------------------------------------------------------- overload
def test_full_waiting_queue_answers_503_with_retry_after(server, client):
    """Stall the pipeline inside a logits processor: at most max_num_seqs requests get admitted, the
    rest pile up waiting until the bound, and past it requests are refused with 503 + Retry-After;
    every accepted one completes once the stall ends."""
    eng = _engine(server)
    release, entered = threading.Event(), threading.Event()

    def blocker(_ids, logits):
        entered.set()
        release.wait(60)
        return logits

    gate = eng.submit([1, 2, 3], SamplingParams(max_tokens=1, logits_processors=(blocker,)))
    assert entered.wait(30)
    total = MAX_WAITING + eng.config.max_num_seqs + 1  # more than can be admitted plus the bound

    async def run() -> list:
        async with httpx.AsyncClient(
            base_url=server.url, headers=AUTH, timeout=60, limits=httpx.Limits(max_connections=total)
        ) as ac:
            req = {"model": MODEL, "prompt": "queued", "max_tokens": 2, "temperature": 0}
            tasks = [asyncio.create_task(ac.post("/v1/completions", json=req)) for _ in range(total)]
            refused = []
            for t in asyncio.as_completed(tasks):  # refusals come back while the rest are stalled
                r = await t
                assert r.status_code == 503, r.text
                refused.append(r)
                if len(refused) + MAX_WAITING + eng.config.max_num_seqs >= total:
                    break
            # A refusal means MAX_WAITING were waiting then; while the gate stalls, none finishes, so
            # since then the scheduler can only have admitted up to max_num_seqs - 1 of them (the
            # gate holds a slot), whenever its thread got to them.
            assert eng.num_waiting() >= MAX_WAITING - (eng.config.max_num_seqs - 1)
            release.set()
            return refused + [r for r in await asyncio.gather(*tasks) if r not in refused]

    try:
        responses = asyncio.run(run())
    finally:
        release.set()
    gate.result(30)
    refused = [r for r in responses if r.status_code == 503]
    assert len(responses) == total and refused
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full" for r in refused)
    assert all(r.status_code == 200 for r in responses if r not in refused)
    assert total - len(refused) >= MAX_WAITING
    assert_serves(client, MODEL)


def test_max_waiting_requests_is_validated():
    from minisgl_backend import ConfigError

    for bad in (0, -3, 1.5, True, "8"):
        with pytest.raises(ConfigError, match="max_waiting_requests"):
            EngineConfig(max_waiting_requests=bad)
    assert EngineConfig(max_waiting_requests=8).max_waiting_requests == 8


# ----------------------------------------------------------------------------------------- disconnects
def _raw_post(server, path: str, body: dict) -> socket.socket:
    s = socket.create_connection((server.host, server.port))
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    s.sendall(head + data)
    return s


def _wait_for_record(server, user: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        server.state.collect()
        recs = [r for r in list(server.state.finished) if r.user == user]
        if recs:
            return recs
        time.sleep(0.01)
    raise AssertionError(f"no finished record for {user}")


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_the_request(server, stream):
    eng = _engine(server)
    user = f"gone-{stream}"
    s = _raw_post(
        server,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "bye",
            "max_tokens": 900,
            "ignore_eos": True,
            "temperature": 0,
            "stream": stream,
            "user": user,
        },
    )
    deadline = time.monotonic() + 30
    while eng.check_invariants()["running"] == 0:  # wait until it holds KV
        assert time.monotonic() < deadline
        time.sleep(0.005)
    if stream:
        assert s.recv(1)  # the response has started
    s.close()
    (rec,) = _wait_for_record(server, user)
    assert rec.finish_reason == "abort" and rec.completion_tokens < 900
    _drained_free(server)


@pytest.mark.slow
def test_many_concurrent_streaming_clients_with_random_disconnects(server):
    """≥ 32 concurrent streaming clients, 1,000 requests over a tight KV pool (preemption), ~20% of
    them hanging up after their first chunk: every completed response equals its solo greedy
    reference, every disconnected one was aborted, and after drain every block is FREE."""
    eng = _engine(server)
    rng = random.Random(0)
    pool = []
    for _ in range(24):  # distinct requests, each run alone first (nothing else in the engine)
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randrange(4, 40))]
        n = rng.randrange(4, 24)
        pool.append((prompt, n, _greedy(eng, prompt, n, ignore_eos=True).text))
    total, clients = 1000, 32
    plan = [(rng.randrange(len(pool)), rng.random() < 0.2) for _ in range(total)]
    results: list = [None] * total
    t0 = time.monotonic()

    async def one(ac, k: int) -> None:
        j, hang_up = plan[k]
        prompt, n, _ = pool[j]
        req = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 200 if hang_up else n,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "user": f"c{k}",
        }
        text, finish = "", None
        async with ac.stream("POST", "/v1/completions", json=req) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line:
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                c = json.loads(data)["choices"][0]
                text += c["text"]
                finish = c["finish_reason"] or finish
                if hang_up and text:
                    results[k] = ("gone", None)
                    return  # leaving the block closes the connection mid-stream
        results[k] = (text, finish)

    async def main() -> None:
        queue = list(range(total))
        async with httpx.AsyncClient(
            base_url=server.url,
            headers=AUTH,
            timeout=120,
            limits=httpx.Limits(max_connections=clients, max_keepalive_connections=0),
        ) as ac:

            async def worker() -> None:
                while queue:
                    await one(ac, queue.pop())

            await asyncio.gather(*(worker() for _ in range(clients)))

    asyncio.run(main())
    wall = time.monotonic() - t0
    _drained_free(server)
    server.state.collect()
    records = {r.user: r for r in list(server.state.finished) if r.user and r.user.startswith("c")}
    mismatches, gone = [], 0
    for k, ((j, hang_up), res) in enumerate(zip(plan, results)):
        assert res is not None, k
        if hang_up:
            gone += 1
            assert res[0] == "gone"
            assert records[f"c{k}"].finish_reason == "abort" and records[f"c{k}"].completion_tokens < 200, k
        elif res != (pool[j][2], "length"):
            mismatches.append((k, j, res, pool[j][2]))
    assert not mismatches, mismatches[:3]
    assert gone > 100
    print(f"\n{total} requests, {clients} clients, {gone} disconnected, {wall:.1f}s")


@pytest.mark.parametrize("rate", [float("inf"), 200.0])
def test_bench_serve_closed_loop_and_poisson_with_check(server, rate):
    load = dict(num_requests=60, num_prompts=8, input_len=16, output_len=8, concurrency=8)
    row, text = checked_bench(
        server.url, key=KEY, model=MODEL, **load, request_rate=rate, disconnect_prob=0.2, seed=1
    )
    assert row["completed"] + row["disconnected"] == 60 and row["disconnected"] > 0
    assert row["output_tok_per_s"] > 0 and row["ttft_p99_ms"] >= row["ttft_median_ms"] > 0
    assert row["tpot_mean_ms"] > 0 and row["itl_mean_ms"] > 0 and "req/s" in text
    _drained_free(server)


# --------------------------------------------------------------------------------------------- metrics
def _scrape(client) -> dict[tuple, float]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[
                (
                    s.name,
                    tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                    if "le" not in s.labels
                    else tuple(sorted(s.labels.items())),
                )
            ] = s.value
    return out


def _val(m: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
    return m.get(key, 0.0)


def test_metrics_scrape_matches_a_known_workload(server, client):
    _drained_free(server)
    before = _scrape(client)
    lens = [(5, 3), (9, 7), (2, 1), (12, 10)]
    for plen, n in lens:
        r = client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": list(range(10, 10 + plen)),
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200
    after = _scrape(client)

    def delta(name: str, **labels) -> float:
        return _val(after, name, **labels) - _val(before, name, **labels)

    assert delta("minisgl:prompt_tokens_total") == sum(p for p, _ in lens)
    assert delta("minisgl:generation_tokens_total") == sum(n for _, n in lens)
    assert delta("minisgl:request_success_total", finished_reason="length") == len(lens)
    assert delta("minisgl:request_success_total", finished_reason="abort") == 0
    assert delta("minisgl:time_to_first_token_seconds_count") == len(lens)
    assert delta("minisgl:e2e_request_latency_seconds_count") == len(lens)
    assert delta("minisgl:inter_token_latency_seconds_count") == sum(n - 1 for _, n in lens)
    itl_sum = delta("minisgl:inter_token_latency_seconds_sum")
    assert 0 < itl_sum < delta("minisgl:e2e_request_latency_seconds_sum")
    assert delta("minisgl:e2e_request_latency_seconds_sum") > 0
    assert delta("minisgl:request_queue_time_seconds_count") == len(lens)
    assert (
        0
        <= delta("minisgl:request_queue_time_seconds_sum")
        <= delta("minisgl:e2e_request_latency_seconds_sum")
    )
    for gauge in (
        "minisgl:num_requests_running",
        "minisgl:num_requests_waiting",
        "minisgl:kv_cache_usage_perc",
    ):
        assert (gauge, (("model_name", MODEL),)) in after
    assert (
        _val(after, "minisgl:prefix_cache_queries_total")
        >= _val(after, "minisgl:prefix_cache_hits_total")
        >= 0
    )


def test_metrics_carry_the_load_gauges_under_vllm_names_too(server, client):
    """What a load-aware router (Gateway API inference extension, llm-d) scrapes by name."""
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        ours, theirs = families[f"minisgl:{name}"], families[f"vllm:{name}"]
        assert theirs.type == "gauge" and [s.labels for s in theirs.samples] == [{"model_name": MODEL}]
        assert [s.value for s in theirs.samples] == [s.value for s in ours.samples]


def test_nothing_of_a_request_is_kept_once_it_has_ended(server):
    """A server of its own, with the default books: after a burst its backend holds no record, no
    output and no handle of the requests, whether or not another request or a scrape follows."""
    from minisgl_backend.serve import start_in_thread

    srv = start_in_thread(_engine(server), api_key=KEY, model_name=MODEL)
    backend = srv.state
    try:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
            for i in range(4):
                body = {"model": MODEL, "prompt": ["hi", "yo"], "max_tokens": 4, "n": 2, "user": f"user-{i}"}
                assert c.post("/v1/completions", json={**body, "logprobs": 5}).status_code == 200
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert _sse_events(r.iter_lines())[-1] == "[DONE]"
        deadline = time.monotonic() + 60
        while not backend.done.empty():  # the last request's output, until the loop folds it
            assert time.monotonic() < deadline, "a finished request's output is still held"
            time.sleep(0.01)
        assert not backend.live and len(backend.finished) == 0
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------- lifecycle
def test_a_signal_drains_the_requests_in_flight_and_refuses_new_ones(server):
    """With a shutdown timeout, SIGTERM lets the requests in flight finish in full (a stream and a
    whole answer), while a request that arrives, /health included, gets a 503 with Retry-After;
    then the server stops. Its own app over the module's engine: only it stops."""
    from minisgl_backend.serve import start_in_thread

    eng = _engine(server)
    srv = start_in_thread(eng, api_key=KEY, model_name=MODEL, shutdown_timeout=120)
    cmpl = {"model": MODEL, "prompt": "hi", "ignore_eos": True, "temperature": 0}
    whole: dict = {}
    release, entered = threading.Event(), threading.Event()

    def blocker(_ids, logits):
        entered.set()
        release.wait(60)
        return logits

    def post_whole() -> None:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as c:
            whole["r"] = c.post("/v1/completions", json={**cmpl, "max_tokens": 600})

    try:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as c:
            body = {**cmpl, "max_tokens": 200, "stream": True, "stream_options": {"include_usage": True}}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")  # the stream is under way
                # The engine is held until the late requests were refused: the stream cannot end
                # before the second request is in flight, nor both before the signal, however
                # slowly a loaded machine runs this thread.
                gate = eng.submit([1, 2, 3], SamplingParams(max_tokens=1, logits_processors=(blocker,)))
                assert entered.wait(60)
                t = threading.Thread(target=post_whole)
                t.start()
                deadline = time.monotonic() + 60
                while len(srv.state.live) < 2 and t.is_alive():  # the whole answer is being generated
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                srv.server.handle_exit(signal.SIGTERM, None)
                while not srv.app.state.drain.draining:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as other:
                    for method, path in (("POST", "/v1/completions"), ("GET", "/health")):
                        late = other.request(method, path, json={**cmpl, "max_tokens": 2})
                        assert late.status_code == 503, late.text
                        assert late.json()["error"]["code"] == "shutting_down"
                        assert late.headers["retry-after"] == "1"
                release.set()
                gate.result(60)
                events = _sse_events(lines)
            t.join(120)
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 200
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        assert whole["r"].status_code == 200, whole["r"].text
        (choice,) = whole["r"].json()["choices"]
        assert choice["finish_reason"] == "length" and whole["r"].json()["usage"]["completion_tokens"] == 600
        srv.thread.join(60)  # then it stops by itself
        assert not srv.thread.is_alive()
    finally:
        release.set()
        srv.stop()


def test_a_request_still_being_prepared_at_a_signal_gets_a_503_error_object(server):
    """The CPU workers are busy (held here) when the signal comes: the /tokenize request queued
    behind them is answered 503 `shutting_down` at once, not cancelled with a bare 500 later."""
    from minisgl_backend.serve import start_in_thread

    srv = start_in_thread(_engine(server), api_key=KEY, model_name=MODEL)
    hold = threading.Event()
    state = srv.app.state.server
    try:
        busy = [state.pool._pool.submit(hold.wait, 120) for _ in range(state.limits.cpu_workers)]
        result: dict = {}

        def tokenize() -> None:
            with httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as c:
                result["r"] = c.post("/tokenize", json={"model": MODEL, "prompt": "hello"})

        t = threading.Thread(target=tokenize)
        t.start()
        deadline = time.monotonic() + 60
        while srv.app.state.drain.inflight == 0:  # the request waits for a worker
            assert time.monotonic() < deadline
            time.sleep(0.01)
        srv.server.handle_exit(signal.SIGTERM, None)
        t.join(120)
        r = result["r"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        assert r.headers["retry-after"] == "1"
    finally:
        hold.set()
        for f in busy:
            f.result(60)
        srv.stop()


@pytest.mark.slow
def test_graceful_shutdown_on_sigint_and_sigterm(tiny_model_dir):
    """`minisgl serve` as subprocesses (both started at once): serves, then SIGINT (one) and SIGTERM
    (the other) stop it with exit code 0, an in-flight stream is ended at once (its request
    aborted), and nothing prints a traceback."""
    procs = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):  # both start before either is waited for
            procs[sig] = start_serve(tiny_model_dir, "--served-model-name", "t")
        for sig, srv in procs.items():
            srv.wait_serving()
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                assert (
                    c.post(
                        "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "model": "t"}
                    ).status_code
                    == 200
                )
                with c.stream(
                    "POST",
                    "/v1/completions",
                    json={"prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True},
                ) as r:
                    lines = r.iter_lines()
                    assert next(lines).startswith("data: ")
                    srv.proc.send_signal(sig)
                    events = _sse_events(lines)  # the open stream is ended: its request aborted
                assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"
        for sig, srv in procs.items():
            out, err = srv.proc.communicate(timeout=60)
            assert srv.proc.returncode == 0, (sig, err)
            assert "Traceback" not in err and "Traceback" not in out, err
            assert "Application shutdown complete" in err
    finally:
        for srv in procs.values():
            srv.kill()


def test_health_is_503_once_the_engine_is_dead(server, client):
    """Last in the module: closes the engine under the running server."""
    assert_serves(client, MODEL)
    _engine(server).close()
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead" and "retry-after" in r.headers


def test_the_logprobs_limit_is_the_engines(tiny_model_dir):
    """logprobs / top_logprobs are capped by the engine's max_logprobs (vLLM's --max-logprobs), the
    one limit: a server configured for 30 answers 25 alternatives, and past 30 is a 400 naming it."""
    config = EngineConfig(model=str(tiny_model_dir), **TINY_ENGINE, max_logprobs=30)
    with (
        serving(config, key=KEY, model=MODEL) as srv,
        httpx.Client(base_url=srv.url, headers=AUTH) as c,
    ):
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "logprobs": 25})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 25
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
            "logprobs": True,
        }
        r = c.post("/v1/chat/completions", json=chat | {"top_logprobs": 25})
        assert r.status_code == 200, r.text
        r = c.post("/v1/chat/completions", json=chat | {"top_logprobs": 31})
        assert r.status_code == 400 and "max_logprobs" in r.json()["error"]["message"], r.text
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "logprobs": 31})
        assert r.status_code == 400 and "max_logprobs" in r.json()["error"]["message"], r.text
