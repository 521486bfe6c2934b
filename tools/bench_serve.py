"""Throughput of ``kjarni serve`` with concurrent streaming clients on a tiny model. Prints JSON.

A real uvicorn server on 127.0.0.1 (random port) around a tiny random model that never ends a turn
(tests/serve_fixtures.py), so every request streams exactly ``--max-tokens`` tokens. ``--clients``
threads each send ``--requests`` streaming chat requests with the official ``openai`` client, after
one warm-up request. Reports completion tokens per second over the whole run, requests per
second, and each request's time to first token and total time (median and max); the same for one
client alone, for comparison. Run from the repository root:

    .venv/bin/python tools/bench_serve.py [--clients 8] [--requests 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ holds the fixtures


def one_request(client, max_tokens: int, seed: int) -> dict:
    started = time.perf_counter()
    first = None
    tokens = 0
    stream = client.chat.completions.create(
        model="endless", messages=[{"role": "user", "content": f"Tell me a story, number {seed}."}],
        max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}, seed=seed)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - started
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"ttft_s": first, "total_s": time.perf_counter() - started, "completion_tokens": tokens}


def run(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=600)
    one_request(client, max_tokens, 0)  # warm-up
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda i: one_request(client, max_tokens, i), range(clients * requests)))
    wall = time.perf_counter() - started
    tokens = sum(r["completion_tokens"] for r in results)
    return {
        "clients": clients, "requests": len(results), "completion_tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall, "requests_per_s": len(results) / wall,
        "ttft_median_s": statistics.median(r["ttft_s"] for r in results), "ttft_max_s": max(r["ttft_s"] for r in results),
        "request_median_s": statistics.median(r["total_s"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    from kjarni.generator import Generator
    from kjarni.serve import create_app
    from tests.serve_fixtures import make_endless_model, running_server

    with tempfile.TemporaryDirectory() as folder:
        model = make_endless_model(Path(folder) / "endless")
        generator = Generator.builder().model_path(model).cpu().greedy().prefix_cache(True).quiet().build()
        with running_server(create_app(generator, max_queue=args.clients * 2)) as url:
            alone = run(url, 1, args.requests, args.max_tokens)
            together = run(url, args.clients, args.requests, args.max_tokens)
    config = generator.decoder.config
    print(json.dumps({
        "model": f"tiny random llama (hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocab {config.vocab_size})",
        "device": generator.device.value, "max_tokens": args.max_tokens, "one_client": alone, "concurrent": together,
    }, indent=2))


if __name__ == "__main__":
    main()
