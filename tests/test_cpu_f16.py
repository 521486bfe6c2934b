"""The lower-memory CPU mode: weight matrices stored as float16, products computed in float32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kjarni import cli, numpy_ops
from kjarni.errors import InvalidConfigurationError
from kjarni.generator import Generator
from kjarni.loader import load_model
from kjarni.numpy_ops import NumpyOps
from tests.test_api import write_tiny_tokenizer
from tests.tiny_models import random_state_dict, save_safetensors_model, tiny_config


@pytest.fixture(scope="module")
def f16_exact_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose weights are already f16 values, so storing them as f16 loses nothing."""
    from tests.test_api import TINY_VOCAB

    config = tiny_config("qwen2", vocab_size=TINY_VOCAB)
    tensors = {n: t.astype(np.float16).astype(np.float32) for n, t in random_state_dict(config, seed=11).items()}
    folder = tmp_path_factory.mktemp("tiny-f16")
    save_safetensors_model(folder, config, tensors)
    write_tiny_tokenizer(folder)
    return folder


def _matrices(model) -> list[np.ndarray]:  # noqa: ANN001
    arrays = [model.embed_tokens, model.lm_head]
    for block in model.blocks:
        arrays += [block.qkv, block.o_proj, block.gate_up, block.down_proj]
    return arrays


def test_f16_mode_halves_the_weight_matrices_and_keeps_the_rest_float32(f16_exact_dir: Path) -> None:
    reference = load_model(f16_exact_dir, ops=NumpyOps()).model
    low = load_model(f16_exact_dir, ops=NumpyOps(weight_format="f16")).model
    assert all(w.dtype == np.float16 for w in _matrices(low))
    assert sum(w.nbytes for w in _matrices(low)) * 2 == sum(w.nbytes for w in _matrices(reference))
    assert low.norm.dtype == np.float32 and low.rope.dtype == np.float32
    assert low.blocks[0].qkv_bias.dtype == np.float32 and low.blocks[0].input_norm.dtype == np.float32


def test_f16_mode_computes_what_float32_computes_on_the_same_weights(f16_exact_dir: Path) -> None:
    reference = load_model(f16_exact_dir, ops=NumpyOps()).model
    low = load_model(f16_exact_dir, ops=NumpyOps(weight_format="f16")).model
    prompt = np.arange(3, 40, dtype=np.int32)
    ref_cache, low_cache = reference.new_cache(48), low.new_cache(48)
    expected = reference.forward(prompt, ref_cache, logits="all")
    got = low.forward(prompt, low_cache, logits="all")
    # Same float32 values multiplied; only the tiles' summation order may differ.
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))
    for _ in range(6):  # decode steps (one row) too, with the same greedy tokens
        token = int(np.argmax(expected[-1]))
        assert token == int(np.argmax(got[-1]))
        expected, got = reference.forward([token], ref_cache), low.forward([token], low_cache)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))


@pytest.mark.parametrize("tokens", [1, 3, 70])
def test_the_tiled_f16_product_equals_the_float32_product(monkeypatch: pytest.MonkeyPatch, tokens: int) -> None:
    monkeypatch.setattr(numpy_ops, "F16_TILE_ELEMENTS", 7 * 45)  # 7 rows a tile: 103 rows = 14 tiles + 5
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((103, 45)).astype(np.float16)
    x = rng.standard_normal((tokens, 45)).astype(np.float32)
    bias = rng.standard_normal(103).astype(np.float32)
    residual = rng.standard_normal((tokens, 103)).astype(np.float32)
    ops = NumpyOps(weight_format="f16")
    got = ops.linear(x, weight, bias, residual)
    expected = x @ weight.astype(np.float32).T + bias + residual
    assert got.shape == expected.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_f16_mode_is_chosen_from_the_builder_and_the_cli(f16_exact_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    low = Generator.builder().model_path(f16_exact_dir).cpu().with_load_config(lambda c: c.cpu_f16()).quiet().build()
    assert low.decoder.model.ops.weight_format == "f16" and low.load_config.cpu_weight_format == "f16"
    reference = Generator.builder().model_path(f16_exact_dir).cpu().quiet().build()
    assert reference.decoder.model.ops.weight_format == "f32"  # float32 stays the default
    assert low.generate("the", max_tokens=8, temperature=0) == reference.generate("the", max_tokens=8, temperature=0)
    assert cli.main(["generate", "the", "--model-path", str(f16_exact_dir), "--device", "cpu", "--cpu-weights", "f16",
                     "--max-tokens", "8", "--greedy", "-q"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == reference.generate("the", max_tokens=8, temperature=0).rstrip("\n")
    with pytest.raises(InvalidConfigurationError, match="cpu_weight_format 'bf16'"):
        Generator.builder().model_path(f16_exact_dir).with_load_config(lambda c: c.cpu_weight_format("bf16"))


def test_widening_f16_bits_is_exact_for_every_finite_f16() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = bits.view(np.float16)
    finite = np.isfinite(values)
    bits, values = bits[finite].reshape(-1, 2), values[finite].reshape(-1, 2)
    out = np.empty(values.shape, dtype=np.float32)
    numpy_ops._widen_f16(bits, out, np.empty(values.shape, dtype=np.uint32))
    assert np.array_equal(out.view(np.uint32), values.astype(np.float32).view(np.uint32))  # -0.0 and subnormals too


def test_quantized_gguf_tensors_are_dequantized_in_row_chunks_to_the_same_f16(monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf

    from kjarni.weights import QuantTensor

    rng = np.random.default_rng(2)
    values = rng.standard_normal((50, 64)).astype(np.float32)
    data = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    tensor = QuantTensor(gguf.GGMLQuantizationType.Q8_0, (50, 64), data.reshape(50, -1))
    monkeypatch.setattr(numpy_ops, "F16_LOAD_ROWS", 7)  # 8 chunks, the last of 1 row
    stored = NumpyOps(weight_format="f16").weight(tensor, name="model.layers.0.mlp.up_proj.weight")
    assert stored.dtype == np.float16
    assert np.array_equal(stored, tensor.dequantize().astype(np.float16))


@pytest.mark.parametrize("bad", [-1e6, np.inf, np.nan])
def test_a_weight_f16_cannot_hold_is_refused_naming_it(bad: float) -> None:
    ops = NumpyOps(weight_format="f16")
    weight = np.ones((4, 4), dtype=np.float32)
    weight[1, 2] = bad
    with pytest.raises(InvalidConfigurationError, match=r"layers\.0\.mlp\.down_proj\.weight.*cannot be stored as f16"):
        ops.weight(weight, name="model.layers.0.mlp.down_proj.weight")
