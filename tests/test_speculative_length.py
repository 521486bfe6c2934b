"""The speculative draft length: fixed or adapted to the measured acceptance and costs.

``DraftLength`` is driven with controlled acceptance and costs (no clock); ``speculative_step``
runs tiny models whose forwards advance a fake clock by chosen costs, so the choices it makes are
counted, not timed. Whatever the length, greedy output stays plain greedy output and sampled
output keeps the target's distribution.
"""

from __future__ import annotations

import numpy as np
import pytest

from kjarni.errors import InvalidConfigurationError
from kjarni.sampler import Sampler
from kjarni.stream import GenerationParams, GenerationStats, stream_generate
from kjarni.speculative import INITIAL_DRAFT_TOKENS, MAX_DRAFT_TOKENS, DraftLength, speculative_step
from tests.test_generate import FakeTokenizer
from tests.test_speculative import PROMPT, _build, _chi_square, _critical, _exact_joint, _tokens

# ---------------------------------------------------------------- DraftLength on controlled costs

PLAIN, DRAFT_STEP = 1.0, 0.1


def verify(rows: int) -> float:
    return 1.0 + 0.05 * (rows - 1)


def drive(length: DraftLength, accepts, tokens: int, *, draft_step: float = DRAFT_STEP, plain: float = PLAIN):
    """Run the controller against a simulated pair for ``tokens`` tokens.

    ``accepts(k)`` says how many of k drafts are accepted. Returns the list of decisions:
    ("round", k) or ("plain", n).
    """
    done, trace = 1, []
    while done < tokens:
        k = length.choose()
        if k == 0:
            n = length.plain_run()
            length.record_plain(n, n * plain)
            trace.append(("plain", n))
            done += n
            continue
        a = accepts(k)
        length.record_round(k, a, verify(k + 1), k * draft_step, k)
        trace.append(("round", k))
        done += a + 1
    return trace


def test_a_fixed_length_is_always_chosen_and_never_stops_early_by_default():
    length = DraftLength(5)
    assert length.p_min == 0.0 and not length.adaptive
    assert drive(length, lambda k: 0, 60) == [("round", 5)] * 59  # no plain runs, even when useless


def test_the_adaptive_length_starts_short_times_a_plain_run_then_follows_the_model():
    length = DraftLength()
    assert length.adaptive and length.p_min == 0.5 and length.max_tokens == MAX_DRAFT_TOKENS
    trace = drive(length, lambda k: k, 80)  # a perfect draft
    assert trace[:2] == [("round", INITIAL_DRAFT_TOKENS), ("plain", DraftLength.FIRST_PLAIN_RUN)]
    assert {kind for kind, _ in trace[2:]} == {"round"}
    assert trace[-3:] == [("round", MAX_DRAFT_TOKENS)] * 3  # cheap and always right: the longest rounds


def test_rates_are_expected_tokens_over_expected_time():
    length = DraftLength()
    for _ in range(30):  # acceptance about 2/3, the prior decayed away
        length.record_round(4, 2, verify(5), 4 * DRAFT_STEP, 4)
        length.record_round(1, 1, verify(2), DRAFT_STEP, 1)
    a = length.acceptance
    assert a == pytest.approx(3 / 4, abs=0.02)  # 3 accepted in 4 trials per pair of rounds
    assert length.verify_seconds(9) == pytest.approx(verify(9))
    rates = length.rates()
    for k in (1, 3, 8):
        expected_tokens = sum(a**i for i in range(k + 1))
        assert rates[k] == pytest.approx(expected_tokens / (k * DRAFT_STEP + verify(k + 1)))


def test_early_stops_lower_the_continuation_and_the_expected_tokens():
    length = DraftLength()
    for _ in range(30):  # the draft stops after one token every round, which is accepted
        length.record_round(1, 1, verify(2), 2 * DRAFT_STEP, 2, stopped=True)
    c, a = length.continuation, length.acceptance
    assert c == pytest.approx(0.5, abs=0.02) and a == pytest.approx(1.0, abs=0.01)
    drafted = c + c**2
    tokens = 1 + c * a + (c * a) ** 2
    assert length.rates()[2] == pytest.approx(tokens / ((1 + c) * DRAFT_STEP + length.verify_seconds(1 + drafted)))


