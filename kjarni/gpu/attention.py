"""Attention on the GPU: the KV cache, rope_store and the attention kernels per case.

`Attention.attention` picks the kernel: a one-token step fused with rope_store (attention_step.wgsl,
optionally split over the keys and merged by the next matvec), one pass over a short context
(attention_single), flash-decoding (attention_decode + attention_combine), and for a prefill the
tensor-core kernel (Dawn) or the register-tiled one (head_dim 64 or 128), or attention_prefill.
The choices read `GpuTuning`.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from kjarni.errors import ContextOverflowError, InvalidConfigurationError, InvalidModelError
from kjarni.gpu import kernels
from kjarni.gpu.context import WgpuContext
from kjarni.gpu.params import ATTENTION, ATTENTION_STEP, ROPE_STORE
from kjarni.gpu.step import AttentionPartials, GpuTensor, RopePending, StepStart, WithF16, fold, new_tensor
from kjarni.gpu.upload import GpuWeight

if TYPE_CHECKING:
    from kjarni.gpu.ops import WgpuOps

ROPE_KINDS = ("uniform", "uniform", "read", "read", "rw", "rw", "rw")
ATTENTION_KINDS = ("uniform", "uniform", "read", "read", "read", "rw")
COMBINE_KINDS = ("uniform", "uniform", "read", "rw")
COMBINE_HALF_KINDS = (*COMBINE_KINDS, "rw")  # attention_combine with the flag half: out16 too

DECODE_CHUNK = 64  # keys per split of attention_decode (its workgroup size)
SINGLE_MAX_KEYS = 2048  # attention_single.wgsl's MAX_KEYS: keys it holds in workgroup memory
SINGLE_WG = 512  # threads of attention_single
STEP_MAX_KEYS = 1024  # attention_step.wgsl's MAX_KEYS
STEP_Q_REGS = 4  # attention_step.wgsl's QMAX: vec4s of q a score lane may hold in registers
ATTENTION_TILED_DEFAULTS = {64: (32, 32), 128: (32, 16)}
"""head_dim -> (query rows a workgroup, keys a tile) of attention_tiled where GpuTuning names none
(`kernels.ATTENTION_TILED_SHAPES`; a device with less workgroup memory takes the first that fits)."""


class WgpuKVCache:
    """Keys and values per layer, ``[kv_heads, capacity, head_dim]`` each (f32 or f16), allocated once."""

    def __init__(self, context: WgpuContext, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, kv_format: str) -> None:
        if head_dim % 4 or head_dim > 256:
            raise InvalidModelError(f"the GPU backend needs head_dim a multiple of 4 and at most 256, got {head_dim}")
        element = 2 if kv_format == "f16" else 4
        layer_bytes = num_kv_heads * capacity * head_dim * element
        if layer_bytes > context.max_binding_size:
            raise InvalidConfigurationError(
                f"a KV cache of {capacity} positions needs {layer_bytes} bytes per layer, more than this GPU's "
                f"binding limit of {context.max_binding_size}; ask for a smaller capacity"
            )
        self.keys = [context.storage(layer_bytes, f"k{i}") for i in range(num_layers)]
        self.values = [context.storage(layer_bytes, f"v{i}") for i in range(num_layers)]
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.capacity = capacity
        self.kv_format = kv_format
        self.offset = 0
        self._nbytes = 2 * num_layers * layer_bytes
        self.tapes: dict = {}  # step tapes recorded on this cache (kjarni/gpu/capture.py)
        # Gone with its last reference: the context frees its buffers at the next collect (the
        # bind groups made for them would keep them on the device otherwise).
        self.finalizer = weakref.finalize(self, context.retire, [*self.keys, *self.values])

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions; returns the new offset."""
        self.offset -= min(max(n, 0), self.offset)
        return self.offset


def _kv_flags(kv_cache: WgpuKVCache) -> tuple[str, ...]:
    return ("kv_f16",) if kv_cache.kv_format == "f16" else ()


