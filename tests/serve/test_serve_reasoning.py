"""`minisgl serve --reasoning-parser`: a reasoning model's leading <think>...</think> goes to the chat
message's `reasoning` (streamed as `reasoning` deltas) and the answer alone to `content`, split by
the code the LangChain adapter uses (minisgl_backend/chat/reasoning.py); without the flag the
reply is left as it is."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")

from minisgl_backend import EngineConfig  # noqa: E402
from tests.serve.servers import serving  # noqa: E402

TRACE, ANSWER = "plan it", "The answer."
MODEL = "thinker"


@pytest.fixture(scope="module")
def thinker_dir(smollm_dir, tmp_path_factory):
    """A scripted tiny Llama (SmolLM2's tokenizer with <think> and </think> as single tokens, as
    Qwen3 has them): after the generation prompt it says <think>plan it</think>The answer. and EOS."""
    from transformers import AutoTokenizer

    from minisgl_backend.tools.tiny import make_scripted_llama

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    tok.add_tokens(["<think>", "</think>"])
    said = tok.encode(f"<think>{TRACE}</think>{ANSWER}", add_special_tokens=False)
    history = [{"role": "user", "content": "x"}]
    entry = tok.encode(tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True))
    assert len(set(said)) == len(said) and entry[-1] not in said  # one successor per token
    script = dict(zip([entry[-1], *said], [*said, tok.eos_token_id]))
    return make_scripted_llama(tmp_path_factory.mktemp("scripted-thinker"), tok, script)


def _serve(path, parser):
    config = EngineConfig(model=str(path), num_threads=1, stats_interval_s=0, num_blocks=64)
    return serving(config, key="k", model=MODEL, reasoning_parser=parser)


def _chat(url: str, stream: bool) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 32,
        "stream": stream,
    }
    return httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"}, timeout=60
    )


def _streamed(r: httpx.Response) -> tuple[str, str]:
    content = reasoning = ""
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                content += choice["delta"].get("content") or ""
                reasoning += choice["delta"].get("reasoning") or ""
    return content, reasoning


def test_the_trace_goes_to_reasoning_whole_and_streamed(thinker_dir):
    with _serve(thinker_dir, "qwen3") as srv:
        r = _chat(srv.url, stream=False)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert (message["content"], message["reasoning"]) == (ANSWER, TRACE)
        assert _streamed(_chat(srv.url, stream=True)) == (ANSWER, TRACE)


def test_without_the_parser_the_reply_stays_whole(thinker_dir):
    with _serve(thinker_dir, None) as srv:
        message = _chat(srv.url, stream=False).json()["choices"][0]["message"]
        assert message["content"] == f"<think>{TRACE}</think>{ANSWER}" and "reasoning" not in message
        content, reasoning = _streamed(_chat(srv.url, stream=True))
        assert content == f"<think>{TRACE}</think>{ANSWER}" and reasoning == ""


def test_an_unknown_parser_is_refused(thinker_dir):
    from minisgl_backend import Engine
    from minisgl_backend.serve import start_in_thread

    with Engine(EngineConfig(model=str(thinker_dir), num_threads=1, num_blocks=16)) as engine:
        with pytest.raises(ValueError, match="reasoning parser 'granite'"):
            start_in_thread(engine, reasoning_parser="granite")
