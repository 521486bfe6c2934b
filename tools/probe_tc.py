"""Where a tensor-core prefill product's time goes (issue 20), on a Dawn adapter with f16 subgroup
matrices: ``matmul_tc`` tiles timed whole and with parts of their K loop left out, and what
``subgroupMatrixLoad`` of an f16 matrix reads from workgroup arrays of other element types. Prints
JSON lines as they come (a run cut short keeps what it printed).

Probes of a tile (each a text edit of the rendered kernel; only ``full`` computes the product):

  full      the kernel as shipped
  copy      the global loads, workgroup stores and barriers, but one matrix product a step
            instead of TM x TN (the other operands' loads then fall away too)
  noglobal  no loads from storage in the K loop: the workgroup tiles are stored from stale registers
  nosync    noglobal without the loop's barriers (stores, operand loads, products)
  smem_mma  nosync without the stores: the operand loads from workgroup memory and the products
  mma       the operands loaded once before the loop: the products alone
  nostore   the kernel as shipped but its results stored only by the workgroups of the first
            row (or, token-major, token) tile: the cost of the result stores (36.7 MB of f32 for
            the 1.5B gate_up). The K loop stays whole (its barriers and workgroup stores keep the
            compiler from moving it into the store's branch)

Time per probe is GPU time of the matmul_tc dispatch alone (the f16 activation prep not counted)
from timestamp queries: every probe of a tile is compiled and recorded first, then all are timed
in one command buffer on a warm GPU (``--warm-ms`` of work, then ``--passes`` rounds of a pass per
probe of ``--reps`` products back to back, the median round counting: tools/gputime.py; before the
seventeenth session each probe was timed right after its compile, while an H100 may idle at 345
MHz, so those sessions' probe figures mix clocks); ``tflops`` is the whole product's FLOPs over that time, so a
probe's figure is the rate the product would run at if only that part cost anything.

``--mma-peak`` times products on registers alone (NA x NB operand matrices, NA x NB accumulators,
NSG subgroups a workgroup): the ceiling of any tile at that register load on this stack.

``--pad-shared BYTES`` adds that much unused workgroup memory to every probe of a tile (touched only
when ``rows`` is 0, never here, so nothing else changes): if a SHARED 1 tile padded to a SHARED 3
tile's size loses what SHARED 3 loses, workgroup memory (fewer workgroups an SM) is the cause.

``--layouts`` loads a 16 x 16 f16 left (row-major) and right (column-major) matrix from workgroup
arrays of f16, u32, vec2<f16> and vec4<u32> with an offset and stride and says whether Dawn read
them in halves (the WGSL meaning of offset and stride) or in units of the array's element.

    python tools/probe_tc.py --layouts
    python tools/probe_tc.py --mma-peak 1x1x4,2x2x4,4x4x4,4x2x8
    python tools/probe_tc.py --model qwen2.5-1.5b --shapes gate_up --tc-tiles 4x4_2x2_k2_s,4x4_2x2_k2_t
    python tools/probe_tc.py --shapes gate_up --tc-tiles 4x4_2x2_k2_s --probes full,mma --pad-shared 20480
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kjarni.gpu import kernels  # noqa: E402
from gputime import record, time_lists  # noqa: E402
from sweep_sgmat import product, product_inputs, shapes  # noqa: E402

PROBES = ("full", "copy", "noglobal", "nosync", "smem_mma", "mma", "nostore")

_GLOBAL = re.compile(r"^\s*p[abxw]\d+ = ")  # the prefetches from storage (PRE and the loop)
_STORE = re.compile(r"^\s*([xw]s\[|subgroupMatrixStore<\w+>\(&[xw]s,)")
_LOOP_BARRIER = re.compile(r"^ {8}workgroupBarrier\(\);$")  # the K loop's (bias_tile's are deeper)
_MMA = re.compile(r"^\s*acc(\d+)_(\d+) = subgroupMatrixMultiplyAccumulate")
_OPERAND = re.compile(r"^\s*let ([ab]\d+) = (subgroupMatrixLoad<.*\(&[xw]s, .*\));$")
_RESULT_STORE = re.compile(r"^(\s*)(subgroupMatrixStore<row_major>\(&y, .*;)$")


def pad_shared(source: str, nbytes: int) -> str:
    """``source`` with ``nbytes`` more workgroup memory, written and read only when ``params.rows``
    is 0 (never for a real product), so the driver allocates it and nothing else runs."""
    if nbytes <= 0:
        return source
    lines = source.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("var<workgroup> cs:"))
    lines.insert(at + 1, f"var<workgroup> pad_shared: array<u32, {-(-nbytes // 4)}u>;")
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("let t_out = "))
    lines.insert(at + 1, "    if (params.rows == 0u) { pad_shared[lane] = pad_shared[lane + 1u] + 1u; y[0] = f32(pad_shared[lane]); }")
    return "\n".join(lines) + "\n"


def probe_source(source: str, probe: str) -> str:
    """The rendered ``matmul_tc`` kernel with the parts ``probe`` leaves out deleted."""
    if probe == "full":
        return source
    out, hoisted = [], {}
    lines = source.splitlines()
    if probe == "nostore":
        return "\n".join(_RESULT_STORE.sub(r"\1if (wid.x == 0u) { \2 }", line) for line in lines) + "\n"
    for line in lines:
        if probe == "copy":
            m = _MMA.match(line)
            if m and (m.group(1), m.group(2)) != ("0", "0"):
                continue
        if probe in ("noglobal", "nosync", "smem_mma", "mma") and _GLOBAL.match(line):
            continue
        if probe in ("nosync", "smem_mma", "mma") and _LOOP_BARRIER.match(line):
            continue
        if probe in ("smem_mma", "mma") and _STORE.match(line):
            continue
        if probe == "mma":
            m = _OPERAND.match(line)
            if m:  # the first K step's operand (the first tile of SHARED 3 and 5), loaded once before the loop
                hoisted.setdefault(m.group(1), f"    let {m.group(1)} = {m.group(2).replace('cur * ', '0u * ')};")
                continue
        out.append(line)
    if probe == "mma":
        at = next(i for i, line in enumerate(out) if line.lstrip().startswith("for (var k0 = k_begin;"))
        out[at:at] = list(hoisted.values())
    return "\n".join(out) + "\n"


LAYOUT_KERNEL = """enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;

