"""The Generator API (kjarni.generator) on a tiny random model: builder, layers, streams, async, threads.

The tiny model is a Hugging Face folder (config.json, safetensors, a byte-level BPE tokenizer.json
built here with the tokenizers library) from tests/tiny_models.py; `make_tiny_model` is shared with
test_cli.py and test_docs.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import numpy as np
import pytest

import kjarni.generator as kg
from kjarni import sources
from kjarni.errors import (
    ContextOverflowError,
    GenerationFailedError,
    GpuUnavailableError,
    InvalidConfigurationError,
    InvalidModelError,
    LoadFailedError,
    ModelNotDownloadedError,
    UnknownModelError,
)
from kjarni.generator import (
    DEFAULT_PREFIX_CACHE_TOKENS,
    DownloadPolicy,
    GeneratedToken,
    GenerationOverrides,
    Generator,
    GeneratorBuilder,
    KjarniDevice,
    LoadConfig,
    LoadConfigBuilder,
    ResolvedGenerationConfig,
)
from kjarni.generator import builder as builder_module
from tests.threads import HANG_GUARD_S, Gate, WatchedLock, Worker, join_async_workers
from tests.tiny_models import CHAT_TEMPLATE, SPECIAL_TOKENS, random_state_dict, save_safetensors_model, tiny_config, tiny_vocab

TINY_VOCAB = 300  # every byte has a token, so any text (emoji, CJK) encodes


def write_tiny_tokenizer(folder: Path, *, bos: bool = True) -> None:
    """A byte-level BPE tokenizer.json (two merges) with the tiny vocabulary, plus tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, _, merges = tiny_vocab(TINY_VOCAB)
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges])
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE}
    if bos:
        config["bos_token"] = "<|im_start|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def make_tiny_model(
    folder: Path,
    *,
    generation_config: dict | None = None,
    bos: bool = True,
    model_type: str = "llama",
    weight_noise: float = 0.0,
    **config_overrides,
) -> Path:
    """A tiny model folder kjarni can load: config, random float32 weights, tokenizer.

    ``weight_noise`` > 0 adds that much relative noise to the same weights: a draft model that
    agrees with the noiseless one often, not always (two independent random models never agree).
    """
    overrides = {"vocab_size": TINY_VOCAB, **config_overrides}
    if not bos:
        overrides["bos_token_id"] = None
    config = tiny_config(model_type, **overrides)
    tensors = random_state_dict(config, seed=3)
    if weight_noise:
        rng = np.random.default_rng(1003)
        tensors = {n: (t + weight_noise * t.std() * rng.standard_normal(t.shape)).astype(np.float32) for n, t in tensors.items()}
    save_safetensors_model(folder, config, tensors, generation_config=generation_config)
    write_tiny_tokenizer(folder, bos=bos)
    return folder


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Generator:
    """A shared CPU Generator on the tiny model (kjarni's default sampling, no model defaults)."""
    return Generator.builder().model_path(tiny_dir).cpu().quiet().build()


def build(path: Path, **_: object) -> GeneratorBuilder:
    return Generator.builder().model_path(path).cpu().quiet()


# ---------------------------------------------------------------- properties


def test_generator_properties_describe_the_loaded_model(tiny: Generator, tiny_dir: Path) -> None:
    assert tiny.model_type == "llama"
    assert tiny.model_name == tiny_dir.name
    assert tiny.device is KjarniDevice.CPU
    assert tiny.context_size == 256
    assert tiny.vocab_size == TINY_VOCAB
    assert tiny.gpu_context is None
    assert tiny.decoder.config.hidden_size == 48 and tiny.decoder.model.config is tiny.decoder.config
    assert len(tiny.decoder.model.blocks) == 2 and tiny.decoder.model.ops.name == "cpu"
    assert isinstance(tiny.generation_config, ResolvedGenerationConfig)
    assert 2 in tiny.generation_config.eos_token_ids
    with pytest.raises(AttributeError):
        tiny.model_name = "other"  # type: ignore[misc]


def test_last_stats_reports_the_last_generation(tiny: Generator) -> None:
    greedy = GenerationOverrides(max_tokens=5, temperature=0.0)
    streamed = list(tiny.stream_with_config("the cat", greedy))  # the same generation, token by token
    tiny.generate_with_config("the cat", greedy)
    stats = tiny.last_stats
    assert stats.prompt_tokens == len(tiny.tokenizer.encode("the cat"))
    assert (stats.generated_tokens, stats.finish_reason) == (len(streamed), streamed[-1].finish_reason)
    assert stats.finish_reason in ("eos", "length")
    tokens = []
    for token in tiny.stream_with_config("the", GenerationOverrides(max_tokens=3, temperature=0.0)):
        tokens.append(token)
        if token.finish_reason:
            break  # a consumer that stops at the last token still leaves its stats behind
    assert tiny.last_stats.generated_tokens == len(tokens)
    assert tiny.last_stats.prompt_tokens == len(tiny.tokenizer.encode("the"))


# ---------------------------------------------------------------- builder and config layers


def test_every_sampling_setter_lands_in_the_resolved_config(tiny_dir: Path) -> None:
    g = (
        build(tiny_dir)
        .temperature(0.5).max_tokens(17).top_p(0.8).top_k(9).min_p(0.1).repetition_penalty(1.3)
        .seed(42).stop(["\n\n", "END"])
        .build()
    )
    c = g.generation_config
    assert (c.temperature, c.max_tokens, c.top_p, c.top_k, c.min_p, c.repetition_penalty, c.seed) == (
        0.5, 17, 0.8, 9, 0.1, 1.3, 42,
    )
    assert c.stop == ("\n\n", "END")


