"""Linear products on the GPU: which kernel each weight segment runs, planned once per use.

`Linear.record` is the hot path of a decode step (4 of its 6 dispatches per layer): everything that
depends only on the shapes and the weight is planned once (`plan`) and kept on the weight; the
bind groups are cached per (x, residual, y) buffers, which repeat step after step (pooled).
`segment_kernel` picks the kernel of one segment: the tensor-core or SIMT matmul for a prefill,
matvec.tmpl.wgsl for one token, linear_body's / quant.py's matrix-vector kernels otherwise. The
choices read `GpuTuning` (kjarni/gpu/tuning.py).
"""

from __future__ import annotations

from typing import Any

from kjarni.errors import InvalidConfigurationError
from kjarni.gpu import kernels
from kjarni.gpu.context import WgpuContext
from kjarni.gpu.params import LINEAR, LINEAR_BIAS, LINEAR_NORM, LINEAR_RESIDUAL, LINEAR_SILU
from kjarni.gpu.step import AttentionPartials, F16Activations, GpuTensor, ReducePending, SiluMulPending, WithF16, fold
from kjarni.gpu.tuning import GpuTuning
from kjarni.gpu.upload import GpuWeight, Segment

LINEAR_KINDS = ("uniform", "read", "read", "read", "read", "read", "read", "rw")
REDUCE_PREP_KINDS = ("uniform", "read", "rw", "read", "read", "read", "read", "rw")  # matmul_reduce_prep: y at 2


def matmul_workgroup_bytes(tm: int, tn: int, bk: int, ksplit: int, nbuf: int = 1) -> int:
    """Workgroup memory of matmul.tmpl.wgsl's tiles: per thread group and buffer, x as BK x
    (2 TM + 1) and W as BK x 2 TN vec4s."""
    return nbuf * ksplit * bk * (2 * tm + 1 + 2 * tn) * 16


