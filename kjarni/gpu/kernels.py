"""WGSL sources: loaded from the ``kjarni.shaders`` package and specialised by small substitution.

A shader may contain two directives, written as WGSL comments so every file stays valid to read:

- ``// #include other.wgsl`` pastes another file of the package (shared kernel bodies);
- ``// #if FLAG`` / ``// #else`` / ``// #endif`` keeps one side depending on the variant's flags
  (``subgroup`` when the device has subgroup operations, ``kv_f16`` for a half-precision KV cache).

New kernels are written once as a template, ``shaders/<op>.tmpl.wgsl``, whose ``{{NAME}}`` fields
are filled from the variant table of this module (`TEMPLATES`) before the directives above run:
`template` renders one variant. The decode matrix-vector product (``matvec``), the prefill matmul
(``matmul``) and the embedding gather (``embed``) have one variant per weight format, each pasting
its format's block decoder (`BLOCKS`), the one place a format's layout is decoded.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from pathlib import Path

_DIRECTIVE = re.compile(r"^\s*//\s*#(include|if|else|endif)\b\s*(.*?)\s*$")


@functools.cache
def raw_source(filename: str) -> str:
    """The text of ``shaders/<filename>`` as packaged (or from the checkout when not installed)."""
    try:
        return resources.files("kjarni.shaders").joinpath(filename).read_text(encoding="utf-8")
    except (FileNotFoundError, ModuleNotFoundError):
        # A plain checkout without `pip install -e .`: shaders/ sits next to kjarni/.
        return (Path(__file__).resolve().parents[2] / "shaders" / filename).read_text(encoding="utf-8")


def exists(stem: str) -> bool:
    try:
        raw_source(stem + ".wgsl")
    except FileNotFoundError:
        return False
    return True


@functools.cache
def source(stem: str, flags: frozenset[str] = frozenset()) -> str:
    """``shaders/<stem>.wgsl`` with includes pasted and ``#if`` blocks resolved for ``flags``."""
    return _preprocess(raw_source(stem + ".wgsl"), flags, stem)


BLOCKS: dict[str, str] = {
    "f32": "block_f32", "f16": "block_f16", "Q4_0": "block_q4_0", "Q4_1": "block_q4_1", "Q5_0": "block_q5_0",
    "Q5_1": "block_q5_1", "Q8_0": "block_q8_0", "Q4_K": "block_q4_k", "Q6_K": "block_q6_k",
}
"""Weight format -> its block decoder (``shaders/block_<format>.wgsl``): the weight bindings, ``UNIT``,
``unit_values(row, u)``, ``unit_col(u, k)`` and ``load_w8(row, c8)`` (8 consecutive values); pasted
by the linear, matmul and embed kernels of that format."""

SGMAT_TILES: tuple[tuple[int, int, int, int, int], ...] = (
    (64, 64, 32, 2, 2), (64, 128, 32, 2, 4), (128, 128, 32, 2, 4), (128, 64, 32, 4, 2),
    (64, 64, 64, 2, 2), (32, 64, 32, 1, 2), (128, 128, 32, 4, 4), (64, 128, 64, 2, 2),
)
"""The tensor-core prefill matmul's tiles (``matmul_sgmat.tmpl.wgsl``): (BM tokens, BN rows, BK
columns a step, SM x SN subgroups), each at subgroup sizes 32 and 64."""


def sgmat_variant(bm: int, bn: int, bk: int, sm: int, sn: int, sg: int) -> str:
    """The ``matmul_sgmat`` variant name of a tile at subgroup size ``sg``."""
    return f"{bm}x{bn}x{bk}_{sm}x{sn}_sg{sg}"


def sgmat_fields(bm: int, bn: int, bk: int, sm: int, sn: int, sg: int) -> dict[str, str]:
    """The fields of ``matmul_sgmat.tmpl.wgsl`` for one tile: its sizes, and the per-register code
    written out (each thread's NX x loads and NW W loads of a step, the subgroup's TMT x TNT result
    matrices and their products, BK / 16 a step)."""
    wg = sm * sn * sg
    nx, nw = bm * bk // 4 // wg, bn * bk // 8 // wg
    tmt, tnt = bm // (16 * sm), bn // (16 * sn)
    xdecl = "\n".join(f"    var xr{j} = vec4<f32>(0.0);\n    var ur{j} = vec4<f32>(1.0);\n    var nr{j} = vec4<f32>(1.0);"
                      for j in range(nx))
    xload = "\n".join(
        f"""            {{
                let t = t0 + xq_t + {j * wg // (bk // 4)}u;
                let c = kn / 4u + xq_c;
                if (t < tokens) {{
                    xr{j} = x[t * xrs + c];
                    if (silu) {{
                        ur{j} = x[t * xrs + up + c];
                    }}
                }}
                if (norm) {{
                    nr{j} = norm_weight[c];
                }}
            }}""" for j in range(nx))
    xstore = "\n".join(
        f"""        {{
            let t = xq_t + {j * wg // (bk // 4)}u;
            var v = xr{j};
            if (silu) {{
                v = silu_mul4(v, ur{j});
            }}
            let h = vec4<f16>(v * scale[t] * nr{j});
            let o = t * LDS + 4u * xq_c;
            xs[o] = h.x;
            xs[o + 1u] = h.y;
            xs[o + 2u] = h.z;
            xs[o + 3u] = h.w;
        }}""" for j in range(nx))
    wdecl = "\n".join(f"    var wr{j} = vec4<u32>(0u);" for j in range(nw))
    wload = "\n".join(
        f"""            {{
                let r = r0 + wq_r + {j * wg // (bk // 8)}u;
                if (r < rows) {{
                    wr{j} = w_a[r * wrs + kn / 8u + wq_c];
                }}
            }}""" for j in range(nw))
    wstore = "\n".join(
        f"""        {{
            let o = (wq_r + {j * wg // (bk // 8)}u) * LDS + 8u * wq_c;
            let a = bitcast<vec2<f16>>(wr{j}.x);
            let b = bitcast<vec2<f16>>(wr{j}.y);
            let c = bitcast<vec2<f16>>(wr{j}.z);
            let d = bitcast<vec2<f16>>(wr{j}.w);
            ws[o] = a.x;
            ws[o + 1u] = a.y;
            ws[o + 2u] = b.x;
            ws[o + 3u] = b.y;
            ws[o + 4u] = c.x;
            ws[o + 5u] = c.y;
            ws[o + 6u] = d.x;
            ws[o + 7u] = d.y;
        }}""" for j in range(nw))
    acc = "\n".join(f"    var acc{i}_{j} = subgroup_matrix_result<f32, 16, 16>();" for i in range(tmt) for j in range(tnt))
    mma = []
    for kk in range(0, bk, 16):
        mma.append("        {")
        mma += [f"            let a{i} = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&xs, xb + {16 * i}u * LDS + {kk}u, LDS);"
                for i in range(tmt)]
        mma += [f"            let b{j} = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&ws, wb + {16 * j}u * LDS + {kk}u, LDS);"
                for j in range(tnt)]
        mma += [f"            acc{i}_{j} = subgroupMatrixMultiplyAccumulate(a{i}, b{j}, acc{i}_{j});" for i in range(tmt) for j in range(tnt)]
        mma.append("        }")
    out = "\n".join(f"    write_tile(acc{i}_{j}, sg, lane, t0 + (sm * TMT + {i}u) * 16u, r0 + (sn * TNT + {j}u) * 16u, t_out);"
                     for i in range(tmt) for j in range(tnt))
    return {"BM": str(bm), "BN": str(bn), "BK": str(bk), "SM": str(sm), "SN": str(sn), "SG": str(sg),
            "XDECL": xdecl, "XLOADN": xload, "XSTORE": xstore, "WDECL": wdecl, "WLOADN": wload,
            "WSTORE": wstore, "ACC": acc, "MMA": "\n".join(mma), "OUT": out}


