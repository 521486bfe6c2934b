// layer_norm: y[t, :] = (x[t, :] - mean) / sqrt(var + eps) * weight + bias, var = mean((x - mean)^2).
// Bindings: params, x [tokens, cols], weight [cols], bias [cols], y [tokens, cols]. Grid: (tokens).

struct Params {
    cols: u32,
    tokens: u32,
    eps: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

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
    let n = f32(params.cols);
    var sum = 0.0;
    for (var c = lid; c < params.cols; c += WG) {
        sum += x[base + c];
    }
    let mean = workgroup_sum(sum, lid, sg) / n;
    // Two passes over the row (centred squares), as torch does: no cancellation for large means.
    var ss = 0.0;
    for (var c = lid; c < params.cols; c += WG) {
        let v = x[base + c] - mean;
        ss += v * v;
    }
    let inv = inverseSqrt(workgroup_sum(ss, lid, sg) / n + params.eps);
    for (var c = lid; c < params.cols; c += WG) {
        y[base + c] = (x[base + c] - mean) * inv * weight[c] + bias[c];
    }
}
