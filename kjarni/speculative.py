"""Speculative decoding: a small draft model proposes tokens, the target checks them in one pass.

Each round (``speculative_step``):

    draft    proposes k tokens, one forward each, from its OWN KV cache kept across rounds
    target   one forward over [last token, d1 .. dk] (logits="all"): k + 1 distributions
    verify   accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw
             from norm(max(0, p_i - q_i)) instead; when all k pass, draw a bonus token from p_k
    rollback both caches trimmed back past the first rejection (``KVCache.trim``: no copy)

``p`` and ``q`` are the configured sampling distribution (``Sampler.distribution``: repetition
penalty over the history including the tokens accepted so far, temperature, top-k, top-p, min-p)
of the target and the draft, so the output follows the target's distribution exactly (Leviathan
et al. 2023, Chen et al. 2023). Greedy is the special case of one-hot distributions: accept while
the target's argmax agrees, then take the target's argmax, so the output is the target's greedy
output (up to the backend's rounding of a k + 1 row forward against a 1 row one, see
``docs/benchmarks.md``).

Only token ids pass between the two models, so the draft and the target may run on different
backends. The first token of a generation comes from the target's prefill as without a draft.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Iterator, Sequence

import numpy as np

from kjarni.errors import InvalidConfigurationError
from kjarni.ops import KVCache
from kjarni.sampling import Sampler, apply_repetition_penalty

DEFAULT_DRAFT_TOKENS = 4
"""Tokens the draft proposes per round unless chosen; on numpy 8 measured best (docs/benchmarks.md)."""


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


def validate_draft_tokens(num_draft_tokens: object) -> int:
    """``num_draft_tokens`` as an int, or ``InvalidConfigurationError`` unless it is an integer >= 1."""
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, (int, np.integer)) or num_draft_tokens < 1:
        raise InvalidConfigurationError(
            f"num_draft_tokens={num_draft_tokens!r} is out of range: it must be an integer >= 1 (4 is a good start)"
        )
    return int(num_draft_tokens)


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
    num_draft_tokens: int,
    max_tokens: int,
    logprobs: bool = False,
    on_round: Callable[[int, int], None] | None = None,
) -> Iterator[tuple[int, float | None]]:
    """``(token_id, logprob)`` pairs like ``generate_step``, produced by draft-and-verify rounds.

    Either cache may already hold a prefix of ``prompt_ids`` (the prefix cache); only the rest is
    prefilled. Each round proposes ``min(num_draft_tokens, tokens left - 1, room left in the
    caches)`` tokens, so no forward computes a token that ``max_tokens`` or the context would
    forbid. ``on_round(proposed, accepted)`` is called once per round, before its tokens are
    yielded. Between rounds, the target's cache holds every token but the last one yielded and
    the draft's cache at most as many.
    """
    from kjarni.generate import choose_token, prefill, step_name  # generate.py imports this module lazily

    seq = [int(t) for t in prompt_ids]
    for cache in (target_cache, draft_cache):
        if cache.offset >= len(seq):
            cache.trim(cache.offset - len(seq) + 1)
    logits = prefill(target, target_cache, seq[target_cache.offset :])
    token, logprob = choose_token(target, logits, sampler, seq, rng, logprobs=logprobs, step=step_name(0, len(seq)))
    seq.append(token)
    emitted = 1
    yield token, logprob

    while True:
        k = min(
            num_draft_tokens,
            max_tokens - emitted - 1,
            target_cache.capacity - len(seq),
            draft_cache.capacity - len(seq) + 1,
        )
        k = max(k, 0)
        drafts, draft_probs = _propose(draft, draft_cache, seq, k, sampler, rng) if k else ([], [])
        verify_logits = target.forward(np.asarray(seq[-1:] + drafts, dtype=np.int32), target_cache, logits="all")
        accepted, out = _verify(target, verify_logits, drafts, draft_probs, seq, sampler, rng, logprobs)
        # Both caches now hold seq + drafts[:accepted] at most: forget the rejected positions.
        keep = len(seq) + accepted
        target_cache.trim(target_cache.offset - keep)
        draft_cache.trim(max(draft_cache.offset - keep, 0))
        if on_round is not None:
            on_round(k, accepted)
        for token, logprob in out:
            seq.append(token)
            emitted += 1
            yield token, logprob


def _propose(
    draft, draft_cache: KVCache, seq: list[int], k: int, sampler: Sampler, rng: np.random.Generator
) -> tuple[list[int], list[np.ndarray]]:
    """k draft tokens and, when sampling, the distribution each was drawn from."""
    from kjarni.generate import checked_ids, choose_token

    # Catch up on what the draft has not seen: the last token, plus the previous round's last
    # proposal or resampled token when the target accepted everything.
    logits = draft.forward(np.asarray(seq[draft_cache.offset :], dtype=np.int32), draft_cache, logits="last")
    ops = draft.ops
    if sampler.greedy and not sampler.needs_full_logits and getattr(ops, "decode_ahead", 1) > 1:
        # Each proposal feeds the next on the device (argmax_ahead): k steps, one readback.
        handles = [ops.argmax_ahead(logits)]
        for _ in range(k - 1):
            handles.append(ops.argmax_ahead(draft.forward(handles[-1], draft_cache, logits="last")))
        return [int(checked_ids(draft, ids, "a draft step")[0]) for ids in ops.read_tokens(handles)], []
    drafts: list[int] = []
    probs: list[np.ndarray] = []
    for i in range(k):
        history = seq + drafts
        if sampler.greedy:
            token, _ = choose_token(draft, logits, sampler, history, rng, step="a draft step")
        else:
            q = sampler.distribution(draft.ops.read(logits)[0], history)
            token = _draw(q, rng)
            probs.append(q)
        drafts.append(token)
        if i + 1 < k:
            logits = draft.forward(np.asarray([token], dtype=np.int32), draft_cache, logits="last")
    return drafts, probs


def _verify(
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
    from kjarni.generate import checked_ids

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
            token, logprob = sampler.sample(rows[i], history, rng)
            out.append((token, logprob if logprobs else None))
            if i == k or token != drafts[i]:
                return i, out
            continue
        p = sampler.distribution(rows[i], history)
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
    x = apply_repetition_penalty(logits, history, sampler.repetition_penalty).astype(np.float64)
    m = x.max()
    return float(x[token] - m - np.log(np.exp(x - m).sum()))