def test_greedy_creative_precise_and_generation_config_are_layers_where_later_calls_win(tiny_dir: Path) -> None:
    assert build(tiny_dir).greedy().build().generation_config.temperature == 0.0
    creative = build(tiny_dir).creative().build().generation_config
    assert creative.temperature == builder_module.CREATIVE.temperature and creative.top_k == 0
    precise = build(tiny_dir).precise().build().generation_config
    assert precise.temperature == builder_module.PRECISE.temperature
    later = build(tiny_dir).creative().temperature(0.3).build().generation_config
    assert later.temperature == 0.3 and later.top_p == builder_module.CREATIVE.top_p
    merged = build(tiny_dir).top_k(5).generation_config(GenerationOverrides(temperature=0.4, max_tokens=3)).build()
    assert (merged.generation_config.top_k, merged.generation_config.temperature, merged.generation_config.max_tokens) == (5, 0.4, 3)


def test_stop_takes_one_string_as_one_stop_string(tiny_dir: Path) -> None:
    assert build(tiny_dir).stop("END").build().generation_config.stop == ("END",)


def test_builder_methods_all_chain(tiny_dir: Path, tmp_path: Path) -> None:
    b = GeneratorBuilder("smollm2-135m-instruct")
    chained = (
        b.model_path(tiny_dir).device("cpu").cpu().temperature(1.0).max_tokens(4).top_p(1.0).top_k(0).min_p(0.0)
        .repetition_penalty(1.0).greedy().seed(1).stop("x").generation_config(GenerationOverrides())
        .with_load_config(lambda c: c).cache_dir(tmp_path).download_policy(DownloadPolicy.NEVER).offline()
        .quiet().allow_warnings().creative().precise().preset("generator_fast_v1").cpu()
    )
    assert chained is b
    assert b.draft("qwen2.5-0.5b", 4) is b and b.prefix_cache(True) is b and b.prefix_cache_tokens(8) is b


def test_config_layers_resolve_model_then_preset_then_builder_then_call(tmp_path: Path) -> None:
    folder = make_tiny_model(
        tmp_path / "m", generation_config={"temperature": 0.3, "top_k": 7, "top_p": 0.6, "max_new_tokens": 11}
    )
    model_only = build(folder).build().generation_config
    assert (model_only.temperature, model_only.top_k, model_only.top_p, model_only.max_tokens) == (0.3, 7, 0.6, 11)
    assert model_only.min_p == 0.0 and model_only.repetition_penalty == 1.0  # kjarni's defaults below

    preset = kg.GENERATOR_FAST_V1
    with_preset = build(folder).preset(preset).cpu().build().generation_config
    assert (with_preset.temperature, with_preset.max_tokens) == (preset.temperature, preset.default_max_tokens)
    assert with_preset.top_k == 7  # the preset does not set it: the model's value stays

    g = build(folder).preset(preset).cpu().temperature(0.5).build()
    assert (g.generation_config.temperature, g.generation_config.max_tokens) == (0.5, preset.default_max_tokens)

    stream = g.stream_with_config("the", GenerationOverrides(temperature=0.1, max_tokens=2))
    with stream:
        assert (stream.config.temperature, stream.config.max_tokens, stream.config.top_k) == (0.1, 2, 7)
    assert g.generation_config.temperature == 0.5  # per-call overrides do not stick


def test_model_do_sample_false_means_greedy(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "m", generation_config={"do_sample": False, "temperature": 0.9})
    assert build(folder).build().generation_config.temperature == 0.0


def test_out_of_range_model_defaults_are_ignored_not_fatal(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "m", generation_config={"top_p": 0.0, "temperature": 0.4})
    config = build(folder).build().generation_config
    assert config.temperature == 0.4 and config.top_p == kg.config.KJARNI_DEFAULTS.top_p


@pytest.mark.parametrize(
    ("setter", "value", "name"),
    [
        ("temperature", -0.1, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -1, "top_k"),
        ("min_p", -0.01, "min_p"),
        ("min_p", 1.01, "min_p"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("max_tokens", 0, "max_tokens"),
        ("max_tokens", 2.5, "max_tokens"),
        ("seed", -1, "seed"),
    ],
)
def test_bad_values_are_refused_at_once_naming_value_and_range(setter: str, value: float, name: str) -> None:
    with pytest.raises(InvalidConfigurationError, match=rf"{name}=.*out of range.*must be"):
        getattr(GeneratorBuilder("no-such-model"), setter)(value)
    with pytest.raises(InvalidConfigurationError, match=name):
        GenerationOverrides(**{name: value})


def test_bad_per_call_overrides_fail_before_generation(tiny: Generator) -> None:
    with pytest.raises(InvalidConfigurationError):
        tiny.generate_with_config("the", GenerationOverrides(top_p=2.0))
    with pytest.raises(InvalidConfigurationError, match="GenerationOverrides"):
        tiny.generate_with_config("the", {"temperature": 0.5})  # type: ignore[arg-type]
    with pytest.raises(InvalidConfigurationError):
        GenerationOverrides(stop=("",))
    tiny.generate_with_config("the", GenerationOverrides(max_tokens=1))  # the lock was not left held


# ---------------------------------------------------------------- speculative decoding and the prefix cache

GREEDY_30 = GenerationOverrides(temperature=0.0, max_tokens=30)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's weights with 4% noise, same tokenizer: accepted often, not always."""
    return make_tiny_model(tmp_path_factory.mktemp("draft"), weight_noise=0.04)


def greedy_ids(generator: Generator, prompt: str, overrides: GenerationOverrides = GREEDY_30) -> list[int]:
    return [t.token_id for t in generator.stream_with_config(prompt, overrides)]


def test_draft_and_prefix_cache_settings_are_checked_before_any_work() -> None:
    with pytest.raises(InvalidConfigurationError, match="num_tokens"):
        GeneratorBuilder("x").draft("qwen2.5-0.5b", 0)
    with pytest.raises(InvalidConfigurationError, match="num_tokens"):
        GeneratorBuilder("x").draft("qwen2.5-0.5b", True)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfigurationError, match="draft model name"):
        GeneratorBuilder("x").draft("", 4)
    with pytest.raises(InvalidConfigurationError, match="device"):
        GeneratorBuilder("x").draft("qwen2.5-0.5b", 4, device="tpu")
    with pytest.raises(InvalidConfigurationError, match="prefix_cache_tokens"):
        GeneratorBuilder("x").prefix_cache_tokens(0)
    assert DEFAULT_PREFIX_CACHE_TOKENS == 4096


