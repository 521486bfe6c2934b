"""The settings of one generation: ``GenerationParams``, the one type that describes them.

Every layer ends here: the Generator API's ``GenerationOverrides`` (a partial layer) resolves into
a ``GenerationParams`` (``ResolvedGenerationConfig`` is this type under its public name), presets
produce overrides, and ``sampler.Sampler`` is the chain built from one. It is validated once, when
it is made (``__post_init__``): every range is written once, in ``SAMPLING_RANGES``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, Iterable

from kjarni.errors import InvalidConfigurationError

MIN_TEMPERATURE = 1e-5
"""The smallest temperature above 0 accepted (vLLM's threshold too). Logits are divided by it in
float32: ``1e-50`` is 0 in float32 and would turn every logit into inf or NaN after the prefill, so
anything in ``(0, MIN_TEMPERATURE)`` is refused up front; 0 asks for greedy decoding."""


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


SAMPLING_RANGES: dict[str, tuple[Callable[[object], bool], str]] = {
    "max_tokens": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "temperature": (lambda v: _finite(v) and (v == 0 or v >= MIN_TEMPERATURE),
                    f"0 (greedy) or >= {MIN_TEMPERATURE:g} (smaller ones overflow float32 logits)"),
    "top_k": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0 means off)"),
    "top_p": (lambda v: _finite(v) and 0 < v <= 1, "in (0, 1] (1 means off)"),
    "min_p": (lambda v: _finite(v) and 0 <= v <= 1, "in [0, 1] (0 means off)"),
    "repetition_penalty": (lambda v: _finite(v) and v > 0, "> 0 (1 means off)"),
    "seed": (lambda v: v is None or (_is_int(v) and v >= 0), "an integer >= 0 (None: fresh entropy)"),
}
"""Every numeric setting's valid range, the one place it is written: (test, description)."""

_INTEGRAL = ("max_tokens", "top_k", "seed")


def check_sampling(**settings: object) -> None:
    """Raise ``InvalidConfigurationError`` naming the first setting (in the order given) outside its
    ``SAMPLING_RANGES`` range, with its value: ``top_p=1.5 is out of range: top_p must be in (0, 1]
    (1 means off)``."""
    for name, value in settings.items():
        ok, valid = SAMPLING_RANGES[name]
        if not ok(value):
            raise InvalidConfigurationError(f"{name}={value!r} is out of range: {name} must be {valid}")


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


def _plain_number(name: str, value: object) -> object:
    """numpy scalars (and other ``numbers`` types) as plain int / float; anything else unchanged,
    for ``check_sampling`` to refuse with its message."""
    if isinstance(value, bool):
        return value
    if name in _INTEGRAL:
        return int(value) if isinstance(value, numbers.Integral) else value
    if isinstance(value, numbers.Real) and type(value) is not float:
        return float(value)
    return value


@dataclass(frozen=True)
class GenerationParams:
    """Every setting of one generation; validated once, on construction.

    ``temperature=0`` is greedy (argmax); ``top_k=0``, ``top_p=1``, ``min_p=0`` and
    ``repetition_penalty=1`` switch those off (the defaults here: sampling from the model's own
    distribution). ``seed=None`` draws fresh entropy. ``stop`` strings end generation; the text
    before the first one is emitted, the stop string itself is not (a single str is one stop
    string). ``eos_token_ids`` end generation and are never emitted as text. ``logprobs=True``
    makes every token carry its logprob (it forces the whole vocabulary to be read each step);
    otherwise the greedy and top-k paths skip it and report ``None``. Any integral
    (``numpy.int64(3)``) is accepted where an int is expected and any real number where a float
    is; they are stored as plain ``int`` / ``float``. A value out of range raises
    ``InvalidConfigurationError`` naming the setting, the value and the range.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    logprobs: bool = False

    def __post_init__(self) -> None:
        numbers_ = {name: _plain_number(name, getattr(self, name)) for name in SAMPLING_RANGES}
        for name, value in numbers_.items():
            object.__setattr__(self, name, value)
        check_sampling(**numbers_)
        object.__setattr__(self, "stop", normalize_stop(self.stop))
        object.__setattr__(self, "eos_token_ids", tuple(dict.fromkeys(int(i) for i in self.eos_token_ids)))
        if not isinstance(self.logprobs, bool):
            raise InvalidConfigurationError(f"logprobs={self.logprobs!r} must be True or False")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0
