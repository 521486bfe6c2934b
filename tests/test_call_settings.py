"""Per-call keyword settings, as in llama-cpp-python and mlx-lm: generate(prompt, max_tokens=..., ...)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kjarni.errors import InvalidConfigurationError
from kjarni.generator import GenerationOverrides, Generator
from kjarni.generator.config import SETTING_NAMES
from tests.test_api import make_tiny_model

SAMPLED = dict(max_tokens=12, temperature=1.3, top_p=0.95, top_k=40, min_p=0.01, repetition_penalty=1.1, seed=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Generator:
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-kwargs"))
    return Generator.builder().model_path(folder).cpu().quiet().build()


def test_the_keywords_are_the_familiar_names() -> None:
    assert set(SETTING_NAMES) == {
        "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop"
    }


def test_keywords_give_what_the_same_overrides_give(tiny: Generator) -> None:
    expected = tiny.generate_with_config("the", GenerationOverrides(**SAMPLED))
    assert tiny.generate("the", **SAMPLED) == expected
    assert "".join(tiny.stream_text("the", **SAMPLED)) == expected
    assert "".join(t.text for t in tiny.stream("the", **SAMPLED)) == expected
    stream = tiny.stream("the", **SAMPLED)
    assert stream.config.top_k == 40 and stream.config.min_p == 0.01
    stream.close()


def test_keywords_apply_to_this_call_only(tiny: Generator) -> None:
    before = tiny.generation_config
    assert len(list(tiny.stream("the", max_tokens=3, temperature=0))) == 3
    assert tiny.generation_config == before
    stream = tiny.stream("the")
    assert stream.config.max_tokens == before.max_tokens
    stream.close()


def test_async_twins_take_the_keywords(tiny: Generator) -> None:
    expected = tiny.generate("the", **SAMPLED)

    async def main() -> tuple[str, str, str]:
        text = await tiny.agenerate("the", **SAMPLED)
        pieces = [piece async for piece in tiny.astream_text("the", **SAMPLED)]
        tokens = [token.text async for token in tiny.astream("the", **SAMPLED)]
        return text, "".join(pieces), "".join(tokens)

    assert asyncio.run(main()) == (expected, expected, expected)


def test_numpy_integers_and_floats_are_accepted(tiny: Generator) -> None:
    plain = tiny.generate("the", max_tokens=8, temperature=1.0, top_k=0, seed=3)
    assert tiny.generate("the", max_tokens=np.int64(8), temperature=np.float32(1.0), top_k=np.int32(0), seed=np.int64(3)) == plain
    stream = tiny.stream("the", seed=np.uint8(3))
    assert type(stream.config.seed) is int and stream.config.seed == 3
    stream.close()
    assert type(GenerationOverrides(temperature=np.float32(0.5)).temperature) is float


def test_stop_takes_a_string_or_a_list(tiny: Generator) -> None:
    settings = {**SAMPLED, "max_tokens": 30}
    full = tiny.generate("the", **settings)
    first_new = next(i for i in range(2, len(full)) if full[i] not in full[:i])  # a character seen first at i
    stop = full[first_new]
    cut = full[:first_new]
    assert tiny.generate("the", **settings, stop=stop) == cut
    assert tiny.generate("the", **settings, stop=[stop, "\x00never"]) == cut


def test_passing_both_overrides_and_keywords_is_an_error(tiny: Generator) -> None:
    with pytest.raises(InvalidConfigurationError, match="not both"):
        tiny.generate_with_config("the", GenerationOverrides(max_tokens=3), temperature=0)
    with pytest.raises(InvalidConfigurationError, match="not both"):
        tiny.astream_with_config("the", GenerationOverrides(max_tokens=3), seed=1)
    # None is "not given": this is not both.
    assert len(list(tiny.stream_with_config("the", GenerationOverrides(max_tokens=3, temperature=0), seed=None))) == 3


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"temprature": 0.5}, "did you mean temperature"),
        ({"max_new_tokens": 5}, "did you mean max_tokens"),
        ({"seed": 1.5}, "seed=1.5 is out of range"),
        ({"seed": -1}, "seed=-1"),
        ({"top_p": np.float64("nan")}, "top_p=nan"),
        ({"max_tokens": True}, "max_tokens=True"),
        ({"stop": ""}, "non-empty"),
    ],
)
def test_bad_keywords_are_refused_before_any_work(tiny: Generator, settings: dict, message: str) -> None:
    calls = []
    model = tiny.decoder.model
    forward = model.forward
    model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)  # type: ignore[method-assign]
    try:
        with pytest.raises(InvalidConfigurationError, match=message):
            tiny.generate("the", **settings)
    finally:
        model.forward = forward  # type: ignore[method-assign]
    assert calls == []


@pytest.mark.parametrize("stop", [5, 2.5, object()])
def test_a_stop_that_is_no_string_or_list_is_a_configuration_error(tiny: Generator, stop: object) -> None:
    with pytest.raises(InvalidConfigurationError, match="must be a non-empty str or a list of them"):
        tiny.generate("the", max_tokens=2, stop=stop)
    with pytest.raises(InvalidConfigurationError, match="must be a non-empty str or a list of them"):
        GenerationOverrides(stop=stop)
    with pytest.raises(InvalidConfigurationError, match="must be a non-empty str or a list of them"):
        Generator.builder().stop(stop)
