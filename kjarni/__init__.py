"""kjarni: text generation for decoder language models on any GPU through WebGPU, with a numpy reference."""

from kjarni.errors import (
    ChatTemplateError,
    ContextOverflowError,
    DownloadFailedError,
    GenerationFailedError,
    GpuUnavailableError,
    HubUnreachableError,
    InvalidConfigurationError,
    InvalidModelError,
    KjarniError,
    LoadFailedError,
    ModelNotDownloadedError,
    ModelPathNotFoundError,
    UnknownModelError,
    UnsuitableDeviceError,
)

__version__ = "0.1.0"

# The API and the GPU context load on first use, so `import kjarni` stays cheap and does not
# touch wgpu until a GPU is asked for.
_LAZY = {
    "Generator": "kjarni.generator",
    "GeneratorBuilder": "kjarni.generator",
    "GenerationOverrides": "kjarni.generator",
    "KjarniDevice": "kjarni.generator",
    "WgpuContext": "kjarni.gpu",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kjarni' has no attribute {name!r}")


__all__ = [
    "GenerationOverrides",
    "Generator",
    "GeneratorBuilder",
    "KjarniDevice",
    "WgpuContext",
    "ChatTemplateError",
    "ContextOverflowError",
    "DownloadFailedError",
    "GenerationFailedError",
    "GpuUnavailableError",
    "HubUnreachableError",
    "InvalidConfigurationError",
    "InvalidModelError",
    "KjarniError",
    "LoadFailedError",
    "ModelNotDownloadedError",
    "ModelPathNotFoundError",
    "UnknownModelError",
    "UnsuitableDeviceError",
]
