"""load_weights: safetensors and GGUF give the same tensors under HF names, with precise load errors."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.numpy

import kjarni.weights
from kjarni.model_config import ModelConfig
from kjarni.errors import InvalidModelError, KjarniError, LoadFailedError
from kjarni.weights import QuantTensor, check_shapes, load_weights
from tests.tiny_models import (
    bf16_round,
    gguf_roundtrip,
    llama_cpp_permute,
    quant_config,
    random_state_dict,
    save_gguf_model,
    save_safetensors_model,
    tiny_config,
)
from tests.real_models import QWEN_CODER_05B, SMOLLM2, real_model_path

# ---------------------------------------------------------------- safetensors


@pytest.fixture
def llama():
    d = tiny_config("llama")
    return d, random_state_dict(d, seed=3)


def test_single_safetensors_file_loads_every_tensor_exactly(tmp_path, llama):
    d, tensors = llama
    folder = save_safetensors_model(tmp_path, d, tensors)
    for source in (folder, folder / "model.safetensors"):
        weights = load_weights(source)
        assert set(weights.names()) == set(tensors)
        for name, value in tensors.items():
            assert weights.stored_type(name) == "F32"
            np.testing.assert_array_equal(weights.f32(name), value)
            assert weights.f32(name).dtype == np.float32
        check_shapes(weights, ModelConfig.from_dict(d))


def test_f16_safetensors_keep_f16_raw_and_widen_in_f32(tmp_path, llama):
    d, tensors = llama
    weights = load_weights(save_safetensors_model(tmp_path, d, tensors, dtype="f16"))
    name = "model.layers.1.mlp.down_proj.weight"
    assert weights.raw(name).dtype == np.float16 and weights.stored_type(name) == "F16"
    np.testing.assert_array_equal(weights.f32(name), tensors[name].astype(np.float16).astype(np.float32))


def test_bf16_safetensors_widen_exactly_to_the_bf16_values(tmp_path, llama):
    d, tensors = llama
    weights = load_weights(save_safetensors_model(tmp_path, d, tensors, dtype="bf16"))
    for name, value in tensors.items():
        assert weights.stored_type(name) == "BF16"
        assert weights.raw(name).dtype == np.float32
        np.testing.assert_array_equal(weights.f32(name), bf16_round(value))
        np.testing.assert_allclose(weights.f32(name), value, rtol=2**-8, atol=1e-30)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_sharded_folder_with_index_loads_all_shards(tmp_path, llama, dtype):
    d, tensors = llama
    folder = save_safetensors_model(tmp_path, d, tensors, dtype=dtype, shards=3)
    assert len(list(folder.glob("*.safetensors"))) == 3
    weights = load_weights(folder)
    assert set(weights.names()) == set(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(weights.f32(name), value if dtype == "f32" else bf16_round(value))


def test_folder_of_safetensors_without_index_loads_them_all(tmp_path, llama):
    d, tensors = llama
    folder = save_safetensors_model(tmp_path, d, tensors, shards=2)
    (folder / "model.safetensors.index.json").unlink()
    assert set(load_weights(folder).names()) == set(tensors)


def test_tied_safetensors_alias_lm_head_to_the_embedding_without_copy(tmp_path):
    d = tiny_config("llama", tie_word_embeddings=True)
    tensors = random_state_dict(d)
    assert "lm_head.weight" not in tensors
    weights = load_weights(save_safetensors_model(tmp_path, d, tensors))
    assert "lm_head.weight" in weights and weights.alias_of("lm_head.weight") == "model.embed_tokens.weight"
    assert weights.f32("lm_head.weight") is weights.f32("model.embed_tokens.weight")
    check_shapes(weights, ModelConfig.from_dict(d))


def test_converted_arrays_are_shared_while_held_and_read_only(tmp_path, llama):
    d, tensors = llama
    weights = load_weights(save_safetensors_model(tmp_path, d, tensors, dtype="f16"))
    first = weights.f32("model.norm.weight")
    assert weights.f32("model.norm.weight") is first
    with pytest.raises(ValueError):
        first[0] = 1.0


# ---------------------------------------------------------------- GGUF


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_f32_gguf_loads_to_exactly_the_hf_tensors(tmp_path, model_type):
    d = tiny_config(model_type)
    tensors = random_state_dict(d, seed=5)
    weights = load_weights(save_gguf_model(tmp_path / "m.gguf", d, tensors))
    assert weights.format == "gguf" and isinstance(weights.gguf_reader, gguf.GGUFReader)
    assert set(weights.names()) == set(tensors)
    for name, value in tensors.items():
        assert isinstance(weights.raw(name), np.ndarray)
        np.testing.assert_array_equal(weights.f32(name), value, err_msg=name)
    check_shapes(weights, ModelConfig.from_gguf(weights.gguf_reader))


def test_llama_gguf_stores_permuted_qk_rows_and_loading_undoes_it(tmp_path):
    d = tiny_config("llama")
    tensors = random_state_dict(d, seed=6)
    path = save_gguf_model(tmp_path / "m.gguf", d, tensors)
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    q, k = tensors["model.layers.0.self_attn.q_proj.weight"], tensors["model.layers.0.self_attn.k_proj.weight"]
    assert not np.array_equal(stored["blk.0.attn_q.weight"], q)  # the file really is permuted...
    np.testing.assert_array_equal(stored["blk.0.attn_q.weight"], llama_cpp_permute(q, 3))
    np.testing.assert_array_equal(stored["blk.0.attn_k.weight"], llama_cpp_permute(k, 3, 1))
    weights = load_weights(path)  # ...and loading gives HF's order back
    np.testing.assert_array_equal(weights.f32("model.layers.0.self_attn.q_proj.weight"), q)
    np.testing.assert_array_equal(weights.f32("model.layers.0.self_attn.k_proj.weight"), k)


def test_llama_gguf_biases_are_unpermuted_too(tmp_path):
    d = tiny_config("llama", attention_bias=True)
    tensors = random_state_dict(d, seed=7)
    assert "model.layers.0.self_attn.q_proj.bias" in tensors
    weights = load_weights(save_gguf_model(tmp_path / "m.gguf", d, tensors))
    for name in ("model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.k_proj.bias"):
        np.testing.assert_array_equal(weights.f32(name), tensors[name])


def test_qwen2_gguf_is_not_permuted(tmp_path):
    d = tiny_config("qwen2")
    tensors = random_state_dict(d, seed=8)
    path = save_gguf_model(tmp_path / "m.gguf", d, tensors)
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    np.testing.assert_array_equal(stored["blk.0.attn_q.weight"], tensors["model.layers.0.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(stored["blk.0.attn_q.bias"], tensors["model.layers.0.self_attn.q_proj.bias"])


@pytest.mark.parametrize("model_type,quant,tolerance", [
    ("llama", "Q8_0", 0.01), ("llama", "Q4_1", 0.1), ("qwen2", "Q4_0", 0.15), ("qwen2", "Q5_1", 0.05),
])
def test_quantized_gguf_keeps_blocks_and_dequantizes_like_gguf(tmp_path, model_type, quant, tolerance):
    d = quant_config(model_type)
    tensors = random_state_dict(d, seed=9)
    weights = load_weights(save_gguf_model(tmp_path / "m.gguf", d, tensors, quant=quant))
    q_name = "model.layers.0.self_attn.q_proj.weight"
    raw = weights.raw(q_name)
    assert isinstance(raw, QuantTensor) and raw.ggml_type.name == quant and raw.shape == (64, 64)
    assert raw.data.dtype == np.uint8 and raw.data.shape == (64, 64 // raw.block_size * raw.type_size)
    # Rows are in HF order: the blocks equal quantizing the HF matrix directly.
    np.testing.assert_array_equal(raw.data, gguf.quants.quantize(tensors[q_name], raw.ggml_type))
    assert isinstance(weights.raw("model.norm.weight"), np.ndarray)
    for name, value in tensors.items():
        np.testing.assert_array_equal(weights.f32(name), gguf_roundtrip(value, quant), err_msg=name)
        np.testing.assert_allclose(weights.f32(name), value, atol=tolerance, err_msg=name)


def test_tied_gguf_aliases_lm_head_to_the_quantized_embedding(tmp_path):
    d = quant_config("llama", tie_word_embeddings=True)
    weights = load_weights(save_gguf_model(tmp_path / "m.gguf", d, random_state_dict(d), quant="Q8_0"))
    assert weights.alias_of("lm_head.weight") == "model.embed_tokens.weight"
    assert weights.raw("lm_head.weight") is weights.raw("model.embed_tokens.weight")
    assert weights.f32("lm_head.weight") is weights.f32("model.embed_tokens.weight")
    assert ModelConfig.from_gguf(weights.gguf_reader).tie_word_embeddings is True


# ---------------------------------------------------------------- bad input


def test_missing_path_is_a_load_failure_naming_it(tmp_path):
    with pytest.raises(LoadFailedError, match="nowhere.gguf does not exist"):
        load_weights(tmp_path / "nowhere.gguf")


def test_folder_without_weights_is_a_load_failure(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(LoadFailedError, match="no \\*.safetensors"):
        load_weights(tmp_path)


@pytest.mark.parametrize("keep", [0.99, 0.6, 0.05, 0.0005])
def test_truncated_gguf_is_a_load_failure_naming_the_file(tmp_path, keep):
    d = quant_config("llama")
    path = save_gguf_model(tmp_path / "m.gguf", d, random_state_dict(d), quant="Q8_0")
    data = path.read_bytes()
    path.write_bytes(data[: max(4, int(len(data) * keep))])
    with pytest.raises(LoadFailedError, match="m.gguf is truncated"):
        load_weights(path)


def test_file_that_is_not_gguf_or_safetensors_is_a_load_failure(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf at all")
    with pytest.raises(LoadFailedError, match="not a GGUF file"):
        load_weights(path)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x00" * 16)
    with pytest.raises(LoadFailedError, match="neither a .gguf nor a .safetensors"):
        load_weights(other)


def test_gguf_with_a_corrupted_length_field_is_a_load_failure(tmp_path):
    d = tiny_config("llama")
    path = save_gguf_model(tmp_path / "m.gguf", d, random_state_dict(d))
    data = bytearray(path.read_bytes())
    key = b"general.architecture"
    at = data.index(key) + len(key) + 4  # after the key and its value type: the string length
    data[at:at + 8] = (2**40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(LoadFailedError, match="m.gguf"):
        load_weights(path)


def test_truncated_safetensors_is_a_load_failure_naming_file_and_tensor(tmp_path, llama):
    d, tensors = llama
    path = save_safetensors_model(tmp_path, d, tensors) / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(LoadFailedError, match=r"model.safetensors is truncated: tensor .* ends at byte"):
        load_weights(path)


def test_safetensors_shorter_than_its_header_is_a_load_failure(tmp_path, llama):
    d, tensors = llama
    path = save_safetensors_model(tmp_path, d, tensors) / "model.safetensors"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(LoadFailedError, match="truncated or corrupted: its header claims"):
        load_weights(path)
    path.write_bytes(b"\x01\x02")
    with pytest.raises(LoadFailedError, match="shorter than the 8-byte header length"):
        load_weights(path)


def test_safetensors_with_garbage_header_is_a_load_failure(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes((16).to_bytes(8, "little") + b"{\"a\": [1, 2, \xff\xfe" + b"\x00" * 64)
    with pytest.raises(LoadFailedError, match="corrupted safetensors header"):
        load_weights(path)


def test_safetensors_header_whose_offsets_disagree_with_the_shape_is_a_load_failure(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\x00" * 64)
    with pytest.raises(LoadFailedError, match=r"tensor w is F32\[4, 4\] \(64 bytes\) but its data_offsets span 60"):
        load_weights(path)


def test_safetensors_of_an_unsupported_dtype_is_an_invalid_model(tmp_path):
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({"qweight": np.zeros((4, 4), np.int32)}, str(path))
    with pytest.raises(InvalidModelError, match="tensor qweight has dtype I32"):
        load_weights(path)


def test_sharded_index_naming_a_missing_shard_is_a_load_failure(tmp_path, llama):
    d, tensors = llama
    folder = save_safetensors_model(tmp_path, d, tensors, shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(LoadFailedError, match="model-00002-of-00002.safetensors does not exist"):
        load_weights(folder)


def test_shape_disagreeing_with_config_names_tensor_expected_and_actual(tmp_path, llama):
    d, tensors = llama
    weights = load_weights(save_safetensors_model(tmp_path, d, tensors))
    wrong = ModelConfig.from_dict({**d, "intermediate_size": 80})
    with pytest.raises(LoadFailedError, match=r"model.layers.0.mlp.gate_proj.weight has shape \(72, 48\) "
                                              r"but the config expects \(80, 48\)"):
        check_shapes(weights, wrong)


def test_missing_tensor_is_named_by_check_shapes(tmp_path, llama):
    d, tensors = llama
    del tensors["model.layers.1.mlp.up_proj.weight"]
    weights = load_weights(save_safetensors_model(tmp_path, d, tensors))
    with pytest.raises(LoadFailedError, match="model.layers.1.mlp.up_proj.weight is missing"):
        check_shapes(weights, ModelConfig.from_dict(d))
    with pytest.raises(LoadFailedError, match="no tensor named model.layers.1.mlp.up_proj.weight"):
        weights.f32("model.layers.1.mlp.up_proj.weight")


def test_qwen2_without_biases_fails_check_shapes(tmp_path):
    d = tiny_config("qwen2")
    tensors = {k: v for k, v in random_state_dict(d).items() if not k.endswith(".bias")}
    weights = load_weights(save_safetensors_model(tmp_path, d, tensors))
    with pytest.raises(LoadFailedError, match="q_proj.bias is missing"):
        check_shapes(weights, ModelConfig.from_dict(d))


def test_unsupported_gguf_quant_type_is_an_invalid_model_naming_tensor_and_type(tmp_path, monkeypatch):
    d = quant_config("llama")
    path = save_gguf_model(tmp_path / "m.gguf", d, random_state_dict(d), quant="Q8_0")
    monkeypatch.setattr(kjarni.weights, "SUPPORTED_GGML_TYPES",
                        kjarni.weights.SUPPORTED_GGML_TYPES - {gguf.GGMLQuantizationType.Q8_0})
    with pytest.raises(InvalidModelError, match=r"tensor \S+ is stored as Q8_0, which kjarni cannot dequantize"):
        load_weights(path)


def test_every_type_gguf_can_dequantize_is_supported():
    supported = {t.name for t in kjarni.weights.SUPPORTED_GGML_TYPES}
    assert {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
            "Q6_K", "IQ4_NL", "IQ4_XS"} <= supported


# ---------------------------------------------------------------- real models

def _smollm2_path() -> Path:
    return real_model_path(SMOLLM2)


@pytest.mark.slow
def test_smollm2_gguf_loads_with_its_known_config_and_dequantizes_each_tensor_once_when_asked(monkeypatch):
    """Loading maps the file and dequantizes nothing (what made loading fast); `f32` dequantizes
    each quantized tensor on first use only. Load times: tools/bench_load.py."""
    dequantized = []
    dequantize = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda data, qtype: dequantized.append(qtype) or dequantize(data, qtype))
    weights = load_weights(_smollm2_path())
    config = ModelConfig.from_gguf(weights.gguf_reader)
    check_shapes(weights, config)
    assert dequantized == []
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.rope_theta, config.tie_word_embeddings) == (49152, 100000.0, True)
    assert config.intermediate_size == 1536 and config.rms_norm_eps == 1e-5 and config.eos_token_id == (2,)
    assert weights.stored_type("model.layers.0.self_attn.q_proj.weight") == "Q4_1"
    assert weights.stored_type("model.embed_tokens.weight") == "Q8_0"
    assert weights.alias_of("lm_head.weight") == "model.embed_tokens.weight"
    stored = [name for name in weights.names() if weights.alias_of(name) is None]  # lm_head is the embedding
    quantized = [name for name in stored if isinstance(weights.raw(name), QuantTensor)]
    assert len(quantized) == 7 * 30 + 1  # every layer's 7 matrices, and the embedding
    dense = {name: weights.f32(name) for name in weights.names()}
    assert len(dequantized) == len(quantized)
    assert all(weights.f32(name) is dense[name] for name in weights.names())  # kept: no second dequantize
    assert len(dequantized) == len(quantized)
    assert all(a.dtype == np.float32 for a in dense.values())
    assert np.isfinite(dense["model.layers.29.mlp.down_proj.weight"]).all()
    assert dense["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


@pytest.mark.slow
def test_qwen_gguf_loads_with_its_known_config():
    path = real_model_path(QWEN_CODER_05B)
    weights = load_weights(path)
    config = ModelConfig.from_gguf(weights.gguf_reader)
    check_shapes(weights, config)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("qwen2", 24, 896)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (14, 2, 151936)
    assert config.attention_bias and not config.tie_word_embeddings and config.rope_theta == 1e6
    assert "lm_head.weight" in weights and weights.alias_of("lm_head.weight") is None
    assert {weights.stored_type(n) for n in weights.names()} >= {"Q5_0", "Q8_0", "Q6_K", "F32"}
    assert np.isfinite(weights.f32("model.layers.0.mlp.down_proj.weight")).all()  # a K-quant


def test_errors_are_kjarni_errors():
    assert issubclass(LoadFailedError, KjarniError) and issubclass(InvalidModelError, KjarniError)
