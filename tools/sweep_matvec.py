"""Sweep the decode matrix-vector kernels: GB/s per (shape, format, variant) on this GPU.

For each of Qwen2.5-0.5B's five decode matrices (qkv 1152x896 with norm + bias, o_proj 896x896
with residual, gate_up 9728x896 with norm, down 896x4864 reading silu(gate) * up plus residual,
LM head 151936x896 with norm), one token (``--tokens N``: N, see below), and each weight format (f16, Q8_0, Q5_0; Q4_K where the
row length allows), every candidate configuration of the linear kernels is timed with timestamp
queries around one compute pass of ``--reps`` back-to-back dispatches (median of ``--passes``
passes, the variants of a shape timed in interleaved rounds after a warm-up: see
``Bench.time_interleaved``). Each dispatch reads another copy of the weight (enough copies to overflow the L2), as a
decode step reads every layer's weights once. Every variant's output is checked against numpy.

Variants (shaders/matvec.tmpl.wgsl, shaders/matvec_dot.tmpl.wgsl, shaders/linear_body.wgsl,
shaders/linear_q*.wgsl):
- every format ``mv0 ...``: matvec.tmpl.wgsl in the configuration `Linear.matvec_config` picks (what
  f16 runs, and what the quantized formats ran before the integer-dot product: the A/B baseline).
- Q8_0, Q5_0, Q4_K ``dot WG=w L=l R=r UN=u G=g``: matvec_dot.tmpl.wgsl (x quantized to int8 in each
  workgroup, dot4I8Packed; g = workgroups at most, 0 = one per row set), checked against numpy with
  x quantized the same way; ``dotc`` / ``dotu``: kjarni's configuration for the shape compiled with /
  without naga's runtime checks (the other setting of GpuTuning.matvec_dot_unchecked). The report's
  ``matvec_dot_configs`` (and ``--tuning-out``) lists the best ``dot`` per (shape, format);
  ``best_by_family`` puts each family's best side by side.
- f16 ``h16 WG=w L=l R=r UN=u G=g``: matvec_f16.tmpl.wgsl (x staged in workgroup memory, r x u
  weight loads a trip written out, g = workgroups at most), compiled as kjarni does
  (GpuTuning.matvec_f16_unchecked); ``h16c`` / ``h16u``: kjarni's configuration for the shape with /
  without naga's runtime checks. The report's ``matvec_f16_configs`` (and ``--tuning-out``) lists the
  best ``h16`` per shape.
- every format ``mv WG=w L=l R=r UN=u``: the decode template (w threads in row groups of l lanes,
  r rows a group, u units a trip); the report's ``matvec_template_configs`` lists the best per
  (shape, format) as GpuTuning.matvec_template_configs takes them (``--tuning-out`` writes them too).
- f16 ``sg R=r``: ``matvec_sg`` (a subgroup per r rows, 256 threads); ``wg``: ``matvec`` (the
  workgroup split-K with R = 4); ``u WG=w R=r U=u``: ``matvec_u`` (w threads on r rows, u chunks of
  8 columns per thread per step, loads issued before use).
- quantized ``sg WG=w``: ``main`` (a subgroup per row, w / 32 rows per workgroup); ``sgfold``: the
  same with the grid folded to 8 workgroups per SM-ish (1056); ``split WG=w``: ``main`` with
  ``SPLIT_K`` (the whole workgroup on one row).

``--tokens N`` (N > 1; speculative verify): x is [N, cols] ([N, 2 cols] for down), the residual and
the output [N, rows], and every variant is checked against numpy on all N rows. The variants above
run at N tokens (they loop over the tokens, a 4-token tile per pass for ``main``), plus the
multi-token kernels as kjarni/gpu/linear.py's `Linear.segment_kernel` dispatches them:
- f16 ``t WG=w R=r Q=q``: ``matvec_t`` (w threads in 32, 64, 128, 256 on r in 1, 2, 4 rows, q token
  quads per pass in 1 .. min(3, ceil(N / 4)), as GpuTuning.matvec_t_quads is limited), grid
  ``fold(ceil(rows / r))``.
- quantized ``t WG=w QT=q``: ``main_t`` (a subgroup per row, w in 32, 64, 128, 256; q tiles of 4
  tokens per pass in 1 .. min(3, ceil(N / 4))), grid ceil(rows / (w / 32)) workgroups (at most
  65535; for WG = 128, the one kjarni uses, that is ``quant.workgroup_count(rows)``).
The results carry ``"ops": true`` on the variant WgpuOps would pick at N tokens; the report
records ``"tokens"`` and ``"suggest"`` names the matvec_t / main_t settings of the winners
(``--tuning-out`` is for one token only). ``--variants t,u`` keeps only the variants whose label
starts with one of the given words (families: f16 sg, wg, u, t; quantized sg, sgfold, split, t).

``--model`` picks whose decode matrices (Qwen2.5-0.5B by default, Qwen2.5-1.5B, SmolLM2-135M; a
comma-separated list sweeps several in one run, each result naming its model, rows and cols).
Small kernels time slow when the GPU idles between variants (its clock drops while pipelines
compile): rank configurations here, and trust bench_gpu's per-kernel figures inside a step.
The report starts with ``empty_dispatch_us``, one dispatch of an empty one-workgroup kernel in a
chain of dependent dispatches: the floor of the small shapes (``us_over_empty_dispatch`` per best).

Then (unless ``--no-prefill``) runs ``tools/bench_gpu.py --prefill-only`` for the per-kernel GPU
time of one 512-token prefill. Prints one JSON document (``--out`` also writes it) and a summary
on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gputime import EMPTY_WGSL
from kjarni.gpu import kernels, quant
from kjarni.gpu.context import WgpuContext
from kjarni.gpu.linear import LINEAR_KINDS, Linear
from kjarni.gpu.step import fold
from kjarni.gpu.tuning import GpuTuning
from kjarni.gpu.params import (
    LINEAR,
    LINEAR_BIAS,
    LINEAR_NORM,
    LINEAR_RESIDUAL,
    LINEAR_SILU,
)
from kjarni.numpy_ops import quantize_activations
from kjarni.weights import QuantTensor

SHAPES = {  # name: (rows, cols, flags)
    "qkv": (1152, 896, LINEAR_NORM | LINEAR_BIAS),
    "o_proj": (896, 896, LINEAR_RESIDUAL),
    "gate_up": (9728, 896, LINEAR_NORM),
    "down": (896, 4864, LINEAR_SILU | LINEAR_RESIDUAL),
    "lm_head": (151936, 896, LINEAR_NORM),
}
MODELS = {  # --model: the decode matrices of other shapes (tools/bench_gpu.py's SHAPES)
    "qwen2.5-0.5b": dict(SHAPES),
    "qwen2.5-1.5b": {
        "qkv": (2048, 1536, LINEAR_NORM | LINEAR_BIAS),
        "o_proj": (1536, 1536, LINEAR_RESIDUAL),
        "gate_up": (17920, 1536, LINEAR_NORM),
        "down": (1536, 8960, LINEAR_SILU | LINEAR_RESIDUAL),
        "lm_head": (151936, 1536, LINEAR_NORM),
    },
    "smollm2-135m": {
        "qkv": (960, 576, LINEAR_NORM),
        "o_proj": (576, 576, LINEAR_RESIDUAL),
        "gate_up": (3072, 576, LINEAR_NORM),
        "down": (576, 1536, LINEAR_SILU | LINEAR_RESIDUAL),
        "lm_head": (49152, 576, LINEAR_NORM),
    },
}
def mv_configs(cols: int):
    """(WG, LANES, R, UN) of matvec.tmpl.wgsl worth timing for rows of ``cols`` columns."""
    for lanes in (16, 32, 64, 128, 256):
        if lanes > 64 and cols < 2048:
            continue  # rows too short to split that far
        for wg in sorted({max(lanes, 64), 128, 256}):
            if wg < lanes:
                continue
            for r in (1, 2, 4):
                for un in (1, 2):
                    yield wg, lanes, r, un


def h16_configs(rows: int, cols: int):
    """(WG, LANES, R, UN, workgroups at most) of matvec_f16.tmpl.wgsl worth timing, by the
    matrix's class: a vocabulary-sized LM head, long rows (down_proj), thousands of rows (gate_up),
    small matrices (q/k/v, o_proj)."""
    if rows >= 32768:
        shapes, rus, caps = ((128, 16), (256, 16), (128, 32), (256, 32)), ((4, 1), (4, 2), (2, 2), (2, 4)), (0, 1056, 2112)
    elif cols > 2048:
        shapes, rus, caps = ((128, 32), (128, 64), (256, 64), (128, 128), (256, 128), (256, 256)), ((1, 2), (1, 4), (2, 1), (2, 2)), (0,)
    elif rows > 2048:
        shapes, rus, caps = ((128, 16), (128, 32), (256, 32), (256, 64)), ((2, 1), (2, 2), (4, 1), (4, 2)), (0, 528)
    else:
        shapes, rus, caps = ((64, 64), (128, 32), (128, 64), (256, 64)), ((1, 1), (1, 2), (2, 1), (2, 2)), (0,)
    for wg, lanes in shapes:
        for r, un in rus:
            sets = -(-rows // (r * wg // lanes))
            for cap in caps:
                if cap < sets:
                    yield wg, lanes, r, un, cap


def dot_configs(rows: int, cols: int):
    """(WG, LANES, R, UN, workgroups at most) of matvec_dot.tmpl.wgsl worth timing."""
    for lanes in (8, 16, 32):
        for wg in (128, 256) if lanes == 32 else (128,):
            for r in (1, 2, 4):
                for un in (1, 2):
                    sets = -(-rows // (r * wg // lanes))
                    for cap in (0, 1024) if sets > 1024 else (0,):
                        yield wg, lanes, r, un, cap


EPS = 1e-6


def _quant_weight(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> quant.RepackedWeight:
    qt = quant.T[fmt]
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qt]
    nb = cols // block
    data = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    # Valid small f16 scales (d, and dmin for K-quants) at the start of every block.
    halves = (rng.random((rows, nb, 2), dtype=np.float32) * 0.01 + 0.001).astype(np.float16).view(np.uint8)
    data[:, :, :4 if fmt.endswith("_K") else 2] = halves.reshape(rows, nb, 4)[:, :, :4 if fmt.endswith("_K") else 2]
    return quant.repack(QuantTensor(qt, (rows, cols), data.reshape(rows, nb * size)))


@dataclass
class LinearCase:
    """One linear product's buffers on the GPU (weight copies as (buffer, stride)), y, an
    optional scratch for split-K partials, and the numpy reference."""

    bench: Bench
    rows: int
    cols: int
    tokens: int
    copies: int
    nbytes: int  # of one copy of the weight
    w_a: tuple
    w_b: tuple
    x: Any
    bias: Any
    residual: Any
    norm: Any
    y: Any
    partials: Any
    ref: np.ndarray
    scale: float
    ref_q: np.ndarray | None = None  # with x quantized as matvec_dot does (int-dot formats)

    def groups(self, params, x, y, *, weight: bool = True, bias_residual: bool = True) -> list:
        """One bind group per weight copy (linear family bindings 0 .. 7): ``params``, ``x``, the
        weight (else dummies), bias and residual (else dummies), the norm weight, ``y``."""
        ctx = self.bench.ctx
        dummy = (ctx.dummy, 0, 256)
        (wa, sa), (wb, sb) = self.w_a, self.w_b
        layout = ctx.layout(LINEAR_KINDS)[0]
        out = []
        for i in range(self.copies):
            entries = [
                (params, 0, params.size), (x, 0, x.size),
                (wa, i * sa, sa) if weight else dummy,
                ((wb, i * sb, sb) if wb is not ctx.dummy else dummy) if weight else dummy,
                (self.bias, 0, self.bias.size) if bias_residual else dummy,
                (self.residual, 0, self.residual.size) if bias_residual else dummy,
                (self.norm, 0, self.norm.size), (y, 0, y.size),
            ]
            out.append(self.bench.dev.create_bind_group(layout=layout, entries=[
                {"binding": b, "resource": {"buffer": buf, "offset": off, "size": size}} for b, (buf, off, size) in enumerate(entries)]))
        return out


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.model = args.model.split(",")[0]  # whose matrices run_shape is given (main sets it)
        self.ctx = WgpuContext(args.adapter)
        import wgpu

        self.wgpu = wgpu
        self.dev = self.ctx.device
        self.qs = self.dev.create_query_set(type=wgpu.QueryType.timestamp, count=2 * args.passes)
        self.align = max(256, self.ctx.storage_alignment)

    def buffer(self, data: np.ndarray, copies: int = 1):
        """One buffer holding `copies` copies of data, each at a multiple of the offset alignment."""
        wgpu = self.wgpu
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        stride = -(-max(raw.nbytes, 16) // self.align) * self.align
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
        buf = self.dev.create_buffer(size=stride * copies, usage=usage)
        padded = np.zeros(stride, np.uint8)
        padded[: raw.nbytes] = raw
        self.dev.queue.write_buffer(buf, 0, padded)
        if copies > 1:  # WebGPU refuses a copy within one buffer: copy from a separate source
            src = self.dev.create_buffer(size=stride, usage=usage)
            self.dev.queue.write_buffer(src, 0, padded)
            enc = self.dev.create_command_encoder()
            for i in range(1, copies):
                enc.copy_buffer_to_buffer(src, 0, buf, i * stride, stride)
            self.dev.queue.submit([enc.finish()])
            src.destroy()
        return buf, stride

    def time_steps(self, steps: list, copies: int) -> float:
        """Median seconds per repetition of ``steps`` [(pipeline, groups, grid)] over passes of
        ``--reps`` repetitions, repetition i using groups[i % copies]."""
        a = self.args
        enc = self.dev.create_command_encoder()
        for p in range(a.passes):
            cp = enc.begin_compute_pass(timestamp_writes={
                "query_set": self.qs, "beginning_of_pass_write_index": 2 * p, "end_of_pass_write_index": 2 * p + 1})
            for i in range(a.reps):
                for pipeline, groups, grid in steps:
                    cp.set_pipeline(pipeline)
                    cp.set_bind_group(0, groups[(p * a.reps + i) % copies])
                    cp.dispatch_workgroups(*grid)
            cp.end()
        resolve = self.dev.create_buffer(size=16 * a.passes, usage=self.wgpu.BufferUsage.QUERY_RESOLVE | self.wgpu.BufferUsage.COPY_SRC)
        enc.resolve_query_set(self.qs, 0, 2 * a.passes, resolve, 0)
        self.dev.queue.submit([enc.finish()])
        ticks = np.frombuffer(self.dev.queue.read_buffer(resolve), dtype=np.uint64).astype(np.float64)
        per = (ticks[1::2] - ticks[0::2]) * 1e-9 / a.reps
        return float(np.median(per))

    def time_interleaved(self, variants: list, groups: list) -> list[float]:
        """Median seconds per dispatch of each (pipeline, grid) of ``variants`` (one shape): after
        about ``--warm-ms`` of the first (the GPU clock rises from idle), ``--passes`` rounds, each
        timing every variant once (``--reps`` dispatches in a timestamped compute pass), all
        recorded in one command buffer: the variants run back to back at the same clock, and the
        ranking does not depend on the order they were compiled in."""
        a, wgpu = self.args, self.wgpu
        n, copies = len(variants), len(groups)
        if not n:
            return []
        first = self.time(variants[0][0], groups, variants[0][1])
        warm = int(min(20000, a.warm_ms * 1e-3 / max(first, 1e-7)))
        qs = self.dev.create_query_set(type=wgpu.QueryType.timestamp, count=2 * n * a.passes)
        enc = self.dev.create_command_encoder()
        if warm:
            cp = enc.begin_compute_pass()
            cp.set_pipeline(variants[0][0])
            for i in range(warm):
                cp.set_bind_group(0, groups[i % copies])
                cp.dispatch_workgroups(*variants[0][1])
            cp.end()
        for p in range(a.passes):
            for v, (pipeline, grid) in enumerate(variants):
                q = 2 * (p * n + v)
                cp = enc.begin_compute_pass(timestamp_writes={
                    "query_set": qs, "beginning_of_pass_write_index": q, "end_of_pass_write_index": q + 1})
                cp.set_pipeline(pipeline)
                for i in range(a.reps):
                    cp.set_bind_group(0, groups[(p * a.reps + i) % copies])
                    cp.dispatch_workgroups(*grid)
                cp.end()
        resolve = self.dev.create_buffer(size=16 * n * a.passes, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
        enc.resolve_query_set(qs, 0, 2 * n * a.passes, resolve, 0)
        self.dev.queue.submit([enc.finish()])
        ticks = np.frombuffer(self.dev.queue.read_buffer(resolve), dtype=np.uint64).astype(np.float64)
        per = (ticks[1::2] - ticks[0::2]).reshape(a.passes, n) * 1e-9 / a.reps
        resolve.destroy()
        qs.destroy()
        return [float(t) for t in np.median(per, axis=0)]

    def time(self, pipeline, groups, grid) -> float:
        """Median seconds per dispatch over passes of reps dispatches cycling through groups."""
        return self.time_steps([(pipeline, groups, grid)], len(groups))

    def empty_dispatch(self) -> float:
        """Seconds per dispatch of a one-workgroup kernel in a chain of dependent dispatches (each
        reads what the previous wrote): the floor under every small matvec of a decode step."""
        import wgpu

        usage = wgpu.BufferUsage.STORAGE
        buf = self.dev.create_buffer(size=256, usage=usage)
        pipeline = self.dev.create_compute_pipeline(
            layout="auto", compute={"module": self.dev.create_shader_module(code=EMPTY_WGSL), "entry_point": "main"})
        group = self.dev.create_bind_group(layout=pipeline.get_bind_group_layout(0),
                                           entries=[{"binding": 0, "resource": {"buffer": buf}}])
        self.time(pipeline, [group], (1, 1, 1))  # compiles, warms up
        return self.time(pipeline, [group], (1, 1, 1))

    def check(self, case: LinearCase, steps: list, quantized: bool = False) -> float:
        """Runs ``steps`` once (first copy of the weight) and returns the output's largest error
        against numpy, relative to the largest reference value; then zeroes y, so a later variant
        that writes nothing cannot pass on this one's output."""
        enc = self.dev.create_command_encoder()
        cp = enc.begin_compute_pass()
        for pipeline, groups, grid in steps:
            cp.set_pipeline(pipeline)
            cp.set_bind_group(0, groups[0])
            cp.dispatch_workgroups(*grid)
        cp.end()
        self.dev.queue.submit([enc.finish()])
        n = case.rows * case.tokens
        y = np.frombuffer(self.dev.queue.read_buffer(case.y, 0, n * 4), np.float32).reshape(case.tokens, case.rows)
        self.dev.queue.write_buffer(case.y, 0, np.zeros(n, np.float32))
        return float(np.abs(y - (case.ref_q if quantized else case.ref)).max()) / case.scale

    def linear_case(self, fmt: str, rows: int, cols: int, tokens: int, flags: int, rng, partial_bytes: int = 0) -> LinearCase:
        """Random inputs of one linear product on the GPU (the weight in as many copies as cycle
        through --l2-bytes) and its numpy reference. fmt: f32, f16 or a quantized format."""
        ctx, a = self.ctx, self.args
        silu = bool(flags & LINEAR_SILU)
        x = rng.standard_normal((tokens, cols * (2 if silu else 1)), dtype=np.float32)
        bias = rng.standard_normal(rows, dtype=np.float32) * 0.1
        residual = rng.standard_normal((tokens, rows), dtype=np.float32)
        nw = (1.0 + 0.1 * rng.standard_normal(cols, dtype=np.float32)).astype(np.float32)
        if fmt in ("f16", "f32"):
            dt = np.float16 if fmt == "f16" else np.float32
            wd = np.zeros((rows, -(-cols // 8) * 8 if fmt == "f16" else cols), dt)
            wd[:, :cols] = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.05).astype(dt)
            dense = wd[:, :cols].astype(np.float32)
            wa_data, wb_data, nbytes = wd, None, wd.nbytes
        else:
            rep = _quant_weight(fmt.upper(), rows, cols, rng)
            dense = quant.dequantize_repacked(rep).astype(np.float32)
            wa_data, wb_data, nbytes = rep.w_a, rep.w_b, rep.w_a.nbytes + rep.w_b.nbytes
        copies = int(max(1, min(a.max_copies, -(-a.l2_bytes // nbytes))))
        wa, sa = self.buffer(wa_data, copies)
        wb, sb = self.buffer(wb_data, copies) if wb_data is not None else (ctx.dummy, 256)
        usage = self.wgpu.BufferUsage.STORAGE | self.wgpu.BufferUsage.COPY_SRC | self.wgpu.BufferUsage.COPY_DST
        xv = x[:, :cols]
        if silu:
            xv = xv / (1.0 + np.exp(-xv)) * x[:, cols:]
        refs = []
        for quantized in (False, True) if kernels.has_template("matvec_dot", fmt.upper()) else (False,):
            v = xv * nw if flags & LINEAR_NORM else xv
            ref = (quantize_activations(v) if quantized else v) @ dense.T
            if flags & LINEAR_NORM:
                ref = ref / np.sqrt(np.mean(xv * xv, axis=1, keepdims=True) + EPS)
            if flags & LINEAR_BIAS:
                ref = ref + bias
            if flags & LINEAR_RESIDUAL:
                ref = ref + residual
            refs.append(ref)
        ref = refs[0]
        return LinearCase(
            self, rows, cols, tokens, copies, nbytes, (wa, sa), (wb, sb), self.buffer(x)[0], self.buffer(bias)[0],
            self.buffer(residual)[0], self.buffer(nw)[0], self.dev.create_buffer(size=max(256, rows * tokens * 4), usage=usage),
            self.dev.create_buffer(size=max(256, partial_bytes), usage=usage) if partial_bytes else None,
            ref, float(np.abs(ref).max()) + 1e-6, refs[1] if len(refs) > 1 else None,
        )

    def run_shape(self, name: str, fmt: str, rows: int, cols: int, flags: int, rng) -> list[dict]:
        ctx, a = self.ctx, self.args
        tokens = a.tokens
        case = self.linear_case(fmt, rows, cols, tokens, flags, rng)
        params = ctx.uniform(LINEAR.pack(rows=rows, cols=cols, tokens=tokens, flags=flags, row_offset=0, y_stride=rows, eps=EPS))
        groups = case.groups(params, case.x, case.y)
        results = []
        families = set(a.variants.split(",")) if a.variants else None
        picked = ops_choice(fmt, rows, cols, tokens)
        timed = []  # (index in results, pipeline, grid) of the variants that ran, timed together below
        for label, pipeline, grid in self.variants(fmt, rows, cols, tokens):
            if families is not None and label.split()[0] not in families:
                continue
            try:
                err = self.check(case, [(pipeline, groups, grid)], quantized=label.startswith("dot"))
                results.append({"model": self.model, "shape": name, "format": fmt, "variant": label,
                                "rel_err": float(f"{err:.2e}"), "ok": err < 2e-3, "grid": list(grid)})
                if tokens > 1:
                    results[-1]["ops"] = label == picked
                timed.append((len(results) - 1, pipeline, grid))
            except Exception as exc:  # noqa: BLE001 (a variant that fails to compile must not end the sweep)
                results.append({"model": self.model, "shape": name, "format": fmt, "variant": label, "error": str(exc)[:300]})
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        for (i, _, _), sec in zip(timed, self.time_interleaved([(p, g) for _, p, g in timed], groups)):
            results[i].update(us=round(sec * 1e6, 2), gb_s=round(case.nbytes / sec / 1e9, 1))
            print(json.dumps(results[i]), file=sys.stderr, flush=True)
        return results

    def variants(self, fmt: str, rows: int, cols: int, tokens: int = 1):
        """(label, pipeline, grid) of every candidate; with tokens > 1 also matvec_t / main_t."""
        ctx = self.ctx
        chunks = -(-cols // 8)
        quads = range(1, max(1, min(3, -(-tokens // 4))) + 1)  # token quads (tiles) a pass can use
        fmt_name = fmt if fmt in ("f16", "f32") else fmt.upper()
        plain = Linear(ctx, GpuTuning())
        default = plain.matvec_config(fmt_name, rows, cols)
        if default is not None:  # what kjarni ran before the integer-dot product (and still runs for f16)
            wg, lanes, r, un = default
            p = ctx.pipeline("matvec." + fmt_name, LINEAR_KINDS, constants={"WG": wg, "LANES": lanes, "R": r, "UN": un},
                             source=lambda f=fmt_name: kernels.template("matvec", f))
            yield f"mv0 WG={wg} L={lanes} R={r} UN={un}", p, fold(-(-rows // (r * wg // lanes)))
        if tokens == 1 and plain.matvec_dot_config(fmt_name, rows, cols) is not None:
            # dot: compiled as kjarni does (GpuTuning.matvec_dot_unchecked); dotc / dotu: kjarni's
            # configuration for the shape compiled with naga's runtime checks / without them.
            default = plain.matvec_dot_config(fmt_name, rows, cols)
            other = "dotc" if DEFAULTS.matvec_dot_unchecked else "dotu"
            for config in [*(("dot", *c) for c in dot_configs(rows, cols)), (other, *default)]:
                family, wg, lanes, r, un, cap = config
                unchecked = DEFAULTS.matvec_dot_unchecked if family == "dot" else family == "dotu"
                constants = {"WG": wg, "LANES": lanes, "R": r, "UN": un, "XV": cols // 16}
                p = ctx.pipeline("matvec_dot." + fmt_name, LINEAR_KINDS, flags=("idot",), constants=constants,
                                 source=lambda f=fmt_name: kernels.template("matvec_dot", f, frozenset({"idot"})),
                                 unchecked=unchecked)
                sets = -(-rows // (r * wg // lanes))
                yield f"{family} WG={wg} L={lanes} R={r} UN={un} G={cap}", p, fold(min(sets, cap) if cap else sets)
        if tokens == 1 and plain.matvec_f16_fits(fmt_name, cols):
            # h16: matvec_f16.tmpl.wgsl compiled as kjarni does (GpuTuning.matvec_f16_unchecked);
            # h16c / h16u: kjarni's configuration for the shape with / without naga's runtime checks.
            default = plain.matvec_f16_config(fmt_name, rows, cols)
            other = [("h16c" if DEFAULTS.matvec_f16_unchecked else "h16u", *default)] if default else []
            for family, wg, lanes, r, un, cap in [*(("h16", *c) for c in h16_configs(rows, cols)), *other]:
                unchecked = DEFAULTS.matvec_f16_unchecked if family == "h16" else family == "h16u"
                name = kernels.matvec_f16_variant(r, un)
                p = ctx.pipeline("matvec_f16." + name, LINEAR_KINDS, constants={"WG": wg, "LANES": lanes, "XV": cols // 4},
                                 source=lambda n=name: kernels.template("matvec_f16", n), unchecked=unchecked)
                sets = -(-rows // (r * wg // lanes))
                yield f"{family} WG={wg} L={lanes} R={r} UN={un} G={cap}", p, fold(min(sets, cap) if cap else sets)
        for wg, lanes, r, un in mv_configs(cols):
            p = ctx.pipeline("matvec." + fmt_name, LINEAR_KINDS, constants={"WG": wg, "LANES": lanes, "R": r, "UN": un},
                             source=lambda f=fmt_name: kernels.template("matvec", f))
            yield f"mv WG={wg} L={lanes} R={r} UN={un}", p, fold(-(-rows // (r * wg // lanes)))
        if fmt == "f16":
            for r in (1, 2, 4):
                p = ctx.pipeline("linear_f16", LINEAR_KINDS, entry="matvec_sg", constants={"R": r, "WG": 256})
                yield f"sg R={r}", p, fold(-(-((rows + r - 1) // r) // 8))
            threads = max(64, min(256, 1 << (chunks.bit_length() - 1)))
            p = ctx.pipeline("linear_f16", LINEAR_KINDS, entry="matvec", constants={"R": 4, "WG": threads})
            yield f"wg R=4 WG={threads}", p, fold(-(-rows // 4))
            for wg in (32, 64, 128, 256):
                for u in (1, 2, 4):
                    if u > 1 and (u // 2) * wg >= chunks:  # half the threads' extra chunks would be past the row
                        continue
                    for r in (1, 2, 4):
                        p = ctx.pipeline("linear_f16", LINEAR_KINDS, entry="matvec_u", constants={"R": r, "WG": wg, "U": u})
                        yield f"u WG={wg} R={r} U={u}", p, fold(-(-rows // r))
            if tokens > 1:
                for wg in (32, 64, 128, 256):
                    for r in (1, 2, 4):
                        for q in quads:
                            p = ctx.pipeline("linear_f16", LINEAR_KINDS, entry="matvec_t", constants={"WG": wg, "R": r, "Q": q})
                            yield f"t WG={wg} R={r} Q={q}", p, fold(-(-rows // r))
            return
        kernel = "linear_" + fmt

        def src() -> str:
            return quant.shader_source(kernel, subgroups=ctx.has_subgroups)

        for wg in (32, 64, 128, 256):
            p = ctx.pipeline(kernel, LINEAR_KINDS, constants={"WG": wg}, source=src, flags=("quant",))
            per = wg // 32
            yield f"sg WG={wg}", p, (min(-(-rows // per), 65535), 1, 1)
            if -(-rows // per) > 1056:
                yield f"sgfold WG={wg}", p, (1056, 1, 1)
            p = ctx.pipeline(kernel, LINEAR_KINDS, constants={"WG": wg, "SPLIT_K": True}, source=src, flags=("quant",))
            yield f"split WG={wg}", p, (min(rows, 65535), 1, 1)
        if tokens > 1:
            for wg in (32, 64, 128, 256):
                for q in quads:
                    p = ctx.pipeline(kernel, LINEAR_KINDS, entry="main_t", constants={"WG": wg, "QT": q}, source=src,
                                     flags=("quant",))
                    yield f"t WG={wg} QT={q}", p, (min(-(-rows // (wg // 32)), 65535), 1, 1)


DEFAULTS = GpuTuning()  # the kernel choices kjarni makes without a --tuning file


def ops_choice(fmt: str, rows: int, cols: int, tokens: int) -> str | None:
    """The label of the variant kjarni/gpu/linear.py's `Linear.segment_kernel` dispatches at `tokens` (> 1) tokens, if swept."""
    if tokens > DEFAULTS.matvec_max_tokens:
        return None  # the tiled matmul, not swept here
    q = max(1, min(DEFAULTS.matvec_t_quads, 3, -(-tokens // 4)))
    if fmt == "f16" and tokens >= DEFAULTS.matvec_t_min_tokens:
        threads, r = DEFAULTS.matvec_t_configs.get((rows, cols)) or (
            (32 if rows >= 65536 else 128, 4 if rows >= 1024 else 2) if -(-cols // 8) <= 256 else (256, 4)
        )
        return f"t WG={threads} R={r} Q={q}"
    if fmt != "f16" and tokens >= DEFAULTS.quant_t_min_tokens:
        return f"t WG=128 QT={q}"  # main_t's WG is the shader's default, 128
    return None


def suggest_multi(report: dict) -> dict:
    """At several tokens: per (shape, format), the best matvec_t / main_t variant, the best of the
    others (the per-token kernels), and the variant kjarni picks; plus GpuTuning.matvec_t_configs
    from the f16 winners among the matvec_t variants."""
    out, configs = {}, {}
    for r in report["results"]:
        if "gb_s" not in r or not r["ok"]:
            continue
        entry = out.setdefault(f"{r['shape']} {r['format']}", {})
        for key in ("t" if r["variant"].startswith("t ") else "other", "ops" if r.get("ops") else None):
            if key and (key not in entry or r["us"] < entry[key]["us"]):
                entry[key] = {"variant": r["variant"], "us": r["us"], "gb_s": r["gb_s"]}
    for name, entry in out.items():
        shape, fmt = name.split()
        if fmt == "f16" and "t" in entry:
            wg, rr, _ = (int(part.split("=")[1]) for part in entry["t"]["variant"].split()[1:])
            rows, cols, _ = SHAPES[shape]
            configs[f"({rows}, {cols})"] = f"({wg}, {rr})"
    return {"matvec_t_configs": "{" + ", ".join(f"{k}: {v}" for k, v in configs.items()) + "}", "per_shape": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", default=None)
    parser.add_argument("--formats", default="f16,q8_0,q5_0,q4_k")
    parser.add_argument("--model", default="qwen2.5-0.5b", help=f"whose decode matrices, comma-separated: {', '.join(sorted(MODELS))}")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="names of --model's matrices (all by default)")
    parser.add_argument("--tokens", type=int, default=1, help="tokens per product (> 1: also matvec_t / main_t)")
    parser.add_argument("--variants", default=None, help="only these label families, e.g. t,u (f16: sg wg u t; quantized: sg sgfold split t)")
    parser.add_argument("--reps", type=int, default=100, help="dispatches per timed pass")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--warm-ms", type=float, default=300.0, help="GPU time of a shape's first variant before its rounds")
    parser.add_argument("--l2-bytes", type=int, default=384 << 20, help="bytes of weight copies cycled through")
    parser.add_argument("--max-copies", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="shapes / 8 rows, few reps (CPU adapters)")
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tuning-out", default=None, help="write the suggested settings as JSON for bench_gpu.py --tuning")
    args = parser.parse_args()
    if args.tokens < 1:
        parser.error("--tokens must be at least 1")
    if args.tuning_out and args.tokens > 1:
        parser.error("--tuning-out writes the one-token settings: leave out --tokens (see the report's suggest)")
    if args.quick:
        args.reps, args.passes, args.max_copies, args.warm_ms = 3, 1, 2, 0.0
    bench = Bench(args)
    rng = np.random.default_rng(0)
    models = args.model.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--model {','.join(unknown)}: not one of {', '.join(sorted(MODELS))}")
    if args.tokens > 1 and len(models) > 1:
        parser.error("--tokens N > 1 takes one --model")
    empty = bench.empty_dispatch()
    report = {"adapter": bench.ctx.description, "model": args.model, "tokens": args.tokens,
              "empty_dispatch_us": round(empty * 1e6, 2), "results": []}
    print(f"# empty dependent dispatch: {empty * 1e6:.2f} us", file=sys.stderr, flush=True)
    for model in models:
        SHAPES.clear()
        SHAPES.update(MODELS[model])
        bench.model = model
        for name in args.shapes.split(","):
            if name not in SHAPES:
                continue
            rows, cols, flags = SHAPES[name]
            if args.quick:
                rows = min(rows, 512)
            for fmt in args.formats.split(","):
                if fmt == "q4_k" and cols % 256:
                    continue
                t0 = time.perf_counter()
                for r in bench.run_shape(name, fmt, rows, cols, flags, rng):
                    report["results"].append({**r, "rows": rows, "cols": cols})
                print(f"# {model} {name} {fmt}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(report, indent=1))
    best, family_best = {}, {}
    for r in report["results"]:
        if "gb_s" in r and r["ok"]:
            k = (r["model"], r["shape"], r["format"])
            if k not in best or r["us"] < best[k]["us"]:  # not gb_s: rounded to 0.1, it ties on slow adapters
                best[k] = r
            kf = (*k, r["variant"].split()[0])
            if kf not in family_best or r["us"] < family_best[kf]["us"]:
                family_best[kf] = r
    report["best"] = [{"model": k[0], "shape": k[1], "format": k[2], "rows": v["rows"], "cols": v["cols"],
                       "variant": v["variant"], "us": v["us"], "gb_s": v["gb_s"],
                       "us_over_empty_dispatch": round(v["us"] - report["empty_dispatch_us"], 2)}
                      for k, v in best.items()]
    # The best of each family (mv0: kjarni's float template as configured before; dot: the
    # integer-dot product), side by side: the A/B of one call.
    report["best_by_family"] = [{"model": k[0], "shape": k[1], "format": k[2], "family": k[3], "variant": v["variant"],
                                 "us": v["us"], "gb_s": v["gb_s"]} for k, v in family_best.items()]
    # GpuTuning.matvec_template_configs from the best matvec.tmpl.wgsl variant per shape and format.
    mv_best = {}
    for r in report["results"]:
        if "gb_s" in r and r["ok"] and r["variant"].startswith("mv "):
            k = (r["model"], r["shape"], r["format"])
            if k not in mv_best or r["us"] < mv_best[k]["us"]:
                mv_best[k] = r
    report["matvec_template_configs"] = [
        [f if f in ("f16", "f32") else f.upper(), v["rows"], v["cols"], *(int(p.split("=")[1]) for p in v["variant"].split()[1:])]
        for (_, s, f), v in mv_best.items()]
    # GpuTuning.matvec_dot_configs from the best checked integer-dot variant per shape and format.
    report["matvec_dot_configs"] = [
        [f.upper(), v["rows"], v["cols"], *(int(p.split("=")[1]) for p in v["variant"].split()[1:])]
        for (_, s, f, fam), v in family_best.items() if fam == "dot"]
    # GpuTuning.matvec_f16_configs from the best matvec_f16 variant per shape: [rows, cols] alone
    # (None: the float template) where the float template's mv0 was faster.
    report["matvec_f16_configs"] = [
        [v["rows"], v["cols"]] + ([] if family_best.get((m, s, f, "mv0"), v)["us"] < v["us"]
                                  else [int(p.split("=")[1]) for p in v["variant"].split()[1:]])
        for (m, s, f, fam), v in family_best.items() if fam == "h16"]
    # What kjarni should pick (GpuTuning.matvec_configs, quant_split_k_min_cols), from the winners.
    configs, split_cols, plain_cols = {}, [], []
    for r in report["best"]:
        rows, cols = r["rows"], r["cols"]
        if r["format"] == "f16" and r["variant"].startswith("u "):
            wg, rr, u = (int(part.split("=")[1]) for part in r["variant"].split()[1:])
            configs[f"({rows}, {cols})"] = f"({wg}, {rr}, {u})"
        elif r["format"] != "f16" and not r["variant"].startswith(("mv", "dot")):
            (split_cols if r["variant"].startswith("split") else plain_cols).append(cols)
    report["suggest"] = {
        "matvec_configs": "{" + ", ".join(f"{k}: {v}" for k, v in configs.items()) + "}",
        "quant_split_k_min_cols": min(split_cols) if split_cols and (not plain_cols or min(split_cols) > max(plain_cols)) else None,
    }
    if args.tokens > 1:  # the one-token settings above mean nothing here
        report["suggest"] = suggest_multi(report)
    if args.tuning_out:
        Path(args.tuning_out).write_text(json.dumps({
            "matvec_configs": [[r["rows"], r["cols"], *(int(p.split("=")[1]) for p in r["variant"].split()[1:])]
                               for r in report["best"] if r["format"] == "f16" and r["variant"].startswith("u ")],
            "quant_split_k_min_cols": report["suggest"]["quant_split_k_min_cols"],
            "matvec_template_configs": report["matvec_template_configs"],
            # Only the families swept: an empty list would clear kjarni's defaults for the others.
            **{key: report[key] for key in ("matvec_dot_configs", "matvec_f16_configs") if report[key]},
        }))
    if not args.no_prefill:
        cmd = [sys.executable, str(Path(__file__).with_name("bench_gpu.py")), "--prefill-only", "--no-torch",
               "--model", "qwen2.5-0.5b", "--formats", "f16"]
        if args.quick:
            cmd = [sys.executable, str(Path(__file__).with_name("bench_gpu.py")), "--prefill-only", "--no-torch",
                   "--small", "--formats", "f16"]
        del bench
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), check=False)
        try:
            report["prefill"] = json.loads(proc.stdout)
        except json.JSONDecodeError:
            report["prefill"] = {"stdout": proc.stdout[-3000:], "stderr": proc.stderr[-3000:]}
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    print("BEST (per family):", file=sys.stderr)
    for b in report["best_by_family"]:
        print(f"  {b['model']:13s} {b['shape']:8s} {b['format']:5s} {b['variant']:34s} {b['us']:8.2f} us {b['gb_s']:7.1f} GB/s",
              file=sys.stderr)
    print(f"  (empty dependent dispatch: {report['empty_dispatch_us']} us)", file=sys.stderr)
    if args.tokens > 1:
        print(f"{args.tokens} TOKENS: the best matvec_t / main_t, the best per-token kernel, WgpuOps' pick:", file=sys.stderr)
        for name, e in report["suggest"]["per_shape"].items():
            parts = [f"{what} {e[k]['variant']} {e[k]['us']:.2f} us"
                     for k, what in (("t", "multi"), ("other", "per-token"), ("ops", "ops")) if k in e]
            print(f"  {name:14s} " + " | ".join(parts), file=sys.stderr)
        print("SUGGEST: matvec_t_configs", report["suggest"]["matvec_t_configs"], file=sys.stderr)
    else:
        print("SUGGEST:", json.dumps(report["suggest"]), file=sys.stderr)
    bad = [f"{r['shape']} {r['format']} {r['variant']}" for r in report["results"] if not r.get("ok")]
    print(f"CHECK: {len(report['results']) - len(bad)} of {len(report['results'])} variants match numpy"
          + (f"; failed or errored: {bad}" if bad else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
