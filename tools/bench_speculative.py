"""Benchmark speculative decoding: plain greedy vs the default (adaptive) draft length vs fixed
lengths, on prose and code. Prints JSON.

Two modes:

    .venv/bin/python tools/bench_speculative.py [--tokens 40,256] [--ks 1,2,3,4,5,6,7,8] [--repeats 1]
    python3 tools/bench_speculative.py --random-gpu [--tokens 128,512] [--rates 0.7,1.0] [--repeats 3]

The first runs the real Qwen2.5-Coder-1.5B-Instruct (target) and Qwen2.5-Coder-0.5B-Instruct
(draft) on the numpy backend, on one plain-English and one code prompt, chat-formatted as
``kjarni generate`` does for a new user. Both models must be in the cache (``kjarni pull``).

The second builds random weights of the Qwen2.5-1.5B (target) and 0.5B (draft) shapes on the GPU
(f16), made so that the draft agrees with the target at a known rate (``successor_model``): the
layers' output projections are scaled down to 1e-3 so the residual stream keeps its token's
embedding, and the LM head maps each token's embedding to the row of a fixed random successor
``f(x)``; the draft has its own embeddings and the successor ``f(pi(x))``, where ``pi`` moves a
random ``1 - rate`` of the vocabulary. Greedy decoding then follows ``x -> f(x)`` and a drafted
token is right exactly where ``x`` is not moved, so the acceptance is ``rate`` up to which tokens
the walk happens to visit (the measured acceptance is reported). The shapes, dtypes and kernels
are those of the real models, so the timings are (the LM heads are untied: same bytes read per
step as the tied ones). ``--rates`` stand in for prose and code: the numpy mode measures about
0.73 and 1.0 on the real pair. The target does not depend on the rate and is built once; each
rate builds its draft on its own ``WgpuOps`` of the same device (as the builder loads one). The
weights are views of pools of random f16 values (``RandomPool``), so a build costs about the
upload. The only warm-up is one short plain generation (what plain decoding warms); the
pipelines the draft and the verify passes need are compiled in each variant's first run.

For every prompt (or rate) the variants run interleaved, ``--repeats`` times: plain, the
defaults (``num_draft_tokens=None``), then each fixed length in ``--ks``; greedy outputs are
compared with plain's token for token (``identical``). Speedups are decode tok/s (the tokens
after the first over the time after the prefill, as ``GenerationStats`` reports it) over plain's
median; ``first_run_speedup`` is the first repeat's alone (on the GPU: with its first compiles).
The time after the prefill holds every cost of the draft, its own prefill of the prompt included.
The summary gives, per prompt (or rate) and ``--tokens`` value, the default's speedup next to the
best fixed length and the default's ``draft_decisions``; a JSON line of it goes to stdout as each
is done, the full report at the end; one line per run goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = {
    "prose": ("You are a helpful assistant.", "Tell me about the history of the bicycle."),
    "code": ("You are a helpful coding assistant.",
             "Write a Python function `is_prime(n)` that checks whether n is prime, with a docstring and doctests."),
}
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def chat(system: str, text: str) -> str:
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def generate(target, tokenizer, prompt_ids, params, **kwargs):
    from kjarni.stream import GenerationStats, stream_generate

    stats = GenerationStats()
    tokens = [e.token_id for e in stream_generate(target, tokenizer, prompt_ids, params, stats=stats, **kwargs)]
    return tokens, stats


def bench_prompt(name, target, draft, tokenizer, prompt_ids, params, ks, repeats, out) -> dict:
    """Interleaved runs of plain, the defaults and each fixed length; one JSON line per run on ``out``."""
    variants = [("plain", None), ("default", None)] + [(f"k={k}", k) for k in ks]
    runs: dict[str, list[dict]] = {v: [] for v, _ in variants}
    reference = None
    for repeat in range(repeats):
        for variant, k in variants:
            kwargs = {} if variant == "plain" else {"draft": draft, "num_draft_tokens": k}
            tokens, stats = generate(target, tokenizer, prompt_ids, params, **kwargs)
            if reference is None:
                reference = tokens
            row = {
                "prompt": name, "variant": variant, "repeat": repeat, "tokens": len(tokens),
                "decode_tokens_per_second": round(stats.tokens_per_second, 3),
                "seconds": round(stats.prefill_seconds + stats.decode_seconds, 3),
                "identical": tokens == reference,
                "first_difference": next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None),
            }
            if variant != "plain":
                row.update(
                    acceptance_rate=round(stats.acceptance_rate, 3), tokens_per_round=round(stats.tokens_per_round, 3),
                    rounds=stats.rounds, draft_length=round(stats.draft_length, 3),
                    draft_lengths=dict(sorted(stats.draft_lengths.items())), draft_stops=stats.draft_stops,
                    plain_tokens=stats.plain_tokens, draft_decisions=dict(sorted(stats.draft_decisions.items())),
                )
            runs[variant].append(row)
            print(json.dumps(row), file=out, flush=True)
    plain = float(np.median([r["decode_tokens_per_second"] for r in runs["plain"]]))
    summary = {"plain_decode_tokens_per_second": round(plain, 3), "tokens": len(reference), "variants": {}}
    for variant, rows in runs.items():
        tps = float(np.median([r["decode_tokens_per_second"] for r in rows]))
        entry = {"decode_tokens_per_second": round(tps, 3), "speedup": round(tps / plain, 3),
                 # the first run of the variant: pipelines plain decoding's warm-up did not make
                 # are compiled in it, as a user's first generation with the draft compiles them
                 "first_run_speedup": round(rows[0]["decode_tokens_per_second"] / plain, 3),
                 "identical": all(r["identical"] for r in rows)}
        for key in ("acceptance_rate", "draft_length", "plain_tokens", "draft_stops", "rounds", "draft_lengths",
                    "draft_decisions"):
            if key in rows[0]:
                entry[key] = rows[-1][key]
        summary["variants"][variant] = entry
    fixed = {v: e for v, e in summary["variants"].items() if v.startswith("k=")}
    best = max(fixed, key=lambda v: fixed[v]["speedup"])
    summary["default_speedup"] = summary["variants"]["default"]["speedup"]
    summary["default_first_run_speedup"] = summary["variants"]["default"]["first_run_speedup"]
    summary["best_fixed"] = best
    summary["best_fixed_speedup"] = fixed[best]["speedup"]
    return summary


# ---------------------------------------------------------------- numpy, real models


def bench_numpy(args) -> dict:
    from kjarni.stream import GenerationParams
    from kjarni.loader import load_model
    from kjarni.sources import resolve
    from kjarni.speculative import check_draft_compatible

    start = time.perf_counter()
    target = load_model(resolve(TARGET, quiet=True).path)
    draft = load_model(resolve(DRAFT, quiet=True).path)
    load_seconds = time.perf_counter() - start
    check_draft_compatible(target, draft, target_name=TARGET, draft_name=DRAFT)
    tokenizer = target.tokenizer
    report = {"backend": "numpy", "target": TARGET, "draft": DRAFT, "load_seconds_both": round(load_seconds, 1),
              "max_tokens": args.tokens, "repeats": args.repeats, "prompts": {}}
    for name in args.prompts.split(","):
        ids = tokenizer.encode(chat(*PROMPTS[name]))
        for tokens in args.tokens:
            params = GenerationParams(max_tokens=tokens, temperature=0, eos_token_ids=tokenizer.eos_token_ids)
            summary = bench_prompt(name, target.model, draft.model, tokenizer, ids, params, args.ks, args.repeats,
                                   sys.stderr)
            report["prompts"].setdefault(name, {})[str(tokens)] = summary
            print(json.dumps({"prompt": name, "max_tokens": tokens, **headline(summary)}), flush=True)
    return report


def headline(summary: dict) -> dict:
    """The one-line result of a prompt or rate at one max_tokens."""
    return {key: summary[key] for key in ("default_speedup", "default_first_run_speedup", "best_fixed",
                                          "best_fixed_speedup", "plain_decode_tokens_per_second")} | {
        "default_decisions": summary["variants"]["default"]["draft_decisions"]}


# ---------------------------------------------------------------- GPU, random weights agreeing at a known rate


class RandomPool:
    """Random f16-representable float32 values, made once: every random matrix is a view of it at
    its own offset, so building a 1.5B model costs the upload's one f32 -> f16 pass, not a normal
    draw and two conversions per weight (bench_gpu's RandomWeights: about 130 s a pair on the
    H200's host). Uniform values of the given std: the timings do not depend on the distribution."""

    def __init__(self, size: int, std: float, seed: int) -> None:
        rng, self.values = np.random.default_rng(seed), np.empty(size, dtype=np.float32)
        for i in range(0, size, 1 << 24):  # chunked: no float64 temporary of the whole pool
            chunk = rng.random(min(1 << 24, size - i), dtype=np.float32)
            self.values[i : i + len(chunk)] = ((chunk - 0.5) * np.float32(std * 12**0.5)).astype(np.float16)
        self._rng = rng

    def view(self, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape))
        offset = int(self._rng.integers(0, len(self.values) - size + 1))
        return self.values[offset : offset + size].reshape(shape)