@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f16>;

var<workgroup> ws: array<{T}, {N}u>;

@compute @workgroup_size(128)
fn main(@builtin(local_invocation_index) i: u32, @builtin(subgroup_id) sg: u32) {{
    for (var j = i; j < {N}u; j += 128u) {{
{FILL}
    }}
    workgroupBarrier();
    if (sg == 0u) {{
        let a = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&ws, {OFF}u, {STRIDE}u);
        subgroupMatrixStore<row_major>(&dst, 0u, a, 16u);
        let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&ws, {OFF}u, {STRIDE}u);
        subgroupMatrixStore<col_major>(&dst, 256u, b, 16u);
    }}
}}
"""
LAYOUT_FILL = {  # element type: (halves an element, the statement filling ws[j] from src's words)
    "f16": (1, "        ws[j] = bitcast<vec2<f16>>(src[j / 2u])[j % 2u];"),
    "u32": (2, "        ws[j] = src[j];"),
    "vec2<f16>": (2, "        ws[j] = bitcast<vec2<f16>>(src[j]);"),
    "vec4<u32>": (8, "        ws[j] = vec4<u32>(src[4u * j], src[4u * j + 1u], src[4u * j + 2u], src[4u * j + 3u]);"),
}


MMA_KERNEL = """enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;

@group(0) @binding(0) var<storage, read_write> y: array<f32>;
@group(0) @binding(1) var<storage, read> src: array<f16>;

