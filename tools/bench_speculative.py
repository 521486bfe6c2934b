"""Benchmark speculative decoding on the numpy backend: plain greedy vs a draft model. Prints JSON.

Qwen2.5-Coder-1.5B-Instruct (target) with Qwen2.5-Coder-0.5B-Instruct (draft), greedy, on code
prompts. For every prompt and every ``num_draft_tokens``, plain and speculative generation run
back to back in this process (the machine is shared, so only ratios measured side by side mean
much) and their outputs are asserted identical. Both models must be in the cache:

    .venv/bin/python tools/bench_speculative.py [--tokens 64] [--ks 2,3,4,5,6,8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

PROMPTS = [
    "Write a Python function `is_prime(n)` that checks whether n is prime, with a docstring and doctests.",
    "Write a Python class `Stack` with push, pop, peek and __len__, raising IndexError on an empty pop.",
    "Write a Python function that parses a CSV file into a list of dicts without using the csv module.",
]
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def chat(text: str) -> str:
    return (
        "<|im_start|>system\nYou are a helpful coding assistant.<|im_end|>\n"
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    )


def run(target, tokenizer, prompt_ids, params, **kwargs):
    from kjarni.generate import GenerationStats, stream_generate

    stats = GenerationStats()
    start = time.perf_counter()
    tokens = [e.token_id for e in stream_generate(target, tokenizer, prompt_ids, params, stats=stats, **kwargs)]
    return tokens, time.perf_counter() - start, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per generation")
    parser.add_argument("--ks", default="2,3,4,5,6,8", help="num_draft_tokens values, comma-separated")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the built-in prompts")
    args = parser.parse_args()

    from kjarni.generate import GenerationParams
    from kjarni.loader import load_model
    from kjarni.sources import resolve
    from kjarni.speculative import check_draft_compatible

    start = time.perf_counter()
    target = load_model(resolve(TARGET, quiet=True).path)
    draft = load_model(resolve(DRAFT, quiet=True).path)
    load_seconds = time.perf_counter() - start
    check_draft_compatible(target, draft, target_name=TARGET, draft_name=DRAFT)
    tokenizer = target.tokenizer
    params = GenerationParams(max_tokens=args.tokens, temperature=0, eos_token_ids=tokenizer.eos_token_ids)
    ks = [int(k) for k in args.ks.split(",")]

    rows = []
    for p, text in enumerate(PROMPTS[: args.prompts]):
        prompt_ids = tokenizer.encode(chat(text))
        for k in ks:
            plain, plain_s, plain_stats = run(target.model, tokenizer, prompt_ids, params)
            spec, spec_s, spec_stats = run(target.model, tokenizer, prompt_ids, params, draft=draft.model,
                                           num_draft_tokens=k)
            if spec != plain:
                first = next(i for i, (a, b) in enumerate(zip(plain, spec)) if a != b) if len(spec) == len(plain) else None
                raise SystemExit(f"prompt {p} k={k}: speculative output differs from plain greedy at token {first}")
            row = {
                "prompt": p,
                "num_draft_tokens": k,
                "tokens": len(plain),
                "plain_seconds": round(plain_s, 3),
                "speculative_seconds": round(spec_s, 3),
                "plain_tokens_per_second": round(len(plain) / plain_s, 3),
                "speculative_tokens_per_second": round(len(spec) / spec_s, 3),
                "speedup": round(plain_s / spec_s, 3),
                "plain_decode_tokens_per_second": round(plain_stats.tokens_per_second, 3),
                "speculative_decode_tokens_per_second": round(spec_stats.tokens_per_second, 3),
                "decode_speedup": round(spec_stats.tokens_per_second / plain_stats.tokens_per_second, 3),
                "acceptance_rate": round(spec_stats.acceptance_rate, 3),
                "tokens_per_round": round(spec_stats.tokens_per_round, 3),
                "identical": True,
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)

    summary = {}
    for k in ks:
        mine = [r for r in rows if r["num_draft_tokens"] == k]
        plain_s = sum(r["plain_seconds"] for r in mine)
        spec_s = sum(r["speculative_seconds"] for r in mine)
        summary[k] = {
            "speedup": round(plain_s / spec_s, 3),
            "acceptance_rate": round(sum(r["acceptance_rate"] for r in mine) / len(mine), 3),
            "tokens_per_round": round(sum(r["tokens_per_round"] for r in mine) / len(mine), 3),
        }
    best = max(summary, key=lambda k: summary[k]["speedup"])
    print(json.dumps({
        "target": TARGET,
        "draft": DRAFT,
        "backend": "numpy",
        "load_seconds_both": round(load_seconds, 1),
        "max_tokens": args.tokens,
        "results": rows,
        "by_num_draft_tokens": summary,
        "best_num_draft_tokens": best,
        "best_speedup": summary[best]["speedup"],
    }, indent=1))


if __name__ == "__main__":
    main()
