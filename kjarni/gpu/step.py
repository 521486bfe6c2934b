"""What a decode step records and hands on: activation handles, the fusions that defer a kernel to
the next op, the per-step uniform and the readback ring of ids chosen on the GPU.

`GpuTensor` is an activation on a pooled buffer; `F16Activations` and `WithF16` carry the f16
rounding a tensor-core product reads. The four pending kinds stand for a result not recorded yet,
so the op that consumes it can do the work while loading its input (one dispatch fewer per layer);
anything else that reads ``buffer`` records the deferred kernel at that point.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from kjarni.backend import DeviceTokens
from kjarni.gpu import sampling as gpu_sampling
from kjarni.gpu.context import Scratch, WgpuContext
from kjarni.gpu.params import STEP

if TYPE_CHECKING:
    from kjarni.gpu.ops import WgpuOps

TOKEN_RING_BYTES = 65536  # argmax_ahead's readback ring: 8192 (id, status) pairs, read before that many more are chosen


def fold(workgroups: int) -> tuple[int, int, int]:
    """A 1-D workgroup count as an (x, y) grid within the 65535-per-dimension limit."""
    x = min(max(workgroups, 1), 32768)
    return x, -(-workgroups // x), 1


class GpuTensor:
    """An activation ``[tokens, features]`` of float32 in a pooled GPU buffer."""

    __slots__ = ("scratch", "buffer", "shape")

    def __init__(self, scratch: Scratch, shape: tuple[int, int]) -> None:
        self.scratch = scratch  # holds the buffer out of the pool while this handle lives
        self.buffer = scratch.buffer
        self.shape = shape

    def __repr__(self) -> str:
        return f"GpuTensor{self.shape}"


class F16Activations(GpuTensor):
    """Activations ``[tokens, features]`` already rounded to f16 for a tensor-core product (what
    matmul_tc_prep.wgsl writes): matmul_tc's silu flag writes them for the down projection
    (`Linear.record_swiglu`), whose linear then skips its prep. Only a linear whose every segment
    runs on tensor cores reads them."""

    __slots__ = ()


class WithF16(GpuTensor):
    """An f32 activation that also holds its f16 rounding (``half``, [tokens, features] of 2
    bytes): what matmul_tc_prep.wgsl would write from it with no norm. attention_combine writes
    both after a tensor-core prefill attention (`GpuTuning.attention_tc_half`), so the o_proj on
    tensor cores reads ``half`` and runs no prep; any other reader uses the f32 ``buffer``."""

    __slots__ = ("half",)

    def __init__(self, scratch: Scratch, half: Scratch, shape: tuple[int, int]) -> None:
        super().__init__(scratch, shape)
        self.half = half  # holds that buffer out of the pool too


class Pending(GpuTensor):
    """A result not recorded yet (see the module's docstring): ``buffer`` and ``scratch`` record
    the deferred kernel (`_materialize`, once) and answer for its output."""

    __slots__ = ()
    what = ""  # the deferred kernel, for repr

    def _materialize(self) -> GpuTensor:
        raise NotImplementedError

    @property  # type: ignore[override]
    def buffer(self) -> Any:
        return self._materialize().buffer

    @property  # type: ignore[override]
    def scratch(self) -> Scratch:
        return self._materialize().scratch

    def __repr__(self) -> str:
        return f"GpuTensor{self.shape} ({self.what} pending)"


class ReducePending(Pending):
    """The output of a tensor-core product split over K whose matmul_reduce is not recorded yet:
    the next linear, when it norms its input for tensor cores (the next layer's qkv after a
    down_proj), records matmul_reduce_prep.wgsl instead, which writes these sums and its f16
    activations in one dispatch (`fuse`, `GpuTuning.tc_reduce_prep`). Anything else that needs the
    values (``buffer``, ``scratch``) records the plain reduce first, at that point of the recording.
    Holds the partials' scratch and the residual until then (a buffer back in the pool could be
    written before the reduce reads it)."""

    __slots__ = ("out", "partials", "residual", "reduce", "fused", "_done")
    what = "matmul_reduce"

    def __init__(self, out: GpuTensor, partials: Scratch, residual: GpuTensor | None, reduce: tuple, fused: tuple) -> None:
        self.out, self.partials, self.residual = out, partials, residual
        self.reduce = reduce  # (pipeline, bind group, grid) of matmul_reduce
        self.fused = fused  # (linear, weight, splits, flags, bias buffer, residual buffer) for matmul_reduce_prep
        self._done = False
        self.shape = out.shape

    def _materialize(self) -> GpuTensor:
        if not self._done:
            pipeline, group, grid = self.reduce
            self.fused[0].context.dispatch_group(pipeline, group, grid)
            self._done = True
            self.partials = self.residual = None  # read by the recorded reduce: back to the pool
        return self.out

    def fuse(self, norm_weight: Any, eps: float) -> F16Activations:
        """Records the sums and, from them, the f16 activations of a product normed by
        ``norm_weight`` (matmul_reduce_prep.wgsl); the values are the reduce's and the prep's bit
        for bit."""
        if self._done:
            raise RuntimeError("ReducePending.fuse after the reduce was recorded")
        self._done = True
        a = self.fused[0].record_reduce_prep(self, norm_weight, eps)
        self.partials = self.residual = None
        return a

    @property
    def pending(self) -> bool:
        return not self._done


class SiluMulPending(Pending):
    """``silu_mul(source)`` not computed yet: the next `linear` reads ``[gate | up]`` and applies
    it while loading x (``LINEAR_SILU``), saving a dispatch per layer. Anything else that needs the
    values (``buffer``, ``scratch``) runs the silu_mul kernel first, at that point of the recording."""

    __slots__ = ("source", "_ops", "_done")
    what = "silu_mul"

    def __init__(self, ops: WgpuOps, source: GpuTensor) -> None:
        self.source = source
        self._ops = ops
        self._done: GpuTensor | None = None
        self.shape = (source.shape[0], source.shape[1] // 2)

    def _materialize(self) -> GpuTensor:
        if self._done is None:
            self._done = self._ops._silu_mul_now(self.source)
        return self._done



class RopePending(Pending):
    """``rope_store(qkv, ...)`` of one token not recorded yet: the next `attention` on it runs
    attention_step.wgsl, which rotates q and k, stores k and v and attends in one dispatch. Anything
    else that reads q (``buffer``, ``scratch``) records rope_store at that point (storing the same
    k and v again is harmless), and a handle dropped with nothing stored records it then, so the
    cache always receives the token's keys and values."""

    __slots__ = ("qkv", "rope", "kv_cache", "layer", "start", "stored", "_ops", "_done")
    what = "rope_store"

    def __init__(self, ops: WgpuOps, qkv: GpuTensor, rope, kv_cache, layer: int, start: int, width: int) -> None:
        self.qkv, self.rope, self.kv_cache, self.layer, self.start = qkv, rope, kv_cache, layer, start
        self.stored = False  # attention_step has written k and v
        self._ops = ops
        self._done: GpuTensor | None = None
        self.shape = (1, width)

    def _materialize(self) -> GpuTensor:
        if self._done is None:
            self._done = self._ops._rope_store_now(self.qkv, self.rope, self.kv_cache, self.layer, self.start)
            self.stored = True
        return self._done

    def __del__(self) -> None:
        if not self.stored:
            self._materialize()



