"""Benchmark the prefix cache on the numpy backend: a long prompt cold vs mostly cached. Prints JSON.

Qwen2.5-Coder-0.5B-Instruct, a 2048-token prompt (kjarni's own source code, tokenized): prefill
it cold, then again through a ``PrefixCache`` already holding its first 1984 tokens from an
earlier call. Reports both times, their ratio, and how the two sets of last-position logits
compare (the seed's reference: 15.96 s cold, 0.49 s cached). The model must be in the cache:

    .venv/bin/python tools/bench_prefix_cache.py [--prompt-tokens 2048] [--cached-tokens 1984]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

MODEL = "qwen2.5-coder-0.5b-instruct"


def prompt_tokens(tokenizer, count: int) -> list[int]:
    """``count`` tokens of real text: kjarni's own Python sources, in a fixed order."""
    root = Path(__file__).resolve().parent.parent / "kjarni"
    text = "\n".join(p.read_text() for p in sorted(root.glob("*.py")))
    ids = tokenizer.encode(text)
    if len(ids) < count:
        raise SystemExit(f"only {len(ids)} tokens of source text; ask for fewer")
    return ids[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--cached-tokens", type=int, default=1984)
    parser.add_argument("--repeats", type=int, default=2, help="cold and cached runs, interleaved")
    args = parser.parse_args()

    from kjarni.stream import GenerationParams, GenerationStats, stream_generate
    from kjarni.loader import load_model
    from kjarni.prefix_cache import DEFAULT_PREFIX_CACHE_TOKENS, PrefixCache
    from kjarni.sources import resolve

    loaded = load_model(resolve(MODEL, quiet=True).path)
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = prompt_tokens(tokenizer, args.prompt_tokens)
    head = ids[: args.cached_tokens]
    prefix = PrefixCache(model, DEFAULT_PREFIX_CACHE_TOKENS)

    cold_times, cached_times = [], []
    cold_logits = cached_logits = None
    for _ in range(args.repeats):
        cache = model.new_cache(len(ids) + 1)
        start = time.perf_counter()
        cold_logits = model.ops.read(model.forward(ids, cache, logits="last"))[0]
        cold_times.append(time.perf_counter() - start)

        prefix.clear()  # an earlier call left the first cached_tokens in the prefix cache
        kv = prefix.take(head)
        model.forward(head, kv, logits="last")
        prefix.remember(head)
        start = time.perf_counter()
        kv = prefix.take(ids)
        reused = kv.offset
        cached_logits = model.ops.read(model.forward(ids[reused:], kv, logits="last"))[0]
        cached_times.append(time.perf_counter() - start)
        prefix.remember(ids)

    # The same through the public loop: one greedy token with and without the prefix cache.
    params = GenerationParams(max_tokens=1, temperature=0)
    cold_stats, cached_stats = GenerationStats(), GenerationStats()
    cold_token = [e.token_id for e in stream_generate(model, tokenizer, ids, params, stats=cold_stats)]
    prefix.clear()
    list(stream_generate(model, tokenizer, head, params, prefix_cache=prefix))
    cached_token = [e.token_id for e in stream_generate(model, tokenizer, ids, params, stats=cached_stats,
                                                        prefix_cache=prefix)]

    diff = np.abs(cold_logits - cached_logits)
    cold, cached = min(cold_times), min(cached_times)
    print(json.dumps({
        "model": MODEL,
        "backend": "numpy",
        "prompt_tokens": len(ids),
        "cached_tokens": reused,
        "prefix_cache_capacity": prefix.capacity,
        "prefix_cache_nbytes": prefix.nbytes,
        "cold_seconds": round(cold, 3),
        "cached_seconds": round(cached, 3),
        "ratio": round(cold / cached, 1),
        "cold_seconds_all": [round(t, 3) for t in cold_times],
        "cached_seconds_all": [round(t, 3) for t in cached_times],
        "logits_identical": bool(np.array_equal(cold_logits, cached_logits)),
        "logits_max_abs_diff": float(diff.max()),
        "logits_max_abs": float(np.abs(cold_logits).max()),
        "argmax_equal": int(np.argmax(cold_logits)) == int(np.argmax(cached_logits)),
        "stream_generate": {
            "cold_prefill_seconds": round(cold_stats.prefill_seconds, 3),
            "cached_prefill_seconds": round(cached_stats.prefill_seconds, 3),
            "cached_prompt_tokens": cached_stats.cached_prompt_tokens,
            "same_first_token": cold_token == cached_token,
        },
        "seed_reference": {"cold_seconds": 15.96, "cached_seconds": 0.49, "ratio": round(15.96 / 0.49, 1)},
    }, indent=1))


if __name__ == "__main__":
    main()