@compute @workgroup_size({WG})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(subgroup_id) sg: u32) {{
{DECL}
    for (var i = 0u; i < {ITERS}u; i++) {{
{MMA}
    }}
{STORE}
}}
"""


def mma_peak(ctx, configs: str, iters: int, reps: int) -> None:
    """The rate of f16 subgroup-matrix products on registers alone: NA left x NB right operands
    loaded once, NA x NB accumulators, ITERS products each per subgroup, NSG subgroups a
    workgroup, 8 workgroups per multiprocessor-sized grid. The ceiling any matmul_tc tile here
    can reach at that register load."""
    sg = ctx.f16_matrix_subgroup
    src = ctx.upload(np.full(4096, 0.01, dtype=np.float16), "mma.src")  # 16 matrices of 256 halves
    for item in configs.split(","):
        na, nb, nsg = (int(v) for v in item.split("x"))
        groups = 132 * 8  # 8 workgroups per multiprocessor of an H100 / H200
        entry: dict = {"probe": "mma_peak", "left": na, "right": nb, "subgroups": nsg, "iters": iters}
        try:
            decl = [f"    let a{i} = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&src, {256 * i}u, 16u);" for i in range(na)]
            decl += [f"    let b{j} = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&src, {256 * j}u, 16u);" for j in range(nb)]
            decl += [f"    var c{i}_{j} = subgroup_matrix_result<f32, 16, 16>();" for i in range(na) for j in range(nb)]
            mma = [f"        c{i}_{j} = subgroupMatrixMultiplyAccumulate(a{i}, b{j}, c{i}_{j});" for i in range(na) for j in range(nb)]
            store = [f"    subgroupMatrixStore<row_major>(&y, ((wid.x * {nsg}u + sg) * {na * nb}u + {i * nb + j}u) * 256u, c{i}_{j}, 16u);"
                     for i in range(na) for j in range(nb)]
            code = MMA_KERNEL.format(WG=nsg * sg, DECL="\n".join(decl), MMA="\n".join(mma), STORE="\n".join(store), ITERS=iters)
            pipeline = ctx.pipeline(f"mma_peak_{na}x{nb}x{nsg}", ("rw", "read"), source=code)
            y = ctx.storage(groups * nsg * na * nb * 1024, "mma.y")
            call = (pipeline, ctx.bind_group(pipeline, [y, src]), (groups, 1, 1))
            us = 1e6 * time_lists(ctx, {"mma": [call]}, 3, reps, 0.5)["mma"]  # on a warm GPU (tools/gputime.py)
            flops = 2 * 16 * 16 * 16 * na * nb * iters * nsg * groups
            entry.update(us=round(us, 1), tflops=round(flops / us / 1e6, 1))
        except Exception as exc:  # noqa: BLE001 - reported per configuration
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(entry), flush=True)


def layouts(ctx) -> None:
    """Which reading of offset and stride Dawn gives f16 matrices loaded from each array type."""
    import wgpu

    device = ctx.device
    bu = wgpu.BufferUsage
    halves = 4096
    rng = np.random.default_rng(1)
    h = rng.standard_normal(halves).astype(np.float16)
    src = device.create_buffer(size=halves * 2, usage=bu.STORAGE | bu.COPY_DST)
    device.queue.write_buffer(src, 0, h.view(np.uint32).tobytes())
    dst = device.create_buffer(size=1024, usage=bu.STORAGE | bu.COPY_SRC)
    off, stride = 8, 24  # in halves: room for both readings within 4,096 halves
    for t, (unit, fill) in LAYOUT_FILL.items():
        entry: dict = {"probe": "layout", "type": t, "offset": off, "stride": stride}
        try:
            code = LAYOUT_KERNEL.format(T=t, N=halves // unit, FILL=fill, OFF=off, STRIDE=stride)
            module = device.create_shader_module(code=code)
            pipeline = device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
            group = device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=[
                {"binding": 0, "resource": {"buffer": src, "offset": 0, "size": halves * 2}},
                {"binding": 1, "resource": {"buffer": dst, "offset": 0, "size": 1024}}])
            encoder = device.create_command_encoder()
            compute = encoder.begin_compute_pass()
            compute.set_pipeline(pipeline)
            compute.set_bind_group(0, group)
            compute.dispatch_workgroups(1, 1, 1)
            compute.end()
            device.queue.submit([encoder.finish()])
            got = np.frombuffer(device.queue.read_buffer(dst), dtype=np.float16)
            left, right = got[:256].reshape(16, 16), got[256:].reshape(16, 16).T  # right: [k][n] stored column-major
            readings = {"halves": 1, "elements": unit}
            for name, u in readings.items():
                # Row (left) or column (right) r of the matrix starts at u (off + r stride) halves.
                want = np.stack([h[u * (off + r * stride): u * (off + r * stride) + 16] for r in range(16)])
                entry[f"left_{name}"] = bool(np.array_equal(left, want))
                entry[f"right_{name}"] = bool(np.array_equal(right.T, want))
        except Exception as exc:  # noqa: BLE001 - reported per type
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(entry), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-1.5b", choices=("qwen2.5-0.5b", "qwen2.5-1.5b"))
    parser.add_argument("--shapes", default="gate_up", help="comma-separated subset of qkv,o_proj,gate_up,down")
    parser.add_argument("--tc-tiles", default="4x4_2x2_k2_s", help="comma-separated TMxTN_SMxSN_kKU_{s,t,p,w} (SHARED 1, 2, 3, 5)")
    parser.add_argument("--probes", default=",".join(PROBES))
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--passes", type=int, default=5, help="timed rounds over a tile's probes (the median counts)")
    parser.add_argument("--warm-ms", type=float, default=500, help="GPU work before a tile's timed rounds (the clock ramps)")
    parser.add_argument("--layouts", action="store_true", help="only the workgroup-array reading test")
    parser.add_argument("--mma-peak", metavar="NAxNBxNSG,...", help="only the register-only product rate, e.g. 1x1x4,4x4x4")
    parser.add_argument("--iters", type=int, default=2048, help="--mma-peak: products per accumulator")
    parser.add_argument("--pad-shared", type=int, default=0, metavar="BYTES",
                        help="unused workgroup memory added to every probe (the occupancy test)")
    args = parser.parse_args()

    from kjarni.gpu import WgpuContext, WgpuOps
    from kjarni.gpu.runtime import DAWN_FAST_DEVICE_TOGGLES

    ctx = WgpuContext(runtime="dawn", dawn_device_toggles=DAWN_FAST_DEVICE_TOGGLES)
    sg = ctx.f16_matrix_subgroup
    print(json.dumps({"adapter": ctx.description, "runtime": ctx.runtime.description, "f16_matrix_subgroup": sg}), flush=True)
    if args.layouts:
        layouts(ctx)
        return
    if args.mma_peak:
        mma_peak(ctx, args.mma_peak, args.iters, args.reps)
        return
    if sg is None:
        raise SystemExit("probe_tc: this adapter has no f16 subgroup-matrix configuration")
    tiles = {kernels.tc_variant(*t, sg).rsplit("_sg", 1)[0]: t for t in kernels.TC_TILES if t[5]}
    rng = np.random.default_rng(0)
    original = kernels.template
    state = {"probe": "full"}

    def template(op: str, variant: str, flags: frozenset[str] = frozenset()) -> str:
        text = original(op, variant, flags)
        return pad_shared(probe_source(text, state["probe"]), args.pad_shared) if op == "matmul_tc" else text

    kernels.template = template
    for name, (rows, cols, kind) in shapes(args.model).items():
        if name not in args.shapes.split(","):
            continue
        w = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.05).astype(np.float16).astype(np.float32)
        xin, nw, b, r = product_inputs(rng, args.tokens, rows, cols, kind)
        for label in args.tc_tiles.split(","):
            tile = tiles.get(label)
            if tile is None or kernels.tc_workgroup_bytes(*tile) + args.pad_shared > ctx.max_workgroup_storage:
                print(json.dumps({"shape": name, "tile": label, "error": "no such SHARED tile at this subgroup size"}), flush=True)
                continue
            # Each probe compiled and its matmul_tc dispatch recorded, then all timed together on a
            # warm GPU (tools/gputime.py: an H100 idles at 345 MHz between compiles).
            prepared = {}
            for probe in args.probes.split(","):
                state["probe"] = probe
                ctx._pipelines.clear()  # the same kernel name, another source
                entry: dict = {"shape": name, "rows": rows, "cols": cols, "tile": label, "probe": probe,
                               "workgroup_bytes": kernels.tc_workgroup_bytes(*tile) + args.pad_shared}
                try:
                    ops = WgpuOps(ctx, weight_format="f16")
                    ops.tuning.sgmat_tiles = {}
                    ops.tuning.tc_tiles = {(rows, cols): tile}
                    run = product(ops, w, name, kind, xin, nw, b, r)
                    ops.read(run())
                    calls, out = record(ctx, run)
                    ops.read(out)
                    tc = [c for c in calls if c[0].kjarni_name.startswith("matmul_tc.")]
                    if not tc:
                        raise RuntimeError(f"matmul_tc did not run ({sorted({c[0].kjarni_name for c in calls})})")
                    prepared[probe] = (entry, tc, (ops, run, out))
                except Exception as exc:  # noqa: BLE001 - reported per probe
                    entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(json.dumps(entry), flush=True)
            if prepared:
                times = time_lists(ctx, {p: v[1] for p, v in prepared.items()}, args.passes, args.reps, args.warm_ms / 1e3)
                for probe, (entry, _, (ops, _, _)) in prepared.items():
                    us = 1e6 * times[probe]
                    entry.update(us=round(us, 1), tflops=round(2 * args.tokens * rows * cols / us / 1e6, 1))
                    print(json.dumps(entry), flush=True)
                    ops.close()
    kernels.template = original


if __name__ == "__main__":
    main()
