"""Per prefill product: the integer-dot path (matmul_dot_prep + matmul_dot, GpuTuning.matmul_int_dot)
against the SIMT matmul kjarni runs by default, on one runtime (issue 12: wgpu-native's prefill is
f32 SIMT; llama.cpp's Vulkan backend multiplies quantized weights by int8-quantized activations
with the GPU's integer dot product where it has no cooperative matrices). Prints JSON, a line per
Qwen2.5 product and weight format.

Each product is recorded through `WgpuOps` as the prefill records it (random weights in the
format, ``--tokens`` random activations, tensor cores off), once per variant: ``simt`` (the
default), ``dot_t4`` / ``dot_t8`` (matmul_int_dot on, each tile, the automatic K split) and
``dot_t4_unchecked``; each list of dispatches is timed warm, side by side (tools/gputime.py's
time_lists), with its kernels named. Errors: each variant's output against
NumpyOps(quantize_activations=True, quantized_prefill_min_tokens=..) (the int8 path's reference)
and against float32 numpy, relative to max |y|.

    python tools/probe_idot.py [--runtime dawn] [--model qwen2.5-1.5b] [--formats q8_0,q4_k] [--tokens 512]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = {"qwen2.5-0.5b": (896, 4864, 1152), "qwen2.5-1.5b": (1536, 8960, 2048)}
VARIANTS = {
    "simt": {"matmul_int_dot": False},  # the integer-dot path is the default since 0294b8b
    "dot_t4": {"matmul_int_dot": True, "matmul_dot_tile": 4},
    "dot_t8": {"matmul_int_dot": True, "matmul_dot_tile": 8},
    "dot_t4_unchecked": {"matmul_int_dot": True, "matmul_dot_tile": 4, "matmul_dot_unchecked": True},
}


def main() -> None:
    from bench_gpu import random_quant
    from gputime import record, time_lists

    from kjarni.gpu import GpuTensor, WgpuOps
    from kjarni.gpu.context import WgpuContext
    from kjarni.numpy_ops import NumpyOps

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", default=None, help="wgpu (wgpu-native, the default) or dawn")
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    parser.add_argument("--formats", default="q8_0,q4_k", help="bench_gpu formats: q8_0, q4_k (Q5_0 where rows are not of 256)")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    ctx = WgpuContext(None, runtime=args.runtime)
    if not ctx.has_timestamps:
        raise SystemExit("probe_idot: this adapter has no timestamp queries")
    hidden, inter, qkv = MODELS[args.model]
    rng = np.random.default_rng(0)
    tokens = args.tokens
    ref = NumpyOps(quantize_activations=True, quantized_prefill_min_tokens=2)
    plain = NumpyOps()
    for fmt in args.formats.split(","):
        for name, (rows, cols) in {"qkv": (qkv, hidden), "o_proj": (hidden, hidden), "gate_up": (2 * inter, hidden),
                                   "down": (hidden, inter)}.items():
            qt = random_quant(fmt if fmt != "q4_k" or cols % 256 == 0 else "q5_0", (rows, cols), rng)
            x = rng.standard_normal((tokens, cols), dtype=np.float32)
            w = ref.weight(qt, name=f"{name}.weight")
            want, exact = ref.linear(x, w), plain.linear(x, w)
            lists, errors, kernels = {}, {}, {}
            for variant, fields in VARIANTS.items():
                ops = WgpuOps(ctx, weight_format="f16")
                ops.tuning.tensor_cores = False
                for field, value in fields.items():
                    setattr(ops.tuning, field, value)
                weight = ops.weight(qt, name=f"{name}.weight")
                xt = GpuTensor(ctx.scratch(x.nbytes), x.shape)
                ctx.queue.write_buffer(xt.buffer, 0, x)
                calls, out = record(ctx, lambda ops=ops, xt=xt, weight=weight: ops.linear(xt, weight))
                got = ops.read(out)
                scale = float(np.abs(exact).max())
                errors[variant] = {"matched": float(f"{np.abs(got - want).max() / scale:.2e}"),
                                   "float32": float(f"{np.abs(got - exact).max() / scale:.2e}")}
                kernels[variant] = [p.kjarni_name.split(":")[0] for p, _, _ in calls]
                lists[variant] = calls
            times = time_lists(ctx, lists, args.passes, args.reps, 0.5)
            flops = 2.0 * tokens * rows * cols
            print(json.dumps({"shape": name, "format": qt.ggml_type.name, "rows": rows, "cols": cols, "tokens": tokens,
                              "runtime": ctx.runtime.name, "adapter": ctx.description,
                              "us": {k: round(1e6 * t, 1) for k, t in times.items()},
                              "tflops": {k: round(flops / t / 1e12, 1) for k, t in times.items()},
                              "speedup_vs_simt": {k: round(times["simt"] / t, 2) for k, t in times.items() if k != "simt"},
                              "rel_err": errors, "kernels": kernels}), flush=True)


if __name__ == "__main__":
    main()
