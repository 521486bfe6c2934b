"""Speculative decoding: a small draft model proposes tokens, the target checks them in one pass.

Each round (``speculative_step``):

    draft    proposes up to k tokens, one forward each, from its OWN KV cache kept across rounds;
             it stops early where its own top probability falls below ``p_min`` (llama.cpp's
             ``--draft-p-min``): a token it is unsure of is likely to be rejected
    target   one forward over [last token, d1 .. dj] (logits="all"): j + 1 distributions
    verify   accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw
             from norm(max(0, p_i - q_i)) instead; when all j pass, draw a bonus token from p_j
    rollback both caches trimmed back past the first rejection (``KVCache.trim``: no copy)

``p`` and ``q`` are the configured sampling distribution (``Sampler.distribution``: repetition
penalty over the history including the tokens accepted so far, temperature, top-k, top-p, min-p)
of the target and the draft, so the output follows the target's distribution exactly (Leviathan
et al. 2023, Chen et al. 2023). Greedy is the special case of one-hot distributions: accept while
the target's argmax agrees, then take the target's argmax, so the output is the target's greedy
output (up to the backend's rounding of a k + 1 row forward against a 1 row one, see
``docs/benchmarks.md``).

The length k is ``DraftLength``'s choice: fixed when the caller gives ``num_draft_tokens``, else
(the default) chosen before every round from the acceptance and the costs measured so far, and 0
(plain decoding, no draft) while speculation does not pay. Neither the length nor the early stop
changes what the output is, only how fast it comes: each position is still either verified
against the target or drawn from the target.

Only token ids pass between the two models, so the draft and the target may run on different
backends. The first token of a generation comes from the target's prefill as without a draft.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from typing import Callable, Iterator, Sequence

import numpy as np

from kjarni.backend import KVCache
from kjarni.decode import checked_ids, choose_token, generate_step, prefill, runs_ahead, step_name, verify
from kjarni.errors import InvalidConfigurationError
from kjarni.sampler import Sampler, apply_repetition_penalty

MAX_DRAFT_TOKENS = 8
"""The longest round the adaptive length considers (``num_draft_tokens=None``)."""
DEFAULT_DRAFT_P_MIN = 0.5
"""With the adaptive length, the draft stops proposing when its top probability is below this."""
INITIAL_DRAFT_TOKENS = 3
"""The adaptive length's first rounds, before any cost is measured."""
VERIFY_ROW_PRIOR = 0.1
"""Until two verify lengths are timed: each extra row costs this fraction of a one-row pass."""


# ---------------------------------------------------------------- setup checks


def vocabulary_fingerprint(tokenizer) -> str:
    """A short hash of a tokenizer's vocabulary: every token's text and which ones are special."""
    digest = hashlib.sha256()
    token_text = getattr(tokenizer, "token_text", None)
    for i in range(tokenizer.vocab_size):
        text = token_text(i).encode("utf-8", "surrogatepass") if token_text else tokenizer.token_bytes(i)
        digest.update(len(text).to_bytes(4, "little") + text + (b"S" if tokenizer.is_special(i) else b"N"))
    return digest.hexdigest()[:16]


def check_draft_compatible(target, draft, *, target_name: str = "target", draft_name: str = "draft") -> None:
    """Raise ``InvalidConfigurationError`` unless ``draft`` can draft for ``target``.

    Both are ``LoadedModel``-like (``config``, ``tokenizer``). The draft's token ids must mean the
    same tokens: equal tokenizer vocabularies (size and content) and equal logits width.
    """
    sizes = (target.tokenizer.vocab_size, draft.tokenizer.vocab_size)
    widths = (target.config.vocab_size, draft.config.vocab_size)
    if sizes[0] != sizes[1] or widths[0] != widths[1]:
        raise InvalidConfigurationError(
            f"draft model {draft_name!r} has a vocabulary of {sizes[1]} tokens ({widths[1]} logits) but "
            f"{target_name!r} has {sizes[0]} tokens ({widths[0]} logits); a draft must share the target's "
            "vocabulary: pick a smaller model of the same family (qwen2.5-coder-0.5b-instruct drafts for "
            "qwen2.5-coder-1.5b-instruct)"
        )
    prints = (vocabulary_fingerprint(target.tokenizer), vocabulary_fingerprint(draft.tokenizer))
    if prints[0] != prints[1]:
        raise InvalidConfigurationError(
            f"draft model {draft_name!r} and {target_name!r} both have {sizes[0]} tokens but different "
            f"vocabularies (fingerprints {prints[1]} and {prints[0]}); a draft must share the target's "
            "tokenizer: pick a smaller model of the same family"
        )


