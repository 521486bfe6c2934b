// matmul_reduce_prep: matmul_reduce.wgsl and the next product's matmul_tc_prep.wgsl in one
// dispatch, one workgroup per token row: y[t, c] = sum_z x[z, t, c] (+ bias) (+ residual), summed
// in matmul_reduce's order (so y is its value bit for bit), then a[t, c] = f16(y[t, c] s_t nw[c])
// with s_t the rms norm of the row (flags bit 2; else 1), in matmul_tc_prep's order (row_norm.wgsl:
// so a is its value bit for bit). Used where a product split over K (down_proj) feeds a normed product on
// tensor cores (the next layer's qkv): kjarni/gpu/step.py's ReducePending.
// Bindings (the linear family's slots): x the partials [S, tokens, rows] (1), y [tokens, rows] (2,
// f32), bias (4), residual (5), norm_weight (6), a [tokens, rows] f16 (7). Params: rows the width,
// cols S, flags as matmul_reduce's (bias 1, residual 2) and the norm (4), eps the norm's.
// Needs rows % 4 == 0, y_stride == rows and row_offset 0 (one segment). Grid: (tokens, 1, 1), 256
// threads.

enable f16;

// #include linear_structs.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> y: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> bias: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> residual: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> norm_weight: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> a: array<vec4<f16>>;

const WG: u32 = 256u;

// #include row_norm.wgsl
// #include row_norm_f16.wgsl

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let t = wid.x;
    let c4s = params.rows / 4u;
    let slice = params.tokens * c4s;  // one partial, in vec4s
    let norm = (params.flags & 4u) != 0u;
    var q = 0.0;
    for (var c = lid; c < c4s; c += WG) {
        let i = t * c4s + c;
        var o = x[i];
        for (var z = 1u; z < params.cols; z++) {
            o += x[z * slice + i];
        }
        if ((params.flags & 1u) != 0u) {
            o += bias[c];
        }
        if ((params.flags & 2u) != 0u) {
            o += residual[i];
        }
        y[i] = o;
        q += dot(o, o);
    }
    var s = 1.0;
    if (norm) {
        s = row_scale(q, sg, nsg, lane, params.rows, params.eps);
    }
    for (var c = lid; c < c4s; c += WG) {
        a[t * c4s + c] = normed_f16(y[t * c4s + c], s, c, norm);  // this thread's own store above
    }
}
