"""LangChain integration of the minisgl engine: `MiniSGL` (LLM) and `ChatMiniSGL` (chat model)."""

from langchain_minisgl._engines import close_all, close_engine, running_configs
from langchain_minisgl.chat_models import ChatMiniSGL
from langchain_minisgl.llms import MiniSGL

__all__ = ["ChatMiniSGL", "MiniSGL", "close_all", "close_engine", "running_configs"]
