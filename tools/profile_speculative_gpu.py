"""Where a speculative round's time goes on the GPU: each part of a round timed on its own, synced.

    python3 tools/profile_speculative_gpu.py [--shapes qwen2.5-1.5b,qwen2.5-0.5b] [--context 256] [--reps 3]

Builds the random pair of ``tools/bench_speculative.py --random-gpu`` (the draft always agreeing),
warms it (a short plain generation and a short one with ``num_draft_tokens=3``), then, ``--reps``
times on fresh KV caches as a generation gets them:

    plain_run        a plain run started as speculative decoding starts one after the prefill
                     (``generate_step`` running ahead from its first step): the time of each
                     ``next()``, so the first readback and each later burst show apart
    synced_step      one forward from a CPU token with its token read back
    verify           a verify pass of n rows (logits "all", argmax, readback), 3 times each n
    draft            the draft's synced prefill of the whole context, then its synced steps
    rounds_k3        on-device greedy rounds of 3 drafts (``_round_on_device``), with the
                     time until the drafts were recorded (``record``)
    first_round_k3   the same with the draft's cache empty, as a generation's first round is
    plain_after_round  a plain run started after it

and last ``--generations`` interleaved pairs of plain and default (``num_draft_tokens=None``)
generations of ``--tokens`` tokens with their wall and decode seconds. One JSON line per
measurement on stdout, as it is done (a run stopped by a time limit keeps what it printed).
Times in ms but ``wall`` and ``decode_s`` (seconds).
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

import bench_speculative as bs  # noqa: E402


def _out(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-0.5b", help="target,draft shapes (bench_gpu's)")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens")
    parser.add_argument("--reps", type=int, default=3, help="repeats of the part-by-part measurements")
    parser.add_argument("--tokens", type=int, default=512, help="max_tokens of the closing generations")
    parser.add_argument("--generations", type=int, default=3, help="pairs of plain and default generations")
    parser.add_argument("--adapter", default=None, help="substring of the adapter name")
    args = parser.parse_args()

    from bench_gpu import SHAPES

    from kjarni.decode import choose_token, generate_step, prefill
    from kjarni.gpu import WgpuContext, WgpuOps
    from kjarni.sampler import Sampler
    from kjarni.speculative import _round_on_device
    from kjarni.stream import GenerationParams

    if not os.environ.get("XDG_RUNTIME_DIR"):
        import tempfile

        os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="kjarni-xdg-")
    clock = time.perf_counter
    target_shape, draft_shape = args.shapes.split(",")
    ctx = WgpuContext(args.adapter)
    pools = bs.random_pools(target_shape)
    vocab = SHAPES[target_shape]["vocab_size"]
    f, g = bs.successors(vocab, 1.0)
    t_ops, d_ops = WgpuOps(ctx, weight_format="f16"), WgpuOps(ctx, weight_format="f16")
    target = bs.successor_model(target_shape, f, t_ops, 1, pools)
    draft = bs.successor_model(draft_shape, g, d_ops, 2, pools)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, vocab, args.context)]
    tokenizer = bs.IdsTokenizer(vocab)
    bs.generate(target, tokenizer, prompt, GenerationParams(max_tokens=12, temperature=0))
    bs.generate(target, tokenizer, prompt, GenerationParams(max_tokens=64, temperature=0), draft=draft,
                num_draft_tokens=3)
    _out(stage="warm", adapter=ctx.description, decode_ahead=t_ops.decode_ahead, shapes=args.shapes)
    sampler = Sampler(GenerationParams(temperature=0))
    rng = np.random.default_rng(0)
    capacity = args.context + 512

    def synced_prefill(model, cache, ids):
        started = clock()
        token, _ = choose_token(model, prefill(model, cache, ids), sampler, ids, rng)
        return clock() - started, token

    def synced_steps(model, cache, token, n):
        """ms of ``n`` forwards of ``token`` at the cache's end, each read back and trimmed away."""
        times = []
        for _ in range(n):
            started = clock()
            logits = model.forward(np.asarray([token], dtype=np.int32), cache, logits="last")
            model.ops.read_tokens([model.ops.argmax_ahead(logits)])
            times.append(_ms(clock() - started))
            cache.trim(1)
        return times

    def timed_run(seq, cache, n):
        steps = generate_step(target, seq, sampler, rng, cache, max_tokens=n, first_burst=t_ops.decode_ahead)
        times = []
        for _ in range(n):
            started = clock()
            token, _ = next(steps)
            times.append(_ms(clock() - started))
            seq.append(token)
        steps.close()
        return times

    def keep(seq, cache, draft_cache, drafts, choices, k):
        accepted = next((j for j in range(k) if drafts[j] != choices[j]), k)
        kept = len(seq) + accepted
        cache.trim(cache.offset - kept)
        draft_cache.trim(max(draft_cache.offset - kept, 0))
        seq += drafts[:accepted] + [choices[accepted]]

    for rep in range(args.reps):
        cache = target.new_cache(capacity)
        seconds, token = synced_prefill(target, cache, prompt)
        seq = prompt + [token]
        times = timed_run(seq, cache, 40)
        _out(stage="plain_run", rep=rep, prefill_ms=_ms(seconds), next_ms=times, total=round(sum(times), 2))
        _out(stage="synced_step", rep=rep, ms=synced_steps(target, cache, seq[-1], 5))
        verify = {}
        for n in (1, 2, 4, 8, 9):
            verify[n] = []
            for _ in range(3):
                started = clock()
                logits = target.forward(np.asarray(seq[-1:] * n, dtype=np.int32), cache, logits="all")
                t_ops.read_tokens([t_ops.argmax_ahead(logits)])
                verify[n].append(_ms(clock() - started))
                cache.trim(n)
        _out(stage="verify", rep=rep, ms=verify)
        draft_cache = draft.new_cache(capacity)
        seconds, _ = synced_prefill(draft, draft_cache, seq[:-1])
        _out(stage="draft", rep=rep, context=len(seq) - 1, prefill_ms=_ms(seconds),
             synced_step_ms=synced_steps(draft, draft_cache, seq[-1], 3))
        rounds = []
        for _ in range(3):
            started = clock()
            drafts, choices, drafted = _round_on_device(target, draft, cache, draft_cache, seq, 3, clock)
            rounds.append({"total": _ms(clock() - started), "record": _ms(drafted - started)})
            keep(seq, cache, draft_cache, drafts, choices, 3)
        _out(stage="rounds_k3", rep=rep, ms=rounds)
        draft_cache = draft.new_cache(capacity)
        started = clock()
        drafts, choices, drafted = _round_on_device(target, draft, cache, draft_cache, seq, 3, clock)
        _out(stage="first_round_k3", rep=rep, total=_ms(clock() - started), record=_ms(drafted - started))
        keep(seq, cache, draft_cache, drafts, choices, 3)
        _out(stage="plain_after_round", rep=rep, next_ms=timed_run(seq, cache, 24))

    params = GenerationParams(max_tokens=args.tokens, temperature=0)
    for rep in range(args.generations):
        for variant, kwargs in (("plain", {}), ("default", {"draft": draft, "num_draft_tokens": None})):
            started = clock()
            _, stats = bs.generate(target, tokenizer, prompt, params, **kwargs)
            _out(stage="generation", rep=rep, variant=variant, wall=round(clock() - started, 4),
                 decode_s=round(stats.decode_seconds, 4), rounds=stats.rounds, plain_tokens=stats.plain_tokens)


if __name__ == "__main__":
    main()
