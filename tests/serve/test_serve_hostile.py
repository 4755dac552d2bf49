"""`minisgl serve` under hostile clients (issue 26) and vLLM's request fields (issue 27), on the tiny
random model: every malformed or oversized input is a 4xx with OpenAI's error object and the server
keeps serving; a huge prompt does not hold up /health; half-sent headers and slow bodies are cut off;
past the connection cap a client gets a clean 503 and service resumes once connections free; grammar
constraints (guided_choice / guided_regex / structured_outputs) hold. One server for the module, on
a free port of 127.0.0.1, with short timeouts and small caps so that each check takes about a second.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from minisgl_backend import EngineConfig  # noqa: E402
from minisgl_backend.serve.guard import ServeLimits  # noqa: E402
from tests.serve.servers import TINY_ENGINE, assert_serves, serving  # noqa: E402

KEY = "sk-hostile"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = ServeLimits(
    max_body_bytes=24 * 1024 * 1024,
    max_prompts=16,
    max_sequences=32,
    header_timeout_s=1.0,
    body_timeout_s=1.0,
    max_connections=12,
    stream_idle_timeout_s=1.0,
    max_request_chars=200_000,
)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), **TINY_ENGINE)
    with serving(config, key=KEY, model=MODEL, limits=LIMITS) as srv:
        yield srv


@pytest.fixture(scope="module")
def patient(server):
    """A second server over the same engine whose body timeout no loaded machine reaches, for the
    uploads of tens of MB whose answer a test checks: under the module's 1 s one, an upload slowed
    by the machine would be answered 408 instead."""
    from dataclasses import replace

    from minisgl_backend.serve import start_in_thread

    limits = replace(LIMITS, body_timeout_s=120.0)
    srv = start_in_thread(server.state.engine, api_key=KEY, model_name=MODEL, limits=limits)
    yield srv
    srv.stop()


SUR = "a\ud800b"  # a lone surrogate: JSON can carry it (as an escape), UTF-8 cannot
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TOOL = {
    "type": "function",
    "function": {"name": "add", "description": "Add.", "parameters": {"type": "object", "properties": {}}},
}
SELF_REF = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


def _chat(**kw):
    return ("/v1/chat/completions", {**CHAT, **kw})


def _cmpl(**kw):
    return ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **kw})


# (case, (path, body as JSON-able object or raw bytes), status, code, param or None)
CASES = [
    # lone surrogates, field by field
    (
        "surrogate chat content",
        _chat(messages=[{"role": "user", "content": SUR}]),
        400,
        "invalid_unicode",
        "messages.0.content",
    ),
    (
        "surrogate text part",
        _chat(messages=[{"role": "user", "content": [{"type": "text", "text": SUR}]}]),
        400,
        "invalid_unicode",
        "messages.0.content.0.text",
    ),
    (
        "surrogate tool description",
        _chat(tools=[{**TOOL, "function": {**TOOL["function"], "description": SUR}}]),
        400,
        "invalid_unicode",
        "tools.0.function.description",
    ),
    (
        "surrogate schema description",
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "r", "schema": {"type": "object", "description": SUR}},
            }
        ),
        400,
        "invalid_unicode",
        "response_format.json_schema.schema.description",
    ),
    ("surrogate completion prompt", _cmpl(prompt=SUR), 400, "invalid_unicode", "prompt"),
    ("surrogate in a prompt list", _cmpl(prompt=["ok", SUR]), 400, "invalid_unicode", "prompt.1"),
    ("surrogate stop string", _cmpl(stop=[SUR]), 400, "invalid_unicode", "stop.0"),
    ("surrogate /tokenize", ("/tokenize", {"prompt": SUR}), 400, "invalid_unicode", "prompt"),
    ("surrogate logit_bias key", _cmpl(logit_bias={SUR: 1}), 400, "invalid_unicode", "logit_bias"),
    # two spellings of one token id: one of the biases would be lost without a word
    ("logit_bias key with leading zeros", _cmpl(logit_bias={"00005": 1, "5": -1}), 400, "value_error", None),
    # oversize, field by field (max_model_len is 1024 tokens: at most 1024 x 81 characters)
    ("oversize completion prompt", _cmpl(prompt="a" * 100_000), 400, "context_length_exceeded", "prompt"),
    (
        "oversize prompt in a list",
        _cmpl(prompt=["a", "a" * 100_000]),
        400,
        "context_length_exceeded",
        "prompt",
    ),
    ("oversize token-id prompt", _cmpl(prompt=[5] * 1025), 400, "context_length_exceeded", None),
    (
        "oversize chat content",
        _chat(messages=[{"role": "user", "content": "a" * 100_000}]),
        400,
        "context_length_exceeded",
        "messages",
    ),
    ("oversize body", ("/v1/completions", b"x" * (25 * 1024 * 1024)), 413, "body_too_large", None),
    (
        "oversize tool description",
        _chat(tools=[{**TOOL, "function": {**TOOL["function"], "description": "a" * 100_000}}]),
        400,
        "context_length_exceeded",
        "tools",
    ),
    # grammars that compile but exceed llguidance's limits, or do not compile
    (
        "recursive $ref schema",
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SELF_REF}}),
        400,
        "invalid_grammar",
        None,
    ),
    ("recursive $ref guided_json", _cmpl(guided_json=SELF_REF), 400, "invalid_grammar", None),
    ("bad Lark grammar", _chat(guided_grammar="start: nothing_defined"), 400, "invalid_grammar", None),
    ("bad regex", _cmpl(guided_regex="(unclosed"), 400, "invalid_grammar", None),
    # JSON nested past Python's recursion limit inside string fields (the body itself is shallow)
    (
        "deeply nested guided_json string",
        _cmpl(guided_json="[" * 5000 + "]" * 5000),
        400,
        "value_error",
        None,
    ),
    (
        "deeply nested structured_outputs.json string",
        _chat(structured_outputs={"json": "[" * 5000 + "]" * 5000}),
        400,
        "value_error",
        None,
    ),
    ("empty choice list", _chat(guided_choice=[]), 400, "too_short", "guided_choice"),
    ("two constraints", _chat(guided_regex="a", guided_choice=["a"]), 400, "value_error", None),
    # work per request
    ("huge max_tokens completions", _cmpl(max_tokens=10**12), 400, "context_length_exceeded", "max_tokens"),
    ("huge max_tokens chat", _chat(max_tokens=10**12), 400, "context_length_exceeded", "max_tokens"),
    (
        "max_tokens past the context",
        _cmpl(prompt=[5] * 1000, max_tokens=25),
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    ("too many prompts", _cmpl(prompt=["a"] * 17), 400, "too_many_prompts", "prompt"),
    ("n x prompts over the cap", _cmpl(prompt=["a"] * 4, n=9), 400, "too_many_sequences", "n"),
    ("n over 128", _chat(n=129), 400, "less_than_equal", "n"),
    # numbers and structure
    ("5,000-digit logit_bias key", _cmpl(logit_bias={"9" * 5000: 1}), 400, "value_error", None),
    (
        "5,000-digit integer",
        ("/v1/completions", b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}"),
        400,
        "invalid_json",
        None,
    ),
    (
        "nesting 100 deep",
        ("/v1/completions", b'{"prompt": "a", "user": ' + b"[" * 100 + b"]" * 100 + b"}"),
        400,
        "too_deep",
        None,
    ),
    ("invalid UTF-8 bytes", ("/v1/completions", b'{"prompt": "\xc3\x28"}'), 400, "invalid_json", None),
    (
        "UTF-8-encoded surrogate",
        ("/v1/completions", b'{"prompt": "\xed\xa0\x80"}'),
        400,
        "invalid_unicode",
        "prompt",
    ),
    ("token id outside the vocabulary", _cmpl(prompt=[10**9]), 400, "invalid_request", None),
    # chat-template controls
    (
        "template kwarg clash",
        _chat(chat_template_kwargs={"tokenize": True}),
        400,
        "invalid_chat_request",
        None,
    ),
    (
        "continue with a generation prompt",
        _chat(continue_final_message=True),
        400,
        "value_error",
        None,
    ),
]


@pytest.mark.parametrize("name,req,status,code,param", CASES, ids=[c[0] for c in CASES])
def test_hostile_input_gets_a_4xx_error_object_and_the_server_keeps_serving(
    server, client, name, req, status, code, param
):
    path, body = req
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # ASCII: \ud800 escaped
    with httpx.Client(base_url=server.url, timeout=30) as c:  # its own connection: a 413 closes it
        r = c.post(path, content=content, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    assert "Traceback" not in err["message"] and "/" not in (err["param"] or "")
    assert_serves(client, MODEL)


def test_a_20_mb_prompt_does_not_hold_up_health(patient, client):
    prompt = "word " * (4 * 1024 * 1024)  # 20 MiB
    result: dict = {}

    def send() -> None:
        with httpx.Client(base_url=patient.url, headers=AUTH, timeout=120) as c:
            result["r"] = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})

    worst = 0.0
    with httpx.Client(base_url=patient.url, timeout=10) as h:
        h.get("/health")  # connected before the upload starts
        t = threading.Thread(target=send)
        t.start()
        polls = 0
        while t.is_alive() or polls < 3:
            t0 = time.perf_counter()
            assert h.get("/health").status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            polls += 1
            time.sleep(0.01)
        t.join()
    r = result["r"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert worst < 1.0, f"/health took {worst:.2f} s during the 20 MB request"
    assert_serves(client, MODEL)


# Each fits the context on its own or is not checked against it; in all each is past the per-request
# bound (200,000 characters here), or the context, before a token is made.
TOO_MUCH_IN_ALL = [
    ("many prompts", "/v1/completions", {"model": MODEL, "prompt": ["word " * 12_000] * 16, "max_tokens": 1}),
    (
        "tool-call arguments",
        "/v1/chat/completions",
        {
            **CHAT,
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "add", "arguments": "[" * 300_000}}],
                },
                {"role": "tool", "tool_call_id": "c", "content": "3"},
            ],
        },
    ),
    ("/tokenize prompt", "/tokenize", {"prompt": "word " * 60_000}),
    (
        "/tokenize tool-call arguments",
        "/tokenize",
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "add", "arguments": "1" * 300_000}}],
                }
            ]
        },
    ),
]


@pytest.mark.parametrize("name,path,body", TOO_MUCH_IN_ALL, ids=[c[0] for c in TOO_MUCH_IN_ALL])
def test_too_many_characters_in_all_are_refused_before_tokenising(
    server, client, monkeypatch, name, path, body
):
    def no_tokenizer():
        raise AssertionError("tokenised")

    monkeypatch.setattr(server.app.state.server.pool, "tokenizer", no_tokenizer)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] in ("request_too_long", "context_length_exceeded"), err
    if err["code"] == "request_too_long":
        assert "--max-request-chars" in err["message"]
    monkeypatch.undo()
    assert_serves(client, MODEL)


def test_many_token_ids_and_large_answers_are_handled_off_the_event_loop(server, client, monkeypatch):
    """The event loop answers every stream and /health: checking thousands of token ids, or building
    an answer of many choices with logprobs, runs on another thread (the loop's is minisgl-serve)."""
    from minisgl_backend.serve.routes import chat

    engine = server.state.engine
    threads: dict[str, set[str]] = {"submit": set(), "logprobs": set()}
    submit, logprobs = engine.submit, chat._logprobs

    def recording_submit(prompt, *a, **kw):
        if len(prompt) >= 1000:  # one of the 16 long prompts (the chat request's is short)
            threads["submit"].add(threading.current_thread().name)
        return submit(prompt, *a, **kw)

    def recording_logprobs(*a, **kw):
        threads["logprobs"].add(threading.current_thread().name)
        return logprobs(*a, **kw)

    monkeypatch.setattr(engine, "submit", recording_submit)
    monkeypatch.setattr(chat, "_logprobs", recording_logprobs)
    ids = [[(7 * i + j) % 1000 + 10 for j in range(1000)] for i in range(16)]  # 16,000 token ids
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 16, r.text
    bad = client.post("/v1/completions", json={"model": MODEL, "prompt": [*ids[:-1], [10**9] * 1000]})
    assert bad.status_code == 400 and "out of range" in bad.json()["error"]["message"], bad.text
    req = {**CHAT, "n": 16, "logprobs": True, "top_logprobs": 5}
    r = client.post("/v1/chat/completions", json=req)
    assert r.status_code == 200 and len(r.json()["choices"]) == 16, r.text
    assert threads["submit"] and threads["logprobs"], threads
    assert "minisgl-serve" not in threads["submit"] | threads["logprobs"], threads


def test_request_bodies_held_at_once_are_bounded_over_all_clients(server):
    """One slow upload holds most of --max-buffered-bytes: a second body that would pass it gets a
    503 with Retry-After, and is served again once the first one's client leaves."""
    from dataclasses import replace

    from minisgl_backend.serve import start_in_thread

    limits = replace(LIMITS, body_timeout_s=120.0, max_buffered_bytes=1024 * 1024)
    srv = start_in_thread(server.state.engine, api_key=KEY, model_name=MODEL, limits=limits)
    held = srv.app.state.buffered
    try:
        slow = socket.create_connection((srv.host, srv.port), timeout=10)
        slow.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 2000000\r\n\r\n"
        )
        slow.sendall(b'{"prompt": "' + b"a" * 900_000)  # and then nothing more
        deadline = time.monotonic() + 60
        while held.bytes < 900_000:  # the server has read what was sent
            assert time.monotonic() < deadline, held.bytes
            time.sleep(0.01)
        body = {"model": MODEL, "prompt": "word " * 40_000, "max_tokens": 1}  # 200 KB
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
            r = c.post("/v1/completions", json=body)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "server_busy" and r.headers["retry-after"] == "1"
        slow.close()
        while held.bytes:  # the slow client left: its bytes are let go
            assert time.monotonic() < deadline, held.bytes
            time.sleep(0.01)
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
            r = c.post("/v1/completions", json=body)
        assert r.json()["error"]["code"] == "context_length_exceeded", r.text  # past the cap's check
    finally:
        srv.stop()


