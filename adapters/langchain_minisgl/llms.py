"""MiniSGL: the engine as a LangChain text-completion LLM (BaseLLM, so batch() is one engine batch)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict

from langchain_minisgl._base import (
    MiniSGLParams,
    await_handle,
    check_streamable,
    stream_async,
    stream_sync,
    usage_of,
)
from minisgl_backend import RequestOutput, StreamDelta


class MiniSGL(MiniSGLParams, BaseLLM):
    """Text completion on an in-process minisgl engine.

    >>> llm = MiniSGL(temperature=0, max_tokens=16, engine_config={"dtype": "bfloat16"})
    >>> llm.invoke("The capital of France is")

    Models with the same model + engine config share one engine (see `langchain_minisgl.close_all`).
    """

    model_config = ConfigDict(protected_namespaces=())

    @property
    def _llm_type(self) -> str:
        return "minisgl"

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        # BaseLLM.batch() lands here once with every prompt: all go into the engine before any is awaited.
        self.check_call_kwargs(kwargs)
        params = self.sampling_params(stop, kwargs)
        outs = self.run_sync(kwargs, lambda eng: [eng.submit(p, params) for p in prompts])
        return self._result(outs, kwargs)

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        self.check_call_kwargs(kwargs)
        params = self.sampling_params(stop, kwargs)
        outs = await self.run_async(kwargs, lambda eng: [eng.submit(p, params) for p in prompts])
        return self._result(outs, kwargs)

    def _result(self, outs: list, kwargs: dict[str, Any]) -> LLMResult:
        gens = [  # per prompt, its n samples
            [
                Generation(text=s.text, generation_info={"finish_reason": s.finish_reason, "seed": s.seed})
                for s in o.samples
            ]
            for o in outs
        ]
        return LLMResult(
            generations=gens,
            llm_output={"token_usage": usage_of(outs), "model_name": kwargs.get("model", self.model_name)},
        )

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        self.check_call_kwargs(kwargs)
        params = self.sampling_params(stop, kwargs)
        check_streamable(params)
        engine = self.engine_for(kwargs)
        handle = engine.submit(prompt, params)
        for delta in stream_sync(engine, handle):
            # The final delta is posted just before the result: result() returns at once.
            chunk = self._chunk(delta, handle.result() if delta.finished else None, kwargs)
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        self.check_call_kwargs(kwargs)
        params = self.sampling_params(stop, kwargs)
        check_streamable(params)
        engine = self.engine_for(kwargs)
        handle = engine.submit(prompt, params)
        async for delta in stream_async(engine, handle):
            out = await await_handle(engine, handle) if delta.finished else None
            chunk = self._chunk(delta, out, kwargs)
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _chunk(
        self, delta: StreamDelta, out: RequestOutput | None, kwargs: dict[str, Any]
    ) -> GenerationChunk:
        if out is None:
            return GenerationChunk(text=delta.text)
        info = {
            "finish_reason": out.finish_reason,
            "seed": out.seed,
            "token_usage": usage_of([out]),
            "model_name": kwargs.get("model", self.model_name),
        }
        return GenerationChunk(text=delta.text, generation_info=info)

    def get_num_tokens(self, text: str) -> int:
        """Tokens of `text` under the engine's own tokenizer (the LangChain default downloads GPT-2's)."""
        return len(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def get_token_ids(self, text: str) -> list[int]:
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))
