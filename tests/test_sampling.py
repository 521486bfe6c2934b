"""Sampler properties: each filter on hand-built and random logits, the draw, the fast paths."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kjarni.errors import GenerationFailedError, InvalidConfigurationError, NonFiniteLogitsError
from kjarni.numpy_ops import NumpyOps
from kjarni.sampler import (
    Sampler,
    apply_repetition_penalty,
    apply_temperature,
    make_sampler,
    min_p_filter,
    top_k_filter,
    top_p_filter,
)
from kjarni.settings import GenerationParams

# Logits on a coarse grid so that ties happen often.
tied_logits = hnp.arrays(
    np.float32,
    st.integers(2, 40),
    elements=st.integers(-8, 8).map(lambda v: np.float32(v / 2)),
)
smooth_logits = hnp.arrays(
    np.float32,
    st.integers(2, 40),
    elements=st.floats(-10, 10, width=32),
)


def _probs(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


# ---------------------------------------------------------------- filters


@given(tied_logits, st.integers(1, 50))
def test_top_k_keeps_k_tokens_plus_ties_at_the_boundary(logits, k):
    kept = np.isfinite(top_k_filter(logits, k))
    if k >= len(logits):
        assert kept.all()
        return
    threshold = np.sort(logits)[::-1][k - 1]
    assert np.array_equal(kept, logits >= threshold)
    assert kept.sum() >= k
    assert kept.sum() == k or (logits == threshold).sum() > 1  # more than k only through ties


def test_top_k_zero_disables_and_input_is_not_mutated():
    logits = np.array([1, 3, 2], np.float32)
    assert np.array_equal(top_k_filter(logits, 0), logits)
    top_k_filter(logits, 1)
    assert np.array_equal(logits, [1, 3, 2])


@given(smooth_logits, st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_prefix_reaching_p(logits, p):
    kept = np.isfinite(top_p_filter(logits, p))
    probs = _probs(logits)
    # The kept tokens are the most probable ones (everything kept is >= everything removed).
    if (~kept).any():
        assert probs[kept].min() >= probs[~kept].max()
    assert kept[np.argmax(logits)]  # the top token always stays
    mass = probs[kept].sum()
    assert mass >= p - 1e-9 or kept.all()
    # Minimal: dropping the least probable kept token falls below p.
    if kept.sum() > 1:
        assert mass - probs[kept].min() < p + 1e-9


def test_top_p_on_a_hand_built_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    assert np.isfinite(top_p_filter(logits, 0.5)).tolist() == [True, False, False, False]
    assert np.isfinite(top_p_filter(logits, 0.6)).tolist() == [True, True, False, False]
    assert np.isfinite(top_p_filter(logits, 0.9)).tolist() == [True, True, True, False]
    assert np.isfinite(top_p_filter(logits, 1.0)).all()


def test_top_p_tie_at_the_boundary_keeps_the_lower_id():
    logits = np.zeros(4, np.float32)
    assert np.isfinite(top_p_filter(logits, 0.5)).tolist() == [True, True, False, False]


@given(smooth_logits, st.floats(0.0, 1.0))
def test_min_p_threshold_is_relative_to_the_top_probability(logits, p):
    kept = np.isfinite(min_p_filter(logits, p))
    probs = _probs(logits)
    assert kept[np.argmax(logits)]
    if p == 0:
        assert kept.all()
    else:
        assert np.array_equal(kept, probs >= p * probs.max())


def test_min_p_hand_built():
    logits = np.log(np.array([0.6, 0.3, 0.07, 0.03], np.float32))
    assert np.isfinite(min_p_filter(logits, 0.1)).tolist() == [True, True, True, False]


@given(tied_logits, st.lists(st.integers(0, 39), max_size=10), st.floats(0.1, 5.0))
def test_repetition_penalty_signs(logits, history, penalty):
    history = [h for h in history if h < len(logits)]
    out = apply_repetition_penalty(logits, history, penalty)
    assert out.dtype == np.float32
    seen = np.zeros(len(logits), bool)
    seen[history] = True
    assert np.array_equal(out[~seen], logits[~seen])
    for i in np.flatnonzero(seen):
        expected = logits[i] * np.float32(penalty) if logits[i] < 0 else logits[i] / np.float32(penalty)
        assert out[i] == np.float32(expected)
        if penalty > 1:
            assert out[i] <= logits[i]  # a penalty > 1 never makes a repeated token likelier


def test_repetition_penalty_counts_repeats_once():
    out = apply_repetition_penalty(np.array([4.0, -4.0], np.float32), [0, 0, 0, 1, 1], 2.0)
    assert out.tolist() == [2.0, -8.0]


def test_temperature_divides_and_stays_float32():
    out = apply_temperature(np.array([1.0, -2.0], np.float32), 0.5)
    assert out.dtype == np.float32 and out.tolist() == [2.0, -4.0]


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("temperature", dict(temperature=-0.1)),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.5)),
        ("top_k", dict(top_k=-1)),
        ("min_p", dict(min_p=1.1)),
        ("min_p", dict(min_p=-0.1)),
        ("repetition_penalty", dict(repetition_penalty=0.0)),
        ("max_tokens", dict(max_tokens=0)),
        ("temperature", dict(temperature=float("nan"))),
    ],
)
def test_validation_names_the_value_and_range(field, kwargs):
    with pytest.raises(InvalidConfigurationError, match=field) as info:
        GenerationParams(**kwargs)
    assert "must be" in str(info.value)


def test_valid_edges_are_accepted():
    GenerationParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, max_tokens=1)
    GenerationParams(temperature=2.0, top_k=5, top_p=0.01, min_p=1.0, repetition_penalty=0.5, max_tokens=10)
    assert make_sampler(0.0).greedy


# ---------------------------------------------------------------- the draw


def test_greedy_takes_the_lowest_id_among_equal_maxima():
    sampler = make_sampler(temperature=0)
    logits = np.array([1.0, 5.0, 2.0, 5.0], np.float32)
    token, logprob = sampler.sample(logits, [], np.random.default_rng(0))
    assert token == 1
    assert logprob == pytest.approx(np.log(_probs(logits)[1]))
    assert sampler.distribution(logits).tolist() == [0, 1, 0, 0]


def test_greedy_applies_the_repetition_penalty():
    sampler = make_sampler(temperature=0, repetition_penalty=4.0)
    token, _ = sampler.sample(np.array([3.0, 2.0], np.float32), [0], np.random.default_rng(0))
    assert token == 1


def test_distribution_matches_the_filter_chain():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=50).astype(np.float32) * 3
    history = [1, 2, 3, 3]
    sampler = make_sampler(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.3)
    chained = min_p_filter(
        top_p_filter(top_k_filter(apply_temperature(apply_repetition_penalty(logits, history, 1.3), 0.7), 20), 0.8),
        0.05,
    )
    probs = sampler.distribution(logits, history)
    assert probs.dtype == np.float32
    np.testing.assert_allclose(probs, _probs(chained), rtol=1e-6, atol=1e-7)
    assert probs.sum() == pytest.approx(1.0, abs=1e-6)


def test_samples_follow_the_filtered_distribution():
    """Chi-square goodness of fit at a fixed seed (df ~ 5, critical value at p=0.001 is 20.5)."""
    logits = np.log(np.array([0.3, 0.25, 0.2, 0.1, 0.08, 0.05, 0.02], np.float32))
    sampler = make_sampler(temperature=0.9, top_k=6, top_p=0.95)
    expected = sampler.distribution(logits).astype(np.float64)
    assert expected[6] == 0  # removed by top-k
    rng = np.random.default_rng(1234)
    n = 20000
    counts = np.bincount([sampler.sample(logits, [], rng)[0] for _ in range(n)], minlength=7)
    assert counts[expected == 0].sum() == 0  # filtered tokens are never drawn
    live = expected > 0
    chi2 = (((counts[live] - n * expected[live]) ** 2) / (n * expected[live])).sum()
    assert chi2 < 20.5


def test_same_seed_same_tokens():
    logits = np.random.default_rng(0).normal(size=100).astype(np.float32)
    sampler = make_sampler(temperature=1.0, top_p=0.9)
    a = [sampler.sample(logits, [], rng)[0] for rng in [np.random.default_rng(7)] for _ in range(50)]
    b = [sampler.sample(logits, [], rng)[0] for rng in [np.random.default_rng(7)] for _ in range(50)]
    c = [sampler.sample(logits, [], rng)[0] for rng in [np.random.default_rng(8)] for _ in range(50)]
    assert a == b and a != c


def test_sampled_logprob_is_the_models_log_softmax():
    logits = np.array([2.0, 1.0, 0.5], np.float32)
    token, logprob = make_sampler(temperature=2.0).sample(logits, [], np.random.default_rng(0))
    assert logprob == pytest.approx(np.log(_probs(logits)[token]))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_logits_raise_naming_the_step_on_every_sampler_entry(bad):
    logits = np.array([bad, 1.0, 0.5], np.float32)
    rng = np.random.default_rng(0)
    calls = {
        "sample": lambda s, step: s.sample(logits, [], rng, step=step),
        "distribution": lambda s, step: s.distribution(logits, step=step),
        "sample_candidates": lambda s, step: s.sample_candidates(logits, np.arange(3), rng, step=step),
    }
    for entry, call in calls.items():
        with pytest.raises(NonFiniteLogitsError, match=r"NaN or infinite logits at decode step 7 \(largest value") as caught:
            call(make_sampler(temperature=0.8, top_k=2), "decode step 7")
        assert caught.value.step == "decode step 7", entry
        assert isinstance(caught.value, GenerationFailedError)  # what callers caught before: still caught
    with pytest.raises(NonFiniteLogitsError, match="at a sampling step") as caught:
        make_sampler().sample(logits, [], rng)  # called directly, without a step
    assert caught.value.step == "a sampling step"


# ---------------------------------------------------------------- top-k candidates path


def test_needs_full_logits():
    assert not make_sampler(temperature=0).needs_full_logits
    assert not make_sampler(top_k=5).needs_full_logits
    assert not make_sampler(top_k=5, top_p=0.9, min_p=0.1).needs_full_logits
    assert make_sampler(top_k=0).needs_full_logits
    assert make_sampler(top_p=0.9).needs_full_logits
    assert make_sampler(top_k=5, repetition_penalty=1.1).needs_full_logits
    assert make_sampler(temperature=0, repetition_penalty=1.1).needs_full_logits


@settings(max_examples=60, deadline=None)
@given(
    tied_logits | smooth_logits,
    st.integers(1, 12),
    st.sampled_from([0.3, 1.0, 1.7]),
    st.sampled_from([1.0, 0.9, 0.5]),
    st.sampled_from([0.0, 0.1]),
    st.integers(0, 2**32 - 1),
)
def test_top_k_candidates_draw_exactly_what_the_full_logits_draw(logits, k, temperature, top_p, min_p, seed):
    sampler = make_sampler(temperature=temperature, top_k=k, top_p=top_p, min_p=min_p)
    ops = NumpyOps()
    full_rng, cand_rng = np.random.default_rng(seed), np.random.default_rng(seed)
    for _ in range(5):
        expected, _ = sampler.sample(logits, [], full_rng)
        values, ids = ops.top_k(logits[None, :], sampler.candidate_count)
        token = sampler.sample_candidates(values[0], ids[0], cand_rng)
        if token is None:  # a tie at the boundary: the loop falls back to the full logits
            threshold = np.sort(logits)[::-1][k - 1] / np.float32(temperature)
            assert (apply_temperature(logits, temperature) == threshold).sum() > 1
            token, _ = sampler.sample(logits, [], cand_rng)
        assert token == expected


def test_candidates_detect_a_tie_at_the_boundary_without_consuming_the_rng():
    sampler = make_sampler(top_k=2)
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    values = np.array([3.0, 1.0, 1.0], np.float32)
    assert sampler.sample_candidates(values, np.array([4, 0, 9]), rng) is None
    assert rng.bit_generator.state == state


def test_sampler_is_a_plain_frozen_dataclass():
    sampler = make_sampler(0.5, 3, 0.9, 0.1, 1.2)
    assert sampler == Sampler(GenerationParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        sampler.settings = GenerationParams()  # type: ignore[misc]