class IdsTokenizer:
    """What stream_generate needs of a tokenizer when only ids matter (the random models)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def is_special(self, token):
        return False

    def token_bytes(self, token):
        return b"x"


def successors(vocab: int, rate: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(f, f o pi): the target's successor permutation and the draft's, which differs from it on
    a random ``1 - rate`` of the vocabulary (pi: a cycle over them). f does not depend on ``rate``."""
    rng = np.random.default_rng(seed)
    successor = rng.permutation(vocab)  # f
    moved = rng.choice(vocab, size=int(round((1 - rate) * vocab)), replace=False)
    pi = np.arange(vocab)
    pi[moved] = np.roll(moved, 1)  # a derangement of the moved tokens
    return successor, successor[pi]


def successor_model(shape: str, f: np.ndarray, ops, seed: int, pools: dict):
    """A DecoderModel of ``shape`` with random weights whose greedy walk is ``x -> f(x)``: embeddings
    E (std 1), layer output projections at 1e-3 of the others, LM head row v = E[f^-1(v)]."""
    from bench_gpu import SHAPES, RandomWeights

    from kjarni.model_config import ModelConfig
    from kjarni.model import DecoderModel

    config = dict(SHAPES[shape], tie_word_embeddings=False, rms_norm_eps=1e-6)
    vocab, hidden = config["vocab_size"], config["hidden_size"]

    class _SuccessorWeights(RandomWeights):
        def raw(self, name):
            shape = self.shapes[name]
            if name == "model.embed_tokens.weight":
                return embed
            if name == "lm_head.weight":
                inverse = np.empty_like(f)
                inverse[f] = np.arange(len(f))
                return embed[inverse]  # row v = E[f^-1(v)]: E[x] scores highest at v = f(x)
            if len(shape) == 1:
                return super().raw(name)
            return pools["small" if name.endswith(("o_proj.weight", "down_proj.weight")) else "matrix"].view(shape)

    weights = _SuccessorWeights(config, "f16")
    weights.shapes["lm_head.weight"] = (vocab, hidden)
    embed = pools["embed"].view((vocab, hidden))
    return DecoderModel(ModelConfig.from_dict(config), weights, ops)