class AttentionPartials(Pending):
    """The output of a split attention_step not merged yet: ``partials`` holds, per head, ``splits``
    runs of ``hd4`` vec4 outputs then (m, l). The next one-token `linear` merges them while loading
    x (matvec.tmpl.wgsl, flag ``attn``), saving a dispatch; anything else that reads the values
    (``buffer``, ``scratch``) runs attention_combine first, at that point of the recording."""

    __slots__ = ("partials", "splits", "hd4", "_ops", "_done")
    what = "attention merge"

    def __init__(self, ops: WgpuOps, partials: Scratch, width: int, splits: int, hd4: int) -> None:
        self.partials, self.splits, self.hd4 = partials, splits, hd4
        self._ops = ops
        self._done: GpuTensor | None = None
        self.shape = (1, width)

    def _materialize(self) -> GpuTensor:
        if self._done is None:
            self._done = self._ops._merge_attention(self)
        return self._done



class GpuTokens(DeviceTokens):
    """Ids chosen by `WgpuOps.argmax_ahead` or `sample_ahead`: ``buffer`` holds them for the next
    embed, then a status per id; a copy of both waits at ``ring_offset`` of the readback ring for
    `WgpuOps.read_tokens`."""

    __slots__ = ("scratch", "buffer", "ring_offset")

    def __init__(self, scratch: Scratch, count: int, ring_offset: int) -> None:
        super().__init__(count)
        self.scratch = scratch
        self.buffer = scratch.buffer
        self.ring_offset = ring_offset