def test_a_client_that_never_reads_its_whole_answer_is_cut_off(server, client):
    """A non-streamed answer of megabytes to a client that reads none of it: once the socket's
    buffers are full, the server waits stream_idle_timeout_s (1 s here), then drops the connection
    and the rest of the answer, instead of holding them as long as the client stays."""
    try:  # the answer must outgrow what the kernel buffers for the socket
        send_max = int(open("/proc/sys/net/ipv4/tcp_wmem").read().split()[2])
    except (OSError, ValueError, IndexError):
        pytest.skip("the socket buffer sizes are unknown here")
    if send_max > 6 * 1024 * 1024:
        pytest.skip(f"the kernel buffers up to {send_max} bytes per socket: more than the answer")
    connections = server.server.server_state.connections
    before = len(connections)
    ids = [j % 1000 + 10 for j in range(1000)]
    body = json.dumps(
        {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 20, "n": 16}
    ).encode()  # the answer: 16 choices of 1,000 tokens with 20 alternatives each, about 10 MB
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # reads nothing, buffers little
    sock.settimeout(10)
    sock.connect((server.host, server.port))
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        deadline = time.monotonic() + 120
        while len(connections) == before:  # accepted
            assert time.monotonic() < deadline
            time.sleep(0.01)
        while len(connections) > before:  # the server lets the connection go by itself
            assert time.monotonic() < deadline, "the server still holds the unread answer"
            time.sleep(0.05)
    finally:
        sock.close()
    assert_serves(client, MODEL)


