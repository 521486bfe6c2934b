"""The tensor-core prefill matmuls (shaders/matmul_tc.tmpl.wgsl with matmul_tc_prep.wgsl, and the
first kernel, matmul_sgmat.tmpl.wgsl) against NumpyOps with the same f16 rounding of the activations. Runs where the adapter has an f16 subgroup-matrix configuration
(Dawn, e.g. on NVIDIA's Vulkan driver: KJARNI_WEBGPU_RUNTIME=dawn); skips with the reason elsewhere
(wgpu-native has no subgroup matrices; Dawn does not run on Mesa 22.3's lavapipe)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kjarni.numpy_ops import NumpyOps
from tests.test_gpu_prefill import f16_round, rand, upload

ref16 = NumpyOps(activations="f16")
ref32 = NumpyOps()


@pytest.fixture
def tc_ops(wgpu_context):
    from kjarni.gpu import WgpuOps

    if wgpu_context.f16_matrix_subgroup is None:
        pytest.skip(f"{wgpu_context.description} on {wgpu_context.runtime.description} has no f16 subgroup-matrix "
                    "configuration (needs Dawn: KJARNI_WEBGPU_RUNTIME=dawn, on a driver that offers one)")
    ops = WgpuOps(wgpu_context, weight_format="f16")
    ops.tuning.tensor_cores = True  # the default (GpuTuning.tensor_cores); set so these tests hold if it changes
    return ops


def _eval_wgsl(expr: str, env: dict) -> int:
    """An integer WGSL expression of tc_fields' declarations (u32 literals, / % * + and calls) in Python."""
    py = re.sub(r"(\d+)u\b", r"\1", expr).replace("/", "//")
    return eval(py, {}, env)  # noqa: S307 - the expression comes from kernels.tc_fields


@pytest.mark.parametrize("variant", sorted(n for n in __import__("kjarni.gpu.kernels", fromlist=["TEMPLATES"]).TEMPLATES["matmul_tc"]
                                            if "_t_" in n or (re.search(r"_[pw]_", n) and "." not in n)))