class StepStart:
    """The per-step uniform holding ``start`` (packed once per step, shared by every layer)."""

    def __init__(self, context: WgpuContext) -> None:
        self.context = context
        self.start = -1
        self._bytes = b""

    def buffer(self, start: int) -> Any:
        if start != self.start:
            self.start, self._bytes = start, STEP.pack(start=start)
        return self.context.step_buffer("start", self._bytes)


class TokenRing:
    """The readback ring of ids chosen on the GPU: `push` copies a step's ids there and submits,
    `read` fetches a burst of them in one readback."""

    def __init__(self, context: WgpuContext) -> None:
        self.context = context
        self.buffer: Any = None  # allocated on first use; `WgpuOps.close` frees it
        self._cursor = 0

    def push(self, out: Scratch, tokens: int) -> GpuTokens:
        """Copies ``out`` ([tokens] ids, then [tokens] statuses) into the ring and submits."""
        ctx = self.context
        if self.buffer is None:
            self.buffer = ctx.storage(TOKEN_RING_BYTES, "token ring")
        if self._cursor + 8 * tokens > TOKEN_RING_BYTES:
            self._cursor = 0
        ctx.copy(out.buffer, 0, self.buffer, self._cursor, 8 * tokens)
        handle = GpuTokens(out, tokens, self._cursor)
        self._cursor += 8 * tokens
        ctx.flush()
        return handle

    def read_later(self, handles: Sequence[GpuTokens]) -> Callable[[], list[np.ndarray]]:
        """`read`, started now and waited for by the returned function (`WgpuContext.read_later`);
        where the ring wrapped between the handles, read now."""
        counts, offsets = [len(h) for h in handles], [h.ring_offset for h in handles]
        if not handles or not _adjacent(counts, offsets):
            ids = self.read(handles)
            return lambda: ids
        wait = self.context.read_later(self.buffer, offsets[0], 8 * sum(counts))
        return lambda: gpu_sampling.decode_ring(np.frombuffer(wait(), dtype=np.uint32), counts)

    def read(self, handles: Sequence[GpuTokens]) -> list[np.ndarray]:
        """The ids of ``handles`` in one readback (`gpu_sampling.decode_ring`)."""
        if not handles:
            return []
        ring, counts = self.buffer, [len(h) for h in handles]
        offsets = [h.ring_offset for h in handles]
        read = self.context.read
        if _adjacent(counts, offsets):
            data = read(ring, offsets[0], 8 * sum(counts))
        else:  # the ring wrapped between them
            data = b"".join(read(ring, offset, 8 * count) for offset, count in zip(offsets, counts))
        return gpu_sampling.decode_ring(np.frombuffer(data, dtype=np.uint32), counts)


def _adjacent(counts: list[int], offsets: list[int]) -> bool:
    """Whether handles of ``counts`` ids at ring ``offsets`` lie back to back (the ring did not wrap)."""
    return all(offsets[i + 1] == offsets[i] + 8 * counts[i] for i in range(len(offsets) - 1))


def new_tensor(context: WgpuContext, tokens: int, features: int) -> GpuTensor:
    """A fresh ``[tokens, features]`` activation on a pooled buffer."""
    return GpuTensor(context.scratch(tokens * features * 4), (tokens, features))
