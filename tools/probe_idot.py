"""Probe: an integer-dot (dot4I8Packed) prefill matmul for Q8_0 weights, against the SIMT matmul
kjarni runs today, on one runtime (issue 12: wgpu-native's prefill is f32 SIMT; llama.cpp's
Vulkan backend multiplies quantized weights by int8-quantized activations with the GPU's integer
dot product where it has no cooperative matrices). A measurement to decide whether to build
the path into kjarni, not a kernel kjarni runs.

Per Qwen2.5 prefill product (random Q8_0 weights, ``--tokens`` random activations): the activations
are quantized in numpy as the decode product quantizes them (numpy_ops.quantize_activations: int8
blocks of 32, scale max|v| / 127) and uploaded; the probe kernel sums dot4I8Packed per block and
scales by the two block scales in f32: 256 threads, 64 rows a workgroup, K 64 a step through
workgroup memory with the next step's loads in flight, and 4 x 4 outputs a thread (``idot_t4``,
64 tokens a workgroup) or 8 x 4 (``idot_t8``, 128 tokens). Printed per shape (JSON): each
kernel's time and TFLOP/s beside the SIMT matmul's (WgpuOps' prefill of the float activations by
the same weight) and the time of ``prep``, the GPU quantization of x a real path would run first
(one workgroup a token; its quants and scales are compared with numpy's and the differing ones
counted), and each probe kernel's max error against float64 x8 @ W relative to max |y|.

    python tools/probe_idot.py [--runtime dawn] [--model qwen2.5-1.5b] [--tokens 512]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = {"qwen2.5-0.5b": (896, 4864, 1152), "qwen2.5-1.5b": (1536, 8960, 2048)}
BN = 64  # rows a workgroup (16 threads x 4); tokens: 16 threads x TI (kernel_source)
KS = 64  # values of K a step (two Q8_0 blocks: 4 vec4<u32> of int8 quants a row)
PAD = 5  # vec4 a tile row (4 + 1 against bank conflicts)


def kernel_source(ti: int) -> str:
    """The probe kernel with TI (4 or 8) tokens x 4 rows a thread (BM = 16 TI tokens a workgroup),
    its products written out."""
    bm = 16 * ti
    nx = bm * 4 // 256  # x vec4 a thread loads a step
    comp = "xyzw"
    body = []
    for i in range(ti):
        body += [f"            let x{i}_{q} = xs[(ty + {16 * i}u) * PAD + {q}u];" for q in range(4)]
        body += [f"            let dx{i} = vec2<f32>(xds[(ty + {16 * i}u) * 2u], xds[(ty + {16 * i}u) * 2u + 1u]);"]
    for j in range(4):
        body += [f"            let w{j}_{q} = ws[(tx + {16 * j}u) * PAD + {q}u];" for q in range(4)]
        body += [f"            let dw{j} = vec2<f32>(wds[(tx + {16 * j}u) * 2u], wds[(tx + {16 * j}u) * 2u + 1u]);"]
    for i in range(ti):
        for b in range(2):
            sums = ", ".join(f"idot8(x{i}_{2 * b}, x{i}_{2 * b + 1}, w{j}_{2 * b}, w{j}_{2 * b + 1})" for j in range(4))
            scales = ", ".join(f"dw{j}.{comp[b]}" for j in range(4))
            body.append(f"            acc{i} = fma(vec4<f32>(vec4<i32>({sums})), dx{i}.{comp[b]} * vec4<f32>({scales}), acc{i});")
    store = []
    for i in range(ti):
        store.append(f"    {{\n        let t = m0 + ty + {16 * i}u;\n        if (t < params.tokens) {{")
        store += [f"            if (n0 + tx + {16 * j}u < params.rows) {{ y[t * params.rows + n0 + tx + {16 * j}u] = acc{i}.{comp[j]}; }}"
                  for j in range(4)]
        store.append("        }\n    }")
    return f"""
