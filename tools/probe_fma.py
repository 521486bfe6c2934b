"""Register-only FMA rates per arithmetic type: f32, vec4<f32>, vec2<f16> and vec4<f16> chains,
and the packed 4 x int8 dot product with accumulation (dot4I8Packed), timed on a warm GPU
(tools/gputime.py), one JSON line per type. Whether packed f16 arithmetic (vec2<f16> fma: the GPU's
paired half-precision FMA, where the driver emits one) or the int8 dot product doubles the f32 rate
decides whether an f16 or int8 SIMT prefill matmul is worth building for runtimes without tensor
cores (issue 12: wgpu-native's prefill is f32 SIMT).

    python tools/probe_fma.py [--runtime dawn] [--groups 2048] [--iters 4096]

Each thread runs CHAINS independent chains of ``x = fma(x, 0.99, 0.001)`` (values stay near 0.1,
normal in f16), or ``c = dot4I8Packed(bitcast<u32>(c), 0x01ff01ff) + c`` (4 multiply-adds a step,
each step's operand the previous sum); flops (int8: operations) = 2 x lanes x chains x iters x
threads. ``tflops`` is the median of
``--passes`` timed passes of ``--reps`` dispatches each.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CHAINS = 8
TYPES = {"f32": ("f32", 1), "vec4_f32": ("vec4<f32>", 4), "vec2_f16": ("vec2<f16>", 2), "vec4_f16": ("vec4<f16>", 4),
         "i8dot4": ("i32", 4)}


def source(wgsl_type: str, iters: int) -> str:
    """The probe kernel for one type: CHAINS chains a thread, their sum stored as f32."""
    f16 = "f16" in wgsl_type
    if wgsl_type == "i32":
        chains = "\n".join(f"    var c{i} = i32(gid.x) + {i};" for i in range(CHAINS))
        steps = "\n".join(f"        c{i} = dot4I8Packed(bitcast<u32>(c{i}), 0x01ff01ffu) + c{i};" for i in range(CHAINS))
        total = " + ".join(f"c{i}" for i in range(CHAINS))
        return f"""@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
{chains}
    for (var i = 0u; i < {iters}u; i++) {{
{steps}
    }}
    out[gid.x] = f32({total});
}}
"""
    scalar = "f16" if f16 else "f32"
    chains = "\n".join(f"    var c{i} = {wgsl_type}({scalar}(s + {0.01 * i}));" for i in range(CHAINS))
    steps = "\n".join(f"        c{i} = fma(c{i}, {wgsl_type}(0.99), {wgsl_type}(0.001));" for i in range(CHAINS))
    total = " + ".join(f"c{i}" for i in range(CHAINS))
    reduce = "dot(vec4<f32>(t), vec4<f32>(1.0))" if wgsl_type.startswith("vec4") else (
        "f32(t.x) + f32(t.y)" if wgsl_type.startswith("vec2") else "f32(t)")
    return f"""{"enable f16;" if f16 else ""}
@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    let s = f32(gid.x % 64u) * 1e-3;
{chains}
    for (var i = 0u; i < {iters}u; i++) {{
{steps}
    }}
    let t = {total};
    out[gid.x] = {reduce};
}}
"""


def main() -> None:
    import wgpu
    from gputime import time_lists

    from kjarni.gpu.context import WgpuContext

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", default=None, help="wgpu (wgpu-native, the default) or dawn")
    parser.add_argument("--groups", type=int, default=2048, help="workgroups of 256 threads")
    parser.add_argument("--iters", type=int, default=4096, help="trips of each chain")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    ctx = WgpuContext(None, runtime=args.runtime)
    if not ctx.has_timestamps:
        raise SystemExit("probe_fma: this adapter has no timestamp queries")
    buf = ctx.device.create_buffer(size=args.groups * 256 * 4, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    lists, flops = {}, {}
    for name, (wgsl_type, lanes) in TYPES.items():
        if "f16" in wgsl_type and "shader-f16" not in ctx.features:
            print(json.dumps({"type": name, "skipped": "the adapter has no shader-f16"}), flush=True)
            continue
        module = ctx.device.create_shader_module(code=source(wgsl_type, args.iters), label=f"probe_fma.{name}")
        pipeline = ctx.device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
        group = ctx.device.create_bind_group(layout=pipeline.get_bind_group_layout(0),
                                             entries=[{"binding": 0, "resource": {"buffer": buf, "offset": 0, "size": buf.size}}])
        lists[name] = [(pipeline, group, (args.groups, 1, 1))]
        flops[name] = 2.0 * lanes * CHAINS * args.iters * args.groups * 256
    times = time_lists(ctx, lists, args.passes, args.reps, warm_s=0.5)
    for name, seconds in times.items():
        print(json.dumps({"type": name, "runtime": ctx.runtime.name, "adapter": ctx.description, "us": round(1e6 * seconds, 1),
                          "tflops": round(flops[name] / seconds / 1e12, 2)}), flush=True)


if __name__ == "__main__":
    main()
