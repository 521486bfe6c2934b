"""What one architecture family changes in the generic decoder: the `Architecture` record that each
``kjarni/models/<model_type>.py`` fills in, and the defaults most families share.

The generic modules ask the record instead of naming families: model_config.py (config.json and
GGUF translation, allowed activations, whether RoPE applies), weights.py (the GGUF tensor-name
overrides, llama.cpp's q/k permutation, safetensors fixes, the tensors to expect), loader.py (the
forward). A family module registers its record in ``kjarni.models.ARCHITECTURES``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from kjarni.backend import Ops
    from kjarni.model_config import ModelConfig
    from kjarni.weights import Weights

SWIGLU_ACTIVATIONS = ("silu", "swish")
"""hidden_act values of a SwiGLU MLP (``ops.silu_mul``)."""


def single_window(d: dict[str, Any], source: str) -> dict[str, Any]:
    """config.json as it is, except that a sliding window (if any) covers every layer."""
    return {k: v for k, v in d.items() if k != "max_window_layers"}


def no_window(d: dict[str, Any], source: str) -> dict[str, Any]:
    """config.json without a sliding window (the family never uses one, whatever the file says)."""
    return {**single_window(d, source), "sliding_window": None}


def gguf_as_is(d: dict[str, Any], meta: Any, tensor_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """The generic translation of GGUF metadata, unchanged."""
    return d


def decoder_shapes(
    config: ModelConfig, *, fused_qkv: bool = False, mlp_inputs: tuple[str, ...] = ("gate_proj", "up_proj")
) -> dict[str, tuple[int, ...]]:
    """Every tensor a pre-norm RoPE decoder (DecoderModel) of this config needs, in HF layout.

    ``fused_qkv``: q/k/v stored as one ``qkv_proj``; ``mlp_inputs``: the MLP's input projections
    (``gate_up_proj`` is stored fused, 2 x intermediate rows, gate first).
    """
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config.vocab_size, hidden),
    }
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        if fused_qkv:
            shapes[p + "self_attn.qkv_proj.weight"] = (config.q_size + 2 * config.kv_size, hidden)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (config.q_size, hidden)
            shapes[p + "self_attn.k_proj.weight"] = (config.kv_size, hidden)
            shapes[p + "self_attn.v_proj.weight"] = (config.kv_size, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, config.q_size)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (config.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (config.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (config.kv_size,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        for name in mlp_inputs:
            shapes[p + f"mlp.{name}.weight"] = (2 * inter if name == "gate_up_proj" else inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    return shapes


@dataclass(frozen=True)
class Architecture:
    """One family, keyed by config.json's ``model_type`` (= GGUF's ``general.architecture``).

    - ``forward(config, weights, ops)``: the model (``DecoderModel``, or the family's own forward)
    - ``activations``: the ``hidden_act`` values it runs; ``rotary``: positions by RoPE (False:
      learned absolute positions, no rotary dims to check)
    - ``config_json(d, source)``: config.json's dict under ModelConfig's names (renames, the
      family's implied settings such as q/k/v biases or its sliding-window rule)
    - ``gguf_config(d, meta, tensor_shapes)``: the generic translation of GGUF metadata, adjusted
    - ``expected_shapes(config)``: every tensor with its HF-layout shape (checked at load)
    - ``gguf_names`` / ``gguf_block_names``: GGUF -> HF name overrides of weights.py's llama.cpp
      maps (block names without the ``blk.N.`` prefix); ``block_prefix``: the HF layer prefix;
      ``embedding``: the token embedding a missing ``lm_head.weight`` aliases
    - ``gguf_permuted_qk``: llama.cpp's converter permuted the attn_q/attn_k rows (undone at load)
    - ``sanitize(tensors)``: load-time fixes of a safetensors checkpoint; each family's leaves
      tensors that are not its own untouched (it runs on every safetensors load)
    """

    model_type: str
    forward: Callable[[ModelConfig, Weights, Ops], Any]
    activations: tuple[str, ...] = SWIGLU_ACTIVATIONS
    rotary: bool = True
    config_json: Callable[[dict[str, Any], str], dict[str, Any]] = single_window
    gguf_config: Callable[[dict[str, Any], Any, Mapping[str, tuple[int, ...]]], dict[str, Any]] = gguf_as_is
    expected_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]] = decoder_shapes
    gguf_names: Mapping[str, str] = field(default_factory=dict)
    gguf_block_names: Mapping[str, str] = field(default_factory=dict)
    block_prefix: str = "model.layers.{}."
    embedding: str = "model.embed_tokens.weight"
    gguf_permuted_qk: bool = False
    sanitize: Callable[[dict[str, Any]], dict[str, Any]] | None = None
