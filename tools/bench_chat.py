"""Time to first token of a chat's second turn, with and without the prefix cache. Prints JSON.

A conversation through ``Generator.chat`` (the model's chat template, greedy): turn 1 asks a
question, turn 2 resends it with the answer and asks another. With the prefix cache, turn 2
prefills only what turn 1 did not already leave in the cache; without it, the whole conversation.
Time to first token is measured from the ``stream_chat`` call (template rendering and tokenizing
included) to the first token out. Each configuration runs ``--repeats`` fresh conversations;
the median and all runs are printed.

    .venv/bin/python tools/bench_chat.py [--model smollm2-135m-instruct] [--device cpu] [--turns 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "And what is the capital of Italy?",
    "Which of the two cities is larger?",
    "Name one famous museum in each.",
]


def conversation(generator, turns: int, max_tokens: int) -> dict:
    """One conversation of ``turns`` turns; the last turn's time to first token and its stats."""
    messages: list[dict] = []
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        started = time.perf_counter()
        stream = generator.stream_chat_tokens(messages, max_tokens=max_tokens)
        first = None
        pieces = []
        with stream:
            for token in stream:
                if first is None:
                    first = time.perf_counter() - started
                pieces.append(token.text)
        messages.append({"role": "assistant", "content": "".join(pieces)})
    stats = generator.last_stats
    return {"ttft_s": first, "prompt_tokens": stats.prompt_tokens, "cached_prompt_tokens": stats.cached_prompt_tokens,
            "answer": messages[-1]["content"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu", "auto"))
    parser.add_argument("--turns", type=int, default=2, help=f"turns per conversation, 2..{len(QUESTIONS)}")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from kjarni.generator import Generator

    results = {}
    for cached in (False, True):
        builder = Generator.builder(args.model).device(args.device).greedy().quiet()
        generator = (builder.prefix_cache(True) if cached else builder).build()
        conversation(generator, args.turns, args.max_tokens)  # warm-up: caches, allocations
        runs = []
        for _ in range(args.repeats):
            if cached:
                generator.clear_prefix_cache()  # each conversation starts cold; its own turn 1 fills the cache
            runs.append(conversation(generator, args.turns, args.max_tokens))
        results["prefix_cache" if cached else "no_prefix_cache"] = {
            "ttft_median_s": statistics.median(r["ttft_s"] for r in runs),
            "runs": runs,
        }
        device = generator.device.value
    off, on = results["no_prefix_cache"]["ttft_median_s"], results["prefix_cache"]["ttft_median_s"]
    print(json.dumps({"model": args.model, "device": device, "turn": args.turns, "max_tokens": args.max_tokens,
                      **results, "speedup": off / on if on else None}, indent=2))


if __name__ == "__main__":
    main()