def validate_draft_tokens(num_draft_tokens: object) -> int | None:
    """``num_draft_tokens`` as an int (or None: the adaptive length), else ``InvalidConfigurationError``."""
    if num_draft_tokens is None:
        return None
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, (int, np.integer)) or num_draft_tokens < 1:
        raise InvalidConfigurationError(
            f"num_draft_tokens={num_draft_tokens!r} is out of range: it must be an integer >= 1, or None "
            "to let kjarni choose each round's length from the measured acceptance (the default)"
        )
    return int(num_draft_tokens)


def validate_draft_p_min(p_min: object) -> float | None:
    """``p_min`` as a float in [0, 1] (or None: the mode's default), else ``InvalidConfigurationError``."""
    if p_min is None:
        return None
    if isinstance(p_min, bool) or not isinstance(p_min, (int, float, np.floating)) or not 0.0 <= p_min <= 1.0:
        raise InvalidConfigurationError(
            f"draft_p_min={p_min!r} is out of range: it must be a probability in [0, 1] (0 never stops a "
            f"round early; the adaptive default is {DEFAULT_DRAFT_P_MIN})"
        )
    return float(p_min)


# ---------------------------------------------------------------- choosing the draft length


class DraftLength:
    """Chooses each round's draft length: fixed, or adapted to the measured acceptance and costs.

    Fixed (``num_tokens`` an int): every round drafts ``num_tokens`` (fewer where the draft's top
    probability falls below ``p_min``, 0 by default). Adaptive (``num_tokens=None``, ``p_min``
    ``DEFAULT_DRAFT_P_MIN`` by default): ``choose()`` picks the ``k`` in ``1 .. max_tokens``
    maximising the expected tokens per second of a round,

        (1 + sum_i (c a)^i) / ((1 + sum_{i<k} c^i) * draft_step + verify(1 + sum_i c^i)),   i = 1 .. k

    and returns it only when it beats plain decoding's ``1 / plain_step`` by ``MARGIN``; otherwise
    0, meaning: decode ``plain_run()`` tokens without the draft. ``a`` is the acceptance per
    drafted token (accepted / (accepted + rejections)), ``c`` the chance that the draft goes on
    past ``p_min`` at a position (drafted / (drafted + early stops)), both decayed by ``DECAY`` per
    trial so they follow the text, from priors ``PRIOR_ACCEPTANCE`` and 1; ``draft_step`` is the
    draft's time per forward, ``verify(n)`` the target's time for an ``n``-row pass (a line through
    the medians of the lengths timed so far) and ``plain_step`` the median time of a plain decode
    step. So the numerator is the expected tokens of a round, the denominator its expected time.

    The sequence: one short plain run to time the plain step (``FIRST_PLAIN_RUN`` tokens, or two
    of the backend's bursts where it runs ahead: see ``burst``), then ``INITIAL_DRAFT_TOKENS`` until
    the draft and verify costs are timed, then the cost model. After every plain run comes one
    probe round of the best ``k`` (the acceptance may have changed: prose turning into code). Each
    losing round sets the next plain run: at least twice the last one (up to ``MAX_PLAIN_RUN``;
    never shorter than the last), and long enough that the time the round lost against plain
    decoding (its measured time less its tokens at the plain step) is at most ``PROBE_SHARE`` of
    the run's time (up to ``MAX_LOSS_RUN``). So a draft that loses a little is probed often and cheaply, and one that
    loses a lot (a GPU, where every round's readbacks cost more than a step) is probed rarely.

    The budget (``record_prefill``, which ``speculative_step`` calls with the generation's
    ``max_tokens``): no round starts unless its worst case (nothing accepted: the estimated
    ``round_seconds``, the draft's prefill of the prompt in the first round, for one token)
    fits in the ``credit``, ``PROBE_SHARE`` of the whole generation at the plain step less
    what the rounds so far lost (a round the model expects to pay is weighed at its expected
    tokens instead). Once a round does not fit, every token left is decoded plain. So with any
    draft the rounds cost at most about ``PROBE_SHARE`` of plain decoding's time (the estimates'
    error aside), and a short generation never pays the draft's prefill.
    ``cost_ratio`` (the draft's forward time over the target's; by default the ratio of their
    ``step_weights``) prices the draft before it is timed.

    Start-up (``record_plain``'s ``startup_*``): a plain run's first readback comes after
    ``burst`` steps (the backend's ``decode_ahead`` where decoding runs ahead on the device, else
    1), and it costs more than those steps at the plain step wherever the device does something
    the first time (on the GPU: recording step tapes and bind groups for a new KV cache, filling
    the pipeline). The plain step is timed on the steps after it; the excess (``startup``) is
    priced into the first round, which records the draft's and the verify pass's tapes in the
    same way, and the excess of a plain run after a round is counted in that round's loss.

    ``decision`` says why the last ``choose()`` chose what it did: "plain: time the plain step",
    "plain: rounds lose", "plain: budget", "round: measure costs", "round: probe", "round: pays",
    "round: fixed length". Time is read by the caller (``record_*``), so tests drive the choice
    with controlled costs.
    """

    PRIOR_ACCEPTANCE, PRIOR_TRIALS = 0.7, 3.0
    DECAY = 0.9
    MARGIN = 1.05
    SAMPLES = 8
    FIRST_PLAIN_RUN, MAX_PLAIN_RUN = 8, 128
    PROBE_SHARE, MAX_LOSS_RUN = 0.02, 1024

    def __init__(self, num_tokens: int | None = None, p_min: float | None = None, *,
                 max_tokens: int = MAX_DRAFT_TOKENS, cost_ratio: float | None = None, burst: int = 1) -> None:
        self.cost_ratio = cost_ratio
        self.burst = int(burst)  # the steps of a plain run's first readback (speculative_step sets it)
        self.adaptive = num_tokens is None
        self.max_tokens = int(max_tokens) if num_tokens is None else int(num_tokens)
        self.p_min = (DEFAULT_DRAFT_P_MIN if self.adaptive else 0.0) if p_min is None else float(p_min)
        self._hits = self.PRIOR_ACCEPTANCE * self.PRIOR_TRIALS
        self._trials = self.PRIOR_TRIALS
        self._goes_on, self._checks = self.PRIOR_TRIALS, self.PRIOR_TRIALS
        self._draft: list[float] = []
        self._verify: dict[int, list[float]] = {}
        self._plain: list[float] = []
        self._startup: list[float] = []  # the excess of plain runs' first readbacks (see the docstring)
        self._after_round = False  # a round came last: the next plain run's start-up is its loss
        self._next_plain_run = self.FIRST_PLAIN_RUN
        self._probe = False
        self._last_round = (0.0, 0)  # (seconds, tokens) of the last round
        self._round_seconds, self._round_tokens = 0.0, 0  # of all rounds
        self._total: int | None = None  # the generation's max_tokens (record_prefill)
        self._catch_up_row = 0.0  # estimated draft seconds per token of a many-token catch-up
        self._held = False  # the budget is spent: no more rounds
        self.decision = ""

    @property
    def acceptance(self) -> float:
        """The current estimate of the probability that a drafted token is accepted."""
        return self._hits / self._trials

    @property
    def continuation(self) -> float:
        """The current estimate of the probability that the draft is confident enough to go on."""
        return self._goes_on / self._checks

    def record_round(self, proposed: int, accepted: int, verify_seconds: float,
                     draft_seconds: float = 0.0, draft_forwards: int = 0, stopped: bool = False) -> None:
        """One round: ``accepted`` of ``proposed`` drafts passed a verify pass of ``proposed + 1``
        rows that took ``verify_seconds``; the draft spent ``draft_seconds`` on ``draft_forwards``
        one-token forwards (0: not a fair sample, e.g. a long catch-up after plain decoding) and
        ``stopped`` early on ``p_min``."""
        trials = accepted + (accepted < proposed)  # the drafts up to and including the first rejection
        decay = self.DECAY**trials
        self._hits = self._hits * decay + accepted
        self._trials = self._trials * decay + trials
        checks = proposed + stopped
        decay = self.DECAY**checks
        self._goes_on = self._goes_on * decay + proposed
        self._checks = self._checks * decay + checks
        if draft_forwards:
            _push(self._draft, draft_seconds / draft_forwards, self.SAMPLES)
        self._last_round = (verify_seconds + draft_seconds, accepted + 1)
        self._after_round = True
        self._round_seconds += verify_seconds + draft_seconds
        self._round_tokens += accepted + 1
        _push(self._verify.setdefault(proposed + 1, []), verify_seconds, self.SAMPLES)

    def record_plain(self, tokens: int, seconds: float, startup_tokens: int = 0,
                     startup_seconds: float = 0.0) -> None:
        """``tokens`` plain decode steps took ``seconds``, of which the first ``startup_tokens``
        (the run's first readback) took ``startup_seconds``: the plain step is timed on the rest,
        and their excess over the plain step is the run's start-up (see the class docstring)."""
        startup_tokens = min(startup_tokens, tokens)
        if tokens > startup_tokens:
            _push(self._plain, (seconds - startup_seconds) / (tokens - startup_tokens), self.SAMPLES)
        if startup_tokens and self._plain:
            excess = max(startup_seconds - startup_tokens * _median(self._plain), 0.0)
            if self._after_round:  # what the last round cost the plain decoding after it
                self._round_seconds += excess
                self._last_round = (self._last_round[0] + excess, self._last_round[1])
            else:
                _push(self._startup, excess, self.SAMPLES)
        self._after_round = False

    @property
    def startup(self) -> float:
        """The measured excess of a plain run's first readback over its steps at the plain step
        (0 before one is measured, and where there is none: the numpy backend)."""
        return _median(self._startup)

    def record_prefill(self, tokens: int, seconds: float, max_tokens: int) -> None:
        """The target prefilled ``tokens`` in ``seconds`` for a generation of ``max_tokens`` tokens:
        the budget the draft's costs are weighed against (``credit``), and, scaled by
        ``cost_ratio``, the estimated cost per token of the draft's own prefill and catch-ups."""
        self._total = int(max_tokens)
        if tokens:
            self._catch_up_row = seconds / tokens * (1.0 if self.cost_ratio is None else self.cost_ratio)

    def credit(self) -> float:
        """Seconds the draft may still lose against plain decoding: ``PROBE_SHARE`` of the whole
        generation's time at the plain step, less what the rounds so far lost (their time, and the
        start-up of the plain runs after them, less their tokens at the plain step; a round that
        won adds its gain). Infinite without a budget (``record_prefill``) and before a plain step
        is timed."""
        if self._total is None or not self._plain:
            return math.inf
        step = _median(self._plain)
        return self.PROBE_SHARE * step * self._total - (self._round_seconds - self._round_tokens * step)

    def round_seconds(self, k: int, catch_up: int = 1) -> float:
        """Estimated time of a round drafting ``k`` tokens after feeding the draft the ``catch_up``
        tokens it has not seen (its whole prompt in the first round): the measured costs where
        there are some, else priors from the plain step and ``cost_ratio``, and before any round
        is timed, the first use's costs (``startup``)."""
        draft_step = self._draft_step()
        feed = draft_step if catch_up <= 2 else max(draft_step, catch_up * self._catch_up_row)
        first_use = 0.0 if self._verify else self.startup
        return feed + (k - 1) * draft_step + self.verify_seconds(k + 1) + first_use

    def verify_seconds(self, rows: int) -> float:
        """Estimated time of a verify pass over ``rows`` rows (before any is timed: a plain step
        and ``VERIFY_ROW_PRIOR`` of one for each extra row)."""
        points = sorted((n, _median(v)) for n, v in self._verify.items())
        if not points:
            return _median(self._plain) * (1 + VERIFY_ROW_PRIOR * (rows - 1))
        if len(points) == 1:  # one length timed: assume each extra row costs VERIFY_ROW_PRIOR of one
            n, t = points[0]
            return t * (1 + VERIFY_ROW_PRIOR * (rows - 1)) / (1 + VERIFY_ROW_PRIOR * (n - 1))
        ns, ts = np.array(points, dtype=np.float64).T
        slope = max(float(np.polyfit(ns, ts, 1)[0]), 0.0)
        return max(float(ts.mean() + slope * (rows - ns.mean())), 0.0)

    def rates(self) -> dict[int, float]:
        """The cost model: expected tokens per second of a round of each length ``1 .. max_tokens``."""
        a, c, step = self.acceptance, self.continuation, self._draft_step()
        out, tokens, drafted, forwards = {}, 1.0, 0.0, 1.0
        for k in range(1, self.max_tokens + 1):
            tokens += (c * a) ** k
            drafted += c**k
            out[k] = tokens / max(forwards * step + self.verify_seconds(1 + drafted), 1e-12)
            forwards += c**k  # the draft feeds token k only if it drafted it and goes on
        return out

    def expected_tokens(self, k: int) -> float:
        """The tokens a round drafting up to ``k`` is expected to produce (the accepted drafts and one)."""
        ca = self.continuation * self.acceptance
        return 1.0 + sum(ca**i for i in range(1, k + 1))

    def _draft_step(self) -> float:
        """The draft's time per forward: measured, else ``cost_ratio`` of a plain step."""
        return _median(self._draft) if self._draft else _median(self._plain) * (self.cost_ratio or 1.0)

    def choose(self, catch_up: int = 1) -> int:
        """The next round's draft length; 0: decode ``plain_run()`` tokens without the draft first.
        ``catch_up``: the tokens the draft has not seen yet (the whole prompt before its first
        round). Sets ``decision`` (see the class docstring)."""
        if not self.adaptive:
            self.decision = "round: fixed length"
            return self.max_tokens
        if self._held:
            self.decision = "plain: budget"
            return 0
        if not self._plain:
            self.decision = "plain: time the plain step"
            return 0
        if not self._verify:
            k, self.decision = min(INITIAL_DRAFT_TOKENS, self.max_tokens), "round: measure costs"
        else:
            rates = self.rates()
            k = max(rates, key=rates.__getitem__)
            if self._probe:
                self._probe, self.decision = False, "round: probe"
            elif rates[k] * _median(self._plain) > self.MARGIN:
                self._next_plain_run, self.decision = self.FIRST_PLAIN_RUN, "round: pays"
            else:
                self.decision = "plain: rounds lose"
                return 0
        # A round measuring or probing risks the worst case (nothing accepted: one token for the
        # round's whole time), one the model expects to pay its expected tokens.
        tokens = self.expected_tokens(k) if self.decision == "round: pays" else 1.0
        if self.round_seconds(k, catch_up) - tokens * _median(self._plain) > self.credit():
            self._held, self.decision = True, "plain: budget"
            return 0
        return k

    def plain_run(self) -> int:
        """Tokens to decode without the draft after ``choose()`` returned 0; then a probe round
        (unless the budget is spent: then every token left, ``sys.maxsize``)."""
        if self._held:
            return sys.maxsize
        if not self._plain:
            return max(self.FIRST_PLAIN_RUN, 2 * self.burst)  # the first run only times the plain step
        run, self._probe = max(self._next_plain_run, self._loss_run()), True
        self._next_plain_run = max(min(2 * run, self.MAX_PLAIN_RUN), run)  # never shorter while losing
        return run

    def _loss_run(self) -> int:
        """The plain run over which the last round's loss is ``PROBE_SHARE`` of the time."""
        seconds, tokens = self._last_round
        step = _median(self._plain)
        lost = seconds - tokens * step
        if lost <= 0 or step <= 0:
            return 0
        return min(math.ceil(lost / (self.PROBE_SHARE * step)), self.MAX_LOSS_RUN)


