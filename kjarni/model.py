"""The decoder forward pass, written once against the `Ops` contract: pre-norm blocks of RMSNorm,
RoPE attention (grouped-query, optional q/k/v biases and sliding window) and a gated MLP.

What a family changes is given, not looked up: the config (biases, window, RoPE scaling), the
tensors present (q/k/v and gate/up stored fused or apart), and the MLP's input projections and
activation (``mlp_inputs``, ``mlp_activation``; SwiGLU by default), which a family's module
(kjarni/models/) binds. Weights are uploaded once, with q/k/v fused into one matrix and the MLP's
inputs into another, so a block is six backend calls. RoPE frequency scaling (linear, llama3,
longrope) is applied once, when the tables are built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from typing import TYPE_CHECKING, Callable

from kjarni.backend import Activation, DeviceTokens, KVCache, Ops, Weight
from kjarni.errors import ContextOverflowError, InvalidConfigurationError, InvalidModelError

if TYPE_CHECKING:
    from kjarni.model_config import ModelConfig
    from kjarni.weights import Weights


def swiglu(ops: Ops, gate_up: Activation) -> Activation:
    """The SwiGLU MLP's activation: ``silu(gate) * up`` over ``[gate | up]``."""
    return ops.silu_mul(gate_up)


@dataclass
class _Block:
    input_norm: Weight
    qkv: Weight
    qkv_bias: Weight | None
    o_proj: Weight
    post_norm: Weight
    gate_up: Weight
    down_proj: Weight


def rope_table(config: ModelConfig, positions: int, *, long_context: bool = False) -> np.ndarray:
    """``[positions, rotary_dim]``: cos in the first half of each row, sin in the second.

    Computed in float32 exactly as Hugging Face's rotary embedding does, with the frequency scaling
    the config asks for (linear, llama3, longrope). LongRoPE has two tables: short factors for
    sequences within ``original_max_position_embeddings``, long ones past it (``long_context``),
    both multiplied by its attention factor.
    """
    dim = int(config.head_dim * getattr(config, "partial_rotary_factor", 1.0))
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    base = (np.float32(config.rope_theta) ** exponents).astype(np.float32)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    attention_factor = np.float32(1.0)
    if kind == "longrope":
        factors = scaling["long_factor"] if long_context else scaling["short_factor"]
        inv_freq = np.float32(1.0) / (np.asarray(factors, dtype=np.float32) * base)
        attention_factor = np.float32(_longrope_attention_factor(config))
    else:
        inv_freq = _scale_frequencies(np.float32(1.0) / base, config)
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    return (np.concatenate((np.cos(angles), np.sin(angles)), axis=1) * attention_factor).astype(np.float32)


def _longrope_attention_factor(config: ModelConfig) -> float:
    """LongRoPE's cos/sin multiplier: given, or ``sqrt(1 + ln(factor) / ln(original))`` (transformers)."""
    scaling = config.rope_scaling
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _scale_frequencies(inv_freq: np.ndarray, config: ModelConfig) -> np.ndarray:
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if kind == "freq_factors":  # llama.cpp's rope_freqs tensor (GGUF): llama3 scaling, precomputed
        return (inv_freq / np.asarray(scaling["factors"], dtype=np.float32)).astype(np.float32)
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
        f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3, longrope, freq_factors)"
    )


def check_fits(tokens: int, start: int, kv_cache: KVCache) -> None:
    """Refuse an empty forward or one that would write past the cache (shared by every forward)."""
    if tokens == 0:
        raise InvalidConfigurationError("forward needs at least one token")
    if start + tokens > kv_cache.capacity:
        raise ContextOverflowError(
            f"{start + tokens} tokens do not fit in the context of {kv_cache.capacity}",
            tokens=start + tokens,
            context=kv_cache.capacity,
        )


def new_kv_cache(ops: Ops, config: ModelConfig, context_size: int, capacity: int | None) -> KVCache:
    """A KV cache of ``config``'s shape for ``capacity`` positions (default and maximum:
    ``context_size``); any other capacity is an InvalidConfigurationError naming it."""
    capacity = context_size if capacity is None else capacity
    if not 0 < capacity <= context_size:
        raise InvalidConfigurationError(
            f"KV cache capacity {capacity} must be between 1 and the model's context of {context_size}"
        )
    return ops.new_kv_cache(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, capacity)


