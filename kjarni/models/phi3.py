"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama whose checkpoints store q/k/v and gate/up already fused
(``qkv_proj``, ``gate_up_proj``), with LongRoPE scaling (config.json's ``rope_scaling``, or GGUF's
``rope_factors_long/short`` tensors) and possibly partial rotary (``partial_rotary_factor``).
"""

from __future__ import annotations

from typing import Any

from kjarni.model import DecoderModel
from kjarni.models.architecture import Architecture, decoder_shapes


def _shapes(config: Any) -> dict[str, tuple[int, ...]]:
    return decoder_shapes(config, fused_qkv=True, mlp_inputs=("gate_up_proj",))


ARCHITECTURE = Architecture(
    "phi3",
    DecoderModel,
    expected_shapes=_shapes,
    # llama.cpp keeps Phi-3's fusions: ffn_up is gate_up_proj (2 x intermediate rows, gate first).
    gguf_block_names={"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
)
