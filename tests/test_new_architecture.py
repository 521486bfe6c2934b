"""Adding an architecture is one module: the toy family of tests/toy_gelu_llama.py (Llama with an
ungated GELU MLP), registered into ``ARCHITECTURES``, loads from a Hugging Face folder and runs on
the numpy backend with the logits of an independent float64 implementation of that model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kjarni.errors import InvalidModelError, LoadFailedError
from kjarni.loader import build_model
from kjarni.model_config import ModelConfig
from kjarni.models import ARCHITECTURES
from kjarni.numpy_ops import NumpyOps
from kjarni.weights import check_shapes, load_weights
from tests import toy_gelu_llama
from tests.tiny_models import random_state_dict, save_safetensors_model, tiny_config

PROMPT = [5, 17, 3, 88, 42, 9, 60]


def _toy_folder(tmp_path, drop: str = ".gate_proj."):
    config = {**tiny_config("llama"), "model_type": toy_gelu_llama.MODEL_TYPE,
              "architectures": ["GeluLlamaForCausalLM"], "hidden_act": "gelu_pytorch_tanh"}
    tensors = {name: value for name, value in random_state_dict(config, seed=3).items()
               if ".gate_proj." not in name and drop not in name}
    return save_safetensors_model(tmp_path / "toy", config, tensors), config, tensors


def _reference_logits(config: dict, tensors: dict, ids: list[int]) -> np.ndarray:
    """The toy model in plain float64 numpy, written from its definition (HF Llama with the MLP
    ``down(gelu_tanh(up(x)))``), sharing no code with kjarni."""
    w = {name: value.astype(np.float64) for name, value in tensors.items()}
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    eps, n = config["rms_norm_eps"], len(ids)

    def rms_norm(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight

    inv_freq = 1.0 / config["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    angles = np.arange(n)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))

    def rope(x):  # [heads, n, head_dim], rotate-half as in transformers
        half = head_dim // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def gelu_tanh(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    x = w["model.embed_tokens.weight"][ids]
    causal = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(n, heads, head_dim).transpose(1, 0, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(n, kv_heads, head_dim).transpose(1, 0, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(n, kv_heads, head_dim).transpose(1, 0, 2)
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, heads // kv_heads, 0), np.repeat(v, heads // kv_heads, 0)
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(head_dim) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ v).transpose(1, 0, 2).reshape(n, heads * head_dim)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        x = x + gelu_tanh(h @ w[p + "mlp.up_proj.weight"].T) @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_an_unregistered_architecture_is_refused(tmp_path):
    folder, _, _ = _toy_folder(tmp_path)
    with pytest.raises(InvalidModelError, match="gelu_llama is not supported; supported: "):
        ModelConfig.from_json(folder / "config.json")


def test_a_toy_architecture_added_as_one_module_runs_on_numpy(tmp_path, monkeypatch):
    monkeypatch.setitem(ARCHITECTURES, toy_gelu_llama.MODEL_TYPE, toy_gelu_llama.ARCHITECTURE)
    folder, config_dict, tensors = _toy_folder(tmp_path)
    config = ModelConfig.from_json(folder / "config.json")
    assert (config.model_type, config.hidden_act, config.sliding_window) == ("gelu_llama", "gelu_pytorch_tanh", None)
    weights = load_weights(folder)
    check_shapes(weights, config)  # the family's tensor list: no gate_proj expected
    model = build_model(config, weights, NumpyOps())

    logits = model.ops.read(model.forward(PROMPT, model.new_cache(16), logits="all"))

    expected = _reference_logits(config_dict, tensors, PROMPT)
    assert logits.shape == expected.shape == (len(PROMPT), config.vocab_size)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def test_the_toy_family_checks_its_own_tensor_list(tmp_path, monkeypatch):
    monkeypatch.setitem(ARCHITECTURES, toy_gelu_llama.MODEL_TYPE, toy_gelu_llama.ARCHITECTURE)
    folder, _, _ = _toy_folder(tmp_path, drop="layers.1.mlp.up_proj")
    config = ModelConfig.from_json(folder / "config.json")
    with pytest.raises(LoadFailedError, match="tensor model.layers.1.mlp.up_proj.weight is missing"):
        check_shapes(load_weights(folder), config)
