"""kjarni: text generation for decoder language models on any GPU through WebGPU, with a numpy reference."""

from kjarni.errors import (
    ContextOverflowError,
    DownloadFailedError,
    GenerationFailedError,
    GpuUnavailableError,
    InvalidConfigurationError,
    InvalidModelError,
    KjarniError,
    LoadFailedError,
    ModelNotDownloadedError,
    UnknownModelError,
)

__version__ = "0.1.0"

__all__ = [
    "ContextOverflowError",
    "DownloadFailedError",
    "GenerationFailedError",
    "GpuUnavailableError",
    "InvalidConfigurationError",
    "InvalidModelError",
    "KjarniError",
    "LoadFailedError",
    "ModelNotDownloadedError",
    "UnknownModelError",
]