@pytest.mark.parametrize("acceptance, lengths", [(0.6, {2, 3}), (0.95, {8})])
def test_the_chosen_length_grows_with_the_acceptance(acceptance, lengths):
    rng = np.random.default_rng(0)

    def accepts(k):
        return next((i for i in range(k) if rng.random() > acceptance), k)

    trace = drive(DraftLength(), accepts, 400)
    chosen = [k for kind, k in trace[10:] if kind == "round"]
    assert max(set(chosen), key=chosen.count) in lengths


def test_a_draft_never_accepted_falls_back_to_plain_with_probes_ever_rarer():
    trace = drive(DraftLength(), lambda k: 0, 1200)
    rounds = [k for kind, k in trace if kind == "round"]
    runs = [n for kind, n in trace if kind == "plain"]
    assert runs[:7] == [8, 8, 16, 32, 64, 128, 128]
    # Once the acceptance has fallen, plain runs and single probe rounds alternate.
    kinds = [kind for kind, _ in trace[trace.index(("plain", 16)) - 1 :]]
    assert kinds[::2] == ["round"] * len(kinds[::2]) and set(kinds[1::2]) == {"plain"}
    assert len(rounds) <= 20  # of about 1200 tokens


def test_an_expensive_draft_is_not_used_even_when_always_right():
    # 8 drafts at one plain step each + a 9-row verify: 9 tokens in 9.4 steps, under plain's 1 + MARGIN.
    trace = drive(DraftLength(), lambda k: k, 300, draft_step=PLAIN)
    assert sum(n for kind, n in trace if kind == "plain") > 250


def test_speculation_comes_back_when_the_draft_starts_agreeing():
    length = DraftLength()
    drive(length, lambda k: 0, 200)  # prose the draft gets wrong: plain runs of 64 by now
    trace = drive(length, lambda k: k, 400)  # then code it gets right
    first_round = next(i for i, (kind, _) in enumerate(trace) if kind == "round")
    assert first_round <= 1  # the next probe finds it
    assert [kind for kind, _ in trace[first_round:]] == ["round"] * len(trace[first_round:])


# Costs like the H200's with Qwen2.5-1.5B f16 and its 0.5B draft (docs/benchmarks.md): a plain
# step 2.9 ms while decoding runs ahead; each round pays readbacks, so a draft forward costs 2.4 ms
# and a verify 6.7 ms: the best fixed length reaches 0.9x plain with a draft that is always right.
H200_PLAIN, H200_DRAFT = 2.9e-3, 2.4e-3


def h200_verify(rows: int) -> float:
    return 6.7e-3 + 0.3e-3 * (rows - 1)


def simulate(rate: float, tokens: int, seed: int = 0):
    """(simulated seconds, trace) of the adaptive length on the H200's costs, drafts right at ``rate``."""
    rng, length, done, seconds, trace = np.random.default_rng(seed), DraftLength(), 1, 0.0, []
    while done < tokens:
        k = length.choose()
        if k == 0:
            n = min(length.plain_run(), tokens - done)
            length.record_plain(n, n * H200_PLAIN)
            seconds, done = seconds + n * H200_PLAIN, done + n
            trace.append(("plain", n))
            continue
        a = next((i for i in range(k) if rng.random() > rate), k)
        length.record_round(k, a, h200_verify(k + 1), k * H200_DRAFT, k)
        seconds, done = seconds + h200_verify(k + 1) + k * H200_DRAFT, done + a + 1
        trace.append(("round", k))
    return seconds, trace


