"""ModelConfig and GenerationDefaults: config.json and GGUF metadata give the same HF-named config."""

from __future__ import annotations

import json

import gguf
import pytest

from kjarni.model_config import GenerationDefaults, ModelConfig
from kjarni.errors import InvalidModelError, LoadFailedError
from kjarni.weights import load_weights
from tests.tiny_models import random_state_dict, save_gguf_model, save_safetensors_model, tiny_config


def test_llama_config_keeps_config_json_names_and_derives_head_groups():
    config = ModelConfig.from_dict(tiny_config("llama"))
    assert (config.model_type, config.vocab_size, config.hidden_size) == ("llama", 97, 48)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (3, 1, 16)
    assert config.num_key_value_groups == 3
    assert (config.q_size, config.kv_size) == (48, 16)
    assert config.eos_token_id == (2,) and config.bos_token_id == 1
    assert config.attention_bias is False and config.sliding_window is None
    assert config.rms_norm_eps == 1e-5 and config.rope_theta == 10000.0


def test_unknown_keys_are_dropped():
    config = ModelConfig.from_dict(tiny_config("llama", torch_dtype="bfloat16", some_future_key=[1, 2]))
    assert not hasattr(config, "some_future_key") and not hasattr(config, "torch_dtype")


def test_head_dim_and_kv_heads_are_derived_when_absent():
    d = tiny_config("llama")
    del d["head_dim"], d["num_key_value_heads"]
    config = ModelConfig.from_dict(d)
    assert config.head_dim == 16 and config.num_key_value_heads == 3 and config.num_key_value_groups == 1


def test_explicit_head_dim_wins_over_hidden_over_heads():
    config = ModelConfig.from_dict(tiny_config("llama", head_dim=32))
    assert config.head_dim == 32 and config.q_size == 96


def test_qwen2_has_qkv_bias_and_no_sliding_window_unless_enabled():
    config = ModelConfig.from_dict(tiny_config("qwen2"))
    assert config.attention_bias is True and config.sliding_window is None
    enabled = ModelConfig.from_dict(tiny_config("qwen2", use_sliding_window=True, sliding_window=128))
    assert enabled.sliding_window == 128


def test_mistral_keeps_its_sliding_window():
    assert ModelConfig.from_dict(tiny_config("mistral", sliding_window=64)).sliding_window == 64
    assert ModelConfig.from_dict(tiny_config("mistral", sliding_window=None)).sliding_window is None


def test_eos_token_id_list_becomes_a_tuple_without_duplicates():
    assert ModelConfig.from_dict(tiny_config("llama", eos_token_id=[2, 5, 2])).eos_token_id == (2, 5)
    assert ModelConfig.from_dict(tiny_config("llama", eos_token_id=None)).eos_token_id == ()


@pytest.mark.parametrize("d", [
    {"model_type": "bert", "architectures": ["BertModel"], "vocab_size": 30522, "hidden_size": 768},
    {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True},
    {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]},
])
def test_encoders_and_encoder_decoders_are_refused_as_not_decoders(d):
    with pytest.raises(InvalidModelError, match="not a decoder") as info:
        ModelConfig.from_dict(d, source="some/config.json")
    assert "some/config.json" in str(info.value) and "llama" in str(info.value) and "qwen2" in str(info.value)


def test_unknown_decoder_architecture_is_named_with_the_supported_list():
    d = {**tiny_config("llama"), "model_type": "gemma", "architectures": ["GemmaForCausalLM"]}
    with pytest.raises(InvalidModelError, match="gemma is not supported; supported: llama, mistral, qwen2"):
        ModelConfig.from_dict(d)


def test_heads_not_divisible_by_kv_heads_is_a_load_failure_naming_the_file():
    with pytest.raises(LoadFailedError, match=r"cfg\.json.*num_attention_heads \(3\).*num_key_value_heads \(2\)"):
        ModelConfig.from_dict(tiny_config("llama", num_key_value_heads=2), source="cfg.json")


def test_missing_required_key_is_a_load_failure():
    d = tiny_config("llama")
    del d["hidden_size"]
    with pytest.raises(LoadFailedError, match="hidden_size"):
        ModelConfig.from_dict(d)


