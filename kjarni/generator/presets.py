"""Generator presets for common use cases: a registry model, a device and sampling defaults.

Every preset names a model in ``kjarni.registry`` (tests check it resolves). ``memory_mb`` is the
memory the model needs on the preset's recommended device with kjarni's defaults: the weights
as that device holds them (float32 on the CPU, whose numpy backend dequantizes everything;
float16 on the GPU, the default ``weight_format``) plus a float32 KV cache of 4096 positions:

    SmolLM2-135M      134.5M params x 4 B = 538 MB  + KV 30 layers x 3 heads x 64 x 2 x 4 B x 4096 = 189 MB
    Qwen2.5-0.5B      494M   params x 4 B = 1976 MB + KV 24 x 2 x 64 x 2 x 4 B x 4096 = 101 MB
    Qwen2.5(-Coder)-1.5B 1.54B params x 2 B = 3088 MB + KV 28 x 2 x 128 x 2 x 4 B x 4096 = 235 MB
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kjarni.generator.config import GenerationOverrides, KjarniDevice


@dataclass(frozen=True)
class GeneratorPreset:
    """Preset configuration for generator models."""

    name: str
    """Preset name for lookup (``find_preset`` ignores case)."""
    model: str
    """Model name from the registry."""
    architecture: str
    """Model architecture (config.json ``model_type``)."""
    recommended_device: KjarniDevice
    """The device this preset is meant for."""
    temperature: float | None
    """Recommended temperature (``None``: leave it to the model and kjarni's defaults)."""
    default_max_tokens: int
    """Default maximum of new tokens."""
    memory_mb: int
    """Approximate memory in MB on the recommended device (see the module docstring)."""
    description: str
    """Human-readable description."""

    def overrides(self) -> GenerationOverrides:
        """The preset's settings as a layer (above the model's defaults, below the builder's):
        its ``temperature`` (unless None) and ``default_max_tokens`` as ``max_tokens``."""
        return GenerationOverrides(temperature=self.temperature, max_tokens=self.default_max_tokens)


GENERATOR_FAST_V1 = GeneratorPreset(
    name="GENERATOR_FAST_V1",
    model="smollm2-135m-instruct",
    architecture="llama",
    recommended_device=KjarniDevice.CPU,
    temperature=0.7,
    default_max_tokens=256,
    memory_mb=730,
    description="Fast text generation - smallest model (SmolLM2 135M), quick responses even on the CPU.",
)
"""Fast text generation - smallest model, quick responses."""

GENERATOR_BALANCED_V1 = GeneratorPreset(
    name="GENERATOR_BALANCED_V1",
    model="qwen2.5-0.5b-instruct",
    architecture="qwen2",
    recommended_device=KjarniDevice.CPU,
    temperature=0.7,
    default_max_tokens=512,
    memory_mb=2080,
    description="Balanced text generation - Qwen2.5 0.5B, good quality with reasonable speed on the CPU.",
)
"""Balanced text generation - good quality with reasonable speed."""

GENERATOR_QUALITY_V1 = GeneratorPreset(
    name="GENERATOR_QUALITY_V1",
    model="qwen2.5-1.5b-instruct",
    architecture="qwen2",
    recommended_device=KjarniDevice.GPU,
    temperature=0.7,
    default_max_tokens=1024,
    memory_mb=3320,
    description="Quality text generation - Qwen2.5 1.5B on the GPU, better outputs.",
)
"""Quality text generation - larger model, better outputs."""

GENERATOR_CREATIVE_V1 = GeneratorPreset(
    name="GENERATOR_CREATIVE_V1",
    model="qwen2.5-1.5b-instruct",
    architecture="qwen2",
    recommended_device=KjarniDevice.GPU,
    temperature=0.9,
    default_max_tokens=1024,
    memory_mb=3320,
    description="Creative text generation - Qwen2.5 1.5B with a higher temperature for variety.",
)
"""Creative text generation - higher temperature for variety."""

GENERATOR_CODE_V1 = GeneratorPreset(
    name="GENERATOR_CODE_V1",
    model="qwen2.5-coder-1.5b-instruct",
    architecture="qwen2",
    recommended_device=KjarniDevice.GPU,
    temperature=0.2,
    default_max_tokens=2048,
    memory_mb=3320,
    description="Code generation - Qwen2.5 Coder 1.5B with a low temperature for precision.",
)
"""Code generation preset."""

ALL_V1_PRESETS: tuple[GeneratorPreset, ...] = (
    GENERATOR_FAST_V1,
    GENERATOR_BALANCED_V1,
    GENERATOR_QUALITY_V1,
    GENERATOR_CREATIVE_V1,
    GENERATOR_CODE_V1,
)
"""All V1 presets, for iteration."""


class GeneratorTier(enum.Enum):
    """Generator quality tiers for easy selection."""

    FAST = "fast"
    """Fastest, smallest model."""
    BALANCED = "balanced"
    """Balanced speed and quality."""
    QUALITY = "quality"
    """Best quality, larger model."""

    def resolve(self) -> GeneratorPreset:
        """The preset for this tier."""
        return _TIER_PRESETS[self]

    def preset(self) -> GeneratorPreset:
        """The preset for this tier (alias of ``resolve``)."""
        return self.resolve()


_TIER_PRESETS = {
    GeneratorTier.FAST: GENERATOR_FAST_V1,
    GeneratorTier.BALANCED: GENERATOR_BALANCED_V1,
    GeneratorTier.QUALITY: GENERATOR_QUALITY_V1,
}


def find_preset(name: str) -> GeneratorPreset | None:
    """The preset called ``name``, ignoring case (``"generator_fast_v1"``), or ``None``."""
    wanted = name.strip().lower()
    return next((p for p in ALL_V1_PRESETS if p.name.lower() == wanted), None)


def list_presets() -> list[str]:
    """Names of all presets, in ``ALL_V1_PRESETS`` order."""
    return [p.name for p in ALL_V1_PRESETS]
