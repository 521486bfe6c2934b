"""Every architecture family against transformers: tiny random models from tools/make_arch_fixtures.py.

Each fixture folder holds a model saved by transformers (safetensors, hub-style config.json), and
reference.json with transformers' logits (last rows of a few prompts) and 16 greedy tokens decoded
through its KV cache. Scaled-RoPE and sliding-window cases also hold the logits with the feature
switched off, so the tests prove the feature is applied and changes the result.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from kjarni.model_config import ModelConfig
from kjarni.errors import InvalidModelError
from kjarni.models.gpt2 import GPT2Model
from kjarni.loader import build_model
from kjarni.model import DecoderModel, rope_table
from kjarni.numpy_ops import NumpyOps
from kjarni.backend import Ops
from kjarni.weights import check_shapes, load_weights

FIXTURES = Path(__file__).parent / "fixtures" / "arch"
CASES = ["gpt2", "phi3", "phi3_partial", "llama3", "mistral"]
FEATURE_CASES = ["phi3", "llama3", "mistral"]  # longrope, llama3 rope scaling, sliding window


def _reference(name: str) -> dict:
    return json.loads((FIXTURES / name / "reference.json").read_text())


def _model(name: str, ops: Ops, **config_changes):
    config = ModelConfig.from_json(FIXTURES / name / "config.json")
    config = dataclasses.replace(config, **config_changes) if config_changes else config
    weights = load_weights(FIXTURES / name)
    check_shapes(weights, config)
    return build_model(config, weights, ops)


def _last_logits(model, ids: list[int], rows: int) -> np.ndarray:
    return model.ops.read(model.forward(ids, model.new_cache(), logits="all"))[-rows:]


def _greedy(model, ids: list[int], count: int = 16) -> list[int]:
    cache = model.new_cache()
    logits = model.forward(ids, cache)
    out = []
    for _ in range(count):
        out.append(int(model.ops.argmax(logits)[0]))
        logits = model.forward([out[-1]], cache)
    return out


# ---------------------------------------------------------------- numpy against transformers


@pytest.mark.parametrize("name", CASES)
def test_numpy_logits_and_greedy_tokens_match_transformers(name):
    model = _model(name, NumpyOps())
    reference = _reference(name)
    for prompt in reference["prompts"]:
        logits = _last_logits(model, prompt["ids"], reference["last_rows"])
        np.testing.assert_allclose(logits, np.array(prompt["logits"]), atol=1e-4, rtol=0)
        assert _greedy(model, prompt["ids"]) == prompt["greedy"], f"{name}, prompt of {len(prompt['ids'])}"


@pytest.mark.parametrize("name", FEATURE_CASES)
def test_the_feature_changes_the_logits_exactly_as_transformers_does(name):
    """Switched off, kjarni matches transformers' feature-off logits, which differ from the feature-on ones."""
    reference = _reference(name)
    change = reference["prompts"][0]["feature_off"]["change"]
    model = _model(name, NumpyOps(), **change)
    for prompt in reference["prompts"]:
        on, off = np.array(prompt["logits"]), np.array(prompt["feature_off"]["logits"])
        assert np.abs(on - off).max() > 0.5, "the fixture's context is too short for the feature to matter"
        np.testing.assert_allclose(_last_logits(model, prompt["ids"], reference["last_rows"]), off, atol=1e-4, rtol=0)


def test_the_forward_is_picked_by_model_type():
    ops = NumpyOps()
    assert isinstance(_model("gpt2", ops), GPT2Model)
    for name in ("phi3", "llama3", "mistral"):
        assert isinstance(_model(name, ops), DecoderModel)


def test_unsupported_architecture_is_refused_naming_it_and_the_supported_ones():
    config = dataclasses.replace(ModelConfig.from_json(FIXTURES / "llama3" / "config.json"), model_type="gemma")
    with pytest.raises(InvalidModelError, match=r"'gemma' is not supported; supported: ") as raised:
        build_model(config, load_weights(FIXTURES / "llama3"), NumpyOps())
    d = {**json.loads((FIXTURES / "llama3" / "config.json").read_text()), "model_type": "gemma"}
    with pytest.raises(InvalidModelError, match="gemma is not supported; supported: ") as from_config:
        ModelConfig.from_dict(d)
    for message in (str(raised.value), str(from_config.value)):
        assert all(arch in message for arch in ("llama", "mistral", "qwen2", "phi3", "gpt2")), message


