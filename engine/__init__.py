"""cuserve's engine: everything below HTTP. Imports nothing from server/."""

from .config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from .engine import CompletionOutput, Engine, RequestOutput
from .llm import LLM
from .request import SamplingParams
from .scheduler import QueueFullError

__all__ = [
    "LLM", "CacheConfig", "CompletionOutput", "Engine", "EngineConfig", "ModelConfig", "QueueFullError",
    "RequestOutput", "SamplingParams", "SchedulerConfig",
]
