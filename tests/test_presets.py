"""kjarni.generator.presets: the seed's presets, each naming a real registry model with honest figures."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kjarni import registry
from kjarni.generator import Generator, GeneratorBuilder, KjarniDevice
from kjarni.generator.builder import _parse_params
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
from tests.test_api import make_tiny_model

SEED_FIELDS = ("name", "model", "architecture", "recommended_device", "temperature", "default_max_tokens",
               "memory_mb", "description")


def test_preset_has_exactly_the_seed_fields_and_is_frozen() -> None:
    assert tuple(f.name for f in dataclasses.fields(GeneratorPreset)) == SEED_FIELDS
    with pytest.raises(dataclasses.FrozenInstanceError):
        GENERATOR_FAST_V1.temperature = 2.0  # type: ignore[misc]


def test_all_v1_presets_in_seed_order_with_unique_names() -> None:
    assert ALL_V1_PRESETS == (
        GENERATOR_FAST_V1, GENERATOR_BALANCED_V1, GENERATOR_QUALITY_V1, GENERATOR_CREATIVE_V1, GENERATOR_CODE_V1,
    )
    assert list_presets() == [
        "GENERATOR_FAST_V1", "GENERATOR_BALANCED_V1", "GENERATOR_QUALITY_V1", "GENERATOR_CREATIVE_V1",
        "GENERATOR_CODE_V1",
    ]


@pytest.mark.parametrize("preset", ALL_V1_PRESETS, ids=lambda p: p.name)
def test_every_preset_model_resolves_in_the_registry_with_its_architecture(preset: GeneratorPreset) -> None:
    entry = registry.find_entry(preset.model)
    assert entry.name == preset.model
    assert entry.architecture == preset.architecture
    assert entry.supported
    assert preset.default_max_tokens > 0 and preset.description and isinstance(preset.recommended_device, KjarniDevice)


@pytest.mark.parametrize("preset", ALL_V1_PRESETS, ids=lambda p: p.name)
def test_memory_figures_are_weights_on_the_recommended_device_plus_a_modest_kv_cache(preset: GeneratorPreset) -> None:
    # The numpy backend holds every weight as float32; the GPU holds f16 by default.
    params = _parse_params(registry.find_entry(preset.model).params)
    bytes_per_param = 4 if preset.recommended_device is KjarniDevice.CPU else 2
    weights_mb = params * bytes_per_param / 1e6
    assert weights_mb <= preset.memory_mb <= weights_mb * 1.4, (preset.name, weights_mb, preset.memory_mb)


def test_the_fast_preset_is_the_default_model_and_the_code_preset_a_coder() -> None:
    assert GENERATOR_FAST_V1.model == registry.DEFAULT_MODEL
    assert "coder" in GENERATOR_CODE_V1.model
    assert GENERATOR_CODE_V1.temperature < 0.5 and GENERATOR_CODE_V1.default_max_tokens >= 1024
    assert GENERATOR_CREATIVE_V1.temperature > 0.8
    assert GENERATOR_QUALITY_V1.memory_mb >= GENERATOR_BALANCED_V1.memory_mb >= GENERATOR_FAST_V1.memory_mb
    assert GENERATOR_QUALITY_V1.default_max_tokens >= GENERATOR_FAST_V1.default_max_tokens


def test_find_preset_ignores_case_and_returns_none_for_unknown_names() -> None:
    assert find_preset("GENERATOR_FAST_V1") is GENERATOR_FAST_V1
    assert find_preset("generator_fast_v1") is GENERATOR_FAST_V1
    assert find_preset(" Generator_Balanced_V1 ") is GENERATOR_BALANCED_V1
    assert find_preset("nonexistent") is None


def test_tiers_resolve_to_their_presets() -> None:
    assert GeneratorTier.FAST.resolve() is GENERATOR_FAST_V1
    assert GeneratorTier.BALANCED.resolve() is GENERATOR_BALANCED_V1
    assert GeneratorTier.QUALITY.preset() is GENERATOR_QUALITY_V1


def test_from_preset_sets_model_device_and_the_preset_layer(tmp_path: Path) -> None:
    builder = GeneratorBuilder.from_preset(GENERATOR_QUALITY_V1)
    assert builder._model == GENERATOR_QUALITY_V1.model
    assert builder._device is KjarniDevice.AUTO  # a GPU recommendation still runs where there is none
    assert GeneratorBuilder.from_preset("generator_fast_v1")._device is KjarniDevice.CPU
    assert GeneratorBuilder.from_preset(GeneratorTier.BALANCED)._model == GENERATOR_BALANCED_V1.model
    assert GeneratorBuilder("smollm2").preset(GENERATOR_CODE_V1)._model == "smollm2"  # a named model stays

    tiny = make_tiny_model(tmp_path / "m")
    g = Generator.builder().model_path(tiny).preset(GENERATOR_CREATIVE_V1).cpu().quiet().build()
    assert g.generation_config.temperature == GENERATOR_CREATIVE_V1.temperature
    assert g.generation_config.max_tokens == GENERATOR_CREATIVE_V1.default_max_tokens


def test_unknown_preset_name_is_an_invalid_configuration() -> None:
    from kjarni.errors import InvalidConfigurationError

    with pytest.raises(InvalidConfigurationError, match="GENERATOR_FAST_V1"):
        GeneratorBuilder.from_preset("turbo")
