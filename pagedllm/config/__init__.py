"""Configuration: what a model is (model.py), the engine's options (engine.py), and how an
option is declared (option.py)."""

from .engine import (
    KV_CACHE_DTYPES,
    SECTIONS,
    SUPPORTED_BLOCK_SIZES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    LoRAConfig,
    MultimodalConfig,
    ParallelConfig,
    SchedulerConfig,
    SpecDecodeConfig,
    cdiv,
    engine_options,
    normalize_kv_cache_dtype,
)
from .model import ModelConfig
from .option import Option, option

__all__ = [
    "ModelConfig",
    "EngineConfig",
    "LoadConfig",
    "DeviceConfig",
    "CacheConfig",
    "SchedulerConfig",
    "ParallelConfig",
    "LoRAConfig",
    "MultimodalConfig",
    "SpecDecodeConfig",
    "SECTIONS",
    "engine_options",
    "Option",
    "option",
    "cdiv",
    "SUPPORTED_BLOCK_SIZES",
    "KV_CACHE_DTYPES",
    "normalize_kv_cache_dtype",
]
