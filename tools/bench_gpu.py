"""Benchmark the GPU backend on random weights shaped like real models. Prints JSON.

Weights are generated with numpy (no files): f16, and GGUF quantized blocks (Q8_0, Q4_K) with
random quants and sane scales. For each shape and format it measures prefill tok/s for a
``--context``-token prompt (best of 3), decode tok/s at that context (greedy argmax on the GPU, one submit per
token), GPU memory of the weights, dispatches per decode step and, where the adapter has
timestamp queries, GPU time per kernel for one decode step. With torch + CUDA importable it also
times Hugging Face transformers (eager, f16, random weights) on the same shapes; with ``--peer``,
llama.cpp's Vulkan backend on the same weights (tools/peer_llama_cpp.py).

``fma_probe_us`` (where timestamps exist): a fixed f32 FMA kernel timed before and after the timed
part (tools/gputime.py). Its figure follows the GPU's clock at that moment, so within one call a run
whose probe took several times the others' ran at a low clock (an H100 can sit at its idle 345 MHz
through a whole prefill benchmark, warm-up included: seventeenth session, docs/benchmarks.md).

    python tools/bench_gpu.py                      # Qwen2.5-0.5B shape, f16 + Q8_0 + Q4_K
    python tools/bench_gpu.py --model all          # + SmolLM2-135M and Qwen2.5-1.5B shapes
    python tools/bench_gpu.py --small              # a quick check on a CPU adapter (lavapipe)
    python tools/bench_gpu.py --prefill-only --no-torch   # prefill tok/s + GPU time per kernel
    python tools/bench_gpu.py --core --no-torch --peer    # beside llama.cpp, kjarni over llama.cpp
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gputime import FmaProbe  # noqa: E402

if TYPE_CHECKING:
    from kjarni.gpu.tuning import GpuTuning

# main's kernel choices (--set, --tuning, --sgmat-choice), given to every WgpuOps it makes.
TUNING: GpuTuning | None = None

SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=32768),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, head_dim=128, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=32768),
    "small": dict(model_type="qwen2", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=4096,
                  tie_word_embeddings=True, rope_theta=10000.0, max_position_embeddings=1024),
}


class RandomWeights:
    """A `Weights` stand-in: HF-named tensors made on demand (seeded by name), in one storage format."""

    def __init__(self, config: dict, fmt: str) -> None:
        self.config, self.fmt = config, fmt
        c = config
        hidden, inter, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
        hd = c["head_dim"]
        shapes = {"model.embed_tokens.weight": (c["vocab_size"], hidden), "model.norm.weight": (hidden,)}
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (heads * hd, hidden), p + "self_attn.k_proj.weight": (kv * hd, hidden),
                p + "self_attn.v_proj.weight": (kv * hd, hidden), p + "self_attn.o_proj.weight": (hidden, heads * hd),
                p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            })
            if c["model_type"] == "qwen2":
                shapes.update({p + "self_attn.q_proj.bias": (heads * hd,), p + "self_attn.k_proj.bias": (kv * hd,),
                               p + "self_attn.v_proj.bias": (kv * hd,)})
        self.shapes = shapes

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def raw(self, name: str):
        shape = self.shapes[name]
        rng = np.random.default_rng(zlib.crc32(name.encode()))  # the same weights in every process
        if len(shape) == 1:
            base = 1.0 if name.endswith("norm.weight") else 0.0
            return (base + rng.standard_normal(shape) * 0.02).astype(np.float32)
        if self.fmt == "f16":
            return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16).astype(np.float32)
        return random_quant(self.fmt, shape, rng)


def random_quant(fmt: str, shape: tuple[int, int], rng):
    """Random GGUF blocks of type ``fmt`` (a valid tensor of that type) whose dequantized weights
    have mean about 0 and standard deviation about 0.02, as the f16 ones: random quants, fixed
    scales. (Until the ninth session the scales were 0.001 with random Q4_K sub-block scales and
    mins, a mean of about +0.2 a weight: on the Qwen2.5-1.5B shape the down projections' inputs
    reached 1.6e5, past float16's 65,504, so the f16 tensor-core prefill gave NaN.)"""
    import gguf

    from kjarni.weights import QuantTensor

    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    rows, cols = shape
    if cols % gguf.GGML_QUANT_SIZES[qtype][0]:
        # as llama.cpp does for K-quants of rows not a multiple of 256 (most of Qwen2.5-0.5B)
        qtype = gguf.GGMLQuantizationType.Q5_0
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    nb = cols // block
    data = rng.integers(0, 256, (rows, nb * size), dtype=np.uint8)
    blocks = data.reshape(rows, nb, size)

    def put(offset: int, values, dtype) -> None:
        raw = np.asarray(values, dtype).view(np.uint8)
        blocks[:, :, offset : offset + raw.size] = raw

    name = qtype.name
    if name == "Q8_0":  # d * q, q uniform in [-128, 127] (std 74)
        put(0, [0.02 / 74], np.float16)
    elif name in ("Q5_0", "Q4_0"):  # d * (q - 16) or d * (q - 8): std 9.2 or 4.6
        put(0, [0.02 / (9.2 if name == "Q5_0" else 4.6)], np.float16)
    elif name in ("Q4_1", "Q5_1"):  # d * q + m, q uniform in [0, 15] or [0, 31]: m centres it
        std, mid = (4.6, 7.5) if name == "Q4_1" else (9.2, 15.5)
        d = 0.02 / std
        put(0, [d, -mid * d], np.float16)
    elif name == "Q4_K":
        # every scale byte 0x11: sub-blocks 0-3 get scale = min = 17, sub-blocks 4-7 scale = min = 1;
        # dmin = 7.5 d makes each sub-block d * scale * (q - 7.5), q uniform in [0, 15] (std 4.6).
        d = 0.02 / (4.6 * np.sqrt((17**2 + 1) / 2))
        put(0, [d, 7.5 * d], np.float16)
        blocks[:, :, 4:16] = 0x11
    elif name == "Q6_K":  # d * scale * (q - 32), scales 1, q uniform in [0, 63] (std 18.5)
        blocks[:, :, 192:208] = 1
        put(208, [0.02 / 18.5], np.float16)
    else:
        raise ValueError(f"random_quant has no scale layout for {name}")
    return QuantTensor(qtype, shape, data)


def shape_config(shape: str) -> dict:
    """The config of one of SHAPES, as `build` makes its model from (a new dict)."""
    config = dict(SHAPES[shape])
    config.setdefault("rms_norm_eps", 1e-6)
    return config


def build(shape: str, fmt: str, ops):
    from kjarni.model_config import ModelConfig
    from kjarni.model import DecoderModel

    config = shape_config(shape)
    return DecoderModel(ModelConfig.from_dict(config), RandomWeights(config, fmt), ops)


def bench_gpu(shape: str, fmt: str, context: int, steps: int, ctx, core: bool = False) -> dict:
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(ctx, weight_format="f16", tuning=TUNING)
    t0 = time.perf_counter()
    model = build(shape, fmt, ops)
    load_s = time.perf_counter() - t0
    prompt = (np.arange(context, dtype=np.int32) * 7919) % model.config.vocab_size
    capacity = context + 4 * steps + 24

    # Warm-up: compile every pipeline used by prefill and decode.
    cache = model.new_cache(capacity)
    token = int(ops.argmax(model.forward(prompt, cache))[0])
    for _ in range(3):
        token = int(ops.argmax(model.forward([token], cache))[0])

    fma_probe = FmaProbe(ctx) if ctx.has_timestamps else None  # compiled before the warm-up
    _warm_up(ops, model, prompt, cache, probe=fma_probe)
    probe = [fma_probe()] if fma_probe else []  # the clock now and after the decode timings
    prefill_s = float("inf")  # best of 3
    for _ in range(3):
        cache.offset = 0
        t0 = time.perf_counter()
        token = int(ops.argmax(model.forward(prompt, cache))[0])
        prefill_s = min(prefill_s, time.perf_counter() - t0)

    t0 = time.perf_counter()
    for _ in range(steps):
        token = int(ops.argmax(model.forward([token], cache))[0])
    sync_s = time.perf_counter() - t0
    dispatches = ops.stats.last_dispatches

    # The library's greedy loop (generate_step): steps run ahead of the readback, each fed the
    # previous step's argmax on the GPU, ids read once per burst of ops.decode_ahead.
    decode_s = _decode_ahead(model, cache, prompt, steps)

    # The same decode, submitting every 48 dispatches: the GPU runs early layers while Python
    # records the later ones (more submits, less idle time on fast GPUs).
    ctx.submit_every = 48
    t0 = time.perf_counter()
    for _ in range(steps):
        token = int(ops.argmax(model.forward([token], cache))[0])
    overlapped_s = time.perf_counter() - t0
    ctx.submit_every = None

    # CPU cost of recording one step (no submit): what a faster GPU cannot hide. Median of 9.
    records = []
    for _ in range(9):
        t0 = time.perf_counter()
        logits = model.forward([token], cache)
        records.append(time.perf_counter() - t0)
        token = int(ops.argmax(logits)[0])
    record_s = float(np.median(records))

    # The same decode with flash-decoding (attention_decode + attention_combine, after rope_store)
    # instead of the fused attention_step, for comparison at this context.
    single_max, ops.tuning.attention_single_max = ops.tuning.attention_single_max, 0
    fuse_rope, ops.tuning.fuse_rope = ops.tuning.fuse_rope, False
    token = int(ops.argmax(model.forward([token], cache))[0])
    t0 = time.perf_counter()
    for _ in range(steps):
        token = int(ops.argmax(model.forward([token], cache))[0])
    split_s = time.perf_counter() - t0
    ops.tuning.attention_single_max, ops.tuning.fuse_rope = single_max, fuse_rope

    probe += [fma_probe()] if fma_probe else []

    # --core: prefill, greedy decode, recording and the per-step GPU time only (a short device call).
    verify_ms = _verify_costs(model, ops, cache, token, steps) if not core else None
    sampling = _sampling_costs(model, ops, cache, prompt, token, steps) if not core else {}

    result = {
        "shape": shape, "format": fmt, "context": context,
        "verify_ms_by_k": verify_ms,
        "verify_over_decode_k8": round(verify_ms["8"] / verify_ms["0"], 2) if verify_ms else None,
        "prefill_tok_s": round(context / prefill_s, 1),
        "decode_tok_s": round(steps / decode_s, 1),
        "decode_ms": round(1000 * decode_s / steps, 3),
        "decode_ahead": ops.decode_ahead,
        "decode_tok_s_one_readback_per_step": round(steps / sync_s, 1),
        "decode_tok_s_submit_every_48": round(steps / overlapped_s, 1),
        "decode_tok_s_split_attention": round(steps / split_s, 1),
        "fma_probe_us": probe,
        "record_ms_per_step": round(1000 * record_s, 3),
        "dispatches_per_step": dispatches,
        "step_tapes": {"captured": ops.tapes.captured, "replayed": ops.tapes.replayed},  # GpuTuning.step_capture
        "weight_mb": round(ops.weight_bytes / 2**20, 1),
        "weight_formats": sorted({f for w in _matrices(model) for f in w.formats}),
        "kv_cache_mb": round(cache.nbytes / 2**20, 1),
        "load_s": round(load_s, 2),
        **sampling,
    }
    if ctx.has_timestamps:
        try:
            for key, tokens in (("", [token]),) + ((("verify_k8_", [token] * 9),) if not core else ()):
                ctx.profile(True)
                int(ops.argmax(model.forward(tokens, cache, logits="all"))[0])
                cache.trim(len(tokens))
                kernel_times = list(ctx.stats.kernel_times)
                times = defaultdict(float)
                counts = defaultdict(int)
                for name, seconds in ctx.stats.kernel_times:
                    times[name] += seconds
                    counts[name] += 1
                ctx.profile(False)
                result[key + "gpu_us_per_step"] = round(1e6 * sum(times.values()), 1)
                result[key + "kernels_us"] = {k: {"us": round(1e6 * v, 1), "n": counts[k]}
                                              for k, v in sorted(times.items(), key=lambda kv: -kv[1])}
                if not key:  # the step's dispatches in order: embed and the first two layers, the LM head and argmax
                    order = [[name, round(1e6 * s, 2)] for name, s in kernel_times]
                    result["dispatch_us_first"] = order[:11]
                    result["dispatch_us_last"] = order[-3:]
            if not core:
                result["verify_k8_gpu_over_decode"] = round(result["verify_k8_gpu_us_per_step"] / result["gpu_us_per_step"], 2)
        except Exception as exc:  # timestamps are optional
            ctx._profile = None
            result["kernels_us"] = f"unavailable: {exc}"
    del model, cache
    return result


def _decode_ahead(model, cache, prompt, steps: int, sampler=None) -> float:
    """Seconds for ``steps`` tokens after the first (greedy unless ``sampler``), through
    kjarni.decode.generate_step."""
    from kjarni.decode import generate_step
    from kjarni.sampler import make_sampler

    seconds = []
    for _ in range(2):  # the first run warms the bursts' pipelines and buffers
        cache.offset = len(prompt)  # the prompt's keys are already there: generate_step re-runs its last token
        tokens = generate_step(model, prompt, sampler or make_sampler(0.0), np.random.default_rng(0), cache,
                               max_tokens=steps + 1)
        next(tokens)
        t0 = time.perf_counter()
        for _ in range(steps):
            next(tokens)
        seconds.append(time.perf_counter() - t0)
        tokens.close()
    return min(seconds)


def _verify_costs(model, ops, cache, token: int, steps: int) -> dict[str, float]:
    """Speculative verification: ms for the target's forward over the last token and k drafts
    (k + 1 rows, logits of every row, a greedy choice per row read back) at the current context,
    k = 0 .. 8; k = 0 is a plain decode step. The k are interleaved round by round (the host's
    speed drifts) and each gets the median of its ``steps`` rounds."""
    times: dict[int, list[float]] = {k: [] for k in range(9)}
    for k in times:  # compile every shape first
        ops.argmax(model.forward([token] * (k + 1), cache, logits="all"))
        cache.trim(k + 1)
    for _ in range(steps):
        for k in times:
            tokens = [token] * (k + 1)
            t0 = time.perf_counter()
            ops.argmax(model.forward(tokens, cache, logits="all"))
            times[k].append(time.perf_counter() - t0)
            cache.trim(k + 1)
    return {str(k): round(1000 * float(np.median(v)), 3) for k, v in times.items()}


def _sampling_costs(model, ops, cache, prompt, token: int, steps: int) -> dict:
    """Sampled decode with the generator's default settings (temperature 0.7, top-k 50, top-p 0.9:
    drawn on the GPU, kjarni/gpu/sampling.py) against greedy, and what the finite check folded into
    argmax / top_k costs: decode tok/s with ``finite_check`` off, interleaved rounds, best of 3, and
    the GPU time of one step's selection kernels from timestamps (one pass each, so a few us high)."""
    from kjarni.sampler import make_sampler

    variants = {"greedy": make_sampler(0.0), "sampled": make_sampler(0.7, top_k=50, top_p=0.9)}
    best: dict[tuple[str, bool], float] = defaultdict(lambda: float("inf"))
    checked = ops.tuning.finite_check
    for _ in range(3):
        for check in (True, False):
            ops.tuning.finite_check = check
            for name, sampler in variants.items():
                best[name, check] = min(best[name, check], _decode_ahead(model, cache, prompt, steps, sampler))
    kernels: dict[str, dict[str, float]] = {}
    if ops.context.has_timestamps:
        choose = {"argmax": ops.argmax_ahead, "top_k+sample": lambda x: ops.sample_ahead(x, variants["sampled"], 0.5)}
        for check in (True, False):
            ops.tuning.finite_check = check
            for name, select in choose.items():
                cache.offset = len(prompt)
                logits = model.forward([token], cache)
                ops.context.profile(True)  # submits the forward first: only the selection is timed
                ops.read_tokens([select(logits)])
                us = 1e6 * sum(seconds for _, seconds in ops.context.stats.kernel_times)
                ops.context.profile(False)
                kernels.setdefault(name, {})["us_checked" if check else "us_unchecked"] = round(us, 1)
    ops.tuning.finite_check = checked
    return {
        "decode_tok_s_sampled": round(steps / best["sampled", True], 1),
        "sampled_over_greedy": round(best["greedy", True] / best["sampled", True], 3),
        "finite_check": {
            "decode_tok_s_greedy": [round(steps / best["greedy", c], 1) for c in (True, False)],
            "decode_tok_s_sampled": [round(steps / best["sampled", c], 1) for c in (True, False)],
            "order": "[with the check, without]",
            "kernels": kernels,
        },
    }


def _warm_up(ops, model, prompt, cache, seconds: float = 1.0, probe: FmaProbe | None = None) -> None:
    """Prefills ``prompt`` (from position 0) for at least ``seconds`` and 3 times: the H200 runs the
    first prompts after an idle spell at lower clocks (measured: 50 ms of wall time for 25 ms of
    GPU time), which made single timings swing by 2-3x between calls. Then, with a ``probe``,
    0.3 s of its kernel back to back: the prefills alone left an H100 at a low clock more than
    once (their recording idles the GPU in between; eighteenth session, docs/benchmarks.md)."""
    t0, n = time.perf_counter(), 0
    while n < 3 or time.perf_counter() - t0 < seconds:
        cache.offset = 0
        int(ops.argmax(model.forward(prompt, cache))[0])
        n += 1
    if probe is not None:
        probe.spin(0.3)


def bench_prefill(shape: str, fmt: str, context: int, ctx, repeats: int = 3) -> dict:
    """Prefill only: best of ``repeats`` timed prompts, and GPU time per kernel of one prefill."""
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(ctx, weight_format="f16", tuning=TUNING)
    model = build(shape, fmt, ops)
    prompt = (np.arange(context, dtype=np.int32) * 7919) % model.config.vocab_size
    cache = model.new_cache(context + 8)
    fma_probe = FmaProbe(ctx) if ctx.has_timestamps else None  # compiled before the warm-up
    _warm_up(ops, model, prompt, cache, probe=fma_probe)  # pipelines, clocks
    probe = [fma_probe()] if fma_probe else []
    times = []
    for _ in range(repeats):
        cache.offset = 0
        t0 = time.perf_counter()
        int(ops.argmax(model.forward(prompt, cache))[0])
        times.append(time.perf_counter() - t0)
    probe += [fma_probe()] if fma_probe else []
    result = {"shape": shape, "format": fmt, "context": context, "prefill_tok_s": round(context / min(times), 1),
              "prefill_ms": round(1000 * min(times), 2), "fma_probe_us": probe}
    if ctx.has_timestamps:
        cache.offset = 0
        ctx.profile(True)
        int(ops.argmax(model.forward(prompt, cache))[0])
        kernel_times, counts = defaultdict(float), defaultdict(int)
        for name, seconds in ctx.stats.kernel_times:
            kernel_times[name] += seconds
            counts[name] += 1
        ctx.profile(False)
        result["gpu_ms"] = round(1e3 * sum(kernel_times.values()), 3)
        result["kernels_us"] = {k: {"us": round(1e6 * v, 1), "n": counts[k]}
                                for k, v in sorted(kernel_times.items(), key=lambda kv: -kv[1])}
    del model, cache
    return result


def _matrices(model):
    for block in model.blocks:
        yield from (block.qkv, block.o_proj, block.gate_up, block.down_proj)
    yield model.lm_head


def _peer(ours: dict, shape: str, fmt: str, context: int, steps: int) -> dict:
    """llama.cpp on ``ours``'s weights (tools/peer_llama_cpp.py), with kjarni's figures over its
    where llama.cpp ran on a GPU."""
    import peer_llama_cpp

    try:
        peer = peer_llama_cpp.bench_llama_cpp(shape, fmt, context, steps)
    except Exception as exc:
        return {"shape": shape, "format": fmt, "backend": "llama.cpp", "error": f"{type(exc).__name__}: {exc}"}
    for key in ("prefill_tok_s", "decode_tok_s"):  # not against llama.cpp's CPU backend
        if peer["gpu"] and ours.get(key) and peer.get(key):
            peer[f"kjarni_over_peer_{key}"] = round(ours[key] / peer[key], 3)
    return peer


def bench_torch(shape: str, context: int, steps: int) -> dict | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    c = SHAPES[shape]
    kwargs = dict(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                  num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
                  num_key_value_heads=c["num_key_value_heads"], max_position_embeddings=c["max_position_embeddings"],
                  rope_theta=c["rope_theta"], tie_word_embeddings=c["tie_word_embeddings"], torch_dtype="float16")
    if c["model_type"] == "qwen2":
        config, cls = transformers.Qwen2Config(**kwargs), transformers.Qwen2ForCausalLM
    else:
        config, cls = transformers.LlamaConfig(head_dim=c["head_dim"], **kwargs), transformers.LlamaForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).to(device="cuda", dtype=torch.float16).eval()
    prompt = (torch.arange(context, device="cuda") * 7919) % c["vocab_size"]

    def run() -> tuple[float, float]:
        with torch.no_grad():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(prompt[None], use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            prefill = time.perf_counter() - t0
            past = out.past_key_values
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(token, past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                token.item()
            torch.cuda.synchronize()
            return prefill, time.perf_counter() - t0

    run()
    runs = [run() for _ in range(3)]  # best of 3, as for kjarni
    prefill_s, decode_s = min(r[0] for r in runs), min(r[1] for r in runs)
    return {"shape": shape, "backend": "transformers-eager-f16-cuda", "context": context,
            "prefill_tok_s": round(context / prefill_s, 1), "decode_tok_s": round(steps / decode_s, 1)}


def _apply_tuning(tuning: GpuTuning, path: str) -> dict:
    """Set the matvec and matmul choices of ``tuning`` from a sweep's JSON: [[rows, cols, threads,
    rows_per_wg, chunks], ...] and the like."""
    choice = json.loads(Path(path).read_text())
    # Only the keys the file has: a matvec sweep's file leaves the prefill matmul's choices alone.
    if "matvec_configs" in choice:
        tuning.matvec_configs = {(r, c): (t, rr, u) for r, c, t, rr, u in choice["matvec_configs"]}
    if "quant_split_k_min_cols" in choice:
        tuning.quant_split_k_min_cols = choice["quant_split_k_min_cols"]
    if "matvec_template_configs" in choice:
        tuning.matvec_template_configs = {(f, r, c): (wg, lanes, rr, un)
                                          for f, r, c, wg, lanes, rr, un in choice["matvec_template_configs"]}
    if "matvec_dot_configs" in choice:
        tuning.matvec_dot_configs = {(f, r, c): tuple(cfg) for f, r, c, *cfg in choice["matvec_dot_configs"]}
    if "matvec_f16_configs" in choice:
        tuning.matvec_f16_configs = {(r, c): tuple(cfg) or None for r, c, *cfg in choice["matvec_f16_configs"]}
    # tools/sweep_matmul.py's winners: [[rows, cols, TM, TN, BK, KSPLIT, NBUF, S], ...]
    if "matmul_configs" in choice:
        tuning.matmul_configs = {(r, c): tuple(cfg) for r, c, *cfg in choice["matmul_configs"]}
    return choice


def _set_field(tuning: GpuTuning, item: str) -> str | None:
    """Apply one ``--set NAME=VALUE`` (an int or float; for a tuple field such as
    ``attention_tc_head_dims``, comma-separated ints) to ``tuning``; an error message, or None.
    ``NAME[KEY]=VALUE`` sets one entry of a dict field keyed by shape, its key's parts joined by
    ``x`` (``tc_tiles[17920x1536]=4,2,2,4,2,5``, ``tc_quant_tiles[Q4_Kx17920x1536]=..``; ``none``:
    None), into a new dict (the field's default object is left as it was)."""
    name, _, value = item.partition("=")
    key = None
    if name.endswith("]") and "[" in name:
        name, _, key = name[:-1].partition("[")
    known = tuning.field_names()
    if name not in known:
        return f"--set {item}: GpuTuning has no field {name!r}; its fields: {', '.join(known)}"
    if key is not None:
        table = getattr(tuning, name)
        if not isinstance(table, dict):
            return f"--set {item}: {name} is not a dict field; drop [{key}]"
        try:
            entry = None if value == "none" else tuple(int(v) for v in value.split(",") if v)
        except ValueError:
            return f"--set {item}: {value!r} is not comma-separated ints or none"
        parts = tuple(int(p) if p.isdigit() else p for p in key.split("x"))
        setattr(tuning, name, {**table, parts: entry})
        return None
    listed = isinstance(getattr(tuning, name), tuple)
    try:
        setattr(tuning, name, tuple(int(v) for v in value.split(",") if v) if listed else float(value) if "." in value else int(value))
    except ValueError:
        return f"--set {item}: {value!r} is not {'comma-separated ints' if listed else 'an int or a float'}"
    return None


def apply_sgmat_choice(tuning: GpuTuning, choice: list[dict]) -> None:
    """``tools/sweep_sgmat.py --out`` entries over ``tuning``'s defaults, per shape they name (the
    others keep theirs): matmul_tc's tile ("tc"), the first kernel's ("sgmat") or the SIMT kernel
    (None), the K split and matmul_tc's grid order. Entries of a quantized sweep (``--format``) name
    their GGUF format and set ``tc_quant_tiles``."""
    for c in choice:
        tc = c.get("family") == "tc"
        if c.get("format", "f16") != "f16":
            tuning.tc_quant_tiles[(c["format"], c["rows"], c["cols"])] = tuple(c["tile"]) if tc else None
            continue
        shape = (c["rows"], c["cols"])
        tuning.tc_tiles[shape] = tuple(c["tile"]) if tc else None
        tuning.sgmat_tiles.pop(shape, None)
        if c.get("family") == "sgmat":
            tuning.sgmat_tiles[shape] = tuple(c["tile"])
        for counts in (tuning.tc_split_counts, tuning.sgmat_split_counts):
            counts.pop(shape, None)
        if c["tile"] and c["splits"]:
            (tuning.tc_split_counts if tc else tuning.sgmat_split_counts)[shape] = c["splits"]
        if tc:
            tuning.tc_tokens_first_for[shape] = bool(c.get("tokens_first"))
        tuning.tensor_cores = tuning.tensor_cores or tc or c.get("family") == "sgmat"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b", help=f"one of {sorted(SHAPES)} or 'all'")
    parser.add_argument("--formats", default="f16,q8_0,q4_k", help="comma-separated: f16, q8_0, q4_k")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--adapter", default=None, help="substring of the adapter name")
    parser.add_argument("--small", action="store_true", help="a tiny shape, short context (CPU adapters)")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--prefill-only", action="store_true", help="time prefill only, with GPU time per kernel")
    parser.add_argument("--tuning", metavar="JSON", help="kernel choices from tools/sweep_matvec.py --tuning-out")
    parser.add_argument("--runtime", choices=("wgpu", "dawn"), default=None,
                        help="WebGPU runtime: wgpu (wgpu-py, the default) or dawn (wgpudawn); default KJARNI_WEBGPU_RUNTIME")
    parser.add_argument("--core", action="store_true",
                        help="prefill, greedy decode, recording and GPU time per step only (no verify / sampling costs)")
    parser.add_argument("--sgmat-choice", metavar="JSON",
                        help="tensor-core tiles, K splits and grid orders per shape from tools/sweep_sgmat.py --out, comma-separated "
                             "files (missing ones skipped), over the defaults (shapes a file does not name keep theirs)")
    parser.add_argument("--dawn-fast", action="store_true",
                        help="Dawn only: the device toggles disable_robustness and disable_workgroup_init")
    parser.add_argument("--peer", action="store_true",
                        help="also time llama.cpp (tools/peer_llama_cpp.py, the 'peer' extra) on the same weights, "
                             "llama-bench's way, after each shape and format; its row holds kjarni's figures over its own")
    parser.add_argument("--set", action="append", default=[], metavar="ATTR=VALUE",
                        help="override a GpuTuning field (kjarni/gpu/tuning.py; an int or float, comma-separated ints for a "
                             "tuple), e.g. matvec_t_quads=2, or one shape's entry of a dict field, e.g. tc_tiles[17920x1536]=4,2,2,4,2,5")
    args = parser.parse_args()
    from kjarni.gpu.tuning import GpuTuning

    global TUNING
    TUNING = GpuTuning()
    for item in args.set:
        error = _set_field(TUNING, item)
        if error:
            parser.error(error)
    tuning = _apply_tuning(TUNING, args.tuning) if args.tuning else None
    choice_files = [Path(f) for f in (args.sgmat_choice or "").split(",") if f and Path(f).is_file()]
    sgmat_choice = [c for f in choice_files for c in json.loads(f.read_text())] or None
    apply_sgmat_choice(TUNING, sgmat_choice or [])
    if args.small:
        args.model, args.context, args.steps = "small", 64, 8
    if not os.environ.get("XDG_RUNTIME_DIR"):
        import tempfile

        os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="kjarni-xdg-")
    from kjarni.gpu import WgpuContext

    from kjarni.gpu.runtime import DAWN_FAST_DEVICE_TOGGLES

    from kjarni.gpu.runtime import requested_runtime

    fast = args.dawn_fast and requested_runtime(args.runtime) == "dawn"  # ignored on wgpu-native
    ctx = WgpuContext(args.adapter, runtime=args.runtime, dawn_device_toggles=DAWN_FAST_DEVICE_TOGGLES if fast else ())
    shapes = ["smollm2-135m", "qwen2.5-0.5b", "qwen2.5-1.5b"] if args.model == "all" else [args.model]
    report = {"adapter": ctx.description, "runtime": ctx.runtime.description,
              "dawn_device_toggles": list(DAWN_FAST_DEVICE_TOGGLES) if fast else [], "features": sorted(ctx.features), "tuning": tuning, "sgmat_choice": sgmat_choice, "set": args.set,
              "results": []}
    for shape in shapes:
        for fmt in args.formats.split(","):
            try:
                report["results"].append(bench_prefill(shape, fmt.strip(), args.context, ctx) if args.prefill_only
                                          else bench_gpu(shape, fmt.strip(), args.context, args.steps, ctx, args.core))
            except Exception as exc:
                report["results"].append({"shape": shape, "format": fmt, "error": f"{type(exc).__name__}: {exc}"})
            print(json.dumps(report["results"][-1]), file=sys.stderr, flush=True)
            if args.peer:
                report["results"].append(_peer(report["results"][-1], shape, fmt.strip(), args.context, args.steps))
                print(json.dumps(report["results"][-1]), file=sys.stderr, flush=True)
        if not args.no_torch:
            try:
                torch_result = bench_torch(shape, args.context, args.steps)
            except Exception as exc:
                torch_result = {"shape": shape, "backend": "transformers", "error": f"{type(exc).__name__}: {exc}"}
            if torch_result:
                report["results"].append(torch_result)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