class Attention:
    """rope_store and attention of `WgpuOps` (``ops``: the owner of the pending handles it makes),
    with uniforms and pipelines planned once per shape in ``plans``."""

    def __init__(self, ops: WgpuOps, step: StepStart) -> None:
        self.ops = ops
        self.context = ops.context
        self.tuning = ops.tuning
        self.step = step
        self.plans: dict[tuple, Any] = {}

    def rope_store(self, qkv: GpuTensor, rope: GpuWeight | None, kv_cache: WgpuKVCache, layer: int, start: int) -> GpuTensor:
        tokens, width = qkv.shape
        hd, kv = kv_cache.head_dim, kv_cache.num_kv_heads
        heads = (width - 2 * kv * hd) // hd
        if start + tokens > kv_cache.capacity:
            raise ContextOverflowError(
                f"{start + tokens} positions do not fit in a KV cache of {kv_cache.capacity}",
                tokens=start + tokens,
                context=kv_cache.capacity,
            )
        if rope is not None and (rope.kind != "table" or start + tokens > rope.shape[0] or rope.shape[1] > hd):
            raise InvalidConfigurationError(f"rope table {rope.name} {rope.shape} does not cover position {start + tokens - 1}")
        if self.fuses_rope(tokens, start):
            return RopePending(self.ops, qkv, rope, kv_cache, layer, start, heads * hd)  # attention_step does it
        return self.rope_store_now(qkv, rope, kv_cache, layer, start)

    def rope_store_now(self, qkv: GpuTensor, rope: GpuWeight | None, kv_cache: WgpuKVCache, layer: int, start: int) -> GpuTensor:
        ctx = self.context
        tokens, width = qkv.shape
        hd, kv = kv_cache.head_dim, kv_cache.num_kv_heads
        heads = (width - 2 * kv * hd) // hd
        step = self.step.buffer(start)
        rotary_dim = 0 if rope is None else rope.shape[1]
        key = ("rope_store", tokens, heads, kv, hd, kv_cache.capacity, rotary_dim, kv_cache.kv_format)
        plan = self.plans.get(key)
        if plan is None:
            params = ctx.uniform(
                ROPE_STORE.pack(
                    num_heads=heads, num_kv_heads=kv, head_dim=hd, tokens=tokens, capacity=kv_cache.capacity,
                    rotary_dim=rotary_dim,
                )
            )
            pipeline = ctx.pipeline("rope_store", ROPE_KINDS, flags=_kv_flags(kv_cache))
            plan = self.plans[key] = (pipeline, params, fold(-(-tokens * (heads + 2 * kv) * (hd // 2) // 64)))
        pipeline, params, grid = plan
        q = new_tensor(ctx, tokens, heads * hd)
        table = ctx.dummy if rope is None else rope.buffer
        buffers = (params, step, qkv.buffer, table, kv_cache.keys[layer], kv_cache.values[layer], q.buffer)
        ctx.dispatch(pipeline, buffers, grid)
        return q

    def attention(
        self, q: GpuTensor, kv_cache: WgpuKVCache, layer: int, start: int, window: int | None = None
    ) -> GpuTensor:
        ctx, tuning = self.context, self.tuning
        if type(q) is RopePending:
            if q.kv_cache is kv_cache and q.layer == layer and q.start == start and not q.stored:
                return self.attention_step(q, window)
            q = q._materialize()
        tokens, width = q.shape
        hd, kv = kv_cache.head_dim, kv_cache.num_kv_heads
        heads = width // hd
        step = self.step.buffer(start)
        max_splits = -(-kv_cache.capacity // DECODE_CHUNK)
        key = ("attention", tokens, heads, kv, hd, kv_cache.capacity, window or 0)

        def uniform(splits: int) -> Any:  # the attention Params with this stride of split partials
            return ctx.uniform(
                ATTENTION.pack(
                    num_heads=heads, num_kv_heads=kv, head_dim=hd, tokens=tokens, capacity=kv_cache.capacity,
                    max_splits=splits, scale=float(np.float32(1.0 / np.sqrt(hd))), window=window or 0,
                )
            )

        params = self.plans.get(key)
        if params is None:
            params = self.plans[key] = uniform(max_splits)
        flags = _kv_flags(kv_cache)
        out = new_tensor(ctx, tokens, width)
        k_buf, v_buf = kv_cache.keys[layer], kv_cache.values[layer]
        if tokens <= tuning.matvec_max_tokens and self.single_pass(tokens, start, window):
            # Short context: one workgroup per (head, row) over all its keys, one dispatch.
            single = self.plans.get(("attention_single", hd, flags))
            if single is None:
                single = self.plans[("attention_single", hd, flags)] = ctx.pipeline(
                    "attention_single", ATTENTION_KINDS, flags=flags, constants={"HEAD_DIM": hd, "WG": SINGLE_WG}
                )
            ctx.dispatch(single, (params, step, q.buffer, k_buf, v_buf, out.buffer), (heads, tokens, 1))
        elif tokens <= tuning.matvec_max_tokens:
            # Flash-decoding: chunks of DECODE_CHUNK positions in parallel, then one merge.
            partial = ctx.scratch(tokens * heads * max_splits * (hd + 2) * 4)
            decode = ctx.pipeline(
                "attention_decode", ATTENTION_KINDS, flags=flags, constants={"HEAD_DIM": hd, "WG": DECODE_CHUNK}
            )
            splits = -(-(start + tokens) // DECODE_CHUNK)
            ctx.dispatch(decode, (params, step, q.buffer, k_buf, v_buf, partial.buffer), (heads, splits, tokens))
            combine = ctx.pipeline("attention_combine", COMBINE_KINDS, constants={"CHUNK": DECODE_CHUNK})
            ctx.dispatch(combine, (params, step, partial.buffer, out.buffer), (heads, tokens, 1))
        elif (tc := self.tc_shape(hd)) is not None:
            # Tensor cores (Dawn): NW subgroups of MS query rows each, two passes (or one, online)
            # over BKT-key tiles; past `tc_chunk` keys split over workgroups too, as attention_tiled.
            variant = kernels.attention_tc_variant(hd, *tc)
            chunk, splits = self.key_chunk(self.tc_chunk(hd), tokens, heads, hd, start)
            grid = (-(-tokens // (tc[0] * tc[2])), heads, splits)
            tc_flags = (*flags, *(["prefetch"] if tuning.attention_tc_prefetch else []),
                        *(["online"] if tuning.attention_tc_online else []))
            attn = ctx.pipeline(f"attention_tc.{variant}", ATTENTION_KINDS, flags=tc_flags,
                                constants={"CHUNK": chunk} if splits > 1 else None,
                                source=lambda: kernels.template("attention_tc", variant, frozenset(tc_flags)))
            if splits <= 1:
                ctx.dispatch(attn, (params, step, q.buffer, k_buf, v_buf, out.buffer), grid)
                return out
            if tuning.attention_tc_half:  # f16 for o_proj on tensor cores too
                out = WithF16(out.scratch, ctx.scratch(tokens * width * 2), out.shape)
            self.split_keys(attn, uniform(splits), (q.buffer, k_buf, v_buf), out, grid, chunk, start)
        elif tuning.attention_tiled and (shape := self.tiled_shape(hd)) is not None:
            # Register-tiled flash attention: BQ query rows x BKT-key tiles per workgroup; past
            # `attention_tiled_chunk` keys the keys are split over workgroups too (grid z), and
            # attention_combine merges the splits as for flash-decoding.
            # The partials grow with tokens x splits: long prompts take longer chunks (doubling).
            variant = kernels.attention_tiled_variant(hd, *shape)
            chunk, splits = self.key_chunk(tuning.attention_tiled_chunk, tokens, heads, hd, start)
            grid = (-(-tokens // shape[0]), heads, splits)
            tiled = ctx.pipeline(f"attention_tiled.{variant}", ATTENTION_KINDS, flags=flags,
                                 constants={"CHUNK": chunk} if splits > 1 else None,
                                 source=lambda: kernels.template("attention_tiled", variant, frozenset(flags)),
                                 unchecked=tuning.attention_tiled_unchecked)
            if splits <= 1:
                ctx.dispatch(tiled, (params, step, q.buffer, k_buf, v_buf, out.buffer), grid)
                return out
            self.split_keys(tiled, uniform(splits), (q.buffer, k_buf, v_buf), out, grid, chunk, start)
        else:
            # Threads per query row: a power of two dividing hd / 4, within a subgroup.
            dt = 1
            while ctx.has_subgroups and dt < tuning.attention_prefill_lanes and (hd // 4) % (2 * dt) == 0:
                dt *= 2
            rows_per_group = max(1, 256 // dt) if dt > 1 else 32

            def source() -> str:
                # Private arrays cannot be sized by an override: size q and the output row exactly.
                subgroup = frozenset({"subgroup"}) if ctx.has_subgroups else frozenset()
                text = kernels.source("attention_prefill", frozenset(flags) | subgroup)
                text = text.replace("const DT: u32 = 1u;", f"const DT: u32 = {dt}u;")
                return text.replace("const MAX_D4: u32 = 64u;", f"const MAX_D4: u32 = {hd // 4}u;")

            # Past `attention_prefill_chunk` keys, grid z splits them as for attention_tiled.
            chunk, splits = self.key_chunk(tuning.attention_prefill_chunk, tokens, heads, hd, start)
            constants = {"HEAD_DIM": hd, "BQ": rows_per_group, "CHUNK": chunk if splits > 1 else 0}
            prefill = ctx.pipeline("attention_prefill", ATTENTION_KINDS, flags=(*flags, f"lanes{dt}"),
                                   constants=constants, source=source)
            grid = (-(-tokens // rows_per_group), heads, splits)
            if splits <= 1:
                ctx.dispatch(prefill, (params, step, q.buffer, k_buf, v_buf, out.buffer), grid)
            else:
                self.split_keys(prefill, uniform(splits), (q.buffer, k_buf, v_buf), out, grid, chunk, start)
        return out

    def tc_shape(self, hd: int) -> tuple[int, int, int, int] | None:
        """(MS, SG, NW, BKT) of attention_tc for a prefill with head size ``hd``, or None:
        ``attention_tc`` on, ``hd`` in ``attention_tc_head_dims``, a square f16 subgroup-matrix
        configuration (``context.f16_matrix``), a variant of ``hd`` and ``attention_tc_warps`` /
        ``_keys`` (keys falling back to 32) within the device's workgroup memory, and a chunk that
        is a multiple of its keys."""
        tuning, config = self.tuning, self.context.f16_matrix
        if not tuning.attention_tc or config is None or hd not in tuning.attention_tc_head_dims:
            return None
        for bkt in dict.fromkeys((tuning.attention_tc_keys, 32)):
            shape = (hd, *config, tuning.attention_tc_warps, bkt)
            if (shape in kernels.ATTENTION_TC_SHAPES and kernels.attention_tc_bytes(*shape) <= self.context.max_workgroup_storage
                    and self.tc_chunk(hd) % bkt == 0):
                return shape[1:]
        return None

    def tc_chunk(self, hd: int) -> int:
        """Keys a split of attention_tc at head size ``hd``: ``attention_tc_chunk`` (which counts
        them at head size 64) in proportion to ``hd``; 0: no split."""
        return self.tuning.attention_tc_chunk * hd // 64

    def tiled_shape(self, hd: int) -> tuple[int, int] | None:
        """(query rows, keys a tile) of attention_tiled for ``hd``: GpuTuning's
        ``attention_tiled_rows`` / ``_keys`` where they name a tile of ``hd``, else `ATTENTION_TILED_DEFAULTS`, else the first
        tile of `kernels.ATTENTION_TILED_SHAPES` that fits the device's workgroup memory; None
        where none does (attention_prefill runs)."""
        tuning = self.tuning
        shapes = [(bq, bkt) for d, bq, bkt in kernels.ATTENTION_TILED_SHAPES if d == hd]
        wanted = (tuning.attention_tiled_rows, tuning.attention_tiled_keys)
        if wanted not in shapes:  # (0, 0), or a tile of other head sizes only
            wanted = ATTENTION_TILED_DEFAULTS.get(hd, (0, 0))
        limit = self.context.max_workgroup_storage
        for shape in [wanted] + shapes:
            if shape in shapes and kernels.attention_tiled_bytes(hd, *shape) <= limit:
                return shape
        return None

    def fuses_rope(self, tokens: int, start: int) -> bool:
        """Whether rope_store of ``tokens`` at ``start`` waits for the next attention (attention_step)."""
        return tokens == 1 and self.tuning.fuse_rope and start + 1 <= self.step_max_keys()

    def step_splits(self, positions: int) -> int:
        """Workgroups per head of attention_step over ``positions`` keys (a split needs subgroups:
        the o_proj merge): ``attention_step_splits``, doubled while a split would hold more than
        ``attention_step_split_keys`` keys, up to ``attention_step_max_splits``."""
        tuning = self.tuning
        splits = max(1, tuning.attention_step_splits) if self.context.has_subgroups else 1
        if splits > 1 and tuning.attention_step_split_keys > 0:
            while splits * tuning.attention_step_split_keys < positions and splits * 2 <= tuning.attention_step_max_splits:
                splits *= 2
        return splits

    def step_max_keys(self) -> int:
        """Positions up to which a one-token step runs attention_step: ``attention_step_max`` (0:
        as far as the most splits reach, or ``attention_single_max`` unsplit), at most
        STEP_MAX_KEYS a split."""
        tuning = self.tuning
        reach = self.step_splits(1 << 62) * STEP_MAX_KEYS
        if tuning.attention_step_max:
            return min(tuning.attention_step_max, reach)
        return reach if reach > STEP_MAX_KEYS else min(tuning.attention_single_max, reach)

    def single_pass(self, tokens: int, start: int, window: int | None) -> bool:
        """Whether a few-token attention at ``start`` runs attention_single (else flash-decoding)."""
        span = start + tokens if not window else min(start + tokens, window)  # keys a query row sees
        return span <= min(self.tuning.attention_single_max, SINGLE_MAX_KEYS)

    def position_class(self, tokens: int, start: int, windows: Sequence[int | None]) -> tuple:
        """What the recording of ``tokens`` (at most ``matvec_max_tokens``) at ``start`` depends on
        through the position, for layers of the sliding ``windows`` given (None: none): a step
        tape (kjarni/gpu/capture.py) is replayed only at positions of the class it was recorded at.
        Every position-dependent choice of rope_store and attention for so few tokens is one of
        `fuses_rope` (with attention_step's split count), `single_pass` and flash-decoding's split count."""
        if self.fuses_rope(tokens, start):
            return ("step", self.step_splits(start + 1))  # the position is read from the step uniform
        splits = -(-(start + tokens) // DECODE_CHUNK)
        return tuple(0 if self.single_pass(tokens, start, w) else splits for w in dict.fromkeys(windows))

    def key_chunk(self, chunk: int, tokens: int, heads: int, hd: int, start: int) -> tuple[int, int]:
        """(keys per split, splits) of a prefill split over its keys (chunk 0: one split); the
        partials take tokens x heads x splits x (hd + 2) floats, so the chunk doubles until they fit
        in `attention_partial_max_bytes` and one storage binding."""
        if not chunk:
            return 0, 1
        tuning = self.tuning
        fits = min(tuning.attention_partial_max_bytes, self.context.max_binding_size) // (tokens * heads * (hd + 2) * 4)
        while -(-(start + tokens) // chunk) > max(1, fits):
            chunk *= 2
        return chunk, -(-(start + tokens) // chunk)

    def split_keys(self, pipeline: Any, params: Any, inputs: tuple, out: GpuTensor, grid: tuple[int, int, int],
                   chunk: int, start: int) -> None:
        """A prefill kernel over ``grid`` (z: the key splits) into partials, merged into ``out`` by
        attention_combine."""
        ctx = self.context
        tokens, heads = out.shape[0], grid[1]
        hd = out.shape[1] // heads
        partial = ctx.scratch(tokens * heads * grid[2] * (hd + 2) * 4)
        step = self.step.buffer(start)
        ctx.dispatch(pipeline, (params, step, *inputs, partial.buffer), grid)
        if type(out) is WithF16:  # and its f16 rounding
            combine = ctx.pipeline("attention_combine", COMBINE_HALF_KINDS, flags=("half",), constants={"CHUNK": chunk})
            ctx.dispatch(combine, (params, step, partial.buffer, out.buffer, out.half.buffer), (heads, tokens, 1))
            return
        combine = ctx.pipeline("attention_combine", COMBINE_KINDS, constants={"CHUNK": chunk})
        ctx.dispatch(combine, (params, step, partial.buffer, out.buffer), (heads, tokens, 1))

    def attention_step(self, pending: RopePending, window: int | None) -> GpuTensor:
        """rope_store + attention of one token in one dispatch (attention_step.wgsl)."""
        ctx, tuning = self.context, self.tuning
        kv_cache, rope, qkv = pending.kv_cache, pending.rope, pending.qkv
        hd, kv = kv_cache.head_dim, kv_cache.num_kv_heads
        heads = pending.shape[1] // hd
        rotary_dim = 0 if rope is None else rope.shape[1]
        splits = self.step_splits(pending.start + 1)
        key = ("attention_step", heads, kv, hd, kv_cache.capacity, rotary_dim, window or 0, kv_cache.kv_format, splits,
               tuning.attention_step_lean, tuning.attention_step_key_lanes, tuning.attention_step_unchecked,
               tuning.attention_step_q_regs, tuning.attention_step_one_barrier)
        plan = self.plans.get(key)
        if plan is None:
            params = ctx.uniform(ATTENTION_STEP.pack(
                num_heads=heads, num_kv_heads=kv, head_dim=hd, capacity=kv_cache.capacity, rotary_dim=rotary_dim,
                window=window or 0, scale=float(np.float32(1.0 / np.sqrt(hd))),
            ))
            # WG: hd / 4 times a power of two, at most attention_step_threads and the device's limit;
            # KL threads per key in the scores (a divisor of hd / 4; subgroup shuffles).
            most = tuning.attention_split_threads if splits > 1 else tuning.attention_step_threads
            limit = min(most, int(ctx.adapter.limits["max-compute-invocations-per-workgroup"]))
            threads = hd // 4
            while threads * 2 <= limit:
                threads *= 2
            kl = next(k for k in (8, 4, 2, 1) if k <= tuning.attention_step_key_lanes and (hd // 4) % k == 0) \
                if ctx.has_subgroups else 1
            q_regs = tuning.attention_step_q_regs and hd // 4 // kl <= STEP_Q_REGS
            pipeline = ctx.pipeline("attention_step", ROPE_KINDS, flags=_kv_flags(kv_cache),
                                    constants={"HEAD_DIM": hd, "WG": threads, "KL": kl, "SPLITS": splits,
                                               "LEAN": int(tuning.attention_step_lean), "QREG": int(q_regs),
                                               "ONE_BARRIER": int(tuning.attention_step_one_barrier)},
                                    unchecked=tuning.attention_step_unchecked)
            plan = self.plans[key] = (pipeline, params)
        pipeline, params = plan
        if splits > 1:
            partials = ctx.scratch(heads * splits * (hd + 4) * 4)
            out_buffer = partials.buffer
        else:
            out = new_tensor(ctx, 1, heads * hd)
            out_buffer = out.buffer
        table = ctx.dummy if rope is None else rope.buffer
        buffers = (params, self.step.buffer(pending.start), qkv.buffer, table, kv_cache.keys[pending.layer],
                   kv_cache.values[pending.layer], out_buffer)
        ctx.dispatch(pipeline, buffers, (heads, splits, 1))
        pending.stored = True
        if splits > 1:
            return AttentionPartials(self.ops, partials, heads * hd, splits, hd // 4)
        return out

    def merge(self, x: AttentionPartials) -> GpuTensor:
        """attention_combine over a split attention_step's partials (when no matvec merges them)."""
        ctx = self.context
        heads = x.shape[1] // (4 * x.hd4)
        key = ("attention_merge", heads, x.hd4, x.splits)
        plan = self.plans.get(key)
        if plan is None:
            params = ctx.uniform(ATTENTION.pack(num_heads=heads, num_kv_heads=1, head_dim=4 * x.hd4, tokens=1, capacity=0,
                                                max_splits=x.splits, scale=1.0, window=0))
            pipeline = ctx.pipeline("attention_combine", COMBINE_KINDS, constants={"SPLITS": x.splits, "PAD": 4})
            plan = self.plans[key] = (pipeline, params)
        pipeline, params = plan
        out = new_tensor(ctx, 1, x.shape[1])
        ctx.dispatch(pipeline, (params, self.step.buffer(self.step.start), x.partials.buffer, out.buffer), (heads, 1, 1))
        return out