@pytest.mark.parametrize("rate", [0.0, 0.7, 1.0])
def test_rounds_that_lose_clearly_give_way_to_long_plain_runs(rate):
    seconds, trace = simulate(rate, 128)
    rounds = [k for kind, k in trace if kind == "round"]
    runs = [n for kind, n in trace if kind == "plain"]
    assert len(rounds) <= 2  # the round timing the costs, at most one probe
    assert runs[0] == DraftLength.FIRST_PLAIN_RUN and max(runs) >= 48  # then runs long enough to amortise it
    assert seconds <= 127 * H200_PLAIN / 0.96  # within 4% of plain decoding's 127 steps
    seconds, trace = simulate(rate, 2048)
    assert sum(kind == "round" for kind, _ in trace) <= 16
    assert seconds <= 2047 * H200_PLAIN / 0.98  # the probes cost about PROBE_SHARE


def test_a_losing_probe_sets_a_run_that_makes_its_loss_a_small_share():
    length = DraftLength()
    length.record_round(3, 3, 0.010, 0.006, 3)  # 4 tokens in 16 ms
    assert length.choose() == 0 and length.plain_run() == DraftLength.FIRST_PLAIN_RUN
    length.record_plain(8, 8 * 0.002)  # 2 ms a step: the round lost 16 - 4 * 2 = 8 ms
    assert length.choose() == 0
    assert DraftLength.PROBE_SHARE == 0.02 and length.plain_run() == 200  # 8 ms is 2% of 200 steps
    rates = length.rates()
    assert length.choose() == max(rates, key=rates.__getitem__)  # then the probe


# ---------------------------------------------------------------- speculative_step with a fake clock


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Timed:
    """A model whose forwards advance ``clock`` by ``base + per_row * (rows - 1)`` and are counted."""

    def __init__(self, model, clock: Clock, base: float, per_row: float = 0.05) -> None:
        self._model, self.clock, self.base, self.per_row = model, clock, base, per_row
        self.ops, self.config, self.context_size = model.ops, model.config, model.context_size
        self.forwards: list[int] = []

    def forward(self, ids, kv_cache, logits="last"):
        rows = len(ids)
        self.forwards.append(rows)
        self.clock.now += self.base * (1 + self.per_row * (rows - 1))
        return self._model.forward(ids, kv_cache, logits=logits)

    def new_cache(self, capacity=None):
        return self._model.new_cache(capacity)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("target"), seed=11)


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("noisy"), seed=11, noise=0.04)


@pytest.fixture(scope="module")
def unrelated(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("unrelated"), seed=99)


def run(target, draft, max_tokens, draft_cost, params=None, **kwargs):
    """(tokens, stats, timed target, timed draft) of one speculative generation on the fake clock."""
    clock = Clock()
    t, d = Timed(target, clock, 1.0), Timed(draft, clock, draft_cost)
    params = params or GenerationParams(temperature=0)
    stats = GenerationStats()
    capacity = len(PROMPT) + max_tokens
    steps = speculative_step(
        t, d, PROMPT, Sampler(params), np.random.default_rng(params.seed), target.new_cache(capacity),
        draft.new_cache(capacity), max_tokens=max_tokens, on_round=stats.count_round,
        on_plain=stats.count_plain, clock=clock, **kwargs,
    )
    tokens = [next(steps)[0] for _ in range(max_tokens)]
    steps.close()
    return tokens, stats, t, d


def _rounds_account_for_every_token(stats: GenerationStats, tokens: int) -> bool:
    produced = 1 + stats.plain_tokens + stats.draft_tokens_accepted + stats.rounds
    return produced >= tokens and produced - tokens <= MAX_DRAFT_TOKENS  # the last round may overshoot


@pytest.mark.parametrize("draft_name, draft_cost", [("target", 0.1), ("noisy", 0.3), ("target", 1.0), ("unrelated", 0.3)])
def test_adaptive_greedy_is_plain_greedy_whatever_it_chooses(request, target, draft_name, draft_cost):
    draft = request.getfixturevalue(draft_name) if draft_name != "target" else target
    tokens, stats, _, _ = run(target, draft, 60, draft_cost)
    assert tokens == _tokens(target, GenerationParams(max_tokens=60, temperature=0))
    assert _rounds_account_for_every_token(stats, 60)
    assert sum(stats.draft_lengths.values()) == stats.rounds
    assert sum(k * n for k, n in stats.draft_lengths.items()) == stats.draft_tokens_proposed


