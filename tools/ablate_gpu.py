"""What each kernel of a forward costs inside the chain it runs in: a leave-one-out GPU profile. Prints JSON.

bench_gpu's per-kernel profile puts every dispatch in its own timestamped compute pass; on an H100
the emptiest kernels of a decode step show 6-8 us there, so its per-kernel figures (attention_step's
12.6 us a layer, say) carry a per-dispatch cost that the real step, one pass of back-to-back
dispatches, does not pay in full. This tool measures the other way:

1. Build a random-weight model (bench_gpu's shapes and weights), prefill ``--context`` tokens and
   record the dispatches of one forward (a decode step, or with ``--prefill`` the prompt's
   prefill): every (pipeline, bind group, grid), in order, as WgpuContext records them (step
   capture off, so nothing replays a tape past the recorder).
2. Replay that list in timestamped compute passes, one pass per variant, all variants of a round
   recorded in one command buffer after a warm-up (so they run at the same clock), ``--passes``
   rounds, the median per variant: ``full`` (the forward as recorded), ``empty`` (as many
   dispatches of an empty one-workgroup kernel: the chain's floor), and for each kernel label (the
   pipeline's ``kernel:entry`` and grid, so qkv and gate_up matvecs count apart) the list without
   that label's dispatches.
3. Report per label: dispatches, ``marginal_us`` = full - without (what the forward would save if
   that kernel cost nothing, the dependencies it waits on included), per dispatch, and bench_gpu's
   profiled time of the same dispatches beside it.

Replays repeat the same forward on the same buffers (a decode step rewrites its own KV position),
and a variant without a kernel leaves its readers on the previous values: the timings are real,
the outputs of the leave-one-out variants are not (``--check`` compares the full replay's output
with the recorded forward's). Buffer copies in a forward (none in a decode step) are not replayed.

    python tools/ablate_gpu.py --model qwen2.5-0.5b --format f16            # decode at 512 positions
    python tools/ablate_gpu.py --runtime dawn --dawn-fast --prefill --model qwen2.5-1.5b
    python tools/ablate_gpu.py --prefill --model qwen2.5-1.5b --runtime dawn --choices "default;gate_up_w.json"
    python tools/ablate_gpu.py --small --check                               # lavapipe smoke test

``--choices`` measures several tensor-core configurations (sweep_sgmat.py --out files over the
defaults) on one model build, each as its own result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_gpu  # noqa: E402
from gputime import empty_calls, record, replay, time_lists  # noqa: E402

def label(pipeline, grid) -> str:
    return f"{pipeline.kjarni_name} {grid[0]}x{grid[1]}x{grid[2]}"


def variants(calls: list) -> dict[str, list]:
    """``full``, and per label the calls without that label's dispatches (labels in first-seen order)."""
    out = {"full": calls}
    for name in dict.fromkeys(label(p, g) for p, _, g in calls):
        out[name] = [c for c in calls if label(c[0], c[2]) != name]
    return out


def profiled(ctx, calls: list) -> dict[str, float]:
    """Seconds per label as bench_gpu's profile measures them (a timestamped pass per dispatch)."""
    ctx.profile(True)
    replay(ctx, calls)
    ctx.read(ctx.dummy, 0, 4)
    times = [seconds for _, seconds in ctx.stats.kernel_times]
    ctx.profile(False)
    out: dict[str, float] = defaultdict(float)
    for (pipeline, _, grid), seconds in zip(calls, times):
        out[label(pipeline, grid)] += seconds
    return dict(out)


def ablate(shape: str, fmt: str, context: int, ctx, *, prefill: bool, passes: int, reps: int, warm_s: float,
           check: bool, choices: list[str]) -> list[dict]:
    """One model build, then per entry of ``choices`` ("default", or comma-separated
    tools/sweep_sgmat.py --out files applied over ``bench_gpu.TUNING``): the forward recorded and
    ablated (`measure`). Each result is also printed to stderr as a JSON line when it is done."""
    import copy

    from kjarni.gpu import WgpuOps

    base = copy.deepcopy(bench_gpu.TUNING)
    ops = WgpuOps(ctx, weight_format="f16", tuning=bench_gpu.TUNING)
    model = bench_gpu.build(shape, fmt, ops)
    prompt = (np.arange(context, dtype=np.int32) * 7919) % model.config.vocab_size
    cache = model.new_cache(context + 8)
    results = []
    for choice in choices:
        for name in type(base).field_names():
            setattr(ops.tuning, name, copy.deepcopy(getattr(base, name)))
        ops.tuning.step_capture = False  # a replayed tape would bypass the recorder
        entries = [] if choice == "default" else [c for f in choice.split(",") for c in json.loads(Path(f).read_text())]
        bench_gpu.apply_sgmat_choice(ops.tuning, entries)
        for weight in bench_gpu._matrices(model):
            weight.plans.clear()  # planned once per weight and shape: the choice takes effect now
        result = {"shape": shape, "format": fmt, "context": context, "choice": choice,
                  **measure(ops, model, prompt, cache, prefill=prefill, passes=passes, reps=reps, warm_s=warm_s, check=check)}
        print(json.dumps(result), file=sys.stderr, flush=True)
        results.append(result)
    return results


