"""Choosing the next token: a chain of small pure functions over logits, then one draw.

The chain runs in Hugging Face ``generate``'s order (``GenerationMixin._get_logits_processor``
applies the repetition penalty among the processors, then the warpers in this order):

    repetition penalty  ->  temperature  ->  top-k  ->  top-p  ->  min-p  ->  draw

Each filter takes float32 logits ``[vocab]`` and returns a new array with removed tokens set to
``-inf``; none of them mutates its input. Their semantics follow Hugging Face's warpers with
``min_tokens_to_keep=1``:

- ``top_k_filter`` keeps every token whose logit is at least the k-th largest, so ties at the
  boundary are all kept (HF: ``scores < topk(scores, k)[0][..., -1]`` is what gets removed).
- ``top_p_filter`` keeps the smallest prefix of tokens ranked by probability whose mass reaches
  ``p``: a token stays when the mass ranked strictly ahead of it is below ``p`` (HF removes a token
  when the ascending cumulative mass up to it is ``<= 1 - p``, the same set). Equal logits are
  ranked lowest id first, so a tie at the boundary keeps the lower ids (HF leaves this to an
  unstable sort). The top token is always kept.
- ``min_p_filter`` keeps tokens whose probability is at least ``p`` times the largest one.

Probabilities are computed in float64 for exact normalisation and returned as float32. A draw
consumes exactly one ``rng.random()``; greedy decoding (temperature 0) consumes none, takes the
lowest id among equal maxima, and ignores top-k/top-p/min-p (the argmax survives all of them).

Where the filters only need the largest logits (top-k without a repetition penalty), the loop can
ask the backend for ``top_k + 1`` candidates instead of reading the whole vocabulary;
``Sampler.sample_candidates`` then gives exactly the token ``Sampler.sample`` would have drawn
from the full logits with the same generator state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kjarni.errors import NonFiniteLogitsError
from kjarni.settings import GenerationParams


# ---------------------------------------------------------------- filters (pure)


def apply_repetition_penalty(logits: np.ndarray, history: Sequence[int] | np.ndarray, penalty: float) -> np.ndarray:
    """Penalise every token that occurs in ``history`` (prompt and generated ids) once.

    Positive logits are divided by ``penalty`` and negative ones multiplied, so ``penalty > 1``
    always makes a repeated token less likely (CTRL, as in HF's RepetitionPenaltyLogitsProcessor).
    """
    out = np.array(logits, dtype=np.float32, copy=True)
    if penalty == 1.0 or len(history) == 0:
        return out
    ids = np.unique(np.asarray(history, dtype=np.int64))
    scores = out[ids]
    p = np.float32(penalty)
    out[ids] = np.where(scores < 0, scores * p, scores / p)
    return out


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """``logits / temperature`` in float32 (temperature > 0; 0 is handled as greedy upstream)."""
    return (np.asarray(logits, dtype=np.float32) / np.float32(temperature)).astype(np.float32)


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep tokens whose logit is at least the ``k``-th largest (ties at the boundary all stay).

    ``k = 0`` or ``k >= vocab`` keeps everything.
    """
    out = np.array(logits, dtype=np.float32, copy=True)
    if k <= 0 or k >= out.shape[-1]:
        return out
    threshold = np.partition(out, out.shape[-1] - k)[out.shape[-1] - k]
    out[out < threshold] = -np.inf
    return out


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most probable tokens whose probability mass reaches ``p``.

    Ranked by logit, lowest id first among equals; the top token always stays; ``p = 1`` keeps all.
    """
    out = np.array(logits, dtype=np.float32, copy=True)
    if p >= 1.0:
        return out
    ids = np.flatnonzero(np.isfinite(out))
    keep = _top_p_keep(out[ids].astype(np.float64), ids, p)
    removed = np.ones(out.shape[-1], dtype=bool)
    removed[ids[keep]] = False
    out[removed] = -np.inf
    return out


def min_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep tokens whose probability is at least ``p`` times the most probable token's.

    ``p = 0`` keeps everything; the top token always stays.
    """
    out = np.array(logits, dtype=np.float32, copy=True)
    if p <= 0.0:
        return out
    ids = np.flatnonzero(np.isfinite(out))
    keep = _min_p_keep(out[ids].astype(np.float64), p)
    removed = np.ones(out.shape[-1], dtype=bool)
    removed[ids[keep]] = False
    out[removed] = -np.inf
    return out


# The filters and the sampler share these helpers over a compact set of surviving tokens
# (``ids`` ascending, ``values`` their float64 logits): working on the compact set, in the same
# order, is what makes the full-vocabulary path and the top-k-candidates path bit-identical.


def _softmax(values: np.ndarray) -> np.ndarray:
    e = np.exp(values - values.max())
    return e / e.sum()


def _top_p_keep(values: np.ndarray, ids: np.ndarray, p: float) -> np.ndarray:
    probs = _softmax(values)
    order = np.lexsort((ids, -values))  # most probable first, lowest id first among equals
    ranked = probs[order]
    mass_ahead = np.cumsum(ranked) - ranked
    keep = np.zeros(len(values), dtype=bool)
    keep[order[mass_ahead < p]] = True
    keep[order[0]] = True
    return keep


def _min_p_keep(values: np.ndarray, p: float) -> np.ndarray:
    probs = _softmax(values)
    return probs >= p * probs.max()


def _log_softmax_at(logits: np.ndarray, token: int) -> float:
    x = logits.astype(np.float64)
    m = x.max()
    return float(x[token] - m - np.log(np.exp(x - m).sum()))


# ---------------------------------------------------------------- the sampler


@dataclass(frozen=True)
class Sampler:
    """The sampler chain built from one ``GenerationParams``: ``Sampler(params)``, or ``make_sampler``.

    It reads ``temperature``, ``top_k``, ``top_p``, ``min_p`` and ``repetition_penalty`` from
    ``settings`` (validated when they were made): ``temperature = 0`` is greedy, ``top_k = 0``,
    ``top_p = 1`` and ``min_p = 0`` disable their filter, ``repetition_penalty = 1`` the penalty.
    """

    settings: GenerationParams

    @property
    def greedy(self) -> bool:
        return self.settings.greedy

    @property
    def needs_full_logits(self) -> bool:
        """False when the largest logits decide the token: greedy, or top-k, without a penalty.

        Then the loop may ask the backend for ``ops.argmax`` (greedy) or ``ops.top_k`` with
        ``candidate_count`` candidates (``sample_candidates``) instead of reading the vocabulary.
        top-p and min-p after top-k only look at the k survivors, so they do not need the rest.
        """
        if self.settings.repetition_penalty != 1.0:
            return True
        return not (self.greedy or self.settings.top_k > 0)

    @property
    def candidate_count(self) -> int:
        """How many top candidates ``sample_candidates`` wants: one more than ``top_k``, to see ties."""
        return self.settings.top_k + 1

    def distribution(
        self, logits: np.ndarray, history: Sequence[int] | np.ndarray = (), *, step: str = "a sampling step"
    ) -> np.ndarray:
        """The probability of every token, float32 ``[vocab]`` (one-hot on the argmax when greedy).

        NaN or inf logits raise ``NonFiniteLogitsError`` naming ``step`` (here and in ``sample``,
        ``sample_candidates``)."""
        logits = _check_logits(logits, step)
        penalised = apply_repetition_penalty(logits, history, self.settings.repetition_penalty)
        probs = np.zeros(logits.shape[-1], dtype=np.float64)
        if self.greedy:
            probs[int(np.argmax(penalised))] = 1.0
            return probs.astype(np.float32)
        ids, p = self._surviving(penalised)
        probs[ids] = p
        return probs.astype(np.float32)

    def sample(
        self, logits: np.ndarray, history: Sequence[int] | np.ndarray, rng: np.random.Generator, *,
        step: str = "a sampling step",
    ) -> tuple[int, float]:
        """Draw one token from full logits ``[vocab]``; returns ``(token_id, logprob)``.

        ``logprob`` is the model's log-probability of the token: log-softmax of the penalised
        logits, before temperature and filters (what "logprobs" means in OpenAI's API and mlx-lm).
        """
        logits = _check_logits(logits, step)
        penalised = apply_repetition_penalty(logits, history, self.settings.repetition_penalty)
        if self.greedy:
            token = int(np.argmax(penalised))  # first maximum: lowest id wins ties
        else:
            ids, probs = self._surviving(penalised)
            token = int(ids[_draw(probs, rng)])
        return token, _log_softmax_at(penalised, token)

    def sample_candidates(
        self, values: np.ndarray, ids: np.ndarray, rng: np.random.Generator, *, step: str = "a sampling step"
    ) -> int | None:
        """Draw from the backend's ``candidate_count`` largest logits (``ops.top_k``), or None.

        Gives exactly the token ``sample`` would draw from the full logits with the same ``rng``
        state. Returns None, without touching ``rng``, when the candidates cannot decide: a tie at
        the top-k boundary (top-k keeps every tied token, and some may be missing). The caller then
        reads the full logits and calls ``sample``. Only valid when ``needs_full_logits`` is False.
        """
        values = np.asarray(values, dtype=np.float32).reshape(-1)
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if self.needs_full_logits or self.greedy:
            raise ValueError("sample_candidates needs a top-k sampler without a repetition penalty")
        _check_logits(values, step)
        # Scale first: the full path applies top-k to scaled logits, and float32 division can
        # turn two close logits into a tie.
        scaled = apply_temperature(values, self.settings.temperature)
        order = np.lexsort((ids, -scaled))
        scaled, ids = scaled[order], ids[order]
        k = self.settings.top_k
        if len(scaled) > k:
            if scaled[k] == scaled[k - 1]:
                return None
            scaled, ids = scaled[:k], ids[:k]
        finite = np.isfinite(scaled)
        scaled, ids = scaled[finite], ids[finite]
        by_id = np.argsort(ids, kind="stable")
        kept_ids, kept_probs = self._filter_tail(ids[by_id], scaled[by_id])
        return int(kept_ids[_draw(kept_probs, rng)])

    def _surviving(self, penalised: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Ids (ascending) and probabilities of the tokens left after temperature and the filters."""
        scaled = apply_temperature(penalised, self.settings.temperature)
        if self.settings.top_k > 0:
            scaled = top_k_filter(scaled, self.settings.top_k)
        ids = np.flatnonzero(np.isfinite(scaled))
        return self._filter_tail(ids, scaled[ids])

    def _filter_tail(self, ids: np.ndarray, scaled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        values = scaled.astype(np.float64)
        if self.settings.top_p < 1.0:
            keep = _top_p_keep(values, ids, self.settings.top_p)
            ids, values = ids[keep], values[keep]
        if self.settings.min_p > 0.0:
            keep = _min_p_keep(values, self.settings.min_p)
            ids, values = ids[keep], values[keep]
        return ids, _softmax(values)


def make_sampler(
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
) -> Sampler:
    """``Sampler(GenerationParams(...))`` with just the sampling settings (``InvalidConfigurationError``
    names any value out of range)."""
    return Sampler(GenerationParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                    repetition_penalty=repetition_penalty))


class FixedDraw:
    """A stand-in for ``np.random.Generator`` holding one uniform drawn earlier: ``random()`` returns it.

    The GPU draws a token with a uniform taken from the generator when the step was recorded; a
    draw it leaves to the CPU (``kjarni.backend.UNDECIDED``) is made with that same uniform.
    """

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw with one ``rng.random()``; never returns a zero-probability entry."""
    cdf = np.cumsum(probs)
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(index, int(np.flatnonzero(probs)[-1]))


def _check_logits(logits: np.ndarray, step: str) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float32).reshape(-1)
    top = logits.max()
    if not np.isfinite(top):
        raise NonFiniteLogitsError(
            f"the model produced NaN or infinite logits at {step} (largest value {top}): its weights hold "
            "NaN/inf, its hidden states overflowed float32, or the backend is broken; nothing was sampled "
            "from them. Compare against device='cpu' (`kjarni parity`)",
            step=step,
        )
    return logits