struct Params {{
    tokens: u32,
    rows: u32,
    cols: u32,
    _pad: u32,
}}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> xq: array<vec4<u32>>;  // [tokens, cols / 16]: int8 quants
@group(0) @binding(2) var<storage, read> xd: array<f32>;        // [tokens, cols / 32]: block scales
@group(0) @binding(3) var<storage, read> wq: array<vec4<u32>>;  // Q8_0 w_a: [rows, cols / 16]
@group(0) @binding(4) var<storage, read> wd: array<u32>;        // Q8_0 w_b: f16 scale pairs
@group(0) @binding(5) var<storage, read_write> y: array<f32>;   // [tokens, rows]

const PAD: u32 = {PAD}u;
var<workgroup> xs: array<vec4<u32>, {bm} * PAD>;
var<workgroup> ws: array<vec4<u32>, {BN} * PAD>;
var<workgroup> xds: array<f32, {2 * bm}>;
var<workgroup> wds: array<f32, {2 * BN}>;

fn idot8(a0: vec4<u32>, a1: vec4<u32>, b0: vec4<u32>, b1: vec4<u32>) -> i32 {{
    return dot4I8Packed(a0.x, b0.x) + dot4I8Packed(a0.y, b0.y) + dot4I8Packed(a0.z, b0.z) + dot4I8Packed(a0.w, b0.w)
         + dot4I8Packed(a1.x, b1.x) + dot4I8Packed(a1.y, b1.y) + dot4I8Packed(a1.z, b1.z) + dot4I8Packed(a1.w, b1.w);
}}

struct Loads {{
    x0: vec4<u32>,
    x1: vec4<u32>,
    w: vec4<u32>,
    dx0: f32,
    dx1: f32,
    dw: f32,
}}

// Thread i's share of the step at k0: vec4 e % 4 of tile row e / 4 of x for e = i (and i + 256
// when the tile has 512), the same of W for e = i; the scale of x block e % 2 of row e / 2 for
// e = i, i + 256 below 2 BM, and that of W for e = i below 2 BN.
fn fetch(k0: u32, m0: u32, n0: u32, i: u32) -> Loads {{
    let c16 = params.cols / 16u;
    let nb = params.cols / 32u;
    let last = params.tokens - 1u;
    let r = min(n0 + i / 4u, params.rows - 1u);
    var l = Loads();
    l.x0 = xq[min(m0 + i / 4u, last) * c16 + k0 / 16u + i % 4u];
    if ({nx}u > 1u) {{
        l.x1 = xq[min(m0 + (i + 256u) / 4u, last) * c16 + k0 / 16u + i % 4u];
    }}
    if (i < {BN * 4}u) {{
        l.w = wq[r * c16 + k0 / 16u + i % 4u];
    }}
    let b = k0 / 32u + i % 2u;
    if (i < {2 * bm}u) {{
        l.dx0 = xd[min(m0 + i / 2u, last) * nb + b];
    }}
    if (i + 256u < {2 * bm}u) {{
        l.dx1 = xd[min(m0 + (i + 256u) / 2u, last) * nb + b];
    }}
    if (i < {2 * BN}u) {{
        let rr = min(n0 + i / 2u, params.rows - 1u);
        l.dw = unpack2x16float(wd[rr * ((nb + 1u) / 2u) + b / 2u])[b & 1u];
    }}
    return l;
}}

