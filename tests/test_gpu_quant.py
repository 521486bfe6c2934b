"""GGUF quantized weights on the GPU: repack layouts (kjarni/gpu/quant.py) and the linear_ and embed kernels.

The repack is held bit-exact to ``gguf.quants.dequantize``; every kernel is checked against numpy
``x @ dequant(W).T`` with the bias / residual / fused-rms-norm flags. The GPU tests use a minimal
wgpu harness of their own (device with the adapter's max limits, buffers, one dispatch, read back)
so they do not depend on the GPU framework.
"""

from __future__ import annotations

import os
import struct
import tempfile
import time

import gguf
import numpy as np
import pytest

from kjarni.errors import InvalidModelError
from kjarni.gpu import kernels, quant
from kjarni.weights import QuantTensor
from tests.real_models import QWEN_CODER_05B, SMOLLM2, real_model_path

T = gguf.GGMLQuantizationType
TYPES = sorted(quant.SUPPORTED, key=lambda t: t.name)
REAL_MODELS = [SMOLLM2, QWEN_CODER_05B]


def random_quant(qtype: T, rows: int, cols: int, seed: int = 0) -> QuantTensor:
    """Random valid blocks: random bytes everywhere, with sane f16 values in the scale fields.

    Random quant bytes reach every nibble / high-bit / 6-bit-scale pattern, which quantizing smooth
    data would not; gguf.quants.quantize cannot make K-quants anyway.
    """
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    nb = cols // block_size
    data = rng.integers(0, 256, (rows, nb * type_size), dtype=np.uint8)
    blocks = data.reshape(rows, nb, type_size)

    def f16(first: int, count: int) -> None:
        values = rng.uniform(-0.1, 0.1, (rows, nb, count)).astype(np.float16)
        blocks[:, :, first : first + 2 * count] = values.view(np.uint8).reshape(rows, nb, 2 * count)

    f16(*{T.Q4_0: (0, 1), T.Q5_0: (0, 1), T.Q8_0: (0, 1), T.Q4_1: (0, 2), T.Q5_1: (0, 2),
          T.Q4_K: (0, 2), T.Q6_K: (208, 1)}[qtype])
    return QuantTensor(qtype, (rows, cols), data)


def test_repack_round_trips_bit_exact_for_every_type_on_random_blocks():
    for qtype in TYPES:
        cols = 768 if qtype in (T.Q4_K, T.Q6_K) else 96  # odd block counts exercise f16-pair padding
        qt = random_quant(qtype, 7, cols, seed=int(qtype))
        rw = quant.repack(qt)
        assert rw.w_a.dtype == np.uint32 and rw.w_b.dtype == np.uint32 and rw.w_a.shape[0] == 7
        assert rw.kernel == f"linear_{qtype.name.lower()}"
        expected = gguf.quants.dequantize(qt.data, qtype)
        got = quant.dequantize_repacked(rw)
        assert got.dtype == np.float32 and got.shape == (7, cols)
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), qtype.name


def test_repack_round_trips_tensors_made_by_gguf_quantize():
    rng = np.random.default_rng(1)
    for qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        data = gguf.quants.quantize(rng.standard_normal((5, 64)).astype(np.float32), qtype)
        rw = quant.repack(QuantTensor(qtype, (5, 64), data))
        assert np.array_equal(quant.dequantize_repacked(rw), gguf.quants.dequantize(data, qtype)), qtype.name


def test_split_rows_gives_contiguous_row_chunks_within_the_byte_limit():
    rw = quant.repack(random_quant(T.Q6_K, 11, 512))
    max_bytes = 4 * rw.w_a.shape[1] * 4  # four rows of w_a
    chunks = quant.split_rows(rw, max_bytes)
    assert [c.rows for c in chunks] == [4, 4, 3]
    assert [c.row_offset for c in chunks] == [0, 4, 8]
    assert all(c.w_a.nbytes <= max_bytes and c.w_b.nbytes <= max_bytes for c in chunks)
    whole = np.concatenate([quant.dequantize_repacked(c) for c in chunks])
    assert np.array_equal(whole, quant.dequantize_repacked(rw))
    assert quant.split_rows(rw, 1 << 30) == [rw]
    with pytest.raises(InvalidModelError, match="binding limit"):
        quant.split_rows(rw, 16)


def test_unsupported_type_and_inconsistent_data_raise_invalid_model():
    with pytest.raises(InvalidModelError, match="Q5_K"):
        quant.repack(QuantTensor(T.Q5_K, (2, 256), np.zeros((2, 176), np.uint8)))
    with pytest.raises(InvalidModelError, match="inconsistent"):
        quant.repack(QuantTensor(T.Q8_0, (2, 64), np.zeros((2, 60), np.uint8)))


