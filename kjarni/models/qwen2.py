"""Qwen2 (Qwen2.5, Qwen2.5-Coder): Llama plus q/k/v biases, and a sliding window that, when
``use_sliding_window`` turns it on, applies from layer ``max_window_layers`` on (transformers'
``layer_types``). Its config.json has no ``attention_bias`` key: the biases are implied.
"""

from __future__ import annotations

from typing import Any, Mapping

from kjarni.model import DecoderModel
from kjarni.models.architecture import Architecture


def _config_json(d: dict[str, Any], source: str) -> dict[str, Any]:
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    return {
        **d,
        "attention_bias": True,
        "sliding_window": window,
        "max_window_layers": int(d.get("max_window_layers") or 0) if window else 0,
    }


def _gguf_config(d: dict[str, Any], meta: Any, tensor_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    return {**d, "attention_bias": True}


ARCHITECTURE = Architecture("qwen2", DecoderModel, config_json=_config_json, gguf_config=_gguf_config)