TC_SHARED_LETTERS = "dstpvw"
"""The letter of each SHARED mode in a ``matmul_tc`` variant name (`tc_variant`)."""
TC_TILES: tuple[tuple[int, int, int, int, int, int], ...] = (
    (4, 2, 1, 1, 2, 0), (2, 2, 1, 1, 2, 0), (4, 4, 1, 1, 1, 0), (2, 2, 2, 2, 2, 0), (4, 2, 2, 2, 2, 0),
    (2, 4, 2, 2, 2, 0), (4, 2, 2, 1, 2, 0), (2, 4, 1, 2, 2, 0),
    (2, 2, 2, 2, 2, 1), (2, 4, 2, 2, 2, 1), (4, 2, 2, 2, 2, 1), (4, 4, 2, 2, 2, 1), (2, 2, 2, 2, 4, 1),
    (4, 2, 2, 4, 2, 1),
    (2, 2, 2, 2, 2, 2), (2, 4, 2, 2, 2, 2), (4, 2, 2, 2, 2, 2), (4, 4, 2, 2, 2, 2), (2, 2, 2, 2, 4, 2),
    (4, 2, 2, 4, 2, 2), (4, 4, 2, 2, 4, 2), (4, 4, 2, 4, 2, 2),
    (2, 2, 2, 2, 2, 3), (2, 4, 2, 2, 2, 3), (4, 2, 2, 2, 2, 3), (4, 4, 2, 2, 2, 3), (4, 2, 2, 4, 2, 3),
    (2, 4, 4, 2, 2, 3),
    (4, 4, 2, 2, 2, 5), (4, 2, 2, 4, 2, 5), (2, 4, 4, 2, 2, 5), (2, 2, 2, 2, 2, 5),
)
"""The tensor-core prefill matmul's tiles (``matmul_tc.tmpl.wgsl``): (TM x TN result matrices a
subgroup, SM x SN subgroups, KU 16-column steps of K a loop, SHARED: 0 operands from storage, 1
through workgroup memory copied by matrix loads and stores, 2 through workgroup memory copied by
the threads in 16-byte chunks, 3 as 2 with two tiles of workgroup memory, one barrier a step, 5
as 3 with the tiles held as vec4<u32> (one 16-byte store a chunk instead of 8 f16 stores), the
matrix loads' offset and stride given in vec4<u32> elements, which is how Dawn reads them
(tools/probe_tc.py --layouts on an H100, docs/benchmarks.md; SHARED 4, the same in f16 values,
read the wrong data and is gone), each at subgroup sizes 32 and 64 where the copies divide
evenly. (KU 1 double-buffered tiles, with a KU 2 single tile's workgroup memory, lost every product
they were measured on and are not made: docs/benchmarks.md, sixteenth session; so did SHARED 6,
SHARED 5's weight tiles with the activation matrices loaded straight from storage, on the 1.5B
Q4_K prefill: twenty-first session.)"""


# The block decoders that split their prefill chunk load (fetch_w8, the loads) from its conversion
# (finish_w8), so that the loads stay in flight through a matmul step; the others' load_w8 is used
# whole (matmul_w_direct.wgsl).
SPLIT_LOAD_FORMATS = frozenset({"f16", "Q8_0", "Q4_K", "Q5_0"})
TC_QUANT_FORMATS = ("Q8_0", "Q4_K", "Q5_0", "Q6_K", "Q4_0", "Q4_1", "Q5_1")
"""GGUF formats with ``matmul_tc`` variants (SHARED tiles only): the weight tile dequantized by the
format's block decoder and rounded to f16 in workgroup memory (see matmul_tc.tmpl.wgsl)."""


def tc_variant(tm: int, tn: int, sm: int, sn: int, ku: int, shared: int, sg: int, fmt: str = "f16") -> str:
    """The ``matmul_tc`` variant name of a tile at subgroup size ``sg`` for weights in ``fmt``, e.g.
    ``4x2_1x1_k2_d_sg32`` (f16), ``4x4_2x2_k2_s_sg32.Q8_0``, ``4x4_2x2_k2_t_sg32`` (SHARED 2) or
    ``4x4_2x2_k2_p_sg32`` (SHARED 3; 5: ``_w``; 4, ``_v``, is no longer made)."""
    name = f"{tm}x{tn}_{sm}x{sn}_k{ku}_{TC_SHARED_LETTERS[shared]}_sg{sg}"
    return name if fmt == "f16" else f"{name}.{fmt}"


