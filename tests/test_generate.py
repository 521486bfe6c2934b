"""The generation loop on a tiny random model: feeding back, stop rules, caches, fast paths, closing."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from kjarni.model_config import ModelConfig
from kjarni.errors import ContextOverflowError, InvalidConfigurationError
from kjarni.decode import generate_step
from kjarni.stream import GenerationParams, GenerationStats, TokenEvent, stream_generate
from kjarni.model import DecoderModel
from kjarni.numpy_ops import NumpyOps
from kjarni.sampler import make_sampler
from kjarni.weights import load_weights
from tests.tiny_models import random_state_dict, save_safetensors_model, tiny_config

PROMPT = [1, 17, 3, 88, 42, 9]
SPECIAL = {0, 1, 2}


class FakeTokenizer:
    """Bytes per id for the tiny vocabulary (97): letters, plus pieces of "日" split across ids."""

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in SPECIAL:
            return b"<special>"
        if token_id % 10 == 0:
            return "日".encode()[:2]
        if token_id % 10 == 5:
            return "日".encode()[2:]
        return bytes([ord("a") + token_id % 26])

    def is_special(self, token_id: int) -> bool:
        return token_id in SPECIAL

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(i) for i in ids if i not in SPECIAL).decode("utf-8", "replace")


class CountingModel:
    """Wraps a model to count forwards and cache allocations."""

    def __init__(self, model: DecoderModel) -> None:
        self._model = model
        self.ops, self.config, self.context_size = model.ops, model.config, model.context_size
        self.forwards: list[int] = []
        self.capacities: list[int] = []
        self.caches: list[weakref.ref] = []

    def forward(self, ids, kv_cache, logits="last"):
        self.forwards.append(len(ids))
        return self._model.forward(ids, kv_cache, logits=logits)

    def new_cache(self, capacity=None):
        self.capacities.append(capacity)
        cache = self._model.new_cache(capacity)
        self.caches.append(weakref.ref(cache))
        return cache


def _build(path, **overrides) -> DecoderModel:
    config = tiny_config("llama", **overrides)
    save_safetensors_model(path, config, random_state_dict(config, seed=11))
    return DecoderModel(ModelConfig.from_json(path / "config.json"), load_weights(path), NumpyOps())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> DecoderModel:
    return _build(tmp_path_factory.mktemp("tiny"))


@pytest.fixture()
def model(tiny) -> CountingModel:
    return CountingModel(tiny)


def _greedy_reference(model: DecoderModel, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by re-running the whole sequence each step, no cache reuse."""
    ids = list(prompt)
    for _ in range(n):
        logits = model.ops.read(model.forward(ids, model.new_cache(len(ids)), logits="last"))[0]
        ids.append(int(np.argmax(logits)))
    return ids[len(prompt) :]


def _run(model, params, prompt=PROMPT, **kwargs) -> list[TokenEvent]:
    return list(stream_generate(model, FakeTokenizer(), prompt, params, **kwargs))


# ---------------------------------------------------------------- the loop


def test_greedy_stream_matches_a_cache_free_reference(model, tiny):
    events = _run(model, GenerationParams(max_tokens=8, temperature=0))
    assert [e.token_id for e in events] == _greedy_reference(tiny, PROMPT, 8)


def test_one_prefill_then_one_single_token_forward_per_later_token(model):
    events = _run(model, GenerationParams(max_tokens=5, temperature=0))
    assert len(events) == 5
    assert model.forwards == [len(PROMPT), 1, 1, 1, 1]  # the 5th token is never fed: nothing wasted


def test_generate_step_feeds_back_every_token_including_special_ones(tiny):
    cache = tiny.new_cache(64)
    steps = generate_step(tiny, PROMPT, make_sampler(temperature=0), np.random.default_rng(0), cache)
    tokens = [next(steps)[0] for _ in range(6)]
    steps.close()
    assert cache.offset == len(PROMPT) + 5
    assert tokens == _greedy_reference(tiny, PROMPT, 6)


def test_text_deltas_concatenate_to_the_one_shot_decode(model):
    events = _run(model, GenerationParams(max_tokens=30, temperature=1.0, seed=5))
    assert "".join(e.text for e in events) == FakeTokenizer().decode([e.token_id for e in events])


