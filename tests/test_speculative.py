"""Speculative decoding on tiny random models: greedy identity, the target's distribution, caches, limits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kjarni.model_config import ModelConfig
from kjarni.errors import ContextOverflowError, InvalidConfigurationError
from kjarni.stream import GenerationParams, GenerationStats, stream_generate
from kjarni.loader import load_model
from kjarni.model import DecoderModel
from kjarni.numpy_ops import NumpyOps
from kjarni.sampler import Sampler
from kjarni.speculative import check_draft_compatible, speculative_step
from kjarni.weights import load_weights
from tests.test_generate import FakeTokenizer
from tests.tiny_models import random_state_dict, save_gguf_model, save_safetensors_model, tiny_config

PROMPT = [1, 17, 3, 88, 42, 9]


class Recording:
    """Wraps a model to record the length of every forward and the cache offsets it saw."""

    def __init__(self, model: DecoderModel) -> None:
        self._model = model
        self.ops, self.config, self.context_size = model.ops, model.config, model.context_size
        self.forwards: list[tuple[int, int]] = []  # (tokens, offset before)
        self.caches: list = []

    def forward(self, ids, kv_cache, logits="last"):
        self.forwards.append((len(ids), kv_cache.offset))
        return self._model.forward(ids, kv_cache, logits=logits)

    def new_cache(self, capacity=None):
        cache = self._model.new_cache(capacity)
        self.caches.append(cache)
        return cache


def _build(path, seed, noise=0.0, **overrides) -> DecoderModel:
    config = tiny_config("qwen2", **overrides)
    tensors = random_state_dict(config, seed=seed)
    rng = np.random.default_rng(seed + 1000)
    tensors = {n: (t + noise * t.std() * rng.standard_normal(t.shape)).astype(np.float32) for n, t in tensors.items()}
    save_safetensors_model(path, config, tensors)
    return DecoderModel(ModelConfig.from_json(path / "config.json"), load_weights(path), NumpyOps())


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> DecoderModel:
    return _build(tmp_path_factory.mktemp("target"), seed=11)


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> DecoderModel:
    # The target's weights with 4% noise over the same 97-token vocabulary: it agrees often, not always
    # (two independent random tiny models almost never agree, which would leave acceptance untested).
    return _build(tmp_path_factory.mktemp("draft"), seed=11, noise=0.04)


def _tokens(model, params, prompt=PROMPT, **kwargs) -> list[int]:
    return [e.token_id for e in stream_generate(model, FakeTokenizer(), prompt, params, **kwargs)]


# ---------------------------------------------------------------- greedy: exactly the target's output


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_greedy_speculative_output_is_token_for_token_plain_greedy(target, draft, k):
    params = GenerationParams(max_tokens=40, temperature=0)
    stats = GenerationStats()
    assert _tokens(target, params, draft=draft, num_draft_tokens=k, stats=stats) == _tokens(target, params)
    assert 0 < stats.draft_tokens_accepted < stats.draft_tokens_proposed  # both outcomes happened


def test_greedy_with_a_repetition_penalty_and_logprobs_matches_plain(target, draft):
    params = GenerationParams(max_tokens=30, temperature=0, repetition_penalty=1.3, logprobs=True)
    plain = list(stream_generate(target, FakeTokenizer(), PROMPT, params))
    spec = list(stream_generate(target, FakeTokenizer(), PROMPT, params, draft=draft, num_draft_tokens=3))
    assert [e.token_id for e in spec] == [e.token_id for e in plain]
    np.testing.assert_allclose([e.logprob for e in spec], [e.logprob for e in plain], atol=1e-4)


def test_a_perfect_draft_is_always_accepted_and_gives_k_plus_one_tokens_per_round(target):
    stats = GenerationStats()
    params = GenerationParams(max_tokens=1 + 4 * 5, temperature=0)
    tokens = _tokens(target, params, draft=target, num_draft_tokens=4, stats=stats)
    assert tokens == _tokens(target, params)
    assert (stats.rounds, stats.draft_tokens_proposed, stats.draft_tokens_accepted) == (4, 16, 16)
    assert stats.acceptance_rate == 1.0 and stats.tokens_per_round == 5.0


# ---------------------------------------------------------------- caches: one verify pass, no re-prefill


def test_each_round_is_one_target_pass_and_draft_cache_is_never_reprefilled(target, draft):
    t, d = Recording(target), Recording(draft)
    k = 4
    list(stream_generate(t, FakeTokenizer(), PROMPT, GenerationParams(max_tokens=30, temperature=0),
                         draft=d, num_draft_tokens=k))
    assert t.forwards[0] == (len(PROMPT), 0)  # prefill, then one verify pass of 1 + k per round
    assert all(n <= k + 1 for n, _ in t.forwards[1:])
    assert d.forwards[0] == (len(PROMPT) + 1, 0)  # the draft's own prefill, once
    # Afterwards the draft only catches up on 1 or 2 tokens, from a cache rolled back, never reset.
    assert all(n in (1, 2) and offset > len(PROMPT) for n, offset in d.forwards[1:])


def test_rejection_rolls_both_caches_back_to_the_accepted_tokens(target, draft):
    tcache, dcache = target.new_cache(64), draft.new_cache(64)
    seen = []
    steps = speculative_step(
        target, draft, PROMPT, Sampler(GenerationParams(temperature=0)), np.random.default_rng(0),
        tcache, dcache, num_draft_tokens=4, max_tokens=40,
        on_round=lambda proposed, accepted, stopped: seen.append((proposed, accepted, tcache.offset, dcache.offset)),
    )
    tokens = [next(steps)[0]]
    for proposed, accepted, t_offset, d_offset in _rounds(steps, tokens, seen, 6):
        # The target holds every token but the round's last; the draft no more than that.
        assert t_offset == len(PROMPT) + len(tokens) - 1
        assert d_offset <= t_offset
    steps.close()


def _rounds(steps, tokens, seen, n):
    for _ in range(n):
        before = len(seen)
        tokens.append(next(steps)[0])
        assert len(seen) == before + 1
        proposed, accepted, t_offset, d_offset = seen[-1]
        for _ in range(accepted):
            tokens.append(next(steps)[0])
        yield seen[-1]


# ---------------------------------------------------------------- limits and stop rules as without a draft


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 11])
def test_never_exceeds_max_tokens_and_never_computes_past_it(target, max_tokens):
    t, d = Recording(target), Recording(target)
    params = GenerationParams(max_tokens=max_tokens, temperature=0)
    events = list(stream_generate(t, FakeTokenizer(), PROMPT, params, draft=d, num_draft_tokens=4))
    assert len(events) == max_tokens and events[-1].finish_reason == "length"
    # A perfect draft: every forward is useful, the last token is never fed.
    assert sum(n for n, _ in t.forwards) == len(PROMPT) + max_tokens - 1


def test_eos_and_stop_strings_end_generation_as_without_a_draft(target, draft):
    plain = _tokens(target, GenerationParams(max_tokens=30, temperature=0))
    eos = plain[9]
    params = GenerationParams(max_tokens=30, temperature=0, eos_token_ids={eos})
    with_draft = list(stream_generate(target, FakeTokenizer(), PROMPT, params, draft=draft, num_draft_tokens=5))
    without = list(stream_generate(target, FakeTokenizer(), PROMPT, params))
    assert with_draft == without and with_draft[-1].finish_reason == "eos"
    text = FakeTokenizer().decode(plain)
    stop = text[5:8]
    params = GenerationParams(max_tokens=30, temperature=0, stop=(stop,))
    with_draft = list(stream_generate(target, FakeTokenizer(), PROMPT, params, draft=draft, num_draft_tokens=5))
    assert with_draft == list(stream_generate(target, FakeTokenizer(), PROMPT, params))
    assert with_draft[-1].finish_reason == "stop"


def test_the_context_limit_ends_with_context_and_rounds_shrink_to_fit(target, draft):
    cache = target.new_cache(len(PROMPT) + 9)
    params = GenerationParams(max_tokens=50, temperature=0)
    events = list(stream_generate(target, FakeTokenizer(), PROMPT, params, kv_cache=cache, draft=draft,
                                  num_draft_tokens=4))
    assert len(events) == 9 and events[-1].finish_reason == "context"
    assert [e.token_id for e in events] == _tokens(target, params)[:9]


def test_draft_with_a_different_logits_width_or_no_room_is_refused(target, tmp_path):
    other = _build(tmp_path / "wide", seed=3, vocab_size=101)
    with pytest.raises(InvalidConfigurationError, match="101.*97"):
        stream_generate(target, FakeTokenizer(), PROMPT, GenerationParams(), draft=other)
    with pytest.raises(InvalidConfigurationError, match="num_draft_tokens"):
        stream_generate(target, FakeTokenizer(), PROMPT, GenerationParams(), draft=target, num_draft_tokens=0)
    short = _build(tmp_path / "short", seed=3, max_position_embeddings=4, sliding_window=4)
    with pytest.raises(ContextOverflowError, match="draft"):
        stream_generate(target, FakeTokenizer(), PROMPT, GenerationParams(), draft=short)


def test_check_draft_compatible_names_both_vocabularies(tmp_path):
    def loaded(name, seed, **overrides):
        config = tiny_config("qwen2", **overrides)
        return load_model(save_gguf_model(tmp_path / f"{name}.gguf", config, random_state_dict(config, seed=seed)))

    target, same = loaded("t", 1), loaded("d", 2, num_hidden_layers=1)
    check_draft_compatible(target, same)  # same tokenizer, different weights: fine
    with pytest.raises(InvalidConfigurationError, match=r"103 tokens.*97 tokens"):
        check_draft_compatible(target, loaded("wide", 3, vocab_size=103))
    renamed = loaded("r", 4)
    renamed.tokenizer._tokens = list(renamed.tokenizer._tokens)
    renamed.tokenizer._tokens[50] = "zz"
    with pytest.raises(InvalidConfigurationError, match="different vocabularies"):
        check_draft_compatible(target, renamed)


# ---------------------------------------------------------------- sampling: exactly the target's distribution


def _exact_joint(model, sampler, prompt, depth, first_from=None):
    """{(t1, .., t_depth): probability} of the first tokens; levels past the first from ``first_from``."""
    def dist(m, ids):
        logits = m.ops.read(m.forward(ids, m.new_cache(len(ids)), logits="last"))[0]
        return sampler.distribution(logits, ids).astype(np.float64)

    joint = {(): 1.0}
    for level in range(depth):
        m = model if first_from is None or level == 0 else first_from
        nxt = {}
        for prefix, prob in joint.items():
            p = dist(m, list(prompt) + list(prefix))
            for t in np.flatnonzero(p):
                nxt[prefix + (int(t),)] = prob * p[t]
        joint = nxt
    return joint


def _chi_square(counts: dict, expected_probs: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic with cells of expected count < 5 pooled; (statistic, degrees of freedom)."""
    cells = set(counts) | set(expected_probs)
    big = [c for c in cells if expected_probs.get(c, 0.0) * n >= 5]
    rest = [c for c in cells if c not in big]
    observed = [counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in rest)]
    expected = [expected_probs[c] * n for c in big] + [sum(expected_probs.get(c, 0.0) for c in rest) * n]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    stat += sum(1e9 for o, e in zip(observed, expected) if e == 0 and o > 0)  # an impossible outcome
    return stat, len(big)  # cells - 1 (the pooled cell counts as one)


