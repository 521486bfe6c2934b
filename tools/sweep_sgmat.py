"""Sweep the tensor-core prefill matmuls on a Dawn adapter with f16 subgroup matrices: per Qwen2.5
prefill product and tile, GPU time (timestamp queries; each variant is compiled, checked and its
dispatches recorded first, then every variant of a shape is timed in one command buffer on a warm
GPU: ``--warm-ms`` of work, then ``--passes`` rounds of a pass per variant of ``--reps`` products back
to back, the median round counting; the f16 activation prep and any K-split reduce included; before
the seventeenth session each product was timed right after its compile, while an H100 idled at
345 MHz, which ranked the tiles wrongly), TFLOP/s and the error against numpy with the same f16 rounding of the
activations (NumpyOps(activations="f16")'s math); the SIMT kernel (matmul_f16) beside it. Tiles of
matmul_tc.tmpl.wgsl (``--tc-tiles``, kernels.TC_TILES) and of the first kernel, matmul_sgmat.tmpl.wgsl
(``--tiles``). ``--format q8_0`` (or q4_k, q5_0, ..) sweeps the quantized variants of matmul_tc
(SHARED tiles: the weight tile dequantized to f16 in workgroup memory) against the SIMT matmul of
that format, on random blocks (bench_gpu.random_quant: Q5_0 where a row is not whole 256-blocks), the
reference rounding the dequantized weight to f16 too. Prints JSON.

    python tools/sweep_sgmat.py                       # Qwen2.5-0.5B shapes, 512 tokens, every tile
    python tools/sweep_sgmat.py --model qwen2.5-1.5b --tiles none --tc-tiles 4x2_2x2_k2_d,2x2_2x2_k2_s
    python tools/sweep_sgmat.py --format q8_0 --out q8.json   # quantized weights (matmul_tc only)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gputime import record, time_lists  # noqa: E402
from kjarni.gpu import kernels  # noqa: E402

MODELS = {"qwen2.5-0.5b": (896, 4864, 1152), "qwen2.5-1.5b": (1536, 8960, 2048)}
EPS = 1e-6


def shapes(model: str) -> dict[str, tuple[int, int, str]]:
    hidden, inter, qkv = MODELS[model]
    return {"qkv": (qkv, hidden, "norm+bias"), "o_proj": (hidden, hidden, "residual"),
            "gate_up": (2 * inter, hidden, "norm"), "down": (hidden, inter, "silu+residual")}


def reference(x: np.ndarray, w16: np.ndarray, kind: str, nw, b, r) -> np.ndarray:
    """f16-rounded activations times the f16 weight in float64, then bias / residual."""
    if "silu" in kind:
        half = x.shape[1] // 2
        g, u = x[:, :half], x[:, half:]
        x = g / (np.float32(1) + np.exp(-g)) * u
    if "norm" in kind:
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(EPS)) * nw
    a = x.astype(np.float16).astype(np.float64)
    y = a @ w16.astype(np.float64).T
    if b is not None:
        y += b
    if r is not None:
        y += r
    return y


def product_inputs(rng: np.random.Generator, tokens: int, rows: int, cols: int, kind: str):
    """Random inputs of one prefill product of ``shapes``: the activations ([gate | up] where it
    applies silu_mul), and its norm weight, bias and residual where ``kind`` has them (else None)."""
    xin = rng.standard_normal((tokens, 2 * cols if "silu" in kind else cols), dtype=np.float32)
    nw = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32) if "norm" in kind else None
    b = (0.1 * rng.standard_normal(rows)).astype(np.float32) if "bias" in kind else None
    r = rng.standard_normal((tokens, rows), dtype=np.float32) if "residual" in kind else None
    return xin, nw, b, r


def product(ops, wsrc, name: str, kind: str, xin: np.ndarray, nw, b, r):
    """Uploads one prefill product's weight and inputs to ``ops``; returns a function recording the
    product as the model does (silu_mul, the fused norm, bias, residual) and returning y."""
    from kjarni.gpu import GpuTensor

    def upload(a: np.ndarray) -> GpuTensor:
        t = GpuTensor(ops.context.scratch(a.nbytes), a.shape)
        ops.context.queue.write_buffer(t.buffer, 0, np.ascontiguousarray(a, dtype=np.float32))
        return t

    weight = ops.weight(wsrc, name=f"{name}.weight")
    nwt = ops.weight(nw, name="norm.weight") if nw is not None else None
    bt = ops.weight(b, name=f"{name}.bias") if b is not None else None
    x = upload(xin)
    rt = upload(r) if r is not None else None

    def run():
        xx = ops.silu_mul(x) if "silu" in kind else x
        if nwt is not None:
            return ops.norm_linear(xx, nwt, EPS, weight, bt)
        return ops.linear(xx, weight, bt, rt)

    return run


def time_prepared(ctx, prepared: list[dict], where: dict, args, report: dict, best: dict) -> None:
    """Times the prepared variants of one shape (``where``) back to back on a warm GPU, reports each
    and keeps the fastest correct one in ``best``; empties ``prepared``."""
    if not prepared:
        return
    times = time_lists(ctx, {v["label"]: v["calls"] for v in prepared}, args.passes, args.reps, args.warm_ms * 1e-3)
    for v in prepared:
        us = 1e6 * times[v["label"]]
        entry = {**where, "kernel": v["label"], "us": round(us, 1),
                 "tflops": round(2 * args.tokens * where["rows"] * where["cols"] / us / 1e6, 1),
                 "rel_err": float(f"{v['err']:.2e}"), "ok": v["err"] < 2e-3, "kernels": v["ran"]}
        v["ops"].close()
        report["results"].append(entry)
        print(json.dumps(entry), file=sys.stderr, flush=True)
        family, tile, sp, tokens_first = v["variant"]
        if entry["ok"] and family and entry["us"] < best.get(where["shape"], {}).get("us", 1e30):
            best[where["shape"]] = dict(entry, family=family, tile=list(tile), splits=sp, tokens_first=tokens_first)
    prepared.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=10, help="products back to back in one timed pass")
    parser.add_argument("--passes", type=int, default=5, help="timed rounds over every variant of a shape (the median counts)")
    parser.add_argument("--warm-ms", type=float, default=500.0, help="GPU work before a shape's timed rounds (clocks)")
    parser.add_argument("--tiles", default="", help="matmul_sgmat: comma-separated BMxBNxBK_SMxSN (default: all; none: no tile)")
    parser.add_argument("--tc-tiles", default="", help="matmul_tc: comma-separated TMxTN_SMxSN_kKU_{d,s,t,p,w} (SHARED 0-3, 5; default: all; none: no tile)")
    parser.add_argument("--runtime", default="dawn", help="dawn; wgpu runs only the SIMT kernel (a smoke test)")
    parser.add_argument("--shapes", default="", help="comma-separated subset of qkv,o_proj,gate_up,down")
    parser.add_argument("--splits", default="auto", help="comma-separated K splits per tile: auto (WgpuOps' rule) and/or counts")
    parser.add_argument("--out", help="write the per-shape choice (JSON) here, for bench_gpu.py --sgmat-choice")
    parser.add_argument("--robust", action="store_true", help="without Dawn's disable_robustness/disable_workgroup_init")
    parser.add_argument("--format", default="f16", help="weights: f16, or a GGUF type (q8_0, q4_k, q5_0, ..)")
    parser.add_argument("--orders", default="rows", help="matmul_tc grid orders, comma-separated: rows (row tiles fastest) "
                        "and/or tokens (GpuTuning.tc_tokens_first; labels end in +tf)")
    args = parser.parse_args()

    from kjarni.gpu import WgpuContext, WgpuOps
    from kjarni.gpu.runtime import DAWN_FAST_DEVICE_TOGGLES

    dawn = args.runtime == "dawn"
    toggles = DAWN_FAST_DEVICE_TOGGLES if dawn and not args.robust else ()
    ctx = WgpuContext(runtime=args.runtime, dawn_device_toggles=toggles)
    sg = ctx.f16_matrix_subgroup
    report = {"adapter": ctx.description, "runtime": ctx.runtime.description, "f16_matrix_subgroup": sg,
              "toggles": [] if args.robust else list(DAWN_FAST_DEVICE_TOGGLES), "tokens": args.tokens, "results": []}
    if sg is None:
        report["note"] = "no f16 subgroup-matrix configuration on this adapter: SIMT only"
    tiles = [t for t in kernels.SGMAT_TILES if sg and kernels.sgmat_variant(*t, sg) in kernels.TEMPLATES["matmul_sgmat"]]
    if args.tiles:
        wanted = set(args.tiles.split(","))
        tiles = [t for t in tiles if kernels.sgmat_variant(*t, sg).rsplit("_sg", 1)[0] in wanted]
    quantized = args.format.lower() != "f16"
    if quantized:
        tiles = []  # the first kernel reads f16 weights only
    probe = kernels.TC_QUANT_FORMATS[0] if quantized else "f16"  # every quantized format has the same tiles
    tc_tiles = [t for t in kernels.TC_TILES if sg and kernels.tc_variant(*t, sg, probe) in kernels.TEMPLATES["matmul_tc"]
                and kernels.tc_workgroup_bytes(*t) <= ctx.max_workgroup_storage]
    if args.tc_tiles:
        wanted = set(args.tc_tiles.split(","))
        tc_tiles = [t for t in tc_tiles if kernels.tc_variant(*t, sg).rsplit("_sg", 1)[0] in wanted]
    report["format"] = args.format
    rng = np.random.default_rng(0)
    tokens = args.tokens

    best: dict[str, dict] = {}
    for name, (rows, cols, kind) in shapes(args.model).items():
        if args.shapes and name not in args.shapes.split(","):
            continue
        if quantized:
            import gguf
            from bench_gpu import random_quant

            qt = random_quant(args.format, (rows, cols), rng)
            fmt = kernels_format = gguf.GGMLQuantizationType(qt.ggml_type).name
            w16 = qt.dequantize().astype(np.float16)  # the kernel's one rounding of the dequantized weight
            wsrc = qt
        else:
            fmt = kernels_format = "f16"
            w16 = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.05).astype(np.float16)
            wsrc = w16.astype(np.float32)
        xin, nw, b, r = product_inputs(rng, tokens, rows, cols, kind)
        ref = reference(xin, w16, kind, nw, b, r)
        scale = float(np.abs(ref).max())
        splits_list = [None if v == "auto" else int(v) for v in args.splits.split(",")]
        variants = [("simt", None, None, None, False)]
        variants += [("sgmat." + kernels.sgmat_variant(*t, sg) + ("" if sp is None else f"_s{sp}"), "sgmat", t, sp, False)
                     for t in tiles for sp in splits_list]
        variants += [("tc." + kernels.tc_variant(*t, sg, kernels_format) + ("" if sp is None else f"_s{sp}") + ("+tf" if o == "tokens" else ""),
                      "tc", t, sp, o == "tokens")
                     for t in tc_tiles for sp in splits_list for o in args.orders.split(",")]
        prepared: list[dict] = []  # compiled, checked and recorded, timed together (`time_prepared`)
        where = {"shape": name, "rows": rows, "cols": cols, "format": fmt}
        for label, family, tile, sp, tokens_first in variants:
            ops = WgpuOps(ctx, weight_format="f16")
            ops.tuning.tensor_cores = ops.tuning.tc_quant = tile is not None
            ops.tuning.sgmat_splits = ops.tuning.tc_splits = sp
            ops.tuning.tc_tokens_first = tokens_first
            if family == "sgmat":
                ops.tuning.sgmat_tiles = {(rows, cols): tile}
            elif family == "tc":
                ops.tuning.sgmat_tiles = {}  # a shape named there runs the first kernel, whatever tc_tiles says
                ops.tuning.tc_tiles = {(rows, cols): tile}
                ops.tuning.tc_quant_tiles = {(fmt, rows, cols): tile}
            try:
                run = product(ops, wsrc, name, kind, xin, nw, b, r)
                y = ops.read(run())
                err = float(np.abs(y - ref).max()) / scale
                calls, out = record(ctx, run)  # the product's dispatches: prep, matmul, any K-split reduce
                ops.read(out)
                ran = sorted({p.kjarni_name.split(":")[0] for p, _, _ in calls})
                if family and not any(n.startswith("matmul_" + family + ".") for n in ran):
                    raise RuntimeError(f"{label} did not run (ran {ran})")
                # run and out hold the product's buffers (inputs, output) out of the scratch pool until it is timed
                prepared.append({"label": label, "variant": (family, tile, sp, tokens_first), "ops": ops, "calls": calls,
                                 "err": err, "ran": ran, "keep": (run, out)})
            except Exception as exc:  # noqa: BLE001 - reported per variant
                entry = {"shape": name, "kernel": label, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
                report["results"].append(entry)
                print(json.dumps(entry), file=sys.stderr, flush=True)
                # A GPU error can leave the context's encoder unusable: the variants prepared so far
                # are timed on it, and the next variant gets a new one.
                try:
                    time_prepared(ctx, prepared, where, args, report, best)
                except Exception as exc2:  # noqa: BLE001
                    print(json.dumps({"shape": name, "error": f"timing after an error: {exc2}"}), file=sys.stderr, flush=True)
                    prepared.clear()
                ctx = WgpuContext(runtime=args.runtime, dawn_device_toggles=toggles)
        time_prepared(ctx, prepared, where, args, report, best)
    report["best"] = {k: [v["kernel"], v["us"], v["tflops"]] for k, v in best.items()}
    # Per shape, what WgpuOps should run (bench_gpu.py --sgmat-choice): the fastest correct tile and
    # split, or the SIMT kernel where it was faster.
    choice = []
    formats = {e["shape"]: e["format"] for e in report["results"] if "format" in e}
    for name, (rows, cols, _) in shapes(args.model).items():
        if args.shapes and name not in args.shapes.split(","):
            continue
        simt = next((e for e in report["results"] if e["shape"] == name and e["kernel"] == "simt" and "us" in e), None)
        tc = best.get(name)
        if tc is None or (simt is not None and simt["us"] <= tc["us"]):
            choice.append({"rows": rows, "cols": cols, "format": formats.get(name, "f16"), "family": None, "tile": None, "splits": None})
        else:
            choice.append({"rows": rows, "cols": cols, "format": formats.get(name, "f16"), "family": tc["family"], "tile": tc["tile"],
                           "splits": tc["splits"], "tokens_first": tc["tokens_first"]})
    report["choice"] = choice
    if args.out:
        Path(args.out).write_text(json.dumps(choice))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
