// rms_norm: y[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * weight.
// Bindings: params, x [tokens, cols], weight [cols], y [tokens, cols]. Grid: (tokens).

struct Params {
    cols: u32,
    tokens: u32,
    eps: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

override WG: u32 = 64u;

// #include reduce.wgsl

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
// #if subgroup
    @builtin(subgroup_id) sg_id: u32,
    @builtin(num_subgroups) sg_count: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
// #endif
) {
// #if subgroup
    let sg = vec3<u32>(sg_id, sg_count, sg_lane);
// #else
    let sg = vec3<u32>(0u);
// #endif
    let base = wid.x * params.cols;
    var ss = 0.0;
    for (var c = lid; c < params.cols; c += WG) {
        let v = x[base + c];
        ss += v * v;
    }
    let inv = inverseSqrt(workgroup_sum(ss, lid, sg) / f32(params.cols) + params.eps);
    for (var c = lid; c < params.cols; c += WG) {
        y[base + c] = x[base + c] * inv * weight[c];
    }
}
