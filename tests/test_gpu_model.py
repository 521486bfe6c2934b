"""Tiny random Llama and Qwen2 models on the GPU against the numpy reference.

With f32 weights the GPU must give the same logits (1e-3) and the same greedy tokens; prefill
in one forward must equal feeding the tokens one by one; a decode step must be one submit of a
small, fixed number of dispatches that allocates nothing once warm.
"""

from __future__ import annotations

import numpy as np
import pytest

from kjarni.model_config import ModelConfig
from kjarni.model import DecoderModel
from kjarni.numpy_ops import NumpyOps
from kjarni.weights import QuantTensor, load_weights
from tests.tiny_models import quant_config, random_state_dict, save_gguf_model, save_safetensors_model, tiny_config

pytestmark = pytest.mark.gpu

PROMPT = [5, 17, 3, 88, 42, 9, 61, 2, 30, 77, 14]


def _pair(tmp_path, ops, model_type="llama", seed=11, **overrides):
    """(numpy model, GPU model) on the same tiny random weights."""
    config = tiny_config(model_type, **overrides)
    save_safetensors_model(tmp_path, config, random_state_dict(config, seed=seed))
    cfg = ModelConfig.from_json(tmp_path / "config.json")
    weights = load_weights(tmp_path)
    return DecoderModel(cfg, weights, NumpyOps()), DecoderModel(cfg, weights, ops)