class DecoderModel:
    """One decoder language model on one backend.

    ``forward`` runs a whole prompt (prefill) or a single token (decode) through the model,
    writing keys and values at ``kv_cache.offset`` and advancing it.
    """

    def __init__(
        self, config: ModelConfig, weights: Weights, ops: Ops, *,
        mlp_inputs: tuple[str, ...] = ("gate_proj", "up_proj"),
        mlp_activation: Callable[[Ops, Activation], Activation] = swiglu,
    ) -> None:
        self.config = config
        self.mlp_inputs = mlp_inputs
        self.mlp_activation = mlp_activation
        self.ops = ops
        self.context_size = config.max_position_embeddings
        self.windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
        scaling = config.rope_scaling or {}
        # LongRoPE switches tables on the length of the sequence so far, as transformers does: short
        # factors while it fits the original context (only that many rows needed), long ones past it.
        self.short_context = 0
        self.rope_short = None
        if scaling.get("rope_type") == "longrope":
            self.short_context = min(int(scaling["original_max_position_embeddings"]), self.context_size)
            self.rope_short = ops.weight(rope_table(config, self.short_context), name="rope.short")
        self.rope = ops.weight(rope_table(config, self.context_size, long_context=True), name="rope")
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
        # Some checkpoints store the fusions themselves (qkv_proj, gate_up_proj); the others are fused here.
        fused = attn + "qkv_proj.weight" in weights
        qkv_names = [attn + "qkv_proj.weight"] if fused else [attn + f"{n}_proj.weight" for n in "qkv"]
        bias_names = [attn + "qkv_proj.bias"] if fused else [attn + f"{n}_proj.bias" for n in "qkv"]
        has_bias = all(name in weights for name in bias_names)
        gate_up_names = [mlp + "gate_up_proj.weight"] if mlp + "gate_up_proj.weight" in weights else [
            mlp + f"{name}.weight" for name in self.mlp_inputs]
        return _Block(
            input_norm=ops.weight(weights.raw(p + "input_layernorm.weight"), name=p + "input_layernorm.weight"),
            qkv=ops.weight([weights.raw(n) for n in qkv_names], name=attn + "qkv_proj.weight"),
            qkv_bias=ops.weight([weights.raw(n) for n in bias_names], name=attn + "qkv_proj.bias") if has_bias else None,
            o_proj=ops.weight(weights.raw(attn + "o_proj.weight"), name=attn + "o_proj.weight"),
            post_norm=ops.weight(
                weights.raw(p + "post_attention_layernorm.weight"), name=p + "post_attention_layernorm.weight"
            ),
            gate_up=ops.weight([weights.raw(n) for n in gate_up_names], name=mlp + "gate_up_proj.weight"),
            down_proj=ops.weight(weights.raw(mlp + "down_proj.weight"), name=mlp + "down_proj.weight"),
        )

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """A KV cache for ``capacity`` positions (default and maximum: the model's context)."""
        return new_kv_cache(self.ops, self.config, self.context_size, capacity)

    def forward(self, token_ids: np.ndarray | list[int] | DeviceTokens, kv_cache: KVCache, *, logits: str = "last") -> Activation:
        """Run ``token_ids`` at positions ``kv_cache.offset ..`` and return logits.

        ``logits="last"`` returns ``[1, vocab]`` for the last token (prefill, decode);
        ``"all"`` returns ``[tokens, vocab]`` (speculative verification, tests). ``token_ids`` may
        be `DeviceTokens` from the backend's ``argmax_ahead`` (greedy decode running ahead).
        """
        ids = token_ids if isinstance(token_ids, DeviceTokens) else np.asarray(token_ids, dtype=np.int32).reshape(-1)
        tokens, start = len(ids), kv_cache.offset
        check_fits(tokens, start, kv_cache)
        rope = self.rope_short if start + tokens <= self.short_context else self.rope
        tapes = getattr(self.ops, "tapes", None)  # the GPU's step capture: a recorded step replayed (kjarni/gpu/capture.py)
        if tapes is not None:
            return tapes.forward(self, ids, kv_cache, logits, rope, self.windows, self._forward)
        return self._forward(ids, kv_cache, logits, rope)

    def _forward(self, ids: np.ndarray | DeviceTokens, kv_cache: KVCache, logits: str, rope: Weight) -> Activation:
        ops, eps = self.ops, self.config.rms_norm_eps
        tokens, start = len(ids), kv_cache.offset
        x = ops.embed(self.embed_tokens, ids)
        for i, block in enumerate(self.blocks):
            qkv = ops.norm_linear(x, block.input_norm, eps, block.qkv, block.qkv_bias)
            q = ops.rope_store(qkv, rope, kv_cache, i, start)
            attn = ops.attention(q, kv_cache, i, start, self.windows[i])
            x = ops.linear(attn, block.o_proj, residual=x)
            if self.mlp_activation is swiglu:
                x = ops.swiglu_mlp(x, block.post_norm, eps, block.gate_up, block.down_proj, residual=x)
            else:
                gate_up = ops.norm_linear(x, block.post_norm, eps, block.gate_up)
                x = ops.linear(self.mlp_activation(ops, gate_up), block.down_proj, residual=x)
        kv_cache.offset = start + tokens
        if logits == "last":
            x = ops.rows(x, tokens - 1, 1)
        return ops.norm_linear(x, self.norm, eps, self.lm_head)
