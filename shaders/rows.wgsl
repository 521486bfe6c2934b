// rows: y[i] = x[first + i] for i < count: consecutive rows of an activation as a new one
// (WgpuOps.rows: the last row of a few-token forward before the final norm and the LM head). A
// dispatch rather than a buffer copy, so that a forward using it can be taped (kjarni/gpu/capture.py).
// Bindings: params, x [.., first + count], y [count]; count and first in values (rows x features).
// Grid: n = ceil(count / 64) workgroups folded as (min(n, 32768), ceil(n / 32768)).

struct Params {
    count: u32,
    first: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (i >= params.count) {
        return;
    }
    y[i] = x[params.first + i];
}
