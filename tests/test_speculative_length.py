"""The speculative draft length: fixed or adapted to the measured acceptance and costs.

``DraftLength`` is driven with controlled acceptance and costs (no clock); ``speculative_step``
runs tiny models whose forwards advance a fake clock by chosen costs, so the choices it makes are
counted, not timed. Whatever the length, greedy output stays plain greedy output and sampled
output keeps the target's distribution.
"""

from __future__ import annotations

import math
from typing import NamedTuple

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


def test_the_adaptive_length_times_a_plain_run_then_starts_short_then_follows_the_model():
    length = DraftLength()
    assert length.adaptive and length.p_min == 0.5 and length.max_tokens == MAX_DRAFT_TOKENS
    trace = drive(length, lambda k: k, 80)  # a perfect draft
    assert trace[:2] == [("plain", DraftLength.FIRST_PLAIN_RUN), ("round", INITIAL_DRAFT_TOKENS)]
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


class Costs(NamedTuple):
    """Simulated seconds: a plain step, a draft step, a verify pass of ``rows`` rows (``verify_base
    + verify_row * (rows - 1)``), a prefill row of the target and of the draft (its catch-ups of
    more than 2 tokens), the prompt's tokens, and the ``cost_ratio`` the controller is told; where
    decoding runs ahead, the steps of a plain run's first readback (``burst``), what the first
    plain run pays on top of its steps (``startup``: plain decoding pays it as well), what a
    plain run after a round pays (``restart``) and what the first round pays (``first_use``)."""

    plain: float
    draft: float
    verify_base: float
    verify_row: float
    prefill_row: float
    draft_row: float
    prompt: int
    cost_ratio: float
    burst: int = 1
    startup: float = 0.0
    restart: float = 0.0
    first_use: float = 0.0

    def verify(self, rows: int) -> float:
        return self.verify_base + self.verify_row * (rows - 1)


# Like the H200's with Qwen2.5-1.5B f16 and its 0.5B draft (docs/benchmarks.md): a plain step
# 2.9 ms while decoding runs ahead; each round pays readbacks, so a draft forward costs 2.4 ms and
# a verify 6.7 ms (the best fixed length reaches 0.9x plain with a draft that is always right,
# and the priors, a plain step per verify row, underestimate a round); a 256-token prefill 33 ms
# for the target, 12 ms for the draft; step_weights' ratio of the pair 0.32.
H200 = Costs(2.9e-3, 2.4e-3, 6.7e-3, 0.3e-3, 33e-3 / 256, 12e-3 / 256, 256, 0.32)
# Like the numpy backend's with the real Qwen2.5-Coder pair on this 2-core machine (drafting
# pays, docs/benchmarks.md "Speculative decoding"): a plain step 220 ms, a draft step 72 ms, a
# verify 550 ms + 30 ms a row (OpenBLAS's gemm for 2+ rows: the prior, a tenth of a step a row,
# underestimates it); prefill rows 60 and 20 ms for a 40-token chat prompt.
NUMPY = Costs(0.22, 0.072, 0.52, 0.03, 0.06, 0.02, 40, 0.32)
# A pair where drafting pays well: a verify pass a step and a tenth of one a row (the priors'
# shape), a draft step a third of a step.
PAYS = Costs(0.175, 0.058, 0.175, 0.0175, 0.04, 0.013, 40, 0.32)
# The H200 pair as measured in the eleventh session (docs/benchmarks.md): decoding runs ahead 8
# steps, 1.89 ms a step, but a plain run's first readback after the prefill costs 40 ms for its 8
# steps (25 ms over them: the new KV cache's step tapes and bind groups), a run after a round at
# most about 1 ms more (0.1-0.4 measured), and the first round about 10 ms more than the next ones
# (the draft's and the verify's tapes); a 256-token prefill 37 ms, the draft's of 296 tokens 19 ms.
H200_AHEAD = Costs(1.89e-3, 2.4e-3, 6.7e-3, 0.3e-3, 37e-3 / 256, 19e-3 / 296, 256, 0.32,
                   burst=8, startup=25e-3, restart=1e-3, first_use=12e-3)


