"""The prefix cache on a tiny random model: reuse across calls, chat replay, limits, logits, with a draft."""

from __future__ import annotations

import numpy as np
import pytest

from kjarni.model_config import ModelConfig
from kjarni.errors import InvalidConfigurationError
from kjarni.stream import GenerationParams, GenerationStats, stream_generate
from kjarni.model import DecoderModel
from kjarni.numpy_ops import NumpyOps
from kjarni.prefix_cache import DEFAULT_PREFIX_CACHE_TOKENS, PrefixCache
from kjarni.weights import load_weights
from tests.test_generate import CountingModel, FakeTokenizer
from tests.tiny_models import random_state_dict, save_safetensors_model, tiny_config

PROMPT = [1, 17, 3, 88, 42, 9, 23, 61, 7, 30]
GREEDY = GenerationParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> DecoderModel:
    path = tmp_path_factory.mktemp("tiny")
    config = tiny_config("qwen2")
    save_safetensors_model(path, config, random_state_dict(config, seed=5))
    return DecoderModel(ModelConfig.from_json(path / "config.json"), load_weights(path), NumpyOps())


@pytest.fixture()
def model(tiny) -> CountingModel:
    return CountingModel(tiny)


def _generate(model, prompt, params=GREEDY, **kwargs) -> list[int]:
    return [e.token_id for e in stream_generate(model, FakeTokenizer(), prompt, params, **kwargs)]


# ---------------------------------------------------------------- reuse


def test_a_prompt_sharing_the_cached_head_prefills_only_the_rest(model):
    prefix = PrefixCache(model, 128)
    _generate(model, PROMPT, prefix_cache=prefix)
    model.forwards.clear()
    stats = GenerationStats()
    second = PROMPT[:7] + [5, 6, 8]
    tokens = _generate(model, second, prefix_cache=prefix, stats=stats)
    assert model.forwards[0] == 3 and stats.cached_prompt_tokens == 7
    assert model.capacities == [128]  # allocated once, at construction
    assert tokens == _generate(model, second)  # same greedy tokens as from scratch


def test_a_chat_replaying_its_history_reuses_the_previous_answer(model):
    prefix = PrefixCache(model, 128)
    answer = _generate(model, PROMPT, prefix_cache=prefix)
    # The last answer token was sampled but never fed: everything before it is cached.
    assert prefix.cached_ids == tuple(PROMPT + answer[:-1])
    model.forwards.clear()
    stats = GenerationStats()
    follow_up = PROMPT + answer + [44, 45, 46]
    _generate(model, follow_up, prefix_cache=prefix, stats=stats)
    assert stats.cached_prompt_tokens == len(PROMPT) + len(answer) - 1
    assert model.forwards[0] == 4  # the answer's last token and the three new ones


def test_a_fully_cached_prompt_reruns_only_its_last_token(model):
    """Its logits give the first generated token, so the last prompt token is always fed."""
    prefix = PrefixCache(model, 128)
    first = _generate(model, PROMPT, prefix_cache=prefix)
    model.forwards.clear()
    assert _generate(model, PROMPT, prefix_cache=prefix) == first
    assert model.forwards[0] == 1


def test_a_diverging_prompt_trims_the_cache_to_the_common_prefix(model):
    prefix = PrefixCache(model, 128)
    _generate(model, PROMPT, prefix_cache=prefix)
    kv = prefix.take([1, 17, 3, 99, 99])
    assert kv.offset == 3 and prefix.tokens == 3
    prefix.remember([1, 17, 3, 99, 99])  # nothing was fed beyond the shared prefix
    assert prefix.cached_ids == (1, 17, 3)


def test_closing_early_remembers_only_what_was_fed(model):
    prefix = PrefixCache(model, 128)
    events = stream_generate(model, FakeTokenizer(), PROMPT, GenerationParams(max_tokens=50, temperature=0),
                             prefix_cache=prefix)
    got = [next(events).token_id for _ in range(3)]
    events.close()
    assert prefix.cached_ids == tuple(PROMPT + got[:2])


# ---------------------------------------------------------------- limits


def test_capacity_is_clamped_to_the_context_and_allocated_eagerly(tiny):
    config = tiny.config
    prefix = PrefixCache(tiny)
    assert DEFAULT_PREFIX_CACHE_TOKENS == 4096 and prefix.capacity == tiny.context_size == 256
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert prefix.nbytes == 256 * per_token and prefix.tokens == 0
    with pytest.raises(InvalidConfigurationError, match="capacity"):
        PrefixCache(tiny, 0)