def test_shader_source_keeps_one_entry_point_named_main():
    with_sub = quant.shader_source("linear_q8_0", subgroups=True)
    without = quant.shader_source("linear_q8_0", subgroups=False)
    assert "subgroupAdd" in with_sub and with_sub.count("fn main(") == 1 and "fn main_t(" in with_sub
    assert without.count("fn main(") == 1 and "workgroupBarrier" in without and "fn main_t(" not in without
    assert "subgroupAdd" not in without and "@builtin(subgroup" not in without


# ================================================================ a minimal wgpu harness


class Harness:
    """One device with the adapter's max limits; dispatch a kernel once and read the result."""

    def __init__(self, subgroups: bool) -> None:
        import wgpu

        self.wgpu = wgpu
        adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
        if adapter is None:
            raise RuntimeError("no adapter")
        self.subgroups = subgroups and "subgroup" in adapter.features
        limits = {k: adapter.limits[k] for k in ("max-storage-buffer-binding-size", "max-buffer-size")}
        self.max_binding = limits["max-storage-buffer-binding-size"]
        self.device = adapter.request_device_sync(
            required_features=["subgroup"] if self.subgroups else [], required_limits=limits
        )
        self.pipelines: dict[str, object] = {}

    def pipeline(self, kernel: str, entry: str = "main", constants: dict | None = None):
        key = f"{kernel}:{entry}:{sorted((constants or {}).items())}"
        if key not in self.pipelines:
            op, _, fmt = kernel.partition(".")  # "embed.Q8_0": a template rendered for a format
            code = kernels.template(op, fmt) if fmt else quant.shader_source(kernel, subgroups=self.subgroups)
            module = self.device.create_shader_module(code=code)
            self.pipelines[key] = self.device.create_compute_pipeline(
                layout="auto", compute={"module": module, "entry_point": entry, "constants": constants or {}}
            )
        return self.pipelines[key]

    def storage(self, array: np.ndarray):
        data = np.ascontiguousarray(array).tobytes() or b"\0" * 16
        usage = self.wgpu.BufferUsage.STORAGE | self.wgpu.BufferUsage.COPY_SRC
        return self.device.create_buffer_with_data(data=data + b"\0" * (-len(data) % 16), usage=usage)

    def run(self, kernel: str, params: tuple, inputs: list, out, groups: int, entry: str = "main",
            constants: dict | None = None) -> None:
        """Dispatch ``kernel`` with bindings (params, *inputs, out) into the existing buffer ``out``."""
        uniform = self.device.create_buffer_with_data(
            data=struct.pack("<6IfI", *params), usage=self.wgpu.BufferUsage.UNIFORM
        )
        pipeline = self.pipeline(kernel, entry, constants)
        entries = [{"binding": 0, "resource": {"buffer": uniform}}]
        for i, buf in enumerate([*inputs, out], start=1):
            entries.append({"binding": i, "resource": {"buffer": buf}})
        bind_group = self.device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=entries)
        encoder = self.device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        compute.set_pipeline(pipeline)
        compute.set_bind_group(0, bind_group)
        compute.dispatch_workgroups(groups, 1, 1)
        compute.end()
        self.device.queue.submit([encoder.finish()])

    def read(self, buf, shape) -> np.ndarray:
        count = int(np.prod(shape))
        return np.frombuffer(self.device.queue.read_buffer(buf), dtype=np.float32)[:count].reshape(shape).copy()

    def linear(self, rw: quant.RepackedWeight, x, bias=None, residual=None, norm=None, eps=1e-5,
               chunk_bytes: int | None = None, silu: bool = False, entry: str = "main",
               constants: dict | None = None) -> np.ndarray:
        """``silu``: x is ``[tokens, 2 cols]`` = ``[gate | up]`` (flags bit 3). ``entry``, ``constants``:
        the entry point (``main_t`` for several tokens) and its overrides."""
        tokens, cols = x.shape[0], rw.cols
        rows = rw.rows
        flags = (bias is not None) | (residual is not None) << 1 | (norm is not None) << 2 | int(silu) << 3
        dummy = np.zeros(4, np.float32)
        y0 = residual if residual is not None else np.full((tokens, rows), np.nan, np.float32)
        y = self.storage(np.zeros_like(y0))
        common = [self.storage(bias if bias is not None else dummy), self.storage(y0),
                  self.storage(norm if norm is not None else dummy)]
        xb = self.storage(x)
        for chunk in quant.split_rows(rw, chunk_bytes or self.max_binding):
            params = (chunk.rows, cols, tokens, flags, chunk.row_offset, rows, eps, 0)
            self.run(chunk.kernel, params, [xb, self.storage(chunk.w_a), self.storage(chunk.w_b), *common], y,
                     quant.workgroup_count(chunk.rows, subgroups=self.subgroups), entry, constants)
        return self.read(y, (tokens, rows))

    def embed(self, rw: quant.RepackedWeight, ids: np.ndarray, chunk_bytes: int | None = None) -> np.ndarray:
        out = self.storage(np.full((len(ids), rw.cols), np.nan, np.float32))
        idb = self.storage(ids.astype(np.uint32))
        for chunk in quant.split_rows(rw, chunk_bytes or self.max_binding):
            params = (chunk.rows, rw.cols, len(ids), 0, chunk.row_offset, 0, 0.0, 0)
            self.run("embed." + chunk.format_name, params, [idb, self.storage(chunk.w_a), self.storage(chunk.w_b)], out,
                     min(len(ids), 65535))
        return self.read(out, (len(ids), rw.cols))