fn store(l: Loads, i: u32) {{
    xs[(i / 4u) * PAD + i % 4u] = l.x0;
    if ({nx}u > 1u) {{
        xs[((i + 256u) / 4u) * PAD + i % 4u] = l.x1;
    }}
    if (i < {BN * 4}u) {{
        ws[(i / 4u) * PAD + i % 4u] = l.w;
    }}
    if (i < {2 * bm}u) {{
        xds[i] = l.dx0;
    }}
    if (i + 256u < {2 * bm}u) {{
        xds[i + 256u] = l.dx1;
    }}
    if (i < {2 * BN}u) {{
        wds[i] = l.dw;
    }}
}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
    let n0 = wid.x * {BN}u;
    let m0 = wid.y * {bm}u;
    let tx = lid % 16u;
    let ty = lid / 16u;
{chr(10).join(f"    var acc{i} = vec4<f32>(0.0);" for i in range(ti))}
    var next = fetch(0u, m0, n0, lid);
    for (var k0 = 0u; k0 < params.cols; k0 += {KS}u) {{
        workgroupBarrier();
        store(next, lid);
        workgroupBarrier();
        if (k0 + {KS}u < params.cols) {{
            next = fetch(k0 + {KS}u, m0, n0, lid);
        }}
        {{
{chr(10).join(body)}
        }}
    }}
{chr(10).join(store)}
}}
"""


PREP_WGSL = """
struct Params {
    tokens: u32,
    rows: u32,
    cols: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;        // [tokens, cols]
@group(0) @binding(2) var<storage, read_write> xq: array<vec4<u32>>;  // [tokens, cols / 16]
@group(0) @binding(3) var<storage, read_write> xd: array<f32>;        // [tokens, cols / 32]

fn pack(v: vec4<f32>, inv: f32) -> u32 {
    return pack4xI8(vec4<i32>(round(v * inv)));
}

// One workgroup per token row; thread b quantizes blocks b, b + 256, .. of 32 values as
// numpy_ops.quantize_activations does: q = round(v 127 / max|v|), d = max|v| / 127.
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    let nb = params.cols / 32u;
    for (var b = lid; b < nb; b += 256u) {
        let o = t * params.cols / 4u + b * 8u;
        let v0 = x[o]; let v1 = x[o + 1u]; let v2 = x[o + 2u]; let v3 = x[o + 3u];
        let v4 = x[o + 4u]; let v5 = x[o + 5u]; let v6 = x[o + 6u]; let v7 = x[o + 7u];
        let m4 = max(max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3))), max(max(abs(v4), abs(v5)), max(abs(v6), abs(v7))));
        let m = max(max(m4.x, m4.y), max(m4.z, m4.w));
        let inv = select(0.0, 127.0 / m, m > 0.0);
        let q = t * params.cols / 16u + b * 2u;
        xq[q] = vec4<u32>(pack(v0, inv), pack(v1, inv), pack(v2, inv), pack(v3, inv));
        xq[q + 1u] = vec4<u32>(pack(v4, inv), pack(v5, inv), pack(v6, inv), pack(v7, inv));
        xd[t * nb + b] = m / 127.0;
    }
}
"""
"""The activations' quantization a real integer-dot path would run first, timed with the probe."""


