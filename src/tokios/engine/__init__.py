"""The engine: EngineCore (model, KV cache, scheduler, runner), LLM (offline) and AsyncEngine
(background step loop with per-request async streams, used by the server)."""

from tokios.engine.async_engine import AsyncEngine
from tokios.engine.core import EngineCore, EngineStats
from tokios.engine.llm import LLM

__all__ = ["AsyncEngine", "EngineCore", "EngineStats", "LLM"]