def step_weights(config) -> int:
    """The weights a decode step reads: the layers' attention and MLP matrices and the LM head
    (an untied one, or the tied embedding table read as one). The ratio of two models' counts
    estimates the ratio of their step times, and (slightly over, the LM head being applied to
    one row) of their prefill times."""
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    head_dim = config.head_dim or config.hidden_size // heads
    attention = config.hidden_size * head_dim * (2 * heads + 2 * kv_heads)  # q, o; k, v
    layers = (attention + 3 * config.hidden_size * config.intermediate_size) * config.num_hidden_layers
    return layers + config.vocab_size * config.hidden_size


def _push(samples: list[float], value: float, limit: int) -> None:
    samples.append(value)
    del samples[:-limit]


def _median(samples: list[float]) -> float:
    return float(np.median(samples)) if samples else 0.0


# ---------------------------------------------------------------- the rounds


def speculative_step(
    target,
    draft,
    prompt_ids: Sequence[int],
    sampler: Sampler,
    rng: np.random.Generator,
    target_cache: KVCache,
    draft_cache: KVCache,
    *,
    max_tokens: int,
    num_draft_tokens: int | None = None,
    draft_p_min: float | None = None,
    logprobs: bool = False,
    on_round: Callable[[int, int, bool], None] | None = None,
    on_plain: Callable[[int], None] | None = None,
    on_decision: Callable[[str], None] | None = None,
    length: DraftLength | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[tuple[int, float | None]]:
    """``(token_id, logprob)`` pairs like ``generate_step``, produced by draft-and-verify rounds.

    Either cache may already hold a prefix of ``prompt_ids`` (the prefix cache); only the rest is
    prefilled. Each round drafts at most ``min(chosen length, tokens left - 1, room left in the
    caches)`` tokens, so no forward computes a token that ``max_tokens`` or the context would
    forbid; the length is ``length``'s choice (default ``DraftLength(num_draft_tokens,
    draft_p_min)``), timed with ``clock``. When it chooses 0, and for a last token that leaves no
    room to draft, tokens come from plain decode steps of the target (``generate_step``'s, running
    ahead where it does) and the draft catches up on them in its next round.
    ``on_round(proposed, accepted, stopped)`` is called once per round, before its tokens are
    yielded (``stopped``: the draft ended it early on ``p_min``), ``on_plain(tokens)`` once per
    plain run, before its last token is yielded, and ``on_decision(text)`` with each choice's
    ``DraftLength.decision`` ("plain: last token" where no room was left to draft). Between rounds, the target's cache holds every
    token but the last one yielded and the draft's cache at most as many.
    """
    if length is None:
        length = DraftLength(num_draft_tokens, draft_p_min)
    seq = [int(t) for t in prompt_ids]
    for cache in (target_cache, draft_cache):
        if cache.offset >= len(seq):
            cache.trim(cache.offset - len(seq) + 1)
    if length.cost_ratio is None:
        length.cost_ratio = step_weights(draft.config) / max(step_weights(target.config), 1)
    # A plain run's first readback: after decode_ahead steps where decoding runs ahead on the device.
    burst = getattr(target.ops, "decode_ahead", 1) if runs_ahead(target.ops, sampler, logprobs) else 1
    length.burst = burst
    started, prefilled = clock(), len(seq) - target_cache.offset
    logits = prefill(target, target_cache, seq[target_cache.offset :])
    token, logprob = choose_token(target, logits, sampler, seq, rng, logprobs=logprobs, step=step_name(0, len(seq)))
    length.record_prefill(prefilled, clock() - started, max_tokens)
    seq.append(token)
    emitted = 1
    yield token, logprob

    on_device = _rounds_on_device(target, draft, sampler, logprobs)
    while True:
        left = max_tokens - emitted
        choice = length.choose(len(seq) - draft_cache.offset)
        k = max(min(choice, left - 1, target_cache.capacity - len(seq), draft_cache.capacity - len(seq) + 1), 0)
        if on_decision is not None:
            on_decision(length.decision if k or choice == 0 else "plain: last token")
        if k == 0:
            # Plain decode steps: the run the length asked for, or the last token (no room to draft).
            # generate_step feeds seq[-1] first; closed after n tokens, its cache holds all but the last.
            n = max(min(length.plain_run() if choice == 0 else 1, left, target_cache.capacity - len(seq) + 1), 1)
            # All n tokens are wanted: run ahead at full speed from the first step (one readback
            # per decode_ahead steps), so the run and the plain step timed on it are plain decoding's.
            plain = generate_step(target, seq, sampler, rng, target_cache, logprobs=logprobs, max_tokens=n,
                                  first_burst=getattr(target.ops, "decode_ahead", 1))
            spent = startup = 0.0
            try:
                for i in range(n):
                    started = clock()
                    token, logprob = next(plain)
                    spent += clock() - started
                    if i == 0:  # the first readback: the first burst's steps
                        startup = spent
                    seq.append(token)
                    emitted += 1
                    if i == n - 1:  # account for the run before its last token leaves
                        length.record_plain(n, spent, min(burst, n), startup)
                        if on_plain is not None:
                            on_plain(n)
                    yield token, logprob
            finally:
                plain.close()
            continue
        started = clock()
        catch_up = len(seq) - draft_cache.offset
        if on_device:
            drafts, choices, drafted = _round_on_device(target, draft, target_cache, draft_cache, seq, k, clock)
            accepted = next((i for i in range(k) if drafts[i] != choices[i]), k)
            out = [(t, None) for t in drafts[:accepted] + [choices[accepted]]]
            forwards, stopped = k, False
        else:
            drafts, draft_probs, forwards, stopped = _propose(draft, draft_cache, seq, k, sampler, rng, length.p_min)
            drafted = clock()
            verify_logits = verify(target, target_cache, seq[-1:] + drafts)
            accepted, out = _accept(target, verify_logits, drafts, draft_probs, seq, sampler, rng, logprobs)
        length.record_round(len(drafts), accepted, clock() - drafted, drafted - started,
                            forwards if catch_up <= 2 else 0, stopped)
        # Both caches now hold seq + drafts[:accepted] at most: forget the rejected positions.
        keep = len(seq) + accepted
        target_cache.trim(target_cache.offset - keep)
        draft_cache.trim(max(draft_cache.offset - keep, 0))
        if on_round is not None:
            on_round(len(drafts), accepted, stopped)
        for token, logprob in out:
            seq.append(token)
            emitted += 1
            yield token, logprob


def _rounds_on_device(target, draft, sampler: Sampler, logprobs: bool) -> bool:
    """Whether a greedy round can stay on the device until its end (`_round_on_device`): both
    models run ahead (``decode_ahead > 1``) on one device, and the target can embed the draft's
    on-device choices behind a CPU-known token (``join_tokens``)."""
    if not sampler.greedy or sampler.needs_full_logits or logprobs:
        return False
    t, d = target.ops, draft.ops
    return (getattr(t, "decode_ahead", 1) > 1 and getattr(d, "decode_ahead", 1) > 1
            and hasattr(t, "join_tokens") and getattr(t, "context", None) is getattr(d, "context", False))


def _round_on_device(
    target, draft, target_cache: KVCache, draft_cache: KVCache, seq: list[int], k: int, clock: Callable[[], float],
) -> tuple[list[int], list[int], float]:
    """A greedy round with one readback: the draft's ``k`` argmax choices feed each other and the
    verify pass over [last token, d1 .. dk] on the device, and the drafts and the target's ``k + 1``
    choices come back together. Returns (drafts, choices, the clock when the drafts were recorded).
    The draft's time is then only its recording (the device runs it behind the CPU); the verify
    time holds the rest, and the verify line fitted over the lengths timed carries the per-draft cost."""
    logits = draft.forward(np.asarray(seq[draft_cache.offset :], dtype=np.int32), draft_cache, logits="last")
    d, t = draft.ops, target.ops
    handles = [d.argmax_ahead(logits)]
    for _ in range(k - 1):
        handles.append(d.argmax_ahead(draft.forward(handles[-1], draft_cache, logits="last")))
    drafted = clock()
    verify_logits = target.forward(t.join_tokens(seq[-1:], handles), target_cache, logits="all")
    choice = t.argmax_ahead(verify_logits)
    if d is t:
        ids = t.read_tokens([*handles, choice])  # one readback: the ring holds them side by side
    else:  # two rings on one device: the first read waits for the verify, the second finds it done
        ids = d.read_tokens(handles) + t.read_tokens([choice])
    drafts = [int(checked_ids(draft, i, "a draft step")[0]) for i in ids[:k]]
    choices = [int(c) for c in checked_ids(target, ids[k], "a speculative verify step")]
    return drafts, choices, drafted


def _propose(
    draft, draft_cache: KVCache, seq: list[int], k: int, sampler: Sampler, rng: np.random.Generator,
    p_min: float = 0.0,
) -> tuple[list[int], list[np.ndarray], int, bool]:
    """Up to k draft tokens, the distribution each was drawn from (when sampling), the number of
    draft forwards run, and whether drafting stopped early: before a token whose top probability
    is below ``p_min`` (checked where the draft's logits are read anyway, so not on a backend
    drafting greedily ahead on the device)."""
    # Catch up on what the draft has not seen: the last token, plus the previous round's last
    # proposal or resampled token when the target accepted everything (or the plain run's tokens).
    logits = draft.forward(np.asarray(seq[draft_cache.offset :], dtype=np.int32), draft_cache, logits="last")
    ops = draft.ops
    if sampler.greedy and not sampler.needs_full_logits and getattr(ops, "decode_ahead", 1) > 1:
        # Each proposal feeds the next on the device (argmax_ahead): k steps, one readback.
        handles = [ops.argmax_ahead(logits)]
        for _ in range(k - 1):
            handles.append(ops.argmax_ahead(draft.forward(handles[-1], draft_cache, logits="last")))
        return [int(checked_ids(draft, ids, "a draft step")[0]) for ids in ops.read_tokens(handles)], [], k, False
    drafts: list[int] = []
    probs: list[np.ndarray] = []
    forwards = 1
    for i in range(k):
        history = seq + drafts
        if sampler.greedy:
            if p_min > 0 and _top_probability(ops.read(logits)[0]) < p_min:
                return drafts, probs, forwards, True
            token, _ = choose_token(draft, logits, sampler, history, rng, step="a draft step")
        else:
            q = sampler.distribution(ops.read(logits)[0], history, step="a draft step")
            if p_min > 0 and float(q.max()) < p_min:
                return drafts, probs, forwards, True
            token = _draw(q, rng)
            probs.append(q)
        drafts.append(token)
        if i + 1 < k:
            logits = draft.forward(np.asarray([token], dtype=np.int32), draft_cache, logits="last")
            forwards += 1
    return drafts, probs, forwards, False


def _top_probability(logits: np.ndarray) -> float:
    """The largest softmax probability of one row of logits."""
    x = logits.astype(np.float64)
    return float(1.0 / np.exp(x - x.max()).sum())


def _accept(
    target,
    logits,
    drafts: list[int],
    draft_probs: list[np.ndarray],
    seq: list[int],
    sampler: Sampler,
    rng: np.random.Generator,
    logprobs: bool,
) -> tuple[int, list[tuple[int, float | None]]]:
    """How many drafts the target accepts, and the tokens (with logprobs) the round emits."""
    ops, k = target.ops, len(drafts)
    if sampler.greedy and not (sampler.needs_full_logits or logprobs):
        choices = [int(t) for t in checked_ids(target, ops.argmax(logits), "a speculative verify step")]
        accepted = next((i for i in range(k) if drafts[i] != choices[i]), k)
        return accepted, [(t, None) for t in drafts[:accepted] + [choices[accepted]]]

    rows = ops.read(logits)
    out: list[tuple[int, float | None]] = []
    for i in range(k + 1):
        history = seq + drafts[:i]
        if sampler.greedy:  # with a penalty or logprobs: the plain sampler's exact choice
            token, logprob = sampler.sample(rows[i], history, rng, step="a speculative verify step")
            out.append((token, logprob if logprobs else None))
            if i == k or token != drafts[i]:
                return i, out
            continue
        p = sampler.distribution(rows[i], history, step="a speculative verify step")
        if i == k:
            token = _draw(p, rng)  # every draft accepted: the bonus token
        else:
            d, q = drafts[i], draft_probs[i]
            if p[d] >= q[d] or rng.random() * q[d] < p[d]:
                out.append((d, _logprob(rows[i], history, d, sampler) if logprobs else None))
                continue
            residual = np.maximum(p.astype(np.float64) - q, 0.0)
            token = _draw(residual if residual.sum() > 0 else p, rng)
        out.append((token, _logprob(rows[i], history, token, sampler) if logprobs else None))
        return i, out
    raise AssertionError("unreachable")


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw from unnormalised ``probs`` with one ``rng.random()``; never a zero entry."""
    cdf = np.cumsum(probs, dtype=np.float64)
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(index, int(np.flatnonzero(probs)[-1]))


def _logprob(logits: np.ndarray, history: Sequence[int], token: int, sampler: Sampler) -> float:
    """Log-softmax of the penalised logits at ``token``, as ``Sampler.sample`` reports it."""
    x = apply_repetition_penalty(logits, history, sampler.settings.repetition_penalty).astype(np.float64)
    m = x.max()
    return float(x[token] - m - np.log(np.exp(x - m).sum()))