def test_non_positive_size_is_a_load_failure():
    with pytest.raises(LoadFailedError, match="num_hidden_layers must be a positive integer"):
        ModelConfig.from_dict(tiny_config("llama", num_hidden_layers=0))


def test_from_json_reads_the_file_and_names_it_on_errors(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config("qwen2")))
    assert ModelConfig.from_json(path).model_type == "qwen2"
    with pytest.raises(LoadFailedError, match="missing.json does not exist"):
        ModelConfig.from_json(tmp_path / "missing.json")
    path.write_text("{not json")
    with pytest.raises(LoadFailedError, match=r"config\.json is not valid JSON"):
        ModelConfig.from_json(path)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [False, True])
def test_config_from_gguf_equals_config_from_json(tmp_path, model_type, tied):
    d = tiny_config(model_type, tie_word_embeddings=tied)
    tensors = random_state_dict(d, seed=1)
    folder = save_safetensors_model(tmp_path / "hf", d, tensors)
    gguf_path = save_gguf_model(tmp_path / "m.gguf", d, tensors)
    from_json = ModelConfig.from_json(folder / "config.json")
    from_gguf = ModelConfig.from_gguf(load_weights(gguf_path).gguf_reader)
    assert from_gguf == from_json
    assert from_gguf.tie_word_embeddings is tied


def test_config_from_gguf_reads_key_length_as_head_dim(tmp_path):
    d = tiny_config("llama", head_dim=32)
    path = save_gguf_model(tmp_path / "m.gguf", d, random_state_dict(d))
    config = ModelConfig.from_gguf(gguf.GGUFReader(path))  # a stock reader works too
    assert config.head_dim == 32 and config == ModelConfig.from_dict(d)


def _write_metadata_only_gguf(path, arch, **extra):
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in extra.items():
        writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(path)


def test_gguf_of_an_encoder_or_unknown_architecture_is_refused(tmp_path):
    with pytest.raises(InvalidModelError, match="bert is not a decoder"):
        ModelConfig.from_gguf(_write_metadata_only_gguf(tmp_path / "b.gguf", "bert"))
    with pytest.raises(InvalidModelError, match="architecture gemma is not supported"):
        ModelConfig.from_gguf(_write_metadata_only_gguf(tmp_path / "g.gguf", "gemma"))


def test_gguf_without_required_metadata_is_a_load_failure_naming_the_key(tmp_path):
    reader = _write_metadata_only_gguf(tmp_path / "l.gguf", "llama", **{"llama.embedding_length": 64})
    with pytest.raises(LoadFailedError, match="l.gguf: GGUF metadata lacks llama.attention.head_count"):
        ModelConfig.from_gguf(reader)
    with pytest.raises(LoadFailedError, match="^named.gguf: "):
        ModelConfig.from_gguf(reader, path="named.gguf")


def test_generation_defaults_from_json(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"eos_token_id": [151645, 151643], "temperature": 0.7, "top_p": 0.8,
                                "top_k": 20, "repetition_penalty": 1.05, "do_sample": True,
                                "transformers_version": "4.44"}))
    defaults = GenerationDefaults.from_json(path)
    assert defaults.eos_token_ids == (151645, 151643)
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.7, 0.8, 20)
    assert defaults.repetition_penalty == 1.05 and defaults.do_sample is True and defaults.max_new_tokens is None


def test_generation_defaults_are_all_optional():
    defaults = GenerationDefaults.from_dict({})
    assert defaults == GenerationDefaults() and defaults.eos_token_ids == () and defaults.temperature is None


def test_generation_defaults_from_gguf_collect_eos_and_eot(tmp_path):
    reader = _write_metadata_only_gguf(tmp_path / "e.gguf", "llama", **{
        "tokenizer.ggml.eos_token_id": 7, "tokenizer.ggml.eot_token_id": 9})
    assert GenerationDefaults.from_gguf(reader).eos_token_ids == (7, 9)
    same = _write_metadata_only_gguf(tmp_path / "s.gguf", "llama", **{
        "tokenizer.ggml.eos_token_id": 7, "tokenizer.ggml.eot_token_id": 7})
    assert GenerationDefaults.from_gguf(same).eos_token_ids == (7,)
