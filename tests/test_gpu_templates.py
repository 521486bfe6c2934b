"""The per-format templates (shaders/matvec.tmpl.wgsl, matmul.tmpl.wgsl, embed.tmpl.wgsl): every
variant renders from the one block decoder of its format, and the embedding gather reads a
vocabulary-sized table (151,936 rows, Qwen2.5's) in f16 and Q8_0 against numpy."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from kjarni.gpu import kernels


@pytest.mark.parametrize("op", ["matvec", "matmul", "embed"])
@pytest.mark.parametrize("fmt", sorted(kernels.BLOCKS))
def test_each_template_variant_pastes_its_formats_block_decoder_once(op, fmt):
    text = kernels.template(op, fmt, frozenset({"subgroup"}))
    assert "{{" not in text and "#include" not in text
    assert text.count("fn unit_values(") == 1 and text.count("fn load_w8(") == 1
    assert text.count("var<storage, read> w_a") == 1  # the bindings come from the block decoder alone
    if op == "matmul":
        assert text.count("fn fetch_w8(") == 1 and text.count("fn finish_w8(") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["f16", "q8_0"])
def test_embed_gathers_from_a_vocabulary_sized_table(wgpu_context, fmt):
    from kjarni.gpu import WgpuOps

    ops = WgpuOps(wgpu_context, weight_format=fmt)
    rng = np.random.default_rng(11)
    vocab, hidden = 151_936, 64
    table = rng.standard_normal((vocab, hidden), dtype=np.float32)
    ids = np.array([151_935, 0, 75_968, 151_935, 3, 131_071, 131_072], dtype=np.int32)
    got = ops.read(ops.embed(ops.weight(table, name="embed"), ids))
    if fmt == "f16":
        expected = table[ids].astype(np.float16).astype(np.float32)
    else:
        blocks = gguf.quants.quantize(table[ids], gguf.GGMLQuantizationType.Q8_0)
        expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).reshape(len(ids), hidden)
    np.testing.assert_array_equal(got, expected)
