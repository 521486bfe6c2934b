"""Every kernel's ``Params`` uniform, declared once: field names in WGSL order, all 4-byte scalars.

A test parses each shader's ``struct Params`` and compares it with these declarations, so the
Python packing and the WGSL layout cannot drift apart.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamsLayout:
    """A WGSL uniform struct of ``u32`` / ``f32`` fields, padded to 16 bytes."""

    name: str
    fields: tuple[tuple[str, str], ...]  # (field name, "u32" | "f32")

    @property
    def size(self) -> int:
        return -(-4 * len(self.fields) // 16) * 16

    def __post_init__(self) -> None:
        codes = "".join("I" if kind == "u32" else "f" for _, kind in self.fields)
        pad = (self.size - 4 * len(self.fields)) // 4
        object.__setattr__(self, "_struct", struct.Struct("<" + codes + "I" * pad))
        object.__setattr__(self, "_names", tuple(name for name, _ in self.fields))
        object.__setattr__(self, "_pad", (0,) * pad)

    def pack(self, **values: float) -> bytes:
        """The struct's bytes; missing fields are zero, unknown ones are an error."""
        if not values.keys() <= set(self._names):
            raise KeyError(f"{self.name} has no field(s) {sorted(set(values) - set(self._names))}")
        return self._struct.pack(*(values.get(name, 0) for name in self._names), *self._pad)


def _layout(name: str, spec: str) -> ParamsLayout:
    fields = tuple(tuple(item.split(":")) for item in spec.split())
    return ParamsLayout(name, fields)  # type: ignore[arg-type]


LINEAR = _layout(
    "LinearParams", "rows:u32 cols:u32 tokens:u32 flags:u32 row_offset:u32 y_stride:u32 eps:f32 _pad:u32"
)
"""The linear family (every weight format): docs/gpu-kernels.md."""
LINEAR_BIAS, LINEAR_RESIDUAL, LINEAR_NORM, LINEAR_SILU = 1, 2, 4, 8
"""``LINEAR.flags`` bits. ``LINEAR_SILU``: x is ``[tokens, 2 cols]`` = ``[gate | up]`` and the kernel
multiplies by ``silu(gate) * up`` (silu_mul fused into the down projection)."""

EMBED = LINEAR
"""The embedding gather family uses the linear Params (flags, y_stride, eps unused)."""
RMS_NORM = _layout("RmsNormParams", "cols:u32 tokens:u32 eps:f32 _pad:u32")
SILU_MUL = _layout("SiluMulParams", "half:u32 tokens:u32 _pad0:u32 _pad1:u32")
LAYER_NORM = _layout("LayerNormParams", "cols:u32 tokens:u32 eps:f32 _pad:u32")
ELEMENTWISE = _layout("ElementwiseParams", "count:u32 _pad0:u32 _pad1:u32 _pad2:u32")
"""gelu and add: ``count`` values of the activation(s)."""
ROWS = _layout("RowsParams", "count:u32 first:u32 _pad0:u32 _pad1:u32")
"""rows.wgsl: ``count`` values from value ``first`` of the activation (both rows x features)."""
ROPE_STORE = _layout(
    "RopeStoreParams",
    "num_heads:u32 num_kv_heads:u32 head_dim:u32 tokens:u32 capacity:u32 rotary_dim:u32 _pad1:u32 _pad2:u32",
)
"""``rotary_dim``: dims of each head that rotate (the rope table's width); 0 stores without rotation."""
ATTENTION = _layout(
    "AttentionParams", "num_heads:u32 num_kv_heads:u32 head_dim:u32 tokens:u32 capacity:u32 max_splits:u32 scale:f32 window:u32"
)
"""``window``: sliding attention window (0: none); position p sees keys p - window < k <= p."""
ATTENTION_STEP = _layout(
    "AttentionStepParams",
    "num_heads:u32 num_kv_heads:u32 head_dim:u32 capacity:u32 rotary_dim:u32 window:u32 scale:f32 _pad:u32",
)
"""attention_step.wgsl (decode: rope_store and attention_single in one dispatch)."""
SELECT = _layout("SelectParams", "cols:u32 tokens:u32 chunks:u32 k:u32")
"""argmax and top_k."""
SAMPLE = _layout("SampleParams", "n:u32 top_k:u32 temperature:f32 top_p:f32 min_p:f32 flagged:u32 _pad1:u32 _pad2:u32")
"""sample.wgsl: ``n`` candidates (top_k + 1, or the vocabulary if smaller) and the sampler's settings;
``flagged``: candidates[n] holds top_k.wgsl's "incomplete" flag (its PER_CHUNK variant)."""
DRAW = _layout("Draw", "u:f32 _pad0:u32 _pad1:u32 _pad2:u32")
"""sample.wgsl's per-step uniform: the step's random draw ``u`` in [0, 1)."""

STEP = _layout("Step", "start:u32 _pad0:u32 _pad1:u32 _pad2:u32")
"""The per-step uniform (binding ``step``): written once per forward, shared by every layer."""

KERNEL_PARAMS: dict[str, ParamsLayout] = {
    "linear_f32": LINEAR,
    "linear_f16": LINEAR,
    "rms_norm": RMS_NORM,
    "silu_mul": SILU_MUL,
    "layer_norm": LAYER_NORM,
    "gelu": ELEMENTWISE,
    "add": ELEMENTWISE,
    "rows": ROWS,
    "rope_store": ROPE_STORE,
    "attention_decode": ATTENTION,
    "attention_combine": ATTENTION,
    "attention_prefill": ATTENTION,
    "attention_single": ATTENTION,
    "attention_step": ATTENTION_STEP,
    "argmax": SELECT,
    "top_k": SELECT,
    "sample": SAMPLE,
}
"""Shader file stem -> the layout of its ``struct Params`` (quantized kernels use LINEAR / EMBED)."""

STEP_KERNELS = ("rope_store", "attention_decode", "attention_combine", "attention_prefill", "attention_single",
                "attention_step")
"""Kernels that also declare ``struct Step``."""