def test_thread_copied_tiles_copy_each_operand_value_once_from_its_place(variant):
    """SHARED 2, 3 and 5 tiles (no GPU needed): evaluating the generated chunk indices for every thread,
    each x and weight tile slot of a K step is written exactly once, from the token / row and columns
    the matrix loads of the subgroups then read it as (clamped into the product like tok() and row())."""
    from kjarni.gpu import kernels

    tm, tn, sm, sn, ku, kind, sg = re.match(r"(\d+)x(\d+)_(\d+)x(\d+)_k(\d+)_([tpw])_sg(\d+)$", variant).groups()
    tm, tn, sm, sn, ku, sg = (int(v) for v in (tm, tn, sm, sn, ku, sg))
    fields = kernels.tc_fields(tm, tn, sm, sn, ku, kernels.TC_SHARED_LETTERS.index(kind), sg)
    decls = dict(re.findall(r"let ([xw][crd]\d+) = (.+);", fields["DECL"]))
    nsg, bk, lds = sm * sn, 16 * ku, 16 * ku + 8
    bm, bn, tokens, rows, cols = sm * tm * 16, sn * tn * 16, 200, 400, 4 * bk
    base = {"WG": nsg * sg, "SG": sg, "BK": bk, "LDS": lds, "wx": 1, "wy": 1,
            "tok": lambda wy, s, i: min((wy * sm + s) * tm * 16 + i * 16, tokens - 16),
            "row": lambda wx, s, j: min((wx * sn + s) * tn * 16 + j * 16, rows - 16)}
    for side, tile_rows, place in (("x", bm, base["tok"]), ("w", bn, base["row"])):
        names = sorted({k[2:] for k in decls if k[0] == side})
        written = {}
        for thread in range(nsg * sg):
            env = dict(base, sg=thread // sg, lane=thread % sg)
            for n in names:
                for part in "crd":  # in declaration order: d uses c
                    env[f"{side}{part}{n}"] = _eval_wgsl(decls[f"{side}{part}{n}"], env)
                c, r, d = (env[f"{side}{part}{n}"] for part in "crd")
                assert d not in written, (side, thread, n)
                written[d] = (r, c)
        want = {}
        for tr in range(tile_rows):
            source = place(1, 0, tr // 16) + tr % 16
            want.update({tr * lds + 8 * c: (source, c) for c in range(bk // 8)})
        assert written == want
        # and the loads read 8 c .. 8 c + 7 of those rows: a 16-byte unit c of k0 / 8 onwards
        assert f"{side}[{side}r0 * (cols / 8u) + (k_begin) / 8u + {side}c0]" in fields["PRE"].replace("w_a[w", "w[w")
    assert cols % bk == 0


@pytest.mark.parametrize("shared", [3, 5])
@pytest.mark.parametrize("fmt", ["f16", "Q8_0", "Q4_K"])
def test_double_buffered_tiles_store_the_next_step_where_no_subgroup_reads(fmt, shared):
    """SHARED 3 and 5 (no GPU needed): before the loop, step 0 goes to tile 0 and a barrier follows;
    in the loop every workgroup store goes to the tile the products do not read (1 - cur), every
    operand load reads tile cur, and one barrier ends the step. SHARED 5 stores a chunk as one
    vec4<u32> and gives the loads offsets and strides in vec4<u32> elements."""
    from kjarni.gpu import kernels

    fields = kernels.tc_fields(4, 4, 2, 2, 2, shared, 32, fmt)
    pre, step = fields["PRE"].splitlines(), fields["STEP"].splitlines()
    stores = [line.strip() for line in step if re.match(r"\s*[xw]s\[", line)]
    loads = [line for line in step if "subgroupMatrixLoad" in line]
    assert len(stores) == (8 if shared == 3 else 1) * (4 + 4) and len(loads) == 2 * (4 + 4)  # 4 + 4 chunks; KU x (TM + TN) matrices
    prefix = {3: "{t}s[(1u - cur) * B{mn} * LDS + ", 5: "{t}s[((1u - cur) * B{mn} * LDS + "}[shared]
    assert all(line.startswith(prefix.format(t=line[0], mn="M" if line[0] == "x" else "N")) for line in stores)
    if shared > 3:  # one 16-byte element a chunk, its index in f16 values / 8
        assert all(") / 8u] = " in line for line in stores)
    pattern = r"\(&([xw])s, cur \* B[MN] \* LDS \+ .*, LDS\);" if shared < 5 else r"\(&([xw])s, \(cur \* B[MN] \* LDS \+ .*\) / 8u, LDS / 8u\);"
    assert all(re.search(pattern, line) for line in loads)
    assert [line.strip() for line in step].count("workgroupBarrier();") == 1 and step[-1].strip() == "workgroupBarrier();"
    assert pre[-1].strip() == "workgroupBarrier();" and not any("cur" in line for line in pre)
    assert any(re.match(r"\s*xs\[\(?xd0(\) / 8u\]| \+ 0u\])", line) for line in pre)  # step 0 into tile 0
    assert kernels.tc_workgroup_bytes(4, 4, 2, 2, 2, shared) == 4 * 1024 + 2 * kernels.tc_workgroup_bytes(4, 4, 2, 2, 2, 2) - 2 * 4 * 1024


def _wgsl_fn(text: str, name: str) -> list[tuple[str, str]]:
    """The ``let`` lines and the ``return`` of WGSL function ``name`` in ``text``: (name or
    "return", expression), in order."""
    body = text.split(f"fn {name}(", 1)[1].split("\n}\n", 1)[0]
    return [(m[0] or m[1], m[2]) for m in re.findall(r"^\s*(?:let (\w+) =|(return)) (.+);$", body, re.M)]


@pytest.mark.parametrize("tile", [(2, 4, 4, 2, 2, 3), (4, 2, 2, 4, 2, 5), (2, 2, 2, 2, 2, 1), (2, 4, 2, 2, 2, 0)])
@pytest.mark.parametrize("half", [192, 208])  # 208: no whole number of 64-output workgroups
def test_silu_flag_pairs_gate_rows_with_their_up_rows_and_covers_every_output(tile, half):
    """No GPU: under the silu flag, evaluating the rendered row() and the epilogue's output column
    for every workgroup, subgroup column and matrix: matrix j < TN / 2 reads the gate rows of the
    outputs it writes and j + TN / 2 the up rows ``half`` further down [gate | up]; the operand
    copies' row(wx, 0u, b) is subgroup column b / TN's matrix b % TN; the outputs cover 0 .. half
    in whole 16-column matrices (the last workgroup's clamped ones repeat their neighbours')."""
    from kjarni.gpu import kernels

    tm, tn, sm, sn, ku, shared = tile
    text = kernels.template("matmul_tc", kernels.tc_variant(*tile, 32), frozenset({"silu"}))
    body = _wgsl_fn(text, "row")

    def row(wx, s, j):
        env = {"TN": tn, "SN": sn, "wx": wx, "sn": s, "j": j, "min": min, "params_rows": 2 * half}
        for name, expr in body:
            value = _eval_wgsl(expr.replace("params.rows", "params_rows"), env)
            if name == "return":
                return value
            env[name] = value

    outs = re.findall(r"let c = (.+);", kernels.tc_fields(*tile, 32)["STORE_SILU"])
    assert len(outs) == tm * tn // 2
    covered = set()
    for wx in range(-(-half // (8 * sn * tn))):
        for s in range(sn):
            for j in range(tn // 2):
                c = _eval_wgsl(outs[j].replace("params.rows", "params_rows"), {"wx": wx, "sn": s, "SN": sn, "TN": tn, "min": min,
                                                                               "params_rows": 2 * half})
                assert row(wx, s, j) == c and row(wx, s, j + tn // 2) == half + c
                assert c % 16 == 0 and 0 <= c <= half - 16
                covered.add(c)
        for b in range(sn * tn):
            assert row(wx, 0, b) == row(wx, b // tn, b % tn)
    assert covered == set(range(0, half, 16))


def test_silu_flag_renders_f16_outputs_and_no_f32_store():
    """No GPU: the silu flag swaps y for f16 pairs and the result stores for silu_out; without it
    the kernel is the plain one."""
    from kjarni.gpu import kernels

    variant = kernels.tc_variant(2, 4, 4, 2, 2, 3, 32)
    plain, silu = kernels.template("matmul_tc", variant), kernels.template("matmul_tc", variant, frozenset({"silu"}))
    assert "var<storage, read_write> y: array<f32>;" in plain and "silu_out" not in plain
    assert "var<storage, read_write> y: array<vec2<f16>>;" in silu and "subgroupMatrixStore<row_major>(&y," not in silu
    assert silu.count("        silu_out(t") == 2 * 2 * 4  # TM x TN / 2 pairs, 128 / SG output pairs a lane each


def test_every_silu_variant_compiles_with_tint(tint_compile):
    """Dawn's WGSL compiler accepts the silu flag on every f16 tile with an even TN, and on a
    quantized one (Null device: no GPU needed)."""
    from kjarni.gpu import kernels

    names = [kernels.tc_variant(*tile, 32) for tile in kernels.TC_TILES if tile[1] % 2 == 0 and kernels.tc_tile_renders(tile, 32)]
    names += [kernels.tc_variant(4, 2, 2, 4, 2, 5, 32, "Q4_K"), kernels.tc_variant(4, 4, 2, 2, 2, 1, 64, "Q8_0")]
    for name in names:
        tint_compile(kernels.template("matmul_tc", name, frozenset({"silu"})), name + "+silu")


def _ran(ops, weight, tokens) -> str:
    return next(p for key, p in weight.plans.items() if key[0] == tokens)[0][0][0].kjarni_name


def _ran_all(weight, tokens) -> list[str]:
    """The kernels of the last plan made for ``tokens`` rows, in dispatch order."""
    plan = [p for key, p in weight.plans.items() if key[0] == tokens][-1]
    return [d[0].kjarni_name for d in plan[0]]


TC_TILES = [(4, 2, 2, 2, 2, 0), (2, 4, 2, 2, 2, 0), (4, 2, 1, 1, 2, 0), (2, 2, 2, 2, 2, 1), (4, 2, 2, 4, 2, 1), (2, 2, 2, 2, 4, 1),
            (2, 2, 2, 2, 2, 2), (4, 4, 2, 2, 2, 2), (2, 2, 2, 2, 4, 2), (2, 2, 2, 2, 2, 3), (4, 4, 2, 2, 2, 3), (2, 4, 4, 2, 2, 3),
            (2, 2, 2, 2, 2, 5), (4, 2, 2, 4, 2, 5)]


def _probe_sources(shared: int) -> dict[str, str]:
    """tools/probe_tc.py's probe sources of the 4x4_2x2_k2 tile of ``shared`` at subgroup size 32."""
    import sys
    from pathlib import Path

    from kjarni.gpu import kernels

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import probe_tc

    source = kernels.template("matmul_tc", kernels.tc_variant(4, 4, 2, 2, 2, shared, 32))
    return {p: probe_tc.probe_source(source, p) for p in probe_tc.PROBES}


@pytest.mark.parametrize("shared", [1, 3, 5])
def test_probe_tc_probes_leave_out_what_they_name(shared):
    """tools/probe_tc.py's text edits of a rendered tile: each probe deletes its part of the K loop
    (global loads, barriers, workgroup stores, operand loads) and nothing else it names; nostore
    only puts the result stores behind the first row tile's branch."""
    from kjarni.gpu import kernels

    got = _probe_sources(shared)
    assert got["full"] == kernels.template("matmul_tc", kernels.tc_variant(4, 4, 2, 2, 2, shared, 32))
    assert len(re.findall(r"subgroupMatrixMultiplyAccumulate", got["copy"])) == 2  # KU = 2 steps, acc0_0 only
    assert len(re.findall(r"subgroupMatrixMultiplyAccumulate", got["mma"])) == 32
    for p in ("noglobal", "nosync", "smem_mma", "mma"):
        assert not re.search(r"^\s*p[abxw]\d+ = ", got[p], re.M), p
    assert "        workgroupBarrier();" in got["noglobal"].splitlines()
    for p in ("nosync", "smem_mma", "mma"):
        assert "        workgroupBarrier();" not in got[p].splitlines(), p
    assert re.search(r"^\s*([xw]s\[|subgroupMatrixStore<\w+>\(&[xw]s,)", got["nosync"], re.M)
    for p in ("smem_mma", "mma"):
        assert not re.search(r"^\s*([xw]s\[|subgroupMatrixStore<\w+>\(&[xw]s,)", got[p], re.M), p
    loop = "for (var k0 = k_begin;"  # the K loop, and what follows it: no more operand loads
    assert "subgroupMatrixLoad<subgroup_matrix_left" in got["smem_mma"].split(loop, 1)[1]
    assert "subgroupMatrixLoad<subgroup_matrix_left" not in got["mma"].split(loop, 1)[1]
    assert got["mma"].count("subgroupMatrixLoad<subgroup_matrix_left") == 4  # TM operands, loaded once
    stores = [line for line in got["nostore"].splitlines() if "subgroupMatrixStore<row_major>(&y," in line]
    assert len(stores) == 16 and all(line.startswith("    if (wid.x == 0u) { subgroupMatrixStore") for line in stores)
    assert [line for line in got["nostore"].splitlines() if line not in stores] == \
        [line for line in got["full"].splitlines() if "subgroupMatrixStore<row_major>(&y," not in line]


@pytest.mark.parametrize("shared", [1, 3, 5])
def test_probe_tc_probe_sources_compile_with_tint(tint_compile, shared):
    """Every probe source of tools/probe_tc.py still compiles under Tint (Dawn's Null device)."""
    for probe, text in _probe_sources(shared).items():
        tint_compile(text, probe)


def test_probe_tc_pad_shared_adds_only_unreachable_workgroup_memory(tint_compile):
    """probe_tc --pad-shared: one more workgroup array of the asked size, touched only behind
    ``params.rows == 0u``; the rest of the kernel is unchanged, and it compiles under Tint."""
    import sys
    from pathlib import Path

    from kjarni.gpu import kernels

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import probe_tc

    source = kernels.template("matmul_tc", kernels.tc_variant(4, 4, 2, 2, 2, 1, 32))
    padded = probe_tc.pad_shared(source, 20480)
    added = [line for line in padded.splitlines() if line not in source.splitlines()]
    assert added[0] == "var<workgroup> pad_shared: array<u32, 5120u>;"
    assert len(added) == 2 and added[1].startswith("    if (params.rows == 0u) {")
    assert [line for line in padded.splitlines() if line not in added] == source.splitlines()
    assert probe_tc.pad_shared(source, 0) == source
    tint_compile(padded, "pad_shared")


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("tile", TC_TILES)
@pytest.mark.parametrize("tokens,rows,cols", [(16, 32, 64), (70, 144, 128), (130, 208, 1152), (300, 16, 64)])
def test_tc_matmul_matches_numpy_with_f16_activations(tc_ops, tile, splits, tokens, rows, cols):
    from kjarni.gpu import kernels

    ops = tc_ops
    sg = ops.context.f16_matrix_subgroup
    if kernels.tc_variant(*tile, sg) not in kernels.TEMPLATES["matmul_tc"] or kernels.tc_workgroup_bytes(*tile) > ops.context.max_workgroup_storage:
        pytest.skip("tile not made at this subgroup size, or beyond this device's workgroup memory")
    ops.tuning.tc_tiles = {(rows, cols): tile}
    ops.tuning.tc_splits = splits  # 3: over grid z, then matmul_reduce (fewer where K has fewer steps)
    rng = np.random.default_rng(tokens * rows + cols)
    x, w, b, r, nw = rand(rng, tokens, cols), rand(rng, rows, cols), rand(rng, rows), rand(rng, tokens, rows), rand(rng, cols)
    w16 = f16_round(w)
    gx, gw, gb, gr = upload(ops, x), ops.weight(w, name="w"), ops.weight(b, name="b"), upload(ops, r)
    variant = "matmul_tc." + kernels.tc_variant(*tile, sg)
    for bias, residual in ((gb, gr), (None, gr), (gb, None), (None, None)):
        got = ops.read(ops.linear(gx, gw, bias, residual=residual))
        ran = _ran_all(gw, tokens)
        assert ran[:2] == ["matmul_tc_prep:main", variant + ":main"], ran
        want = ref16.linear(x, w16, b if bias else None, r if residual else None)
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)  # f32 sums in another order
    # ... and measurably not the f32-activation product (the rounding happened)
    assert np.abs(ref32.linear(x, w16, b, r) - ref16.linear(x, w16, b, r)).max() > 1e-5 * np.abs(ref16.linear(x, w16, b, r)).max()
    got = ops.read(ops.norm_linear(gx, ops.weight(nw, name="n"), 1e-5, gw, gb))
    want = ref16.norm_linear(x, nw, 1e-5, w16, b)
    # The norm's f32 scale differs in its last bits, which can flip an f16 rounding: one f16 ulp
    # of one activation (2^-11 relative) times a weight.
    np.testing.assert_allclose(got, want, atol=4e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("fmt", ["f16", "Q4_K"])
@pytest.mark.parametrize("tile", [(2, 4, 4, 2, 2, 3), (4, 2, 2, 4, 2, 5), (2, 2, 2, 2, 2, 1), (2, 4, 2, 2, 2, 0)])
@pytest.mark.parametrize("tokens,half", [(70, 256), (150, 224)])  # 224: no whole number of 64-output workgroups
def test_swiglu_mlp_with_silu_in_gate_ups_epilogue_matches_numpy(tc_ops, tile, fmt, tokens, half):
    """ops.swiglu_mlp on tensor cores: gate_up (fused norm) writes silu(gate) up in f16 from its
    epilogue (the silu flag) and down reads it with no prep of its own; the result matches
    NumpyOps with the same f16 roundings, and so does the unfused GPU path (tc_silu off: silu_mul
    in down's prep) within the same bound."""
    from gguf import GGMLQuantizationType as T

    from kjarni.gpu import kernels
    from tests.test_gpu_quant import random_quant

    ops = tc_ops
    sg = ops.context.f16_matrix_subgroup
    quant = fmt != "f16"
    if (kernels.tc_variant(*tile, sg, fmt) not in kernels.TEMPLATES["matmul_tc"]
            or kernels.tc_workgroup_bytes(*tile) > ops.context.max_workgroup_storage):
        pytest.skip("tile not made at this subgroup size or format, or beyond this device's workgroup memory")
    hidden, half = 256, 256 if quant else half  # Q4_K blocks of 256 along down's K
    key = "tc_quant_tiles" if quant else "tc_tiles"
    getattr(ops.tuning, key).update({k: tile for k in ([(fmt, 2 * half, hidden), (fmt, hidden, half)] if quant else
                                                      [(2 * half, hidden), (hidden, half)])})
    ops.tuning.tc_splits = 1
    rng = np.random.default_rng(tokens + half)
    # The norm weight at 1/16 keeps silu(gate) up within f16 range (random Q4_K weights reach 90).
    x, nw, r = rand(rng, tokens, hidden), rand(rng, hidden) / 16, rand(rng, tokens, hidden)
    if quant:
        q_gu, q_dn = random_quant(T.Q4_K, 2 * half, hidden, seed=1), random_quant(T.Q4_K, hidden, half, seed=2)
        gu16, dn16 = f16_round(q_gu.dequantize()), f16_round(q_dn.dequantize())
        g_gu, g_dn = ops.weight(q_gu, name="gate_up.weight"), ops.weight(q_dn, name="down.weight")
        assert [s.format for s in g_gu.segments + g_dn.segments] == ["Q4_K", "Q4_K"]
    else:
        gu, dn = rand(rng, 2 * half, hidden), rand(rng, hidden, half)
        gu16, dn16 = f16_round(gu), f16_round(dn)
        g_gu, g_dn = ops.weight(gu, name="gate_up"), ops.weight(dn, name="down")
    gx, gnw, gr = upload(ops, x), ops.weight(nw, name="n"), upload(ops, r)
    got = ops.read(ops.swiglu_mlp(gx, gnw, 1e-5, g_gu, g_dn, residual=gr))
    variant = "matmul_tc." + kernels.tc_variant(*tile, sg, fmt)
    assert _ran_all(g_gu, tokens) == ["matmul_tc_prep:main", variant + "+silu:main"]
    assert _ran_all(g_dn, tokens)[0] == variant + ":main"  # no prep: the f16 activations came from gate_up
    # gate_up's sums are the plain kernel's (the same K loop): read them, and check the rest of
    # the MLP from them. silu's exp and the f32 sums of down differ in their last bits, and an
    # activation that close to an f16 rounding midpoint can round the other way: one f16 ulp of it
    # times its weights (_f16_flip_bound). (The f16 rounding of the normed input, which flips the
    # same way, is test_tc_matmul's: its flips move gate and up far more than these bounds.)
    gate_up = ops.read(ops.norm_linear(gx, gnw, 1e-5, g_gu))
    normed = ref32.rms_norm(x, nw, 1e-5)  # what the prep rounds to f16: the same flips bound gate_up
    want_gu = ref16.norm_linear(x, nw, 1e-5, gu16)
    assert np.all(np.abs(gate_up - want_gu) <= _f16_flip_bound(normed, gu16)[0] + 1e-5 * np.abs(want_gu).max())
    act = ref32.silu_mul(gate_up)
    want = ref16.linear(act, dn16, residual=r)
    flips, near = _f16_flip_bound(act, dn16)
    assert near < 0.01  # the bound leaves almost every activation exact: the check can fail
    bound = flips + 1e-5 * np.abs(want).max()
    assert np.all(np.abs(got - want) <= bound), np.abs(got - want).max()
    ops.tuning.tc_silu = False
    g_gu.plans.clear()  # the plans (and whether the MLP fuses) are decided once per weight and shape
    g_dn.plans.clear()
    unfused = ops.read(ops.swiglu_mlp(gx, gnw, 1e-5, g_gu, g_dn, residual=gr))
    assert _ran_all(g_dn, tokens)[:2] == ["matmul_tc_prep:main", variant + ":main"]  # silu_mul in down's prep
    assert np.all(np.abs(got - unfused) <= bound), np.abs(got - unfused).max()


def _f16_flip_bound(a: np.ndarray, w: np.ndarray, rel: float = 2e-6) -> tuple[np.ndarray, float]:
    """For y = f16(a) @ w.T: per output, the most that f16 roundings of activations an f32 error
    of ``rel`` |a| could flip may move it (one f16 ulp of each such activation times |w|), and the
    fraction of activations that close to a rounding midpoint."""
    a16 = a.astype(np.float16)
    ulp = np.spacing(np.abs(a16)).astype(np.float32)  # the spacing above |f16(a)|: the larger side
    near = ulp / 2 - np.abs(a - a16.astype(np.float32)) <= rel * np.abs(a)
    return (near * ulp) @ np.abs(w).T, float(near.mean())


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("tile", [(4, 2, 2, 2, 2, 0), (2, 2, 2, 2, 2, 1), (2, 2, 2, 2, 2, 2), (4, 4, 2, 2, 2, 3), (4, 2, 2, 4, 2, 5)])
def test_tc_matmul_in_token_major_order_matches_numpy(tc_ops, tile, splits):
    """GpuTuning.tc_tokens_first: the grid is (token tiles, row tiles) and every workgroup still
    computes its own tile (the last ones clamped into the product), bias and residual applied."""
    from kjarni.gpu import kernels

    ops = tc_ops
    sg = ops.context.f16_matrix_subgroup
    if kernels.tc_variant(*tile, sg) not in kernels.TEMPLATES["matmul_tc"] or kernels.tc_workgroup_bytes(*tile) > ops.context.max_workgroup_storage:
        pytest.skip("tile not made at this subgroup size, or beyond this device's workgroup memory")
    tokens, rows, cols = 150, 272, 256  # several token and row tiles, neither a whole number of them
    ops.tuning.tc_tiles = {(rows, cols): tile}
    ops.tuning.tc_splits = splits
    ops.tuning.tc_tokens_first = True
    rng = np.random.default_rng(7)
    x, w, b, r = rand(rng, tokens, cols), rand(rng, rows, cols), rand(rng, rows), rand(rng, tokens, rows)
    w16 = f16_round(w)
    gx, gw, gb, gr = upload(ops, x), ops.weight(w, name="w"), ops.weight(b, name="b"), upload(ops, r)
    got = ops.read(ops.linear(gx, gw, gb, residual=gr))
    assert _ran_all(gw, tokens)[1] == "matmul_tc." + kernels.tc_variant(*tile, sg) + "+tf:main"
    want = ref16.linear(x, w16, b, r)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_token_major_order_swaps_the_grid_and_the_tile_indices():
    """No GPU: with tc_tokens_first the kernel reads its row tile from wid.y and its token tile
    from wid.x, and tc_kernel's grid is (token tiles, row tiles, 1)."""
    import types

    from kjarni.gpu import kernels
    from kjarni.gpu.linear import Linear
    from kjarni.gpu.tuning import GpuTuning

    variant = kernels.tc_variant(4, 4, 2, 2, 2, 3, 32)
    plain = kernels.template("matmul_tc", variant)
    assert "let wx = wid.x;" in plain and "let wy = wid.y;" in plain and "let wx = wid.y;" not in plain
    flipped = kernels.template("matmul_tc", variant, frozenset({"tokens_first"}))
    assert "let wx = wid.y;" in flipped and "let wy = wid.x;" in flipped and "let wx = wid.x;" not in flipped
    made = []
    context = types.SimpleNamespace(f16_matrix_subgroup=32, uniform=lambda data: data,
                                    pipeline=lambda name, kinds, **kw: made.append((name, kw["flags"], kw["source"]())) or name)
    seg = types.SimpleNamespace(format="f16", rows=17920, row_offset=0)
    for first, grid in ((False, (140, 4, 1)), (True, (4, 140, 1))):
        linear = Linear(context, GpuTuning(tc_tokens_first=first))
        name, _, got = linear.tc_kernel((4, 4, 2, 2, 2, 3), seg, 1536, 17920, 512, 0)
        assert got == grid
        assert name == "matmul_tc." + variant + ("+tf" if first else "")
        assert ("let wx = wid.y;" in made[-1][2]) == first and made[-1][1] == (frozenset({"tokens_first"}) if first else frozenset())


def test_token_major_order_per_shape_overrides_the_global_flag():
    """No GPU: tc_tokens_first_for[(rows, cols)] picks the grid order of that shape only."""
    import types

    from kjarni.gpu.linear import Linear
    from kjarni.gpu.tuning import GpuTuning

    context = types.SimpleNamespace(f16_matrix_subgroup=32, uniform=lambda data: data, pipeline=lambda name, kinds, **kw: name)
    linear = Linear(context, GpuTuning(tc_tokens_first=False, tc_tokens_first_for={(17920, 1536): True, (1536, 8960): False}))
    tile = (4, 4, 2, 2, 2, 1)
    up = linear.tc_kernel(tile, types.SimpleNamespace(format="f16", rows=17920, row_offset=0), 1536, 17920, 512, 0)
    down = linear.tc_kernel(tile, types.SimpleNamespace(format="f16", rows=1536, row_offset=0), 8960, 1536, 512, 0)
    other = linear.tc_kernel(tile, types.SimpleNamespace(format="f16", rows=2048, row_offset=0), 1536, 2048, 512, 0)
    assert (up[2], down[2], other[2]) == ((4, 140, 1), (12, 4, 1), (16, 4, 1))
    assert up[0].endswith("+tf") and not down[0].endswith("+tf") and not other[0].endswith("+tf")


def test_bench_gpu_set_takes_numbers_and_lists_of_ints():
    """tools/bench_gpu.py --set NAME=VALUE: an int or float field, or a tuple field as comma-separated
    ints; an unknown field or a bad value is an error message naming it, the tuning unchanged."""
    import sys
    from pathlib import Path

    from kjarni.gpu.tuning import GpuTuning

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import bench_gpu

    tuning = GpuTuning()
    assert bench_gpu._set_field(tuning, "attention_tc_head_dims=64,128") is None and tuning.attention_tc_head_dims == (64, 128)
    assert bench_gpu._set_field(tuning, "attention_tc_chunk=128") is None and tuning.attention_tc_chunk == 128
    assert "comma-separated ints" in bench_gpu._set_field(tuning, "attention_tc_head_dims=x")
    assert "no field 'nope'" in bench_gpu._set_field(tuning, "nope=1")
    assert tuning.attention_tc_head_dims == (64, 128)


def test_bench_gpu_set_changes_one_entry_of_a_dict_field_in_a_new_dict():
    """--set NAME[KEY]=VALUE (KEY's parts joined by x): one shape's entry of tc_tiles or
    tc_quant_tiles, in a new dict, so the default dict that ab_attention_gpu restores is unchanged."""
    import sys
    from pathlib import Path

    from kjarni.gpu.tuning import GpuTuning

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import bench_gpu

    tuning = GpuTuning()
    default = tuning.tc_tiles
    before = dict(default)
    assert bench_gpu._set_field(tuning, "tc_tiles[17920x1536]=4,2,2,4,2,5") is None
    assert tuning.tc_tiles[(17920, 1536)] == (4, 2, 2, 4, 2, 5) and default == before
    assert {k: v for k, v in tuning.tc_tiles.items() if k != (17920, 1536)} == {k: v for k, v in before.items() if k != (17920, 1536)}
    assert bench_gpu._set_field(tuning, "tc_quant_tiles[Q4_Kx1536x8960]=none") is None
    assert tuning.tc_quant_tiles[("Q4_K", 1536, 8960)] is None
    assert "not a dict field" in bench_gpu._set_field(tuning, "tc_tile[1x2]=1")
    assert "comma-separated ints or none" in bench_gpu._set_field(tuning, "tc_tiles[1x2]=a")


def test_bench_gpu_sweep_choice_overrides_only_the_shapes_it_names():
    """tools/bench_gpu.py --sgmat-choice: a sweep of some shapes keeps the other shapes' default
    tiles; each named shape gets its kernel family, tile, K split and grid order."""
    import sys
    from pathlib import Path

    from kjarni.gpu.tuning import GpuTuning

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import bench_gpu

    tuning = GpuTuning()
    tuning.sgmat_tiles[(896, 896)] = (64, 128, 32, 2, 4)  # the first kernel named for a shape
    before = dict(tuning.tc_tiles)
    assert (2048, 1536) in before and (17920, 1536) in before
    bench_gpu.apply_sgmat_choice(tuning, [
        {"rows": 17920, "cols": 1536, "format": "f16", "family": "tc", "tile": [4, 2, 2, 4, 2, 5], "splits": None, "tokens_first": True},
        {"rows": 1536, "cols": 8960, "format": "f16", "family": "tc", "tile": [2, 4, 4, 2, 2, 3], "splits": 8, "tokens_first": False},
        {"rows": 896, "cols": 896, "format": "f16", "family": "tc", "tile": [2, 4, 4, 2, 2, 3], "splits": None, "tokens_first": False},
        {"rows": 1152, "cols": 896, "format": "f16", "family": None, "tile": None, "splits": None},
        {"rows": 9728, "cols": 896, "format": "Q8_0", "family": "tc", "tile": [4, 2, 2, 4, 2, 5], "splits": None},
    ])
    assert tuning.tc_tiles[(17920, 1536)] == (4, 2, 2, 4, 2, 5) and tuning.tc_tokens_first_for[(17920, 1536)] is True
    assert tuning.tc_tiles[(1536, 8960)] == (2, 4, 4, 2, 2, 3) and tuning.tc_split_counts[(1536, 8960)] == 8
    assert tuning.tc_tokens_first_for[(1536, 8960)] is False
    assert (896, 896) not in tuning.sgmat_tiles and tuning.tc_tiles[(896, 896)] == (2, 4, 4, 2, 2, 3)
    assert tuning.tc_tiles[(1152, 896)] is None  # the SIMT kernel won there
    assert tuning.tc_tiles[(2048, 1536)] == before[(2048, 1536)]  # not in the choice: the default
    assert tuning.tc_quant_tiles[("Q8_0", 9728, 896)] == (4, 2, 2, 4, 2, 5)
    assert tuning.tc_quant_tiles[("Q8_0", 896, 896)] == GpuTuning().tc_quant_tiles[("Q8_0", 896, 896)]


def test_tc_matmul_applies_a_pending_silu_mul_in_its_prep(tc_ops):
    ops = tc_ops
    rng = np.random.default_rng(7)
    tokens, cols, rows = 70, 96, 48
    gate_up, w, r = rand(rng, tokens, 2 * cols), rand(rng, rows, cols), rand(rng, tokens, rows)
    gw = ops.weight(w, name="w")
    ops.tuning.tc_splits = 1
    before = ops.stats.dispatches
    got = ops.read(ops.linear(ops.silu_mul(upload(ops, gate_up)), gw, residual=upload(ops, r)))
    assert ops.stats.dispatches - before == 4, "two uploads, the prep and one matmul: no silu_mul dispatch"
    assert _ran_all(gw, tokens)[0] == "matmul_tc_prep:main"
    want = ref16.linear(ref32.silu_mul(gate_up), f16_round(w), None, r)
    np.testing.assert_allclose(got, want, atol=4e-5 * np.abs(want).max(), rtol=0)


def test_tc_matmul_only_where_every_matrix_fits_whole(tc_ops):
    ops = tc_ops
    rng = np.random.default_rng(3)
    w, odd = ops.weight(rand(rng, 48, 64), name="w"), ops.weight(rand(rng, 40, 64), name="odd")
    for tokens, first in ((12, "matmul.f16:main"), (16, "matmul_tc_prep:main")):  # fewer than 16 tokens: SIMT
        ops.linear(upload(ops, rand(rng, tokens, 64)), w)
        assert _ran_all(w, tokens)[0] == first
    ops.linear(upload(ops, rand(rng, 20, 64)), odd)  # 40 rows: not a multiple of 16
    assert _ran_all(odd, 20)[0] == "matmul.f16:main"


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("tile", [(64, 64, 32, 2, 2), (64, 128, 32, 2, 4), (128, 128, 32, 2, 4), (32, 64, 32, 1, 2)])
@pytest.mark.parametrize("tokens,rows,cols", [(10, 29, 64), (70, 131, 96), (130, 200, 1120), (300, 9, 32)])
def test_tensor_core_matmul_matches_numpy_with_f16_activations(tc_ops, tile, splits, tokens, rows, cols):
    from kjarni.gpu import kernels

    ops = tc_ops
    if kernels.sgmat_variant(*tile, ops.context.f16_matrix_subgroup) not in kernels.TEMPLATES["matmul_sgmat"]:
        pytest.skip("tile not made at this subgroup size")
    ops.tuning.sgmat_tiles = {(rows, cols): tile}  # the first kernel runs only where named
    ops.tuning.sgmat_splits = splits  # 3: over grid z, then matmul_reduce (fewer where K has fewer steps)
    rng = np.random.default_rng(tokens * rows + cols)
    x, w, b, r, nw = rand(rng, tokens, cols), rand(rng, rows, cols), rand(rng, rows), rand(rng, tokens, rows), rand(rng, cols)
    w16 = f16_round(w)
    gx, gw = upload(ops, x), ops.weight(w, name="w")
    got = ops.read(ops.linear(gx, gw, ops.weight(b, name="b"), residual=upload(ops, r)))
    assert _ran(ops, gw, tokens).startswith("matmul_sgmat.")
    want = ref16.linear(x, w16, b, r)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)  # f32 sums in another order
    # ... and measurably not the f32-activation product (the rounding happened)
    assert np.abs(ref32.linear(x, w16, b, r) - want).max() > 1e-5 * scale
    got = ops.read(ops.norm_linear(gx, ops.weight(nw, name="n"), 1e-5, gw, ops.weight(b, name="b")))
    want = ref16.norm_linear(x, nw, 1e-5, w16, b)
    # The norm's f32 scale differs in its last bits, which can flip an f16 rounding: one f16 ulp
    # of one activation (2^-11 relative) times a weight.
    np.testing.assert_allclose(got, want, atol=4e-5 * np.abs(want).max(), rtol=0)


def test_tensor_cores_apply_a_pending_silu_mul(tc_ops):
    ops = tc_ops
    rng = np.random.default_rng(7)
    tokens, cols, rows = 70, 96, 45
    gate_up, w, r = rand(rng, tokens, 2 * cols), rand(rng, rows, cols), rand(rng, tokens, rows)
    gw = ops.weight(w, name="w")
    ops.tuning.sgmat_tiles = {(rows, cols): (64, 64, 32, 2, 2)}
    ops.tuning.sgmat_splits = 1
    before = ops.stats.dispatches
    got = ops.read(ops.linear(ops.silu_mul(upload(ops, gate_up)), gw, residual=upload(ops, r)))
    assert ops.stats.dispatches - before == 3, "two uploads and one matmul: no silu_mul dispatch"
    want = ref16.linear(ref32.silu_mul(gate_up), f16_round(w), None, r)
    np.testing.assert_allclose(got, want, atol=4e-5 * np.abs(want).max(), rtol=0)


def test_tensor_cores_only_for_f16_prefill_products_with_whole_column_steps(tc_ops):
    from kjarni.gpu import WgpuOps

    ops = tc_ops
    rng = np.random.default_rng(2)
    w, odd = ops.weight(rand(rng, 40, 64), name="w"), ops.weight(rand(rng, 40, 72), name="odd")
    ops.tuning.sgmat_tiles = {(40, 64): (64, 64, 32, 2, 2), (40, 72): (64, 64, 32, 2, 2)}
    for tokens, name in ((1, "matvec_f16."), (ops.tuning.matvec_max_tokens, "linear_f16:matvec_t")):
        ops.linear(upload(ops, rand(rng, tokens, 64)), w)
        assert _ran(ops, w, tokens).startswith(name)
    ops.linear(upload(ops, rand(rng, 10, 64)), w)
    assert _ran(ops, w, 10).startswith("matmul_sgmat.")
    ops.linear(upload(ops, rand(rng, 10, 72)), odd)  # 72 columns: not a multiple of BK = 32
    assert _ran(ops, odd, 10) == "matmul.f16:main"
    q8 = WgpuOps(ops.context, weight_format="q8_0")
    wq = q8.weight(rand(rng, 40, 64), name="wq")
    q8.linear(upload(q8, rand(rng, 10, 64)), wq)
    assert _ran(q8, wq, 10) == "matmul_dot_prep:main"  # under 16 tokens: the integer-dot prefill (matmul_int_dot)
    q8.tuning.matmul_int_dot = False
    wq.plans.clear()
    q8.linear(upload(q8, rand(rng, 10, 64)), wq)
    assert _ran(q8, wq, 10) == "matmul.Q8_0:main"
    ops.tuning.tensor_cores = False
    w2 = ops.weight(rand(rng, 40, 64), name="w2")
    ops.linear(upload(ops, rand(rng, 10, 64)), w2)
    assert _ran(ops, w2, 10) == "matmul.f16:main"


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_attention_output_in_f16_feeds_o_proj_with_no_prep_and_the_same_values(tc_ops, kv_heads):
    """After a split tensor-core attention, attention_combine also writes its output rounded to f16
    (`WithF16`, GpuTuning.attention_tc_half), and the next product on tensor cores (o_proj) reads
    that instead of running matmul_tc_prep: one dispatch fewer, and the same result bit for bit (the
    prep would round the same f32 values)."""
    from kjarni.gpu.step import WithF16
    from kjarni.model import rope_table

    ops = tc_ops
    if ops._attention.tc_shape(64) is None:
        pytest.skip("no attention_tc variant for head size 64 on this adapter")
    rng = np.random.default_rng(11)
    tokens, heads, hd = 100, 4, 64

    class Cfg:  # the fields rope_table reads
        head_dim, rope_theta, rope_scaling = hd, 10000.0, None

    rope = ops.weight(rope_table(Cfg(), 128), name="rope")
    qkv = upload(ops, rand(rng, tokens, (heads + 2 * kv_heads) * hd))
    w_o = ops.weight(rand(rng, 96, heads * hd) * np.float32(0.05), name="o_proj")
    residual = upload(ops, rand(rng, tokens, 96))
    got = {}
    for half in (False, True):
        ops.tuning.attention_tc_half = half
        cache = ops.new_kv_cache(2, kv_heads, hd, 128)
        att = ops.attention(ops.rope_store(qkv, rope, cache, 1, 0), cache, 1, 0)
        assert (type(att) is WithF16) == half
        before = ops.stats.dispatches
        y = ops.linear(att, w_o, residual=residual)
        got[half] = (ops.read(y), ops.stats.dispatches - before, _ran_all(w_o, tokens))
    assert got[False][2][0] == "matmul_tc_prep:main" and "matmul_tc_prep:main" not in got[True][2]
    assert got[False][1] - got[True][1] == 1
    np.testing.assert_array_equal(got[True][0], got[False][0])


def _off_and_on(ops, fields: list[str], weights, run) -> dict[bool, tuple]:
    """``run(on)`` with the boolean tuning ``fields`` off, then on, each of ``weights``' cached
    plans dropped first: {on: (what run returned, the dispatches it recorded)}."""
    got = {}
    for on in (False, True):
        for name in fields:
            setattr(ops.tuning, name, on)
        for w in weights:
            w.plans.clear()
        before = ops.stats.dispatches
        value = run(on)
        got[on] = (value, ops.stats.dispatches - before)
    return got


@pytest.mark.parametrize("bias", [False, True])
def test_a_split_products_reduce_is_recorded_with_the_next_normed_prep(tc_ops, bias):
    """A product split over K on tensor cores (down_proj) leaves its reduce pending
    (`ReducePending`, GpuTuning.tc_reduce_prep); the next normed product on tensor cores (the next
    layer's qkv) records matmul_reduce_prep.wgsl, which writes the sums and its f16 activations: one
    dispatch fewer than matmul_reduce then matmul_tc_prep, and both products' values bit for bit."""
    from kjarni.gpu.step import ReducePending

    ops = tc_ops
    rng = np.random.default_rng(5)
    tokens, cols, rows, rows2 = 70, 1152, 96, 48
    x, r = upload(ops, rand(rng, tokens, cols)), upload(ops, rand(rng, tokens, rows))
    w1, w2 = ops.weight(rand(rng, rows, cols), name="down"), ops.weight(rand(rng, rows2, rows), name="qkv")
    nw = ops.weight(rand(rng, rows) + np.float32(1), name="norm")
    b2 = ops.weight(rand(rng, rows2), name="bias") if bias else None
    ops.tuning.tc_splits = 3

    def run(fuse: bool) -> tuple[np.ndarray, np.ndarray]:
        h = ops.linear(x, w1, residual=r)
        assert (type(h) is ReducePending) == fuse
        y = ops.norm_linear(h, nw, 1e-6, w2, b2)
        return ops.read(y), ops.read(h)

    got = _off_and_on(ops, ["tc_reduce_prep"], (w1, w2), run)
    np.testing.assert_array_equal(got[True][0][1], got[False][0][1])
    np.testing.assert_array_equal(got[True][0][0], got[False][0][0])
    assert got[False][1] - got[True][1] == 1
    assert "matmul_tc_prep:main" not in _ran_all(w2, tokens)


def test_a_prefill_gives_the_same_logits_with_and_without_the_prep_fusions(tc_ops):
    """A whole prefill on tensor cores (tools/bench_gpu.py's small Qwen2 shape: 4 layers, head size
    64, random f16 weights, 100 tokens, every position's logits) with the f16 attention output for
    o_proj (attention_tc_half) and the reduce recorded with the next prep (tc_reduce_prep), against
    the same model with both off: the same logits bit for bit, matmul_reduce_prep and the f16
    combine in use, and at least a dispatch a layer fewer."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import bench_gpu

    ops = tc_ops
    model = bench_gpu.build("small", "f16", ops)
    prompt = (np.arange(100, dtype=np.int32) * 7919) % model.config.vocab_size
    names = []
    real = ops.context.pipeline
    ops.context.pipeline = lambda kernel, kinds, **kw: names.append((kernel, kw.get("flags", ()))) or real(kernel, kinds, **kw)

    def run(_: bool) -> tuple[np.ndarray, set]:
        names.clear()
        return ops.read(model.forward(prompt, model.new_cache(128), logits="all")), set(names)

    try:
        got = _off_and_on(ops, ["tc_reduce_prep", "attention_tc_half"], list(bench_gpu._matrices(model)), run)
    finally:
        del ops.context.pipeline
    (logits_off, ran_off), (logits_on, ran_on) = got[False][0], got[True][0]
    np.testing.assert_array_equal(logits_on, logits_off)
    assert ("matmul_reduce_prep", ()) in ran_on and ("attention_combine", ("half",)) in ran_on
    assert not any(k == "matmul_reduce_prep" or "half" in f for k, f in ran_off)
    assert got[False][1] - got[True][1] >= len(model.blocks)


def test_a_pending_reduce_keeps_the_silu_mul_for_the_next_products_load(tc_ops):
    """gate_up split over K (so its MLP is not the fused SwiGLU) returns a `ReducePending`;
    silu_mul on it still waits for the down projection's load (`SiluMulPending`), as it does on a
    plain tensor: the same values and the same dispatches with tc_reduce_prep on and off."""
    from kjarni.gpu.step import ReducePending, SiluMulPending

    ops = tc_ops
    rng = np.random.default_rng(9)
    tokens, cols, half, rows = 70, 1152, 48, 64
    x = upload(ops, rand(rng, tokens, cols))
    w_gu, w_dn = ops.weight(rand(rng, 2 * half, cols), name="gate_up"), ops.weight(rand(rng, rows, half), name="down")
    ops.tuning.tc_splits = 3

    def run(fuse: bool) -> np.ndarray:
        h = ops.linear(x, w_gu)
        assert (type(h) is ReducePending) == fuse
        s = ops.silu_mul(h)
        assert type(s) is SiluMulPending
        return ops.read(ops.linear(s, w_dn))

    got = _off_and_on(ops, ["tc_reduce_prep"], (w_gu, w_dn), run)
    np.testing.assert_array_equal(got[True][0], got[False][0])
    assert got[True][1] == got[False][1]