def dot_prep_bytes(tokens: int, cols: int) -> int:
    """Bytes of matmul_dot_prep.wgsl's output for ``tokens`` rows of ``cols`` values: the int8
    quants, then a (d, d sum q) f32 pair per 32-value block."""
    return tokens * cols + tokens * (cols // 32) * 8


def template_pipeline(context: WgpuContext, op: str, fmt: str, kinds: tuple[str, ...], constants: dict | None = None,
                      unchecked: bool = False) -> Any:
    """The pipeline of ``shaders/<op>.tmpl.wgsl`` rendered for weight format ``fmt`` (kernels.TEMPLATES),
    named ``<op>.<fmt>`` (``unchecked``: see `WgpuContext.pipeline`)."""

    def source() -> str:
        return kernels.template(op, fmt)

    return context.pipeline(f"{op}.{fmt}", kinds, constants=constants, source=source, unchecked=unchecked)


class Linear:
    """Plans and records ``y = x W^T (+ bias) (+ residual)``, with an optional fused norm of x or
    silu_mul of ``[gate | up]``, on ``context`` as ``tuning`` says."""

    def __init__(self, context: WgpuContext, tuning: GpuTuning) -> None:
        self.context = context
        self.tuning = tuning

    def record(self, x: GpuTensor, weight: GpuWeight, bias: GpuWeight | None, residual: GpuTensor | None,
               norm_weight: GpuWeight | None, eps: float, silu_out: bool = False, glu_out: bool = False) -> GpuTensor:
        """Records the product; ``silu_out`` (from `record_swiglu` only): ``weight`` is [gate | up]
        and the result is silu(gate) up as `F16Activations` (matmul_tc's silu flag); ``glu_out``
        (likewise): the same in float32 from one token's matvec_f16 or matvec_dot (their ``glu`` flag)."""
        ctx = self.context
        tokens = x.shape[0]
        if (type(x) is ReducePending and x.pending and norm_weight is not None and self.tuning.tc_reduce_prep
                and self.all_tc(weight, tokens, x.shape[1])):
            x = x.fuse(norm_weight, eps)  # the previous product's reduce and this one's prep in one dispatch
            norm_weight, eps = None, 0.0
        prepared = type(x) is F16Activations
        # An f32 x with its f16 rounding beside (attention_combine's): read that where a prep would
        # write the same, i.e. no norm and every segment on tensor cores.
        half = type(x) is WithF16 and norm_weight is None and self.all_tc(weight, tokens, x.shape[1])
        prepared = prepared or half
        silu = type(x) is SiluMulPending and self.silu_fusable(weight, tokens)
        attn = None
        if type(x) is AttentionPartials:
            attn = (x.splits, x.hd4)
            fusable = weight.plans.get(("merge", attn))  # whether this weight's matvec merges them, decided once
            if fusable is None:
                fusable = weight.plans[("merge", attn)] = self.merge_fusable(x, weight)
            if not fusable:
                attn = None
        key = (tokens, id(bias), residual is not None, id(norm_weight), eps, silu, attn, prepared, silu_out, glu_out)
        plan = weight.plans.get(key)
        if plan is None:
            plan = weight.plans[key] = self.plan(x.shape, weight, bias, residual, norm_weight, eps, silu, attn, prepared, silu_out,
                                                 glu_out)
        dispatches, groups, rows, common = plan
        x_buffer = x.source.buffer if silu else x.partials.buffer if attn else x.buffer
        if silu_out:  # silu(gate) up in f16: [tokens, rows / 2] of 2 bytes
            out = F16Activations(ctx.scratch(tokens * rows), (tokens, rows // 2))
        elif glu_out:  # silu(gate) up: [tokens, rows / 2] of 4 bytes
            out = GpuTensor(ctx.scratch(tokens * rows * 2), (tokens, rows // 2))
        else:
            out = GpuTensor(ctx.scratch(tokens * rows * 4), (tokens, rows))
        r_buffer = residual.buffer if residual is not None else None
        # Split K (prefill, few tiles): the partial sums go through a scratch of S x [tokens, rows],
        # free again once recorded (later users of the pool write it after the reduce has read it).
        partials = ctx.scratch(common[4]) if common[4] else None
        p_buffer = partials.buffer if partials is not None else None
        # Tensor cores (matmul_tc): x as f16 activations (norm, silu_mul applied), in a scratch
        # free again once recorded, as the partials are.
        a_scratch = ctx.scratch(common[5]) if common[5] else None
        a_buffer = x.half.buffer if half else x.buffer if prepared else a_scratch.buffer if a_scratch is not None else None
        # Integer-dot prefill (matmul_dot): x as int8 quants and block scales, likewise.
        d_scratch = ctx.scratch(common[6]) if common[6] else None
        d_buffer = d_scratch.buffer if d_scratch is not None else None
        bound = groups.get((x_buffer, r_buffer, out.buffer, p_buffer, a_buffer, d_buffer))
        if bound is None:
            bias_buffer, norm_buffer = common[:2]
            dummy, r = ctx.dummy, r_buffer or ctx.dummy
            buffers = {  # per role: bindings 1 .. 7 (x, w_a, w_b, bias, residual, norm_weight, y)
                "out": lambda w_a, w_b: (x_buffer, w_a, w_b, bias_buffer, r, norm_buffer, out.buffer),
                "partial": lambda w_a, w_b: (x_buffer, w_a, w_b, dummy, dummy, norm_buffer, p_buffer),
                "reduce": lambda w_a, w_b: (p_buffer, dummy, dummy, bias_buffer, r, dummy, out.buffer),
                "prep": lambda w_a, w_b: (x_buffer, dummy, dummy, dummy, dummy, norm_buffer, a_buffer),
                "tc": lambda w_a, w_b: (a_buffer, w_a, w_b, bias_buffer, r, dummy, out.buffer),
                "tc_partial": lambda w_a, w_b: (a_buffer, w_a, w_b, dummy, dummy, dummy, p_buffer),
                "dot_prep": lambda w_a, w_b: (x_buffer, dummy, dummy, dummy, dummy, norm_buffer, d_buffer),
                "dot": lambda w_a, w_b: (d_buffer, w_a, w_b, bias_buffer, r, dummy, out.buffer),
                "dot_partial": lambda w_a, w_b: (d_buffer, w_a, w_b, dummy, dummy, dummy, p_buffer),
            }
            bound = groups[(x_buffer, r_buffer, out.buffer, p_buffer, a_buffer, d_buffer)] = [
                ctx.bind_group(pipeline, (params, *buffers[role](w_a, w_b))) for pipeline, params, _, w_a, w_b, role in dispatches
            ]
        # A product split over K on tensor cores, one segment of rows % 4: its reduce waits for the
        # next linear, which may record it together with its own prep (ReducePending).
        defer = (self.tuning.tc_reduce_prep and len(dispatches) >= 2 and dispatches[-1][5] == "reduce"
                 and dispatches[-2][5] == "tc_partial" and len(weight.segments) == 1 and rows % 4 == 0)
        for (pipeline, _, grid, _, _, _), group in zip(dispatches[:-1] if defer else dispatches, bound):
            ctx.dispatch_group(pipeline, group, grid)
        if defer:
            flags = (LINEAR_BIAS if bias is not None else 0) | (LINEAR_RESIDUAL if residual is not None else 0)
            out = ReducePending(out, partials, residual, (dispatches[-1][0], bound[-1], dispatches[-1][2]),
                                (self, weight, dispatches[-2][2][2], flags, common[0], r_buffer or ctx.dummy))
        if tokens > self.tuning.matvec_max_tokens and ctx.stats.pending_dispatches >= self.tuning.prefill_submit_every:
            ctx.flush()  # a long prompt: the GPU starts on these layers while Python records the next
        return out

    def record_reduce_prep(self, pending: ReducePending, norm_weight: GpuWeight, eps: float) -> F16Activations:
        """`ReducePending.fuse`: matmul_reduce_prep.wgsl over the pending product's partials,
        writing its output (pending.out) and the f16 activations of a product normed by
        ``norm_weight`` (returned)."""
        ctx = self.context
        _, weight, splits, flags, bias_buffer, r_buffer = pending.fused
        tokens, rows = pending.shape
        key = ("reduce_prep", tokens, splits, flags, eps)
        params = weight.plans.get(key)
        if params is None:
            params = weight.plans[key] = ctx.uniform(LINEAR.pack(rows=rows, cols=splits, tokens=tokens, flags=flags | LINEAR_NORM,
                                                                 row_offset=0, y_stride=rows, eps=eps))
        a = F16Activations(ctx.scratch(tokens * rows * 2), (tokens, rows))
        pipeline = ctx.pipeline("matmul_reduce_prep", REDUCE_PREP_KINDS)
        ctx.dispatch(pipeline, (params, pending.partials.buffer, pending.out.buffer, ctx.dummy, bias_buffer, r_buffer,
                                norm_weight.buffer, a.buffer), (tokens, 1, 1))
        return a

    def record_swiglu(self, x: GpuTensor, norm_weight: GpuWeight, eps: float, gate_up: GpuWeight, down: GpuWeight,
                      residual: GpuTensor | None) -> GpuTensor | None:
        """``down(silu_mul(gate_up(rms_norm(x)))) + residual`` with the silu_mul in gate_up's
        epilogue: its tensor-core matmul's (`swiglu_fusable`) or one token's matvec_f16 or
        matvec_dot (`glu_fusable`); None where neither applies (the caller composes it)."""
        if self.glu_fusable(x.shape[0], x.shape[1], gate_up, down):
            h = self.record(x, gate_up, None, None, norm_weight, eps, glu_out=True)
        elif self.swiglu_fusable(x.shape[0], x.shape[1], gate_up, down):
            h = self.record(x, gate_up, None, None, norm_weight, eps, silu_out=True)
        else:
            return None
        return self.record(h, down, None, residual, None, 0.0)

    def glu_fusable(self, tokens: int, cols: int, gate_up: GpuWeight, down: GpuWeight) -> bool:
        """Whether a one-token `record_swiglu` writes silu(gate) up from gate_up's matvec_f16 or
        matvec_dot (``matvec_glu`` on, gate_up one segment of ``cols`` columns that one of them
        runs on an even number of rows a group, down of rows / 2 columns)."""
        if tokens != 1 or not self.tuning.matvec_glu or gate_up.kind != "matrix" or down.kind != "matrix":
            return False
        rows = gate_up.shape[0]
        if len(gate_up.segments) != 1 or gate_up.shape[1] != cols or rows % 2 or down.shape[1] != rows // 2:
            return False
        fmt = gate_up.segments[0].format
        config = self.matvec_f16_config(fmt, rows, cols) or self.matvec_dot_config(fmt, rows, cols)
        return config is not None and config[2] % 2 == 0

    def swiglu_fusable(self, tokens: int, cols: int, gate_up: GpuWeight, down: GpuWeight) -> bool:
        """Whether `record_swiglu` applies (decided once per weight and shape): ``tc_silu`` on,
        gate_up one segment on tensor cores with an even TN tile and no K split, its halves of
        whole 16-row matrices, and every segment of down on tensor cores."""
        key = ("swiglu", tokens, cols, id(down))
        fusable = gate_up.plans.get(key)
        if fusable is None:
            fusable = gate_up.plans[key] = self._swiglu_fusable(tokens, cols, gate_up, down)
        return fusable

    def _swiglu_fusable(self, tokens: int, cols: int, gate_up: GpuWeight, down: GpuWeight) -> bool:
        rows = gate_up.shape[0]
        if not (self.tuning.tc_silu and gate_up.kind == "matrix" and down.kind == "matrix" and len(gate_up.segments) == 1
                and gate_up.shape[1] == cols and rows % 32 == 0 and down.shape[1] == rows // 2):
            return False
        tile = self.tc_tile(gate_up.segments[0], tokens, cols, rows)
        if tile is None or tile[1] % 2 or self.tc_splits(tile, rows, tokens, cols, rows, gate_up.segments[0].format) != 1:
            return False
        return self.all_tc(down, tokens, rows // 2)

    def all_tc(self, weight: GpuWeight, tokens: int, cols: int) -> bool:
        """Whether every segment of ``weight`` multiplies ``tokens`` rows of ``cols`` on tensor
        cores (decided once per weight and shape)."""
        key = ("all_tc", tokens, cols)
        tc = weight.plans.get(key)
        if tc is None:
            tc = weight.plans[key] = (weight.kind == "matrix" and weight.shape[1] == cols
                                      and all(self.tc_tile(seg, tokens, cols, weight.shape[0]) is not None for seg in weight.segments))
        return tc

    def silu_fusable(self, weight: GpuWeight, tokens: int) -> bool:
        """Whether every kernel this linear would run reads ``[gate | up]`` (``LINEAR_SILU``): the
        matrix-vector kernels and matmul.tmpl.wgsl do; a format without a matmul kernel does not."""
        if weight.kind != "matrix":
            return False
        return tokens <= self.tuning.matvec_max_tokens or all(kernels.has_template("matmul", s.format) for s in weight.segments)

    def merge_fusable(self, x: AttentionPartials, weight: GpuWeight) -> bool:
        """Whether the one-token product by ``weight`` can merge split attention partials while
        loading x: every segment runs matvec.tmpl.wgsl, and x fits its workgroup memory."""
        cols = x.shape[1]
        return (self.tuning.matvec_attn_merge and weight.kind == "matrix" and cols <= 4096 and weight.shape[1] == cols
                and all(self.matvec_config(s.format, s.rows, cols) is not None for s in weight.segments))

    def plan(self, x_shape: tuple[int, int], weight: GpuWeight, bias, residual, norm_weight, eps, silu: bool,
             attn: tuple[int, int] | None = None, prepared: bool = False, silu_out: bool = False, glu_out: bool = False) -> tuple:
        """(dispatches [(pipeline, params, grid, w_a, w_b, role)], bind group cache, rows, (bias, norm
        buffers, bias, norm, bytes of split-K partials, bytes of f16 activations)); role "out" writes
        y, "partial" the partials of a prefill matmul split over K, "reduce" adds them into y
        (matmul_reduce.wgsl); "prep" writes the tensor cores' f16 activations, which "tc" (y) and
        "tc_partial" (partials) multiply (matmul_tc.tmpl.wgsl). ``prepared``: x holds them already
        (`F16Activations`), so there is no prep; ``silu_out``, ``glu_out``: see `record`."""
        ctx = self.context
        tokens, cols = x_shape
        rows = weight.shape[0]
        if weight.kind != "matrix" or weight.shape[1] != cols:
            raise InvalidConfigurationError(f"linear: x of shape {x_shape} does not fit weight {weight.name} {weight.shape}")
        flags = (
            (LINEAR_BIAS if bias is not None else 0)
            | (LINEAR_RESIDUAL if residual is not None else 0)
            | (LINEAR_NORM if norm_weight is not None else 0)
            | (LINEAR_SILU if silu else 0)
        )
        dispatches = []
        prep_bytes = dot_bytes = 0
        if (prepared or silu_out) and not all(self.tc_tile(seg, tokens, cols, rows) for seg in weight.segments):
            raise InvalidConfigurationError(f"linear: {weight.name} has a segment off tensor cores, which f16 activations "
                                            "in and silu(gate) up out need (Linear.swiglu_fusable decides that first)")
        for seg in weight.segments:
            if glu_out:  # glu_fusable decided it: one token, one segment, matvec_f16 or matvec_dot
                pipeline, params, grid = self.segment_kernel(seg, cols, rows, tokens, flags, eps, glu=True)
                dispatches.append((pipeline, params, grid, seg.w_a, seg.w_b, "out"))
                continue
            tc = self.tc_tile(seg, tokens, cols, rows)
            if tc is not None:
                # Tensor cores: the f16 activations once (matmul_tc_prep.wgsl), then per segment
                # matmul_tc without the norm and silu_mul the prep applied.
                if not prep_bytes and not prepared:
                    prep_bytes = tokens * cols * 2
                    params = ctx.uniform(LINEAR.pack(rows=seg.rows, cols=cols, tokens=tokens, flags=flags & (LINEAR_NORM | LINEAR_SILU),
                                                     row_offset=0, y_stride=rows, eps=eps))
                    prep = ctx.pipeline("matmul_tc_prep", LINEAR_KINDS)
                    dispatches.append((prep, params, (tokens, 1, 1), ctx.dummy, ctx.dummy, "prep"))
                splits = 1 if silu_out else self.tc_splits(tc, seg.rows, tokens, cols, rows, seg.format)
                mm_flags = flags & (LINEAR_BIAS | LINEAR_RESIDUAL) if splits == 1 else 0
                pipeline, params, grid = self.tc_kernel(tc, seg, cols, rows, tokens, mm_flags, silu_out)
                dispatches.append((pipeline, params, (grid[0], grid[1], splits), seg.w_a, seg.w_b, "tc" if splits == 1 else "tc_partial"))
                if splits > 1:
                    dispatches.append(self.reduce_dispatch(seg, splits, tokens, flags, rows, eps))
                continue
            ti = self.dot_tile(seg, tokens, cols)
            if ti is not None:
                # Integer dot: x quantized to int8 once (matmul_dot_prep.wgsl, norm and silu_mul
                # applied), then per segment matmul_dot without them.
                if not dot_bytes:
                    dot_bytes = dot_prep_bytes(tokens, cols)
                    params = ctx.uniform(LINEAR.pack(rows=seg.rows, cols=cols, tokens=tokens, flags=flags & (LINEAR_NORM | LINEAR_SILU),
                                                     row_offset=0, y_stride=rows, eps=eps))
                    prep = ctx.pipeline("matmul_dot_prep", LINEAR_KINDS)
                    dispatches.append((prep, params, (tokens, 1, 1), ctx.dummy, ctx.dummy, "dot_prep"))
                splits = self.dot_splits(ti, seg.rows, tokens, cols, rows)
                mm_flags = flags & (LINEAR_BIAS | LINEAR_RESIDUAL) if splits == 1 else 0
                pipeline, params, grid = self.dot_kernel(ti, seg, cols, rows, tokens, mm_flags)
                dispatches.append((pipeline, params, (grid[0], grid[1], splits), seg.w_a, seg.w_b, "dot" if splits == 1 else "dot_partial"))
                if splits > 1:
                    dispatches.append(self.reduce_dispatch(seg, splits, tokens, flags, rows, eps))
                continue
            tile = self.sgmat_tile(seg, tokens, cols)
            if tile is not None:
                splits = self.sgmat_splits(tile, seg.rows, tokens, cols, rows)
            else:
                splits = self.matmul_splits(seg.rows, tokens, cols, flags, rows) if self.uses_matmul(seg, tokens) else 1
            if splits == 1:
                pipeline, params, grid = self.segment_kernel(seg, cols, rows, tokens, flags, eps, attn)
                dispatches.append((pipeline, params, grid, seg.w_a, seg.w_b, "out"))
                continue
            # Split K: partial sums (no bias, no residual) into the scratch, then matmul_reduce.
            kept = LINEAR_SILU | (LINEAR_NORM if tile is not None else 0)  # matmul_sgmat's norm covers whole rows
            pipeline, params, grid = self.segment_kernel(seg, cols, rows, tokens, flags & kept, eps)
            dispatches.append((pipeline, params, (grid[0], grid[1], splits), seg.w_a, seg.w_b, "partial"))
            dispatches.append(self.reduce_dispatch(seg, splits, tokens, flags, rows, eps))
        most = max((d[2][2] for d in dispatches if d[5] in ("partial", "tc_partial", "dot_partial")), default=1)
        common = (
            bias.buffer if bias is not None else ctx.dummy,
            norm_weight.buffer if norm_weight is not None else ctx.dummy,
            bias,  # held so that their ids in the plan key stay theirs
            norm_weight,
            most * tokens * rows * 4 if most > 1 else 0,  # the partials' scratch
            prep_bytes,  # the tensor cores' f16 activations
            dot_bytes,  # matmul_dot's int8 activations
        )
        return dispatches, {}, rows, common

    def reduce_dispatch(self, seg: Segment, splits: int, tokens: int, flags: int, rows: int, eps: float) -> tuple:
        """The matmul_reduce.wgsl dispatch (role "reduce") adding a segment's ``splits`` K-split
        partials into y, with the bias and residual of ``flags``."""
        ctx = self.context
        params = ctx.uniform(LINEAR.pack(rows=seg.rows, cols=splits, tokens=tokens, flags=flags & (LINEAR_BIAS | LINEAR_RESIDUAL),
                                         row_offset=seg.row_offset, y_stride=rows, eps=eps))
        reduce = ctx.pipeline("matmul_reduce", LINEAR_KINDS)
        return reduce, params, (-(-seg.rows // 256), tokens, 1), ctx.dummy, ctx.dummy, "reduce"

    def segment_kernel(self, seg: Segment, cols: int, rows: int, tokens: int, flags: int, eps: float,
                       attn: tuple[int, int] | None = None, glu: bool = False) -> tuple[Any, Any, tuple[int, int, int]]:
        """(pipeline, params, grid) of the one dispatch that multiplies ``tokens`` rows of x by
        segment ``seg`` (writing rows ``seg.row_offset ..`` of a y of ``rows`` columns; ``glu``:
        one token's matvec_f16 or matvec_dot writing silu(gate) up, ``rows / 2`` columns)."""
        from kjarni.gpu import quant

        ctx, tuning = self.context, self.tuning
        params = ctx.uniform(
            LINEAR.pack(rows=seg.rows, cols=cols, tokens=tokens, flags=flags, row_offset=seg.row_offset, y_stride=rows, eps=eps)
        )
        tile = self.sgmat_tile(seg, tokens, cols)
        if tile is not None:  # tensor cores
            bm, bn, bk, sm, sn = tile
            variant = kernels.sgmat_variant(bm, bn, bk, sm, sn, ctx.f16_matrix_subgroup)

            def source_sg() -> str:
                return kernels.template("matmul_sgmat", variant)

            pipeline = ctx.pipeline("matmul_sgmat." + variant, LINEAR_KINDS, source=source_sg)
            return pipeline, params, (-(-seg.rows // bn), -(-tokens // bm), 1)
        if self.uses_matmul(seg, tokens):
            tm, tn, bk, ksplit, nbuf = self.matmul_config(seg.rows, tokens, cols)
            constants = {"TM": tm, "TN": tn, "BK": bk, "KSPLIT": ksplit, "NBUF": nbuf}
            pipeline = template_pipeline(ctx, "matmul", seg.format, LINEAR_KINDS, constants,
                                         unchecked=self.tuning.matmul_unchecked)
            return pipeline, params, (-(-seg.rows // (8 * tn)), -(-tokens // (8 * tm)), 1)
        h16 = self.matvec_f16_config(seg.format, seg.rows, cols) if tokens == 1 else None
        if h16 is not None:
            # One token, f16: matvec_f16.tmpl.wgsl, x (norm, silu_mul, attention merge) staged once
            # per workgroup, the weight loads of a trip written out (kernels.matvec_f16_fields).
            threads, lanes, r, un, cap = h16
            if attn:  # x: split attention partials, merged per workgroup (fewer, larger workgroups)
                threads, lanes, r, un, cap = tuning.matvec_attn_threads, tuning.matvec_attn_lanes, 1, 2, 0
            name = kernels.matvec_f16_variant(r, un)
            variant = frozenset({"attn"}) if attn else frozenset({"glu"}) if glu else frozenset()

            def source_h16() -> str:
                return kernels.template("matvec_f16", name, variant)

            constants = {"WG": threads, "LANES": lanes, "XV": cols // 4}
            if attn:
                constants.update(SPLITS=attn[0], HD4=attn[1])
            pipeline = ctx.pipeline("matvec_f16." + name, LINEAR_KINDS, flags=tuple(variant), constants=constants,
                                    source=source_h16, unchecked=tuning.matvec_f16_unchecked)
            sets = -(-seg.rows // (r * threads // lanes))
            return pipeline, params, fold(min(sets, cap) if cap else sets)
        dot = self.matvec_dot_config(seg.format, seg.rows, cols) if tokens == 1 else None
        if dot is not None:
            # One token, Q8_0 / Q5_0 / Q4_K: matvec_dot.tmpl.wgsl, x quantized to int8 per workgroup.
            threads, lanes, r, un, cap = dot
            fmt = seg.format
            variant = frozenset({"idot", "attn"}) if attn else frozenset({"idot", "glu"}) if glu else frozenset({"idot"})

            def source_dot() -> str:
                return kernels.template("matvec_dot", fmt, variant)

            constants = {"WG": threads, "LANES": lanes, "R": r, "UN": un, "XV": cols // 16,
                         "EARLY": int(bool(attn) and tuning.matvec_attn_early)}
            if attn:
                constants.update(SPLITS=attn[0], HD4=attn[1])
            pipeline = ctx.pipeline("matvec_dot." + fmt, LINEAR_KINDS, flags=tuple(variant), constants=constants,
                                    source=source_dot, unchecked=tuning.matvec_dot_unchecked)
            sets = -(-seg.rows // (r * threads // lanes))
            return pipeline, params, fold(min(sets, cap) if cap else sets)
        config = self.matvec_config(seg.format, seg.rows, cols) if tokens == 1 else None
        if config is not None:
            # One token (decode): matvec.tmpl.wgsl rendered for the format (its block decoder).
            threads, lanes, r, un = config
            fmt = seg.format
            variant = frozenset({"attn"}) if attn else frozenset()

            def source_mv() -> str:
                return kernels.template("matvec", fmt, variant)

            constants = {"WG": threads, "LANES": lanes, "R": r, "UN": un}
            if attn:  # x: split attention partials, merged per workgroup (fewer, larger workgroups)
                threads, lanes, r, un = tuning.matvec_attn_threads, tuning.matvec_attn_lanes, 1, 2
                constants = {"WG": threads, "LANES": lanes, "R": r, "UN": un, "SPLITS": attn[0], "HD4": attn[1]}
            pipeline = ctx.pipeline("matvec." + fmt, LINEAR_KINDS, flags=tuple(variant), constants=constants, source=source_mv)
            return pipeline, params, fold(-(-seg.rows // (r * threads // lanes)))
        if not seg.dense:
            if tuning.quant_t_min_tokens <= tokens <= tuning.matvec_max_tokens and ctx.has_subgroups:
                # Several tokens: `main_t` dequantizes each unit once for up to 4 x tiles tokens.
                def source_t() -> str:
                    return quant.shader_source(seg.linear_kernel, subgroups=True)

                constants = {"QT": max(1, min(tuning.matvec_t_quads, 3, -(-tokens // 4)))}
                pipeline = ctx.pipeline(
                    seg.linear_kernel, LINEAR_KINDS, entry="main_t", constants=constants, source=source_t, flags=("quant",)
                )
                return pipeline, params, (quant.workgroup_count(seg.rows), 1, 1)
            min_cols = tuning.quant_split_k_min_cols
            if tokens <= tuning.matvec_max_tokens and ctx.has_subgroups and min_cols is not None and cols >= min_cols:
                # Long rows, few of them (down_proj): the whole workgroup shares each row (SPLIT_K).
                def source() -> str:
                    return quant.shader_source(seg.linear_kernel, subgroups=True)

                constants = {"WG": tuning.quant_split_k_threads, "SPLIT_K": True}
                pipeline = ctx.pipeline(seg.linear_kernel, LINEAR_KINDS, constants=constants, source=source, flags=("quant",))
                return pipeline, params, (min(seg.rows, 65535), 1, 1)

            def source_main() -> str:
                return quant.shader_source(seg.linear_kernel, subgroups=ctx.has_subgroups)

            pipeline = ctx.pipeline(seg.linear_kernel, LINEAR_KINDS, entry="main", source=source_main, flags=("quant",))
            return pipeline, params, (quant.workgroup_count(seg.rows, subgroups=ctx.has_subgroups), 1, 1)
        if tuning.matvec_t_min_tokens <= tokens <= tuning.matvec_max_tokens and ctx.has_subgroups:
            # Several tokens (speculative verify): matvec_t applies each weight chunk to up to
            # 4 x quads tokens held in registers; long rows split K over 256 threads as matvec does.
            quads = max(1, min(tuning.matvec_t_quads, 3, -(-tokens // 4)))
            threads, r = tuning.matvec_t_configs.get((seg.rows, cols)) or (
                (32 if seg.rows >= 65536 else 128, 4 if seg.rows >= 1024 else 2) if -(-cols // 8) <= 256 else (256, 4)
            )
            constants = {"WG": threads, "R": r, "Q": quads}
            pipeline = ctx.pipeline(seg.linear_kernel, LINEAR_KINDS, entry="matvec_t", constants=constants)
            return pipeline, params, fold(-(-seg.rows // r))
        config = tuning.matvec_configs.get((seg.rows, cols)) if tokens <= tuning.matvec_max_tokens and ctx.has_subgroups else None
        if config is not None:
            # A configuration measured for this shape (tools/sweep_matvec.py): matvec_u with
            # `threads` threads on `r` rows, `u` 8-column chunks per thread per step.
            threads, r, u = config
            constants = {"WG": threads, "R": r, "U": u}
            pipeline = ctx.pipeline(seg.linear_kernel, LINEAR_KINDS, entry="matvec_u", constants=constants)
            return pipeline, params, fold(-(-seg.rows // r))
        if tokens <= tuning.matvec_max_tokens and ctx.has_subgroups and tuning.matvec_u_default and -(-cols // 8) <= 256:
            # The H200 sweep's winners for rows of up to 2048 columns (tools/sweep_matvec.py, see
            # docs/benchmarks.md): 128 threads on 4 rows (2 when rows are few), and 32 threads
            # for a very tall matrix (the LM head), where many small workgroups fill the GPU.
            threads = 32 if seg.rows >= 65536 else 128
            r = 4 if seg.rows >= 1024 else 2
            pipeline = ctx.pipeline(seg.linear_kernel, LINEAR_KINDS, entry="matvec_u", constants={"WG": threads, "R": r, "U": 1})
            return pipeline, params, fold(-(-seg.rows // r))
        if tokens <= tuning.matvec_max_tokens and ctx.has_subgroups and -(-cols // 8) <= tuning.matvec_subgroup_max_chunks:
            # Rows of up to a few thousand columns: one subgroup per 1, 2 or 4 rows (more rows per
            # subgroup only where there are rows enough to keep every SM busy), no barriers.
            r = 4 if seg.rows >= 8192 else 2 if seg.rows >= 2048 else 1
            threads = tuning.matvec_subgroup_threads
            constants = {"R": r, "WG": threads}
            pipeline = ctx.pipeline(seg.linear_kernel, LINEAR_KINDS, entry="matvec_sg", constants=constants)
            row_sets = -(-seg.rows // r)
            return pipeline, params, fold(-(-row_sets // (threads // 32)))
        chunks = -(-cols // 8)
        threads = max(64, min(tuning.matvec_max_threads, 1 << (chunks.bit_length() - 1)))
        constants = {"R": tuning.matvec_rows, "WG": threads}
        pipeline = ctx.pipeline(seg.linear_kernel, LINEAR_KINDS, entry="matvec", constants=constants)
        return pipeline, params, fold(-(-seg.rows // tuning.matvec_rows))

    def matvec_config(self, fmt: str, rows: int, cols: int) -> tuple[int, int, int, int] | None:
        """(WG, LANES, R, UN) of matvec.tmpl.wgsl for a one-token product of a ``rows`` x ``cols``
        segment in ``fmt``, or None where it does not apply (no subgroups, ``cols`` not a multiple
        of 8, ``matvec_template`` off): ``matvec_template_configs`` first (per (format, rows, cols),
        from tools/sweep_matvec.py), else the H200 sweep's winners on Qwen2.5-0.5B's matrices
        (docs/benchmarks.md), the same for f16 and the quantized formats: a vocabulary-sized LM head
        16 lanes on 4 rows (two row groups a subgroup, many rows a workgroup); rows longer than 2048
        columns (down_proj) split over 256 lanes, 2 rows; thousands of rows (gate_up) 32 lanes on
        4 rows; small matrices (q/k/v, o_proj) 64 lanes on 1 row, to spread over every SM."""
        tuning = self.tuning
        if not (tuning.matvec_template and self.context.has_subgroups and cols % 8 == 0 and kernels.has_template("matvec", fmt)):
            return None
        config = tuning.matvec_template_configs.get((fmt, rows, cols))
        if config is not None:
            return config
        if rows >= 65536:
            return 128, 16, 4, 1
        if cols > 2048:
            return 256, 256, 2, 1
        if rows >= 4096:
            return 128, 32, 4, 2
        return 128, 64, 1, 2

    def matvec_f16_fits(self, fmt: str, cols: int) -> bool:
        """Whether matvec_f16.tmpl.wgsl can run a one-token product of ``cols``-column ``fmt`` rows:
        f16, ``matvec_f16`` and ``matvec_template`` on, a subgroup device, ``cols`` a multiple of 8,
        and x's 4 bytes a column (plus 2304) within the device's workgroup memory."""
        tuning = self.tuning
        if not (fmt == "f16" and tuning.matvec_template and tuning.matvec_f16 and self.context.has_subgroups):
            return False
        return cols % 8 == 0 and 4 * cols + 2304 <= self.context.max_workgroup_storage

    def matvec_f16_config(self, fmt: str, rows: int, cols: int) -> tuple[int, int, int, int, int] | None:
        """(WG, LANES, R, UN, workgroups at most or 0) of matvec_f16.tmpl.wgsl for a one-token
        product of a ``rows`` x ``cols`` segment in ``fmt``, or None for the float template
        (matvec.tmpl.wgsl): where it does not fit (`matvec_f16_fits`), ``matvec_f16_configs``
        (tools/sweep_matvec.py; the H200's winners by default, None where the float template won),
        else the shape of those winners: a vocabulary-sized LM head 256 threads in groups of 32
        lanes on 2 rows, 2 units a trip; rows longer than 4864 columns the float template (x staged
        8960 wide lost to it: 20.8 against 14.9 us); long rows (down_proj) 64 lanes on 1 row, 4
        units a trip; thousands of rows (gate_up) as the LM head; small matrices 64 lanes on 2 rows."""
        if not self.matvec_f16_fits(fmt, cols):
            return None
        configs = self.tuning.matvec_f16_configs
        if (rows, cols) in configs:
            return configs[(rows, cols)]
        if rows >= 32768:
            return 256, 32, 2, 2, 0
        if cols > 4864:
            return None
        if cols > 2048:
            return 256, 64, 1, 4, 0
        if rows > 2048:
            return 256, 32, 2, 2, 0
        return 256, 64, 2, 1, 0

    def matvec_dot_config(self, fmt: str, rows: int, cols: int) -> tuple[int, int, int, int, int] | None:
        """(WG, LANES, R, UN, workgroups at most or 0) of matvec_dot.tmpl.wgsl for a one-token
        product of a ``rows`` x ``cols`` segment in ``fmt``, or None where it does not apply
        (``matvec_int_dot`` or ``matvec_template`` off, no subgroups, a format without an integer-dot
        decoder, or x's 22 bytes per 16 columns past the device's workgroup memory):
        ``matvec_dot_configs`` first
        (from tools/sweep_matvec.py; the H200's winners on Qwen2.5-0.5B / 1.5B by default), else the
        shape of those winners: a vocabulary-sized LM head 128 threads in groups of 16 lanes on 4 rows,
        thousands of rows (gate_up) 16 lanes on 2 rows, 2 chunks a trip; long rows (down_proj) and
        small matrices 256 threads in groups of 32 on 1 row, 2 chunks a trip (many workgroups, each
        quantizing x once)."""
        tuning = self.tuning
        if not (tuning.matvec_template and tuning.matvec_int_dot and self.context.has_subgroups
                and kernels.has_template("matvec_dot", fmt)):
            return None
        if cols % (256 if fmt == "Q4_K" else 32) or 22 * (cols // 16) + 2304 > self.context.max_workgroup_storage:
            return None
        config = tuning.matvec_dot_configs.get((fmt, rows, cols))
        if config is not None:
            return config
        if rows >= 65536:
            return 128, 16, 4, 1, 0
        if rows >= 4096 and cols <= 2048:
            return 128, 16, 2, 2, 0
        return 256, 32, 1, 2, 0

    def uses_matmul(self, seg: Segment, tokens: int) -> bool:
        return tokens > self.tuning.matvec_max_tokens and kernels.has_template("matmul", seg.format)

    def sgmat_tile(self, seg: Segment, tokens: int, cols: int) -> tuple[int, int, int, int, int] | None:
        """(BM, BN, BK, SM, SN) of the first tensor-core matmul (matmul_sgmat) for this prefill
        product, or None: f16 weights, more than ``matvec_max_tokens`` tokens, ``tensor_cores`` on
        (off by default), a device with an f16 subgroup-matrix configuration, and a tile named for
        the shape in ``sgmat_tiles`` with ``cols`` a multiple of its BK (other shapes: matmul_tc
        where `tc_tile` allows, else SIMT)."""
        tuning = self.tuning
        sg = self.context.f16_matrix_subgroup
        if not (tuning.tensor_cores and sg and seg.format == "f16" and tokens > tuning.matvec_max_tokens):
            return None
        tile = tuning.sgmat_tiles.get((seg.rows, cols))
        if tile is None:
            return None  # matmul_tc's (tc_tile) or the SIMT kernel
        if cols % tile[2] or kernels.sgmat_variant(*tile, sg) not in kernels.TEMPLATES["matmul_sgmat"]:
            return None
        return tile

    def tc_tile(self, seg: Segment, tokens: int, cols: int, y_stride: int) -> tuple[int, int, int, int, int, int] | None:
        """(TM, TN, SM, SN, KU, SHARED) of the tensor-core matmul (matmul_tc.tmpl.wgsl) for this
        prefill product, or None for the other kernels: ``tensor_cores`` on, a device with an f16
        subgroup-matrix configuration, f16 weights, more than ``matvec_max_tokens`` and at least
        16 tokens, segment rows, row offset and y stride multiples of 16, ``cols`` of 16 KU, and
        no tile of the older kernel named for the shape (``sgmat_tiles``). The tile:
        ``tc_tiles[(rows, cols)]`` (None there: not on tensor cores), else ``tc_tile``. Quantized
        weights (``kernels.TC_QUANT_FORMATS``, ``tc_quant`` on): ``tc_quant_tiles[(format, rows,
        cols)]``, else ``tc_quant_tile`` (a SHARED tile: the weight is dequantized in workgroup memory)."""
        tuning = self.tuning
        sg = self.context.f16_matrix_subgroup
        fmt = seg.format
        quant = fmt in kernels.TC_QUANT_FORMATS and tuning.tc_quant
        if not (tuning.tensor_cores and sg and (fmt == "f16" or quant) and tokens > tuning.matvec_max_tokens and tokens >= 16):
            return None
        if seg.rows % 16 or seg.row_offset % 16 or y_stride % 16 or (not quant and (seg.rows, cols) in tuning.sgmat_tiles):
            return None
        if quant:
            tile = tuning.tc_quant_tiles.get((fmt, seg.rows, cols), tuning.tc_quant_tile)
        else:
            tile = tuning.tc_tiles.get((seg.rows, cols), tuning.tc_tile)
        if tile is not None and tile[5] == 5 and self.context.info.get("backend_type") != "Vulkan":
            # SHARED 5's matrix loads count offsets in vec4<u32> elements, as Dawn's Vulkan backend
            # reads them (measured); elsewhere the same tile with f16 workgroup tiles (SHARED 3).
            tile = (*tile[:5], 3)
        if tile is None or cols % (16 * tile[4]) or kernels.tc_variant(*tile, sg, fmt) not in kernels.TEMPLATES["matmul_tc"]:
            return None
        if kernels.tc_workgroup_bytes(*tile) > self.context.max_workgroup_storage:
            return None
        return tuple(tile)

    def dot_tile(self, seg: Segment, tokens: int, cols: int) -> int | None:
        """TI of the integer-dot prefill matmul (matmul_dot.tmpl.wgsl) for this product, or None for
        the other kernels: ``matmul_int_dot`` on, a subgroup device (matmul_dot_prep shares a
        block's maximum over 8 lanes), a format of ``kernels.DOT_FORMATS``, more than
        ``matvec_max_tokens`` tokens and ``cols`` a multiple of 64 (`plan` tries `tc_tile` first:
        tensor cores win where the device has them). The tile: ``matmul_dot_tiles[(format, rows,
        cols)]``, else ``matmul_dot_tile``."""
        tuning, ctx = self.tuning, self.context
        if not (tuning.matmul_int_dot and ctx.has_subgroups and seg.format in kernels.DOT_FORMATS
                and tokens > tuning.matvec_max_tokens and cols % 64 == 0):
            return None
        ti = tuning.matmul_dot_tiles.get((seg.format, seg.rows, cols), tuning.matmul_dot_tile)
        if ti not in kernels.DOT_TILES or dot_prep_bytes(tokens, cols) > ctx.max_binding_size:
            return None
        return ti

    def dot_splits(self, ti: int, rows: int, tokens: int, cols: int, y_stride: int) -> int:
        """Workgroups splitting K for matmul_dot (grid z, then matmul_reduce): ``matmul_dot_splits``
        if set, else enough for about ``sgmat_split_below`` workgroups when they are fewer (at most
        ``sgmat_max_splits``), at least 4 steps of 64 each, within one storage binding of partials."""
        groups = -(-rows // 64) * -(-tokens // (16 * ti))
        return self.k_splits(self.tuning.matmul_dot_splits, groups, cols // 64, tokens, y_stride)

    def dot_kernel(self, ti: int, seg: Segment, cols: int, rows: int, tokens: int,
                   flags: int) -> tuple[Any, Any, tuple[int, int, int]]:
        """(pipeline, params, grid) of matmul_dot for one segment (grid z = 1: the caller's split)."""
        ctx = self.context
        variant = kernels.dot_variant(seg.format, ti)
        sides = frozenset({"idot", "i8tile"})  # the block decoder's int8 weight tile

        def source() -> str:
            return kernels.template("matmul_dot", variant, sides)

        pipeline = ctx.pipeline("matmul_dot." + variant, LINEAR_KINDS, source=source, flags=sides,
                                unchecked=self.tuning.matmul_dot_unchecked)
        params = ctx.uniform(LINEAR.pack(rows=seg.rows, cols=cols, tokens=tokens, flags=flags, row_offset=seg.row_offset,
                                         y_stride=rows, eps=0.0))
        return pipeline, params, (-(-seg.rows // 64), -(-tokens // (16 * ti)), 1)

    def tc_kernel(self, tile: tuple[int, ...], seg: Segment, cols: int, rows: int, tokens: int, flags: int,
                  silu: bool = False) -> tuple[Any, Any, tuple[int, int, int]]:
        """(pipeline, params, grid) of matmul_tc for one segment (grid z = 1: the caller's split);
        ``silu``: the silu flag (the segment is [gate | up], y silu(gate) up in f16)."""
        ctx = self.context
        tm, tn, sm, sn = tile[:4]
        variant = kernels.tc_variant(*tile, ctx.f16_matrix_subgroup, seg.format)
        tokens_first = self.tuning.tc_tokens_first_for.get((seg.rows, cols), self.tuning.tc_tokens_first)
        order = frozenset({"tokens_first"} if tokens_first else ()) | frozenset({"silu"} if silu else ())

        def source() -> str:
            return kernels.template("matmul_tc", variant, order)

        name = "matmul_tc." + variant + ("+tf" if tokens_first else "") + ("+silu" if silu else "")
        pipeline = ctx.pipeline(name, LINEAR_KINDS, source=source, flags=order)
        params = ctx.uniform(LINEAR.pack(rows=seg.rows, cols=cols, tokens=tokens, flags=flags, row_offset=seg.row_offset, y_stride=rows, eps=0.0))
        grid = (-(-seg.rows // (16 * sn * tn)), -(-tokens // (16 * sm * tm)))
        return pipeline, params, ((grid[1], grid[0], 1) if tokens_first else (*grid, 1))

    def tc_splits(self, tile: tuple[int, ...], rows: int, tokens: int, cols: int, y_stride: int, fmt: str = "f16") -> int:
        """Workgroups splitting K for matmul_tc (grid z, then matmul_reduce): ``tc_splits`` if set,
        else for f16 weights ``tc_split_counts[(rows, cols)]``, else enough for about ``sgmat_split_below``
        workgroups when they are fewer (at most ``sgmat_max_splits``, at least 4 K steps each),
        within one storage binding of partials."""
        tuning = self.tuning
        tm, tn, sm, sn, ku = tile[:5]
        groups = -(-rows // (16 * sn * tn)) * -(-tokens // (16 * sm * tm))
        splits = tuning.tc_splits if tuning.tc_splits is not None else tuning.tc_split_counts.get((rows, cols)) if fmt == "f16" else None
        return self.k_splits(splits, groups, cols // (16 * ku), tokens, y_stride)

    def sgmat_splits(self, tile: tuple[int, int, int, int, int], rows: int, tokens: int, cols: int, y_stride: int) -> int:
        """Workgroups splitting K (grid z, then matmul_reduce) for the tensor-core matmul:
        ``sgmat_splits`` if set, else ``sgmat_split_counts[(rows, cols)]``, else enough to make about
        ``sgmat_split_below`` workgroups when the tiles are fewer (at most ``sgmat_max_splits``, at
        least 4 K steps each), within one storage binding of partials."""
        tuning = self.tuning
        bm, bn, bk = tile[:3]
        tiles = -(-rows // bn) * -(-tokens // bm)
        splits = tuning.sgmat_splits if tuning.sgmat_splits is not None else tuning.sgmat_split_counts.get((rows, cols))
        return self.k_splits(splits, tiles, cols // bk, tokens, y_stride)

    def k_splits(self, splits: int | None, groups: int, steps: int, tokens: int, y_stride: int) -> int:
        """The K split of a tiled prefill matmul of ``groups`` workgroups and ``steps`` K steps
        (matmul_tc, matmul_sgmat, matmul_dot): ``splits`` where given, else enough for about
        ``sgmat_split_below`` workgroups when they are fewer (at most ``sgmat_max_splits``); at
        least 4 steps a split, and the partials ([splits, tokens, y_stride] f32) within one storage
        binding, else 1."""
        tuning = self.tuning
        if splits is None:
            splits = min(tuning.sgmat_max_splits, -(-tuning.sgmat_split_below // groups)) if groups < tuning.sgmat_split_below else 1
        splits = min(int(splits), steps // 4)
        if splits <= 1 or splits * tokens * y_stride * 4 > self.context.max_binding_size:
            return 1
        return splits

    def matmul_splits(self, rows: int, tokens: int, cols: int, flags: int, y_stride: int) -> int:
        """Workgroups splitting K (grid z) for the prefill matmul of this segment: 1 unless
        ``matmul_splits`` says more and the product allows it (no fused norm, which needs whole
        rows; partials within one storage binding; at least two steps of K per split)."""
        tuning = self.tuning
        tm, tn, bk, ksplit, _ = self.matmul_config(rows, tokens, cols)
        splits = tuning.matmul_splits
        measured = tuning.matmul_configs.get((rows, cols))
        if splits is None and measured is not None:
            splits = measured[5]
        if splits is None:
            tiles = -(-rows // (8 * tn)) * -(-tokens // (8 * tm))
            splits = min(tuning.matmul_max_splits, tuning.matmul_split_tiles // tiles) if tiles < tuning.matmul_split_tiles else 1
        splits = min(int(splits), cols // (2 * bk * ksplit))
        if splits <= 1 or flags & LINEAR_NORM or splits * tokens * y_stride * 4 > self.context.max_binding_size:
            return 1
        return splits

    def matmul_config(self, rows: int, tokens: int, cols: int) -> tuple[int, int, int, int, int]:
        """(TM, TN, BK, KSPLIT, NBUF) of the prefill matmul (matmul.tmpl.wgsl) for a product of
        ``tokens`` x ``cols`` by ``rows`` x ``cols``: ``matmul_configs`` for a measured shape,
        else these rules.

        128x128 output tiles, with K split over 2 thread groups, only when there are many (less
        L2 traffic, little wave tail); else 64 tokens x 128 rows, where few tiles (o_proj,
        down_proj of a small model) split K over 4 thread groups so each SM gets more warps.
        ``matmul_nbuf`` tiles per group (2: double-buffered)."""
        tuning = self.tuning
        measured = tuning.matmul_configs.get((rows, cols))
        if measured is not None:
            tm, tn, bk, ksplit, nbuf = measured[:5]
        elif -(-rows // 128) * -(-tokens // 128) >= tuning.matmul_min_big_tiles:
            tm, tn, bk, ksplit, nbuf = 16, 16, 16, 2 if cols >= 64 else 1, tuning.matmul_nbuf
        else:
            few = -(-rows // 128) * -(-tokens // 64) < tuning.matmul_split_k_below
            tm, tn, bk, ksplit, nbuf = 8, 16, 8, 4 if few and cols >= 256 else 1, tuning.matmul_nbuf
        # Within the device's workgroup memory (128x128 tiles with KSPLIT 2 need 32.5 KiB; many
        # devices allow 32): fewer K groups first, then one buffer; and KSPLIT BK NBUF >= 2
        # max(TM, TN) (the groups' sums meet in the tiles).
        limit = self.context.max_workgroup_storage
        while ksplit > 1 and (matmul_workgroup_bytes(tm, tn, bk, ksplit, nbuf) > limit or ksplit * bk * nbuf < 2 * max(tm, tn)):
            ksplit //= 2
        if nbuf > 1 and matmul_workgroup_bytes(tm, tn, bk, ksplit, nbuf) > limit:
            nbuf = 1
        return tm, tn, bk, ksplit, nbuf
