"""A/B the attention knobs of `GpuTuning` on one model build. Prints JSON lines.

Builds a random-weight model once (tools/bench_gpu.py's shapes and weights), then for each
variant (``--prefill`` / ``--decode``: ``field=value[,field=value...]``, ``default`` for the defaults)
sets the fields, drops the weights' cached plans and measures, in interleaved rounds: prefill
tok/s (best of 3) with the GPU time of the attention kernels and of the whole prompt, or greedy
decode tok/s (kjarni.decode.generate_step) with the GPU time of one step, its attention_step and
o_proj merge, from timestamp queries. Each result line is also appended to ``--out`` as it comes;
after the last round, one ``decode_summary`` / ``prefill_summary`` line per variant gives its
medians over the rounds and its median tok/s as a ratio to the default's.

    python tools/ab_attention_gpu.py --model qwen2.5-1.5b --prefill "default;attention_prefill_chunk=0"
    python tools/ab_attention_gpu.py --decode "default;attention_step_splits=4;matvec_attn_threads=512"
    python tools/ab_attention_gpu.py --runtime dawn --dawn-fast --model qwen2.5-1.5b \
        --prefill "default;attention_tc_head_dims=64,128,attention_tc_online=1"
    python tools/ab_attention_gpu.py --runtime dawn --dawn-fast --model qwen2.5-1.5b \
        --prefill "default;tc_tiles[17920x1536]=4,2,2,4,2,5"   # one shape's entry of a dict field
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_gpu  # noqa: E402
from gputime import FmaProbe  # noqa: E402


def _defaults(tuning) -> dict:
    """The fields `_apply` restores before each variant: every number, tuple and dict field (dict
    fields such as tc_tiles[..]= are replaced whole by a variant, never changed in place, so keeping
    the default object restores them) and every field whose default is None (matmul_dot_splits,
    the automatic choice), so that no variant's setting leaks into the next."""
    values = {n: getattr(tuning, n) for n in tuning.field_names()}
    return {n: v for n, v in values.items() if v is None or isinstance(v, (int, float, tuple, dict))}


def _apply(ops, model, variant: str, defaults: dict) -> None:
    for name, value in defaults.items():
        setattr(ops.tuning, name, value)
    if variant != "default":
        items: list[str] = []
        for part in variant.split(","):  # a part without "=" continues a tuple value (attention_tc_head_dims=64,128)
            if "=" in part or not items:
                items.append(part.strip())
            else:
                items[-1] += "," + part.strip()
        for item in items:
            error = bench_gpu._set_field(ops.tuning, item)
            if error:
                raise SystemExit(error)
    for weight in bench_gpu._matrices(model):
        weight.plans.clear()  # the merging o_proj's threads and lanes are planned once per weight


def _profile(ctx, run) -> dict[str, float]:
    ctx.profile(True)
    run()
    times = defaultdict(float)
    previous = ""
    for name, seconds in ctx.stats.kernel_times:
        # What follows a decode step's attention_step: o_proj (the merging matvec when split), or attention_combine.
        times["after_attention_step" if previous.startswith("attention_step") else name.split(":")[0]] += seconds
        previous = name
    ctx.profile(False)
    return {k: round(1e6 * v, 1) for k, v in times.items()}


