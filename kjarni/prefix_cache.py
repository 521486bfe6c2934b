"""The prefix cache: one KV cache kept across generations, so a prompt only prefills what is new.

A chat replaying its history, or RAG re-sending the same passages, sends prompts that share a long
head with the previous call. ``PrefixCache`` remembers which token ids its KV positions hold (the
last prompt and what was generated after it); ``take`` trims it back to the longest prefix the new
prompt shares and lends it to one generation, which prefills only the rest; ``remember`` records
what that generation left in it.

    cache = PrefixCache(model)                        # allocated once, eagerly
    kv = cache.take(prompt_ids, max_tokens)           # None: does not fit, use a fresh cache
    ... generate with kv (positions < kv.offset already hold prompt_ids[:kv.offset]) ...
    cache.remember(prompt_ids + generated_ids)        # what the generation fed into kv

``stream_generate(..., prefix_cache=cache)`` does the take/remember pair itself.

Positions below the shared prefix are never written by the generation that borrows the cache
(``trim`` only moves ``offset``), so the reused keys and values are byte-identical to what the
earlier call computed, and a tail prefill gets the same logits as the same split done from scratch.
Against one cold prefill of the whole prompt the logits agree to float32 rounding, not bit for bit:
the tail's linears run on fewer rows, and BLAS may pick another kernel, summing in another order,
for another row count (see ``docs/api.md``, the prefix cache). Greedy tokens are the same unless two
top logits lie within that rounding of each other.
"""

from __future__ import annotations

from typing import Sequence

from kjarni.errors import InvalidConfigurationError
from kjarni.backend import KVCache

DEFAULT_PREFIX_CACHE_TOKENS = 4096
"""Tokens a prefix cache holds unless the caller picks a size (clamped to the model's context)."""


class PrefixCache:
    """A KV cache of ``capacity`` positions kept across generations of one model.

    ``capacity`` is clamped to the model's context and allocated at construction (``nbytes``
    reports it). One cache holds one conversation: lend it to one generation at a time.
    """

    def __init__(self, model, capacity: int = DEFAULT_PREFIX_CACHE_TOKENS, *, context_size: int | None = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InvalidConfigurationError(
                f"prefix cache capacity {capacity!r} is out of range: it must be an integer >= 1 (tokens)"
            )
        # The context generations will run in: the model's, or less when the caller clamps it.
        self._context_size = min(model.context_size, context_size or model.context_size)
        self.capacity = min(capacity, self._context_size)
        self.kv_cache: KVCache = model.new_cache(self.capacity)
        self._ids: list[int] = []  # the tokens positions 0 .. len - 1 of kv_cache hold
        self._taken: list[int] = []  # the prompt of the generation the cache is lent to
        self._lent = False

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values, all allocated up front."""
        return int(self.kv_cache.nbytes)

    @property
    def tokens(self) -> int:
        """How many positions currently hold known tokens (reusable by a prompt starting with them)."""
        return len(self._ids)

    @property
    def cached_ids(self) -> tuple[int, ...]:
        """The token ids whose keys and values the cache holds, in order."""
        return tuple(self._ids)

    def take(self, prompt_ids: Sequence[int], max_tokens: int = 0) -> KVCache | None:
        """Lend the cache to a generation of ``prompt_ids``, trimmed to the prefix they share.

        Returns the cache with ``offset`` = the shared prefix length, or None when the prompt plus
        ``max_tokens`` (as far as the model's context allows) does not fit in ``capacity``: the
        caller then prefills from scratch in a cache of its own, and what this cache holds stays
        valid for later calls. Call ``remember`` when the generation is over.
        """
        prompt = [int(t) for t in prompt_ids]
        # A generation may run to min(context, prompt + max_tokens): it must not stop early here.
        needed = min(len(prompt) + max(int(max_tokens), 0), self._context_size)
        if not prompt or len(prompt) >= self.capacity or needed > self.capacity:
            self._lent = False
            return None
        # Leave at least one prompt token to prefill: its logits give the first generated token.
        shared = min(_shared_prefix(self._ids, prompt), len(prompt) - 1)
        self.kv_cache.trim(self.kv_cache.offset - shared)
        self._ids = prompt[:shared]
        self._taken = prompt
        self._lent = True
        return self.kv_cache

    def remember(self, ids: Sequence[int]) -> None:
        """Record that the lent cache's filled positions hold ``ids`` (prompt, then generated tokens).

        ``ids`` may run past what was fed (the last sampled token usually was not): only the first
        ``kv_cache.offset`` count. Positions past ``len(ids)`` (draft tokens a consumer stopped
        before) are forgotten. ``ids`` that do not begin with the prompt given to ``take`` are a
        caller's mistake: only positions before the disagreement are kept. Does nothing when the
        cache was not lent by ``take``.
        """
        if not self._lent:
            return
        self._lent = False
        ids = [int(t) for t in ids]
        agreed = _shared_prefix(ids, self._taken)
        # ids must begin with the prompt that was taken (the generation fed it first); where they
        # do not, only positions before the disagreement are known.
        filled = min(len(ids) if agreed == len(self._taken) else agreed, self.kv_cache.offset)
        self.kv_cache.trim(self.kv_cache.offset - filled)
        self._ids = ids[:filled]

    def clear(self) -> None:
        """Forget everything (the memory stays allocated)."""
        self.kv_cache.trim(self.kv_cache.offset)
        self._ids = []
        self._lent = False

    def __repr__(self) -> str:
        return f"PrefixCache(capacity={self.capacity}, tokens={self.tokens}, nbytes={self.nbytes})"


def _shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
