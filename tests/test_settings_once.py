"""One settings type, validated once: every layer resolves into ``kjarni.settings.GenerationParams``,
which checks its values when made, and the sampler chain is built from that same object."""

from __future__ import annotations

import numpy as np
import pytest

import kjarni.settings
import kjarni.stream
from kjarni.errors import InvalidConfigurationError
from kjarni.generator import GENERATOR_CODE_V1, GenerationOverrides, Generator, ResolvedGenerationConfig
from kjarni.generator.config import KJARNI_DEFAULTS
from kjarni.settings import GenerationParams
from tests.test_api import make_tiny_model

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Generator:
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-settings"))
    return Generator.builder().model_path(folder).cpu().quiet().chat_template(TEMPLATE).build()


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Every ``check_sampling`` call from now on, by its arguments."""
    calls: list[dict] = []
    real = kjarni.settings.check_sampling

    def counting(**settings: object) -> None:
        calls.append(settings)
        real(**settings)

    monkeypatch.setattr(kjarni.settings, "check_sampling", counting)
    return calls


def test_a_generate_call_checks_its_settings_once(tiny: Generator, checks: list[dict]) -> None:
    tiny.generate("the", max_tokens=3, temperature=0.9, top_k=7, seed=1)
    assert len(checks) == 1
    assert (checks[0]["temperature"], checks[0]["top_k"], checks[0]["max_tokens"]) == (0.9, 7, 3)


def test_a_call_with_overrides_checks_once_more_than_the_overrides_themselves(
    tiny: Generator, checks: list[dict]
) -> None:
    overrides = GenerationOverrides(max_tokens=2, top_p=0.5)
    assert len(checks) == 1  # where the overrides were written
    tiny.generate_with_config("the", overrides)
    assert len(checks) == 2  # where they were applied to the resolved config; none in the loop


def test_chat_and_streams_check_once_per_call(tiny: Generator, checks: list[dict]) -> None:
    tiny.chat([{"role": "user", "content": "the"}], max_tokens=2, temperature=0)
    assert len(checks) == 1
    stream = tiny.stream("the", max_tokens=2, min_p=0.1)
    list(stream)
    assert len(checks) == 2


def test_a_call_without_settings_checks_nothing_again(tiny: Generator, checks: list[dict]) -> None:
    tiny.generate("the", max_tokens=None)  # None leaves the setting to the layers below
    assert checks == []


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("top_p", 1.5, "top_p=1.5"),
        ("temperature", 1e-9, "temperature=1e-09"),
        ("top_k", np.int64(-2), "top_k=-2"),
        ("max_tokens", 0, "max_tokens=0"),
        ("seed", -1, "seed=-1"),
        ("repetition_penalty", float("nan"), "repetition_penalty=nan"),
    ],
)
def test_a_bad_value_names_the_setting_and_the_value_on_every_path(
    tiny: Generator, name: str, value: object, shown: str
) -> None:
    message = rf"^{shown} is out of range: {name} must be "
    with pytest.raises(InvalidConfigurationError, match=message):
        tiny.generate("the", **{name: value})
    with pytest.raises(InvalidConfigurationError, match=message):
        GenerationOverrides(**{name: value})
    with pytest.raises(InvalidConfigurationError, match=message):
        Generator.builder("no-such-model").generation_config(GenerationOverrides(**{name: value}))
    with pytest.raises(InvalidConfigurationError, match=message):
        GenerationParams(**{name: value})


def test_the_sampler_is_built_from_the_resolved_config(tiny: Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list = []
    real = kjarni.stream.Sampler

    def recording(settings: GenerationParams) -> object:
        built.append(settings)
        return real(settings)

    monkeypatch.setattr(kjarni.stream, "Sampler", recording)
    tiny.generate("the", max_tokens=2, top_k=3, top_p=0.8)
    expected = GenerationOverrides(max_tokens=2, top_k=3, top_p=0.8).resolve(tiny.generation_config)
    assert built == [expected]
    assert built[0].eos_token_ids == tiny.generation_config.eos_token_ids


def test_layers_resolve_into_the_one_type() -> None:
    assert ResolvedGenerationConfig is GenerationParams
    resolved = GENERATOR_CODE_V1.overrides().resolve(KJARNI_DEFAULTS)
    assert type(resolved) is GenerationParams
    assert (resolved.temperature, resolved.max_tokens, resolved.top_k) == (0.2, 2048, 50)
    # Numbers and stop strings are normalised by the same type, whichever layer they came in.
    layer = GenerationOverrides(top_k=np.int64(4), temperature=np.float32(0.5), stop="END")
    assert (type(layer.top_k), type(layer.temperature), layer.stop) == (int, float, ("END",))
    assert layer.resolve(KJARNI_DEFAULTS) == GenerationParams(
        max_tokens=256, temperature=0.5, top_k=4, top_p=0.9, stop=("END",)
    )
