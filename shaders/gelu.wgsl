// gelu (tanh approximation, GPT-2's gelu_new): y[i] = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
// Bindings: params, x [count], y [count].
// Grid: n = ceil(count / 64) workgroups folded as (min(n, 32768), ceil(n / 32768)).

struct Params {
    count: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
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
    let v = x[i];
    // tanh saturates to +-1 in f32 beyond |u| = 10; clamping keeps exp-based tanh from inf / inf.
    let u = clamp(0.7978845608028654 * (v + 0.044715 * v * v * v), -10.0, 10.0);
    y[i] = 0.5 * v * (1.0 + tanh(u));
}