def simulate(rate: float, tokens: int, costs: Costs = H200, seed: int = 0, length: DraftLength | None = None):
    """(simulated seconds after the prefill, trace) of the adaptive length generating ``tokens``
    (the first from the prefill) with ``costs``, the drafts right at ``rate``; the draft's cache
    followed as speculative_step trims it."""
    rng, length = np.random.default_rng(seed), length or DraftLength(cost_ratio=costs.cost_ratio)
    length.burst = costs.burst  # as speculative_step sets it from the backend
    length.record_prefill(costs.prompt, costs.prompt * costs.prefill_row, tokens)
    done, seconds, trace, unseen = 1, 0.0, [], costs.prompt + 1  # tokens the draft has not seen
    while done < tokens:
        k = min(length.choose(unseen), tokens - done - 1)
        if k <= 0:
            n = min(length.plain_run(), tokens - done) if k == 0 else 1
            extra = costs.restart if trace else costs.startup
            first = min(costs.burst, n)
            length.record_plain(n, n * costs.plain + extra, first, first * costs.plain + extra)
            seconds, done, unseen = seconds + n * costs.plain + extra, done + n, unseen + n
            trace.append(("plain", n))
            continue
        a = next((i for i in range(k) if rng.random() > rate), k)
        feed = costs.draft if unseen <= 2 else max(costs.draft, unseen * costs.draft_row)
        drafting = feed + (k - 1) * costs.draft
        if not any(kind == "round" for kind, _ in trace):
            drafting += costs.first_use
        length.record_round(k, a, costs.verify(k + 1), drafting, k if unseen <= 2 else 0)
        seconds, done, unseen = seconds + costs.verify(k + 1) + drafting, done + a + 1, 1 + (a == k)
        trace.append(("round", k))
    return seconds, trace


def plain_seconds(tokens: int, costs: Costs = H200) -> float:
    return (tokens - 1) * costs.plain + costs.startup


@pytest.mark.parametrize("rate", [0.0, 0.7, 1.0])
def test_on_a_gpu_running_ahead_the_first_readbacks_excess_prices_the_first_round(rate):
    # The first plain run is two bursts, timed on the second; the 25 ms excess of the first burst
    # goes into the first round's worst case (about 40 ms), which 2% of 511 steps (19 ms) cannot pay.
    seconds, trace = simulate(rate, 512, H200_AHEAD)
    assert trace == [("plain", 16), ("plain", 511 - 16)]
    assert seconds == pytest.approx(plain_seconds(512, H200_AHEAD) + H200_AHEAD.restart)  # the second run's start
    for tokens in (2048, 8192):  # a budget that pays for a first round: the loss stays within it
        seconds, trace = simulate(rate, tokens, H200_AHEAD)
        assert ("round", 3) in trace
        assert seconds <= plain_seconds(tokens, H200_AHEAD) * (1 + DraftLength.PROBE_SHARE)


def test_the_plain_step_is_timed_after_the_first_readback_and_its_excess_kept_apart():
    length = DraftLength(burst=8)
    assert length.choose() == 0 and length.plain_run() == 16  # two bursts: one to time a step on
    length.record_plain(16, 0.040 + 8 * 0.002, 8, 0.040)  # 40 ms for the first 8 steps, then 2 ms a step
    assert length.verify_seconds(1) == pytest.approx(0.002) and length.startup == pytest.approx(0.024)
    # The first round's worst case holds the excess; a timed round's estimate does not.
    assert length.round_seconds(3) == pytest.approx(3 * length._draft_step() + length.verify_seconds(4) + 0.024)
    length.record_prefill(100, 0.1, 10_000)
    credit = length.credit()
    length.record_round(3, 0, 0.010, 0.002, 3)
    assert length.round_seconds(3) == pytest.approx(3 * length._draft_step() + length.verify_seconds(4))
    assert length.credit() == pytest.approx(credit - (0.012 - 0.002))
    length.record_plain(8, 0.005 + 8 * 0.002, 8, 0.005 + 8 * 0.002)  # the run after it started 5 ms late
    assert length.credit() == pytest.approx(credit - (0.012 - 0.002) - 0.005)  # the round's loss
    assert length.startup == pytest.approx(0.024)  # not the device's first use


@pytest.mark.parametrize("rate", [0.0, 0.7, 1.0])
def test_a_short_generation_on_the_h200_never_pays_the_drafts_prefill(rate):
    # 2% of 127 plain steps is 7.4 ms: less than the draft's estimated 9 ms prefill of the prompt.
    seconds, trace = simulate(rate, 128)
    assert trace == [("plain", DraftLength.FIRST_PLAIN_RUN), ("plain", 127 - DraftLength.FIRST_PLAIN_RUN)]
    assert seconds == pytest.approx(plain_seconds(128))


