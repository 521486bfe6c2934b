"""The tensor-core prefill (matmul_tc, GpuTuning.tensor_cores) on a real model against numpy: the GPU's
prompt logits, every position, against NumpyOps with the same f16 weights and the same f16 rounding
of the activations (NumpyOps(activations="f16"): tight per product, over a whole model a bound, as
f16 roundings that flip on the last bit of a sum compound over the layers; docs/benchmarks.md) and
against f32 activations (how far the rounding moves the logits). Needs an adapter with f16 subgroup matrices (Dawn). Prints JSON.

A quantized file's weights are dequantized and uploaded as f16 (the f16 tensor-core path), or with
``--quantized`` kept in their GGUF format (GpuTuning.tc_quant: each weight tile dequantized and
rounded to f16 in workgroup memory, the same values as numpy's f16 weights); ``matmul_kernels``
names the kernels that ran. The GPU's KV cache is float32 as numpy's (``--kv-format f16``: the
default of an f16-weight WgpuOps, one more rounding that numpy does not mirror).

    python tools/parity_tc.py model.gguf --runtime dawn --dawn-fast [--quantized]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity_f16_activations import PROMPTS  # noqa: E402


def main() -> None:
    from kjarni.gpu import WgpuContext, WgpuOps
    from kjarni.gpu.runtime import DAWN_FAST_DEVICE_TOGGLES
    from kjarni.loader import load_model
    from kjarni.numpy_ops import NumpyOps

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--runtime", default="dawn")
    parser.add_argument("--dawn-fast", action="store_true", help="Dawn's disable_robustness / disable_workgroup_init")
    parser.add_argument("--quantized", action="store_true", help="keep quantized weights quantized (tc_quant)")
    parser.add_argument("--kv-format", choices=("f32", "f16"), default="f32", help="the GPU's KV cache (numpy's is f32)")
    args = parser.parse_args()
    from kjarni.tensors import QuantTensor

    class F16Ops(WgpuOps):
        """f16 weights also for a quantized file (dequantized, then rounded to f16 as NumpyOps's f16 mode does)."""

        def weight(self, parts, *, name):
            listed = parts if isinstance(parts, (list, tuple)) else [parts]
            return super().weight([p.dequantize() if isinstance(p, QuantTensor) else p for p in listed], name=name)

    ctx = WgpuContext(runtime=args.runtime, dawn_device_toggles=DAWN_FAST_DEVICE_TOGGLES if args.dawn_fast else ())
    ops = (WgpuOps if args.quantized else F16Ops)(ctx, weight_format="f16", kv_format=args.kv_format)
    ops.tuning.tensor_cores = True
    ops.tuning.tc_quant = args.quantized
    min_tokens = ops.tuning.matvec_max_tokens + 1
    gpu = load_model(args.model, ops=ops)
    ref16 = load_model(args.model, ops=NumpyOps(weight_format="f16", activations="f16", f16_activation_min_tokens=min_tokens))
    ref32 = load_model(args.model, ops=NumpyOps(weight_format="f16"))
    report = {"model": args.model, "adapter": ctx.description, "runtime": ctx.runtime.description,
              "f16_matrix_subgroup": ctx.f16_matrix_subgroup, "quantized": args.quantized, "kv_format": args.kv_format, "prompts": []}
    for prompt in PROMPTS:
        ids = ref32.tokenizer.encode(prompt)
        ctx.profile(True)
        logits = [m.model.ops.read(m.model.forward(ids, m.model.new_cache(len(ids)), logits="all")) for m in (gpu, ref16, ref32)]
        kernels = sorted({n for n, _ in ctx.stats.kernel_times if n.startswith("matmul")})
        ctx.profile(False)
        entry = {"prompt_tokens": len(ids), "matmul_kernels": kernels, "logit_range": float(np.abs(logits[2]).max())}
        for name, ref in (("f16_activations", logits[1]), ("f32_activations", logits[2])):
            diff = np.abs(logits[0] - ref)
            entry[name] = {"max_abs_logit_diff": float(diff.max()), "mean_abs_logit_diff": float(diff.mean()),
                           "top1_agreement": float(np.mean(np.argmax(logits[0], 1) == np.argmax(ref, 1)))}
        diff = np.abs(logits[1] - logits[2])
        entry["numpy_f16_vs_f32_activations_max_abs_logit_diff"] = float(diff.max())
        report["prompts"].append(entry)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
