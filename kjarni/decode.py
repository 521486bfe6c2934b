"""The decode loop's phases, below both plain and speculative decoding (gpt-fast's shape):

    prefill / decode_one_token   one forward each (the part of the prompt not cached; one token)
    verify                       one forward over several tokens, logits for every position
    choose_token                 the next token from a logits activation, reading as little of
                                 it as the sampler allows (``argmax`` or ``top_k`` candidates
                                 where greedy or top-k without a penalty allow)
    generate_step                endless (token_id, logprob) pairs: every token is fed back,
                                 running ahead on the device where the backend can

Every phase raises ``NonFiniteLogitsError`` naming its step when the logits are NaN or inf.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator, Sequence

import numpy as np

from kjarni.backend import UNDECIDED, Activation, KVCache
from kjarni.errors import NonFiniteLogitsError
from kjarni.sampler import FixedDraw, Sampler

MAX_CANDIDATES = 1024
"""Beyond this many top-k candidates the loop reads the whole vocabulary instead (no gain left)."""


def prefill(model, kv_cache: KVCache, prompt_ids: Sequence[int] | np.ndarray) -> Activation:
    """One forward over ``prompt_ids`` at ``kv_cache.offset``; the last position's logits."""
    return model.forward(np.asarray(prompt_ids, dtype=np.int32), kv_cache, logits="last")


def decode_one_token(model, kv_cache: KVCache, token_id: int) -> Activation:
    """One forward of a single token at ``kv_cache.offset``; its logits ``[1, vocab]``."""
    return model.forward(np.asarray([token_id], dtype=np.int32), kv_cache, logits="last")


def verify(model, kv_cache: KVCache, token_ids: Sequence[int]) -> Activation:
    """One forward of ``token_ids`` at ``kv_cache.offset``; the logits of every position ``[n, vocab]``."""
    return model.forward(np.asarray(token_ids, dtype=np.int32), kv_cache, logits="all")


def checked_ids(model, ids: np.ndarray, step: str) -> np.ndarray:
    """``ids`` from ``argmax`` / ``top_k`` / ``read_tokens``; a ``-1`` (a row of NaN or inf logits,
    backend.py) raises ``NonFiniteLogitsError`` naming ``step`` ("the prefill of 5 tokens", "decode step 3")."""
    ids = np.asarray(ids)
    if ids.size and ids.min() < 0:
        raise _non_finite(model, step)
    return ids


def _non_finite(model, step: str) -> NonFiniteLogitsError:
    source = getattr(getattr(model, "config", None), "source", "the model")
    return NonFiniteLogitsError(
        f"the model produced NaN or infinite logits at {step}: the weights of {source} hold NaN/inf or its "
        "hidden states overflowed float32; nothing was generated from them. Check the file (re-download or "
        "re-convert it); `kjarni parity` compares the CPU and GPU backends",
        step=step,
    )


def choose_token(
    model,
    logits: Activation,
    sampler: Sampler,
    history: Sequence[int],
    rng: np.random.Generator,
    *,
    logprobs: bool = False,
    step: str = "a decode step",
) -> tuple[int, float | None]:
    """Pick the next token from a logits activation, reading as little of it as the sampler allows.

    NaN or inf logits raise ``NonFiniteLogitsError`` naming ``step``, on every path.
    """
    ops = model.ops
    fast = not (sampler.needs_full_logits or logprobs)
    if fast and sampler.greedy:
        return int(checked_ids(model, ops.argmax(logits), step)[0]), None
    if fast and sampler.candidate_count <= MAX_CANDIDATES:
        values, ids = ops.top_k(logits, sampler.candidate_count)
        token = sampler.sample_candidates(values[0], checked_ids(model, ids, step)[0], rng, step=step)
        if token is not None:  # None: a tie at the top-k boundary, decided on the full logits
            return token, None
    row = ops.read(logits)[0]
    if not np.isfinite(row).all():
        raise _non_finite(model, step)
    return sampler.sample(row, history, rng, step=step)


def step_name(index: int, prompt_tokens: int) -> str:
    """The forward that produced token ``index`` of a generation: the prefill, then decode steps."""
    return f"the prefill (a prompt of {prompt_tokens} tokens)" if index == 0 else f"decode step {index}"


def generate_step(
    model,
    prompt_ids: Sequence[int],
    sampler: Sampler,
    rng: np.random.Generator,
    kv_cache: KVCache,
    *,
    logprobs: bool = False,
    max_tokens: int | None = None,
    first_burst: int = 1,
) -> Iterator[tuple[int, float | None]]:
    """Endless ``(token_id, logprob)`` pairs; the caller decides when to stop.

    Prefills the part of ``prompt_ids`` not already in ``kv_cache`` (its first ``kv_cache.offset``
    positions are taken to hold ``prompt_ids[:offset]``; a fully cached prompt re-runs its last
    token for logits). Every sampled token is fed back, visible text or not, but only when the
    next one is asked for: stopping costs no wasted forward. Raises ``ContextOverflowError`` from
    the model once the cache is full.

    Greedy decoding on a backend with ``decode_ahead > 1``, and sampling where the backend can
    draw on its device (``samples_ahead``), run ahead instead (`_decode_ahead`): up to
    ``max_tokens`` tokens in all, so a consumer stopping mid-burst (eos, a stop string) leaves
    up to ``2 decode_ahead - 1`` steps computed for nothing (a burst and the next, already
    submitted), and the cache is then trimmed back to what the step-by-step loop would have fed.
    ``first_burst``: the steps of the first burst (1: the first token comes as soon as the
    prefill ends; ``ops.decode_ahead``: full speed from the start, for a caller that wants
    ``max_tokens`` tokens in any case, as a speculative plain run does).
    """
    prompt = [int(t) for t in prompt_ids]
    if kv_cache.offset >= len(prompt):
        kv_cache.trim(kv_cache.offset - len(prompt) + 1)
    logits = prefill(model, kv_cache, prompt[kv_cache.offset :])
    if runs_ahead(model.ops, sampler, logprobs):
        yield from _decode_ahead(model, kv_cache, logits, prompt, sampler, rng, max_tokens, first_burst)
        return
    history = list(prompt)
    while True:
        step = step_name(len(history) - len(prompt), len(prompt))
        token, logprob = choose_token(model, logits, sampler, history, rng, logprobs=logprobs, step=step)
        history.append(token)
        yield token, logprob
        logits = decode_one_token(model, kv_cache, token)