def _connect(server) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=10)


def _wait_closed(sock: socket.socket, within: float) -> tuple[float, bytes]:
    """(seconds until the server closed the connection, what it sent before)."""
    t0 = time.monotonic()
    sock.settimeout(within)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return time.monotonic() - t0, data
        data += chunk


def test_half_sent_headers_and_slow_bodies_are_cut_off(server, client):
    # headers never finished: closed after header_timeout_s (1 s here), nothing answered
    sock = _connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: app")
    took, data = _wait_closed(sock, 5)
    sock.close()
    assert 0.8 < took < 3 and data == b"", (took, data)
    # a connection that sends nothing at all is closed the same way
    sock = _connect(server)
    took, data = _wait_closed(sock, 5)
    sock.close()
    assert 0.8 < took < 3 and data == b""
    # a body that stops half way: 408 with the error object after body_timeout_s, then closed
    sock = _connect(server)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
        b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt": '
    )
    took, data = _wait_closed(sock, 5)
    sock.close()
    assert data.startswith(b"HTTP/1.1 408"), data
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert 0.8 < took < 3
    # a header line over max_header_bytes (16 KiB), or 10,000 header fields: refused, closed
    for head in (b"X-Big: " + b"a" * 20_000 + b"\r\n", b"".join(b"X-%d: 1\r\n" % i for i in range(10_000))):
        sock = _connect(server)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + head + b"\r\n")
        _, data = _wait_closed(sock, 5)
        sock.close()
        assert re.match(rb"HTTP/1.1 4(31|00) ", data), data[:100]
    assert_serves(client, MODEL)


