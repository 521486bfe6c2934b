// add: y[i] = a[i] + b[i] (GPT-2's token + position embeddings).
// Bindings: params, a [count], b [count], y [count].
// Grid: n = ceil(count / 64) workgroups folded as (min(n, 32768), ceil(n / 32768)).

struct Params {
    count: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (i >= params.count) {
        return;
    }
    y[i] = a[i] + b[i];
}
