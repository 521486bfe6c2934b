"""Sweep the prefill matmul's tile configurations: TFLOP/s per (shape, format, variant) on this GPU.

For each of Qwen2.5-0.5B's four prefill products at ``--tokens`` tokens (default 512; qkv
1152x896 with norm + bias, o_proj 896x896 with residual, gate_up 9728x896 with norm, down
896x4864 reading silu(gate) * up plus residual), every configuration of ``matmul_<format>``
(shaders/matmul_body.wgsl: TM x TN threads of 8x8 outputs, BK columns per step, KSPLIT thread
groups splitting K, S workgroups splitting K with matmul_reduce after them, for products without a
fused norm) is timed with timestamp queries around one compute pass of ``--reps`` back-to-back
dispatches (median of ``--passes``), each dispatch on another copy of the weight, and checked
against numpy; configurations needing more workgroup memory than the device has are skipped.
``--configs "TM,TN,BK,KSPLIT,S;..."`` sweeps only those. ``--unchecked`` also times every variant
compiled without naga's runtime checks (WgpuContext.pipeline(unchecked=True)); ``--probe`` adds
diagnostic kernels without the step loop's global loads, or also its barriers (timing only).

    python tools/sweep_matmul.py --reps 30 --passes 5    # on the GPU to tune (H200: see docs/benchmarks.md)
    python tools/sweep_matmul.py --quick                 # a check on a CPU adapter (lavapipe)

Also measures this GPU's f32 FMA rate on registers alone (a kernel of 64 independent FMAs per
loop step), the ceiling any SIMT matmul here can reach.

Prints one JSON document: per variant ``us``, ``tflops``, ``rel_err``, ``ok``; ``best`` per shape;
``ops`` marks the variant WgpuOps picks today; ``layer_ms`` sums one layer's four products for the
picks and for the best variants. ``--quick`` runs small shapes on a CPU adapter.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kjarni.gpu import kernels
from kjarni.gpu.ops import LINEAR_KINDS, WgpuOps, matmul_workgroup_bytes
from kjarni.gpu.params import LINEAR, LINEAR_BIAS, LINEAR_NORM, LINEAR_RESIDUAL, LINEAR_SILU
from tools.sweep_matvec import EPS, Bench, _quant_weight

SHAPES = {  # name: (rows, cols, flags)
    "qkv": (1152, 896, LINEAR_NORM | LINEAR_BIAS),
    "o_proj": (896, 896, LINEAR_RESIDUAL),
    "gate_up": (9728, 896, LINEAR_NORM),
    "down": (896, 4864, LINEAR_SILU | LINEAR_RESIDUAL),
}

# (TM, TN, BK, KSPLIT, S): BK a multiple of 8 and at most min(TM, TN); KSPLIT BK >= 2 max(TM, TN);
# S workgroups splitting K (grid z, then matmul_reduce; not for products with a fused norm).
CONFIGS = [
    (16, 16, 16, 1, 1), (16, 16, 8, 1, 1), (16, 16, 16, 2, 1),
    (16, 8, 8, 1, 1), (8, 16, 8, 1, 1), (16, 8, 8, 4, 1), (8, 16, 8, 4, 1),
    (8, 8, 8, 1, 1), (8, 8, 8, 2, 1), (8, 8, 8, 4, 1),
]
SPLIT_CONFIGS = [(*c, s) for c in ((16, 16, 16, 1), (8, 16, 8, 4), (8, 8, 8, 4), (8, 8, 8, 2), (8, 8, 8, 1)) for s in (2, 3, 4, 6)]

FMA_PEAK = """
@group(0) @binding(0) var<storage, read_write> out: array<vec4<f32>>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let s = f32(gid.x) * 1e-9;
    var a0 = vec4<f32>(s); var a1 = a0 + 1.0; var a2 = a0 + 2.0; var a3 = a0 + 3.0;
    var a4 = a0 + 4.0; var a5 = a0 + 5.0; var a6 = a0 + 6.0; var a7 = a0 + 7.0;
    var a8 = a0 + 8.0; var a9 = a0 + 9.0; var a10 = a0 + 10.0; var a11 = a0 + 11.0;
    var a12 = a0 + 12.0; var a13 = a0 + 13.0; var a14 = a0 + 14.0; var a15 = a0 + 15.0;
    let m = vec4<f32>(0.999);
    let b = vec4<f32>(0.001);
    for (var i = 0u; i < 1024u; i++) {
        a0 = fma(a0, m, b); a1 = fma(a1, m, b); a2 = fma(a2, m, b); a3 = fma(a3, m, b);
        a4 = fma(a4, m, b); a5 = fma(a5, m, b); a6 = fma(a6, m, b); a7 = fma(a7, m, b);
        a8 = fma(a8, m, b); a9 = fma(a9, m, b); a10 = fma(a10, m, b); a11 = fma(a11, m, b);
        a12 = fma(a12, m, b); a13 = fma(a13, m, b); a14 = fma(a14, m, b); a15 = fma(a15, m, b);
    }
    out[gid.x] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11 + a12 + a13 + a14 + a15;
}
"""


# Diagnostic kernels (--probe; wrong results, timing only): the step loop without its global loads
# (workgroup memory refilled from stale registers), and also without its two barriers.
_LOADS = (("px = fetch_x(m0 + lxp, ts, kn + lxk);", ""), ("pw = fetch_w8(lr, (kn + lwk) / 8u);", ""))
_BARRIERS = (("workgroupBarrier();  // the previous step's reads are done", ""),
             ("workgroupBarrier();\n        // Next step's", "// Next step's"))
PROBES = {"noload": _LOADS, "noload_nobarrier": _LOADS + _BARRIERS}


def ops_choice(bench: Bench, rows: int, tokens: int, cols: int, flags: int) -> tuple[int, int, int, int, int]:
    """(TM, TN, BK, KSPLIT, S) that WgpuOps._plan_linear dispatches for this product."""
    ops = WgpuOps(bench.ctx)
    return (*ops.matmul_config(rows, tokens, cols), ops._matmul_splits(rows, tokens, cols, flags, rows))


def time_steps(bench: Bench, steps: list, copies: int) -> float:
    """Median seconds per repetition of ``steps`` [(pipeline, groups, grid)] (groups cycled)."""
    a, dev = bench.args, bench.dev
    enc = dev.create_command_encoder()
    for p in range(a.passes):
        cp = enc.begin_compute_pass(timestamp_writes={
            "query_set": bench.qs, "beginning_of_pass_write_index": 2 * p, "end_of_pass_write_index": 2 * p + 1})
        for i in range(a.reps):
            for pipeline, groups, grid in steps:
                cp.set_pipeline(pipeline)
                cp.set_bind_group(0, groups[(p * a.reps + i) % copies])
                cp.dispatch_workgroups(*grid)
        cp.end()
    resolve = dev.create_buffer(size=16 * a.passes, usage=bench.wgpu.BufferUsage.QUERY_RESOLVE | bench.wgpu.BufferUsage.COPY_SRC)
    enc.resolve_query_set(bench.qs, 0, 2 * a.passes, resolve, 0)
    dev.queue.submit([enc.finish()])
    ticks = np.frombuffer(dev.queue.read_buffer(resolve), dtype=np.uint64).astype(np.float64)
    return float(np.median((ticks[1::2] - ticks[0::2]) * 1e-9 / a.reps))


def fma_peak(bench: Bench, groups: int) -> dict:
    ctx, dev = bench.ctx, bench.dev
    pipeline = ctx.pipeline("fma_peak", ("rw",), source=FMA_PEAK)
    out = dev.create_buffer(size=groups * 256 * 16, usage=bench.wgpu.BufferUsage.STORAGE)
    group = dev.create_bind_group(layout=ctx.layout(("rw",))[0], entries=[
        {"binding": 0, "resource": {"buffer": out, "offset": 0, "size": out.size}}])
    sec = time_steps(bench, [(pipeline, [group], (groups, 1, 1))], 1)
    flops = groups * 256 * 1024 * 64 * 2
    return {"workgroups": groups, "us": round(sec * 1e6, 1), "tflops": round(flops / sec / 1e12, 2)}


def run_shape(bench: Bench, name: str, fmt: str, rows: int, cols: int, flags: int, tokens: int, args, rng) -> list[dict]:
    ctx = bench.ctx
    silu = bool(flags & LINEAR_SILU)
    x = rng.standard_normal((tokens, cols * (2 if silu else 1)), dtype=np.float32)
    bias = rng.standard_normal(rows, dtype=np.float32) * 0.1
    residual = rng.standard_normal((tokens, rows), dtype=np.float32)
    nw = (1.0 + 0.1 * rng.standard_normal(cols, dtype=np.float32)).astype(np.float32)
    if fmt in ("f16", "f32"):
        padded = -(-cols // 8) * 8 if fmt == "f16" else cols
        dt = np.float16 if fmt == "f16" else np.float32
        wd = np.zeros((rows, padded), dt)
        wd[:, :cols] = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.05).astype(dt)
        dense = wd[:, :cols].astype(np.float32)
        wa_data, wb_data, nbytes = wd, None, wd.nbytes
    else:
        rep = _quant_weight(fmt.upper(), rows, cols, rng)
        from kjarni.gpu import quant

        dense = quant.dequantize_repacked(rep).astype(np.float32)
        wa_data, wb_data, nbytes = rep.w_a, rep.w_b, rep.w_a.nbytes + rep.w_b.nbytes
    copies = int(max(1, min(args.max_copies, -(-args.l2_bytes // nbytes))))
    wa, sa = bench.buffer(wa_data, copies)
    wb, sb = bench.buffer(wb_data, copies) if wb_data is not None else (ctx.dummy, 256)
    xb, _ = bench.buffer(x)
    bb, _ = bench.buffer(bias)
    rb, _ = bench.buffer(residual)
    nb_, _ = bench.buffer(nw)
    usage = bench.wgpu.BufferUsage.STORAGE | bench.wgpu.BufferUsage.COPY_SRC | bench.wgpu.BufferUsage.COPY_DST
    yb = bench.dev.create_buffer(size=max(256, rows * tokens * 4), usage=usage)
    pb = bench.dev.create_buffer(size=max(256, 6 * rows * tokens * 4), usage=usage)  # split-K partials, S <= 6
    params = ctx.uniform(LINEAR.pack(rows=rows, cols=cols, tokens=tokens, flags=flags, row_offset=0, y_stride=rows, eps=EPS))
    xv = x[:, :cols]
    if silu:
        xv = xv / (1.0 + np.exp(-xv)) * x[:, cols:]
    ref = (xv * nw if flags & LINEAR_NORM else xv) @ dense.T
    if flags & LINEAR_NORM:
        ref = ref / np.sqrt(np.mean(xv * xv, axis=1, keepdims=True) + EPS)
    if flags & LINEAR_BIAS:
        ref = ref + bias
    if flags & LINEAR_RESIDUAL:
        ref = ref + residual
    scale = float(np.abs(ref).max()) + 1e-6
    layout = ctx.layout(LINEAR_KINDS)[0]

    def bind(par, x_, w, y_, res=True):
        return [bench.dev.create_bind_group(layout=layout, entries=[
            {"binding": b, "resource": {"buffer": buf, "offset": off, "size": size}} for b, (buf, off, size) in enumerate([
                (par, 0, par.size), (x_, 0, x_.size), (wa, i * sa, sa) if w else (ctx.dummy, 0, 256),
                (wb, (i * sb) if wb is not ctx.dummy else 0, sb if wb is not ctx.dummy else 256) if w else (ctx.dummy, 0, 256),
                (bb, 0, bb.size) if res else (ctx.dummy, 0, 256), (rb, 0, rb.size) if res else (ctx.dummy, 0, 256),
                (nb_, 0, nb_.size), (y_, 0, y_.size)])]) for i in range(copies)]

    groups = bind(params, xb, True, yb)
    picked = ops_choice(bench, rows, tokens, cols, flags)
    flops = 2.0 * tokens * rows * cols
    results = []
    configs = [(c, u, None) for u in ((False, True) if args.unchecked else (False,)) for c in CONFIGS]
    if not flags & LINEAR_NORM:
        configs += [(c, False, None) for c in SPLIT_CONFIGS]
    if args.probe:
        configs += [(c, False, probe) for c in CONFIGS for probe in PROBES]
    for cfg, unchecked, probe in configs:
        tm, tn, bk, ks, splits = cfg
        if matmul_workgroup_bytes(tm, tn, bk, ks) > ctx.max_workgroup_storage:
            continue  # more workgroup memory than this device allows
        label = f"TM={tm} TN={tn} BK={bk} KSPLIT={ks} S={splits}" + (" unchecked" if unchecked else "") + (f" probe={probe}" if probe else "")
        grid = (-(-rows // (8 * tn)), -(-tokens // (8 * tm)), splits)
        try:
            source = None
            if probe:
                source = kernels.source("matmul_" + fmt, frozenset({"subgroup"} if ctx.has_subgroups else ()))
                for old, new in PROBES[probe]:
                    assert old in source, old
                    source = source.replace(old, new)
            pipeline = ctx.pipeline("matmul_" + fmt + (f"_{probe}" if probe else ""), LINEAR_KINDS,
                                    constants={"TM": tm, "TN": tn, "BK": bk, "KSPLIT": ks}, unchecked=unchecked, source=source)
            if splits == 1:
                steps = [(pipeline, groups, grid)]
            else:
                p_params = ctx.uniform(LINEAR.pack(rows=rows, cols=cols, tokens=tokens, flags=flags & LINEAR_SILU,
                                                   row_offset=0, y_stride=rows, eps=EPS))
                r_params = ctx.uniform(LINEAR.pack(rows=rows, cols=splits, tokens=tokens, flags=flags & (LINEAR_BIAS | LINEAR_RESIDUAL),
                                                   row_offset=0, y_stride=rows, eps=EPS))
                reduce = ctx.pipeline("matmul_reduce", LINEAR_KINDS)
                steps = [(pipeline, bind(p_params, xb, True, pb, res=False), grid),
                         (reduce, bind(r_params, pb, False, yb), (-(-rows // 256), tokens, 1))]
            enc = bench.dev.create_command_encoder()
            cp = enc.begin_compute_pass()
            for pipe, gs, gr in steps:
                cp.set_pipeline(pipe)
                cp.set_bind_group(0, gs[0])
                cp.dispatch_workgroups(*gr)
            cp.end()
            bench.dev.queue.submit([enc.finish()])
            y = np.frombuffer(bench.dev.queue.read_buffer(yb, 0, rows * tokens * 4), np.float32).reshape(tokens, rows)
            bench.dev.queue.write_buffer(yb, 0, np.zeros(rows * tokens, np.float32))
            err = float(np.abs(y - ref).max()) / scale
            sec = time_steps(bench, steps, copies)
            results.append({"shape": name, "format": fmt, "variant": label, "config": list(cfg), "unchecked": unchecked,
                            "us": round(sec * 1e6, 1), "tflops": round(flops / sec / 1e12, 2),
                            "rel_err": float(f"{err:.2e}"), "ok": err < 1e-4 or bool(probe), "grid": list(grid),
                            "ops": tuple(cfg) == picked and not unchecked})
        except Exception as exc:  # noqa: BLE001 (a variant that fails must not end the sweep)
            results.append({"shape": name, "format": fmt, "variant": label, "error": str(exc)[:300]})
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", default=None)
    parser.add_argument("--formats", default="f16")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--unchecked", action="store_true", help="also time every variant without naga's runtime checks")
    parser.add_argument("--probe", action="store_true", help="also time diagnostic kernels without loads / barriers in the step loop")
    parser.add_argument("--configs", default=None, help="only these TM,TN,BK,KSPLIT,S tuples, separated by ';'")
    parser.add_argument("--reps", type=int, default=20, help="dispatches per timed pass")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--l2-bytes", type=int, default=128 << 20, help="bytes of weight copies cycled through")
    parser.add_argument("--max-copies", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="small shapes, few reps (CPU adapters)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.reps, args.passes, args.max_copies, args.tokens = 1, 1, 1, min(args.tokens, 40)
    bench = Bench(args)
    rng = np.random.default_rng(0)
    report = {"adapter": bench.ctx.description, "tokens": args.tokens, "results": []}
    if args.configs:
        CONFIGS[:] = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
        SPLIT_CONFIGS[:] = [c for c in CONFIGS if c[4] > 1]
        CONFIGS[:] = [c for c in CONFIGS if c[4] == 1]
    for _ in range(3):  # the first passes after start-up run slow: warm the GPU up first
        report["fma_peak"] = fma_peak(bench, 8 if args.quick else 132 * 16)
    print("FMA peak:", json.dumps(report["fma_peak"]), file=sys.stderr, flush=True)
    for name in args.shapes.split(","):
        rows, cols, flags = SHAPES[name]
        if args.quick:
            rows, cols = min(rows, 200), min(cols, 300)
        for fmt in args.formats.split(","):
            t0 = time.perf_counter()
            report["results"].extend(run_shape(bench, name, fmt, rows, cols, flags, args.tokens, args, rng))
            print(f"# {name} {fmt}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    good = [r for r in report["results"] if r.get("ok") and "probe" not in r["variant"]]
    best, picked = {}, {}
    for r in good:
        k = f"{r['shape']} {r['format']}"
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = r
        if r["ops"]:
            picked[k] = r
    report["best"] = {k: {"variant": v["variant"], "us": v["us"], "tflops": v["tflops"]} for k, v in best.items()}
    report["ops"] = {k: {"variant": v["variant"], "us": v["us"], "tflops": v["tflops"]} for k, v in picked.items()}
    for fmt in args.formats.split(","):
        report.setdefault("layer_ms", {})[fmt] = {
            "ops": round(sum(v["us"] for k, v in picked.items() if k.endswith(" " + fmt)) / 1e3, 3),
            "best": round(sum(v["us"] for k, v in best.items() if k.endswith(" " + fmt)) / 1e3, 3),
        }
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    for k in best:
        ops = picked.get(k)
        print(f"  {k:14s} best {best[k]['variant']:36s} {best[k]['us']:8.1f} us {best[k]['tflops']:6.2f} TF/s"
              + (f" | ops {ops['variant']} {ops['us']:.1f} us" if ops else ""), file=sys.stderr)
    bad = [r["variant"] + " " + r["shape"] for r in report["results"] if not r.get("ok")]
    print(f"CHECK: {len(report['results']) - len(bad)} of {len(report['results'])} variants match numpy"
          + (f"; failed or errored: {bad}" if bad else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
