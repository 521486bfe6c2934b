"""Sweep the prefill matmul's tile configurations: TFLOP/s per (shape, format, variant) on this GPU.

For each of Qwen2.5-0.5B's four prefill products at ``--tokens`` tokens (default 512; qkv
1152x896 with norm + bias, o_proj 896x896 with residual, gate_up 9728x896 with norm, down
896x4864 reading silu(gate) * up plus residual), every configuration of ``matmul.tmpl.wgsl``
(shaders/matmul.tmpl.wgsl: TM x TN threads of 8x8 outputs, BK columns per step, KSPLIT thread
groups splitting K, S workgroups splitting K with matmul_reduce after them, for products without a
fused norm) is timed with timestamp queries around one compute pass of ``--reps`` back-to-back
dispatches (median of ``--passes``), each dispatch on another copy of the weight, and checked
against numpy; configurations needing more workgroup memory than the device has are skipped.
``--configs "TM,TN,BK,KSPLIT,S;..."`` sweeps only those. Variants are compiled as the library
compiles them (GpuTuning.matmul_unchecked: without naga's runtime checks); ``--unchecked`` times
every variant both ways (WgpuContext.pipeline(unchecked=...)); ``--probe`` adds
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
from kjarni.gpu.linear import LINEAR_KINDS, matmul_workgroup_bytes
from kjarni.gpu.ops import WgpuOps
from kjarni.gpu.params import LINEAR, LINEAR_BIAS, LINEAR_NORM, LINEAR_RESIDUAL, LINEAR_SILU
from kjarni.gpu.tuning import GpuTuning
from tools.sweep_matvec import EPS, Bench

MODELS = {  # model: {product: (rows, cols, flags)}, the prefill products of one layer
    "qwen2.5-0.5b": {
        "qkv": (1152, 896, LINEAR_NORM | LINEAR_BIAS),
        "o_proj": (896, 896, LINEAR_RESIDUAL),
        "gate_up": (9728, 896, LINEAR_NORM),
        "down": (896, 4864, LINEAR_SILU | LINEAR_RESIDUAL),
    },
    "qwen2.5-1.5b": {
        "qkv": (2048, 1536, LINEAR_NORM | LINEAR_BIAS),
        "o_proj": (1536, 1536, LINEAR_RESIDUAL),
        "gate_up": (17920, 1536, LINEAR_NORM),
        "down": (1536, 8960, LINEAR_SILU | LINEAR_RESIDUAL),
    },
}

# (TM, TN, BK, KSPLIT, NBUF, S): BK a multiple of 8, TN / 2 .. min(TM, TN); KSPLIT BK NBUF >= 2
# max(TM, TN) when KSPLIT > 1; NBUF 2 double-buffers the tiles (one barrier a step); S workgroups
# splitting K (grid z, then matmul_reduce; not for products with a fused norm).
CONFIGS = [
    (16, 16, 16, 2, 1, 1), (16, 16, 16, 1, 1, 1), (16, 16, 16, 1, 2, 1), (16, 16, 8, 2, 2, 1),
    (8, 16, 8, 4, 1, 1), (8, 16, 8, 2, 2, 1), (8, 16, 8, 1, 2, 1), (8, 16, 8, 1, 1, 1),
    (16, 8, 8, 4, 1, 1), (16, 8, 8, 2, 2, 1), (8, 8, 8, 4, 1, 1), (8, 8, 8, 4, 2, 1), (8, 8, 8, 2, 2, 1),
]
DEFAULTS = GpuTuning()
SPLIT_CONFIGS = [(*c, s) for c in ((8, 16, 8, 4, 1), (8, 16, 8, 2, 2), (8, 8, 8, 4, 2), (16, 16, 16, 1, 2)) for s in (2, 3, 4)]

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
_LOADS = (("r.x = fetch_x(m0 + lxp, ts, kn + lxk);", ""), ("r.w = fetch_w8(lr, (kn + lwk) / 8u);", ""))
_BARRIERS = (("workgroupBarrier();  // the previous step's reads are done", ""),
             ("workgroupBarrier();\n            // Next step's", "// Next step's"))
PROBES = {"noload": _LOADS, "noload_nobarrier": _LOADS + _BARRIERS}


def ops_choice(bench: Bench, rows: int, tokens: int, cols: int, flags: int) -> tuple[int, int, int, int, int, int]:
    """(TM, TN, BK, KSPLIT, S) that kjarni/gpu/linear.py's `Linear.plan` dispatches for this product."""
    ops = WgpuOps(bench.ctx)
    return (*ops.matmul_config(rows, tokens, cols), ops.linear_kernels.matmul_splits(rows, tokens, cols, flags, rows))