@pytest.mark.parametrize(
    "framing,key,status,code",
    [
        ("content-length", KEY, 413, "body_too_large"),
        ("chunked", KEY, 413, "body_too_large"),
        ("chunked", "wrong", 401, "invalid_api_key"),
    ],
)
def test_an_answer_mid_upload_ends_in_a_clean_close_not_a_reset(patient, client, framing, key, status, code):
    # The server answers while the client is still sending. Were the unread rest of the body left
    # in the socket at close, the kernel would reset the connection, and a client still writing
    # can lose the answer it was sent (CI saw httpx get 0 bytes of a 413). The server reads and
    # drops the rest first, so the client reads the whole answer and then an orderly end of stream.
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += b"Authorization: Bearer " + key.encode() + b"\r\n"
    part = b"x" * (4 * 1024 * 1024)
    sock = _connect(patient)
    if framing == "content-length":
        total = LIMITS.max_body_bytes + len(part)
        sock.sendall(head + b"Content-Length: %d\r\n\r\n" % total)
        for _ in range(total // len(part)):
            sock.sendall(part)
    else:
        sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(LIMITS.max_body_bytes // len(part) + 2):
            sock.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
        sock.sendall(b"0\r\n\r\n")
    time.sleep(0.2)  # the answer and any reset have arrived
    took, data = _wait_closed(sock, 5)  # ConnectionResetError here is the bug
    sock.close()
    assert data.startswith(b"HTTP/1.1 %d" % status), data[:100]
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == code
    assert_serves(client, MODEL)


def test_past_the_connection_cap_a_clean_503_then_service_resumes(server, client):
    """The cap is filled with idle sockets, on a server of its own whose header timeout outlasts the
    test: with the module's 1 s one, a loaded machine could close the first sockets before the last
    one is open, and the probe would find room."""
    from dataclasses import replace

    from minisgl_backend.serve import start_in_thread

    limits = replace(LIMITS, header_timeout_s=120.0)
    srv = start_in_thread(server.state.engine, api_key=KEY, model_name=MODEL, limits=limits)
    connections = srv.server.server_state.connections
    idle = []
    try:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
            while len(connections) < LIMITS.max_connections:  # fill the cap with idle sockets
                idle.append(_connect(srv))
                deadline = time.monotonic() + 60
                while len(connections) < min(LIMITS.max_connections, len(idle)):
                    assert time.monotonic() < deadline, len(connections)
                    time.sleep(0.005)
            r = c.get("/health")
            assert r.status_code == 503, r.text
            assert r.headers["connection"] == "close" and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "too_many_connections"
        for s in idle:
            s.close()
        deadline = time.monotonic() + 60
        while len(connections) >= LIMITS.max_connections:
            assert time.monotonic() < deadline, len(connections)
            time.sleep(0.01)
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
            assert c.get("/health").status_code == 200
    finally:
        for s in idle:
            s.close()
        srv.stop()
    assert_serves(client, MODEL)


def test_errors_leak_no_internals(server, client, tiny_model_dir):
    r = client.get("/v1/models")
    assert r.status_code == 200 and str(tiny_model_dir) not in r.text
    (m,) = r.json()["data"]
    assert not os.path.isabs(m["root"]) and m["id"] == MODEL
    from minisgl_backend.serve.errors import api_error

    err = api_error(RuntimeError("secret /home/x/model detail"))
    assert err.status == 500 and "secret" not in err.message and "request id" in err.message


def test_version_and_ping(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:  # no key needed, as /health
        v = c.get("/version")
        assert v.status_code == 200 and isinstance(v.json()["version"], str)
        assert c.get("/ping").status_code == 200 and c.post("/ping").status_code == 200
        for method, path, allowed in (("PUT", "/ping", {"GET", "POST"}), ("DELETE", "/health", {"GET"})):
            r = c.request(method, path)  # a 405 names every method the path takes
            assert r.status_code == 405 and allowed <= {m.strip() for m in r.headers["allow"].split(",")}, (
                r.headers
            )


# ----------------------------------------------------------------------------------------- issue 27
def test_guided_choice_and_regex_constrain_the_reply(client):
    choices = ["yes", "no", "maybe later"]
    for seed in range(3):
        r = client.post(
            "/v1/chat/completions", json={**CHAT, "max_tokens": 16, "seed": seed, "guided_choice": choices}
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] in choices
        r = client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "Answer:",
                "max_tokens": 16,
                "seed": seed,
                "guided_regex": r"[0-9]{3}-[a-z]{2}",
            },
        )
        assert r.status_code == 200, r.text
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.json()["choices"][0]["text"]), r.json()
    # vLLM's structured_outputs object, streamed: the same constraint
    req = {**CHAT, "max_tokens": 16, "stream": True, "structured_outputs": {"choice": choices}}
    with client.stream("POST", "/v1/chat/completions", json=req) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content") or "" for ln in lines[:-1])
    assert text in choices
    # guided_json on plain completions: the reply is JSON of the schema
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 2]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "{", "max_tokens": 32, "guided_json": schema}
    )
    assert json.loads(r.json()["choices"][0]["text"])["a"] in (1, 2)