def _critical(df: int, z: float = 3.72) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at z sigmas (3.72: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=1.0, top_k=4),
        dict(temperature=0.8, top_p=0.7, min_p=0.1, repetition_penalty=1.4),
    ],
    ids=["top_k", "top_p_min_p_penalty"],
)
def test_speculative_sampling_follows_the_targets_distribution(target, draft, settings):
    """The joint distribution of the first three tokens (two come from a speculative round) is the target's.

    A chi-square test against the exact distribution, enumerated with one forward per prefix; the
    same samples must clearly fail against the distribution a draft-trusting loop would produce,
    so the test can tell the two apart.
    """
    n, k = 2500, 2
    sampler = Sampler(GenerationParams(**settings))
    counts: dict = {}
    stats = GenerationStats()
    accepted = proposed = 0
    for seed in range(n):
        params = GenerationParams(max_tokens=3, seed=seed, **settings)
        tokens = tuple(_tokens(target, params, draft=draft, num_draft_tokens=k, stats=stats))
        counts[tokens] = counts.get(tokens, 0) + 1
        accepted, proposed = accepted + stats.draft_tokens_accepted, proposed + stats.draft_tokens_proposed
    assert 0.1 < accepted / proposed < 0.9  # rejections and acceptances both exercised

    exact = _exact_joint(target, sampler, PROMPT, 3)
    stat, df = _chi_square(counts, exact, n)
    assert stat < _critical(df), f"chi-square {stat:.1f} with {df} degrees of freedom"
    trusting = _exact_joint(target, sampler, PROMPT, 3, first_from=draft)
    wrong, wrong_df = _chi_square(counts, trusting, n)
    assert wrong > 3 * _critical(wrong_df)


def test_same_seed_same_speculative_sample(target, draft):
    params = GenerationParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7)
    first = _tokens(target, params, draft=draft, num_draft_tokens=3)
    assert first == _tokens(target, params, draft=draft, num_draft_tokens=3)
