"""The numpy reference decoder on tiny random models: cache logic, fused weights, formats."""

from __future__ import annotations

import numpy as np
import pytest

from kjarni.model_config import ModelConfig
from kjarni.errors import ContextOverflowError, InvalidConfigurationError
from kjarni.model import DecoderModel, rope_table
from kjarni.numpy_ops import NumpyOps
from kjarni.weights import load_weights
from tests.tiny_models import random_state_dict, save_safetensors_model, tiny_config

PROMPT = [5, 17, 3, 88, 42, 9, 61, 2, 30, 77, 14]


def _tiny_model(tmp_path, model_type: str, **overrides) -> DecoderModel:
    config = tiny_config(model_type, **overrides)
    save_safetensors_model(tmp_path, config, random_state_dict(config, seed=7))
    return DecoderModel(ModelConfig.from_json(tmp_path / "config.json"), load_weights(tmp_path), NumpyOps())


def _naive_logits(config: ModelConfig, tensors: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """A cache-free forward written independently of Ops, for every position at once."""
    c = config
    x = tensors["model.embed_tokens.weight"][ids].astype(np.float64)
    positions = len(ids)
    table = rope_table(c, positions).astype(np.float64)
    half = c.head_dim // 2
    cos, sin = table[:, None, :half], table[:, None, half:]

    def norm(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + c.rms_norm_eps) * w

    def rotate(v):
        a, b = v[..., :half], v[..., half:]
        return np.concatenate((a * cos - b * sin, b * cos + a * sin), -1)

    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        h = norm(x, tensors[p + "input_layernorm.weight"])
        proj = {}
        for n in "qkv":
            proj[n] = h @ tensors[p + f"self_attn.{n}_proj.weight"].T
            if p + f"self_attn.{n}_proj.bias" in tensors:
                proj[n] = proj[n] + tensors[p + f"self_attn.{n}_proj.bias"]
        q = rotate(proj["q"].reshape(positions, c.num_attention_heads, c.head_dim))
        k = rotate(proj["k"].reshape(positions, c.num_key_value_heads, c.head_dim))
        v = proj["v"].reshape(positions, c.num_key_value_heads, c.head_dim)
        groups = c.num_attention_heads // c.num_key_value_heads
        out = np.zeros_like(q)
        for head in range(c.num_attention_heads):
            scores = q[:, head] @ k[:, head // groups].T / np.sqrt(c.head_dim)
            scores[np.triu_indices(positions, 1)] = -np.inf
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, head] = (weights / weights.sum(-1, keepdims=True)) @ v[:, head // groups]
        x = x + out.reshape(positions, -1) @ tensors[p + "self_attn.o_proj.weight"].T
        h = norm(x, tensors[p + "post_attention_layernorm.weight"])
        gate = h @ tensors[p + "mlp.gate_proj.weight"].T
        up = h @ tensors[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ tensors[p + "mlp.down_proj.weight"].T
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    return norm(x, tensors["model.norm.weight"]) @ head.T


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_forward_matches_an_independent_float64_implementation(tmp_path, model_type):
    config_dict = tiny_config(model_type)
    tensors = random_state_dict(config_dict, seed=3)
    save_safetensors_model(tmp_path, config_dict, tensors)
    config = ModelConfig.from_json(tmp_path / "config.json")
    model = DecoderModel(config, load_weights(tmp_path), NumpyOps())
    logits = model.ops.read(model.forward(PROMPT, model.new_cache(64), logits="all"))
    expected = _naive_logits(config, tensors, PROMPT)
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_prefill_equals_token_by_token_decoding(tmp_path, model_type):
    model = _tiny_model(tmp_path, model_type)
    whole = model.ops.read(model.forward(PROMPT, model.new_cache(32), logits="all"))
    cache = model.new_cache(32)
    steps = np.concatenate([model.ops.read(model.forward([t], cache)) for t in PROMPT])
    np.testing.assert_allclose(steps, whole, atol=1e-5, rtol=1e-5)
    assert cache.offset == len(PROMPT)


def test_chunked_prefill_after_trim_equals_one_prefill(tmp_path):
    model = _tiny_model(tmp_path, "qwen2")
    whole = model.ops.read(model.forward(PROMPT, model.new_cache(32), logits="all"))
    cache = model.new_cache(32)
    model.forward(PROMPT[:4] + [1, 2, 3], cache)
    assert cache.trim(3) == 4  # roll back three positions that were speculated wrongly
    tail = model.ops.read(model.forward(PROMPT[4:], cache, logits="all"))
    np.testing.assert_allclose(tail, whole[4:], atol=1e-5, rtol=1e-5)


def test_last_logits_are_the_last_row_of_all_logits(tmp_path):
    model = _tiny_model(tmp_path, "llama")
    last = model.ops.read(model.forward(PROMPT, model.new_cache(32)))
    every = model.ops.read(model.forward(PROMPT, model.new_cache(32), logits="all"))
    assert last.shape == (1, every.shape[1])
    # one row goes through BLAS's matrix-vector path, many through matrix-matrix: rounding differs
    np.testing.assert_allclose(last[0], every[-1], atol=1e-5, rtol=1e-5)


def test_forward_past_the_cache_raises_context_overflow(tmp_path):
    model = _tiny_model(tmp_path, "llama")
    cache = model.new_cache(8)
    with pytest.raises(ContextOverflowError) as raised:
        model.forward(PROMPT, cache)
    assert raised.value.tokens == len(PROMPT) and raised.value.context == 8
    assert cache.offset == 0


def test_cache_capacity_beyond_the_context_is_refused(tmp_path):
    model = _tiny_model(tmp_path, "llama")
    with pytest.raises(InvalidConfigurationError, match="capacity"):
        model.new_cache(model.context_size + 1)


def test_kv_cache_reports_its_size(tmp_path):
    model = _tiny_model(tmp_path, "llama")
    cache = model.new_cache(16)
    c = model.config
    assert cache.nbytes == 2 * 4 * c.num_hidden_layers * c.num_key_value_heads * 16 * c.head_dim


def test_numpy_top_k_sorts_descending_and_breaks_ties_by_lowest_id():
    ops = NumpyOps()
    row = np.array([[1.0, 5.0, 3.0, 5.0, -2.0, 3.0]], dtype=np.float32)
    values, ids = ops.top_k(row, 4)
    np.testing.assert_array_equal(ids[0], [1, 3, 2, 5])
    np.testing.assert_array_equal(values[0], [5.0, 5.0, 3.0, 3.0])
    assert ops.argmax(row)[0] == 1


@pytest.mark.parametrize(
    "capacity, tokens, window", [(1100, 1090, None), (2048, 1090, None), (1100, 1090, 300), (24, 20, None)]
)
def test_numpy_attention_gives_a_row_the_same_bits_in_any_batch(capacity, tokens, window):
    """A row's attention does not depend on the rows around it, whichever BLAS kernel runs.

    It holds by construction (every product is one row's against one 256-key chunk, see
    ``numpy_ops._attend``), so no kernel family may break it; checked by hand under OpenBLAS's
    Haswell, Sandybridge and Prescott kernels. Qwen2.5-0.5B's head shapes (2 kv heads of 64, 7
    query heads each): rows computed in one prefill, in steps of other sizes, alone, or as a tail
    after a cached head are equal bit for bit, and within float32 rounding of a float64 softmax.
    The caches of 1100 and 24 positions end inside a key chunk; 24 also makes every product small.
    """
    rng = np.random.default_rng(3)
    kv_heads, groups, head_dim = 2, 7, 64
    cache = NumpyOps().new_kv_cache(1, kv_heads, head_dim, capacity)
    cache.keys[0] = rng.standard_normal(cache.keys.shape[1:], dtype=np.float32)
    cache.values[0] = rng.standard_normal(cache.values.shape[1:], dtype=np.float32)
    q = rng.standard_normal((tokens, kv_heads * groups * head_dim), dtype=np.float32)
    whole = NumpyOps(attention_rows=tokens).attention(q, cache, 0, 0, window)
    for rows in (1, 7, 64, 300):
        np.testing.assert_array_equal(NumpyOps(attention_rows=rows).attention(q, cache, 0, 0, window), whole)
    for head in (2, tokens // 2, tokens - 2, tokens - 1):  # a tail after a cached head; the last row alone
        np.testing.assert_array_equal(NumpyOps().attention(q[head:], cache, 0, head, window), whole[head:])

    for p in sorted({0, 255, 256, tokens - 1} & set(range(tokens))):
        keys = cache.keys[0, :, : p + 1].astype(np.float64)
        query = q[p].reshape(kv_heads, groups, head_dim).astype(np.float64) / 8.0
        scores = np.einsum("hgd,hkd->hgk", query, keys)
        if window is not None:
            scores[..., : max(0, p - window + 1)] = -np.inf
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        expected = np.einsum("hgk,hkd->hgd", weights, cache.values[0, :, : p + 1])
        np.testing.assert_allclose(whole[p], expected.reshape(-1), atol=2e-6, rtol=0)


def test_rope_table_is_float32_and_starts_at_identity():
    config = ModelConfig.from_dict(tiny_config("llama"))
    table = rope_table(config, 10)
    assert table.dtype == np.float32 and table.shape == (10, config.head_dim)
    half = config.head_dim // 2
    np.testing.assert_array_equal(table[0, :half], 1.0)
    np.testing.assert_array_equal(table[0, half:], 0.0)


def test_loading_shows_progress_on_stderr_only_unless_quiet(tmp_path, capsys):
    from kjarni.loader import load_model
    from tests.test_api import write_tiny_tokenizer

    config = tiny_config("llama", vocab_size=300)
    tensors = random_state_dict(config, seed=7)
    save_safetensors_model(tmp_path, config, tensors)
    write_tiny_tokenizer(tmp_path)
    ops = NumpyOps()
    load_model(tmp_path, ops=ops, quiet=False)
    out, err = capsys.readouterr()
    total = sum(t.nbytes for n, t in tensors.items())
    assert out == "" and f"loading {tmp_path.name}" in err and f"{total / 1e3:.1f} kB" in err
    assert "weight" not in vars(ops)  # the counting wrapper is gone after the load
    load_model(tmp_path, ops=ops)
    assert capsys.readouterr() == ("", "")