# ---------------------------------------------------------------- config and weight quirks


@pytest.mark.parametrize("name", CASES)
def test_transformers5_config_reads_the_same_as_the_hub_config(name):
    hub = ModelConfig.from_json(FIXTURES / name / "config.json")
    v5 = ModelConfig.from_json(FIXTURES / name / "config.transformers5.json")
    assert v5 == hub


def test_gpt2_config_names_are_translated():
    config = ModelConfig.from_json(FIXTURES / "gpt2" / "config.json")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (36, 3, 3)
    assert config.max_position_embeddings == 64 and config.intermediate_size == 4 * 36
    assert config.hidden_act == "gelu_new" and config.layer_norm_epsilon == 1e-5
    assert config.tie_word_embeddings and config.num_key_value_heads == 3 and config.rope_scaling is None


def test_gpt2_with_erf_gelu_or_layer_scaled_attention_is_refused():
    d = json.loads((FIXTURES / "gpt2" / "config.json").read_text())
    with pytest.raises(InvalidModelError, match="hidden_act 'gelu'"):
        ModelConfig.from_dict({**d, "activation_function": "gelu"})
    with pytest.raises(InvalidModelError, match="scale_attn_by_inverse_layer_idx"):
        ModelConfig.from_dict({**d, "scale_attn_by_inverse_layer_idx": True})


def test_gpt2_conv1d_weights_are_transposed_at_load_and_the_prefix_is_optional(tmp_path):
    """openai-community/gpt2 stores names without "transformer." and old files carry mask buffers."""
    import safetensors.numpy

    stored = safetensors.numpy.load_file(FIXTURES / "gpt2" / "model.safetensors")
    bare = {k.removeprefix("transformer."): v for k, v in stored.items()}
    bare["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), dtype=np.float32))  # the causal-mask buffer
    safetensors.numpy.save_file(bare, tmp_path / "model.safetensors")
    weights = load_weights(tmp_path)
    conv1d = stored["transformer.h.1.mlp.c_fc.weight"]  # [in, out] = [36, 144]
    np.testing.assert_array_equal(weights.f32("transformer.h.1.mlp.c_fc.weight"), conv1d.T)
    assert weights.alias_of("lm_head.weight") == "transformer.wte.weight"
    assert not any(".attn.bias" in n and "c_attn" not in n for n in weights.names())
    config = ModelConfig.from_json(FIXTURES / "gpt2" / "config.json")
    check_shapes(weights, config)


def test_phi3_longrope_reads_the_top_level_original_context_and_the_old_su_name():
    d = json.loads((FIXTURES / "phi3" / "config.json").read_text())
    config = ModelConfig.from_dict({**d, "rope_scaling": {**d["rope_scaling"], "type": "su"}})
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.rope_scaling["original_max_position_embeddings"] == 32


@pytest.mark.parametrize("scaling, error", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope_scaling type 'yarn' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, "lacks low_freq_factor, high_freq_factor"),
])
def test_unsupported_or_incomplete_rope_scaling_is_refused(scaling, error):
    d = json.loads((FIXTURES / "llama3" / "config.json").read_text())
    with pytest.raises(Exception, match=error):
        ModelConfig.from_dict({**d, "rope_scaling": scaling})


def test_longrope_short_factors_apply_within_the_original_context_long_ones_past_it():
    config = ModelConfig.from_json(FIXTURES / "phi3" / "config.json")
    short, long = rope_table(config, 40), rope_table(config, 40, long_context=True)
    assert not np.allclose(short[20], long[20])
    model = _model("phi3", NumpyOps())
    assert model.short_context == 32
    np.testing.assert_array_equal(model.rope_short, short[:32])


def test_partial_rotary_table_covers_only_the_rotary_dims():
    config = ModelConfig.from_json(FIXTURES / "phi3_partial" / "config.json")
    assert config.rotary_dim == 8 and rope_table(config, 5).shape == (5, 8)