def test_chat_template_controls(client):
    def ids(**kw):
        msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
        r = client.post("/tokenize", json={"model": MODEL, "messages": msgs, **kw})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    tok = client.post("/tokenize", json={"prompt": "Hello the", "add_special_tokens": False}).json()["tokens"]
    cont = ids(add_generation_prompt=False, continue_final_message=True)
    assert cont[-len(tok) :] == tok  # the prompt ends inside the assistant's message
    closed = ids(add_generation_prompt=False)
    assert closed[: len(cont)] == cont and len(closed) > len(cont)
    r = client.post(
        "/v1/chat/completions",
        json={**CHAT, "chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": True},
    )
    assert r.status_code == 200, r.text


def test_json_object_shows_the_model_no_schema(server):
    from minisgl_backend.chat import render_chat

    tok = server.state.engine.tokenizer
    prompt = render_chat(
        tok, [{"role": "user", "content": "Tell a joke"}], response_format={"type": "json_object"}
    )
    assert "additionalProperties" not in prompt.text and "json_object" in prompt.text


LONG_ARGS = {
    "type": "function",
    "function": {
        "name": "note",
        "description": "Write a note.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
            "required": ["text", "n"],
        },
    },
}


def test_a_forced_tool_call_cut_by_max_tokens_returns_what_was_generated(server, client):
    req = {**CHAT, "tools": [LONG_ARGS], "tool_choice": "required", "max_tokens": 20, "temperature": 0}
    body = client.post("/v1/chat/completions", json=req).json()
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length", choice
    (call,) = choice["message"]["tool_calls"]  # the partial call, not an empty reply
    assert call["function"]["name"] == "note"
    partial = json.loads(call["function"]["arguments"])  # the partial object, closed
    assert isinstance(partial, dict) and set(partial) <= {"text", "n"}
    with client.stream("POST", "/v1/chat/completions", json={**req, "stream": True}) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
    calls = [
        e["choices"][0]["delta"]["tool_calls"] for e in events if e["choices"][0]["delta"].get("tool_calls")
    ]
    assert calls and calls[0][0]["function"]["arguments"] == call["function"]["arguments"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    class Note(BaseModel):
        """Write a note."""

        text: str
        n: int

    chat = lc.ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model=MODEL, temperature=0, max_tokens=20)
    try:
        out = chat.with_structured_output(Note, method="function_calling").invoke("Take a note.")
    except Exception as e:  # noqa: BLE001 - rejecting the partial object (a missing field) is fine
        assert "Note" in str(e) or "validation" in str(e).lower(), e
    else:  # or the partial object itself, never a silent None
        assert isinstance(out, Note), out


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "note"}}])
def test_a_forced_tool_call_cut_before_its_name_comes_back_as_content(client, choice):
    # The grammar makes the tiny model write `<tool_call>` `\n` `{"` `name` ... one token each: cut
    # within those, there is no call to return, so the tokens generated are the content.
    req = {**CHAT, "tools": [LONG_ARGS], "tool_choice": choice, "temperature": 0, "logprobs": True}
    for max_tokens in (1, 5, 6, 8):
        r = client.post("/v1/chat/completions", json={**req, "max_tokens": max_tokens})
        assert r.status_code == 200, r.text
        body = r.json()
        (c,) = body["choices"]
        written = "".join(t["token"] for t in c["logprobs"]["content"])
        assert body["usage"]["completion_tokens"] == max_tokens and len(written) > 0
        assert c["finish_reason"] == "length" and not c["message"].get("tool_calls"), c
        assert c["message"]["content"] == written, (max_tokens, c["message"], written)
        with client.stream(
            "POST", "/v1/chat/completions", json={**req, "max_tokens": max_tokens, "stream": True}
        ) as s:
            events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln and ln != "data: [DONE]"]
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == written
        assert not any(e["choices"][0]["delta"].get("tool_calls") for e in events)
        assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_kv_usage_counts_blocks_held_by_requests_and_cached_blocks_apart(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    def gauges() -> dict[str, float]:
        text = client.get("/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    prompt = list(range(100, 164))  # 4 full blocks of 16, cached once the request is done
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200
    server.state.engine.drain(timeout=30)
    deadline = time.monotonic() + 30  # the engine folds its gauges about once a second
    while True:
        g = gauges()
        if g["minisgl:kv_cache_cached_perc"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert g["minisgl:kv_cache_usage_perc"] == 0.0, g  # idle: no request holds a block
    assert g["minisgl:kv_cache_cached_perc"] >= 4 / 64, g


def test_a_streaming_client_that_stops_reading_is_cut_off_and_its_requests_aborted():
    # The mechanism, without sockets (on loopback the kernel buffers a few MB before a send blocks):
    # a send that does not complete within the idle timeout ends the response and closes the body
    # (whose `finally` aborts the requests); undelivered events past the buffer bound abort at once.
    import asyncio

    from minisgl_backend.serve.errors import SlowClientError
    from minisgl_backend.serve.guard import GuardedStreamingResponse
    from minisgl_backend.serve.streams import StreamMerger

    closed = []

    async def body():
        try:
            for i in range(10):
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    sent = []

    async def send(msg):
        sent.append(msg)
        if msg["type"] == "http.response.body" and len(sent) > 2:
            await asyncio.sleep(3600)  # the client reads nothing any more

    async def stream_once():
        resp = GuardedStreamingResponse(body(), 0.2, media_type="text/event-stream")
        t0 = time.monotonic()
        await resp.stream_response(send)
        return time.monotonic() - t0

    took = asyncio.run(stream_once())
    assert 0.15 < took < 2 and closed == [True] and len(sent) == 3

    class Endless:
        request_id, aborted = "r", False

        async def events(self):
            i = 0
            while not self.aborted:
                yield i
                i += 1
                await asyncio.sleep(0)

        def abort(self):
            self.aborted = True

    async def overflow():
        s = Endless()
        merged = StreamMerger([s], limit=50)
        await asyncio.sleep(0.2)  # the client reads nothing meanwhile
        items = [await merged.next() for _ in range(51)]
        merged.close()
        return s, items

    s, items = asyncio.run(overflow())
    assert s.aborted and isinstance(items[-1][1], SlowClientError) and len(items) == 51


def test_a_grammar_failing_mid_stream_ends_with_an_error_event_and_done():
    from minisgl_backend.chat import GrammarError
    from minisgl_backend.errors import RequestFailedError
    from minisgl_backend.serve.streams import sse_error

    failed = RequestFailedError("logits processor raised GrammarError(...)")
    failed.__cause__ = GrammarError("the output grammar exceeds the parser's limits: too many items")
    events = sse_error(failed).strip().split("\n\n")
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[0][len("data: ") :])["error"]
    assert err["code"] == "invalid_grammar" and "parser's limits" in err["message"]


def test_deeply_nested_tool_call_arguments_are_not_a_500(client):
    """An assistant tool call whose `arguments` string is JSON nested past the parser's depth: kept
    as text in the prompt, so the request gets a typed answer: here the 400 for a prompt past the
    tiny model's context (before, a RecursionError made it a 500)."""
    deep = "[" * 5000 + "]" * 5000
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": deep}}
    messages = [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "user", "content": "thanks"},
    ]
    r = client.post("/v1/chat/completions", json={**CHAT, "messages": messages, "tools": [TOOL]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert_serves(client, MODEL)


def test_context_errors_read_as_english(client):
    """The 400 for an input past the context names it once, with its article."""
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 1100, "max_tokens": 2})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and msg.startswith("the prompt has 1100 tokens"), msg
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "word " * 1100}]}
    msg = client.post("/v1/chat/completions", json=long_chat).json()["error"]["message"]
    assert msg.startswith("the conversation has ") and "the the" not in msg, msg