def _greedy(model, prompt, steps, capacity=64):
    cache = model.new_cache(capacity)
    token = int(model.ops.argmax(model.forward(prompt, cache))[0])
    tokens = [token]
    for _ in range(steps - 1):
        token = int(model.ops.argmax(model.forward([token], cache))[0])
        tokens.append(token)
    return tokens


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_gpu_logits_match_numpy_with_f32_weights(tmp_path, gpu_ops, model_type):
    cpu, gpu = _pair(tmp_path, gpu_ops, model_type)
    cpu_cache, gpu_cache = cpu.new_cache(64), gpu.new_cache(64)
    expected = cpu.ops.read(cpu.forward(PROMPT, cpu_cache, logits="all"))
    got = gpu.ops.read(gpu.forward(PROMPT, gpu_cache, logits="all"))
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=1e-3)
    for token in (7, 50, 96):  # decode steps use the matvec and split-attention kernels
        expected = cpu.ops.read(cpu.forward([token], cpu_cache))
        got = gpu.ops.read(gpu.forward([token], gpu_cache))
        np.testing.assert_allclose(got, expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_greedy_tokens_are_identical_for_32_steps(tmp_path, gpu_ops, model_type):
    cpu, gpu = _pair(tmp_path, gpu_ops, model_type, seed=5)
    assert _greedy(gpu, PROMPT, 32) == _greedy(cpu, PROMPT, 32)


def test_prefill_at_once_equals_step_by_step_on_the_gpu(tmp_path, gpu_ops):
    _, gpu = _pair(tmp_path, gpu_ops, "qwen2")
    at_once = gpu.ops.read(gpu.forward(PROMPT, gpu.new_cache(32), logits="all"))
    cache = gpu.new_cache(32)
    one_by_one = np.concatenate([gpu.ops.read(gpu.forward([t], cache)) for t in PROMPT])
    np.testing.assert_allclose(one_by_one, at_once, atol=1e-4, rtol=1e-4)


def test_forwards_recorded_without_a_read_in_between_stay_correct(tmp_path, gpu_ops):
    # The second forward rewrites the per-step uniform and ids; the first must still see its own.
    cpu, gpu = _pair(tmp_path, gpu_ops, "llama")
    cpu_cache, gpu_cache = cpu.new_cache(32), gpu.new_cache(32)
    first = gpu.forward(PROMPT, gpu_cache)
    second = gpu.forward([3], gpu_cache)
    np.testing.assert_allclose(gpu.ops.read(first), cpu.ops.read(cpu.forward(PROMPT, cpu_cache)), atol=1e-3)
    np.testing.assert_allclose(gpu.ops.read(second), cpu.ops.read(cpu.forward([3], cpu_cache)), atol=1e-3)


def test_a_decode_step_is_one_submit_of_few_dispatches_and_allocates_nothing(tmp_path, gpu_ops):
    _, gpu = _pair(tmp_path, gpu_ops, "qwen2", num_hidden_layers=3)
    stats = gpu_ops.stats
    cache = gpu.new_cache(64)
    token = int(gpu_ops.argmax(gpu.forward(PROMPT, cache))[0])
    for _ in range(3):  # warm up: pipelines, pooled buffers, bind groups
        token = int(gpu_ops.argmax(gpu.forward([token], cache))[0])
    before = (stats.submits, stats.pooled_buffers, stats.bind_groups, stats.pipelines, len(gpu_ops.context._uniforms))
    for _ in range(5):
        token = int(gpu_ops.argmax(gpu.forward([token], cache))[0])
    after = (stats.submits, stats.pooled_buffers, stats.bind_groups, stats.pipelines, len(gpu_ops.context._uniforms))
    assert after[0] - before[0] == 5, "one submit per decode step"
    assert after[1:] == before[1:], "a warm decode step creates no buffers, bind groups, pipelines or uniforms"
    # embed + 5 per layer (norm+qkv, rope_store+attention, o_proj+residual, norm+gate_up,
    # silu_mul+down+residual) + final norm with LM head + argmax x2
    assert stats.last_dispatches == 1 + 5 * 3 + 1 + 2


def _generate(model, prompt, count, **kwargs):
    """The first ``count`` greedy tokens of generate_step, and the cache it used."""
    from kjarni.decode import generate_step
    from kjarni.sampler import make_sampler

    cache = model.new_cache(64)
    steps = generate_step(model, prompt, make_sampler(0.0), np.random.default_rng(0), cache, **kwargs)
    tokens = [token for token, _ in (next(steps) for _ in range(count))]
    steps.close()
    return tokens, cache


def test_greedy_decode_running_ahead_gives_the_step_by_step_tokens(tmp_path, gpu_ops):
    cpu, gpu = _pair(tmp_path, gpu_ops, "qwen2", seed=5)
    assert gpu_ops.decode_ahead > 1
    ahead, gpu_cache = _generate(gpu, PROMPT, 32)
    expected, cpu_cache = _generate(cpu, PROMPT, 32)
    assert ahead == expected == _greedy(gpu, PROMPT, 32)
    # Closed after its 32nd token, the cache holds what the step-by-step loop fed: all but that one.
    assert gpu_cache.offset == cpu_cache.offset == len(PROMPT) + 31


def test_greedy_decode_running_ahead_reads_back_once_per_burst(tmp_path, gpu_ops, monkeypatch):
    _, gpu = _pair(tmp_path, gpu_ops, "llama", num_hidden_layers=2)
    reads = []
    read_later = gpu_ops.read_tokens_later
    monkeypatch.setattr(gpu_ops, "read_tokens_later", lambda handles: reads.append(len(handles)) or read_later(handles))
    bursts = [1]
    while bursts[-1] < gpu_ops.decode_ahead:
        bursts.append(min(2 * bursts[-1], gpu_ops.decode_ahead))
    bursts.append(gpu_ops.decode_ahead)  # [1, 2, 4, 8, 8] at the default of 8
    _generate(gpu, PROMPT, sum(bursts))
    assert reads == bursts, "bursts grow from one token (the prefill's) to decode_ahead"


def test_the_next_burst_is_submitted_before_a_burst_is_read_back(tmp_path, gpu_ops, monkeypatch):
    """While burst n's ids come back, burst n + 1 is already recorded (and submitted), so the GPU
    never waits for the readback; the tokens are the step-by-step loop's."""
    cpu, gpu = _pair(tmp_path, gpu_ops, "qwen2", seed=5)
    forwards, log = [0], []
    forward, read_later = gpu.forward, gpu_ops.read_tokens_later
    monkeypatch.setattr(gpu, "forward", lambda ids, cache, **kw: forwards.__setitem__(0, forwards[0] + 1) or forward(ids, cache, **kw))

    def start(handles):
        wait, started = read_later(handles), forwards[0]
        return lambda: log.append((len(handles), started, forwards[0])) or wait()

    monkeypatch.setattr(gpu_ops, "read_tokens_later", start)
    monkeypatch.setattr(gpu_ops.tuning, "decode_ahead", 4)
    tokens, _ = _generate(gpu, PROMPT, 1 + 2 + 4 + 4)
    assert tokens == _generate(cpu, PROMPT, 11)[0]
    # (burst, forwards when its read started, when it was waited for): the prompt's forward, then
    # each wait comes after the next burst's forwards (2, 4, 4 steps; the last burst's next one too).
    assert log == [(1, 1, 3), (2, 3, 7), (4, 7, 11), (4, 11, 15)]


def test_a_read_started_early_gives_its_bytes_once_and_its_staging_buffer_back(wgpu_context):
    ctx = wgpu_context
    src = ctx.scratch(256)
    ctx.queue.write_buffer(src.buffer, 0, np.arange(64, dtype=np.uint32))
    first = ctx.read_later(src.buffer, 16, 40)
    second = ctx.read_later(src.buffer, 0, 8)  # both in flight: a staging buffer each
    made = len(ctx._created)
    assert np.frombuffer(second(), np.uint32).tolist() == [0, 1]
    assert np.frombuffer(first(), np.uint32).tolist() == list(range(4, 14))
    assert first() == first()  # the bytes again, not a second wait
    third = ctx.read_later(src.buffer, 252, 4)
    assert len(ctx._created) == made, "a staging buffer from the pool, none made"
    assert np.frombuffer(third(), np.uint32).tolist() == [63]


def test_greedy_decode_running_ahead_stops_at_max_tokens_and_the_cache_end(tmp_path, gpu_ops, monkeypatch):
    _, gpu = _pair(tmp_path, gpu_ops, "llama", num_hidden_layers=2)
    forwards = []
    forward = gpu.forward
    monkeypatch.setattr(gpu, "forward", lambda ids, cache, **kw: forwards.append(len(ids)) or forward(ids, cache, **kw))
    tokens, cache = _generate(gpu, PROMPT, 5, max_tokens=5)
    assert len(forwards) == 1 + 4, "the prompt, then one step per token fed: none past max_tokens"
    assert cache.offset == len(PROMPT) + 4

    # A consumer going on past max_tokens still gets tokens, then the cache end raises as usual.
    from kjarni.errors import ContextOverflowError
    from kjarni.decode import generate_step
    from kjarni.sampler import make_sampler

    cache = gpu.new_cache(len(PROMPT) + 3)
    steps = generate_step(gpu, PROMPT, make_sampler(0.0), np.random.default_rng(0), cache, max_tokens=2)
    assert len([next(steps) for _ in range(4)]) == 4  # 4 tokens: the prefill's and 3 fed back
    with pytest.raises(ContextOverflowError):
        next(steps)


def test_f16_weights_and_kv_cache_stay_close_to_numpy(tmp_path, wgpu_context):
    from kjarni.gpu import WgpuOps

    cpu, gpu = _pair(tmp_path, WgpuOps(wgpu_context), "qwen2")  # the defaults: f16 weights, f16 KV
    expected = cpu.ops.read(cpu.forward(PROMPT, cpu.new_cache(32), logits="all"))
    got = gpu.ops.read(gpu.forward(PROMPT, gpu.new_cache(32), logits="all"))
    assert np.abs(got - expected).max() < 0.05 * np.abs(expected).max()
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.9


def test_decode_with_f16_weights_matches_numpy_on_the_same_values(tmp_path, wgpu_context):
    """f16 weights (numpy on the same values in float32), float32 KV: the decode steps run
    matvec_f16, gate_up writing silu(gate) up itself (`Linear.glu_fusable`), and match numpy as
    float32 weights do."""
    from kjarni.gpu import WgpuOps

    if not wgpu_context.has_subgroups:
        pytest.skip("matvec_f16.tmpl.wgsl needs subgroups")
    config = tiny_config("qwen2")
    rounded = {n: t.astype(np.float16).astype(np.float32) for n, t in random_state_dict(config, seed=13).items()}
    save_safetensors_model(tmp_path, config, rounded)
    cfg = ModelConfig.from_json(tmp_path / "config.json")
    ops = WgpuOps(wgpu_context, weight_format="f16", kv_format="f32")
    cpu, gpu = DecoderModel(cfg, load_weights(tmp_path), NumpyOps()), DecoderModel(cfg, load_weights(tmp_path), ops)
    block = gpu.blocks[0]
    assert block.gate_up.formats == ["f16"]
    assert ops.linear_kernels.glu_fusable(1, cfg.hidden_size, block.gate_up, block.down_proj)
    cpu_cache, gpu_cache = cpu.new_cache(64), gpu.new_cache(64)
    np.testing.assert_allclose(gpu.ops.read(gpu.forward(PROMPT, gpu_cache, logits="all")),
                               cpu.ops.read(cpu.forward(PROMPT, cpu_cache, logits="all")), atol=1e-3, rtol=1e-3)
    for token in (7, 50, 96):
        np.testing.assert_allclose(gpu.ops.read(gpu.forward([token], gpu_cache)), cpu.ops.read(cpu.forward([token], cpu_cache)),
                                   atol=1e-3, rtol=1e-3)


def test_tied_embeddings_split_across_bindings(tmp_path):
    from kjarni.errors import GpuUnavailableError
    from kjarni.gpu import WgpuContext, WgpuOps

    try:
        ops = WgpuOps(WgpuContext(max_binding_size=8192), weight_format="f32")
    except GpuUnavailableError as exc:
        pytest.skip(str(exc))
    cpu, gpu = _pair(tmp_path, ops, "llama", tie_word_embeddings=True)
    assert len(gpu.embed_tokens.segments) > 1 and gpu.lm_head is gpu.embed_tokens
    expected = cpu.ops.read(cpu.forward(PROMPT, cpu.new_cache(32), logits="all"))
    got = gpu.ops.read(gpu.forward(PROMPT, gpu.new_cache(32), logits="all"))
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=1e-3)


