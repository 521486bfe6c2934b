"""Sampling on the GPU: the next token drawn on the device, so sampled decoding runs ahead as greedy does.

After a step's logits, `record_sample` records top_k.wgsl (the sampler's ``top_k + 1`` best
logits; over a large vocabulary its variant that keeps `PER_CHUNK` per interleaved chunk and says
when that may have missed one) and sample.wgsl, which applies temperature, top-p and min-p to those candidates and draws
with the step's uniform ``u``. ``u`` is the ``rng.random()`` numpy's sampler would consume for the
same token, drawn on the CPU in the same order (one per sampled token), so a GPU run and a numpy
run with the same seed give the same tokens wherever their candidates agree: only float32
rounding (numpy computes in float64) can move a draw that falls within about 1e-6 of a boundary
between two tokens. Nothing is read back: the token feeds the next step's embedding on the
device, and `WgpuOps.read_tokens` reads a burst of them at once.

What runs on the device (`runs_on_device`): top-k between 1 and 255, with any temperature, top-p
and min-p, and no repetition penalty. Otherwise the loop reads the logits back every step
(kjarni.decode.choose_token), as it does for ``logprobs``.

Every chosen id carries a status: `NOT_FINITE` when the logits held a NaN or an inf, which
argmax.wgsl and top_k.wgsl detect while ranking (a bad value ranks first), and `UNDECIDED_STATUS`
when a tie at the top-k boundary, or a chunk holding more than `PER_CHUNK` of the best, leaves the
candidates unable to decide (the CPU then draws from the full logits with the same ``u``). `decode_ring` reads them as ops.py's ``-1`` (the loop
raises ``NonFiniteLogitsError`` naming the step) and ``kjarni.backend.UNDECIDED``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from kjarni.errors import InvalidConfigurationError
from kjarni.gpu.params import DRAW, SAMPLE
from kjarni.backend import UNDECIDED

if TYPE_CHECKING:
    from kjarni.gpu.context import Scratch

SAMPLE_KINDS = ("uniform", "uniform", "read", "rw")
MAX_DEVICE_TOP_K = 255  # sample.wgsl holds top_k + 1 candidates, one per thread of its 256
PER_CHUNK = 16  # candidates per chunk of top_k.wgsl's sampling variant (16 rounds instead of top_k + 1)
NOT_FINITE = 1  # statuses written after the ids by argmax.wgsl and sample.wgsl
UNDECIDED_STATUS = 2
_BELOW_ONE = np.nextafter(np.float32(1), np.float32(0))


def runs_on_device(sampler: Any) -> bool:
    """Whether ``sampler`` can draw on the GPU: top-k in 1 .. 255, no repetition penalty."""
    return not sampler.greedy and not sampler.needs_full_logits and 1 <= sampler.settings.top_k <= MAX_DEVICE_TOP_K


def record_sample(ops: Any, logits: Any, sampler: Any, draw: float) -> Scratch:
    """Records the draw of one token from ``logits`` ``[1, vocab]``; returns the (token, status) buffer."""
    if not runs_on_device(sampler):
        raise InvalidConfigurationError(f"{sampler} cannot sample on the GPU; read the logits and sample on the CPU")
    rows, cols = logits.shape
    if rows != 1:
        raise InvalidConfigurationError(f"sample_ahead draws from one row of logits, got {rows}")
    ctx = ops.context
    n = min(sampler.candidate_count, cols)
    chunks = -(-cols // 2048)
    # PER_CHUNK candidates per chunk where the chunks hold several times n between them: a chunk
    # with more of the n best (rare, the chunks are interleaved) makes the draw the CPU's.
    per_chunk = PER_CHUNK if n > PER_CHUNK and chunks * PER_CHUNK >= 4 * n else 0
    candidates = ops._top_k(logits, n, per_chunk)
    settings = sampler.settings
    params = ctx.uniform(
        SAMPLE.pack(n=n, top_k=settings.top_k, temperature=settings.temperature, top_p=settings.top_p,
                    min_p=settings.min_p, flagged=int(per_chunk > 0))
    )
    # float32 rounds draws just below 1 up to 1, which no cumulative weight can exceed.
    u = ctx.step_buffer("draw", DRAW.pack(u=min(np.float32(draw), _BELOW_ONE)))
    out = ctx.scratch(8)
    pipeline = ctx.pipeline("sample", SAMPLE_KINDS, constants=ops._finite_constants())
    ctx.dispatch(pipeline, (params, u, candidates.buffer, out.buffer), (1, 1, 1))
    return out


def decode_ring(words: np.ndarray, counts: Sequence[int]) -> list[np.ndarray]:
    """Ids (int64) per handle from the ring's words: each handle's ``count`` ids, then its
    statuses. A `NOT_FINITE` row reads ``-1`` (ops.py's contract: the loop raises
    ``NonFiniteLogitsError`` naming the step), an `UNDECIDED_STATUS` row ``UNDECIDED``."""
    out: list[np.ndarray] = []
    position = 0
    for count in counts:
        ids = words[position : position + count].astype(np.int64)
        status = words[position + count : position + 2 * count]
        ids[status == NOT_FINITE] = -1
        ids[status == UNDECIDED_STATUS] = UNDECIDED
        out.append(ids)
        position += 2 * count
    return out