# ------------------------------------------------------------------------------ what a web page can send
# A page on any site can POST these types (or a typeless blob) without the browser asking the server
# first; each would run a generation on a local server if the body were parsed as JSON regardless.
NOT_JSON = [
    "text/plain",
    "text/plain;charset=UTF-8",
    "application/x-www-form-urlencoded",  # what `curl -d` sends unless told otherwise
    "multipart/form-data; boundary=x",
    None,
]


@pytest.mark.parametrize("ctype", NOT_JSON, ids=[str(c) for c in NOT_JSON])
@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
        ("/v1/chat/completions", CHAT),
        ("/tokenize", {"prompt": "Hi"}),
        ("/detokenize", {"tokens": [5]}),
    ],
    ids=["completions", "chat", "tokenize", "detokenize"],
)
def test_a_body_not_sent_as_json_is_refused_with_415(server, client, ctype, path, body):
    headers = {**AUTH, **({"content-type": ctype} if ctype else {})}
    with httpx.Client(base_url=server.url, timeout=30) as c:  # its own connection: the answer closes it
        r = c.post(path, content=json.dumps(body).encode(), headers=headers)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == "unsupported_media_type" and "application/json" in err["message"], err
    # JSON with a charset parameter, in any case, is JSON
    r = client.post(
        path, content=json.dumps(body).encode(), headers={"content-type": "Application/JSON; charset=utf-8"}
    )
    assert r.status_code == 200, r.text