@pytest.mark.parametrize("rate", [0.0, 0.7, 1.0])
def test_rounds_that_lose_on_the_h200_cost_at_most_the_budget(rate):
    for tokens in (512, 2048, 8192):
        seconds, trace = simulate(rate, tokens)
        assert ("round", 3) in trace  # the budget pays for the draft's prefill and a first round
        # PROBE_SHARE, and what the priors did not foresee of the rounds before the costs were
        # measured (a verify at 1.8x its prior, the draft's prefill at 1.4x): less than one round
        first_round = (H200.prompt + 1) * H200.draft_row + 2 * H200.draft + H200.verify(4)
        assert seconds <= plain_seconds(tokens) * (1 + DraftLength.PROBE_SHARE) + first_round


@pytest.mark.parametrize("tokens", [256, 1024])
def test_where_drafting_pays_the_default_keeps_the_speedup(tokens):
    seconds, trace = simulate(1.0, tokens, PAYS)
    best_fixed = min(simulate(1.0, tokens, PAYS, length=DraftLength(k))[0] for k in range(1, 9))
    assert best_fixed < plain_seconds(tokens, PAYS) / 1.95  # 8 drafts always right
    assert plain_seconds(tokens, PAYS) / seconds > 1.8 and seconds <= best_fixed * 1.05
    seconds, trace = simulate(0.0, tokens, PAYS)  # a draft never right: the budget bounds the loss
    assert seconds <= plain_seconds(tokens, PAYS) * (1 + DraftLength.PROBE_SHARE)


def test_a_generation_too_short_to_repay_the_drafts_prefill_decodes_plain_even_where_drafting_pays():
    # 2% of 63 plain steps (0.22 s) cannot pay the draft's estimated prefill (49 rows: 0.5 s) in
    # the worst case, so the guarantee costs this generation the speedup (fixed k=8: 1.8x).
    seconds, trace = simulate(1.0, 64, PAYS)
    assert trace == [("plain", DraftLength.FIRST_PLAIN_RUN), ("plain", 63 - DraftLength.FIRST_PLAIN_RUN)]
    assert simulate(1.0, 64, PAYS, length=DraftLength(8))[0] < plain_seconds(64, PAYS) / 1.8


@pytest.mark.parametrize("rate", [0.0, 0.73, 1.0])
def test_on_the_numpy_backends_costs_the_default_stays_within_the_budget(rate):
    # A verify pass (OpenBLAS gemm) costs 2.5-3.5 plain steps: its prior underestimates the first round.
    for tokens in (64, 256, 1024):
        seconds, _ = simulate(rate, tokens, NUMPY)
        first_round = (NUMPY.prompt + 9) * NUMPY.draft_row + 2 * NUMPY.draft + NUMPY.verify(4)
        assert seconds <= plain_seconds(tokens, NUMPY) * (1 + DraftLength.PROBE_SHARE) + first_round


@pytest.mark.parametrize("seed", range(40))
def test_with_priors_that_do_not_underestimate_the_default_is_never_more_than_2_percent_slower(seed):
    """Random pairs whose real costs are at most the priors (a verify row a tenth of a plain step,
    a draft step ``cost_ratio`` of one, catch-ups at the prefill's rate times it): whatever the
    acceptance and the length, the rounds lose at most PROBE_SHARE of plain decoding's time."""
    rng = np.random.default_rng(seed)
    plain, ratio = 1.0, float(rng.uniform(0.05, 1.0))
    prefill_row = float(rng.uniform(0.02, 0.5))
    costs = Costs(plain, ratio * rng.uniform(0.3, 1.0), plain * rng.uniform(0.5, 1.0),
                  0.1 * plain * rng.uniform(0, 1.0), prefill_row, prefill_row * ratio * rng.uniform(0.3, 1.0),
                  int(rng.integers(1, 600)), ratio)
    for tokens in (2, 16, 100, 1000):
        rate = float(rng.uniform(0, 1))
        seconds, _ = simulate(rate, tokens, costs, seed=seed)
        assert seconds <= plain_seconds(tokens, costs) * (1 + DraftLength.PROBE_SHARE) + 1e-9


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


class Unbudgeted(DraftLength):
    """The adaptive length without the budget: for tests of what the rounds produce."""

    def credit(self) -> float:
        return math.inf



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


