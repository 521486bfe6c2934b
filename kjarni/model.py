"""The decoder forward pass (Llama, Qwen2, Mistral), written once against the `Ops` contract.

Qwen2 is Llama with q/k/v biases; Mistral is Llama (its sliding window only matters past
``sliding_window`` positions, see ``DecoderModel.__init__``). Weights are uploaded once, with
q/k/v fused into one matrix and gate/up into another, so a block is six backend calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kjarni.config import ModelConfig
from kjarni.errors import ContextOverflowError, InvalidConfigurationError, InvalidModelError
from kjarni.ops import Activation, KVCache, Ops, Weight
from kjarni.weights import Weights

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass
class _Block:
    input_norm: Weight
    qkv: Weight
    qkv_bias: Weight | None
    o_proj: Weight
    post_norm: Weight
    gate_up: Weight
    down_proj: Weight


def rope_table(config: ModelConfig, positions: int) -> np.ndarray:
    """``[positions, head_dim]``: cos in the first half of each row, sin in the second.

    Computed in float32 exactly as Hugging Face's rotary embedding does, with Llama 3
    frequency scaling when the config asks for it.
    """
    dim = config.head_dim
    inv_freq = np.float32(1.0) / (
        np.float32(config.rope_theta) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
    )
    inv_freq = _scale_frequencies(inv_freq.astype(np.float32), config)
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.concatenate((np.cos(angles), np.sin(angles)), axis=1).astype(np.float32)


def _scale_frequencies(inv_freq: np.ndarray, config: ModelConfig) -> np.ndarray:
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise InvalidModelError(
        f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)"
    )


class DecoderModel:
    """One decoder language model on one backend.

    ``forward`` runs a whole prompt (prefill) or a single token (decode) through the model,
    writing keys and values at ``kv_cache.offset`` and advancing it.
    """

    def __init__(self, config: ModelConfig, weights: Weights, ops: Ops) -> None:
        if config.model_type not in SUPPORTED_ARCHITECTURES:
            raise InvalidModelError(
                f"architecture {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.config = config
        self.ops = ops
        self.context_size = config.max_position_embeddings
        if config.sliding_window is not None and config.sliding_window < self.context_size:
            # Windowed attention is not implemented yet: cap the context where it stays exact.
            self.context_size = config.sliding_window
        self.rope = ops.weight(rope_table(config, self.context_size), name="rope")
        self.embed_tokens = ops.weight(weights.raw("model.embed_tokens.weight"), name="model.embed_tokens.weight")
        if config.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = ops.weight(weights.raw("lm_head.weight"), name="lm_head.weight")
        self.norm = ops.weight(weights.raw("model.norm.weight"), name="model.norm.weight")
        self.blocks = [self._upload_block(weights, i) for i in range(config.num_hidden_layers)]

    def _upload_block(self, weights: Weights, i: int) -> _Block:
        ops, p = self.ops, f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv_names = [attn + f"{n}_proj.weight" for n in "qkv"]
        bias_names = [attn + f"{n}_proj.bias" for n in "qkv"]
        has_bias = all(name in weights for name in bias_names)
        return _Block(
            input_norm=ops.weight(weights.raw(p + "input_layernorm.weight"), name=p + "input_layernorm.weight"),
            qkv=ops.weight([weights.raw(n) for n in qkv_names], name=attn + "qkv_proj.weight"),
            qkv_bias=ops.weight([weights.raw(n) for n in bias_names], name=attn + "qkv_proj.bias") if has_bias else None,
            o_proj=ops.weight(weights.raw(attn + "o_proj.weight"), name=attn + "o_proj.weight"),
            post_norm=ops.weight(
                weights.raw(p + "post_attention_layernorm.weight"), name=p + "post_attention_layernorm.weight"
            ),
            gate_up=ops.weight(
                [weights.raw(mlp + "gate_proj.weight"), weights.raw(mlp + "up_proj.weight")],
                name=mlp + "gate_up_proj.weight",
            ),
            down_proj=ops.weight(weights.raw(mlp + "down_proj.weight"), name=mlp + "down_proj.weight"),
        )

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """A KV cache for ``capacity`` positions (default and maximum: the model's context)."""
        capacity = self.context_size if capacity is None else capacity
        if not 0 < capacity <= self.context_size:
            raise InvalidConfigurationError(
                f"KV cache capacity {capacity} must be between 1 and the model's context of {self.context_size}"
            )
        c = self.config
        return self.ops.new_kv_cache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, capacity)

    def forward(self, token_ids: np.ndarray | list[int], kv_cache: KVCache, *, logits: str = "last") -> Activation:
        """Run ``token_ids`` at positions ``kv_cache.offset ..`` and return logits.

        ``logits="last"`` returns ``[1, vocab]`` for the last token (prefill, decode);
        ``"all"`` returns ``[tokens, vocab]`` (speculative verification, tests).
        """
        ops, eps = self.ops, self.config.rms_norm_eps
        ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        tokens, start = len(ids), kv_cache.offset
        if tokens == 0:
            raise InvalidConfigurationError("forward needs at least one token")
        if start + tokens > kv_cache.capacity:
            raise ContextOverflowError(
                f"{start + tokens} tokens do not fit in the context of {kv_cache.capacity}",
                tokens=start + tokens,
                context=kv_cache.capacity,
            )
        x = ops.embed(self.embed_tokens, ids)
        for i, block in enumerate(self.blocks):
            qkv = ops.norm_linear(x, block.input_norm, eps, block.qkv, block.qkv_bias)
            q = ops.rope_store(qkv, self.rope, kv_cache, i, start)
            x = ops.linear(ops.attention(q, kv_cache, i, start), block.o_proj, residual=x)
            gate_up = ops.norm_linear(x, block.post_norm, eps, block.gate_up)
            x = ops.linear(ops.silu_mul(gate_up), block.down_proj, residual=x)
        kv_cache.offset = start + tokens
        if logits == "last":
            x = ops.rows(x, tokens - 1, 1)
        return ops.norm_linear(x, self.norm, eps, self.lm_head)