def runs_ahead(ops, sampler: Sampler, logprobs: bool) -> bool:
    """Whether the backend chooses tokens on its device: greedy without a penalty, or a sampler
    its ``samples_ahead`` accepts (the GPU: top-k, no penalty); never with logprobs."""
    if getattr(ops, "decode_ahead", 1) <= 1 or logprobs:
        return False
    if sampler.greedy:
        return not sampler.needs_full_logits
    return getattr(ops, "samples_ahead", lambda _: False)(sampler)


def _decode_ahead(
    model, kv_cache: KVCache, logits: Activation, prompt: list[int], sampler: Sampler,
    rng: np.random.Generator, max_tokens: int | None, first_burst: int = 1,
) -> Iterator[tuple[int, None]]:
    """Tokens with the choice left on the device: each step embeds the previous step's choice
    (`DeviceTokens`: ``argmax_ahead`` when greedy, else ``sample_ahead`` with the step's
    ``rng.random()``, drawn in the order the step-by-step loop draws) and is submitted at once, so
    the CPU records step n + 1 while the GPU runs step n, and ids are read back once per burst.
    Bursts grow ``first_burst`` (1: the first token comes as soon as the prefill ends), twice
    that .. ``ops.decode_ahead``. While a burst's ids come back (``read_tokens_later``), the next
    burst is already recorded and submitted, so the device never waits for the readback. Steps
    past ``max_tokens`` or the cache are not run ahead; a consumer asking beyond them gets them
    one at a time (and the model's ``ContextOverflowError`` at the end of the cache).

    A draw the device leaves undecided (a tie at the top-k boundary) is made on the CPU from that
    step's logits with the same uniform; the steps run past it are dropped and their uniforms
    reused, so tokens and draws are the step-by-step loop's. Uniforms drawn for steps a consumer
    never asks for are lost: ``rng`` ends up to ``2 decode_ahead - 1`` draws further on."""
    ops = model.ops
    generated: list[int] = []
    spare: deque[float] = deque()  # uniforms of dropped steps, for the steps that replace them

    def choose(step_logits: Activation) -> tuple:  # (handle, logits kept for a CPU draw, uniform)
        if sampler.greedy:
            return ops.argmax_ahead(step_logits), None, None
        draw = spare.popleft() if spare else float(rng.random())
        return ops.sample_ahead(step_logits, sampler, draw), step_logits, draw

    def step_onto(steps: list) -> None:
        """Records (and submits) the next step onto ``steps``."""
        nonlocal last, chosen
        steps.append(choose(model.forward(last, kv_cache)))
        last = steps[-1][0]
        chosen += 1

    def run_ahead(steps: list, size: int) -> None:
        """`step_onto` while ``steps`` holds fewer than ``size`` and each step is sure to be wanted."""
        while len(steps) < size and (max_tokens is None or chosen < max_tokens) and kv_cache.offset < kv_cache.capacity:
            step_onto(steps)

    pending = [choose(logits)]  # steps recorded and not yet read back, oldest first
    last, chosen, produced, burst = pending[0][0], 1, 0, max(min(first_burst, ops.decode_ahead), 1)
    reading = None  # the ids of the burst coming back, while it has not been waited for
    try:
        while True:
            run_ahead(pending, burst)
            if not pending:  # past max_tokens or the cache: one step for a consumer asking on
                step_onto(pending)
            batch, pending = pending, []
            reading = ops.read_tokens_later([handle for handle, _, _ in batch])
            burst = min(2 * burst, ops.decode_ahead)
            run_ahead(pending, burst)  # the next burst runs while this one's ids come back
            ids_list, reading = reading(), None
            for i, ids in enumerate(ids_list):
                token = int(ids[0])
                undecided = token == UNDECIDED
                if undecided:
                    _, step_logits, draw = batch[i]
                    token, _ = sampler.sample(ops.read(step_logits)[0], prompt + generated, FixedDraw(draw),
                                              step=step_name(produced, len(prompt)))
                    spare.extendleft(reversed([d for _, _, d in batch[i + 1 :] + pending]))
                    kv_cache.trim(kv_cache.offset - (len(prompt) + produced))  # what fed this step
                    last, chosen, pending = [token], produced + 1, []
                else:
                    checked_ids(model, ids, step_name(produced, len(prompt)))
                generated.append(token)
                produced += 1
                yield token, None
                if undecided:
                    break
    finally:
        if reading is not None:
            reading()  # its staging buffer back to the device's pool
        # The step-by-step loop has fed every token but the last one it yielded.
        kv_cache.trim(kv_cache.offset - (len(prompt) + max(produced, 1) - 1))