def test_sliding_window_hides_positions_that_slid_out():
    """attention(window=w): position p sees p - w + 1 ..= p, in prefill and in decode alike."""
    ops = NumpyOps()
    rng = np.random.default_rng(0)
    cache = ops.new_kv_cache(1, 1, 4, 12)
    qkv = rng.standard_normal((10, 12)).astype(np.float32)
    q = ops.rope_store(qkv, None, cache, 0, 0)
    windowed = ops.attention(q, cache, 0, 0, window=3)
    values = cache.values[0, 0]
    for p in range(10):  # a constant query would weigh equally: check support via a unit value
        lo = max(0, p - 2)
        keys = cache.keys[0, 0, lo : p + 1]
        scores = keys @ q[p] / np.float32(2.0)
        weights = np.exp(scores - scores.max())
        np.testing.assert_allclose(windowed[p], weights @ values[lo : p + 1] / weights.sum(), atol=1e-6)
    decode = ops.attention(q[9:], cache, 0, 9, window=3)
    np.testing.assert_allclose(decode[0], windowed[9], atol=1e-6)


def test_rope_store_without_a_table_stores_k_and_v_unrotated():
    ops = NumpyOps()
    cache = ops.new_kv_cache(1, 2, 4, 8)  # 2 kv heads of 4; qkv rows: 2 query heads, then k, then v
    qkv = np.arange(3 * 24, dtype=np.float32).reshape(3, 24)
    q = ops.rope_store(qkv, None, cache, 0, 2)
    np.testing.assert_array_equal(q, qkv[:, :8])
    np.testing.assert_array_equal(cache.keys[0, :, 2:5], qkv[:, 8:16].reshape(3, 2, 4).transpose(1, 0, 2))
    np.testing.assert_array_equal(cache.values[0, :, 2:5], qkv[:, 16:].reshape(3, 2, 4).transpose(1, 0, 2))


def test_layer_norm_and_gelu_follow_their_definitions():
    ops = NumpyOps()
    x = np.random.default_rng(1).standard_normal((3, 7)).astype(np.float32)
    w, b = np.float32(1.5) * np.ones(7, np.float32), np.full(7, 0.25, np.float32)
    x64 = x.astype(np.float64)
    expected = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5) * 1.5 + 0.25
    out = ops.layer_norm(x, w, b, 1e-5)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expected, atol=1e-5)
    gelu = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64**3)))
    assert ops.gelu(x).dtype == np.float32
    np.testing.assert_allclose(ops.gelu(x), gelu, atol=1e-6)


