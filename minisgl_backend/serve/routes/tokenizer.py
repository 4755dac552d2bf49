"""vLLM's tokenizer endpoints: /tokenize (a prompt, or a conversation through the chat template),
/detokenize and /tokenizer_info. The work runs on the CPU pool: long texts are what /tokenize is
for (lm-eval's rolling windows)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Response

from minisgl_backend.chat import render_chat
from minisgl_backend.serve.bodies import documented_body, json_body
from minisgl_backend.serve.errors import APIError
from minisgl_backend.serve.protocol import DetokenizeRequest, TokenizeRequest
from minisgl_backend.serve.responses import DetokenizeResponse, TokenizeResponse, TokenizerInfo
from minisgl_backend.serve.state import AppState, keyed_router

router = keyed_router()


@router.post("/tokenize", response_model=TokenizeResponse, openapi_extra=documented_body(TokenizeRequest))
async def tokenize(
    state: AppState, body: Annotated[TokenizeRequest, Depends(json_body(TokenizeRequest))]
) -> Response:
    state.check_model(body.model)
    if body.messages is not None:
        state.check_request_chars(sum(m.chars() for m in body.messages), "the conversation", "messages")
    else:
        state.check_request_chars(len(body.prompt or ""), "the prompt", "prompt")
    messages = [m.template_dict() for m in body.messages] if body.messages is not None else None

    def work() -> str:
        tok = state.pool.tokenizer()
        if messages is not None:
            ids = render_chat(
                tok,
                messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs,
            ).token_ids
        else:
            ids = list(tok.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        return TokenizeResponse(
            count=len(ids),
            max_model_len=state.backend.max_model_len,
            tokens=ids,
            token_strs=tok.convert_ids_to_tokens(ids) if body.return_token_strs else None,
        ).model_dump_json()

    return Response(await state.pool.run(work), media_type="application/json")


@router.post(
    "/detokenize", response_model=DetokenizeResponse, openapi_extra=documented_body(DetokenizeRequest)
)
async def detokenize(
    state: AppState, body: Annotated[DetokenizeRequest, Depends(json_body(DetokenizeRequest))]
) -> Response:
    state.check_model(body.model)
    vocab = state.backend.vocab_size

    def work() -> str:
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
        return DetokenizeResponse(prompt=state.pool.tokenizer().decode(body.tokens)).model_dump_json()

    return Response(await state.pool.run(work), media_type="application/json")


@router.get("/tokenizer_info")
async def tokenizer_info(state: AppState) -> TokenizerInfo:
    tok = state.tokenizer
    return TokenizerInfo(
        tokenizer_class=type(tok).__name__,
        eos_token=tok.eos_token,
        bos_token=tok.bos_token,
        pad_token=tok.pad_token,
        unk_token=tok.unk_token,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        chat_template=getattr(tok, "chat_template", None),
        model_max_length=state.backend.max_model_len,
        vocab_size=state.backend.vocab_size,
        add_bos_token=getattr(tok, "add_bos_token", None),
    )
