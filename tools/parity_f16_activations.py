"""How far the tensor-core prefill's math (activations rounded to f16 before each prefill product,
f32 sums: NumpyOps(activations="f16")) is from the float32 reference, on a real model, on the CPU.
Prints JSON: per prompt position, top-1 agreement and the largest logit difference; then greedy
tokens after the prompt (decode rows stay f32, as on the GPU, which rounds only products of more
than GpuTuning.matvec_max_tokens rows).

    python tools/parity_f16_activations.py ~/.cache/kjarni/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf

``--f16-weights``: the weight matrices dequantized and rounded to f16 too (NumpyOps(weight_format="f16")),
the math of the quantized tensor-core prefill (GpuTuning.tc_quant: each weight tile dequantized to f16
in workgroup memory); its decode rows then use those f16 weights too, where the GPU's one-token
products read the quantized weights (with int8 activations), so read the prompt figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years",
    "def fibonacci(n: int) -> list[int]:\n    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n    result = []\n"
    "    a, b = 0, 1\n    for _ in range(n):\n",
]


def main() -> None:
    from kjarni.gpu.tuning import GpuTuning
    from kjarni.loader import load_model
    from kjarni.numpy_ops import NumpyOps

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--f16-weights", action="store_true", help="also round the (dequantized) weight matrices to f16")
    args = parser.parse_args()
    min_tokens = GpuTuning().matvec_max_tokens + 1
    ref = load_model(args.model, ops=NumpyOps())
    weight_format = "f16" if args.f16_weights else "f32"
    f16 = load_model(args.model, ops=NumpyOps(weight_format=weight_format, activations="f16", f16_activation_min_tokens=min_tokens))
    report = {"model": args.model, "f16_activation_min_tokens": min_tokens, "weights": weight_format, "prompts": []}
    for prompt in PROMPTS:
        ids = ref.tokenizer.encode(prompt)
        caches = [m.model.new_cache(len(ids) + args.steps) for m in (ref, f16)]
        logits = [m.model.ops.read(m.model.forward(ids, c, logits="all")) for m, c in zip((ref, f16), caches)]
        diff = np.abs(logits[0] - logits[1])
        top1 = np.argmax(logits[0], axis=1) == np.argmax(logits[1], axis=1)
        tokens = [[], []]
        last = [int(np.argmax(logits[0][-1])), int(np.argmax(logits[1][-1]))]
        step_diff = []
        for _ in range(args.steps):
            for k in (0, 1):
                tokens[k].append(last[k])
            outs = [m.model.ops.read(m.model.forward([tokens[0][-1]], c))[0] for m, c in zip((ref, f16), caches)]
            step_diff.append(float(np.abs(outs[0] - outs[1]).max()))
            last = [int(np.argmax(o)) for o in outs]
        report["prompts"].append({
            "prompt_tokens": len(ids),
            "prompt_top1_agreement": float(top1.mean()),
            "prompt_max_abs_logit_diff": float(diff.max()),
            "prompt_mean_abs_logit_diff": float(diff.mean()),
            "logit_range": float(np.abs(logits[0]).max()),
            "decode_max_abs_logit_diff": max(step_diff) if step_diff else None,
            "greedy_tokens_identical": tokens[0] == tokens[1],
        })
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