# ---------------------------------------------------------------- GGUF files of these families


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], meta: dict[str, object]) -> Path:
    """A GGUF written the way llama.cpp's converter names things (metadata only what from_gguf reads)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))
    for name, array in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_names(weights, arch: str) -> dict[str, str]:
    """HF name -> GGUF name for every tensor, by inverting weights.hf_name over the candidates."""
    from kjarni.models import ARCHITECTURES
    from kjarni.weights import GGUF_BLOCK_TO_HF, GGUF_TO_HF, hf_name

    candidates = [*GGUF_TO_HF, "position_embd.weight", "output_norm.bias"]
    block_keys = {*GGUF_BLOCK_TO_HF, *ARCHITECTURES[arch].gguf_block_names}
    candidates += [f"blk.{i}.{k}" for i in range(8) for k in block_keys]
    inverse = {hf_name(c, arch): c for c in candidates}
    return {name: inverse[name] for name in weights.names() if weights.alias_of(name) is None}


def test_gpt2_gguf_runs_like_its_safetensors(tmp_path):
    weights = load_weights(FIXTURES / "gpt2")
    config = ModelConfig.from_json(FIXTURES / "gpt2" / "config.json")
    names = _gguf_names(weights, "gpt2")
    assert names["transformer.h.0.attn.c_attn.weight"] == "blk.0.attn_qkv.weight"
    path = _write_gguf(tmp_path / "gpt2.gguf", "gpt2", {g: weights.f32(h) for h, g in names.items()}, {
        "gpt2.context_length": 64, "gpt2.embedding_length": 36, "gpt2.feed_forward_length": 144,
        "gpt2.block_count": 3, "gpt2.attention.head_count": 3, "gpt2.attention.layer_norm_epsilon": 1e-5,
    })
    gguf_weights = load_weights(path)
    gguf_config = ModelConfig.from_gguf(gguf_weights.gguf_reader)
    assert dataclasses.replace(gguf_config, bos_token_id=0, eos_token_id=(0,)) == config
    check_shapes(gguf_weights, gguf_config)
    prompt = _reference("gpt2")["prompts"][1]
    model = build_model(gguf_config, gguf_weights, NumpyOps())
    np.testing.assert_allclose(_last_logits(model, prompt["ids"], 4), np.array(prompt["logits"]), atol=1e-4, rtol=0)


def test_phi3_gguf_with_rope_factor_tensors_runs_like_its_safetensors(tmp_path):
    import math

    weights = load_weights(FIXTURES / "phi3")
    config = ModelConfig.from_json(FIXTURES / "phi3" / "config.json")
    names = _gguf_names(weights, "phi3")
    assert names["model.layers.1.mlp.gate_up_proj.weight"] == "blk.1.ffn_up.weight"
    tensors = {g: weights.f32(h) for h, g in names.items()}
    tensors["rope_factors_long.weight"] = np.array(config.rope_scaling["long_factor"], np.float32)
    tensors["rope_factors_short.weight"] = np.array(config.rope_scaling["short_factor"], np.float32)
    path = _write_gguf(tmp_path / "phi3.gguf", "phi3", tensors, {
        "phi3.context_length": 128, "phi3.embedding_length": 48, "phi3.feed_forward_length": 80,
        "phi3.block_count": 2, "phi3.attention.head_count": 3, "phi3.attention.head_count_kv": 1,
        "phi3.attention.layer_norm_rms_epsilon": 1e-5, "phi3.rope.freq_base": 10000.0,
        "phi3.rope.dimension_count": 16, "phi3.rope.scaling.original_context_length": 32,
        "phi3.rope.scaling.attn_factor": math.sqrt(1 + math.log(4) / math.log(32)),
    })
    gguf_weights = load_weights(path)
    gguf_config = ModelConfig.from_gguf(gguf_weights.gguf_reader)
    assert gguf_config.rope_scaling["rope_type"] == "longrope" and gguf_config.rotary_dim == 16
    check_shapes(gguf_weights, gguf_config)
    model = build_model(gguf_config, gguf_weights, NumpyOps())
    for prompt in _reference("phi3")["prompts"][:2]:  # long factors, and the crossing case
        np.testing.assert_allclose(_last_logits(model, prompt["ids"], 4), np.array(prompt["logits"]), atol=1e-4, rtol=0)
        assert _greedy(model, prompt["ids"]) == prompt["greedy"]


def test_llama_gguf_rope_freqs_tensor_applies_llama3_scaling():
    """llama.cpp stores llama3 scaling as rope_freqs (per-frequency divisors): the same table results."""
    from kjarni.model import _scale_frequencies

    config = ModelConfig.from_json(FIXTURES / "llama3" / "config.json")
    base = np.float32(1.0) / (np.float32(10000.0) ** (np.arange(0, 16, 2).astype(np.float32) / np.float32(16)))
    factors = (base / _scale_frequencies(base, config)).tolist()
    as_gguf = dataclasses.replace(config, rope_scaling={"rope_type": "freq_factors", "factors": factors})
    np.testing.assert_allclose(rope_table(as_gguf, 64), rope_table(config, 64), atol=1e-5)


# ---------------------------------------------------------------- the GPU backend (lavapipe in CI)


def _upload(ops, array: np.ndarray):
    """An activation holding ``array`` (the embedding gather of an f32 table, as test_gpu_kernels does)."""
    return ops.embed(ops.weight(array, name="activation"), np.arange(array.shape[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_gpu_logits_and_greedy_tokens_match_transformers(gpu_ops, name):
    model = _model(name, gpu_ops)
    reference = _reference(name)
    for prompt in reference["prompts"]:
        logits = _last_logits(model, prompt["ids"], reference["last_rows"])
        np.testing.assert_allclose(logits, np.array(prompt["logits"]), atol=1e-3, rtol=0)
        assert _greedy(model, prompt["ids"]) == prompt["greedy"], f"{name}, prompt of {len(prompt['ids'])}"


@pytest.mark.gpu
def test_gpu_sliding_window_switched_off_matches_transformers_without_it(gpu_ops):
    reference = _reference("mistral")
    model = _model("mistral", gpu_ops, sliding_window=None)
    prompt = reference["prompts"][0]
    off = np.array(prompt["feature_off"]["logits"])
    np.testing.assert_allclose(_last_logits(model, prompt["ids"], 4), off, atol=1e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, cols", [(1, 7), (5, 36), (70, 301)])
def test_gpu_layer_norm_gelu_and_add_match_numpy(gpu_ops, tokens, cols):
    rng = np.random.default_rng(tokens + cols)
    x = (rng.standard_normal((tokens, cols)) * 3 + 2).astype(np.float32)  # a large mean: centring matters
    y = rng.standard_normal((tokens, cols)).astype(np.float32)
    w, b = rng.standard_normal(cols).astype(np.float32), rng.standard_normal(cols).astype(np.float32)
    ref, gx, gy = NumpyOps(), _upload(gpu_ops, x), _upload(gpu_ops, y)
    got = gpu_ops.read(gpu_ops.layer_norm(gx, gpu_ops.weight(w, name="w"), gpu_ops.weight(b, name="b"), 1e-5))
    np.testing.assert_allclose(got, ref.layer_norm(x, w, b, 1e-5), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(gpu_ops.read(gpu_ops.gelu(gx)), ref.gelu(x), atol=1e-6, rtol=1e-5)
    big = np.array([[-60.0, -12.0, 0.0, 12.0, 60.0]], np.float32)  # tanh saturation, no NaN
    np.testing.assert_allclose(gpu_ops.read(gpu_ops.gelu(_upload(gpu_ops, big))), ref.gelu(big), atol=1e-6)
    np.testing.assert_array_equal(gpu_ops.read(gpu_ops.add(gx, gy)), x + y)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["f32", "f16"])
@pytest.mark.parametrize("rotary_dim, window", [(None, None), (8, None), (16, 5), (6, 70)])
def test_gpu_rope_store_and_windowed_attention_match_numpy(wgpu_context, kv_format, rotary_dim, window):
    """No table (GPT-2), partial rotary tables (odd half width included), and sliding windows through
    prefill (tiled kernel), decode and a jump over several 64-position splits."""
    from kjarni.gpu import WgpuOps

    ops, ref = WgpuOps(wgpu_context, weight_format="f32", kv_format=kv_format), NumpyOps()
    heads, kv_heads, head_dim, capacity = 4, 2, 16, 160
    config = ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "partial_rotary_factor": (rotary_dim or 16) / 16,
    })
    table = None if rotary_dim is None else rope_table(config, capacity)
    rope = None if table is None else ops.weight(table, name="rope")
    gpu_cache, cpu_cache = ops.new_kv_cache(1, kv_heads, head_dim, capacity), ref.new_kv_cache(1, kv_heads, head_dim, capacity)
    rng = np.random.default_rng(3)
    start = 0
    for tokens in (37, 1, 3, 70, 1):
        qkv = rng.standard_normal((tokens, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
        q = ops.rope_store(_upload(ops, qkv), rope, gpu_cache, 0, start)
        out = ops.read(ops.attention(q, gpu_cache, 0, start, window))
        q_ref = ref.rope_store(qkv, table, cpu_cache, 0, start)
        if kv_format == "f16":
            cpu_cache.keys[:] = cpu_cache.keys.astype(np.float16).astype(np.float32)
            cpu_cache.values[:] = cpu_cache.values.astype(np.float16).astype(np.float32)
        np.testing.assert_allclose(ops.read(q), q_ref, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(out, ref.attention(q_ref, cpu_cache, 0, start, window), atol=1e-4, rtol=1e-4)
        start += tokens
