"""GPT-2 (gpt2, distilgpt2): its config names, tensor names, load-time fixes and its own forward,
written once against the `Ops` contract.

GPT-2 differs from the Llama family in every block piece but attention: LayerNorm with bias instead
of RMSNorm, learned absolute position embeddings instead of RoPE (so ``rope_store`` gets no table),
one fused ``c_attn`` projection with bias, and a GELU (tanh) MLP with biases. Its checkpoints store
Conv1D matrices ``[in, out]``: `sanitize` transposes them to ``[out, in]`` at load, and the tied
``lm_head.weight`` is aliased to ``wte`` (weights.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from kjarni.backend import Activation, DeviceTokens, KVCache, Ops, Weight
from kjarni.errors import InvalidModelError
from kjarni.model import check_fits, new_kv_cache
from kjarni.models.architecture import Architecture

if TYPE_CHECKING:
    from kjarni.model_config import ModelConfig
    from kjarni.weights import Weights

ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
"""hidden_act values meaning the tanh GELU (``ops.gelu``)."""

# GPT-2's config.json names -> the names ModelConfig uses for the same thing.
_CONFIG_KEYS = {
    "n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
    "n_positions": "max_position_embeddings", "n_inner": "intermediate_size",
    "activation_function": "hidden_act",
}

# Conv1D weights ([in, out]) under names with or without the "transformer." prefix
# (openai-community/gpt2 has none, save_pretrained writes it), plus causal-mask buffers in old files.
_CONV1D = re.compile(r"(?:transformer\.)?h\.\d+\.(?:attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight")
_MASK_BUFFER = re.compile(r"(?:transformer\.)?h\.\d+\.attn\.(?:bias|masked_bias)")


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
        if config.model_type != ARCHITECTURE.model_type:
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
        return new_kv_cache(self.ops, self.config, self.context_size, capacity)

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


# ---------------------------------------------------------------- config and tensors


def config_json(d: dict[str, Any], source: str) -> dict[str, Any]:
    """A GPT-2 config.json under the names ModelConfig uses (n_embd -> hidden_size, ...)."""
    if d.get("scale_attn_by_inverse_layer_idx") or d.get("scale_attn_weights") is False:
        raise InvalidModelError(
            f"{source}: GPT-2 attention scaling variants (scale_attn_by_inverse_layer_idx, scale_attn_weights=false) "
            "are not supported; kjarni runs GPT-2 attention scaled by 1/sqrt(head_dim)"
        )
    out = {k: v for k, v in d.items() if k not in _CONFIG_KEYS and k != "max_window_layers"}
    for old, new in _CONFIG_KEYS.items():
        if d.get(old) is not None:
            out[new] = d[old]
    if out.get("intermediate_size") is None and isinstance(out.get("hidden_size"), int):
        out["intermediate_size"] = 4 * out["hidden_size"]  # n_inner: null means 4 x n_embd
    out.setdefault("tie_word_embeddings", True)  # GPT2Config's default; hub configs omit the key
    out.setdefault("hidden_act", "gelu_new")
    out["sliding_window"] = None
    return out


def gguf_config(d: dict[str, Any], meta: Any, tensor_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """GPT-2's GGUF: the tanh GELU, no rotary dims, its LayerNorm epsilon."""
    eps = meta.get("gpt2.attention.layer_norm_epsilon")
    return {
        **d, "hidden_act": "gelu_new", "partial_rotary_factor": None,
        "layer_norm_epsilon": float(str(np.float32(eps))) if eps is not None else 1e-5,
    }


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every GPT-2 tensor with its shape, Conv1D matrices in the Linear layout `sanitize` gives them."""
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (config.vocab_size, hidden),
        "transformer.wpe.weight": (config.max_position_embeddings, hidden),
        "transformer.ln_f.weight": (hidden,),
        "transformer.ln_f.bias": (hidden,),
        "lm_head.weight": (config.vocab_size, hidden),
    }
    for i in range(config.num_hidden_layers):
        p = f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            shapes[p + norm + ".weight"] = shapes[p + norm + ".bias"] = (hidden,)
        shapes[p + "attn.c_attn.weight"] = (3 * hidden, hidden)
        shapes[p + "attn.c_attn.bias"] = (3 * hidden,)
        shapes[p + "attn.c_proj.weight"] = (hidden, hidden)
        shapes[p + "attn.c_proj.bias"] = (hidden,)
        shapes[p + "mlp.c_fc.weight"] = (inter, hidden)
        shapes[p + "mlp.c_fc.bias"] = (inter,)
        shapes[p + "mlp.c_proj.weight"] = (hidden, inter)
        shapes[p + "mlp.c_proj.bias"] = (hidden,)
    return shapes


def sanitize(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GPT-2 safetensors under ``transformer.``-prefixed names with Conv1D matrices transposed to
    ``[out, in]`` and the causal-mask buffers dropped; any other checkpoint is returned as it is."""
    if not any(_CONV1D.fullmatch(name) for name in tensors):
        return tensors
    out: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        if _MASK_BUFFER.fullmatch(name):
            continue  # the causal mask, not a weight
        if _CONV1D.fullmatch(name):
            array = np.ascontiguousarray(array.T)  # one copy at load; kernels only know [out, in]
            array.flags.writeable = False
        canonical = name if name.startswith("transformer.") or name == "lm_head.weight" else "transformer." + name
        out[canonical] = array
    return out


ARCHITECTURE = Architecture(
    "gpt2",
    GPT2Model,
    activations=ACTIVATIONS,
    rotary=False,
    config_json=config_json,
    gguf_config=gguf_config,
    expected_shapes=expected_shapes,
    # GPT-2's converter already transposed the Conv1D matrices, so these are [out, in] as stored.
    gguf_names={
        "token_embd.weight": "transformer.wte.weight",
        "position_embd.weight": "transformer.wpe.weight",
        "output_norm.weight": "transformer.ln_f.weight",
        "output_norm.bias": "transformer.ln_f.bias",
    },
    gguf_block_names={
        "attn_norm.weight": "ln_1.weight", "attn_norm.bias": "ln_1.bias",
        "attn_qkv.weight": "attn.c_attn.weight", "attn_qkv.bias": "attn.c_attn.bias",
        "attn_output.weight": "attn.c_proj.weight", "attn_output.bias": "attn.c_proj.bias",
        "ffn_norm.weight": "ln_2.weight", "ffn_norm.bias": "ln_2.bias",
        "ffn_up.weight": "mlp.c_fc.weight", "ffn_up.bias": "mlp.c_fc.bias",
        "ffn_down.weight": "mlp.c_proj.weight", "ffn_down.bias": "mlp.c_proj.bias",
    },
    block_prefix="transformer.h.{}.",
    embedding="transformer.wte.weight",
    sanitize=sanitize,
)