def measure(ops, model, prompt, cache, *, prefill: bool, passes: int, reps: int, warm_s: float, check: bool) -> dict:
    """Record one forward (the prompt's prefill, or a decode step after it) and time its ablations."""
    ctx = ops.context
    bench_gpu._warm_up(ops, model, prompt, cache, seconds=0.5)  # pipelines
    cache.offset = 0
    token = int(ops.argmax(model.forward(prompt, cache))[0])
    if prefill:
        cache.offset = 0
        calls, out = record(ctx, lambda: model.forward(prompt, cache))
    else:
        int(ops.argmax(model.forward([token], cache))[0])  # one step at this position compiled
        cache.trim(1)
        calls, out = record(ctx, lambda: model.forward([token], cache))
    logits = ops.read(out)  # runs the recorded forward
    result = {"forward": "prefill" if prefill else "decode step", "dispatches": len(calls)}
    if check:  # the full list replayed gives the recorded forward's logits (the same buffers, rewritten)
        ctx.queue.write_buffer(out.buffer, 0, np.zeros(logits.size, np.float32))
        replay(ctx, calls)
        again = ops.read(out)
        result["replay_max_abs_diff"] = float(np.abs(again - logits).max())
        result["replay_matches_forward"] = bool(np.array_equal(again, logits))
    if not ctx.has_timestamps:
        result["timings"] = "unavailable: the adapter has no timestamp-query feature"
        return result
    lists = variants(calls)
    lists["empty"] = empty_calls(ctx, len(calls))
    times = time_lists(ctx, lists, passes, reps, warm_s)
    prof = profiled(ctx, calls)
    counts = defaultdict(int)
    for pipeline, _, grid in calls:
        counts[label(pipeline, grid)] += 1
    full = times["full"]
    result["full_us"] = round(1e6 * full, 1)
    result["empty_chain_us"] = round(1e6 * times["empty"], 1)
    result["profiled_sum_us"] = round(1e6 * sum(prof.values()), 1)
    rows = []
    for name in counts:
        marginal = full - times[name]
        rows.append({"kernel": name, "n": counts[name], "marginal_us": round(1e6 * marginal, 1),
                     "marginal_us_each": round(1e6 * marginal / counts[name], 2),
                     "profiled_us": round(1e6 * prof.get(name, 0.0), 1),
                     "profiled_us_each": round(1e6 * prof.get(name, 0.0) / counts[name], 2)})
    result["kernels"] = sorted(rows, key=lambda r: -r["marginal_us"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b", help=f"one of {sorted(bench_gpu.SHAPES)}")
    parser.add_argument("--format", default="f16", help="f16, q8_0 or q4_k")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefill", action="store_true", help="the prompt's prefill instead of a decode step")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--reps", type=int, default=0, help="runs of a list in a pass (0: 20 for a decode step, 3 for a prefill)")
    parser.add_argument("--warm-ms", type=float, default=300.0)
    parser.add_argument("--check", action="store_true", help="also compare the full replay's logits with the forward's")
    parser.add_argument("--small", action="store_true", help="the tiny shape at 64 positions (CPU adapters)")
    parser.add_argument("--adapter", default=None)
    parser.add_argument("--runtime", choices=("wgpu", "dawn"), default=None)
    parser.add_argument("--dawn-fast", action="store_true", help="Dawn only: disable_robustness and disable_workgroup_init")
    parser.add_argument("--set", action="append", default=[], metavar="ATTR=VALUE", help="override a GpuTuning field")
    parser.add_argument("--choices", default="default", help="configurations measured on one model build, separated "
                        "by ';': 'default', or comma-separated tensor-core choice files (tools/sweep_sgmat.py --out) "
                        "applied over the defaults, as bench_gpu.py --sgmat-choice takes them")
    args = parser.parse_args()
    from kjarni.gpu import WgpuContext
    from kjarni.gpu.runtime import DAWN_FAST_DEVICE_TOGGLES, requested_runtime
    from kjarni.gpu.tuning import GpuTuning

    bench_gpu.TUNING = GpuTuning()
    for item in args.set:
        error = bench_gpu._set_field(bench_gpu.TUNING, item)
        if error:
            parser.error(error)
    if args.small:
        args.model, args.context = "small", 64
    if not os.environ.get("XDG_RUNTIME_DIR"):
        import tempfile

        os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="kjarni-xdg-")
    fast = args.dawn_fast and requested_runtime(args.runtime) == "dawn"
    ctx = WgpuContext(args.adapter, runtime=args.runtime, dawn_device_toggles=DAWN_FAST_DEVICE_TOGGLES if fast else ())
    reps = args.reps or (3 if args.prefill else 20)
    results = ablate(args.model, args.format, args.context, ctx, prefill=args.prefill, passes=args.passes, reps=reps,
                     warm_s=args.warm_ms * 1e-3, check=args.check, choices=args.choices.split(";"))
    report = {"adapter": ctx.description, "runtime": ctx.runtime.description,
              "dawn_device_toggles": list(DAWN_FAST_DEVICE_TOGGLES) if fast else [], "set": args.set,
              "passes": args.passes, "reps": reps, "results": results}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