_harnesses: dict[bool, Harness | None] = {}


def harness(subgroups: bool = True) -> Harness:
    if subgroups not in _harnesses:
        if not os.environ.get("XDG_RUNTIME_DIR") or not os.path.isdir(os.environ["XDG_RUNTIME_DIR"]):
            os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="kjarni-xdg-")  # 0700; silences Mesa
        try:
            _harnesses[subgroups] = Harness(subgroups)
        except Exception as exc:  # no wgpu, no adapter, no device
            _harnesses[subgroups] = None
            _harnesses[f"why-{subgroups}"] = repr(exc)  # type: ignore[index]
    h = _harnesses[subgroups]
    if h is None:
        pytest.skip(f"no WebGPU adapter: {_harnesses[f'why-{subgroups}']}")  # type: ignore[index]
    return h


def reference_linear(w: np.ndarray, x, bias=None, residual=None, norm=None, eps=1e-5) -> np.ndarray:
    if norm is not None:
        x = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + np.float32(eps)) * norm
    y = x.astype(np.float64) @ w.astype(np.float64).T
    if bias is not None:
        y = y + bias
    if residual is not None:
        y = y + residual
    return y


def assert_close(got: np.ndarray, expected: np.ndarray, rtol: float = 1e-4) -> None:
    """Within ``rtol`` of the output's scale (elementwise relative error is meaningless for sums
    that cancel to near zero)."""
    assert np.isfinite(got).all()
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * scale)


def odd_shape(qtype: T) -> tuple[int, int]:
    """Rows not a multiple of any workgroup size; more units per row than a 32-wide subgroup."""
    return (37, 768) if qtype in (T.Q4_K, T.Q6_K) else (37, 288)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 5, 8])
def test_linear_kernel_matches_numpy_with_and_without_bias_residual_norm(qtype, tokens):
    h = harness()
    rows, cols = odd_shape(qtype)
    qt = random_quant(qtype, rows, cols, seed=tokens)
    rw = quant.repack(qt)
    w = qt.dequantize()
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    residual = rng.standard_normal((tokens, rows)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    assert_close(h.linear(rw, x), reference_linear(w, x))
    assert_close(h.linear(rw, x, bias, residual, norm), reference_linear(w, x, bias, residual, norm))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 3])