def random_pools(target_shape: str, seed: int = 0) -> dict:
    """The pools the pair's weights are views of: embeddings (std 1, room for the target's table
    at many offsets), matrices (std 0.02) and the output projections (std 2e-5)."""
    from bench_gpu import SHAPES

    c = SHAPES[target_shape]
    largest = max(c["intermediate_size"], 3 * c["hidden_size"]) * c["hidden_size"]
    return {"embed": RandomPool(c["vocab_size"] * c["hidden_size"] + (1 << 24), 1.0, seed + 1),
            "matrix": RandomPool(2 * largest, 0.02, seed + 2), "small": RandomPool(2 * largest, 2e-5, seed + 3)}


def bench_random_gpu(args) -> dict:
    from bench_gpu import SHAPES

    from kjarni.stream import GenerationParams
    from kjarni.gpu import WgpuContext, WgpuOps

    if not os.environ.get("XDG_RUNTIME_DIR"):
        import tempfile

        os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="kjarni-xdg-")
    ctx = WgpuContext(args.adapter)
    target_shape, draft_shape = args.shapes.split(",")
    report = {"backend": "wgpu", "adapter": ctx.description, "target_shape": target_shape,
              "draft_shape": draft_shape, "weights": "f16, random, draft agreeing at a known rate",
              "max_tokens": args.tokens, "prompt_tokens": args.context, "repeats": args.repeats, "rates": {}}

    rates = [float(r) for r in args.rates.split(",")]
    # The target does not depend on the rate: build it once; each rate gets its own draft on its
    # own WgpuOps (as the builder loads a draft), freed before the next.
    t0 = time.perf_counter()
    pools = random_pools(target_shape)
    vocab = SHAPES[target_shape]["vocab_size"]
    f, _ = successors(vocab, rates[0])
    target = successor_model(target_shape, f, WgpuOps(ctx, weight_format="f16"), 1, pools)
    report["target_build_seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({"target_build_seconds": report["target_build_seconds"]}), flush=True)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, target.config.vocab_size, args.context)]
    tokenizer = IdsTokenizer(target.config.vocab_size)
    for rate in rates:
        t0 = time.perf_counter()
        draft_ops = WgpuOps(ctx, weight_format="f16")
        draft = successor_model(draft_shape, successors(vocab, rate)[1], draft_ops, 2, pools)
        build_seconds = time.perf_counter() - t0
        # Warm-up: what plain decoding's own warm-up makes (its pipelines), nothing more: the
        # draft's and the verify passes' first compiles fall in the variants' first runs, as they
        # would in a user's first generation with the draft (first_run_speedup).
        generate(target, tokenizer, prompt, GenerationParams(max_tokens=12, temperature=0))
        report["rates"][str(rate)] = {"build_seconds": round(build_seconds, 1)}
        for tokens in args.tokens:
            params = GenerationParams(max_tokens=tokens, temperature=0)
            summary = bench_prompt(f"rate={rate}", target, draft, tokenizer, prompt, params, args.ks, args.repeats,
                                   sys.stderr)
            report["rates"][str(rate)][str(tokens)] = summary
            print(json.dumps({"rate": rate, "max_tokens": tokens, **headline(summary),
                              "build_seconds": round(build_seconds, 1)}), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1))
        del draft
        draft_ops.close()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=None, help="max_tokens per generation, comma-separated (40; 128 with --random-gpu)")
    parser.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="fixed num_draft_tokens values, comma-separated")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (1; 3 with --random-gpu)")
    parser.add_argument("--prompts", default="prose,code", help="numpy mode: which of prose, code")
    parser.add_argument("--random-gpu", action="store_true", help="random weights on the GPU (see above)")
    parser.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-0.5b", help="--random-gpu: target,draft shapes")
    parser.add_argument("--rates", default="0.7,1.0", help="--random-gpu: draft agreement rates")
    parser.add_argument("--context", type=int, default=256, help="--random-gpu: prompt tokens")
    parser.add_argument("--adapter", default=None, help="--random-gpu: substring of the adapter name")
    parser.add_argument("--out", default=None, help="also write the JSON report here (after each rate)")
    args = parser.parse_args()
    args.ks = [int(k) for k in args.ks.split(",")]
    args.tokens = [int(t) for t in (args.tokens or ("128" if args.random_gpu else "40")).split(",")]
    args.repeats = args.repeats or (3 if args.random_gpu else 1)
    report = bench_random_gpu(args) if args.random_gpu else bench_numpy(args)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
