"""The GPT-2 forward pass (gpt2, distilgpt2), written once against the `Ops` contract.

GPT-2 differs from the Llama family in every block piece but attention: LayerNorm with bias instead
of RMSNorm, learned absolute position embeddings instead of RoPE (so ``rope_store`` gets no table),
one fused ``c_attn`` projection with bias, and a GELU (tanh) MLP with biases. weights.py has already
transposed the Conv1D matrices to ``[out, in]`` and aliased the tied ``lm_head.weight`` to ``wte``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kjarni.model_config import ModelConfig
from kjarni.errors import InvalidConfigurationError, InvalidModelError
from kjarni.model import check_fits
from kjarni.backend import Activation, DeviceTokens, KVCache, Ops, Weight
from kjarni.weights import Weights


@dataclass
class _Block:
    ln_1: tuple[Weight, Weight]
    c_attn: tuple[Weight, Weight]
    attn_proj: tuple[Weight, Weight]
    ln_2: tuple[Weight, Weight]
    c_fc: tuple[Weight, Weight]
    mlp_proj: tuple[Weight, Weight]


class GPT2Model:
    """A GPT-2 language model on one backend; the same interface as `DecoderModel`."""

    def __init__(self, config: ModelConfig, weights: Weights, ops: Ops) -> None:
        if config.model_type != "gpt2":
            raise InvalidModelError(f"GPT2Model runs gpt2 models, not {config.model_type!r}")
        self.config = config
        self.ops = ops
        self.context_size = config.max_position_embeddings  # wpe has exactly this many rows
        self.wte = self._upload(weights, "transformer.wte.weight")
        self.wpe = self._upload(weights, "transformer.wpe.weight")
        if config.tie_word_embeddings or weights.alias_of("lm_head.weight") == "transformer.wte.weight":
            self.lm_head = self.wte
        else:
            self.lm_head = self._upload(weights, "lm_head.weight")
        self.ln_f = self._pair(weights, "transformer.ln_f")
        self.blocks = [self._upload_block(weights, f"transformer.h.{i}.") for i in range(config.num_hidden_layers)]

    def _upload(self, weights: Weights, name: str) -> Weight:
        return self.ops.weight(weights.raw(name), name=name)

    def _pair(self, weights: Weights, prefix: str) -> tuple[Weight, Weight]:
        return self._upload(weights, prefix + ".weight"), self._upload(weights, prefix + ".bias")

    def _upload_block(self, weights: Weights, p: str) -> _Block:
        return _Block(
            ln_1=self._pair(weights, p + "ln_1"),
            c_attn=self._pair(weights, p + "attn.c_attn"),
            attn_proj=self._pair(weights, p + "attn.c_proj"),
            ln_2=self._pair(weights, p + "ln_2"),
            c_fc=self._pair(weights, p + "mlp.c_fc"),
            mlp_proj=self._pair(weights, p + "mlp.c_proj"),
        )

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """A KV cache for ``capacity`` positions (default and maximum: ``n_positions``)."""
        capacity = self.context_size if capacity is None else capacity
        if not 0 < capacity <= self.context_size:
            raise InvalidConfigurationError(
                f"KV cache capacity {capacity} must be between 1 and the model's context of {self.context_size}"
            )
        c = self.config
        return self.ops.new_kv_cache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, capacity)

    def forward(self, token_ids: np.ndarray | list[int] | DeviceTokens, kv_cache: KVCache, *, logits: str = "last") -> Activation:
        """Run ``token_ids`` at positions ``kv_cache.offset ..`` and return logits (see `DecoderModel.forward`)."""
        ops, eps = self.ops, self.config.layer_norm_epsilon
        ids = token_ids if isinstance(token_ids, DeviceTokens) else np.asarray(token_ids, dtype=np.int32).reshape(-1)
        tokens, start = len(ids), kv_cache.offset
        check_fits(tokens, start, kv_cache)
        positions = np.arange(start, start + tokens, dtype=np.int32)
        x = ops.add(ops.embed(self.wte, ids), ops.embed(self.wpe, positions))
        for i, block in enumerate(self.blocks):
            qkv = ops.linear(ops.layer_norm(x, *block.ln_1, eps), *block.c_attn)
            q = ops.rope_store(qkv, None, kv_cache, i, start)
            x = ops.linear(ops.attention(q, kv_cache, i, start), *block.attn_proj, residual=x)
            h = ops.linear(ops.layer_norm(x, *block.ln_2, eps), *block.c_fc)
            x = ops.linear(ops.gelu(h), *block.mlp_proj, residual=x)
        kv_cache.offset = start + tokens
        if logits == "last":
            x = ops.rows(x, tokens - 1, 1)
        return ops.linear(ops.layer_norm(x, *self.ln_f, eps), self.lm_head)
