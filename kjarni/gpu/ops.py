"""WgpuOps: the `Ops` contract (kjarni/backend.py) on a WebGPU device, matching NumpyOps.

Every op records dispatches into the context's one command encoder; ``read``, ``argmax`` and
``top_k`` submit it once and read back only what they return, so a decode step (all layers,
final norm, LM head, argmax) is one submit. Activations are `GpuTensor` handles on pooled buffers
that go back to the pool when the handle dies, so a steady decode loop allocates nothing; uniforms
and bind groups are created once per shape and reused.

The work is split by job: kjarni/gpu/upload.py (weights), linear.py (the products and their kernel
choice), attention.py (KV cache, rope_store, attention), step.py (activation handles, the fusions
of a decode step, the token readback ring); the knobs are one `GpuTuning` (tuning.py). This file
holds the small ops (embed, norms, elementwise) and the selection ops (argmax, top_k).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import numpy as np

from kjarni.backend import WeightSource
from kjarni.errors import InvalidConfigurationError
from kjarni.gpu import sampling as gpu_sampling
from kjarni.gpu.attention import Attention, WgpuKVCache
from kjarni.gpu.capture import StepTapes
from kjarni.gpu.context import Scratch, Stats, WgpuContext
from kjarni.gpu.linear import Linear, template_pipeline
from kjarni.gpu.params import ELEMENTWISE, LAYER_NORM, LINEAR, RMS_NORM, ROWS, SELECT, SILU_MUL
from kjarni.gpu.step import AttentionPartials, GpuTensor, GpuTokens, ReducePending, SiluMulPending, StepStart, TokenRing, fold, new_tensor
from kjarni.gpu.tuning import GpuTuning
from kjarni.gpu.upload import GpuWeight, Segment, Uploader

__all__ = ["GpuTensor", "GpuTokens", "GpuWeight", "WgpuKVCache", "WgpuOps"]

EMBED_KINDS = ("uniform", "read", "read", "read", "rw")
SELECT_KINDS = ("uniform", "read", "rw", "rw")
RMS_KINDS = ("uniform", "read", "read", "rw")
LAYER_NORM_KINDS = ("uniform", "read", "read", "read", "rw")
SILU_KINDS = ("uniform", "read", "rw")
ADD_KINDS = ("uniform", "read", "read", "rw")

MAX_TOP_K = 256  # larger k reads the row back and selects on the CPU
_TUNING_FIELDS = frozenset(GpuTuning.field_names())


class WgpuOps:
    """The GPU backend.

    ``weight_format`` says how float weights (safetensors, GGUF F32/F16) are kept: ``"f16"``
    (default), ``"f32"`` (parity with numpy) or ``"q8_0"`` (quantized at load; matrices whose width
    is not a multiple of 32 stay f16). GGUF quantized blocks stay as stored wherever a kernel
    exists, and are converted to ``weight_format`` otherwise. ``kv_format``: ``"f16"`` or ``"f32"``
    (default: f32 with f32 weights, else f16). ``tuning``: the kernel choices (`GpuTuning`; default
    a fresh one with the measured defaults), kept as ``ops.tuning``, whose fields a benchmark or
    test may set before the shapes they steer are first used."""

    name = "gpu"

    def __init__(self, context: WgpuContext | None = None, *, weight_format: str = "f16", kv_format: str | None = None,
                 tuning: GpuTuning | None = None) -> None:
        if weight_format not in ("f16", "f32", "q8_0"):
            raise InvalidConfigurationError(f"weight_format must be 'f16', 'f32' or 'q8_0', not {weight_format!r}")
        kv_format = kv_format or ("f32" if weight_format == "f32" else "f16")
        if kv_format not in ("f16", "f32"):
            raise InvalidConfigurationError(f"kv_format must be 'f16' or 'f32', not {kv_format!r}")
        if tuning is not None and not isinstance(tuning, GpuTuning):
            raise InvalidConfigurationError(f"tuning must be a kjarni.gpu.tuning.GpuTuning, not {type(tuning).__name__}")
        self.context = context if context is not None else WgpuContext()
        self._tuning = tuning if tuning is not None else GpuTuning()
        self.kv_format = kv_format
        self.weight_bytes = 0
        self._uploader = Uploader(self.context, weight_format)
        self._plans: dict[tuple, Any] = {}  # small ops: (pipelines, uniforms, grids) per shape
        self._step = StepStart(self.context)
        self._ring = TokenRing(self.context)
        self.linear_kernels = Linear(self.context, self._tuning)  # kernel choice and recording of products
        self._attention = Attention(self, self._step)
        self.tapes = StepTapes(self)  # decode steps recorded once, then replayed (kjarni/gpu/capture.py)
        self._weights: list[GpuWeight] = []  # what `close` frees: this model's buffers only
        self._kv_caches: weakref.WeakSet[WgpuKVCache] = weakref.WeakSet()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _TUNING_FIELDS:  # the knobs moved to GpuTuning: a write here would change nothing
            raise AttributeError(f"{name} is a GpuTuning field: set ops.tuning.{name} (kjarni/gpu/tuning.py)")
        object.__setattr__(self, name, value)

    @property
    def tuning(self) -> GpuTuning:
        """The kernel choices this backend plans with (set its fields; the object itself is fixed)."""
        return self._tuning

    @property
    def weight_format(self) -> str:
        """How float weights are kept: ``"f16"``, ``"f32"`` or ``"q8_0"`` (applies to later uploads)."""
        return self._uploader.weight_format

    @weight_format.setter
    def weight_format(self, value: str) -> None:
        self._uploader.weight_format = value

    @property
    def decode_ahead(self) -> int:
        """Greedy decode: steps submitted per readback (``tuning.decode_ahead``)."""
        return self._tuning.decode_ahead

    @property
    def stats(self) -> Stats:
        """Dispatch, submit, pipeline and buffer counters of the context (``last_dispatches``: last submit)."""
        return self.context.stats

    # ------------------------------------------------------------------ weights

    def weight(self, parts: WeightSource | Sequence[WeightSource], *, name: str) -> GpuWeight:
        w = self._uploader.weight(parts, name)
        self.weight_bytes += w.nbytes
        self._weights.append(w)
        return w

    def close(self) -> int:
        """Free this model's GPU buffers (weights, KV caches, token ring) and nothing else: the
        context, its device and other models on it keep working. Returns the bytes freed."""
        self.context.collect()
        caches = list(self._kv_caches)
        for cache in caches:
            cache.finalizer.detach()  # freed here, not again when the cache goes
        buffers = [self._ring.buffer, *(b for c in caches for b in (*c.keys, *c.values))]
        for w in self._weights:
            buffers += [w.buffer, *(b for seg in w.segments for b in (seg.w_a, seg.w_b))]
            w.plans.clear()
        self._weights, self._ring.buffer = [], None
        self._kv_caches = weakref.WeakSet()
        self._plans.clear()
        self._attention.plans.clear()
        return self.context.release([b for b in buffers if b is not None and b is not self.context.dummy])

    # ------------------------------------------------------------------ activations

    def _new(self, tokens: int, features: int) -> GpuTensor:
        return new_tensor(self.context, tokens, features)

    def new_kv_cache(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int) -> WgpuKVCache:
        self.context.collect()  # the caches gone since the last one: their buffers, before new ones
        cache = WgpuKVCache(self.context, num_layers, num_kv_heads, head_dim, capacity, self.kv_format)
        self._kv_caches.add(cache)
        return cache

    def embed(self, table: GpuWeight, token_ids: np.ndarray | GpuTokens) -> GpuTensor:
        ctx = self.context
        rows, cols = table.shape
        if isinstance(token_ids, GpuTokens):  # chosen on the GPU by argmax_ahead: in range by construction
            tokens, id_buffer = len(token_ids), token_ids.buffer
        else:
            tokens, id_buffer = int(np.size(token_ids)), self.ids_buffer(table, token_ids)
        out = self._new(tokens, cols)
        for seg in table.segments:
            pipeline = template_pipeline(ctx, "embed", seg.format, EMBED_KINDS)
            params = ctx.uniform(LINEAR.pack(rows=seg.rows, cols=cols, tokens=tokens, row_offset=seg.row_offset))
            ctx.dispatch(pipeline, (params, id_buffer, seg.w_a, seg.w_b, out.buffer), (min(tokens, 65535), 1, 1))
        return out

    def ids_buffer(self, table: GpuWeight, token_ids: np.ndarray) -> Any:
        """The per-step buffer holding ``token_ids`` for `embed` of ``table``, after checking them."""
        ids = np.asarray(token_ids).reshape(-1)
        rows = table.shape[0]
        if ids.size == 0 or ids.min() < 0 or ids.max() >= rows:
            raise InvalidConfigurationError(f"token ids must be in [0, {rows}), got {ids.tolist()[:16]}")
        name = "ids:" + table.name  # one ids buffer per table: GPT-2 gathers token and position rows in the same step
        if self.context._capture is not None:
            self.context._capture.tables[name] = table  # a step tape rewrites it (kjarni/gpu/capture.py)
        return self.context.step_buffer(name, ids.astype(np.uint32).tobytes(), usage=_storage_usage(), capacity=16384)

    def rms_norm(self, x: GpuTensor, weight: GpuWeight, eps: float) -> GpuTensor:
        ctx = self.context
        tokens, cols = x.shape
        out = self._new(tokens, cols)
        pipeline = ctx.pipeline("rms_norm", RMS_KINDS)
        params = ctx.uniform(RMS_NORM.pack(cols=cols, tokens=tokens, eps=eps))
        ctx.dispatch(pipeline, (params, x.buffer, weight.buffer, out.buffer), (tokens, 1, 1))
        return out

    def layer_norm(self, x: GpuTensor, weight: GpuWeight, bias: GpuWeight, eps: float) -> GpuTensor:
        ctx = self.context
        tokens, cols = x.shape
        out = self._new(tokens, cols)
        pipeline = ctx.pipeline("layer_norm", LAYER_NORM_KINDS)
        params = ctx.uniform(LAYER_NORM.pack(cols=cols, tokens=tokens, eps=eps))
        ctx.dispatch(pipeline, (params, x.buffer, weight.buffer, bias.buffer, out.buffer), (tokens, 1, 1))
        return out

    def linear(self, x: GpuTensor, weight: GpuWeight, bias: GpuWeight | None = None, residual: GpuTensor | None = None) -> GpuTensor:
        return self._linear(x, weight, bias, residual, None, 0.0)

    def norm_linear(self, x: GpuTensor, norm_weight: GpuWeight, eps: float, weight: GpuWeight, bias: GpuWeight | None = None) -> GpuTensor:
        return self._linear(x, weight, bias, None, norm_weight, eps)

    def swiglu_mlp(self, x: GpuTensor, norm_weight: GpuWeight, eps: float, gate_up: GpuWeight, down: GpuWeight,
                   residual: GpuTensor | None = None) -> GpuTensor:
        out = self.linear_kernels.record_swiglu(x, norm_weight, eps, gate_up, down, residual)
        if out is None:
            out = self.linear(self.silu_mul(self.norm_linear(x, norm_weight, eps, gate_up)), down, residual=residual)
        return out

    def _linear(self, x, weight, bias, residual, norm_weight, eps) -> GpuTensor:
        return self.linear_kernels.record(x, weight, bias, residual, norm_weight, eps)

    def matvec_config(self, fmt: str, rows: int, cols: int) -> tuple[int, int, int, int] | None:
        """(WG, LANES, R, UN) of matvec.tmpl.wgsl for a one-token product (`Linear.matvec_config`)."""
        return self.linear_kernels.matvec_config(fmt, rows, cols)

    def matmul_config(self, rows: int, tokens: int, cols: int) -> tuple[int, int, int, int, int]:
        """(TM, TN, BK, KSPLIT, NBUF) of the prefill matmul (`Linear.matmul_config`)."""
        return self.linear_kernels.matmul_config(rows, tokens, cols)

    def sgmat_tile(self, seg: Segment, tokens: int, cols: int) -> tuple[int, int, int, int, int] | None:
        """The tensor-core tile of a prefill product, or None for the SIMT kernels (`Linear.sgmat_tile`)."""
        return self.linear_kernels.sgmat_tile(seg, tokens, cols)

    def rope_store(
        self, qkv: GpuTensor, rope: GpuWeight | None, kv_cache: WgpuKVCache, layer: int, start: int
    ) -> GpuTensor:
        return self._attention.rope_store(qkv, rope, kv_cache, layer, start)

    def _rope_store_now(self, qkv: GpuTensor, rope: GpuWeight | None, kv_cache: WgpuKVCache, layer: int, start: int) -> GpuTensor:
        return self._attention.rope_store_now(qkv, rope, kv_cache, layer, start)

    def attention(
        self, q: GpuTensor, kv_cache: WgpuKVCache, layer: int, start: int, window: int | None = None
    ) -> GpuTensor:
        return self._attention.attention(q, kv_cache, layer, start, window)

    def _merge_attention(self, x: AttentionPartials) -> GpuTensor:
        return self._attention.merge(x)

    def silu_mul(self, x: GpuTensor) -> GpuTensor:
        if self._tuning.fuse_silu and type(x) in (GpuTensor, ReducePending):  # the reduce is recorded when the next linear reads it
            return SiluMulPending(self, x)  # the next linear applies it while loading (LINEAR_SILU)
        return self._silu_mul_now(x)

    def _silu_mul_now(self, x: GpuTensor) -> GpuTensor:
        ctx = self.context
        tokens, width = x.shape
        half = width // 2
        key = ("silu_mul", tokens, half)
        plan = self._plans.get(key)
        if plan is None:
            params = ctx.uniform(SILU_MUL.pack(half=half, tokens=tokens))
            plan = self._plans[key] = (ctx.pipeline("silu_mul", SILU_KINDS), params, fold(-(-tokens * half // 64)))
        pipeline, params, grid = plan
        out = self._new(tokens, half)
        ctx.dispatch(pipeline, (params, x.buffer, out.buffer), grid)
        return out

    def gelu(self, x: GpuTensor) -> GpuTensor:
        ctx = self.context
        tokens, width = x.shape
        out = self._new(tokens, width)
        params = ctx.uniform(ELEMENTWISE.pack(count=tokens * width))
        ctx.dispatch(ctx.pipeline("gelu", SILU_KINDS), (params, x.buffer, out.buffer), fold(-(-tokens * width // 64)))
        return out

    def add(self, a: GpuTensor, b: GpuTensor) -> GpuTensor:
        ctx = self.context
        if a.shape != b.shape:
            raise InvalidConfigurationError(f"add: shapes {a.shape} and {b.shape} differ")
        tokens, width = a.shape
        out = self._new(tokens, width)
        params = ctx.uniform(ELEMENTWISE.pack(count=tokens * width))
        buffers = (params, a.buffer, b.buffer, out.buffer)
        ctx.dispatch(ctx.pipeline("add", ADD_KINDS), buffers, fold(-(-tokens * width // 64)))
        return out

    def rows(self, x: GpuTensor, first: int, count: int) -> GpuTensor:
        """Rows ``first .. first + count`` of ``x``: a prefix view of the same buffer, else a new
        activation written by a dispatch (rows.wgsl; not a buffer copy, so a few-token forward
        that keeps only its last row can still be taped: kjarni/gpu/capture.py)."""
        tokens, features = x.shape
        if not (0 <= first and count >= 0 and first + count <= tokens):
            raise InvalidConfigurationError(f"rows {first}..{first + count} outside an activation of {tokens} rows")
        if first == 0 or count == 0:
            return GpuTensor(x.scratch, (count, features))  # a prefix view of the same buffer
        ctx = self.context
        out = self._new(count, features)
        params = ctx.uniform(ROWS.pack(count=count * features, first=first * features))
        ctx.dispatch(ctx.pipeline("rows", SILU_KINDS), (params, x.buffer, out.buffer), fold(-(-count * features // 64)))
        return out

    # ------------------------------------------------------------------ readback

    def read(self, x: GpuTensor) -> np.ndarray:
        tokens, features = x.shape
        data = self.context.read(x.buffer, 0, tokens * features * 4)
        return np.frombuffer(data, dtype=np.float32).reshape(tokens, features).copy()

    def argmax(self, x: GpuTensor) -> np.ndarray:
        tokens = x.shape[0]
        out = self._argmax(x)
        words = np.frombuffer(self.context.read(out.buffer, 0, tokens * 8), dtype=np.uint32)
        return gpu_sampling.decode_ring(words, [tokens])[0]

    def argmax_ahead(self, x: GpuTensor) -> GpuTokens:
        """`argmax` left on the GPU and submitted: a forward can embed the result before the CPU
        reads it (`read_tokens`), so a greedy loop records step n + 1 while the GPU runs step n."""
        return self._ahead(self._argmax(x), x.shape[0])

    def sample_ahead(self, x: GpuTensor, sampler: Any, draw: float) -> GpuTokens:
        """A token drawn on the GPU from the last row of ``x`` with ``sampler`` and the uniform
        ``draw`` (kjarni/gpu/sampling.py), left on the device like `argmax_ahead`. Only for
        samplers `samples_ahead` accepts."""
        return self._ahead(gpu_sampling.record_sample(self, x, sampler, draw), 1)

    def samples_ahead(self, sampler: Any) -> bool:
        """Whether `sample_ahead` can draw for ``sampler`` on the GPU (top-k, no repetition penalty)."""
        return gpu_sampling.runs_on_device(sampler)

    def _ahead(self, out: Scratch, tokens: int) -> GpuTokens:
        """Copies ``out`` ([tokens] ids, then [tokens] statuses) into the readback ring and submits."""
        return self._ring.push(out, tokens)

    def join_tokens(self, first: Sequence[int], handles: Sequence[GpuTokens]) -> GpuTokens:
        """``first`` (ids known on the CPU) then the ids of ``handles``, as one `GpuTokens` that a
        forward can embed before any of them is read back: a speculative round feeds its last
        token and the draft's on-device choices to the verify pass without a readback between.
        Only for embedding: read the ids from ``handles`` (the result is not in the ring)."""
        ctx = self.context
        count = len(first) + sum(len(h) for h in handles)
        out = ctx.scratch(8 * count)
        offset = 4 * len(first)
        if first:
            head = ctx.step_buffer("join", np.asarray(first, dtype=np.uint32).tobytes(), usage=_copy_usage())
            ctx.copy(head, 0, out.buffer, 0, offset)
        for handle in handles:  # each handle's buffer: its ids, then their statuses
            ctx.copy(handle.buffer, 0, out.buffer, offset, 4 * len(handle))
            offset += 4 * len(handle)
        return GpuTokens(out, count, -1)

    def read_tokens_later(self, handles: Sequence[GpuTokens]) -> Callable[[], list[np.ndarray]]:
        """`read_tokens` started now: the returned function waits for the ids, and work submitted
        before it is called runs on the GPU meanwhile (`WgpuContext.read_later`)."""
        return self._ring.read_later(handles)

    def read_tokens(self, handles: Sequence[GpuTokens]) -> list[np.ndarray]:
        """The ids of ``handles`` in one readback: ``-1`` where the logits were not finite,
        ``kjarni.backend.UNDECIDED`` for a draw left to the CPU (`gpu_sampling.decode_ring`)."""
        return self._ring.read(handles)

    def _argmax(self, x: GpuTensor) -> Scratch:
        """Records the argmax of each row of ``x`` into a new ``[2, tokens]`` u32 buffer: the ids,
        then a status per row (`gpu_sampling.NOT_FINITE` where the row holds a NaN or an inf)."""
        ctx = self.context
        tokens, cols = x.shape
        chunks = -(-cols // 2048)
        partial = ctx.scratch(tokens * chunks * 8)
        out = ctx.scratch(tokens * 8)
        params = ctx.uniform(SELECT.pack(cols=cols, tokens=tokens, chunks=chunks, k=1))
        buffers = (params, x.buffer, partial.buffer, out.buffer)
        constants = self._finite_constants()
        ctx.dispatch(ctx.pipeline("argmax", SELECT_KINDS, entry="chunks", constants=constants), buffers, (chunks, tokens, 1))
        ctx.dispatch(ctx.pipeline("argmax", SELECT_KINDS, entry="main", constants=constants), buffers, (1, tokens, 1))
        return out

    def _finite_constants(self) -> dict[str, float] | None:
        return None if self._tuning.finite_check else {"FINITE_CHECK": 0}

    def top_k(self, x: GpuTensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        tokens, cols = x.shape
        k = min(int(k), cols)
        if k < 1:
            raise InvalidConfigurationError(f"top_k needs k >= 1, got {k}")
        if k > MAX_TOP_K:
            logits = self.read(x)
            part = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
            values = np.take_along_axis(logits, part, axis=-1)
            order = np.lexsort((part, -values), axis=-1)
            ids = np.take_along_axis(part, order, axis=-1).astype(np.int64)
            values = np.take_along_axis(logits, ids, axis=-1)
            ids[~np.isfinite(logits).all(axis=-1)] = -1  # as the kernel flags them (ops.py)
            return values, ids
        out = self._top_k(x, k)
        pairs = np.frombuffer(self.context.read(out.buffer, 0, tokens * k * 8), dtype=np.uint32).reshape(tokens, k, 2)
        values, ids = pairs[:, :, 0].copy().view(np.float32), pairs[:, :, 1].astype(np.int64)
        ids[~np.isfinite(values[:, 0])] = -1  # the first pair carries a NaN / inf logit as it is (top_k.wgsl)
        return values, ids

    def _top_k(self, x: GpuTensor, k: int, per_chunk: int = 0) -> Scratch:
        """Records the ``k`` (<= MAX_TOP_K, <= cols) best (value bits, index) pairs of each row into
        a new ``[tokens, k]`` buffer; NaN and inf rank first and the first pair keeps their bits.
        ``per_chunk`` > 0: top_k.wgsl's sampling variant (``per_chunk`` candidates per interleaved
        chunk), with a ``[tokens]`` "incomplete" pair after the ``[tokens, k]`` ones."""
        ctx = self.context
        tokens, cols = x.shape
        chunks = -(-cols // 2048)
        partial = ctx.scratch(tokens * chunks * (per_chunk or k) * 8)
        out = ctx.scratch(tokens * (k + (1 if per_chunk else 0)) * 8)
        params = ctx.uniform(SELECT.pack(cols=cols, tokens=tokens, chunks=chunks, k=k))
        buffers = (params, x.buffer, partial.buffer, out.buffer)
        constants = {**(self._finite_constants() or {}), **({"PER_CHUNK": per_chunk} if per_chunk else {})} or None
        ctx.dispatch(ctx.pipeline("top_k", SELECT_KINDS, entry="chunks", constants=constants), buffers, (chunks, tokens, 1))
        ctx.dispatch(ctx.pipeline("top_k", SELECT_KINDS, entry="main", constants=constants), buffers, (1, tokens, 1))
        return out


def _storage_usage() -> int:
    import wgpu

    return wgpu.BufferUsage.STORAGE


def _copy_usage() -> int:
    import wgpu

    return wgpu.BufferUsage.COPY_SRC
