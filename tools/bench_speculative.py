"""Benchmark speculative decoding: plain greedy vs the default (adaptive) draft length vs fixed
lengths, on prose and code. Prints JSON.

Two modes:

    .venv/bin/python tools/bench_speculative.py [--tokens 40] [--ks 1,2,3,4,5,6,7,8] [--repeats 1]
    python3 tools/bench_speculative.py --random-gpu [--tokens 128] [--rates 0.7,1.0] [--repeats 2]

The first runs the real Qwen2.5-Coder-1.5B-Instruct (target) and Qwen2.5-Coder-0.5B-Instruct
(draft) on the numpy backend, on one plain-English and one code prompt, chat-formatted as
``kjarni generate`` does for a new user. Both models must be in the cache (``kjarni pull``).

The second builds random weights of the Qwen2.5-1.5B (target) and 0.5B (draft) shapes on the GPU
(f16), made so that the draft agrees with the target at a known rate (``agreeing_pair``): the
layers' output projections are scaled down to 1e-3 so the residual stream keeps its token's
embedding, and the LM head maps each token's embedding to the row of a fixed random successor
``f(x)``; the draft has its own embeddings and the successor ``f(pi(x))``, where ``pi`` moves a
random ``1 - rate`` of the vocabulary. Greedy decoding then follows ``x -> f(x)`` and a drafted
token is right exactly where ``x`` is not moved, so the acceptance is ``rate`` up to which tokens
the walk happens to visit (the measured acceptance is reported). The shapes, dtypes and kernels
are those of the real models, so the timings are (the LM heads are untied: same bytes read per
step as the tied ones). ``--rates`` stand in for prose and code: the numpy mode measures about
0.73 and 1.0 on the real pair.

For every prompt (or rate) the variants run interleaved, ``--repeats`` times: plain, the
defaults (``num_draft_tokens=None``), then each fixed length in ``--ks``; greedy outputs are
compared with plain's token for token (``identical``). Speedups are decode tok/s (the tokens
after the first over the time after the prefill, as ``GenerationStats`` reports it) over plain's
median. The summary gives, per prompt, the default's speedup next to the best fixed length.
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
                    plain_tokens=stats.plain_tokens,
                )
            runs[variant].append(row)
            print(json.dumps(row), file=out, flush=True)
    plain = float(np.median([r["decode_tokens_per_second"] for r in runs["plain"]]))
    summary = {"plain_decode_tokens_per_second": round(plain, 3), "tokens": len(reference), "variants": {}}
    for variant, rows in runs.items():
        tps = float(np.median([r["decode_tokens_per_second"] for r in rows]))
        entry = {"decode_tokens_per_second": round(tps, 3), "speedup": round(tps / plain, 3),
                 "identical": all(r["identical"] for r in rows)}
        for key in ("acceptance_rate", "draft_length", "plain_tokens", "draft_stops"):
            if key in rows[0]:
                entry[key] = rows[-1][key]
        if "draft_lengths" in rows[0]:
            entry["draft_lengths"] = rows[-1]["draft_lengths"]
        summary["variants"][variant] = entry
    fixed = {v: e for v, e in summary["variants"].items() if v.startswith("k=")}
    best = max(fixed, key=lambda v: fixed[v]["speedup"])
    summary["default_speedup"] = summary["variants"]["default"]["speedup"]
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
    params = GenerationParams(max_tokens=args.tokens, temperature=0, eos_token_ids=tokenizer.eos_token_ids)
    report = {"backend": "numpy", "target": TARGET, "draft": DRAFT, "load_seconds_both": round(load_seconds, 1),
              "max_tokens": args.tokens, "repeats": args.repeats, "prompts": {}}
    for name in args.prompts.split(","):
        ids = tokenizer.encode(chat(*PROMPTS[name]))
        report["prompts"][name] = bench_prompt(name, target.model, draft.model, tokenizer, ids, params,
                                               args.ks, args.repeats, sys.stderr)
    return report


# ---------------------------------------------------------------- GPU, random weights agreeing at a known rate


def agreeing_pair(target_shape: str, draft_shape: str, rate: float, ops, seed: int = 0):
    """(target, draft) DecoderModels of random weights where greedy drafts are right at ``rate``.

    See the module docstring: embeddings E (std 1), layer output projections scaled to 1e-3, LM
    head row v = E[f^-1(v)] for a random permutation f; the draft's successor is f(pi(x)) with
    pi a cycle over a random ``1 - rate`` of the vocabulary.
    """
    from bench_gpu import SHAPES, RandomWeights

    from kjarni.model_config import ModelConfig
    from kjarni.model import DecoderModel

    vocab = SHAPES[target_shape]["vocab_size"]
    rng = np.random.default_rng(seed)
    successor = rng.permutation(vocab)  # f
    moved = rng.choice(vocab, size=int(round((1 - rate) * vocab)), replace=False)
    pi = np.arange(vocab)
    pi[moved] = np.roll(moved, 1)  # a derangement of the moved tokens
    draft_successor = successor[pi]  # f(pi(x))

    def model(shape: str, f: np.ndarray, model_seed: int):
        config = dict(SHAPES[shape], tie_word_embeddings=False, rms_norm_eps=1e-6)
        weights = _SuccessorWeights(config, f, model_seed)
        return DecoderModel(ModelConfig.from_dict(config), weights, ops)

    class _SuccessorWeights(RandomWeights):
        def __init__(self, config, f, model_seed):
            super().__init__(config, "f16")
            self.shapes["lm_head.weight"] = (vocab, config["hidden_size"])
            self._f, self._seed, self._embed = f, model_seed, None

        def raw(self, name):
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                if self._embed is None:
                    e = np.random.default_rng(self._seed).standard_normal(self.shapes["model.embed_tokens.weight"],
                                                                          dtype=np.float32)
                    self._embed = e.astype(np.float16).astype(np.float32)
                if name == "model.embed_tokens.weight":
                    return self._embed
                inverse = np.empty_like(self._f)
                inverse[self._f] = np.arange(len(self._f))
                return self._embed[inverse]  # row v = E[f^-1(v)]: E[x] scores highest at v = f(x)
            w = super().raw(name)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                w = (w * 1e-3).astype(np.float16).astype(np.float32)
            return w

    return model(target_shape, successor, seed + 1), model(draft_shape, draft_successor, seed + 2)


def bench_random_gpu(args) -> dict:
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

    class _Ids:  # stream_generate wants a tokenizer only for text: ids are enough here
        vocab_size = 0

        def is_special(self, token):
            return False

        def token_bytes(self, token):
            return b"x"

    params = GenerationParams(max_tokens=args.tokens, temperature=0)
    for rate in (float(r) for r in args.rates.split(",")):
        t0 = time.perf_counter()
        ops = WgpuOps(ctx, weight_format="f16")
        target, draft = agreeing_pair(target_shape, draft_shape, rate, ops)
        build_seconds = time.perf_counter() - t0
        prompt = [int(t) for t in np.random.default_rng(1).integers(0, target.config.vocab_size, args.context)]
        tokenizer = _Ids()
        tokenizer.vocab_size = target.config.vocab_size
        # Warm-up: every pipeline plain decoding and each verify length use.
        for k in [None] + args.ks:
            generate(target, tokenizer, prompt, GenerationParams(max_tokens=12, temperature=0), draft=draft,
                     num_draft_tokens=k)
        generate(target, tokenizer, prompt, GenerationParams(max_tokens=12, temperature=0))
        summary = bench_prompt(f"rate={rate}", target, draft, tokenizer, prompt, params, args.ks, args.repeats,
                               sys.stderr)
        summary["build_seconds"] = round(build_seconds, 1)
        report["rates"][str(rate)] = summary
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
        del target, draft, ops
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=None, help="max_tokens per generation (40; 128 with --random-gpu)")
    parser.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="fixed num_draft_tokens values, comma-separated")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (1; 2 with --random-gpu)")
    parser.add_argument("--prompts", default="prose,code", help="numpy mode: which of prose, code")
    parser.add_argument("--random-gpu", action="store_true", help="random weights on the GPU (see above)")
    parser.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-0.5b", help="--random-gpu: target,draft shapes")
    parser.add_argument("--rates", default="0.7,1.0", help="--random-gpu: draft agreement rates")
    parser.add_argument("--context", type=int, default=256, help="--random-gpu: prompt tokens")
    parser.add_argument("--adapter", default=None, help="--random-gpu: substring of the adapter name")
    parser.add_argument("--out", default=None, help="also write the JSON report here (after each rate)")
    args = parser.parse_args()
    args.ks = [int(k) for k in args.ks.split(",")]
    if args.random_gpu:
        args.tokens, args.repeats = args.tokens or 128, args.repeats or 2
        report = bench_random_gpu(args)
    else:
        args.tokens, args.repeats = args.tokens or 40, args.repeats or 1
        report = bench_numpy(args)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