def test_cache_is_allocated_once_with_prompt_plus_max_tokens(model):
    _run(model, GenerationParams(max_tokens=7, temperature=0))
    assert model.capacities == [len(PROMPT) + 7]


def test_stats_are_filled(model):
    stats = GenerationStats()
    list(stream_generate(model, FakeTokenizer(), PROMPT, GenerationParams(max_tokens=4, temperature=0), stats=stats))
    assert (stats.prompt_tokens, stats.generated_tokens, stats.finish_reason) == (len(PROMPT), 4, "length")
    assert stats.prefill_seconds > 0 and stats.decode_seconds > 0
    assert stats.tokens_per_second == pytest.approx(3 / stats.decode_seconds)
    list(stream_generate(model, FakeTokenizer(), PROMPT, GenerationParams(max_tokens=2, temperature=0), stats=stats))
    assert stats.generated_tokens == 2  # a reused stats object starts from zero


# ---------------------------------------------------------------- stop rules


def test_max_tokens_is_honoured_and_the_last_event_says_length(model):
    events = _run(model, GenerationParams(max_tokens=3, temperature=1.0, seed=1))
    assert len(events) == 3
    assert [e.finish_reason for e in events] == [None, None, "length"]


def test_eos_ends_generation_and_is_never_text(model, tiny):
    greedy = _greedy_reference(tiny, PROMPT, 12)
    position = next(i for i in range(2, 12) if greedy[i] not in greedy[:i])
    eos = greedy[position]
    events = _run(model, GenerationParams(max_tokens=20, temperature=0, eos_token_ids=frozenset({eos})))
    assert [e.token_id for e in events] == greedy[: position + 1]
    last = events[-1]
    assert last.finish_reason == "eos" and last.is_special
    text = "".join(e.text for e in events)
    assert text == FakeTokenizer().decode(greedy[:position])  # eos's own bytes never appear


def test_stop_string_spanning_tokens_cuts_the_text(model, tiny):
    greedy = _greedy_reference(tiny, PROMPT, 10)
    tok = FakeTokenizer()
    full = tok.decode(greedy)
    first = next(i for i in range(2, 9) if all(t % 10 not in (0, 5) for t in greedy[i : i + 2]))
    stop = tok.decode(greedy[first : first + 2])  # two tokens' worth of plain letters
    assert len(stop) == 2
    events = _run(model, GenerationParams(max_tokens=10, temperature=0, stop=(stop,)))
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason == "stop"
    assert text == full[: full.index(stop)]
    assert len(events) <= first + 2


def test_context_limit_ends_with_context(tmp_path):
    small = CountingModel(_build(tmp_path, max_position_embeddings=12))
    events = _run(small, GenerationParams(max_tokens=50, temperature=0))
    assert len(PROMPT) + len(events) == 12
    assert events[-1].finish_reason == "context"
    assert small.capacities == [12]


def test_prompt_filling_the_context_raises_naming_both_lengths(tmp_path):
    small = _build(tmp_path, max_position_embeddings=6)
    with pytest.raises(ContextOverflowError, match="6 tokens") as info:
        _run(small, GenerationParams(max_tokens=5), prompt=PROMPT + [4])
    assert (info.value.tokens, info.value.context) == (7, 6)


def test_empty_prompt_and_foreign_ids_are_rejected(model):
    with pytest.raises(InvalidConfigurationError, match="no tokens"):
        _run(model, GenerationParams(), prompt=[])
    with pytest.raises(InvalidConfigurationError, match="outside the vocabulary"):
        _run(model, GenerationParams(), prompt=[1, 500])


def test_errors_are_raised_by_the_call_not_the_first_token(model):
    with pytest.raises(ContextOverflowError):
        stream_generate(model, FakeTokenizer(), list(range(3, 90)) * 3, GenerationParams())
    assert model.forwards == []


def test_params_are_validated_on_construction():
    with pytest.raises(InvalidConfigurationError, match="top_p"):
        GenerationParams(top_p=0)
    with pytest.raises(InvalidConfigurationError, match="max_tokens"):
        GenerationParams(max_tokens=0)
    with pytest.raises(InvalidConfigurationError, match="stop string"):
        GenerationParams(stop=("",))