def test_a_prompt_too_long_for_the_cache_prefills_from_scratch_and_keeps_what_was_cached(model):
    prefix = PrefixCache(model, 24)
    _generate(model, PROMPT, prefix_cache=prefix)
    kept = prefix.cached_ids
    model.forwards.clear()
    long_prompt = PROMPT + list(range(40, 60))  # 30 tokens > 24
    tokens = _generate(model, long_prompt, prefix_cache=prefix)
    assert model.forwards[0] == len(long_prompt) and len(tokens) == GREEDY.max_tokens
    assert model.capacities[-1] == len(long_prompt) + GREEDY.max_tokens  # a cache of its own
    assert prefix.cached_ids == kept
    # Fits the prompt but not prompt + max_tokens: also from scratch, so it never stops early.
    stats = GenerationStats()
    tokens = _generate(model, PROMPT + [5] * 10, GenerationParams(max_tokens=10, temperature=0),
                       prefix_cache=prefix, stats=stats)
    assert len(tokens) == 10 and stats.cached_prompt_tokens == 0 and prefix.cached_ids == kept


def test_kv_cache_and_prefix_cache_together_are_refused(tiny):
    with pytest.raises(InvalidConfigurationError, match="not both"):
        stream_generate(tiny, FakeTokenizer(), PROMPT, GREEDY, kv_cache=tiny.new_cache(32),
                        prefix_cache=PrefixCache(tiny, 32))


def test_remember_without_take_or_with_other_ids_trusts_nothing_new(tiny):
    prefix = PrefixCache(tiny, 64)
    prefix.remember(PROMPT)  # never lent
    assert prefix.tokens == 0
    kv = prefix.take(PROMPT)
    tiny.forward(PROMPT, kv)
    prefix.remember([5] + PROMPT[1:])  # not what was taken: keep only the agreed part (none)
    assert prefix.tokens == 0 and kv.offset == 0


# ---------------------------------------------------------------- logits

ROUNDING = 2.0**-16
"""Cached vs cold logits: at most this times the largest cold logit (docs/api.md, the prefix cache).

The tail prefill's linears run on fewer rows than the cold prefill's, and BLAS may take another
kernel, summing the same terms in another order, for another row count; float32 rounding (one ulp
is 2^-23 of a value) then differs through every layer. 2^-16 is 128 to 256 ulps of the largest
logit, about 9x the largest difference measured on real Qwen2.5 weights under OpenBLAS's Haswell,
Sandybridge and Prescott kernels (2.1e-5 on logits up to 12.3);
a real mistake (a stale key, a wrong position) moves logits by 1e-2 or more.
"""


def assert_logits_within_rounding(got: np.ndarray, cold: np.ndarray, what: object = "") -> None:
    """``got`` is ``cold`` to ``ROUNDING``, and has its argmax wherever rounding cannot flip it."""
    bound = ROUNDING * float(np.abs(cold).max())
    diff = float(np.abs(got - cold).max())
    assert diff <= bound, (what, diff, bound)
    second, first = np.sort(cold)[-2:]
    if first - second > 2 * bound:  # a near tie may go either way; anything else may not
        assert int(np.argmax(got)) == int(np.argmax(cold)), (what, float(first - second))


def test_reused_positions_are_byte_identical_and_add_no_error(tiny):
    """Logits through the prefix cache equal, bit for bit, the same split prefill done from scratch.

    The cache only moves ``offset``: the kept keys and values are the bytes the earlier call wrote,
    and the tail prefill sees exactly what a fresh cache filled with the same head would hold.
    """
    head, tail = PROMPT[:7], [55, 56, 57, 58]
    prefix = PrefixCache(tiny, 64)
    kv = prefix.take(head + [70, 71])
    tiny.forward(head + [70, 71], kv)
    prefix.remember(head + [70, 71])
    saved = kv.keys[:, :, :7].copy(), kv.values[:, :, :7].copy()

    kv = prefix.take(head + tail)
    assert kv.offset == 7
    cached = tiny.ops.read(tiny.forward(tail, kv, logits="all"))
    assert np.array_equal(kv.keys[:, :, :7], saved[0]) and np.array_equal(kv.values[:, :, :7], saved[1])

    fresh = tiny.new_cache(64)
    tiny.forward(head + [70, 71], fresh)
    fresh.trim(2)
    assert np.array_equal(tiny.ops.read(tiny.forward(tail, fresh, logits="all")), cached)