def test_linear_kernel_applies_silu_of_gate_times_up_with_flag_bit_3(qtype, tokens):
    h = harness()
    rows, cols = odd_shape(qtype)
    qt = random_quant(qtype, rows, cols, seed=7)
    rng = np.random.default_rng(7)
    gate_up = rng.standard_normal((tokens, 2 * cols)).astype(np.float32)
    residual = rng.standard_normal((tokens, rows)).astype(np.float32)
    gate, up = gate_up[:, :cols], gate_up[:, cols:]
    x = gate / (np.float32(1) + np.exp(-gate)) * up
    got = h.linear(quant.repack(qt), gate_up, residual=residual, silu=True)
    assert_close(got, reference_linear(qt.dequantize(), x, residual=residual))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_main_t_matches_numpy_for_several_tokens_with_every_flag(qtype):
    """`main_t` (each unit dequantized once for up to 3 tiles of 4 tokens: speculative verify), for
    every combination of bias, residual, fused norm and fused silu; Q8_0 at 2..9 tokens and 13 (two
    passes), the other formats at 3, 9 and 13; then 9 tokens in passes of 1 and 2 tiles."""
    h = harness()
    if not h.subgroups:
        pytest.skip("main_t needs subgroups")
    rows, cols = odd_shape(qtype)
    qt = random_quant(qtype, rows, cols, seed=8)
    rw, w = quant.repack(qt), qt.dequantize()
    rng = np.random.default_rng(8)
    counts = [2, 3, 4, 5, 6, 7, 8, 9, 13] if qtype == T.Q8_0 else [3, 9, 13]
    for tokens in counts:
        tiles = min(3, -(-tokens // 4))
        for bias_on, residual_on, norm_on, silu in [(b, r, n, s) for b in (0, 1) for r in (0, 1) for n in (0, 1) for s in (0, 1)]:
            h_in = rng.standard_normal((tokens, 2 * cols if silu else cols)).astype(np.float32)
            x = h_in[:, :cols] / (np.float32(1) + np.exp(-h_in[:, :cols])) * h_in[:, cols:] if silu else h_in
            bias = rng.standard_normal(rows).astype(np.float32) if bias_on else None
            residual = rng.standard_normal((tokens, rows)).astype(np.float32) if residual_on else None
            norm = rng.uniform(0.5, 1.5, cols).astype(np.float32) if norm_on else None
            got = h.linear(rw, h_in, bias, residual, norm, silu=bool(silu), entry="main_t", constants={"QT": tiles})
            assert_close(got, reference_linear(w, x, bias, residual, norm))
    x = rng.standard_normal((9, cols)).astype(np.float32)
    for tiles in (1, 2):
        got = h.linear(rw, x, residual=x[:, :rows], entry="main_t", constants={"QT": tiles})
        assert_close(got, reference_linear(w, x, residual=x[:, :rows]))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_row_chunks_write_their_rows_of_the_full_output(qtype):
    h = harness()
    rows, cols = odd_shape(qtype)
    qt = random_quant(qtype, rows, cols, seed=3)
    rw = quant.repack(qt)
    x = np.random.default_rng(3).standard_normal((3, cols)).astype(np.float32)
    bias = np.arange(rows, dtype=np.float32)
    chunk_bytes = 10 * rw.w_a.shape[1] * 4  # 10 rows per chunk: 4 dispatches
    assert len(quant.split_rows(rw, chunk_bytes)) == 4
    got = h.linear(rw, x, bias=bias, chunk_bytes=chunk_bytes)
    assert_close(got, reference_linear(qt.dequantize(), x, bias))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_shared_memory_variant_for_adapters_without_subgroups(qtype):
    h = harness(subgroups=False)
    rows, cols = odd_shape(qtype)
    qt = random_quant(qtype, rows, cols, seed=4)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    residual = rng.standard_normal((5, rows)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    got = h.linear(quant.repack(qt), x, residual=residual, norm=norm)
    assert_close(got, reference_linear(qt.dequantize(), x, residual=residual, norm=norm))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_embed_kernel_gathers_dequantized_rows_also_from_row_chunks(qtype):
    h = harness()
    rows, cols = odd_shape(qtype)
    qt = random_quant(qtype, rows, cols, seed=5)
    rw = quant.repack(qt)
    ids = np.array([0, 36, 5, 5, 17, 36, 1], dtype=np.int32)
    expected = qt.dequantize()[ids]
    np.testing.assert_allclose(h.embed(rw, ids), expected, rtol=1e-6, atol=1e-7)
    chunk_bytes = 16 * rw.w_a.shape[1] * 4  # 3 chunks: every chunk writes only its own ids
    np.testing.assert_allclose(h.embed(rw, ids, chunk_bytes=chunk_bytes), expected, rtol=1e-6, atol=1e-7)


# ================================================================ the real models


def real_quant_tensors(name: str):
    path = real_model_path(name)
    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        if t.tensor_type in quant.SUPPORTED and len(t.data.shape) == 2:
            rows, cols = t.data.shape[0], int(t.shape[0])
            yield t.name, QuantTensor(t.tensor_type, (rows, cols), np.asarray(t.data))


@pytest.mark.slow
@pytest.mark.parametrize("filename", REAL_MODELS)
def test_repack_of_every_quantized_tensor_of_the_real_models_round_trips(filename):
    repack_seconds = 0.0
    for name, qt in real_quant_tensors(filename):
        start = time.perf_counter()
        rw = quant.repack(qt)
        repack_seconds += time.perf_counter() - start
        expected = gguf.quants.dequantize(qt.data, qt.ggml_type)
        assert np.array_equal(quant.dequantize_repacked(rw), expected), name
    print(f"{filename}: repack of all quantized tensors {repack_seconds:.2f} s")


@pytest.mark.gpu
@pytest.mark.slow
def test_linear_kernels_on_real_qwen_tensors():
    wanted = {"blk.0.ffn_down.weight", "blk.2.ffn_down.weight", "blk.0.attn_q.weight", "blk.0.attn_v.weight"}
    h = harness()
    seen = set()
    rng = np.random.default_rng(6)
    for name, qt in real_quant_tensors(QWEN_CODER_05B):
        if name not in wanted:
            continue
        seen.add(qt.ggml_type)
        x = rng.standard_normal((2, qt.shape[1])).astype(np.float32)
        assert_close(h.linear(quant.repack(qt), x), reference_linear(qt.dequantize(), x))
    assert seen == {T.Q6_K, T.Q4_K, T.Q5_0, T.Q8_0}