def test_two_models_share_one_context(tmp_path, wgpu_context):
    from kjarni.gpu import WgpuOps

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cpu_a, gpu_a = _pair(tmp_path / "a", WgpuOps(wgpu_context, weight_format="f32"), "llama", seed=1)
    cpu_b, gpu_b = _pair(tmp_path / "b", WgpuOps(wgpu_context, weight_format="f32"), "qwen2", seed=2)
    caches = {m: m.new_cache(32) for m in (cpu_a, gpu_a, cpu_b, gpu_b)}
    for tokens in (PROMPT, [4], [9]):
        out = {m: m.ops.read(m.forward(tokens, caches[m])) for m in (gpu_a, gpu_b, cpu_a, cpu_b)}
        np.testing.assert_allclose(out[gpu_a], out[cpu_a], atol=1e-3)
        np.testing.assert_allclose(out[gpu_b], out[cpu_b], atol=1e-3)


def test_q8_0_gguf_weights_stay_quantized_and_match_numpy(tmp_path, gpu_ops):
    config = quant_config("llama")
    path = save_gguf_model(tmp_path / "m.gguf", config, random_state_dict(config, seed=3), quant="Q8_0")
    weights = load_weights(path)
    cfg = ModelConfig.from_dict(config)
    # The numpy reference rounds the products' inputs to int8 where the GPU's integer dot does
    # (the prompt's products too with GpuTuning.matmul_int_dot).
    tuning = gpu_ops.tuning
    ref = NumpyOps(quantize_activations=tuning.matvec_int_dot,
                   quantized_prefill_min_tokens=tuning.matvec_max_tokens + 1 if tuning.matmul_int_dot else 0)
    cpu, gpu = DecoderModel(cfg, weights, ref), DecoderModel(cfg, weights, gpu_ops)
    assert gpu.blocks[0].qkv.formats == ["Q8_0"]
    expected = cpu.ops.read(cpu.forward(PROMPT, cpu.new_cache(32), logits="all"))
    got = gpu.ops.read(gpu.forward(PROMPT, gpu.new_cache(32), logits="all"))
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=1e-3)