# ---------------------------------------------------------------- sampling paths and seeds


def test_same_seed_same_tokens(model):
    params = GenerationParams(max_tokens=12, temperature=1.2, top_p=0.95, seed=42)
    a = [e.token_id for e in _run(model, params)]
    b = [e.token_id for e in _run(model, params)]
    c = [e.token_id for e in _run(model, GenerationParams(max_tokens=12, temperature=1.2, top_p=0.95, seed=43))]
    assert a == b and a != c


class SpyOps(NumpyOps):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def read(self, x):
        self.calls.append("read")
        return super().read(x)

    def argmax(self, x):
        self.calls.append("argmax")
        return super().argmax(x)

    def top_k(self, x, k):
        self.calls.append(f"top_k {k}")
        return super().top_k(x, k)


@pytest.mark.parametrize(
    "sampling, expected",
    [
        (dict(temperature=0), "argmax"),
        (dict(temperature=0.7, top_k=4, top_p=0.9), "top_k 5"),
        (dict(temperature=0.7), "read"),
        (dict(temperature=0, repetition_penalty=1.2), "read"),
        (dict(temperature=0, logprobs=True), "read"),
    ],
)
def test_loop_reads_only_what_the_sampler_needs(model, sampling, expected):
    spy = SpyOps()
    model.ops = spy
    _run(model, GenerationParams(max_tokens=4, seed=0, **sampling))
    assert set(spy.calls) == {expected}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_backend_fast_path_equals_the_full_logits_path(model, temperature):
    fast = GenerationParams(max_tokens=15, temperature=temperature, top_k=8, top_p=0.9, seed=3)
    full = GenerationParams(max_tokens=15, temperature=temperature, top_k=8, top_p=0.9, seed=3, logprobs=True)
    fast_events, full_events = _run(model, fast), _run(model, full)
    assert [e.token_id for e in fast_events] == [e.token_id for e in full_events]
    assert all(e.logprob is None for e in fast_events)
    assert all(e.logprob is not None and e.logprob <= 0 for e in full_events)


def test_logprob_is_the_models_log_softmax(tiny):
    events = _run(tiny, GenerationParams(max_tokens=1, temperature=0, logprobs=True))
    logits = tiny.ops.read(tiny.forward(PROMPT, tiny.new_cache(16)))[0].astype(np.float64)
    expected = logits[events[0].token_id] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    assert events[0].logprob == pytest.approx(expected, abs=1e-5)


# ---------------------------------------------------------------- caches and closing


def test_passed_cache_with_a_shared_prefix_prefills_only_the_rest(model, tiny):
    params = GenerationParams(max_tokens=6, temperature=0)
    fresh = [e.token_id for e in _run(model, params)]
    cache = tiny.new_cache(64)
    tiny.forward(PROMPT[:4], cache)  # the prefix cache holds the first 4 prompt tokens
    model.forwards.clear()
    reused = [e.token_id for e in _run(model, params, kv_cache=cache)]
    assert reused == fresh
    assert model.forwards[0] == len(PROMPT) - 4
    assert model.capacities == [len(PROMPT) + 6]  # only the fresh run allocated


def test_fully_cached_prompt_reruns_its_last_token(model, tiny):
    params = GenerationParams(max_tokens=4, temperature=0)
    fresh = [e.token_id for e in _run(model, params)]
    cache = tiny.new_cache(64)
    tiny.forward(PROMPT + [5, 6], cache)  # longer than the prompt: trimmed back
    model.forwards.clear()
    assert [e.token_id for e in _run(model, params, kv_cache=cache)] == fresh
    assert model.forwards[0] == 1


def test_closing_early_stops_forwards_and_frees_the_cache(model):
    stream = stream_generate(model, FakeTokenizer(), PROMPT, GenerationParams(max_tokens=50, temperature=0))
    next(stream), next(stream)
    stream.close()
    assert model.forwards == [len(PROMPT), 1]
    del stream
    gc.collect()
    assert model.caches[0]() is None
