"""The generation loop's top: token sources stacked under the stop rules.

    generate_step                endless (token_id, logprob) pairs: every token is fed back (decode.py)
    speculative_step             the same pairs from draft-and-verify rounds (speculative.py)
    stream_generate              TokenEvents: detokenizer, stop rules, stats (the ONE place
                                 where generation ends: eos, max_tokens, context, stop strings),
                                 over whichever of the two token sources the call asks for

Data flows one way: stream.py -> speculative.py -> decode.py (the forward phases and token choice).
A KV cache is allocated once per generation unless the caller passes one or a ``PrefixCache``
lends its own (prefix_cache.py).
"""

from __future__ import annotations

import time
from dataclasses import MISSING, dataclass, field, fields
from typing import Iterator, Sequence

import numpy as np

from kjarni.backend import KVCache
from kjarni.decode import generate_step
from kjarni.detokenizer import StopStrings, StreamingDetokenizer
from kjarni.errors import ContextOverflowError, InvalidConfigurationError
from kjarni.prefix_cache import PrefixCache
from kjarni.sampler import Sampler
from kjarni.settings import GenerationParams
from kjarni.speculative import speculative_step, validate_draft_p_min, validate_draft_tokens


@dataclass(frozen=True)
class TokenEvent:
    """One generated token.

    ``text`` is the new visible text this token completes (may be empty: special tokens, half a
    UTF-8 character, text held back as a possible stop string). ``logprob`` is the model's
    log-probability of the token (log-softmax of the penalised logits), or None when the loop did
    not read the vocabulary. ``finish_reason`` is set on the last event only: ``"eos"`` (an end
    token: its text is only what was still held back), ``"length"`` (max_tokens), ``"stop"`` (a stop
    string completed: ``text`` ends before it) or ``"context"`` (prompt plus output fill the context).
    """

    token_id: int
    text: str
    is_special: bool
    logprob: float | None
    finish_reason: str | None = None


@dataclass
class GenerationStats:
    """Counts and timings of one generation, filled in while it runs.

    ``prefill_seconds`` covers the prompt forward and the first token; ``decode_seconds`` every
    later token; ``tokens_per_second`` is decode speed (tokens after the first / decode_seconds).
    Time the consumer spends between tokens is not counted. ``cached_prompt_tokens`` is how much
    of the prompt a passed cache (or the prefix cache) already held.

    With a draft model: ``rounds`` verify passes of the target, ``draft_tokens_proposed`` and
    ``draft_tokens_accepted`` over all of them, ``acceptance_rate`` = accepted / proposed and
    ``tokens_per_round`` = tokens the rounds produced (accepted drafts plus one each) / rounds.
    The draft length is reported as ``draft_length`` (drafted tokens per round, on average),
    ``draft_lengths`` ({drafted tokens: rounds}), ``draft_stops`` (rounds the draft ended early,
    its top probability below ``draft_p_min``) and ``plain_tokens`` (tokens from plain decode
    steps: where the adaptive length found that speculation did not pay, and a last token that
    left no room to draft), and ``draft_decisions`` ({decision: times}: why each round was drafted
    or each plain run decoded, e.g. ``"plain: budget"`` where the tokens left could not repay
    the draft's prefill or a probe; ``speculative.DraftLength``). The first token comes
    from the prefill and is in no round. All of these stay 0 (empty) without a draft.
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    tokens_per_second: float = 0.0
    finish_reason: str | None = None
    cached_prompt_tokens: int = 0
    rounds: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    acceptance_rate: float = 0.0
    tokens_per_round: float = 0.0
    draft_length: float = 0.0
    draft_lengths: dict[int, int] = field(default_factory=dict)
    draft_stops: int = 0
    plain_tokens: int = 0
    draft_decisions: dict[str, int] = field(default_factory=dict)

    def count_round(self, proposed: int, accepted: int, stopped: bool = False) -> None:
        """Add one speculative round: ``proposed`` draft tokens, ``accepted`` of them kept;
        ``stopped``: the draft ended the round early."""
        self.rounds += 1
        self.draft_tokens_proposed += proposed
        self.draft_tokens_accepted += accepted
        self.draft_stops += stopped
        self.draft_lengths[proposed] = self.draft_lengths.get(proposed, 0) + 1
        if self.draft_tokens_proposed:
            self.acceptance_rate = self.draft_tokens_accepted / self.draft_tokens_proposed
        self.tokens_per_round = (self.draft_tokens_accepted + self.rounds) / self.rounds
        self.draft_length = self.draft_tokens_proposed / self.rounds

    def count_plain(self, tokens: int) -> None:
        """Add ``tokens`` decoded by plain decode steps, without the draft."""
        self.plain_tokens += tokens

    def count_decision(self, decision: str) -> None:
        """Add one of the draft length's choices (``speculative.DraftLength.decision``)."""
        self.draft_decisions[decision] = self.draft_decisions.get(decision, 0) + 1


