"""LangChain integration of the minisgl engine: `MiniSGL` (LLM) and `ChatMiniSGL` (chat model)."""

EXTRA = "pip install 'minisgl[langchain]'"

try:
    from langchain_minisgl._engines import close_all, close_engine, running_configs
    from langchain_minisgl.chat_models import ChatMiniSGL
    from langchain_minisgl.llms import MiniSGL
except ModuleNotFoundError as e:  # langchain-core is the `langchain` extra, not a requirement of the engine
    if not (e.name or "").startswith(("langchain_core", "pydantic")):
        raise
    message = f"{e}: the LangChain adapter needs the langchain extra: {EXTRA}"
    raise ModuleNotFoundError(message, name=e.name) from e

__all__ = ["ChatMiniSGL", "MiniSGL", "close_all", "close_engine", "running_configs"]