class DeviceClock(Clock):
    """The fake clock of a device that runs forwards in order while the CPU goes on: a forward
    queues its cost (`DeviceTimed`), and a read advances the clock to the end of the work queued
    before it started (`on_device` patches the context's reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.device_end = 0.0

    def queue(self, cost: float) -> None:
        self.device_end = max(self.device_end, self.now) + cost

    def wait(self, until: float) -> None:
        self.now = max(self.now, until)


class DeviceTimed(Timed):
    """`Timed` on a `DeviceClock`: forwards queue their cost instead of spending it at once."""

    def forward(self, ids, kv_cache, logits="last"):
        rows = len(ids)
        self.forwards.append(rows)
        self.clock.queue(self.base * (1 + self.per_row * (rows - 1)))
        return self._model.forward(ids, kv_cache, logits=logits)


def on_device(monkeypatch, context, clock: DeviceClock) -> None:
    """Make ``context``'s reads wait on ``clock``: `WgpuContext.read` for everything queued so
    far, a `read_later` for what was queued when it started."""
    read, read_later = context.read, context.read_later

    def read_now(*args):
        clock.wait(clock.device_end)
        return read(*args)

    def start(*args):
        until, wait = clock.device_end, read_later(*args)
        return lambda: clock.wait(until) or wait()

    monkeypatch.setattr(context, "read", read_now)
    monkeypatch.setattr(context, "read_later", start)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("target"), seed=11)


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("noisy"), seed=11, noise=0.04)


@pytest.fixture(scope="module")
def unrelated(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("unrelated"), seed=99)


def run(target, draft, max_tokens, draft_cost, params=None, clock=None, **kwargs):
    """(tokens, stats, timed target, timed draft) of one speculative generation on the fake clock
    (``clock``: a `DeviceClock` whose reads `on_device` patched, else the CPU's: forwards cost at once)."""
    timed = DeviceTimed if isinstance(clock, DeviceClock) else Timed
    clock = clock or Clock()
    t, d = timed(target, clock, 1.0), timed(draft, clock, draft_cost)
    params = params or GenerationParams(temperature=0)
    stats = GenerationStats()
    capacity = len(PROMPT) + max_tokens
    # The draft's true cost ratio (the pairs here share one shape, so their step_weights do not say it).
    length = kwargs.pop("length", None) or DraftLength(
        kwargs.pop("num_draft_tokens", None), kwargs.pop("draft_p_min", None), cost_ratio=draft_cost)
    steps = speculative_step(
        t, d, PROMPT, Sampler(params), np.random.default_rng(params.seed), target.new_cache(capacity),
        draft.new_cache(capacity), max_tokens=max_tokens, on_round=stats.count_round,
        on_plain=stats.count_plain, on_decision=stats.count_decision, clock=clock, length=length, **kwargs,
    )
    tokens = [next(steps)[0] for _ in range(max_tokens)]
    steps.close()
    return tokens, stats, t, d


class Recorded(DraftLength):
    """The default length, noting what speculative_step tells it of its plain runs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.plain_records: list[tuple] = []

    def record_plain(self, *args) -> None:
        self.plain_records.append(args)
        super().record_plain(*args)


def test_a_plain_run_reports_its_first_readback_apart_from_its_steps(target):
    # The numpy backend reads every step back: the first readback is the first step (1 s here).
    length = Recorded(cost_ratio=1.0)
    run(target, target, 30, 1.0, length=length)
    assert length.burst == 1
    assert length.plain_records == [(8, 8.0, 1, 1.0), (21, 21.0, 1, 1.0)]  # then the budget's run
    assert length.startup == 0.0


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


def test_stream_generate_reports_the_lengths_and_decisions_and_resets_them(target, noisy):
    stats = GenerationStats()
    params = GenerationParams(max_tokens=40, temperature=0)
    assert _tokens(target, params, draft=noisy, stats=stats) == _tokens(target, params)
    # A draft of the target's own shape costs a plain step a token (the step_weights prior): its
    # prefill and a first round cannot be repaid by 2% of 40 steps, so none is run.
    assert stats.draft_decisions == {"plain: time the plain step": 1, "plain: budget": 1}
    assert stats.rounds == 0 and stats.plain_tokens == 39
    _tokens(target, params, draft=noisy, num_draft_tokens=2, stats=stats, draft_p_min=0.0)
    assert set(stats.draft_lengths) <= {1, 2} and stats.plain_tokens <= 1  # a fresh count, fixed length
    assert stats.draft_stops == 0 and stats.draft_length == pytest.approx(stats.draft_tokens_proposed / stats.rounds)
    assert sum(stats.draft_lengths.values()) == stats.rounds == stats.draft_decisions["round: fixed length"]
    assert set(stats.draft_decisions) <= {"round: fixed length", "plain: last token"}


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
    stops = rounds = 0
    for seed in range(n):
        # The plain step already timed and no budget: the first three tokens come from rounds.
        length = Unbudgeted(p_min=0.45)
        length.record_plain(1, 1.0)
        tokens, stats, _, _ = run(target, noisy, 3, 0.3, GenerationParams(seed=seed, **settings), length=length)
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
        stops, rounds = stops + stats.draft_stops, rounds + stats.rounds
    assert 0.1 * rounds < stops < 0.9 * rounds  # early stops and full rounds both exercised
    exact = _exact_joint(target, Sampler(GenerationParams(**settings)), PROMPT, 3)
    stat, df = _chi_square(counts, exact, n)
    assert stat < _critical(df), f"chi-square {stat:.1f} with {df} degrees of freedom"


# ---------------------------------------------------------------- on the GPU: plain runs running ahead


@pytest.mark.gpu
def test_gpu_adaptive_greedy_with_plain_runs_is_plain_greedy(tmp_path, gpu_ops, monkeypatch):
    from kjarni.model_config import ModelConfig
    from kjarni.model import DecoderModel
    from kjarni.weights import load_weights

    monkeypatch.setattr(gpu_ops.tuning, "decode_ahead", 8)  # the fake clock's figures below are for bursts of 8
    _build(tmp_path, seed=11)
    gpu = DecoderModel(ModelConfig.from_json(tmp_path / "config.json"), load_weights(tmp_path), gpu_ops)
    # A draft as dear as the target: the first round measures the costs and loses (its draft steps
    # and verify cost more than its tokens at the plain step), and plain runs (decode running
    # ahead) do the rest. The fake
    # clock runs the forwards in order on a device (1 s each) while the loop records on, as the
    # GPU does: a plain run's next burst is recorded before the readback waits.
    clock = DeviceClock()
    on_device(monkeypatch, gpu_ops.context, clock)
    length = Recorded(cost_ratio=0.5)
    tokens, stats, _, _ = run(gpu, gpu, 200, 1.0, length=length, clock=clock)
    assert stats.plain_tokens >= 100 and stats.rounds >= 1
    # Decoding runs ahead: the first readback covers decode_ahead steps (8 here), the first run two of them.
    assert length.burst == gpu_ops.decode_ahead == 8
    assert length.plain_records[0] == (16, 16.0, 8, 8.0)
    assert stats.draft_decisions["round: measure costs"] >= 1 and stats.draft_decisions["plain: rounds lose"] >= 1
    assert tokens == _tokens(gpu, GenerationParams(max_tokens=200, temperature=0))


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
    assert gpu_ops.decode_ahead >= 8  # max_tokens (8) ends the bursts, not decode_ahead
    ctx, count = gpu_ops.context, []
    real_read, real_later = ctx.read, ctx.read_later
    ctx.read = lambda *args: count.append(args) or real_read(*args)
    ctx.read_later = lambda *args: count.append(args) or real_later(*args)
    try:
        steps = generate_step(gpu, PROMPT, Sampler(GenerationParams(temperature=0)), np.random.default_rng(0),
                              gpu.new_cache(len(PROMPT) + 8), max_tokens=8, first_burst=first_burst)
        tokens = [next(steps)[0] for _ in range(8)]
        steps.close()
    finally:
        del ctx.read, ctx.read_later
    assert len(count) == reads  # bursts 1, 2, 4, 1 against one burst of 8
    assert tokens == _tokens(gpu, GenerationParams(max_tokens=8, temperature=0))


# ---------------------------------------------------------------- the CLI says when the draft went unused


def test_the_cli_says_when_the_default_left_the_draft_unused(tmp_path, capsys):
    from kjarni import cli
    from tests.test_api import make_tiny_model

    target, draft = make_tiny_model(tmp_path / "target"), make_tiny_model(tmp_path / "draft", weight_noise=0.04)
    assert cli.main(["generate", "the cat sat", "--model-path", str(target), "--device", "cpu", "--greedy",
                     "--max-tokens", "12", "--draft", str(draft)]) == 0
    err = capsys.readouterr().err
    assert "draft draft: not used, the tokens asked for could not repay its prefill and a first round: " \
           "11 tokens decoded without it" in err


def test_step_weights_price_the_qwen_draft_at_a_third_of_its_target():
    from kjarni.model_config import ModelConfig
    from kjarni.speculative import step_weights

    qwen = dict(model_type="qwen2", vocab_size=151936, num_key_value_heads=2, tie_word_embeddings=True)
    draft = ModelConfig.from_dict(dict(qwen, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                       num_attention_heads=14))
    target = ModelConfig.from_dict(dict(qwen, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                        num_attention_heads=12))
    # 0.5B: 24 layers of 14.9M weights and a 136M LM head; 1.5B: 28 of 46.8M and 233M.
    assert step_weights(draft) == 24 * (896 * 64 * (28 + 4) + 3 * 896 * 4864) + 151936 * 896 == 493_961_216
    assert step_weights(draft) / step_weights(target) == pytest.approx(0.32, abs=0.005)