def test_an_unknown_draft_fails_before_the_model_is_loaded(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_loading(*_: object, **__: object) -> None:
        raise AssertionError("the model was loaded before the draft was resolved")

    monkeypatch.setattr(builder_module.PartsBuilder, "_load", no_loading)
    with pytest.raises(UnknownModelError, match="no-such-draft"):
        build(tiny_dir).draft("no-such-draft", 4).build()


def test_greedy_output_with_a_draft_is_the_models_own_and_stats_are_reported(
    tiny: Generator, tiny_dir: Path, draft_dir: Path
) -> None:
    g = build(tiny_dir).draft(str(draft_dir), 3).build()
    assert (g.draft_model_name, g.num_draft_tokens, g.draft_device) == (draft_dir.name, 3, KjarniDevice.CPU)
    assert g.draft_decoder.path == draft_dir and tiny.draft_model_name is None and tiny.num_draft_tokens == 0
    for prompt in ("hello world", "", "the cat sat"):  # the last one runs to max_tokens
        assert greedy_ids(g, prompt) == greedy_ids(tiny, prompt)
    stats = g.last_stats
    assert stats.generated_tokens == 30 and stats.rounds >= 1
    assert 0 < stats.draft_tokens_accepted < stats.draft_tokens_proposed  # both outcomes were exercised
    assert stats.acceptance_rate == stats.draft_tokens_accepted / stats.draft_tokens_proposed
    assert stats.tokens_per_round == (stats.draft_tokens_accepted + stats.rounds) / stats.rounds > 1
    assert tiny.last_stats.rounds == 0  # no draft, no rounds


def test_sampling_with_a_draft_keeps_max_tokens_stop_strings_and_seeds(tiny_dir: Path, draft_dir: Path) -> None:
    g = build(tiny_dir).draft(str(draft_dir), 4).build()
    sampled = GenerationOverrides(temperature=0.9, top_k=0, seed=5, max_tokens=17)
    first = g.generate_with_config("the cat", sampled)
    assert g.generate_with_config("the cat", sampled) == first  # same seed, same text
    assert g.last_stats.generated_tokens <= 17 and g.last_stats.rounds >= 1
    stop = first[len(first) // 2 : len(first) // 2 + 2]
    if stop:
        stopped = g.generate_with_config("the cat", GenerationOverrides(temperature=0.9, top_k=0, seed=5, max_tokens=17, stop=(stop,)))
        assert stop not in stopped and first.startswith(stopped)


def test_a_draft_of_another_vocabulary_is_refused_at_build_naming_both(tiny_dir: Path, tmp_path: Path) -> None:
    other = make_tiny_model(tmp_path / "wide-draft", vocab_size=TINY_VOCAB + 20)
    with pytest.raises(InvalidConfigurationError) as refused:
        build(tiny_dir).draft(str(other), 4).build()
    message = str(refused.value)
    assert "wide-draft" in message and tiny_dir.name in message
    assert str(TINY_VOCAB + 20) in message and str(TINY_VOCAB) in message


def test_the_prefix_cache_is_off_by_default_and_allocated_eagerly_when_on(tiny: Generator, tiny_dir: Path) -> None:
    assert tiny.prefix_cache is None and tiny.prefix_cache_nbytes == 0
    g = build(tiny_dir).prefix_cache(True).build()
    assert g.prefix_cache.capacity == 256  # DEFAULT_PREFIX_CACHE_TOKENS clamped to the context
    assert g.prefix_cache.tokens == 0 and g.prefix_cache_nbytes == g.prefix_cache.nbytes > 0
    assert build(tiny_dir).prefix_cache_tokens(40).build().prefix_cache.capacity == 40
    assert build(tiny_dir).prefix_cache(True).prefix_cache(False).build().prefix_cache is None


def test_a_prompt_sharing_a_cached_prefix_reuses_it_and_gives_the_same_text(tiny: Generator, tiny_dir: Path) -> None:
    g = build(tiny_dir).prefix_cache(True).build()
    first = g.generate_with_config("the cat sat on", GREEDY_30)
    assert g.last_stats.cached_prompt_tokens == 0
    for prompt in ("the cat sat on the mat", "the cat sat on" + first + " and then"):
        assert g.generate_with_config(prompt, GREEDY_30) == tiny.generate_with_config(prompt, GREEDY_30)
        assert g.last_stats.cached_prompt_tokens > 0
    assert g._kv_cache is None  # the Generator's own reusable cache is never allocated beside it
    g.clear_prefix_cache()
    assert g.prefix_cache.tokens == 0
    g.generate_with_config("the cat sat on the mat", GREEDY_30)
    assert g.last_stats.cached_prompt_tokens == 0


def test_a_prompt_too_long_for_the_prefix_cache_still_works(tiny: Generator, tiny_dir: Path) -> None:
    g = build(tiny_dir).prefix_cache_tokens(16).build()
    g.generate_with_config("hi", GenerationOverrides(temperature=0.0, max_tokens=4))
    held = g.prefix_cache.cached_ids
    assert held
    prompt = "the cat sat on the mat and looked around"
    assert g.generate_with_config(prompt, GREEDY_30) == tiny.generate_with_config(prompt, GREEDY_30)
    assert g.prefix_cache.cached_ids == held  # left as it was for later calls


def test_the_prefix_cache_respects_max_context(tiny_dir: Path) -> None:
    g = build(tiny_dir).with_load_config(lambda c: c.max_context(48)).allow_warnings().prefix_cache(True).build()
    assert g.prefix_cache.capacity == 48
    long = GenerationOverrides(temperature=0.0, max_tokens=200)
    first = [t for t in g.stream_with_config("the cat", long)]
    assert first[-1].finish_reason in ("context", "eos")
    assert g.last_stats.prompt_tokens + g.last_stats.generated_tokens <= 48
    g.generate_with_config("the cat sat", long)
    assert g.last_stats.cached_prompt_tokens > 0  # max_tokens beyond the context still uses the cache


def test_a_draft_and_the_prefix_cache_together(tiny: Generator, tiny_dir: Path, draft_dir: Path) -> None:
    g = build(tiny_dir).draft(str(draft_dir), 4).prefix_cache_tokens(128).build()
    assert g.prefix_cache_nbytes == 2 * g.prefix_cache.nbytes  # the draft has its own, same shapes here
    assert greedy_ids(g, "the cat sat") == greedy_ids(tiny, "the cat sat")
    assert greedy_ids(g, "the cat sat on a mat") == greedy_ids(tiny, "the cat sat on a mat")
    assert g.last_stats.cached_prompt_tokens > 0 and g.last_stats.rounds >= 1
    assert g._kv_cache is None and g._draft_kv_cache is None


@pytest.mark.gpu
@pytest.mark.parametrize(("target_device", "draft_device"), [("gpu", "cpu"), ("cpu", "gpu"), ("gpu", None)])
def test_a_draft_on_either_backend_gives_the_same_greedy_tokens(
    tiny: Generator, tiny_dir: Path, draft_dir: Path, wgpu_context: object, target_device: str, draft_device: str | None
) -> None:
    """GPU model with a CPU draft, CPU model with a GPU draft, and both on the GPU sharing one context."""
    builder = build(tiny_dir).draft(str(draft_dir), 3, device=draft_device).with_load_config(lambda c: c.f32())
    builder.allow_warnings()
    plain = tiny
    if target_device == "gpu":
        builder.with_context(wgpu_context)
        plain = Generator.builder().model_path(tiny_dir).with_context(wgpu_context).with_load_config(lambda c: c.f32()).quiet().build()
    g = builder.build()
    assert g.device is KjarniDevice.parse(target_device)
    assert g.draft_device is KjarniDevice.parse(draft_device or target_device)
    if draft_device is None:
        assert g.draft_decoder.model.ops.context is wgpu_context
    assert greedy_ids(g, "the cat sat") == greedy_ids(plain, "the cat sat")
    assert g.last_stats.rounds >= 1


def test_load_config_builder_and_with_load_config(tiny_dir: Path) -> None:
    config = LoadConfigBuilder().quantized().kv_dtype("f16").max_context(64).prefer_gguf().build()
    assert config == LoadConfig(weight_format="quantized", kv_dtype="f16", max_context=64, prefer="gguf")
    assert LoadConfigBuilder().f32().build().weight_format == "f32"
    assert LoadConfigBuilder().q8_0().f16().build().weight_format == "f16"
    for bad in (lambda c: c.weight_format("int3"), lambda c: c.kv_dtype("f64"), lambda c: c.max_context(0),
                lambda c: c.prefer("onnx")):
        with pytest.raises(InvalidConfigurationError):
            GeneratorBuilder().with_load_config(bad)
    with pytest.raises(InvalidConfigurationError, match="must return"):
        GeneratorBuilder().with_load_config(lambda c: None)  # type: ignore[arg-type, return-value]
    g = build(tiny_dir).with_load_config(lambda c: c.max_context(32)).build()
    assert g.context_size == 32 and g.load_config.max_context == 32


def test_load_config_prefer_picks_the_format_in_a_folder_with_both(tmp_path: Path) -> None:
    from tests.tiny_models import save_gguf_model

    # qwen2: save_gguf_model writes tokenizer.ggml.pre "gpt2" for llama, which tokenizer.py does not accept.
    folder = make_tiny_model(tmp_path / "both", model_type="qwen2")
    config = json.loads((folder / "config.json").read_text())
    save_gguf_model(folder / "model.gguf", config, random_state_dict(config, seed=99))
    from_safetensors = build(folder).with_load_config(lambda c: c.prefer_safetensors()).build()
    from_gguf = build(folder).with_load_config(lambda c: c.prefer_gguf()).build()
    assert from_safetensors.decoder.path == folder
    assert from_gguf.decoder.path == folder / "model.gguf"


def test_device_parsing_and_with_context_requires_the_gpu() -> None:
    assert KjarniDevice.parse("GPU") is KjarniDevice.GPU
    with pytest.raises(InvalidConfigurationError, match="tpu"):
        GeneratorBuilder().device("tpu")
    with pytest.raises(InvalidConfigurationError, match="with_context"):
        GeneratorBuilder("no-such-model").with_context(object()).cpu().build()


# ---------------------------------------------------------------- model sources and devices


def test_unknown_model_and_offline_cache_miss_raise_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match="kjarni models"):
        GeneratorBuilder("no-such-model").cpu().quiet().build()
    with pytest.raises(ModelNotDownloadedError, match="kjarni pull"):
        GeneratorBuilder("smollm2-135m-instruct").cache_dir(tmp_path).offline().cpu().quiet().build()
    with pytest.raises(LoadFailedError, match="does not exist"):
        GeneratorBuilder().model_path(tmp_path / "missing").cpu().quiet().build()


def test_gpu_without_a_backend_or_adapter_raises_gpu_unavailable(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_gpu(load_config: LoadConfig, context: object) -> None:
        raise GpuUnavailableError("no WebGPU adapter (test)")

    monkeypatch.setattr(builder_module, "_gpu_ops", no_gpu)
    with pytest.raises(GpuUnavailableError, match="adapter"):
        Generator.builder().model_path(tiny_dir).gpu().quiet().build()


def test_auto_falls_back_to_the_cpu_with_a_notice_on_stderr_unless_quiet(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_gpu(load_config: LoadConfig, context: object) -> None:
        raise GpuUnavailableError("no WebGPU adapter (test)")

    monkeypatch.setattr(builder_module, "_gpu_ops", no_gpu)
    monkeypatch.setattr(builder_module, "_software_adapter", lambda: None)  # as if a real GPU were found
    g = Generator.builder().model_path(tiny_dir).build()  # AUTO is the default
    out, err = capsys.readouterr()
    assert g.device is KjarniDevice.CPU and g.gpu_context is None
    assert "no usable GPU" in err and "Running on the CPU" in err and "loading" in err and out == ""
    Generator.builder().model_path(tiny_dir).quiet().build()
    assert capsys.readouterr() == ("", "")


def _adapter_type() -> str | None:
    try:
        from kjarni.gpu import find_adapter

        return str(find_adapter().info.get("adapter_type"))
    except Exception:  # noqa: BLE001 - no backend or no adapter
        return None


def test_auto_does_not_take_a_software_adapter(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if _adapter_type() != "CPU":
        pytest.skip("needs a machine whose only WebGPU adapter is a software one (llvmpipe)")
    g = Generator.builder().model_path(tiny_dir).build()
    assert g.device is KjarniDevice.CPU
    assert "software" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_generation_matches_the_cpu_greedy_tokens(tiny: Generator, tiny_dir: Path, wgpu_context: object) -> None:
    g = Generator.builder().model_path(tiny_dir).with_context(wgpu_context).with_load_config(lambda c: c.f32()).quiet().build()
    assert g.device is KjarniDevice.GPU and g.gpu_context is wgpu_context
    greedy = GenerationOverrides(temperature=0.0, max_tokens=12)
    assert [t.token_id for t in g.stream_with_config("the cat", greedy)] == [
        t.token_id for t in tiny.stream_with_config("the cat", greedy)
    ]
    # The default weight format is f16: the same greedy tokens as the CPU's f16 mode (the same
    # f16-rounded weights, float32 sums), with a float32 KV cache like the CPU's.
    f16 = Generator.builder().model_path(tiny_dir).with_context(wgpu_context).with_load_config(lambda c: c.kv_dtype("f32")).quiet().build()
    assert f16.gpu_context is wgpu_context and f16.decoder.model.ops.weight_format == "f16"
    cpu_f16 = build(tiny_dir).with_load_config(lambda c: c.cpu_f16()).build()
    assert [t.token_id for t in f16.stream_with_config("the cat", greedy)] == [
        t.token_id for t in cpu_f16.stream_with_config("the cat", greedy)
    ]


@pytest.mark.gpu
def test_gpu_builds_its_own_context(tiny_dir: Path) -> None:
    if _adapter_type() is None:
        pytest.skip("no WebGPU adapter here")
    g = Generator.builder().model_path(tiny_dir).gpu().quiet().build()
    assert g.device is KjarniDevice.GPU and g.decoder.model.ops.context is g.gpu_context
    assert type(g.gpu_context).__name__ == "WgpuContext"


@pytest.mark.gpu
def test_gpu_q8_0_load_config_reaches_the_backend_and_generates_the_cpus_tokens(tmp_path: Path, wgpu_context: object) -> None:
    """Weights that are already Q8_0 values (quantize, dequantize) lose nothing when the GPU
    quantizes them again, so its greedy tokens are the CPU's float32 ones."""
    import gguf

    q8 = gguf.GGMLQuantizationType.Q8_0
    folder = make_tiny_model(tmp_path / "q8", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16)  # every matrix 32-column blocks wide
    config = json.loads((folder / "config.json").read_text())
    tensors = {n: gguf.quants.dequantize(gguf.quants.quantize(t, q8), q8) if t.ndim == 2 else t
               for n, t in random_state_dict(config, seed=3).items()}
    save_safetensors_model(folder, config, tensors)
    g = (Generator.builder().model_path(folder).with_context(wgpu_context).quiet()
         .with_load_config(lambda c: c.q8_0().kv_dtype("f32")).build())
    assert g.decoder.model.ops.weight_format == "q8_0"
    assert g.decoder.model.blocks[0].qkv.formats == ["Q8_0"] and g.decoder.model.blocks[1].down_proj.formats == ["Q8_0"]
    greedy = GenerationOverrides(max_tokens=12, temperature=0.0)
    assert [t.token_id for t in g.stream_with_config("hello", greedy)] == [
        t.token_id for t in build(folder).build().stream_with_config("hello", greedy)
    ]


def test_warnings_for_gpu_settings_on_the_cpu_unless_allowed(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loud = Generator.builder().model_path(tiny_dir).cpu()  # quiet() silences warnings too
    loud.with_load_config(lambda c: c.f32()).build()
    assert "warning" in capsys.readouterr().err
    loud.with_load_config(lambda c: c.f32()).allow_warnings().build()
    assert "warning" not in capsys.readouterr().err
    build(tiny_dir).with_load_config(lambda c: c.f32()).build()
    assert capsys.readouterr().err == ""


def test_registry_functions() -> None:
    models = kg.available_models()
    assert "smollm2-135m-instruct" in models and {"llama-3.2-1b-instruct", "gpt2", "phi-3.5-mini-instruct"} <= set(models)
    assert kg.suggested_models()[0] == "smollm2-135m-instruct"
    assert set(kg.suggested_models()) <= set(models)
    assert kg.is_generator_model("SmolLM2-135M-Instruct") is None
    with pytest.raises(UnknownModelError):
        kg.is_generator_model("bert-base-uncased")
    assert kg.is_generator_model("llama-3.2-1b-instruct") is None  # llama3 RoPE scaling is implemented


def test_is_generator_model_reads_local_configs(tiny_dir: Path, tmp_path: Path) -> None:
    assert kg.is_generator_model(str(tiny_dir)) is None
    encoder = tmp_path / "bert"
    encoder.mkdir()
    (encoder / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(InvalidModelError, match="not a decoder"):
        kg.is_generator_model(encoder)


def test_module_generate_uses_the_named_model(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builder_module, "_gpu_ops", _raise_no_gpu)
    expected = build(tiny_dir).build().generate("the cat", temperature=0.0, max_tokens=8)
    assert kg.generate(str(tiny_dir), "the cat", temperature=0.0, max_tokens=8) == expected
    kept = kg._generator_for(str(tiny_dir))
    assert kept.model_name == tiny_dir.name and kg._generator_for(str(tiny_dir)) is kept  # kept for the next call
    assert asyncio.run(kg.agenerate(str(tiny_dir), "the cat", temperature=0.0, max_tokens=8)) == expected


def _raise_no_gpu(load_config: LoadConfig, context: object) -> None:
    raise GpuUnavailableError("test: no GPU")


# ---------------------------------------------------------------- prompts


def test_prompt_longer_than_the_context_raises_context_overflow_naming_both(tiny: Generator) -> None:
    prompt = "x" * 300  # one token per byte: 300 tokens for a context of 256
    with pytest.raises(ContextOverflowError, match=r"300 tokens.*256") as info:
        tiny.generate(prompt)
    assert (info.value.tokens, info.value.context) == (300, 256)
    with pytest.raises(ContextOverflowError):
        tiny.stream("x" * 256)  # equal does not fit: no room for one generated token
    tiny.generate_with_config("x" * 255, GenerationOverrides(max_tokens=5, temperature=0))  # fits: room for one token
    assert (tiny.last_stats.prompt_tokens, tiny.last_stats.generated_tokens) == (255, 1)
    assert tiny.last_stats.finish_reason in ("context", "eos")


def test_generation_stops_at_the_context_limit(tiny: Generator) -> None:
    stream = tiny.stream_with_config("x" * 250, GenerationOverrides(max_tokens=100, temperature=0, seed=0))
    tokens = list(stream)
    assert len(tokens) <= 6
    assert tokens[-1].finish_reason in ("context", "eos")


def test_empty_prompt_starts_from_bos(tiny: Generator) -> None:
    settings = GenerationOverrides(max_tokens=3, seed=1)
    text = tiny.generate_with_config("", settings)
    assert tiny.last_stats.prompt_tokens == 1
    assert tiny.tokenizer.encode("<|im_start|>") == [tiny.tokenizer.bos_token_id]
    assert text == tiny.generate_with_config("<|im_start|>", settings)  # the prompt that is BOS alone


def test_empty_prompt_without_bos_is_an_error(tmp_path: Path) -> None:
    g = build(make_tiny_model(tmp_path / "nobos", bos=False)).build()
    with pytest.raises(InvalidConfigurationError, match="empty.*BOS"):
        g.generate("")
    g.generate_with_config("a", GenerationOverrides(max_tokens=1))  # a non-empty prompt needs no BOS
    assert (g.last_stats.prompt_tokens, g.last_stats.generated_tokens) == (1, 1)


def test_non_str_prompt_is_refused(tiny: Generator) -> None:
    with pytest.raises(InvalidConfigurationError, match="str"):
        tiny.generate(["the"])  # type: ignore[arg-type]


# ---------------------------------------------------------------- generation and streams

SAMPLED = GenerationOverrides(max_tokens=24, temperature=1.0, top_k=0, top_p=1.0, seed=1234)


def test_stream_text_concatenation_equals_generate_for_the_same_seed(tiny: Generator) -> None:
    text = tiny.generate_with_config("the cat", SAMPLED)
    pieces = list(tiny.stream_text_with_config("the cat", SAMPLED))
    tokens = list(tiny.stream_with_config("the cat", SAMPLED))
    assert "".join(pieces) == text
    assert "".join(t.text for t in tokens) == text
    assert all(isinstance(t, GeneratedToken) for t in tokens)
    assert all(piece for piece in pieces)  # no empty pieces in a text stream
    assert tokens[-1].finish_reason in ("eos", "length") and all(t.finish_reason is None for t in tokens[:-1])


def test_seed_reproduces_and_no_seed_draws_fresh_entropy(tiny: Generator) -> None:
    assert tiny.generate_with_config("the", SAMPLED) == tiny.generate_with_config("the", SAMPLED)
    unseeded = GenerationOverrides(max_tokens=24, temperature=1.5, top_k=0, top_p=1.0)
    outputs = {tiny.generate_with_config("the", unseeded) for _ in range(4)}
    assert len(outputs) > 1


def test_greedy_is_deterministic_and_max_tokens_is_respected(tiny: Generator) -> None:
    greedy = GenerationOverrides(temperature=0.0, max_tokens=7)
    tokens = list(tiny.stream_with_config("the cat", greedy))
    assert len(tokens) <= 7
    if len(tokens) == 7:
        assert tokens[-1].finish_reason == "length"
    again = list(tiny.stream_with_config("the cat", greedy))
    assert [t.token_id for t in tokens] == [t.token_id for t in again]


def test_stop_string_ends_the_text_before_it(tiny: Generator) -> None:
    free = GenerationOverrides(temperature=0.0, max_tokens=40, repetition_penalty=1.3)
    text = tiny.generate_with_config("the cat", free)
    assert len(text) > 6, text
    stop = text[3:6]
    cut = text[: text.index(stop)]
    stopped = tiny.generate_with_config("the cat", free.merged(GenerationOverrides(stop=(stop,))))
    assert stopped == cut
    assert stop not in stopped


def test_stream_text_streams_every_byte_of_multibyte_text(tiny: Generator) -> None:
    # Random weights emit bytes >= 0x80 often: the pieces must still join to generate's string.
    settings = GenerationOverrides(max_tokens=60, temperature=2.0, top_k=0, top_p=1.0, seed=7)
    assert "".join(tiny.stream_text_with_config("😀 中文", settings)) == tiny.generate_with_config("😀 中文", settings)


# ---------------------------------------------------------------- one generation at a time


GREEDY_2 = GenerationOverrides(max_tokens=2, temperature=0.0)


@pytest.fixture
def watched(tiny: Generator, monkeypatch: pytest.MonkeyPatch) -> WatchedLock:
    """The tiny Generator's one-generation-at-a-time lock, watched (tests/threads.py)."""
    lock = WatchedLock(tiny._lock)
    monkeypatch.setattr(tiny, "_lock", lock)
    return lock


def test_an_open_stream_holds_the_generator_until_closed(tiny: Generator, watched: WatchedLock) -> None:
    expected = tiny.generate_with_config("the", GREEDY_2)
    stream = tiny.stream_with_config("the", GenerationOverrides(max_tokens=50, temperature=0))
    next(stream)
    other = Worker(lambda: tiny.generate_with_config("the", GREEDY_2))
    assert watched.contended.wait(HANG_GUARD_S)  # the other thread found the Generator taken: it waits
    assert other.is_alive() and watched.acquired == 2  # the call above and the stream: not the waiter
    stream.close()
    assert other.join() == expected
    assert watched.acquired == 3


def test_a_second_stream_in_the_same_thread_is_an_error_not_a_deadlock(tiny: Generator) -> None:
    expected = tiny.generate_with_config("the", GREEDY_2)
    with tiny.stream("the"):
        with pytest.raises(GenerationFailedError, match="close"):
            tiny.generate("the")
    assert tiny.generate_with_config("the", GREEDY_2) == expected


def test_breaking_out_of_a_stream_frees_the_generator_at_once(tiny: Generator) -> None:
    expected = tiny.generate_with_config("the", GREEDY_2)
    for _ in tiny.stream_with_config("the", GenerationOverrides(max_tokens=50)):
        break
    assert not tiny._lock.locked()  # freed when the loop was left, not later
    assert Worker(lambda: tiny.generate_with_config("the", GREEDY_2)).join() == expected


def test_exhausted_and_closed_streams_stay_ended(tiny: Generator) -> None:
    stream = tiny.stream_with_config("the", GenerationOverrides(max_tokens=3))
    list(stream)
    assert list(stream) == []
    stream.close()
    closed = tiny.stream("the")
    closed.close()
    closed.close()
    assert list(closed) == []


def test_two_threads_sharing_one_generator_are_both_served_correctly(tiny: Generator) -> None:
    settings = {seed: GenerationOverrides(max_tokens=16, temperature=1.0, top_k=0, seed=seed) for seed in (1, 2, 3, 4)}
    expected = {seed: tiny.generate_with_config("the cat", s) for seed, s in settings.items()}
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            results[seed] = tiny.generate_with_config("the cat", settings[seed])
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in settings]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    assert results == expected


# ---------------------------------------------------------------- async twins


GREEDY_KEYWORDS = {"temperature": 0.0, "max_tokens": 10}


def test_async_twins_give_the_same_results_as_the_blocking_calls(tiny: Generator, tiny_dir: Path) -> None:
    expected = tiny.generate_with_config("the cat", SAMPLED)
    expected_tokens = [t.token_id for t in tiny.stream_with_config("the cat", SAMPLED)]
    plain_text = tiny.generate("the", **GREEDY_KEYWORDS)
    plain_tokens = [t.token_id for t in tiny.stream("the", **GREEDY_KEYWORDS)]

    async def main() -> None:
        assert await tiny.agenerate_with_config("the cat", SAMPLED) == expected
        pieces = [piece async for piece in tiny.astream_text_with_config("the cat", SAMPLED)]
        assert "".join(pieces) == expected
        stream = await tiny.astream_with_config("the cat", SAMPLED)  # awaiting gives the stream
        assert [t.token_id async for t in stream] == expected_tokens
        # The keyword twins (no GenerationOverrides) take the same settings as keywords.
        assert await tiny.agenerate("the", **GREEDY_KEYWORDS) == plain_text
        assert "".join([p async for p in tiny.astream_text("the", **GREEDY_KEYWORDS)]) == plain_text
        assert [t.token_id async for t in tiny.astream("the", **GREEDY_KEYWORDS)] == plain_tokens
        built = await Generator.builder().model_path(tiny_dir).cpu().quiet().abuild()
        assert built.vocab_size == TINY_VOCAB

    asyncio.run(main())


def test_anew_builds_with_default_settings(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builder_module, "_gpu_ops", _raise_no_gpu)
    g = asyncio.run(Generator.anew(str(tiny_dir)))
    assert g.device is KjarniDevice.CPU


def test_async_errors_are_raised_before_any_work(tiny: Generator) -> None:
    async def main() -> None:
        with pytest.raises(ContextOverflowError):
            await tiny.agenerate("x" * 300)
        with pytest.raises(InvalidConfigurationError):
            tiny.astream_with_config("the", GenerationOverrides(top_k=-2))

    asyncio.run(main())


def test_concurrent_async_generations_share_one_generator(tiny: Generator) -> None:
    settings = [GenerationOverrides(max_tokens=12, temperature=1.0, top_k=0, seed=s) for s in range(3)]
    expected = [tiny.generate_with_config("the", s) for s in settings]

    async def main() -> list[str]:
        return list(await asyncio.gather(*(tiny.agenerate_with_config("the", s) for s in settings)))

    assert asyncio.run(main()) == expected


GREEDY_LONG = GenerationOverrides(max_tokens=150, temperature=0.0)


@pytest.fixture
def gated(tiny_dir: Path) -> tuple[Generator, list[GeneratedToken], Gate]:
    """A fresh tiny Generator, its uncancelled greedy tokens for "the" (150), and a Gate that
    holds its 5th forward until the test lets it go (tests/threads.py)."""
    g = build(tiny_dir).build()
    tokens = list(g.stream_with_config("the", GREEDY_LONG))
    assert len(tokens) == 150  # uncancelled it runs to max_tokens
    return g, tokens, Gate(g, at=5)


def test_cancelling_an_async_generation_stops_the_worker_and_frees_the_generator(gated) -> None:
    g, _, gate = gated

    async def main() -> None:
        async def consume() -> None:
            async for _ in g.astream_with_config("the", GREEDY_LONG):
                pass

        task = asyncio.create_task(consume())
        assert await asyncio.to_thread(gate.reached.wait, HANG_GUARD_S)  # the worker is inside forward 5
        task.cancel()  # lands in the consumer's wait for the next token
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.go.set()
        await asyncio.to_thread(join_async_workers)
        assert gate.calls == 5  # the step in flight finished; not one forward more
        assert not g._lock.locked()
        assert await g.agenerate_with_config("the", GREEDY_2) == g.generate_with_config("the", GREEDY_2)

    asyncio.run(main())
    join_async_workers()


def test_cancelling_agenerate_stops_it_at_the_next_piece_of_text(gated, monkeypatch: pytest.MonkeyPatch) -> None:
    g, tokens, gate = gated
    streams = []  # the stream agenerate reads, to see its worker told to stop
    astream_text = g.astream_text_with_config
    monkeypatch.setattr(g, "astream_text_with_config", lambda *a, **k: streams.append(astream_text(*a, **k)) or streams[-1])

    async def main() -> None:
        task = asyncio.create_task(g.agenerate_with_config("the", GREEDY_LONG))
        assert await asyncio.to_thread(gate.reached.wait, HANG_GUARD_S)
        task.cancel()
        # agenerate waits for its worker before it ends: let forward 5 finish once the cancel has
        # reached the worker (the task sets its stop event while this thread waits).
        assert await asyncio.to_thread(streams[0]._worker.stop.wait, HANG_GUARD_S)
        gate.go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.to_thread(join_async_workers)
        assert not g._lock.locked()

    asyncio.run(main())
    # Forward 5 gives token 4; a text stream hands over only non-empty pieces, so the worker
    # stops after the first token from there on that has text (random weights make some empty).
    last = next(i for i in range(4, len(tokens)) if tokens[i].text)
    assert gate.calls == last + 1 < len(tokens)


def test_aclose_and_break_free_the_generator(tiny: Generator) -> None:
    async def main() -> None:
        stream = tiny.astream_with_config("the", GenerationOverrides(max_tokens=200))
        await stream.__anext__()
        await asyncio.wait_for(stream.aclose(), 5)
        assert not tiny._lock.locked()  # aclose waits until the worker let go
        async with tiny.astream_with_config("the", GenerationOverrides(max_tokens=200)) as s:
            async for _ in s:
                break
        assert not tiny._lock.locked()
        await asyncio.wait_for(tiny.agenerate_with_config("the", GenerationOverrides(max_tokens=2)), 10)

    asyncio.run(main())


def test_a_task_waiting_its_turn_can_be_cancelled(tiny: Generator, watched: WatchedLock) -> None:
    expected = tiny.generate_with_config("the", GREEDY_2)

    async def main() -> None:
        holder = tiny.stream_with_config("the", GenerationOverrides(max_tokens=5))  # this thread holds it
        waiter = asyncio.create_task(tiny.agenerate_with_config("the", GREEDY_2))
        assert await asyncio.to_thread(watched.contended.wait, HANG_GUARD_S)  # its worker waits its turn
        assert not waiter.done()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiter, HANG_GUARD_S)
        await asyncio.to_thread(join_async_workers)
        assert watched.acquired == 2  # the call for `expected` and the holder: the waiter never got it
        holder.close()
        assert await tiny.agenerate_with_config("the", GREEDY_2) == expected

    asyncio.run(main())


# ---------------------------------------------------------------- output streams


def test_generation_prints_nothing_on_stdout(tiny_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    g = Generator.builder().model_path(tiny_dir).cpu().build()
    g.generate_with_config("the", GenerationOverrides(max_tokens=3))
    out, err = capfd.readouterr()
    assert out == "" and "loading" in err


def test_quiet_silences_everything(tiny_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    g = Generator.builder().model_path(tiny_dir).cpu().quiet().build()
    g.generate_with_config("the", GenerationOverrides(max_tokens=3))
    assert capfd.readouterr() == ("", "")


def test_sources_resolve_is_used_for_registry_names(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_resolve(name, *, cache_dir=None, policy=DownloadPolicy.IF_MISSING, quiet=False, prefer="gguf"):  # noqa: ANN001
        seen.update(name=name, cache_dir=cache_dir, policy=policy, quiet=quiet)
        return sources.ModelSource("smollm2-135m-instruct", tiny_dir, None)

    monkeypatch.setattr(sources, "resolve", fake_resolve)
    g = GeneratorBuilder().cache_dir("/tmp/c").offline().cpu().quiet().build()
    assert seen == {"name": "smollm2-135m-instruct", "cache_dir": Path("/tmp/c"), "policy": DownloadPolicy.NEVER, "quiet": True}
    assert g.model_name == "smollm2-135m-instruct"
