"""Llama (1, 2, 3.x; SmolLM2): the plain pre-norm RoPE decoder, SwiGLU MLP, no sliding window.

llama.cpp's converter permutes the attn_q/attn_k rows of llama GGUFs for its interleaved RoPE;
weights.py undoes it at load. Llama 3.x RoPE scaling comes from config.json's ``rope_scaling``
or, in GGUF files, a ``rope_freqs`` tensor (model_config.py reads both).
"""

from __future__ import annotations

from typing import Any, Mapping

from kjarni.model import DecoderModel
from kjarni.models.architecture import Architecture, no_window


def _gguf_config(d: dict[str, Any], meta: Any, tensor_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    return {**d, "sliding_window": None}


ARCHITECTURE = Architecture(
    "llama", DecoderModel, config_json=no_window, gguf_config=_gguf_config, gguf_permuted_qk=True,
)
