"""Benchmark a prefix-cache hit on the GPU against a cold prefill and a decode step. Prints JSON.

Random weights of the SmolLM2-135M shape (tools/bench_gpu.py), f16, prompts of 1,518 and 8,000
tokens (``--contexts``). Per context, with the prompt's keys already in a cache (what a
``PrefixCache`` lends back for the same prompt):

  cold        the whole prompt prefilled from position 0, the first (greedy) token read back
  tail_n      the prompt again with only its last n tokens re-prefilled (n = 1, 2): what a hit
              costs. ``first``: the first such call in the process, with the GPU objects it
              created (a shape no decode step or prefill used compiles its pipelines then);
              ``steady``: best of ``--repeats``
  loop        the same through the public loop: ``stream_generate(..., prefix_cache=)`` with
              max_tokens=1, a cold call then a hit of the same prompt: the whole call and the
              loop's ``prefill_seconds``, and the tail the PrefixCache left
  decode      one greedy decode step at the prompt's length
  after_idle  tail_1 after a 1 s pause (the H200 drops its clocks when idle)

Times are wall time from the call until the token is on the CPU, after a warm-up that keeps the
GPU busy for a second. ``ratio_cold_over_hit`` divides the loop's cold call by its hit.

    python tools/bench_prefix_gpu.py [--contexts 1518,8000] [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gpu import build  # noqa: E402 (tools/ is not a package)


class _Tokenizer:
    """What stream_generate asks of a tokenizer, for random weights: every id is one byte of text."""

    def is_special(self, token_id: int) -> bool:
        return False

    def token_bytes(self, token_id: int) -> bytes:
        return b"x"


def _created(ops) -> dict[str, int]:
    s = ops.stats
    return {"pipelines": s.pipelines, "bind_groups": s.bind_groups, "buffers": s.pooled_buffers,
            "uniforms": len(ops.context._uniforms)}


def _tail(model, cache, prompt, n: int) -> float:
    """Seconds to re-prefill the last ``n`` prompt tokens (keys before them kept) and read a token."""
    cache.offset = len(prompt) - n
    t0 = time.perf_counter()
    model.ops.argmax(model.forward(prompt[-n:], cache))
    return time.perf_counter() - t0


def bench_context(model, length: int, repeats: int) -> dict:
    from kjarni.stream import GenerationParams, GenerationStats, stream_generate
    from kjarni.prefix_cache import PrefixCache

    ops = model.ops
    prompt = [int(t) for t in (np.arange(length) * 7919) % model.config.vocab_size]
    cache = model.new_cache(length + 64)
    t0, cold = time.perf_counter(), []
    while len(cold) < 3 or time.perf_counter() - t0 < 1.0:  # warm-up: pipelines, clocks
        cache.offset = 0
        t1 = time.perf_counter()
        token = int(ops.argmax(model.forward(prompt, cache))[0])
        cold.append(time.perf_counter() - t1)
    decode = []
    for _ in range(repeats):  # a generation's decode steps (their shapes exist before any hit)
        cache.offset = length
        t1 = time.perf_counter()
        token = int(ops.argmax(model.forward([token], cache))[0])
        decode.append(time.perf_counter() - t1)

    result: dict = {"context": length, "cold_ms": round(1e3 * min(cold[-3:]), 2),
                    "decode_ms": round(1e3 * min(decode), 3)}
    for n in (2, 1):
        before = _created(ops)
        first = _tail(model, cache, prompt, n)
        after = _created(ops)
        steady = min(_tail(model, cache, prompt, n) for _ in range(repeats))
        result[f"tail_{n}"] = {"first_ms": round(1e3 * first, 3), "steady_ms": round(1e3 * steady, 3),
                               "first_created": {k: after[k] - before[k] for k in after}}
    time.sleep(1.0)
    result["after_idle_tail_1_ms"] = round(1e3 * _tail(model, cache, prompt, 1), 3)

    # The public loop: one greedy token, cold then hit, through one PrefixCache; the whole call
    # (take, prefill, the token, remember) and the loop's own prefill_seconds.
    prefix = PrefixCache(model, length + 64)
    params = GenerationParams(max_tokens=1, temperature=0)
    calls: dict[str, list[tuple[float, float]]] = {"cold": [], "hit": []}
    for _ in range(max(3, repeats // 2)):
        prefix.clear()
        for kind in ("cold", "hit"):
            stats = GenerationStats()
            t1 = time.perf_counter()
            list(stream_generate(model, _Tokenizer(), prompt, params, stats=stats, prefix_cache=prefix))
            calls[kind].append((time.perf_counter() - t1, stats.prefill_seconds))
    cold_call, hit_call = (min(c for c, _ in calls[k]) for k in ("cold", "hit"))
    result["loop"] = {"cold_call_ms": round(1e3 * cold_call, 2), "hit_call_ms": round(1e3 * hit_call, 3),
                      "hit_prefill_ms": round(1e3 * min(p for _, p in calls["hit"]), 3),
                      "hit_call_ms_all": [round(1e3 * c, 2) for c, _ in calls["hit"]],
                      "tail_tokens": length - stats.cached_prompt_tokens}
    result["ratio_cold_over_hit"] = round(cold_call / hit_call, 1)
    result["hit_over_decode"] = round(hit_call / min(decode), 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a shape of tools/bench_gpu.py")
    parser.add_argument("--contexts", default="1518,8000")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--adapter", default=None)
    args = parser.parse_args()
    if not os.environ.get("XDG_RUNTIME_DIR"):
        import tempfile

        os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="kjarni-xdg-")
    from kjarni.gpu import WgpuContext, WgpuOps

    ctx = WgpuContext(args.adapter)
    model = build(args.model, "f16", WgpuOps(ctx, weight_format="f16"))
    report = {"adapter": ctx.description, "model": args.model, "format": "f16", "results": []}
    for length in (int(c) for c in args.contexts.split(",")):
        report["results"].append(bench_context(model, length, args.repeats))
        print(json.dumps(report["results"][-1]), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