def test_q8_0_weight_format_quantizes_float_weights_at_load(tmp_path, wgpu_context):
    import gguf

    config = quant_config("qwen2")
    tensors = random_state_dict(config, seed=5)
    save_safetensors_model(tmp_path / "f32", config, tensors)
    q8 = gguf.GGMLQuantizationType.Q8_0
    # The numpy reference runs on the same Q8_0 values the GPU keeps (32-wide matrices only).
    rounded = {n: gguf.quants.dequantize(gguf.quants.quantize(t, q8), q8) if t.ndim == 2 and t.shape[1] % 32 == 0 else t
               for n, t in tensors.items()}
    save_safetensors_model(tmp_path / "rounded", config, rounded)
    cfg = ModelConfig.from_dict(config)
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format="q8_0", kv_format="f32")
    ops.tuning.matmul_int_dot = False  # the prompt's products in float32, as the reference's
    gpu = DecoderModel(cfg, load_weights(tmp_path / "f32"), ops)
    cpu = DecoderModel(cfg, load_weights(tmp_path / "rounded"), NumpyOps())
    assert gpu.blocks[0].qkv.formats == ["Q8_0"] and gpu.blocks[0].down_proj.formats == ["Q8_0"]
    f16 = DecoderModel(cfg, load_weights(tmp_path / "f32"), WgpuOps(wgpu_context, weight_format="f16"))
    assert gpu.ops.weight_bytes < 0.6 * f16.ops.weight_bytes
    expected = cpu.ops.read(cpu.forward(PROMPT, cpu.new_cache(32), logits="all"))
    got = gpu.ops.read(gpu.forward(PROMPT, gpu.new_cache(32), logits="all"))
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=1e-3)


