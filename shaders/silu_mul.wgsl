// silu_mul: y[t, c] = silu(x[t, c]) * x[t, half + c], x = [gate | up] of width 2 half.
// Bindings: params, x [tokens, 2 half], y [tokens, half].
// Grid: n = ceil(tokens * half / 64) workgroups folded as (min(n, 32768), ceil(n / 32768)).

struct Params {
    half: u32,
    tokens: u32,
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
    if (i >= params.tokens * params.half) {
        return;
    }
    let t = i / params.half;
    let c = i % params.half;
    let gate = x[t * 2u * params.half + c];
    let up = x[t * 2u * params.half + params.half + c];
    y[i] = gate / (1.0 + exp(-gate)) * up;
}