# ---------------------------------------------------------------- the stop rules


def stream_generate(
    model,
    tokenizer,
    prompt_ids: Sequence[int],
    params: GenerationParams,
    kv_cache: KVCache | None = None,
    stats: GenerationStats | None = None,
    *,
    prefix_cache: PrefixCache | None = None,
    draft=None,
    num_draft_tokens: int | None = None,
    draft_p_min: float | None = None,
    draft_cache: KVCache | None = None,
    draft_prefix_cache: PrefixCache | None = None,
) -> Iterator[TokenEvent]:
    """Generate from ``prompt_ids`` (already encoded, BOS included) and yield a ``TokenEvent`` per token.

    This is where generation ends, in this priority: an eos id (``"eos"``), a completed stop string
    (``"stop"``), ``max_tokens`` (``"length"``), prompt plus output filling the context or the cache
    (``"context"``). Text held back (half a character, a possible stop-string start) is flushed
    into the last event. The cache is allocated here with capacity
    ``min(context, prompt + max_tokens)`` unless ``kv_cache`` is given (its first ``offset``
    positions are taken to hold the prompt's first tokens) or ``prefix_cache`` lends one: then only
    the part of the prompt the prefix cache does not hold is prefilled, and what this generation
    fed is remembered for the next call when it ends (however it ends). A prompt plus
    ``max_tokens`` too long for the prefix cache is generated in a fresh cache instead, leaving the
    prefix cache as it was. Closing the generator early releases everything it holds. ``stats``,
    if given, is filled in as tokens arrive.

    ``draft`` (a model sharing the vocabulary, on any backend) turns on speculative decoding with
    ``num_draft_tokens`` proposals per round, or (None, the default) a length chosen each round from
    the measured acceptance and costs, falling back to plain decoding when speculation does not pay
    (``speculative.DraftLength``); ``draft_p_min`` ends a round early where the draft's top
    probability is below it (default: ``DEFAULT_DRAFT_P_MIN`` when adaptive, off when fixed). The
    events, stop rules and, for greedy, the tokens are the same as without a draft. ``draft_cache`` / ``draft_prefix_cache`` play the roles of ``kv_cache``
    / ``prefix_cache`` for the draft model. Check tokenizers once at setup with
    ``speculative.check_draft_compatible``.

    Raises ``InvalidConfigurationError`` for an empty prompt, ids outside the vocabulary or
    contradictory arguments, and ``ContextOverflowError`` (naming both lengths) when the prompt
    leaves no room to generate; these are raised by the call itself, before any token (the caches
    are allocated then too).
    """
    prompt = [int(t) for t in prompt_ids]
    if kv_cache is not None and prefix_cache is not None:
        raise InvalidConfigurationError("pass kv_cache or prefix_cache, not both: the prefix cache lends its own")
    if draft is None and (draft_cache is not None or draft_prefix_cache is not None):
        raise InvalidConfigurationError("draft_cache / draft_prefix_cache need a draft model (draft=...)")
    _check_prompt(model, prompt, kv_cache)
    if draft is not None:
        num_draft_tokens = validate_draft_tokens(num_draft_tokens)
        draft_p_min = validate_draft_p_min(draft_p_min)
        _check_draft(model, draft, prompt, draft_cache, draft_prefix_cache)
    if prefix_cache is not None:
        kv_cache = prefix_cache.take(prompt, params.max_tokens)
        if kv_cache is None:
            prefix_cache = None  # too long for it: a fresh cache, the prefix cache left untouched
    if kv_cache is None:
        kv_cache = model.new_cache(min(model.context_size, len(prompt) + params.max_tokens))
    if draft is not None:
        if draft_prefix_cache is not None:
            draft_cache = draft_prefix_cache.take(prompt, params.max_tokens)
            if draft_cache is None:
                draft_prefix_cache = None
        if draft_cache is None:
            draft_cache = draft.new_cache(min(draft.context_size, kv_cache.capacity))
    if stats is None:
        stats = GenerationStats()
    else:  # a reused stats object starts from zero
        for f in fields(GenerationStats):
            setattr(stats, f.name, f.default_factory() if f.default is MISSING else f.default)
    stats.prompt_tokens = len(prompt)
    stats.cached_prompt_tokens = min(kv_cache.offset, len(prompt) - 1)

    rng = np.random.default_rng(params.seed)
    sampler = Sampler(params)
    if draft is None:
        steps = generate_step(
            model, prompt, sampler, rng, kv_cache, logprobs=params.logprobs, max_tokens=params.max_tokens
        )
    else:
        steps = speculative_step(
            model, draft, prompt, sampler, rng, kv_cache, draft_cache,
            num_draft_tokens=num_draft_tokens, draft_p_min=draft_p_min, max_tokens=params.max_tokens,
            logprobs=params.logprobs, on_round=stats.count_round, on_plain=stats.count_plain,
            on_decision=stats.count_decision,
        )
    caches = [(c, kv) for c, kv in ((prefix_cache, kv_cache), (draft_prefix_cache, draft_cache)) if c is not None]
    return _events(model, tokenizer, prompt, params, kv_cache, stats, steps, caches)


