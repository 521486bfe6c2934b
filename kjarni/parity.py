"""Cross-check the GPU backend against the numpy reference: same model, same prompt, both backends.

Both backends prefill the prompt, then decode greedily for ``steps`` tokens. Every step feeds both
the numpy backend's token (teacher forcing), so the logits stay comparable after a first
disagreement; the report gives the logit differences over every compared row, how often the two
agree on the top token, and the first step where their greedy choices differ.

Where the GPU's products round their input to int8 blocks (decode products by Q8_0, Q5_0 and Q4_K
weights, ``GpuTuning.matvec_int_dot``; prefill products by those and Q4_0, Q4_1, Q5_1, Q6_K off
tensor cores, ``GpuTuning.matmul_int_dot``; both on by default), plain float32 numpy is not the
math the GPU does: a second numpy pass over the same weights with the same rounding
(`kjarni.numpy_ops.quantize_activations`) is, and the report gives the difference from both. The
first says how far the GPU's answer is from the float32 reference. The second is the kernels' own
error (float32 tolerance) where the rounded products do not feed each other, as in a decode step
whose only rounded product is the LM head; where a prompt's products are rounded layer after
layer, a value that lands on a rounding tie rounds one way on the GPU and the other in numpy (their
float sums differ in the last bit) and the difference compounds: on the default model (30 layers,
Q4_1) the second figure is as large as the first (docs/benchmarks.md, twenty-first session), and
the kernels' error is what tests/test_gpu_matmul_dot.py holds per product.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from kjarni.errors import InvalidConfigurationError
from kjarni.loader import load_model
from kjarni.numpy_ops import NumpyOps
from kjarni.progress import Progress
from kjarni.quiet import notice, quiet_mesa


@dataclasses.dataclass(frozen=True)
class ParityReport:
    """What ``run_parity`` measured; ``first_divergence`` is None when every greedy step agreed."""

    model: str
    adapter: str
    weight_format: str
    prompt_tokens: int
    steps: int
    max_abs_diff: float
    mean_abs_diff: float
    top1_agreement: float
    first_divergence: int | None
    cpu_tokens: tuple[int, ...]
    gpu_tokens: tuple[int, ...]
    runtime: str = ""  # the WebGPU runtime that ran the GPU side ("wgpu-py 0.32.0 (wgpu-native)")
    # Against numpy with the products' inputs rounded to int8 where the GPU rounds them (decode;
    # prefill with matmul_dot); None when no product of this model does (no weight of those
    # formats, or the integer-dot kernels off).
    max_abs_diff_matched: float | None = None
    mean_abs_diff_matched: float | None = None

    def to_text(self) -> str:
        diverged = "none" if self.first_divergence is None else f"step {self.first_divergence}"
        return "\n".join(
            [
                f"model            {self.model}",
                f"gpu              {self.adapter} ({self.weight_format} weights)" + (f" on {self.runtime}" if self.runtime else ""),
                f"compared rows    {self.steps + 1} (prompt of {self.prompt_tokens} tokens, then {self.steps} greedy steps)",
                f"max |logit diff| {self.max_abs_diff:.3g}",
                f"mean |diff|      {self.mean_abs_diff:.3g}",
                *([] if self.max_abs_diff_matched is None else [
                    "  against numpy with inputs rounded to int8 where the GPU's integer dot rounds them:",
                    f"  max |diff| {self.max_abs_diff_matched:.3g}, mean {self.mean_abs_diff_matched:.3g}",
                ]),
                f"top-1 agreement  {self.top1_agreement:.1%}",
                f"first divergence {diverged}",
            ]
        )


def run_parity(
    path: str | Path,
    prompt: str,
    *,
    steps: int = 16,
    weight_format: str = "f32",
    context: Any = None,
    name: str | None = None,
    quiet: bool = False,
) -> ParityReport:
    """Run the model at ``path`` on numpy and on the GPU and compare their logits for ``prompt``.

    Says on stderr what it is doing (loading on each backend, then a bar over the prompt and the
    greedy steps) unless ``quiet``: on a real model this takes minutes.
    """
    from kjarni.gpu import WgpuContext, WgpuOps

    if steps < 0:
        raise InvalidConfigurationError(f"steps={steps} must be >= 0")
    quiet_mesa()
    label = name or str(path)
    context = context or WgpuContext()
    notice(f"parity: loading {label} on the CPU (numpy, float32)", quiet)
    cpu = load_model(path, ops=NumpyOps(), quiet=quiet)
    notice(f"parity: loading {label} on the GPU ({context.description}, {weight_format} weights)", quiet)
    gpu = load_model(path, ops=WgpuOps(context, weight_format=weight_format), quiet=quiet)
    cpu_ops: NumpyOps = cpu.model.ops
    tuning = gpu.model.ops.tuning
    # The prompt's products too where they run matmul_dot (not on tensor cores, which quantized
    # weights reach where the device has an f16 subgroup-matrix configuration).
    prefill_dot = bool(tuning.matmul_int_dot) and not (tuning.tensor_cores and tuning.tc_quant and context.f16_matrix_subgroup)
    matched = (bool(tuning.matvec_int_dot) and cpu_ops.has_int_dot_weights) or (prefill_dot and cpu_ops.has_int_dot_prefill_weights)
    ids = cpu.tokenizer.encode(prompt)
    if not ids:
        if cpu.tokenizer.bos_token_id is None:
            raise InvalidConfigurationError("the prompt is empty and the model has no BOS token to start from")
        ids = [cpu.tokenizer.bos_token_id]
    capacity = len(ids) + steps
    cpu_cache, gpu_cache = cpu.model.new_cache(capacity), gpu.model.new_cache(capacity)
    matched_cache = cpu.model.new_cache(capacity) if matched else None

    def matched_forward(tokens: list[int]) -> np.ndarray | None:
        """The same numpy model with int8-rounded one-token product inputs (and prefill product
        inputs with ``prefill_dot``), on its own cache."""
        if matched_cache is None:
            return None
        cpu_ops.quantize_activations = bool(tuning.matvec_int_dot)
        cpu_ops.quantized_prefill_min_tokens = tuning.matvec_max_tokens + 1 if prefill_dot else 0
        try:
            return cpu_ops.read(cpu.model.forward(tokens, matched_cache))[0]
        finally:
            cpu_ops.quantize_activations = False
            cpu_ops.quantized_prefill_min_tokens = 0

    bar = Progress(steps + 1, f"parity: prompt of {len(ids)} tokens + {steps} greedy steps on both", quiet, unit="steps")
    with bar:  # one unit per compared row: the prompt, then each greedy step
        cpu_logits = cpu.model.ops.read(cpu.model.forward(ids, cpu_cache))[0]
        gpu_logits = gpu.model.ops.read(gpu.model.forward(ids, gpu_cache))[0]
        matched_logits = matched_forward(ids)
        diffs, matched_diffs, agree, cpu_tokens, gpu_tokens = [], [], [], [], []
        for step in range(steps + 1):
            bar.update(1)
            diffs.append(np.abs(cpu_logits - gpu_logits))
            if matched_logits is not None:
                matched_diffs.append(np.abs(matched_logits - gpu_logits))
            cpu_tokens.append(int(np.argmax(cpu_logits)))
            gpu_tokens.append(int(np.argmax(gpu_logits)))
            agree.append(cpu_tokens[-1] == gpu_tokens[-1])
            if step == steps:
                break
            cpu_logits = cpu.model.ops.read(cpu.model.forward([cpu_tokens[-1]], cpu_cache))[0]
            gpu_logits = gpu.model.ops.read(gpu.model.forward([cpu_tokens[-1]], gpu_cache))[0]
            matched_logits = matched_forward([cpu_tokens[-1]])
    all_diffs = np.stack(diffs)
    all_matched = np.stack(matched_diffs) if matched_diffs else None
    first = next((i for i, same in enumerate(agree) if not same), None)
    return ParityReport(
        model=label,
        adapter=context.description,
        weight_format=weight_format,
        prompt_tokens=len(ids),
        steps=steps,
        max_abs_diff=float(all_diffs.max()),
        mean_abs_diff=float(all_diffs.mean()),
        top1_agreement=float(np.mean(agree)),
        first_divergence=first,
        cpu_tokens=tuple(cpu_tokens),
        gpu_tokens=tuple(gpu_tokens),
        runtime=context.runtime.description,
        max_abs_diff_matched=None if all_matched is None else float(all_matched.max()),
        mean_abs_diff_matched=None if all_matched is None else float(all_matched.mean()),
    )