# A page that makes its own name resolve to 127.0.0.1 ("DNS rebinding") reaches the server with that
# name in Host; the server answers only to its own names.
REBOUND = ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", "localhost.evil.example", "[::2]"]
OWN = ["127.0.0.1", "127.0.0.1:8000", "localhost", "LocalHost:1", "localhost.", "[::1]", "[::1]:8000"]


def test_a_request_for_another_host_name_is_refused_with_421(server, client):
    for host in REBOUND:
        for method, path, body in (
            ("GET", "/health", None),
            ("GET", "/v1/models", None),
            ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
        ):
            with httpx.Client(base_url=server.url, timeout=30) as c:  # the answer closes the connection
                r = c.request(method, path, json=body, headers={**AUTH, "Host": host})
            assert r.status_code == 421, (host, path, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["code"] == "host_not_allowed" and "--allowed-hosts" in err["message"], err
    for host in OWN:
        r = client.get("/v1/models", headers={"Host": host})
        assert r.status_code == 200, (host, r.text)
    assert_serves(client, MODEL)


def test_allowed_hosts_adds_names_and_a_server_on_every_interface_checks_only_when_told():
    from minisgl_backend.cli import _extra_hosts, build_parser
    from minisgl_backend.serve.guard import allowed_hosts

    loopback = {"127.0.0.1", "localhost", "[::1]"}
    assert allowed_hosts("127.0.0.1") == loopback
    assert allowed_hosts("10.0.0.5") == loopback | {"10.0.0.5"}
    assert allowed_hosts("fd00::5") == loopback | {"[fd00::5]"}
    assert allowed_hosts("0.0.0.0") is None and allowed_hosts("::") is None  # names it cannot know
    assert allowed_hosts("0.0.0.0", ["box.lan"]) == loopback | {"box.lan"}
    assert allowed_hosts("127.0.0.1", ["*"]) is None
    args = build_parser().parse_args(["serve", "--allowed-hosts", "a.lan, B.lan:80", "--allowed-hosts", "c"])
    assert allowed_hosts("0.0.0.0", _extra_hosts(args)) == loopback | {"a.lan", "b.lan", "c"}


def test_a_name_given_by_allowed_hosts_is_answered(server):
    from minisgl_backend.serve import start_in_thread

    srv = start_in_thread(server.state.engine, api_key=KEY, model_name=MODEL, extra_hosts=["box.lan"])
    try:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
            assert c.get("/v1/models", headers={"Host": "box.lan:8000"}).status_code == 200
            assert c.get("/v1/models", headers={"Host": "other.lan"}).status_code == 421
    finally:
        srv.stop()


def test_the_prompts_of_one_client_request_are_one_owner_for_fair_admission(server, client, monkeypatch):
    engine = server.state.engine
    owners: list[str] = []
    submit = engine.submit

    def recording(prompt, params, request_id=None, owner=None):
        owners.append(owner)
        return submit(prompt, params, request_id=request_id, owner=owner)

    monkeypatch.setattr(engine, "submit", recording)
    for _ in range(2):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 1})
        assert r.status_code == 200, r.text
    assert len(owners) == 6 and len(set(owners[:3])) == 1 and len(set(owners[3:])) == 1
    assert owners[0] is not None and owners[0] != owners[3]


