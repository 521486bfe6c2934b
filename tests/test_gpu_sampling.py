"""Sampling on the GPU (sample.wgsl after top_k.wgsl) against the numpy sampler, and the finite
check folded into argmax / top_k: NaN or inf logits read as -1 (kjarni/backend.py) and raise
NonFiniteLogitsError naming the step, greedy or sampled, running ahead or step by step.

The GPU draws with the uniform numpy's sampler would consume for the same token, so for the same
logits and seed both give the same token (up to float32 rounding at a boundary, which these
seeded cases do not hit).
"""

from __future__ import annotations

import numpy as np
import pytest

from kjarni.model_config import ModelConfig
from kjarni.errors import NonFiniteLogitsError
from kjarni.decode import generate_step
from kjarni.model import DecoderModel
from kjarni.numpy_ops import NumpyOps
from kjarni.backend import UNDECIDED
from kjarni.sampler import FixedDraw, make_sampler
from tests.tiny_models import random_state_dict, tiny_config

pytestmark = pytest.mark.gpu

PROMPT = [5, 17, 3, 88, 42, 9, 61, 2, 30, 77, 14]


def upload(ops, array):
    """A ``[rows, cols]`` activation holding ``array`` (the embedding gather of an f32 table)."""
    return ops.embed(ops.weight(np.ascontiguousarray(array, np.float32), name="activation"), np.arange(array.shape[0]))


