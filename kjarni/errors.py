"""Every error kjarni raises on purpose: one base class, one subclass per kind of failure.

Messages name the thing (file, tensor, value) and say what to do next. Callers catch
``KjarniError`` to handle them all.
"""

from __future__ import annotations


class KjarniError(Exception):
    """Base class of every error kjarni raises on purpose."""


class UnknownModelError(KjarniError):
    """A model name that is neither in the registry nor a local path."""


class ModelNotDownloadedError(KjarniError):
    """The model is not in the cache and the download policy forbids fetching it."""


class DownloadFailedError(KjarniError):
    """Fetching model files failed (network, pip, checksum)."""


class HubUnreachableError(DownloadFailedError):
    """The Hugging Face hub (or ``HF_ENDPOINT``) could not be reached at all: no network, DNS, proxy.

    Raised after one request, not after huggingface_hub's retries with back-off.
    """


class LoadFailedError(KjarniError):
    """Model files exist but could not be read: missing, truncated, corrupted or inconsistent."""


class ModelPathNotFoundError(LoadFailedError):
    """A model named by a path (``./x``, ``/x``, ``~/x``, ``x.gguf``, ``folder/x``) that does not exist."""


class GpuUnavailableError(KjarniError):
    """The GPU was asked for but no usable WebGPU adapter or device exists."""


class UnsuitableDeviceError(GpuUnavailableError):
    """A GPU device given to kjarni (an application's own) lacks limits kjarni needs.

    ``missing_limits`` lists them as ``"name: have X, need Y"``.
    """

    def __init__(self, message: str, *, missing_limits: list[str]) -> None:
        super().__init__(message)
        self.missing_limits = list(missing_limits)


class GenerationFailedError(KjarniError):
    """Generation could not run or stopped on an internal failure."""


class NonFiniteLogitsError(GenerationFailedError):
    """The model produced NaN or infinite logits; ``step`` names where (the prefill, a decode step).

    NaN or inf weights, or hidden states that overflow float32, end up here rather than as a
    token chosen from garbage (greedy argmax of NaN logits would pick token 0, often end-of-text).
    """

    def __init__(self, message: str, *, step: str) -> None:
        super().__init__(message)
        self.step = step


class HostOutOfMemoryError(LoadFailedError):
    """The machine's own memory (RAM, not the GPU's) ran out while loading a model."""


class InvalidModelError(KjarniError):
    """The model is of a kind kjarni cannot run (not a decoder, unsupported architecture or tensor type)."""


class InvalidConfigurationError(KjarniError):
    """A setting is out of range or settings contradict each other."""


class ContextOverflowError(KjarniError):
    """A prompt (or prompt plus generation) does not fit in the model's context."""

    def __init__(self, message: str, *, tokens: int, context: int) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.context = context


class ChatTemplateError(KjarniError):
    """A model has no chat template, or its template does not compile or fails on the messages."""
