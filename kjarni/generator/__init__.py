"""kjarni.generator: raw text generation for decoder language models.

    from kjarni.generator import Generator

    generator = Generator.builder("smollm2-135m-instruct").cpu().temperature(0.8).max_tokens(100).build()
    print(generator.generate("The capital of France is"))

Every blocking call has an awaitable twin named with an ``a`` prefix (``agenerate``, ``astream``,
``abuild``, ...). See docs/api.md.
"""

from __future__ import annotations

import threading
from typing import Any

from kjarni.generator.config import (
    GenerationOverrides,
    KjarniDevice,
    LoadConfig,
    LoadConfigBuilder,
    ResolvedGenerationConfig,
)
from kjarni.generator.generator import Generator, GeneratorBuilder
from kjarni.generator.streams import AsyncTokenStream, GeneratedToken, TokenStream
from kjarni.generator.presets import (
    ALL_V1_PRESETS,
    GENERATOR_BALANCED_V1,
    GENERATOR_CODE_V1,
    GENERATOR_CREATIVE_V1,
    GENERATOR_FAST_V1,
    GENERATOR_QUALITY_V1,
    GeneratorPreset,
    GeneratorTier,
    find_preset,
    list_presets,
)
from kjarni.generator.availability import available_models, is_generator_model, suggested_models
from kjarni.prefix_cache import DEFAULT_PREFIX_CACHE_TOKENS
from kjarni.sources import DownloadPolicy

__all__ = [
    "ALL_V1_PRESETS",
    "DEFAULT_PREFIX_CACHE_TOKENS",
    "GENERATOR_BALANCED_V1",
    "GENERATOR_CODE_V1",
    "GENERATOR_CREATIVE_V1",
    "GENERATOR_FAST_V1",
    "GENERATOR_QUALITY_V1",
    "AsyncTokenStream",
    "DownloadPolicy",
    "GeneratedToken",
    "GenerationOverrides",
    "Generator",
    "GeneratorBuilder",
    "GeneratorPreset",
    "GeneratorTier",
    "KjarniDevice",
    "LoadConfig",
    "LoadConfigBuilder",
    "ResolvedGenerationConfig",
    "TokenStream",
    "agenerate",
    "available_models",
    "find_preset",
    "generate",
    "is_generator_model",
    "list_presets",
    "suggested_models",
]

# generate()/agenerate() keep the last Generator they built, so a loop of calls on one model loads it once.
_last: tuple[str, Generator] | None = None
_last_lock = threading.Lock()


def _generator_for(model: str) -> Generator:
    global _last
    with _last_lock:
        if _last is not None and _last[0] == model:
            return _last[1]
        _last = None  # free the previous model before loading the next
        generator = Generator.new(model)
        _last = (model, generator)
        return generator


def generate(model: str, prompt: str, **settings: Any) -> str:
    """Generate text after ``prompt`` with ``model``'s default settings, or the keyword
    ``settings`` of ``Generator.generate`` (``max_tokens=``, ``temperature=``, ...) for this call.

    The Generator is kept for the next call with the same model; build one yourself
    (``Generator.new``) to control its lifetime or settings.
    """
    return _generator_for(model).generate(prompt, **settings)


async def agenerate(model: str, prompt: str, **settings: Any) -> str:
    """``generate`` for asyncio (loading and generation run in worker threads)."""
    import asyncio

    generator = await asyncio.to_thread(_generator_for, model)
    return await generator.agenerate(prompt, **settings)
