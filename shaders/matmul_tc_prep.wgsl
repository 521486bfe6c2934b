// matmul_tc_prep: the f16 activations of a tensor-core prefill product (matmul_tc.tmpl.wgsl), one
// workgroup per token row: a[t, c] = f16(v[t, c] s_t nw[c]) with v = x, or silu(gate) up of
// x = [gate | up] (flags bit 3), and s_t nw the fused rms norm (flags bit 2; else 1): what
// NumpyOps(activations="f16") rounds. Written once, read by every workgroup of the product.
// Bindings: the linear family's (docs/gpu-kernels.md): x (1), norm_weight (6), a as y (7, f16).
// Needs cols % 4 == 0. Grid: (tokens, 1, 1), 256 threads.

enable f16;

// #include linear_structs.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> norm_weight: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> a: array<vec4<f16>>;

const WG: u32 = 256u;

// #include row_norm.wgsl
// #include row_norm_f16.wgsl
// #include prep_row.wgsl

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let t = wid.x;
    let c4s = params.cols / 4u;
    let silu = (params.flags & 8u) != 0u;
    let norm = (params.flags & 4u) != 0u;
    let s = row_value_scale(t, c4s, silu, norm, lid, sg, nsg, lane);
    for (var c = lid; c < c4s; c += WG) {
        a[t * c4s + c] = normed_f16(row_value(t, c, c4s, silu), s, c, norm);
    }
}