def test_a_perfect_cheap_draft_drafts_the_longest_rounds(target):
    # draft_p_min=0: a tiny random model is never confident (its top probability stays under 0.5).
    tokens, stats, t, d = run(target, target, 120, 0.1, draft_p_min=0.0)
    assert stats.draft_lengths.get(MAX_DRAFT_TOKENS, 0) >= stats.rounds - 4
    assert stats.plain_tokens <= DraftLength.FIRST_PLAIN_RUN + 1  # the run timing a plain step, the last token
    assert len(t.forwards) == 1 + stats.rounds + stats.plain_tokens <= 30  # prefill, rounds, plain steps


def test_an_unrelated_draft_is_left_idle_most_of_the_time(target, unrelated):
    tokens, stats, t, d = run(target, unrelated, 250, 0.3, draft_p_min=0.0)
    assert stats.acceptance_rate < 0.2
    assert stats.plain_tokens >= 0.8 * 250
    assert len(d.forwards) <= 2 * stats.rounds <= 24  # the probes' catch-ups and drafts only


def test_a_p_min_of_one_stops_every_round_before_its_first_draft(target, noisy):
    tokens, stats, _, d = run(target, noisy, 30, 0.3, num_draft_tokens=4, draft_p_min=1.0)
    assert tokens == _tokens(target, GenerationParams(max_tokens=30, temperature=0))
    assert stats.draft_tokens_proposed == 0 and stats.draft_stops == stats.rounds == 28
    assert len(d.forwards) == 28  # one catch-up forward a round, nothing drafted; the last token plain


def test_a_p_min_stops_some_rounds_early_and_keeps_the_output(target, noisy):
    # The tiny draft's top probability is about 0.2 at the median, 0.15 at the 25th percentile.
    tokens, stats, _, _ = run(target, noisy, 60, 0.3, num_draft_tokens=2, draft_p_min=0.15)
    assert tokens == _tokens(target, GenerationParams(max_tokens=60, temperature=0))
    assert 0 < stats.draft_stops < stats.rounds
    # A round not stopped drafts both (but one clamped by max_tokens at the end).
    assert stats.draft_lengths[2] >= stats.rounds - stats.draft_stops - 1


def test_stream_generate_reports_the_lengths_and_resets_them(target, noisy):
    stats = GenerationStats()
    params = GenerationParams(max_tokens=40, temperature=0)
    assert _tokens(target, params, draft=noisy, stats=stats) == _tokens(target, params)
    assert stats.rounds and stats.draft_length == pytest.approx(stats.draft_tokens_proposed / stats.rounds)
    assert sum(stats.draft_lengths.values()) == stats.rounds
    _tokens(target, params, draft=noisy, num_draft_tokens=2, stats=stats, draft_p_min=0.0)
    assert set(stats.draft_lengths) <= {1, 2} and stats.plain_tokens <= 1  # a fresh count, fixed length
    assert stats.draft_stops == 0


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.5", True])
def test_draft_p_min_outside_0_1_is_refused(target, bad):
    with pytest.raises(InvalidConfigurationError, match="draft_p_min"):
        stream_generate(target, FakeTokenizer(), PROMPT, GenerationParams(), draft=target, draft_p_min=bad)


def test_sampling_with_the_adaptive_length_and_early_stops_follows_the_targets_distribution(target, noisy):
    """As test_speculative's chi-square test, with the default adaptive length and a p_min that
    stops some rounds early: the first three tokens' joint distribution is still the target's."""
    settings = dict(temperature=1.0, top_k=4)
    n = 2500
    counts: dict = {}
    stats = GenerationStats()
    stops = rounds = 0
    for seed in range(n):
        params = GenerationParams(max_tokens=3, seed=seed, **settings)
        tokens = tuple(_tokens(target, params, draft=noisy, draft_p_min=0.45, stats=stats))
        counts[tokens] = counts.get(tokens, 0) + 1
        stops, rounds = stops + stats.draft_stops, rounds + stats.rounds
    assert 0.1 * rounds < stops < 0.9 * rounds  # early stops and full rounds both exercised
    exact = _exact_joint(target, Sampler(GenerationParams(**settings)), PROMPT, 3)
    stat, df = _chi_square(counts, exact, n)
    assert stat < _critical(df), f"chi-square {stat:.1f} with {df} degrees of freedom"