def _events(
    model,
    tokenizer,
    prompt: list[int],
    params: GenerationParams,
    kv_cache: KVCache,
    stats: GenerationStats,
    steps: Iterator[tuple[int, float | None]],
    prefix_caches: list,
) -> Iterator[TokenEvent]:
    limit = min(model.context_size, kv_cache.capacity)  # prompt + output may not exceed this
    detokenizer = StreamingDetokenizer(tokenizer)
    stops = StopStrings(params.stop)
    generated_ids: list[int] = []
    try:
        while True:
            started = time.perf_counter()
            token, logprob = next(steps)
            _count(stats, time.perf_counter() - started)
            generated_ids.append(token)
            generated = stats.generated_tokens

            if token in params.eos_token_ids:
                reason, text = "eos", ""
            else:
                text, stopped = stops.feed(detokenizer.add(token))
                reason = "stop" if stopped else None
            if reason is None and generated >= params.max_tokens:
                reason = "length"
            if reason is None and len(prompt) + generated >= limit:
                reason = "context"
            if reason in ("eos", "length", "context"):
                tail, _ = stops.feed(detokenizer.flush())
                text += tail + stops.flush()
            is_special = token in params.eos_token_ids or bool(tokenizer.is_special(token))
            stats.finish_reason = reason
            yield TokenEvent(token, text, is_special, logprob, reason)
            if reason is not None:
                return
    finally:
        steps.close()
        for prefix_cache, _ in prefix_caches:
            prefix_cache.remember(prompt + generated_ids)


def _count(stats: GenerationStats, elapsed: float) -> None:
    stats.generated_tokens += 1
    if stats.generated_tokens == 1:
        stats.prefill_seconds += elapsed
    else:
        stats.decode_seconds += elapsed
    if stats.decode_seconds > 0:
        stats.tokens_per_second = (stats.generated_tokens - 1) / stats.decode_seconds


def _check_prompt(model, prompt: list[int], kv_cache: KVCache | None) -> None:
    if not prompt:
        raise InvalidConfigurationError(
            "the prompt has no tokens; pass at least one token id (the API adds BOS where the model has one)"
        )
    vocab = model.config.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise InvalidConfigurationError(
            f"prompt token id {bad[0]} is outside the vocabulary of {vocab}; encode with this model's tokenizer"
        )
    context = model.context_size if kv_cache is None else min(model.context_size, kv_cache.capacity)
    if len(prompt) >= context:
        where = "context" if kv_cache is None or kv_cache.capacity >= model.context_size else "KV cache capacity"
        raise ContextOverflowError(
            f"the prompt of {len(prompt)} tokens leaves no room to generate in the model's {where} of "
            f"{context} tokens; shorten the prompt (nothing is truncated)",
            tokens=len(prompt),
            context=context,
        )


def _check_draft(model, draft, prompt: list[int], draft_cache, draft_prefix_cache) -> None:
    if draft_cache is not None and draft_prefix_cache is not None:
        raise InvalidConfigurationError("pass draft_cache or draft_prefix_cache, not both")
    if draft.config.vocab_size != model.config.vocab_size:
        raise InvalidConfigurationError(
            f"the draft model has {draft.config.vocab_size} logits per token but the target has "
            f"{model.config.vocab_size}; a draft must share the target's vocabulary"
        )
    context = draft.context_size if draft_cache is None else min(draft.context_size, draft_cache.capacity)
    if len(prompt) >= context:
        raise ContextOverflowError(
            f"the prompt of {len(prompt)} tokens does not fit in the draft model's context of {context} tokens; "
            "shorten the prompt or generate without a draft",
            tokens=len(prompt),
            context=context,
        )