class _Weights:
    """HF-named tensors from a dict (no file, so a NaN reaches the model as it is)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def __contains__(self, name):
        return name in self.tensors

    def raw(self, name):
        return self.tensors[name]


def _models(gpu_ops, *, nan_in=None, seed=5):
    """(numpy model, GPU model) on the same tiny random Qwen2 weights; ``nan_in``: (tensor, row)."""
    config = tiny_config("qwen2")
    tensors = random_state_dict(config, seed=seed)
    if nan_in is not None:
        name, row = nan_in
        tensors[name] = tensors[name].copy()
        tensors[name][row, 0] = np.nan
    cfg = ModelConfig.from_dict(config)
    return DecoderModel(cfg, _Weights(tensors), NumpyOps()), DecoderModel(cfg, _Weights(tensors), gpu_ops)


def _tokens(model, sampler, count, seed=0, **kwargs):
    cache = model.new_cache(64)
    steps = generate_step(model, PROMPT, sampler, np.random.default_rng(seed), cache, **kwargs)
    try:
        return [token for token, _ in (next(steps) for _ in range(count))]
    finally:
        steps.close()


# ---------------------------------------------------------------- the kernel


SAMPLERS = [
    dict(temperature=0.7, top_k=50, top_p=0.9),  # the generator's defaults
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.5, top_k=200, min_p=0.05),
    dict(temperature=0.3, top_k=255, top_p=0.5, min_p=0.2),
    dict(temperature=1.0, top_k=1),
]


@pytest.mark.parametrize("settings", SAMPLERS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_the_gpu_draws_the_numpy_samplers_token_for_the_same_uniform(gpu_ops, settings):
    sampler = make_sampler(**settings)
    assert gpu_ops.samples_ahead(sampler)
    rng = np.random.default_rng(sum(map(ord, str(settings))))
    # One chunk; two chunks of top_k.wgsl, the last one partial; 15 chunks, where top-k 50 keeps
    # 16 candidates per interleaved chunk (PER_CHUNK).
    for cols in (97, 3001, 30011):
        logits = (rng.standard_normal((1, cols)) * 2.5).astype(np.float32)
        logits[0, 7] = -1e30  # a token that is never drawn
        row = upload(gpu_ops, logits)
        handles, expected = [], []
        for seed in range(6):
            expected.append(sampler.sample(logits[0], [], np.random.default_rng(seed))[0])
            handles.append(gpu_ops.sample_ahead(row, sampler, np.random.default_rng(seed).random()))
        got = [int(ids[0]) for ids in gpu_ops.read_tokens(handles)]
        assert got == expected


def test_a_tie_at_the_top_k_boundary_is_left_to_the_cpu(gpu_ops):
    sampler = make_sampler(temperature=1.0, top_k=3)
    logits = np.linspace(-1, 1, 50, dtype=np.float32)[None]
    logits[0, [10, 20, 30]] = 5.0  # ranks 0..2
    logits[0, [11, 40]] = 4.0  # ranks 3 and 4: no tie at the boundary (ranks 2 and 3)
    decided = gpu_ops.read_tokens([gpu_ops.sample_ahead(upload(gpu_ops, logits), sampler, 0.5)])
    assert int(decided[0][0]) in (10, 20, 30)
    logits[0, 30] = 4.0  # ranks 2..4 tie at 4.0: top-k keeps all three, the candidates see two
    tied = gpu_ops.read_tokens([gpu_ops.sample_ahead(upload(gpu_ops, logits), sampler, 0.5)])
    assert int(tied[0][0]) == UNDECIDED


def test_a_chunk_holding_more_than_its_share_of_the_best_leaves_the_draw_to_the_cpu(gpu_ops):
    from kjarni.gpu.sampling import PER_CHUNK

    sampler = make_sampler(temperature=1.0, top_k=50)
    cols = 30000  # 15 chunks: chunk w holds the columns w, w + 15, ..
    logits = np.random.default_rng(1).standard_normal((1, cols)).astype(np.float32)
    logits[0, 3::15] = -5.0
    logits[0, 3 + 15 * np.arange(PER_CHUNK - 1)] = 10.0 + np.arange(PER_CHUNK - 1)  # 15 of the best
    decided = gpu_ops.read_tokens([gpu_ops.sample_ahead(upload(gpu_ops, logits), sampler, 0.3)])
    assert [int(decided[0][0])] == [sampler.sample(logits[0], [], FixedDraw(0.3))[0]]
    logits[0, 3 + 15 * (PER_CHUNK - 1)] = 9.5  # a 16th: chunk 3 may hold more than it kept
    undecided = gpu_ops.read_tokens([gpu_ops.sample_ahead(upload(gpu_ops, logits), sampler, 0.3)])
    assert int(undecided[0][0]) == UNDECIDED


# ---------------------------------------------------------------- the loop


def test_sampled_decode_on_the_gpu_gives_the_numpy_tokens_for_the_same_seed(gpu_ops, monkeypatch):
    cpu, gpu = _models(gpu_ops)
    reads, read = [], gpu_ops.read
    monkeypatch.setattr(gpu_ops, "read", lambda x: reads.append(x.shape) or read(x))
    for settings in SAMPLERS[:3]:
        sampler = make_sampler(**settings)
        for seed in (0, 1):
            assert _tokens(gpu, sampler, 24, seed) == _tokens(cpu, sampler, 24, seed), settings
    assert reads == [], "sampled decode read no logits back: the draws ran on the GPU"


def test_sampled_decode_runs_ahead_reading_tokens_once_per_burst(gpu_ops, monkeypatch):
    _, gpu = _models(gpu_ops)
    bursts, read_later = [], gpu_ops.read_tokens_later
    monkeypatch.setattr(gpu_ops, "read_tokens_later", lambda handles: bursts.append(len(handles)) or read_later(handles))
    monkeypatch.setattr(gpu_ops.tuning, "decode_ahead", 8)  # bursts of at most 8, whatever the default
    _tokens(gpu, make_sampler(temperature=0.7, top_k=50, top_p=0.9), 1 + 2 + 4 + 8 + 8)
    assert bursts == [1, 2, 4, 8, 8]


@pytest.mark.parametrize("undecided_at", [0, 2, 5])
def test_an_undecided_draw_is_made_on_the_cpu_with_the_same_uniform(gpu_ops, monkeypatch, undecided_at):
    # Pretend the device left one step undecided: the loop must draw that token from the full
    # logits with the step's uniform, drop the steps run past it and reuse their uniforms.
    cpu, gpu = _models(gpu_ops)
    sampler = make_sampler(temperature=1.0, top_k=40)
    seen, read_later = [0], gpu_ops.read_tokens_later

    def one_undecided(handles):
        wait = read_later(handles)

        def ids():
            out = wait()
            for i, _ in enumerate(out):
                if seen[0] + i == undecided_at:
                    out[i] = np.array([UNDECIDED])
                    seen[0] = -1000  # once
                    return out
            seen[0] += len(out)
            return out

        return ids

    monkeypatch.setattr(gpu_ops, "read_tokens_later", one_undecided)
    assert _tokens(gpu, sampler, 16, seed=3) == _tokens(cpu, sampler, 16, seed=3)
    assert seen[0] < 0, "the undecided step was reached"


def test_settings_the_gpu_cannot_draw_fall_back_to_the_cpu_sampler(gpu_ops):
    for settings in (dict(top_k=0, top_p=0.9), dict(top_k=50, repetition_penalty=1.3), dict(top_k=256)):
        assert not gpu_ops.samples_ahead(make_sampler(**settings))
    cpu, gpu = _models(gpu_ops)
    sampler = make_sampler(temperature=0.8, top_k=50, repetition_penalty=1.3)
    assert _tokens(gpu, sampler, 12, seed=4) == _tokens(cpu, sampler, 12, seed=4)


# ---------------------------------------------------------------- NaN and inf


def test_argmax_top_k_and_the_gpu_draw_flag_nan_and_inf_rows_as_minus_one(gpu_ops):
    logits = np.random.default_rng(0).standard_normal((4, 3001)).astype(np.float32)
    logits[0, 2999] = np.nan  # in the last, partial chunk
    logits[1, 5] = np.inf
    logits[2, 70] = -np.inf
    x = upload(gpu_ops, logits)
    np.testing.assert_array_equal(gpu_ops.argmax(x), [-1, -1, -1, np.argmax(logits[3])])
    values, ids = gpu_ops.top_k(x, 3)
    np.testing.assert_array_equal(ids[:3], -np.ones((3, 3)))
    np.testing.assert_array_equal(ids[3], np.argsort(-logits[3])[:3])
    _, many = gpu_ops.top_k(x, 300)  # more than the kernel selects: chosen on the CPU, flagged alike
    assert (many[:3] == -1).all() and (many[3] >= 0).all()
    sampler = make_sampler(top_k=3)
    handles = [gpu_ops.sample_ahead(upload(gpu_ops, logits[row : row + 1]), sampler, 0.5) for row in range(4)]
    handles.append(gpu_ops.argmax_ahead(x))
    got = gpu_ops.read_tokens(handles)
    assert [int(ids[0]) for ids in got[:3]] == [-1, -1, -1] and got[3][0] in ids[3]
    np.testing.assert_array_equal(got[4], [-1, -1, -1, np.argmax(logits[3])])


def _nan_after_three_tokens(gpu_ops, settings):
    """A GPU model whose embedding row of the 3rd generated token holds a NaN: the logits of the
    4th token are the first that are not finite. Returns the model and its clean tokens."""
    _, clean = _models(gpu_ops)
    first = _tokens(clean, make_sampler(**settings), 3)
    assert first[2] not in PROMPT + first[:2]
    _, broken = _models(gpu_ops, nan_in=("model.embed_tokens.weight", first[2]))
    return broken


@pytest.mark.parametrize(
    "settings",
    [dict(temperature=0.0), dict(temperature=0.7, top_k=50, top_p=0.9)],
    ids=["greedy", "sampled"],
)
def test_nan_logits_raise_naming_the_step_when_decoding_runs_ahead(gpu_ops, settings):
    broken = _nan_after_three_tokens(gpu_ops, settings)
    with pytest.raises(NonFiniteLogitsError, match="decode step 3"):
        _tokens(broken, make_sampler(**settings), 8)


@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(temperature=0.7, top_k=50)], ids=["greedy", "sampled"])
def test_nan_logits_raise_when_decoding_step_by_step(gpu_ops, monkeypatch, settings):
    monkeypatch.setattr(gpu_ops.tuning, "decode_ahead", 1)  # the loop reads argmax / top_k every step
    _, broken = _models(gpu_ops, nan_in=("lm_head.weight", 40))
    with pytest.raises(NonFiniteLogitsError, match="the prefill"):
        _tokens(broken, make_sampler(**settings), 4)