# ---------------------------------------------------------------- on the GPU: plain runs running ahead


@pytest.mark.gpu
def test_gpu_adaptive_greedy_with_plain_runs_is_plain_greedy(tmp_path, gpu_ops):
    from kjarni.model_config import ModelConfig
    from kjarni.model import DecoderModel
    from kjarni.weights import load_weights

    _build(tmp_path, seed=11)
    gpu = DecoderModel(ModelConfig.from_json(tmp_path / "config.json"), load_weights(tmp_path), gpu_ops)
    # An expensive draft: after the first rounds, plain runs (decode running ahead) do most of it.
    tokens, stats, _, _ = run(gpu, gpu, 48, 1.0)
    assert stats.plain_tokens >= 24 and stats.rounds >= 2
    assert tokens == _tokens(gpu, GenerationParams(max_tokens=48, temperature=0))


@pytest.mark.gpu
def test_gpu_greedy_round_reads_back_once_and_keeps_plain_greedy(tmp_path, gpu_ops):
    from kjarni.model_config import ModelConfig
    from kjarni.model import DecoderModel
    from kjarni.weights import load_weights

    _build(tmp_path, seed=11)
    gpu = DecoderModel(ModelConfig.from_json(tmp_path / "config.json"), load_weights(tmp_path), gpu_ops)
    ctx, reads, per_round = gpu_ops.context, [], []
    real_read = ctx.read
    ctx.read = lambda *args: reads.append(args) or real_read(*args)
    try:
        params = GenerationParams(temperature=0)
        steps = speculative_step(
            gpu, gpu, PROMPT, Sampler(params), np.random.default_rng(0), gpu.new_cache(len(PROMPT) + 30),
            gpu.new_cache(len(PROMPT) + 30), max_tokens=30, num_draft_tokens=3,
            on_round=lambda *_: per_round.append(len(reads)),
        )
        tokens = [next(steps)[0] for _ in range(30)]
        steps.close()
    finally:
        del ctx.read
    assert len(per_round) >= 7
    assert per_round[0] == 2  # the prefill's token, then the first round
    assert np.diff(per_round).tolist() == [1] * (len(per_round) - 1)  # drafts and choices in one readback
    assert tokens == _tokens(gpu, GenerationParams(max_tokens=30, temperature=0))


@pytest.mark.gpu
@pytest.mark.parametrize("first_burst, reads", [(1, 4), (8, 1)])
def test_gpu_plain_run_at_full_burst_reads_back_once_per_decode_ahead_steps(tmp_path, gpu_ops, first_burst, reads):
    from kjarni.decode import generate_step
    from kjarni.model_config import ModelConfig
    from kjarni.model import DecoderModel
    from kjarni.weights import load_weights

    _build(tmp_path, seed=11)
    gpu = DecoderModel(ModelConfig.from_json(tmp_path / "config.json"), load_weights(tmp_path), gpu_ops)
    assert gpu_ops.decode_ahead == 8
    ctx, count = gpu_ops.context, []
    real_read = ctx.read
    ctx.read = lambda *args: count.append(args) or real_read(*args)
    try:
        steps = generate_step(gpu, PROMPT, Sampler(GenerationParams(temperature=0)), np.random.default_rng(0),
                              gpu.new_cache(len(PROMPT) + 8), max_tokens=8, first_burst=first_burst)
        tokens = [next(steps)[0] for _ in range(8)]
        steps.close()
    finally:
        del ctx.read
    assert len(count) == reads  # bursts 1, 2, 4, 1 against one burst of 8
    assert tokens == _tokens(gpu, GenerationParams(max_tokens=8, temperature=0))
