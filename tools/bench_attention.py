"""Benchmark ``NumpyOps.attention`` alone on Qwen2.5-0.5B's head shapes. Prints JSON.

Random keys, values and queries (2 kv heads of 64, 7 query heads each, 24 layers' worth of calls
counted as one call times 24): a cold prefill of ``--tokens`` rows in one call, the 64-row tail
of the same prompt after a cached head (what ``tools/bench_prefix_cache.py`` times), and one-row
decode steps at that length. Needs no model file, so it runs on any machine:

    .venv/bin/python tools/bench_attention.py [--tokens 2048] [--repeats 3]

``--check`` also asserts that the tail and decode rows equal the cold prefill's bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from kjarni.numpy_ops import NumpyOps

KV_HEADS, GROUPS, HEAD_DIM, LAYERS = 2, 7, 64, 24


def best_of(repeats: int, call) -> tuple[float, np.ndarray]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--tail", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    ops = NumpyOps()
    cache = ops.new_kv_cache(1, KV_HEADS, HEAD_DIM, args.tokens + 1)
    cache.keys[0] = rng.standard_normal(cache.keys.shape[1:], dtype=np.float32)
    cache.values[0] = rng.standard_normal(cache.values.shape[1:], dtype=np.float32)
    q = rng.standard_normal((args.tokens, KV_HEADS * GROUPS * HEAD_DIM), dtype=np.float32)
    head = args.tokens - args.tail

    cold, whole = best_of(args.repeats, lambda: ops.attention(q, cache, 0, 0))
    tail, rows = best_of(args.repeats, lambda: ops.attention(q[head:], cache, 0, head))
    decode, row = best_of(args.repeats * 5, lambda: ops.attention(q[-1:], cache, 0, args.tokens - 1))
    if args.check:
        assert np.array_equal(rows, whole[head:]) and np.array_equal(row, whole[-1:])
    print(json.dumps({
        "shapes": {"kv_heads": KV_HEADS, "groups": GROUPS, "head_dim": HEAD_DIM, "layers": LAYERS},
        "tokens": args.tokens,
        "cold_prefill_seconds_24_layers": round(LAYERS * cold, 3),
        f"tail_{args.tail}_rows_seconds_24_layers": round(LAYERS * tail, 4),
        "decode_ms_per_token_24_layers": round(1000 * LAYERS * decode, 2),
        "tail_and_decode_bit_identical_to_cold": bool(np.array_equal(rows, whole[head:])
                                                      and np.array_equal(row, whole[-1:])),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "numpy": np.__version__,
    }, indent=1))


if __name__ == "__main__":
    main()