def fma_peak(bench: Bench, groups: int) -> dict:
    ctx, dev = bench.ctx, bench.dev
    pipeline = ctx.pipeline("fma_peak", ("rw",), source=FMA_PEAK)
    out = dev.create_buffer(size=groups * 256 * 16, usage=bench.wgpu.BufferUsage.STORAGE)
    group = dev.create_bind_group(layout=ctx.layout(("rw",))[0], entries=[
        {"binding": 0, "resource": {"buffer": out, "offset": 0, "size": out.size}}])
    sec = bench.time(pipeline, [group], (groups, 1, 1))
    flops = groups * 256 * 1024 * 64 * 2
    return {"workgroups": groups, "us": round(sec * 1e6, 1), "tflops": round(flops / sec / 1e12, 2)}


def run_shape(bench: Bench, name: str, fmt: str, rows: int, cols: int, flags: int, tokens: int, args, rng) -> list[dict]:
    ctx = bench.ctx
    case = bench.linear_case(fmt, rows, cols, tokens, flags, rng, partial_bytes=6 * rows * tokens * 4)  # split-K partials, S <= 6
    params = ctx.uniform(LINEAR.pack(rows=rows, cols=cols, tokens=tokens, flags=flags, row_offset=0, y_stride=rows, eps=EPS))
    groups = case.groups(params, case.x, case.y)
    picked = ops_choice(bench, rows, tokens, cols, flags)
    flops = 2.0 * tokens * rows * cols
    results = []
    checks = (False, True) if args.unchecked else (DEFAULTS.matmul_unchecked,)
    configs = [(c, u, None) for u in checks for c in CONFIGS]
    if not flags & LINEAR_NORM:
        configs += [(c, u, None) for u in checks for c in SPLIT_CONFIGS]
    if args.probe:
        configs += [(c, False, probe) for c in CONFIGS for probe in PROBES]
    for cfg, unchecked, probe in configs:
        tm, tn, bk, ks, nbuf, splits = cfg
        if matmul_workgroup_bytes(tm, tn, bk, ks, nbuf) > ctx.max_workgroup_storage:
            continue  # more workgroup memory than this device allows
        label = f"TM={tm} TN={tn} BK={bk} KSPLIT={ks} NBUF={nbuf} S={splits}" + (" unchecked" if unchecked else "") + (f" probe={probe}" if probe else "")
        grid = (-(-rows // (8 * tn)), -(-tokens // (8 * tm)), splits)
        try:
            source = kernels.template("matmul", fmt if fmt in ("f16", "f32") else fmt.upper())
            for old, new in PROBES.get(probe, ()):
                assert old in source, old
                source = source.replace(old, new)
            pipeline = ctx.pipeline("matmul." + fmt + (f"_{probe}" if probe else ""), LINEAR_KINDS,
                                    constants={"TM": tm, "TN": tn, "BK": bk, "KSPLIT": ks, "NBUF": nbuf}, unchecked=unchecked,
                                    source=source)
            if splits == 1:
                steps = [(pipeline, groups, grid)]
            else:
                p_params = ctx.uniform(LINEAR.pack(rows=rows, cols=cols, tokens=tokens, flags=flags & LINEAR_SILU,
                                                   row_offset=0, y_stride=rows, eps=EPS))
                r_params = ctx.uniform(LINEAR.pack(rows=rows, cols=splits, tokens=tokens, flags=flags & (LINEAR_BIAS | LINEAR_RESIDUAL),
                                                   row_offset=0, y_stride=rows, eps=EPS))
                reduce = ctx.pipeline("matmul_reduce", LINEAR_KINDS)
                steps = [(pipeline, case.groups(p_params, case.x, case.partials, bias_residual=False), grid),
                         (reduce, case.groups(r_params, case.partials, case.y, weight=False), (-(-rows // 256), tokens, 1))]
            err = bench.check(case, steps)
            sec = bench.time_steps(steps, case.copies)
            results.append({"shape": name, "format": fmt, "variant": label, "config": list(cfg), "unchecked": unchecked,
                            "us": round(sec * 1e6, 1), "tflops": round(flops / sec / 1e12, 2),
                            "rel_err": float(f"{err:.2e}"), "ok": err < 1e-4 or bool(probe), "grid": list(grid),
                            "ops": tuple(cfg) == picked and unchecked == DEFAULTS.matmul_unchecked})
        except Exception as exc:  # noqa: BLE001 (a variant that fails must not end the sweep)
            results.append({"shape": name, "format": fmt, "variant": label, "error": str(exc)[:300]})
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        if args.out:  # as it goes: a run cut short keeps what it measured
            with open(args.out + ".jsonl", "a") as f:
                f.write(json.dumps(results[-1]) + "\n")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", default=None)
    parser.add_argument("--formats", default="f16")
    parser.add_argument("--model", default="qwen2.5-0.5b", help=f"one of {sorted(MODELS)}, or several separated by ','")
    parser.add_argument("--shapes", default="qkv,o_proj,gate_up,down")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--unchecked", action="store_true", help="also time every variant without naga's runtime checks")
    parser.add_argument("--probe", action="store_true", help="also time diagnostic kernels without loads / barriers in the step loop")
    parser.add_argument("--configs", default=None, help="only these TM,TN,BK,KSPLIT,NBUF,S tuples, separated by ';'")
    parser.add_argument("--quant-configs", default=None, help="the same for the quantized formats (default: --configs)")
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
        SPLIT_CONFIGS[:] = [c for c in CONFIGS if c[5] > 1]
        CONFIGS[:] = [c for c in CONFIGS if c[5] == 1]
    all_configs = (list(CONFIGS), list(SPLIT_CONFIGS))
    quant_configs = all_configs
    if args.quant_configs:
        qc = [tuple(int(v) for v in c.split(",")) for c in args.quant_configs.split(";")]
        quant_configs = ([c for c in qc if c[5] == 1], [c for c in qc if c[5] > 1])
    for _ in range(3):  # the first passes after start-up run slow: warm the GPU up first
        report["fma_peak"] = fma_peak(bench, 8 if args.quick else 132 * 16)
    print("FMA peak:", json.dumps(report["fma_peak"]), file=sys.stderr, flush=True)
    for model in args.model.split(","):
        for shape in args.shapes.split(","):
            rows, cols, flags = MODELS[model][shape]
            name = f"{model} {shape}" if "," in args.model else shape
            if args.quick:
                rows, cols = min(rows, 200), min(cols, 512)  # whole blocks of every format
            for fmt in args.formats.split(","):
                CONFIGS[:], SPLIT_CONFIGS[:] = all_configs if fmt in ("f16", "f32") else quant_configs
                t0 = time.perf_counter()
                report["results"].extend(run_shape(bench, name, fmt, rows, cols, flags, args.tokens, args, rng))
                report.setdefault("shapes", {})[name] = [rows, cols]
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
    # The winners as WgpuOps.matmul_configs entries, per format (tools/bench_gpu.py --tuning reads
    # "matmul_configs": the f16 ones, or --tuning-format's).
    for k, v in best.items():
        name, fmt = k.rsplit(" ", 1)
        report.setdefault("matmul_configs_by_format", {}).setdefault(fmt, []).append([*report["shapes"][name], *v["config"]])
    report["matmul_configs"] = report.get("matmul_configs_by_format", {}).get("f16", [])
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
