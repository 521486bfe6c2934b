"""Bad input that is not a bad file: NaN/inf logits, a lone surrogate, a too-small temperature, host OOM.

Every case raises a typed ``KjarniError`` naming what is wrong (issue 15, sections 2 and 4).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kjarni import loader
from kjarni.errors import HostOutOfMemoryError, InvalidConfigurationError, LoadFailedError, NonFiniteLogitsError
from kjarni.stream import GenerationParams, stream_generate
from kjarni.generator import Generator, GenerationOverrides
from kjarni.numpy_ops import NumpyOps
from kjarni.tokenizer import Tokenizer
from tests.tiny_models import random_state_dict, save_gguf_model, tiny_config

PROMPT_TEXT = "the theme"


def _gguf(tmp_path, name: str, edit=None):
    config = tiny_config("llama")
    tensors = random_state_dict(config, seed=3)
    if edit is not None:
        edit(tensors)
    return save_gguf_model(tmp_path / f"{name}.gguf", config, tensors)


@pytest.fixture(scope="module")
def clean_path(tmp_path_factory):
    return _gguf(tmp_path_factory.mktemp("clean"), "clean")


# ---------------------------------------------------------------- NaN and inf never come out as text

# Every way the loop picks a token: argmax, top-k candidates, the full logits (a penalty), logprobs.
SAMPLERS = {
    "greedy": dict(temperature=0.0),
    "top_k": dict(temperature=0.8, top_k=5),
    "full_logits": dict(temperature=0.8, repetition_penalty=1.1),
    "greedy_logprobs": dict(temperature=0.0, logprobs=True),
}


def _nan_norm(tensors):
    tensors["model.norm.weight"][3] = np.nan


def _inf_embedding_row(tensors):
    tensors["model.embed_tokens.weight"][4, 0] = np.inf


def _overflowing_mlp(tensors):
    # Every weight finite; the first block's MLP output overflows float32, so the residual is inf.
    tensors["model.layers.0.mlp.down_proj.weight"][:] = 3e38


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("edit", [_nan_norm, _inf_embedding_row, _overflowing_mlp], ids=["nan", "inf", "overflow"])
def test_non_finite_logits_raise_naming_the_prefill_on_every_sampling_path(tmp_path, edit, sampler):
    loaded = loader.load_model(_gguf(tmp_path, "bad", edit), ops=NumpyOps())
    prompt = loaded.tokenizer.encode(PROMPT_TEXT) + [4]  # token 4 carries the inf embedding
    params = GenerationParams(max_tokens=4, seed=0, eos_token_ids={2}, **SAMPLERS[sampler])
    with pytest.raises(NonFiniteLogitsError, match=r"at the prefill \(a prompt of \d+ tokens\)") as caught:
        list(stream_generate(loaded.model, loaded.tokenizer, prompt, params))
    assert caught.value.step.startswith("the prefill")
    assert "bad.gguf" in str(caught.value)


def test_overflow_case_really_has_finite_weights(tmp_path):
    weights = loader.load_model(_gguf(tmp_path, "bad", _overflowing_mlp), ops=NumpyOps()).weights
    assert all(np.isfinite(weights.f32(name)).all() for name in weights.names())


def test_nan_reached_only_at_a_decode_step_names_that_step(tmp_path, clean_path):
    clean = loader.load_model(clean_path, ops=NumpyOps())
    prompt = clean.tokenizer.encode(PROMPT_TEXT)
    params = GenerationParams(max_tokens=3, temperature=0.0)
    first = next(iter(stream_generate(clean.model, clean.tokenizer, prompt, params))).token_id
    assert first not in prompt  # else the NaN row would already be read by the prefill

    def nan_row(tensors):
        tensors["model.embed_tokens.weight"][first] = np.nan

    bad = loader.load_model(_gguf(tmp_path, "bad", nan_row), ops=NumpyOps())
    events = stream_generate(bad.model, bad.tokenizer, prompt, params)
    assert next(events).token_id == first
    with pytest.raises(NonFiniteLogitsError, match="at decode step 1") as caught:
        next(events)
    assert caught.value.step == "decode step 1"


def test_speculative_decoding_checks_the_target_logits_too(tmp_path, clean_path):
    bad = loader.load_model(_gguf(tmp_path, "bad", _nan_norm), ops=NumpyOps())
    draft = loader.load_model(clean_path, ops=NumpyOps())
    prompt = bad.tokenizer.encode(PROMPT_TEXT)
    params = GenerationParams(max_tokens=4, temperature=0.0)
    with pytest.raises(NonFiniteLogitsError, match="at the prefill"):
        list(stream_generate(bad.model, bad.tokenizer, prompt, params, draft=draft.model, num_draft_tokens=2))


def test_speculative_verify_step_flags_non_finite_target_logits(tmp_path, clean_path):
    # The target is clean at the prefill; its verify pass reads a token whose embedding is NaN.
    clean = loader.load_model(clean_path, ops=NumpyOps())
    prompt = clean.tokenizer.encode(PROMPT_TEXT)
    greedy = [e.token_id for e in stream_generate(clean.model, clean.tokenizer, prompt, GenerationParams(max_tokens=2, temperature=0.0))]

    def nan_row(tensors):
        tensors["model.embed_tokens.weight"][greedy[0]] = np.nan

    bad = loader.load_model(_gguf(tmp_path, "bad", nan_row), ops=NumpyOps())
    events = stream_generate(bad.model, bad.tokenizer, prompt, GenerationParams(max_tokens=4, temperature=0.0),
                             draft=clean.model, num_draft_tokens=2)
    assert next(events).token_id == greedy[0]
    with pytest.raises(NonFiniteLogitsError, match="speculative verify step"):
        next(events)


@pytest.mark.parametrize("bad_model", ["draft", "target"])
def test_sampled_speculative_decoding_names_the_draft_or_verify_step(tmp_path, clean_path, bad_model):
    # Sampling reads the full logits (Sampler.distribution), not argmax/top-k: its own check names the step.
    clean = loader.load_model(clean_path, ops=NumpyOps())
    prompt = clean.tokenizer.encode(PROMPT_TEXT)
    first = next(iter(stream_generate(clean.model, clean.tokenizer, prompt, GenerationParams(max_tokens=1, temperature=0.0))))

    def nan_row(tensors):  # the first token's embedding: the prefills are clean, the next forward is not
        tensors["model.embed_tokens.weight"][first.token_id] = np.nan

    bad = loader.load_model(_gguf(tmp_path, "bad", nan_row), ops=NumpyOps())
    target, draft = (clean, bad) if bad_model == "draft" else (bad, clean)
    params = GenerationParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=0)  # top_p: no top-k fast path
    events = stream_generate(target.model, target.tokenizer, prompt, params, draft=draft.model, num_draft_tokens=2)
    step = "a draft step" if bad_model == "draft" else "a speculative verify step"
    with pytest.raises(NonFiniteLogitsError, match=f"at {step}") as caught:
        list(events)
    assert caught.value.step == step


def test_generator_api_raises_instead_of_returning_empty_text(tmp_path):
    path = _gguf(tmp_path, "bad", _nan_norm)
    generator = Generator.builder().model_path(path).cpu().quiet().greedy().max_tokens(5).build()
    with pytest.raises(NonFiniteLogitsError, match="at the prefill"):
        generator.generate("hello")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_numpy_argmax_and_top_k_flag_a_non_finite_row_with_minus_one(bad):
    ops = NumpyOps()
    x = np.array([[0.5, 3.0, -1.0, 2.0], [0.5, 3.0, -1.0, 2.0]], dtype=np.float32)
    x[1, 2] = bad
    assert ops.argmax(x).tolist() == [1, -1]
    values, ids = ops.top_k(x, 2)
    assert ids.tolist() == [[1, 3], [-1, -1]]
    assert values[0].tolist() == [3.0, 2.0]


# ---------------------------------------------------------------- a lone surrogate in the prompt


def test_lone_surrogate_in_a_prompt_raises_naming_its_position(clean_path):
    tokenizer = Tokenizer.from_gguf(clean_path)
    with pytest.raises(InvalidConfigurationError, match=r"lone surrogate '\\ud800' at character 4 "):
        tokenizer.encode("abc \ud800")
    assert tokenizer.decode(tokenizer.encode("abc the")) == "abc the"  # valid text still encodes


def test_lone_surrogate_through_the_generator_api(clean_path):
    generator = Generator.builder().model_path(clean_path).cpu().quiet().greedy().max_tokens(2).build()
    with pytest.raises(InvalidConfigurationError, match="at character 1 "):
        generator.generate("a\udfffb")


def test_lone_surrogate_with_a_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    (tmp_path / "tokenizer.json").write_text(HFTokenizer(models.BPE({"a": 0, "b": 1}, [])).to_str())
    tokenizer = Tokenizer.from_dir(tmp_path)
    with pytest.raises(InvalidConfigurationError, match="at character 2 "):
        tokenizer.encode("ab\ud800")


# ---------------------------------------------------------------- tokenizers panics stay inside


def test_merge_making_a_token_outside_the_vocabulary_is_refused_not_a_rust_panic(tmp_path):
    import gguf

    from tests.tiny_models import tiny_vocab

    tokens, types, merges = tiny_vocab(97)
    merges = [*merges, "a b"]  # "a" and "b" are tokens, "ab" is not: tokenizers panics on encode
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LoadFailedError, match="merge 2 .'a b'. does not join two tokens"):
        Tokenizer.from_gguf(path).encode("ab")


def test_tokenizer_json_that_makes_tokenizers_panic_is_a_typed_error(tmp_path):
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": None, "post_processor": None, "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": {"a": 0, "b": 1}, "merges": ["a b"]},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(LoadFailedError, match="PanicException"):
        Tokenizer.from_dir(tmp_path).encode("ab")


# ---------------------------------------------------------------- temperature 1e-50


@pytest.mark.parametrize("temperature", [1e-50, 1e-300, 5e-6])
def test_tiny_positive_temperature_is_refused_before_any_work(clean_path, temperature):
    with pytest.raises(InvalidConfigurationError, match=r"temperature=.* must be 0 \(greedy\) or >= 1e-05"):
        GenerationParams(temperature=temperature)
    with pytest.raises(InvalidConfigurationError, match="temperature"):
        GenerationOverrides(temperature=temperature)
    with pytest.raises(InvalidConfigurationError, match="temperature"):
        Generator.builder().model_path(clean_path).temperature(temperature)


def test_smallest_accepted_temperature_generates_like_greedy(clean_path):
    generator = Generator.builder().model_path(clean_path).cpu().quiet().seed(0).max_tokens(6).build()
    low = generator.generate_with_config(PROMPT_TEXT, GenerationOverrides(temperature=1e-5, top_k=0, top_p=1.0))
    greedy = generator.generate_with_config(PROMPT_TEXT, GenerationOverrides(temperature=0.0))
    assert low == greedy


# ---------------------------------------------------------------- which memory ran out


def test_host_out_of_memory_is_not_reported_as_the_gpu(clean_path, monkeypatch):
    def no_ram(self, parts, *, name):
        raise MemoryError("Unable to allocate 16.0 GiB for an array")

    monkeypatch.setattr(NumpyOps, "weight", no_ram)
    with pytest.raises(HostOutOfMemoryError, match=r"memory \(RAM, not GPU memory\) ran out") as caught:
        Generator.builder().model_path(clean_path).cpu().quiet().build()
    assert "the GPU ran out" not in str(caught.value)
    assert "16.0 GiB" in str(caught.value)