def test_logits_with_the_cache_match_a_cold_prefill_within_float32_rounding(tiny):
    """Cached logits vs one cold prefill of the whole prompt: within ``ROUNDING``, same greedy token.

    Not bit for bit: BLAS may round a row of a linear differently in batches of different lengths.
    """
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(3, 97, size=60)]
    cold_cache = tiny.new_cache(64)
    cold = tiny.ops.read(tiny.forward(ids, cold_cache, logits="last"))[0]
    for head in (1, 2, 9, 31, 58, 59):
        prefix = PrefixCache(tiny, 64)
        kv = prefix.take(ids[:head])
        tiny.forward(ids[:head], kv)
        prefix.remember(ids[:head])
        kv = prefix.take(ids)
        assert kv.offset == min(head, len(ids) - 1)
        cached = tiny.ops.read(tiny.forward(ids[kv.offset :], kv, logits="last"))[0]
        assert_logits_within_rounding(cached, cold, head)


# ---------------------------------------------------------------- with speculative decoding


def test_prefix_caches_for_target_and_draft_work_with_speculative_decoding(model, tiny):
    target_prefix, draft_prefix = PrefixCache(model, 128), PrefixCache(tiny, 128)
    draft = CountingModel(tiny)
    params = GenerationParams(max_tokens=12, temperature=0)
    first = _generate(model, PROMPT, params, prefix_cache=target_prefix, draft=draft, num_draft_tokens=3,
                      draft_prefix_cache=draft_prefix)
    assert first == _generate(tiny, PROMPT, params)
    follow_up = PROMPT + first + [44, 45]
    model.forwards.clear()
    draft.forwards.clear()
    stats = GenerationStats()
    second = _generate(model, follow_up, params, prefix_cache=target_prefix, draft=draft, num_draft_tokens=3,
                       draft_prefix_cache=draft_prefix, stats=stats)
    assert second == _generate(tiny, follow_up, params)
    assert model.forwards[0] == 3  # first's last token and the two new ones
    # The draft reuses its own cache too: it catches up on at most the answer's last two tokens
    # (its last proposal is never fed to it), the two new ones and the first new token.
    assert draft.forwards[0] <= 5
    assert stats.cached_prompt_tokens == len(follow_up) - 3 and stats.rounds > 0


@pytest.mark.gpu
def test_gpu_logits_with_the_cache_match_a_cold_prefill(tmp_path, gpu_ops):
    """The same on the GPU backend (f32 weights and KV): within 1e-5."""
    config = tiny_config("qwen2")
    save_safetensors_model(tmp_path, config, random_state_dict(config, seed=5))
    model = DecoderModel(ModelConfig.from_json(tmp_path / "config.json"), load_weights(tmp_path), gpu_ops)
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 97, size=40)]
    cold = model.ops.read(model.forward(ids, model.new_cache(64)))[0]
    for head in (1, 7, 39):
        prefix = PrefixCache(model, 64)
        model.forward(ids[:head], prefix.take(ids[:head]))
        prefix.remember(ids[:head])
        kv = prefix.take(ids)
        assert kv.offset == min(head, len(ids) - 1)
        cached = model.ops.read(model.forward(ids[kv.offset :], kv))[0]
        np.testing.assert_allclose(cached, cold, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_real_model_logits_with_the_cache_match_a_cold_prefill_within_float32_rounding():
    """The same on real Qwen2.5 weights (logits up to about 20), tails of 64, 10, 1 and 1 rows.

    The cold cache ends inside one of NumpyOps' 256-key chunks (320 positions); the prefix caches hold
    320 or 512.
    """
    from kjarni.loader import load_model
    from tests.real_models import QWEN_CODER_05B, real_model_path

    model = load_model(real_model_path(QWEN_CODER_05B)).model
    ids = [int(t) for t in np.arange(300) * 7919 % 150000 + 100]
    cold = model.ops.read(model.forward(ids, model.new_cache(320)))[0]
    for head, capacity in ((236, 512), (290, 320), (299, 512), (300, 320)):  # 300: all of it was cached
        prefix = PrefixCache(model, capacity)
        model.forward(ids[:head], prefix.take(ids[:head]))
        prefix.remember(ids[:head])
        kv = prefix.take(ids)
        assert kv.offset == min(head, len(ids) - 1)
        cached = model.ops.read(model.forward(ids[kv.offset :], kv))[0]
        assert_logits_within_rounding(cached, cold, head)