def summary(results: list[dict]) -> list[dict]:
    """One line per (kind, variant) of ``results`` (the decode and prefill lines, in order): the
    median over rounds of tok/s and of GPU time (decode: also of attention_step and the kernel
    after it, the merging o_proj, where every round profiled them), and the median tok/s as a
    ratio to the default's (the first variant when none is named ``default``), so a run reads
    side by side."""
    lines = []
    for kind, rate, gpu in (("decode", "decode_tok_s", "gpu_us_per_step"), ("prefill", "prefill_tok_s", "gpu_ms")):
        by_variant: dict[str, list[dict]] = defaultdict(list)
        for r in results:
            if r.get("kind") == kind:
                by_variant[r["variant"]].append(r)
        if not by_variant:
            continue
        base = by_variant.get("default") or next(iter(by_variant.values()))
        base_rate = float(np.median([r[rate] for r in base]))
        for variant, rows in by_variant.items():
            median = float(np.median([r[rate] for r in rows]))
            lines.append({"kind": f"{kind}_summary", "variant": variant, "rounds": len(rows),
                          f"median_{rate}": round(median, 1),
                          f"median_{gpu}": round(float(np.median([r[gpu] for r in rows])), 3),
                          "ratio_to_default": round(median / base_rate, 4)})
            for kernel in ("attention_step", "after_attention_step"):  # decode: the step's attention
                if all(kernel in r.get("kernels_us", {}) for r in rows):
                    lines[-1][f"median_{kernel}_us"] = round(float(np.median([r["kernels_us"][kernel] for r in rows])), 1)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--format", default="f16")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefill", default="", help="variants separated by ';' (default: the defaults)")
    parser.add_argument("--decode", default="", help="variants separated by ';' (default: the defaults)")
    parser.add_argument("--out", default=None, help="append each result as a JSON line to this file")
    parser.add_argument("--runtime", choices=("wgpu", "dawn"), default=None,
                        help="WebGPU runtime (default: $KJARNI_WEBGPU_RUNTIME, else wgpu)")
    parser.add_argument("--dawn-fast", action="store_true", help="Dawn only: disable_robustness / disable_workgroup_init")
    args = parser.parse_args()
    if not os.environ.get("XDG_RUNTIME_DIR"):
        import tempfile

        os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="kjarni-xdg-")
    from kjarni.gpu import WgpuContext, WgpuOps
    from kjarni.gpu.runtime import DAWN_FAST_DEVICE_TOGGLES, requested_runtime

    fast = args.dawn_fast and requested_runtime(args.runtime) == "dawn"
    ctx = WgpuContext(runtime=args.runtime, dawn_device_toggles=DAWN_FAST_DEVICE_TOGGLES if fast else ())
    ops = WgpuOps(ctx, weight_format="f16")
    model = bench_gpu.build(args.model, args.format, ops)
    defaults = _defaults(ops.tuning)
    prompt = (np.arange(args.context, dtype=np.int32) * 7919) % model.config.vocab_size
    cache = model.new_cache(args.context + args.steps + 16)
    fma_probe = FmaProbe(ctx) if ctx.has_timestamps else None  # compiled before the warm-up
    bench_gpu._warm_up(ops, model, prompt, cache, probe=fma_probe)

    results: list[dict] = []

    def emit(result: dict) -> None:
        result.update(shape=args.model, format=args.format, context=args.context, adapter=ctx.description,
                      runtime=ctx.runtime.description, dawn_fast=fast)
        results.append(result)
        line = json.dumps(result)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    prefill = [v for v in args.prefill.split(";") if v]
    decode = [v for v in args.decode.split(";") if v]
    for round_ in range(args.rounds):
        for variant in prefill:
            _apply(ops, model, variant, defaults)

            def run() -> None:
                cache.offset = 0
                int(ops.argmax(model.forward(prompt, cache))[0])

            run()  # plans and pipelines of this variant
            if fma_probe is not None:
                fma_probe.spin(0.3)  # compiling them idled the GPU: back to its clock
            probe = [fma_probe()] if fma_probe else []
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            kernels = _profile(ctx, run)
            emit({"kind": "prefill", "variant": variant, "round": round_,
                  "prefill_tok_s": round(args.context / min(times), 1), "fma_probe_us": probe,
                  "gpu_ms": round(sum(kernels.values()) / 1e3, 3),
                  "attention_us": {k: v for k, v in kernels.items() if k.startswith("attention")},
                  "top_kernels_us": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:6])})
        for variant in decode:
            _apply(ops, model, variant, defaults)
            cache.offset = 0
            token = int(ops.argmax(model.forward(prompt, cache))[0])
            seconds = bench_gpu._decode_ahead(model, cache, prompt, args.steps)
            cache.offset = args.context
            token = int(ops.argmax(model.forward([token], cache))[0])

            def step() -> None:
                int(ops.argmax(model.forward([token], cache, logits="all"))[0])
                cache.trim(1)

            kernels = _profile(ctx, step)
            emit({"kind": "decode", "variant": variant, "round": round_,
                  "decode_tok_s": round(args.steps / seconds, 1),
                  "gpu_us_per_step": round(sum(kernels.values()), 1),
                  "kernels_us": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:8])})
    for line in summary(list(results)):
        emit(line)


if __name__ == "__main__":
    main()