def test_quant_types_without_a_kernel_are_converted_at_load_with_a_notice(wgpu_context, capsys):
    import gguf

    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format="f32")
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (4, 84), dtype=np.uint8)  # one Q2_K block of 256 per row
    data[:, 80:84] = np.full((4, 2), 0.01, np.float16).view(np.uint8)  # sane d and dmin
    qt = QuantTensor(gguf.GGMLQuantizationType.Q2_K, (4, 256), data)
    weight = ops.weight(qt, name="w")
    assert weight.formats == ["f32"]
    assert "Q2_K" in capsys.readouterr().err
    x = rng.standard_normal((1, 256)).astype(np.float32)
    from tests.test_gpu_kernels import upload

    np.testing.assert_allclose(ops.read(ops.linear(upload(ops, x), weight)), x @ qt.dequantize().T, atol=1e-4, rtol=1e-4)


def test_memory_estimate_matches_what_the_gpu_holds(tmp_path, wgpu_context):
    from kjarni.gpu import WgpuOps
    from kjarni.gpu.memory import estimate

    config = quant_config("qwen2")
    save_safetensors_model(tmp_path, config, random_state_dict(config, seed=2))
    cfg, weights = ModelConfig.from_json(tmp_path / "config.json"), load_weights(tmp_path)
    for fmt in ("f16", "f32", "q8_0"):
        ops = WgpuOps(wgpu_context, weight_format=fmt, kv_format="f16")
        model = DecoderModel(cfg, weights, ops)
        found = estimate(weights, cfg, weight_format=fmt, kv_format="f16", context=32)
        rope_bytes = model.context_size * cfg.head_dim * 4  # the RoPE table, not a weight of the file
        assert abs(found.weight_bytes + rope_bytes - ops.weight_bytes) <= 0.05 * ops.weight_bytes, fmt
        assert found.kv_cache_bytes == model.new_cache(32).nbytes


def test_a_model_over_the_gpu_memory_budget_is_refused_before_upload(tmp_path, wgpu_context, monkeypatch):
    from kjarni.errors import GpuUnavailableError
    from kjarni.generator import Generator
    from tests.test_api import make_tiny_model

    folder = make_tiny_model(tmp_path / "tiny")
    monkeypatch.setenv("KJARNI_GPU_MEMORY_MB", "0.01")
    with pytest.raises(GpuUnavailableError, match=r"needs about .* GiB .* budget of 0\.00 GiB"):
        Generator.builder().model_path(folder).gpu().quiet().build()


def test_a_kv_cache_gone_leaves_the_device_when_the_next_one_is_made(tmp_path, wgpu_context):
    # Every generation makes a KV cache; the bind groups made for its buffers would keep them on the
    # device after the cache is gone (a generation's cache for good), unless they are collected.
    import gc

    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format="f32")
    _, gpu = _pair(tmp_path, ops)
    made, real = [], ops.new_kv_cache

    def new_kv_cache(*args):
        cache = real(*args)
        made.append([*cache.keys, *cache.values])
        return cache

    ops.new_kv_cache = new_kv_cache
    gc.collect()
    wgpu_context.collect()  # the session context: what earlier tests left goes first
    freed = wgpu_context.stats.freed_bytes
    for _ in range(4):
        _greedy(gpu, PROMPT, 4, capacity=32)  # makes a cache, drops it
        gc.collect()
    held = {id(b) for key in wgpu_context._bind_groups for b in key[1:]}
    assert not any(id(b) in held for buffers in made[:3] for b in buffers)  # freed with their bind groups
    assert any(id(b) in held for b in made[3])  # the last one waits for the next cache (or close)
    cache_bytes = sum(int(b.size) for b in made[0])
    assert wgpu_context.stats.freed_bytes - freed == 3 * cache_bytes
    live = gpu.new_cache(32)  # frees the fourth; closing frees this one, once
    freed = wgpu_context.stats.freed_bytes
    closed = ops.close()
    del live
    gc.collect()
    assert wgpu_context.collect() == 0 and wgpu_context.stats.freed_bytes - freed == closed
    assert closed >= cache_bytes
