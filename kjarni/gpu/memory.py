"""How much GPU memory a model will take, estimated from its files before anything is uploaded.

WebGPU does not report how much memory an adapter has, so the budget is what the user says
(``KJARNI_GPU_MEMORY_MB``, or ``WgpuContext(memory_budget=...)``); with a budget, a model whose
estimate exceeds it is refused before allocation. Without one, an allocation that fails while
loading is reported with the same estimate (see ``GeneratorBuilder``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from kjarni.model_config import ModelConfig
from kjarni.errors import InvalidConfigurationError
from kjarni.weights import QuantTensor, Weights

# Bytes per weight of float tensors by GPU weight format (Q8_0: 34 bytes per 32 weights).
_FLOAT_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}


@dataclass(frozen=True)
class GpuEstimate:
    """Bytes a model needs on the GPU: weights as the GPU keeps them, and the KV cache."""

    weight_bytes: int
    kv_cache_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes

    def describe(self) -> str:
        return (
            f"about {self.total_bytes / 2**30:.2f} GiB (weights {self.weight_bytes / 2**30:.2f} GiB, "
            f"KV cache {self.kv_cache_bytes / 2**30:.2f} GiB)"
        )


def estimate(weights: Weights, config: ModelConfig, *, weight_format: str, kv_format: str, context: int) -> GpuEstimate:
    """The GPU bytes of ``weights`` in ``weight_format`` plus a KV cache of ``context`` positions.

    GGUF blocks count as stored (they stay quantized on the GPU); float tensors at the format's
    width. Tied tensors count once. Activation scratch (a few MB at batch 1) is left out.
    """
    if weight_format not in _FLOAT_BYTES or kv_format not in ("f16", "f32"):
        raise InvalidConfigurationError(f"unknown weight format {weight_format!r} or KV format {kv_format!r}")
    total = 0.0
    for name in weights.names():
        if weights.alias_of(name) is not None:
            continue
        raw = weights.raw(name)
        if isinstance(raw, QuantTensor):
            total += raw.data.nbytes
        else:
            total += raw.size * (_FLOAT_BYTES[weight_format] if raw.ndim == 2 else 4)
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * context
    return GpuEstimate(int(total), kv * (2 if kv_format == "f16" else 4))


def checked_budget(budget: object, where: str = "memory_budget") -> int:
    """``budget`` (bytes) if it is a positive integer, else `InvalidConfigurationError`."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise InvalidConfigurationError(f"{where}={budget!r} must be a positive whole number of bytes")
    return budget


def budget_from_env() -> int | None:
    """``KJARNI_GPU_MEMORY_MB`` in bytes, or None when unset."""
    value = os.environ.get("KJARNI_GPU_MEMORY_MB")
    if not value:
        return None
    try:
        megabytes = float(value)
    except ValueError:
        raise InvalidConfigurationError(f"KJARNI_GPU_MEMORY_MB={value!r} is not a number of megabytes") from None
    if not math.isfinite(megabytes) or megabytes <= 0:
        raise InvalidConfigurationError(
            f"KJARNI_GPU_MEMORY_MB={value!r} must be a positive, finite number of megabytes "
            "(e.g. KJARNI_GPU_MEMORY_MB=8192 for 8 GiB); unset it for no budget"
        )
    return int(megabytes * 2**20)