def main() -> None:
    import wgpu
    from bench_gpu import random_quant
    from gputime import record, time_lists, time_once

    from kjarni.gpu import GpuTensor, WgpuOps, quant
    from kjarni.gpu.context import WgpuContext
    from kjarni.numpy_ops import quantize_activations, quantize_blocks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", default=None, help="wgpu (wgpu-native, the default) or dawn")
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    ctx = WgpuContext(None, runtime=args.runtime)
    if not ctx.has_timestamps:
        raise SystemExit("probe_idot: this adapter has no timestamp queries")
    prep_module = ctx.device.create_shader_module(code=PREP_WGSL, label="probe_idot_prep")
    prep = ctx.device.create_compute_pipeline(layout="auto", compute={"module": prep_module, "entry_point": "main"})
    pipelines = {}
    for ti in (4, 8):
        module = ctx.device.create_shader_module(code=kernel_source(ti), label=f"probe_idot_t{ti}")
        pipelines[ti] = ctx.device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
    hidden, inter, qkv = MODELS[args.model]
    rng = np.random.default_rng(0)
    tokens = args.tokens
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST

    def buffer(a: np.ndarray):
        return ctx.device.create_buffer_with_data(data=np.ascontiguousarray(a).tobytes(), usage=usage)

    for name, (rows, cols) in {"qkv": (qkv, hidden), "o_proj": (hidden, hidden), "gate_up": (2 * inter, hidden),
                               "down": (hidden, inter)}.items():
        qt = random_quant("q8_0", (rows, cols), rng)
        rw = quant.repack(qt)
        x = rng.standard_normal((tokens, cols), dtype=np.float32)
        x8 = quantize_activations(x)
        q, xd = quantize_blocks(x)
        want = x8.astype(np.float64) @ qt.dequantize().astype(np.float64).T
        params = ctx.device.create_buffer_with_data(data=np.array([tokens, rows, cols, 0], np.uint32).tobytes(),
                                                    usage=wgpu.BufferUsage.UNIFORM)
        inputs = [params, buffer(q.view(np.uint32).reshape(tokens, -1)), buffer(xd), buffer(rw.w_a), buffer(rw.w_b)]
        lists, errors = {}, {}
        # The GPU's own quantization of x, into separate buffers: timed, and compared with numpy's.
        gq = ctx.device.create_buffer(size=tokens * cols, usage=usage)
        gd = ctx.device.create_buffer(size=tokens * cols // 8, usage=usage)
        prep_group = ctx.device.create_bind_group(layout=prep.get_bind_group_layout(0), entries=[
            {"binding": b, "resource": {"buffer": buf, "offset": 0, "size": buf.size}}
            for b, buf in enumerate([params, buffer(x), gq, gd])])
        prep_call = (prep, prep_group, (tokens, 1, 1))
        time_once(ctx, [prep_call])  # runs it (its time is not kept)
        same_q = np.frombuffer(ctx.queue.read_buffer(gq), np.int8) == q.reshape(-1)
        same_d = np.frombuffer(ctx.queue.read_buffer(gd), np.float32) == xd.reshape(-1)
        lists["prep"] = [prep_call]
        for ti, pipeline in pipelines.items():
            y = ctx.device.create_buffer(size=tokens * rows * 4, usage=usage)
            group = ctx.device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=[
                {"binding": b, "resource": {"buffer": buf, "offset": 0, "size": buf.size}} for b, buf in enumerate([*inputs, y])])
            call = (pipeline, group, (-(-rows // BN), -(-tokens // (16 * ti)), 1))
            time_once(ctx, [call])
            got = np.frombuffer(ctx.queue.read_buffer(y), np.float32).reshape(tokens, rows)
            errors[f"idot_t{ti}"] = float(f"{float(np.abs(got - want).max() / np.abs(want).max()):.2e}")
            lists[f"idot_t{ti}"] = [call]
        # The SIMT matmul kjarni runs for this product today, on the float activations.
        ops = WgpuOps(ctx, weight_format="f16")
        ops.tuning.tensor_cores = False
        weight = ops.weight(qt, name=f"{name}.weight")
        xt = GpuTensor(ctx.scratch(x.nbytes), x.shape)
        ctx.queue.write_buffer(xt.buffer, 0, x)
        calls, out = record(ctx, lambda ops=ops, xt=xt, weight=weight: ops.linear(xt, weight))
        ops.read(out)
        lists["simt"] = calls
        times = time_lists(ctx, lists, args.passes, args.reps, 0.5)
        flops = 2.0 * tokens * rows * cols
        print(json.dumps({"shape": name, "rows": rows, "cols": cols, "tokens": tokens, "runtime": ctx.runtime.name,
                          "adapter": ctx.description, "us": {k: round(1e6 * t, 1) for k, t in times.items()},
                          "tflops": {k: round(flops / t / 1e12, 1) for k, t in times.items() if k != "prep"}, "rel_err": errors,
                          "prep_quants_differing": int((~same_q).sum()), "prep_scales_differing": int((~same_d).sum()),
                          "simt_kernels": sorted({p.kjarni_name.split(":")[0] for p, _, _ in calls})}), flush=True)
        ops.close()


if __name__ == "__main__":
    main()