def test_a_trailing_slash_is_a_404_not_a_redirect_built_from_host(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=10, follow_redirects=False) as c:
        for path in ("/health/", "/v1/models/"):
            r = c.get(path)
            assert r.status_code == 404 and "location" not in r.headers, (path, r.status_code, r.headers)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_chat_logprob_bytes_of_tokens_holding_part_of_a_character_join_into_the_text(client):
    """An emoji is several byte-level tokens, each decoding alone to U+FFFD: their `bytes` are the
    token's own, so a client joining them gets the emoji back (OpenAI's reason for the field)."""
    req = {**CHAT, "guided_regex": "😀 é😀", "max_tokens": 12, "logprobs": True, "top_logprobs": 2}
    r = client.post("/v1/chat/completions", json=req)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["message"]["content"] == "😀 é😀"
    entries = choice["logprobs"]["content"]
    assert len(entries) > 3  # several tokens per emoji
    joined = bytes(b for e in entries for b in e["bytes"]).decode("utf-8")
    assert joined.startswith("😀 é😀"), joined  # (then the end-of-turn token the grammar let through)
    assert all(e["bytes"] != [239, 191, 189] for e in entries), entries  # no U+FFFD stand-ins


def test_drain_calls_on_idle_each_time_its_last_request_ends():
    """The server hands freed memory back when no request is in flight (serve/heap.py): Drain tells
    it when the last one ends, not at every request's end."""
    from minisgl_backend.serve.guard import Drain

    calls = []
    drain = Drain(on_idle=lambda: calls.append(drain.inflight))
    drain.enter()
    drain.enter()
    drain.leave()
    assert calls == []
    drain.leave()
    assert calls == [0]
    drain.enter()
    drain.leave()
    assert calls == [0, 0]


def test_the_heap_trimmer_trims_only_past_its_threshold_of_growth(monkeypatch):
    """A trim when RSS grew by the threshold over the last trim's value; none below it, and a lower
    reading lowers the reference."""
    from minisgl_backend.serve import heap

    rss = [1000]
    monkeypatch.setattr(heap, "rss_bytes", lambda: rss[0])
    trims = []
    monkeypatch.setattr(heap, "malloc_trim", lambda: trims.append(rss[0]) or True)
    monkeypatch.setattr(heap, "_MALLOC_TRIM", object())
    t = heap.HeapTrimmer(threshold=100)
    rss[0] = 1099
    assert not t.maybe_trim() and trims == []
    rss[0] = 900  # memory returned by other means: the reference drops
    assert not t.maybe_trim()
    rss[0] = 1000
    assert t.maybe_trim() and trims == [1000] and t.trims == 1
    assert not t.maybe_trim()  # the value after the trim is the new reference


def test_the_cpu_pools_daemon_threads_deliver_results_and_errors_and_drop_queued_jobs_at_close():
    import threading

    from minisgl_backend.serve.state import DaemonExecutor

    ex = DaemonExecutor(2, "t")
    assert ex.submit(lambda x: x + 1, 1).result(10) == 2
    with pytest.raises(ZeroDivisionError):
        ex.submit(lambda: 1 / 0).result(10)
    release, started = threading.Event(), threading.Semaphore(0)

    def hold() -> bool:
        started.release()
        return release.wait(10)

    busy = [ex.submit(hold) for _ in range(2)]
    assert started.acquire(timeout=10) and started.acquire(timeout=10)  # both workers held
    queued = ex.submit(lambda: "never")
    workers = [t for t in threading.enumerate() if t.name.startswith("t_")]
    assert len(workers) == 2 and all(t.daemon for t in workers)  # not joined at the process's exit
    ex.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(lambda: None)
    release.set()
    assert all(f.result(10) for f in busy)  # running jobs finish
    for t in workers:
        t.join(10)
        assert not t.is_alive()