def tc_quant_chunks(tn: int, sm: int, sn: int, ku: int, sg: int) -> float:
    """Weight chunks (8 values) each thread dequantizes a step in a quantized ``matmul_tc`` tile
    (or copies, in a SHARED 2 tile)."""
    return (sn * tn * 16) * (16 * ku // 8) / (sm * sn * sg)


def tc_x_chunks(tm: int, sm: int, sn: int, ku: int, sg: int) -> float:
    """Activation chunks (8 f16 values, 16 bytes) each thread copies a step in a SHARED 2 tile."""
    return (sm * tm * 16) * (16 * ku // 8) / (sm * sn * sg)


def tc_tile_renders(tile: tuple[int, int, int, int, int, int], sg: int, quant: bool = False) -> bool:
    """Whether ``matmul_tc`` has a variant of ``tile`` at subgroup size ``sg`` (for quantized weights
    with ``quant``): the operand copies of a step must divide evenly over the subgroups (SHARED 1:
    16 x 16 matrices) or the threads (SHARED 2, 3 and 5, and every quantized weight tile: 8-value
    chunks). Quantized weights have SHARED 1, 3 and 5 tiles only (their weight tile is always
    copied in chunks: SHARED 2 would be SHARED 1 with x copied by the threads)."""
    tm, tn, sm, sn, ku, shared = tile
    if shared == 0 or (quant and shared == 2):
        return not quant
    if shared == 1:
        a_ok = tm * sm * ku % (sm * sn) == 0
    else:
        a_ok = tc_x_chunks(tm, sm, sn, ku, sg).is_integer() and tc_x_chunks(tm, sm, sn, ku, sg) >= 1
    if shared >= 2 or quant:
        w = tc_quant_chunks(tn, sm, sn, ku, sg)
        return a_ok and w.is_integer() and w >= 1
    return a_ok and tn * sn * ku % (sm * sn) == 0


def tc_fields(tm: int, tn: int, sm: int, sn: int, ku: int, shared: int, sg: int, fmt: str = "f16") -> dict[str, str]:
    """The fields of ``matmul_tc.tmpl.wgsl`` for one tile: its sizes and the code per result matrix
    (and, with SHARED, per operand copy) written out; for a GGUF ``fmt``, the block decoder and the
    per-chunk dequantizing copies of the weight tile."""
    nsg = sm * sn
    ij = [(i, j) for i in range(tm) for j in range(tn)]
    decl = [f"    let t{i} = tok(wy, sm, {i}u);" for i in range(tm)]
    decl += [f"    let r{j} = row(wx, sn, {j}u);" for j in range(tn)]
    decl += [f"    var acc{i}_{j} = subgroup_matrix_result<f32, 16, 16>();" for i, j in ij]
    init = ["    if (has_bias) {"] + [f"        acc{i}_{j} = bias_tile(sg, lane, t{i}, r{j});" for i, j in ij]
    init += ["    } else if (has_residual) {"]
    init += [f"        acc{i}_{j} = subgroupMatrixLoad<subgroup_matrix_result<f32, 16, 16>, row_major>(&residual, "
             f"t{i} * ys + params.row_offset + r{j}, ys);" for i, j in ij]
    init += ["    }"]
    left, right = "subgroup_matrix_left<f16, 16, 16>", "subgroup_matrix_right<f16, 16, 16>"
    step, pre, shmem = [], [], ""
    quant = fmt != "f16"
    if quant and not shared:
        raise ValueError(f"matmul_tc: {fmt} weights need a SHARED tile (the weight tile is dequantized in workgroup memory)")
    if quant:  # the block decoder (w_a, w_b, fetch_w8 / finish_w8)
        weight = f"// #include {BLOCKS[fmt]}.wgsl" + ("" if fmt in SPLIT_LOAD_FORMATS else "\n// #include matmul_w_direct.wgsl")
    elif shared >= 2:  # 16-byte chunks of the f16 weight, copied by the threads
        weight = "@group(0) @binding(2) var<storage, read> w_a: array<vec4<u32>>;"
    else:
        weight = "@group(0) @binding(2) var<storage, read> w_a: array<f16>;"
    xdecl = ("@group(0) @binding(1) var<storage, read> x: array<vec4<u32>>;" if shared >= 2
             else "@group(0) @binding(1) var<storage, read> x: array<f16>;")
    if shared == 4:
        raise ValueError("matmul_tc: SHARED 4 (vec4<u32> tiles read with offsets in f16 values) loads the wrong "
                         "values on Dawn, which reads them in array elements: use SHARED 5")
    double = shared >= 3  # two tiles of each operand: step s computes from one while s + 1 is stored in the other
    # SHARED 5: tiles of vec4<u32> (8 f16 values an element); the matrix loads take their offset
    # and stride in those elements, as Dawn's Vulkan backend reads them (measured: probe_tc --layouts).
    packed = shared == 5

    def products(a_src: str, b_src: str) -> list[str]:
        out = []
        for kk in range(ku):
            out.append("        {")
            out += [f"            let a{i} = subgroupMatrixLoad<{left}, row_major>({a_src.format(i=i, k=16 * kk)});" for i in range(tm)]
            out += [f"            let b{j} = subgroupMatrixLoad<{right}, col_major>({b_src.format(j=j, k=16 * kk)});" for j in range(tn)]
            out += [f"            acc{i}_{j} = subgroupMatrixMultiplyAccumulate(a{i}, b{j}, acc{i}_{j});" for i, j in ij]
            out.append("        }")
        return out

    def halves(dst: str, src: str, var: str) -> list[str]:
        """Stores 8 f16 values of the 16-byte chunk ``src`` (a vec4<u32>) at dst .. dst + 7 of ``var``."""
        out = ["        {"] + [f"            let h{c} = bitcast<vec2<f16>>({src}.{'xyzw'[c]});" for c in range(4)]
        out += [f"            {var}[{dst} + {e}u] = h{e // 2}.{'xy'[e % 2]};" for e in range(8)]
        return out + ["        }"]

    if not shared:
        decl += [f"    let xo{i} = t{i} * cols;" for i in range(tm)] + [f"    let wo{j} = r{j} * cols;" for j in range(tn)]
        step = products("&x, xo{i} + k0 + {k}u, cols", "&w_a, wo{j} + k0 + {k}u, cols")
    else:
        nbuf = "2u * " if double else ""
        elem, per = ("vec4<u32>", " / 8u") if packed else ("f16", "")
        shmem = f"var<workgroup> xs: array<{elem}, {nbuf}BM * LDS{per}>;\nvar<workgroup> ws: array<{elem}, {nbuf}BN * LDS{per}>;"
        # SHARED 1: each subgroup copies whole 16 x 16 operand matrices by matrix loads and stores.
        na, nb = (sm * tm * ku // nsg, sn * tn * ku // nsg) if shared == 1 else (0, 0)
        for n in range(na):
            q = f"({n * nsg}u + sg)"
            decl += [f"    let qa{n}_src = tok(wy, 0u, {q} / KU) * cols + {q} % KU * 16u;",
                     f"    let qa{n}_dst = {q} / KU * 16u * LDS + {q} % KU * 16u;",
                     f"    var pa{n}: {left};"]
        for n in range(nb if not quant else 0):
            q = f"({n * nsg}u + sg)"
            decl += [f"    let qb{n}_src = row(wx, 0u, {q} / KU) * cols + {q} % KU * 16u;",
                     f"    let qb{n}_dst = {q} / KU * 16u * LDS + {q} % KU * 16u;",
                     f"    var pb{n}: {right};"]
        # SHARED 2: thread i of the workgroup copies 8-value chunks i, i + WG, .. of each tile (tile
        # row chunk / (BK / 8), columns 8 (chunk % (BK / 8)) ..), activations and f16 weights alike.
        nx = int(tc_x_chunks(tm, sm, sn, ku, sg)) if shared >= 2 else 0
        for n in range(nx):
            i = f"({n}u * WG + sg * SG + lane)"
            decl += [f"    let xc{n} = {i} % (BK / 8u);",
                     f"    let xr{n} = tok(wy, 0u, {i} / (BK / 8u) / 16u) + {i} / (BK / 8u) % 16u;",
                     f"    let xd{n} = {i} / (BK / 8u) * LDS + 8u * xc{n};",
                     f"    var px{n}: vec4<u32>;"]
        nc = int(tc_quant_chunks(tn, sm, sn, ku, sg)) if quant or shared >= 2 else 0
        for n in range(nc):  # chunk i = n WG + thread: tile row i / (BK / 8), columns 8 (i % (BK / 8)) ..
            i = f"({n}u * WG + sg * SG + lane)"
            decl += [f"    let wc{n} = {i} % (BK / 8u);",
                     f"    let wr{n} = row(wx, 0u, {i} / (BK / 8u) / 16u) + {i} / (BK / 8u) % 16u;",
                     f"    let wd{n} = {i} / (BK / 8u) * LDS + 8u * wc{n};",
                     f"    var pw{n}: {'WRaw' if quant else 'vec4<u32>'};"]

        def fetch(k: str, indent: str) -> list[str]:
            wload = (lambda n: f"fetch_w8(wr{n}, ({k}) / 8u + wc{n})") if quant else (lambda n: f"w_a[wr{n} * (cols / 8u) + ({k}) / 8u + wc{n}]")
            return ([f"{indent}pa{n} = subgroupMatrixLoad<{left}, row_major>(&x, qa{n}_src + {k}, cols);" for n in range(na)]
                    + [f"{indent}pb{n} = subgroupMatrixLoad<{right}, col_major>(&w_a, qb{n}_src + {k}, cols);" for n in range(nb if not quant else 0)]
                    + [f"{indent}px{n} = x[xr{n} * (cols / 8u) + ({k}) / 8u + xc{n}];" for n in range(nx)]
                    + [f"{indent}pw{n} = {wload(n)};" for n in range(nc)])

        def stores(xo: str, wo: str) -> list[str]:
            """The prefetched registers into the tiles at xs[xo ..] and ws[wo ..]."""
            out = [f"        subgroupMatrixStore<row_major>(&xs, {xo}qa{n}_dst, pa{n}, LDS);" for n in range(na)]
            out += [f"        subgroupMatrixStore<col_major>(&ws, {wo}qb{n}_dst, pb{n}, LDS);" for n in range(nb if not quant else 0)]
            for n in range(nx):
                out += [f"        xs[({xo}xd{n}) / 8u] = px{n};"] if packed else halves(f"{xo}xd{n}", f"px{n}", "xs")
            for n in range(nc):
                if quant:
                    out += ["        {", f"            let v = finish_w8(pw{n});", "            let h = vec4<f16>(v.a);",
                            "            let g = vec4<f16>(v.b);"]
                    if packed:
                        out += [f"            ws[({wo}wd{n}) / 8u] = vec4<u32>(bitcast<u32>(h.xy), bitcast<u32>(h.zw), "
                                "bitcast<u32>(g.xy), bitcast<u32>(g.zw));"]
                    else:
                        out += [f"            ws[{wo}wd{n} + {e}u] = {'hg'[e // 4]}.{'xyzw'[e % 4]};" for e in range(8)]
                    out += ["        }"]
                elif packed:
                    out += [f"        ws[({wo}wd{n}) / 8u] = pw{n};"]
                else:
                    out += halves(f"{wo}wd{n}", f"pw{n}", "ws")
            return out

        if not double:
            pre = ["    if (k_begin < k_end) {"] + fetch("k_begin", "        ") + ["    }"]
            step = stores("", "")
            step += ["        workgroupBarrier();", "        if (k0 + BK < k_end) {"] + fetch("k0 + BK", "            ") + ["        }"]
            step += products("&xs, (sm * TM + {i}u) * 16u * LDS + {k}u, LDS", "&ws, (sn * TN + {j}u) * 16u * LDS + {k}u, LDS")
            step += ["        workgroupBarrier();"]
        else:
            # Step k0 into tile 0 and step k0 + BK in flight before the loop; at each step the
            # registers (step k0 + BK) go to the other tile, whose last reads (step k0 - BK) ended
            # before the previous barrier, step k0 + 2 BK's loads are issued, and the products
            # read this step's tile: one barrier a step.
            pre = ["    if (k_begin < k_end) {"] + fetch("k_begin", "        ")
            pre += ["    " + line for line in stores("", "")]
            pre += ["        if (k_begin + BK < k_end) {"] + fetch("k_begin + BK", "            ") + ["        }", "    }",
                                                                                                   "    workgroupBarrier();"]
            step = ["        let cur = (k0 - k_begin) / BK % 2u;", "        if (k0 + BK < k_end) {"]
            step += ["    " + line for line in stores("(1u - cur) * BM * LDS + ", "(1u - cur) * BN * LDS + ")]
            step += ["            if (k0 + 2u * BK < k_end) {"] + fetch("k0 + 2u * BK", "                ") + ["            }", "        }"]
            if not packed:
                step += products("&xs, cur * BM * LDS + (sm * TM + {i}u) * 16u * LDS + {k}u, LDS",
                                 "&ws, cur * BN * LDS + (sn * TN + {j}u) * 16u * LDS + {k}u, LDS")
            else:  # offsets and strides in vec4<u32> elements: every one a multiple of 8 f16 values
                step += products("&xs, (cur * BM * LDS + (sm * TM + {i}u) * 16u * LDS + {k}u) / 8u, LDS / 8u",
                                 "&ws, (cur * BN * LDS + (sn * TN + {j}u) * 16u * LDS + {k}u) / 8u, LDS / 8u")
            step += ["        workgroupBarrier();"]
    store = [f"    subgroupMatrixStore<row_major>(&y, (t_out + t{i}) * ys + params.row_offset + r{j}, acc{i}_{j}, ys);" for i, j in ij]
    # The silu flag (a gate_up product feeding a tensor-core down_proj): result matrices j < TN / 2
    # hold gate rows, j + TN / 2 the matching up rows (row()); each pair goes through this
    # subgroup's cs and leaves as silu(gate) up in f16, pairs of outputs a lane (silu_out).
    silu = []
    for i in range(tm):
        for j in range(tn // 2):
            silu += ["    {", f"        let c = min((wx * SN + sn) * TN * 8u + {16 * j}u, params.rows / 2u - 16u);",
                     f"        subgroupMatrixStore<row_major>(&cs, sg * 256u, acc{i}_{j}, 16u);", "        workgroupBarrier();"]
            silu += [f"        let g{e} = cs_pair(sg, lane + {e * sg}u);" for e in range(128 // sg)]
            silu += ["        workgroupBarrier();", f"        subgroupMatrixStore<row_major>(&cs, sg * 256u, acc{i}_{j + tn // 2}, 16u);",
                     "        workgroupBarrier();"]
            silu += [f"        silu_out(t{i}, c, lane + {e * sg}u, g{e}, cs_pair(sg, lane + {e * sg}u));" for e in range(128 // sg)]
            silu += ["        workgroupBarrier();", "    }"]
    return {"TM": str(tm), "TN": str(tn), "SM": str(sm), "SN": str(sn), "KU": str(ku), "SG": str(sg),
            "X": xdecl, "WEIGHT": weight, "SHMEM": shmem, "DECL": "\n".join(decl), "INIT": "\n".join(init), "PRE": "\n".join(pre),
            "STEP": "\n".join(step), "STORE": "\n".join(store),
            "STORE_SILU": "\n".join(silu)}  # an odd TN does not compile under the silu flag (its const_assert)


def tc_workgroup_bytes(tm: int, tn: int, sm: int, sn: int, ku: int, shared: int) -> int:
    """Workgroup memory of a ``matmul_tc`` tile: the bias staging, and the operand tiles with SHARED."""
    lds = 16 * ku + 8
    return sm * sn * 1024 + (2 * lds * 16 * (sm * tm + sn * tn) * (2 if shared >= 3 else 1) if shared else 0)


MATVEC_DOT_FORMATS = ("Q8_0", "Q5_0", "Q4_K")
"""Formats with an integer-dot decode matvec (``matvec_dot.tmpl.wgsl``: the block decoders' ``idot``
side; numpy_ops.INT_DOT_TYPES)."""
DOT_SCALING: dict[str, str] = {
    "Q8_0": "block", "Q5_0": "block", "Q4_0": "block",
    "Q4_K": "min", "Q4_1": "min", "Q5_1": "min",
    "Q6_K": "piece",
}
"""Formats with an int8 weight tile (the block decoders' ``i8tile`` side, rendered with ``idot``):
the integer-dot prefill matmul (``matmul_dot.tmpl.wgsl``; numpy_ops.INT_DOT_PREFILL_TYPES), and
how a tile's scales apply: ``block``, one scale per 32 values (its signed quants); ``min``, a scale
and a min per 32 values (value = d q - m, the min through the x block's d sum q); ``piece``, one
scale per 16 values (Q6_K's sub-blocks)."""
DOT_FORMATS = tuple(DOT_SCALING)
DOT_TILES = (4, 8)
"""``matmul_dot``'s tiles: TI token registers a thread (64 rows x 16 TI tokens a workgroup)."""


def dot_variant(fmt: str, ti: int) -> str:
    """The ``matmul_dot`` variant name of a format and tile, e.g. ``Q8_0_t4``."""
    return f"{fmt}_t{ti}"


def dot_fields(fmt: str, ti: int) -> dict[str, str]:
    """The fields of ``matmul_dot.tmpl.wgsl`` for weights in ``fmt`` at TI tokens a thread: the
    block decoder, the tile's token count, how a weight piece's scale is stored (`DOT_SCALING`:
    per row, (d, m) of each 32 values or d of each 16) and each thread's loads, registers and
    sums written out."""
    scaling = DOT_SCALING[fmt]
    nx = ti // 4  # x quant vec4s a thread loads a step (BM 4 of them over 256 threads)
    c = "xyzw"
    loads = "\n".join(f"    x{n}: vec4<u32>," for n in range(nx))
    fetch = "\n".join(f"    l.x{n} = a[min(m0 + i / 4u + {64 * n}u, last) * c16 + k0 / 16u + i % 4u];" for n in range(nx))
    store = "\n".join(f"    xs[(i / 4u + {64 * n}u) * PAD + i % 4u] = l.x{n};" for n in range(nx))
    if scaling == "piece":
        wstore = "    wds[r][p] = w.d;"
    else:
        wstore = "    if (p % 2u == 0u) {\n        wds[r][p] = w.d;\n        wds[r][p + 1u] = w.m;\n    }"
    acc = "\n".join(f"    var acc{i} = vec4<f32>(0.0);" for i in range(ti))
    body = []
    for j in range(4):
        body += [f"            let w{j}_{q} = ws[(tx + {16 * j}u) * PAD + {q}u];" for q in range(4)]
        body.append(f"            let dw{j} = wds[tx + {16 * j}u];")
    # The rows' scales as vec4s over the 4 rows: component k of the rows' wds.
    body += [f"            let sw{k} = vec4<f32>(dw0.{c[k]}, dw1.{c[k]}, dw2.{c[k]}, dw3.{c[k]});" for k in range(4)]
    for i in range(ti):
        body += [f"            let x{i}_{q} = xs[(ty + {16 * i}u) * PAD + {q}u];" for q in range(4)]
        body.append(f"            let dx{i} = xds[ty + {16 * i}u];")
        for b in range(2):
            if scaling == "piece":  # pieces 2b and 2b + 1 of x block b, each with its own scale
                lo = ", ".join(f"idot4(x{i}_{2 * b}, w{j}_{2 * b})" for j in range(4))
                hi = ", ".join(f"idot4(x{i}_{2 * b + 1}, w{j}_{2 * b + 1})" for j in range(4))
                body.append(f"            acc{i} = fma(vec4<f32>(vec4<i32>({lo})) * sw{2 * b} + vec4<f32>(vec4<i32>({hi})) * sw{2 * b + 1},"
                            f" vec4<f32>(dx{i}.{c[2 * b]}), acc{i});")
                continue
            sums = ", ".join(f"idot8(x{i}_{2 * b}, x{i}_{2 * b + 1}, w{j}_{2 * b}, w{j}_{2 * b + 1})" for j in range(4))
            body.append(f"            acc{i} = fma(vec4<f32>(vec4<i32>({sums})), dx{i}.{c[2 * b]} * sw{2 * b}, acc{i});")
            if scaling == "min":
                body.append(f"            acc{i} -= dx{i}.{c[2 * b + 1]} * sw{2 * b + 1};")
    put = "\n".join(f"    put(wid.z, m0 + ty + {16 * i}u, n0 + tx, acc{i});" for i in range(ti))
    return {"BLOCK": BLOCKS[fmt], "BM": str(16 * ti), "LOADS": loads, "FETCH": fetch, "STORE": store, "WSTORE": wstore,
            "ACC": acc, "BODY": "\n".join(body), "PUT": put}


MATVEC_F16_SHAPES: tuple[tuple[int, int], ...] = tuple((r, un) for r in (1, 2, 4) for un in (1, 2, 4))
"""The f16 decode matvec's variants (``matvec_f16.tmpl.wgsl``): (R rows a row group, UN units a trip)."""


def matvec_f16_variant(r: int, un: int) -> str:
    """The ``matvec_f16`` variant name of R rows a group and UN units a trip, e.g. ``r4u2``."""
    return f"r{r}u{un}"


def matvec_f16_fields(r: int, un: int) -> dict[str, str]:
    """The fields of ``matvec_f16.tmpl.wgsl`` for R rows and UN units a trip: the clamped rows'
    offsets, a full trip's R x UN loads then sums, and the one-unit tail trip, written out."""
    comp = "xyzw"
    rows = "\n".join(f"        let b{i} = weight_row(row0, {i}u) * stride;" for i in range(r))
    full = [f"            let q{k}_{i} = w_a[b{i} + u + {k}u * LANES];" for k in range(un) for i in range(r)]
    full += [f"            s.{comp[i]} += dot8(q{k}_{i}, u + {k}u * LANES);" for k in range(un) for i in range(r)]
    tail = [f"            let t{i} = w_a[b{i} + u];" for i in range(r)]
    tail += [f"            s.{comp[i]} += dot8(t{i}, u);" for i in range(r)]
    return {"R": str(r), "UN": str(un), "ROWS": rows, "FULL": "\n".join(full), "TAIL": "\n".join(tail)}


ATTENTION_TILED_SHAPES: tuple[tuple[int, int, int], ...] = (
    (64, 32, 32), (64, 32, 16), (64, 16, 32), (64, 16, 16), (128, 32, 16), (128, 16, 32), (128, 16, 16),
)
"""The prefill attention's register tiles (``attention_tiled.tmpl.wgsl``): (head_dim, BQ query rows
a workgroup, BKT keys a tile). Per head_dim the host takes `GpuTuning.attention_tiled_rows` /
``_keys`` or the default of `kjarni.gpu.attention`, else the first here that fits the device."""


def attention_tiled_variant(hd: int, bq: int, bkt: int) -> str:
    """The ``attention_tiled`` variant name, e.g. ``hd128_q32_k16``."""
    return f"hd{hd}_q{bq}_k{bkt}"


def attention_tiled_bytes(hd: int, bq: int, bkt: int) -> int:
    """Workgroup memory of an ``attention_tiled`` variant: Q [BQ, hd], K and V [BKT, hd], P
    [BKT, BQ] and the row maxima / sums [BQ, 16], all f32."""
    return 4 * (hd * bq + 2 * hd * bkt + bkt * bq + 16 * bq)


def attention_tiled_fields(hd: int, bq: int, bkt: int) -> dict[str, str]:
    """The fields of ``attention_tiled.tmpl.wgsl`` for one tile, each thread's registers written
    out: RT = BQ / 8 rows (a ``vecRT`` per key), KT = BKT / 16 keys of the scores, DV = hd / 64
    vec4s of each row's output, and NE = BKT hd / 512 K/V elements of each tile load."""
    rt, kt, dv, ne = bq // 8, bkt // 16, hd // 64, bkt * hd // 512
    comp = "xyzw"
    rows, vec4s, keys = range(rt), range(dv), range(kt)
    masked = [f"select(RV(NEG), s{j}, see{j})" for j in keys]
    part = masked[0] if kt == 1 else f"max({', '.join(masked)})"
    stores = []
    for i in rows:
        stores.append(f"    if (r + {i}u < rows) {{")
        stores.append(f"        let l{i} = row_sum(r + {i}u);")
        stores += [f"        store4(wid.z, t0 + r + {i}u, h, tx + {16 * c}u, o{i}_{c}, m.{comp[i]}, l{i});" for c in vec4s]
        stores.append("    }")
    return {
        "HEAD_DIM": str(hd), "BQ": str(bq), "BKT": str(bkt), "RT": str(rt),
        "TILE_FIELDS": "\n".join(f"    e{e}: KV," for e in range(ne)),
        "TILE_FETCH": ", ".join(f"fetch_kv(kv_head, k0, kmax, lid + {128 * e}u)" for e in range(ne)),
        "TILE_STORE": "\n".join(f"        store_kv(lid + {128 * e}u, tile.e{e});" for e in range(ne)),
        "SEES": ", ".join(f"visible(key, pos + {i}u)" for i in rows),
        "O_DECL": "\n".join(f"    var o{i}_{c} = vec4<f32>(0.0);  // row RT ty + {i}, dims 4 (tx + {16 * c}) .." for i in rows for c in vec4s),
        "S_DECL": "\n".join(f"        var s{j} = RV(0.0);" for j in keys),
        "S_BODY": "\n".join([f"            let q{i} = q_sh[d4 * BQ + RT * ty + {i}u];" for i in rows]
                            + [line for j in keys for line in (
                                f"            let k{j} = k_sh[d4 * BKT + tx + {16 * j}u];",
                                f"            s{j} += RV({', '.join(f'dot(q{i}, k{j})' for i in rows)});")]),
        "S_MASK": "\n".join([f"        let see{j} = sees(k0 + tx + {16 * j}u, pos0);" for j in keys]
                            + [f"        let part = {part};"]),
        "RED_MAX": "\n".join(f"        red[(RT * ty + {i}u) * 16u + tx] = part.{comp[i]};" for i in rows),
        "ROW_MAXES": ", ".join(f"row_max(RT * ty + {i}u)" for i in rows),
        "P_EXP": "\n".join([f"        let p{j} = select(RV(0.0), exp(s{j} - m_new), see{j});" for j in keys]
                           + [f"        l = l * corr + {' + '.join(f'p{j}' for j in keys)};"]),
        "P_STORE": "\n".join(f"        p_sh[(tx + {16 * j}u) * 8u + ty] = p{j};  // P [key][ty]" for j in keys),
        "O_SCALE": "\n".join(f"        o{i}_{c} *= corr.{comp[i]};" for i in rows for c in vec4s),
        "PV_BODY": "\n".join([f"            let v{c} = v_sh[j * D4 + tx + {16 * c}u];" for c in vec4s]
                             + [f"            o{i}_{c} = fma(vec4<f32>(p.{comp[i]}), v{c}, o{i}_{c});" for i in rows for c in vec4s]),
        "RED_SUM": "\n".join(f"    red[(RT * ty + {i}u) * 16u + tx] = l.{comp[i]};" for i in rows),
        "STORE_ROWS": "\n".join(stores),
    }


ATTENTION_TC_SHAPES: tuple[tuple[int, int, int, int, int], ...] = tuple(
    (hd, ms, sg, nw, bkt) for hd in (64, 128) for ms, sg in ((16, 32), (16, 64), (8, 8)) for nw, bkt in ((4, 32), (2, 32), (4, 64))
    if nw * ms <= 2 * bkt and bkt % (sg // ms) == 0 and bkt * hd // 4 % (nw * sg) == 0
)
"""The tensor-core prefill attention's variants (``attention_tc.tmpl.wgsl``): (head_dim, MS the
f16 matrix size, SG the subgroup size of that configuration, NW subgroups a workgroup (NW MS query
rows), BKT keys a tile): 16 x 16 matrices at subgroup size 32 (NVIDIA) or 64, 8 x 8 at 8
(Mesa's lavapipe)."""


def attention_tc_variant(hd: int, ms: int, sg: int, nw: int, bkt: int) -> str:
    """The ``attention_tc`` variant name, e.g. ``hd128_m16_sg32_w4_k32``."""
    return f"hd{hd}_m{ms}_sg{sg}_w{nw}_k{bkt}"


def attention_tc_bytes(hd: int, ms: int, sg: int, nw: int, bkt: int) -> int:
    """Workgroup memory of an ``attention_tc`` variant: the K and V tiles (f16, rows padded by 8),
    the subgroups' scores (f32) and P (f16), the rows' m and l, and the online pass's row scales
    and flags."""
    return 2 * 2 * bkt * (hd + 8) + 4 * nw * ms * bkt + 2 * nw * ms * bkt + 8 * nw * ms + 4 * nw * ms + 4 * max(nw, 4)


def attention_tc_fields(hd: int, ms: int, sg: int, nw: int, bkt: int) -> dict[str, str]:
    """The fields of ``attention_tc.tmpl.wgsl``: its sizes and the subgroup-matrix code written
    out (Q's left matrices, S = Q K^T per MS keys, O += P V per MS dims, the output stores)."""
    left, right, result = (f"subgroup_matrix_{kind}<{t}, {ms}, {ms}>" for kind, t in (("left", "f16"), ("right", "f16"), ("result", "f32")))
    dims, keys = range(hd // ms), range(bkt // ms)
    q_load = [f"    let qm{k} = subgroupMatrixLoad<{left}, row_major>(&kv, sg * MS * LDS + {k * ms}u, LDS);" for k in dims]
    s_body = []
    for j in keys:
        s_body += ["        {", f"            var s = {result}();"]
        s_body += [f"            s = subgroupMatrixMultiplyAccumulate(qm{k}, subgroupMatrixLoad<{right}, col_major>(&kv, {j * ms}u * LDS + "
                   f"{k * ms}u, LDS), s);" for k in dims]
        s_body += [f"            subgroupMatrixStore<col_major>(&s_sh, sbase + {j * ms}u * MS, s, MS);", "        }"]
    pv = []
    for j in keys:
        pv += ["        {", f"            let pl = subgroupMatrixLoad<{left}, col_major>(&p_sh, sbase + {j * ms}u * MS, MS);"]
        pv += [f"            o{d} = subgroupMatrixMultiplyAccumulate(pl, subgroupMatrixLoad<{right}, row_major>(&kv, BKT * LDS + "
               f"{j * ms}u * LDS + {d * ms}u, LDS), o{d});" for d in dims]
        pv += ["        }"]
    store = []
    for d in dims:
        store += ["    workgroupBarrier();", f"    subgroupMatrixStore<row_major>(&s_sh, sbase, o{d}, MS);", "    workgroupBarrier();",
                  "    for (var e = lane; e < MS * MS; e += SG) {", "        let t = t0 + sg * MS + e / MS;",
                  "        if (t < params.tokens) {",
                  f"            store(wid.z, t, h, {d * ms}u + e % MS, s_sh[sbase + e], ml_sh[sg * MS + e / MS]);",
                  "        }", "    }"]
    rescale = []  # online: each O matrix through s_sh, its rows times alpha_sh
    for d in dims:
        rescale += ["            workgroupBarrier();", f"            subgroupMatrixStore<row_major>(&s_sh, sbase, o{d}, MS);",
                    "            workgroupBarrier();", "            for (var e = lane; e < MS * MS; e += SG) {",
                    "                s_sh[sbase + e] *= alpha_sh[sg * MS + e / MS];", "            }", "            workgroupBarrier();",
                    f"            o{d} = subgroupMatrixLoad<{result}, row_major>(&s_sh, sbase, MS);"]
    loads = range(bkt * hd // 4 // (nw * sg))  # a thread's K (and V) loads of a tile
    fetch = []
    for n in loads:
        fetch += ["    {", f"        let i = lid + {n}u * WG;", "        let key = k0 + i / D4;", "        if (key <= kmax) {",
                  f"            t.k{n} = raw_k4(kv_head, key, i % D4);", "            if (v) {",
                  f"                t.v{n} = raw_v4(kv_head, key, i % D4);", "            }", "        }", "    }"]
    tile_store = []
    for n in loads:
        tile_store += ["    {", f"        let i = lid + {n}u * WG;", "        let at = i / D4 * LDS + 4u * (i % D4);",
                       f"        put4(at, kv_unpack(t.k{n}));", "        if (v) {", f"            put4(BKT * LDS + at, kv_unpack(t.v{n}));",
                       "        }", "    }"]
    return {"HEAD_DIM": str(hd), "MS": str(ms), "SG": str(sg), "NW": str(nw), "BKT": str(bkt), "Q_LOAD": "\n".join(q_load),
            "TILE_FIELDS": "\n".join(f"    k{n}: KVRaw,\n    v{n}: KVRaw," for n in loads),
            "TILE_FETCH": "\n".join(fetch), "TILE_STORE": "\n".join(tile_store),
            "S_BODY": "\n".join(s_body), "O_DECL": "\n".join(f"    var o{d} = {result}();" for d in dims),
            "PV_BODY": "\n".join(pv), "RESCALE": "\n".join(rescale), "STORE": "\n".join(store)}


TEMPLATES: dict[str, dict[str, dict[str, str]]] = {
    "matvec": {fmt: {"BLOCK": block} for fmt, block in BLOCKS.items()},
    # The integer-dot decode product (x quantized to int8 blocks): formats whose block decoder has
    # an `idot` side (render with the flag "idot").
    "matvec_dot": {fmt: {"BLOCK": BLOCKS[fmt]} for fmt in MATVEC_DOT_FORMATS},
    # The integer-dot prefill matmul (render with the flags "idot" and "i8tile").
    "matmul_dot": {dot_variant(fmt, ti): dot_fields(fmt, ti) for fmt in DOT_FORMATS for ti in DOT_TILES},
    # The f16 decode product, one variant per (rows a group, units a trip), loads written out.
    "matvec_f16": {matvec_f16_variant(r, un): matvec_f16_fields(r, un) for r, un in MATVEC_F16_SHAPES},
    "matmul": {fmt: {"BLOCK": block, "W8": "" if fmt in SPLIT_LOAD_FORMATS else "// #include matmul_w_direct.wgsl"}
               for fmt, block in BLOCKS.items()},
    "embed": {fmt: {"BLOCK": block} for fmt, block in BLOCKS.items()},
    "attention_tiled": {attention_tiled_variant(*shape): attention_tiled_fields(*shape) for shape in ATTENTION_TILED_SHAPES},
    "attention_tc": {attention_tc_variant(*shape): attention_tc_fields(*shape) for shape in ATTENTION_TC_SHAPES},
    "matmul_sgmat": {
        sgmat_variant(bm, bn, bk, sm, sn, sg): sgmat_fields(bm, bn, bk, sm, sn, sg)
        for bm, bn, bk, sm, sn in SGMAT_TILES for sg in (32, 64)
        if bn * bk % (8 * sm * sn * sg) == 0 and bm * bk % (4 * sm * sn * sg) == 0  # whole loads per thread
    },
    "matmul_tc": {
        tc_variant(*tile, sg): tc_fields(*tile, sg)
        for tile in TC_TILES for sg in (32, 64) if tc_tile_renders(tile, sg)
    } | {
        tc_variant(*tile, sg, fmt): tc_fields(*tile, sg, fmt)
        for tile in TC_TILES for sg in (32, 64) for fmt in TC_QUANT_FORMATS if tc_tile_renders(tile, sg, quant=True)
    },
}
"""Template -> variant -> the values of its ``{{NAME}}`` fields."""


def has_template(op: str, variant: str) -> bool:
    return variant in TEMPLATES.get(op, {})


@functools.cache
def template(op: str, variant: str, flags: frozenset[str] = frozenset()) -> str:
    """``shaders/<op>.tmpl.wgsl`` with the fields of ``TEMPLATES[op][variant]`` filled in, then
    includes pasted and ``#if`` blocks resolved for ``flags``."""
    text = raw_source(op + ".tmpl.wgsl")
    for name, value in TEMPLATES[op][variant].items():
        text = text.replace("{{" + name + "}}", value)
    if "{{" in text:
        raise ValueError(f"{op}.tmpl.wgsl: unfilled field in variant {variant!r}")
    return _preprocess(text, flags, f"{op}.tmpl.wgsl[{variant}]")


def _preprocess(text: str, flags: frozenset[str], where: str) -> str:
    out: list[str] = []
    keep = [True]  # one entry per open #if: whether its current branch is kept (and all outer ones)
    for line in text.splitlines():
        m = _DIRECTIVE.match(line)
        if not m:
            if keep[-1]:
                out.append(line)
            continue
        kind, arg = m.groups()
        if kind == "include":
            if keep[-1]:
                out.append(_preprocess(raw_source(arg), flags, arg))
        elif kind == "if":
            keep.append(keep[-1] and arg in flags)
        elif kind == "else":
            if len(keep) < 2:
                raise ValueError(f"{where}: #else without #if")
            keep[-1] = keep[-2] and not keep[-1]
        else:
            if len(keep) < 2:
                raise ValueError(f"{where}: #endif without #if")
            keep.pop()
    if len(keep) != 1:
        raise ValueError(f"{where}: unterminated #if")
    return "\n".join(out) + "\n"


def struct_fields(wgsl: str, struct_name: str = "Params") -> list[tuple[str, str]]:
    """``[(field, type), ...]`` of ``struct <struct_name>`` in WGSL source (for the layout test)."""
    m = re.search(r"struct\s+" + struct_name + r"\s*\{(.*?)\}", wgsl, re.S)
    if not m:
        return []
    body = re.sub(r"//[^\n]*", "", m.group(1))
    return [(name, kind) for name, kind in re.findall(r"(\w+)\s*:\s*(\w+)\s*,?", body)]
