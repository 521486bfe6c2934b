// matmul_dot_prep: the int8 activations of an integer-dot prefill product (matmul_dot.tmpl.wgsl),
// one workgroup per token row. v[t, c] = x[t, c] s_t nw[c], with x = silu(gate) up of
// x = [gate | up] (flags bit 3) and s_t nw the fused rms norm (flags bit 2; else 1), is quantized
// in blocks of 32 as numpy_ops.quantize_blocks does: q = round(v 127 / max |v|) (int8),
// d = max |v| / 127: what NumpyOps(quantize_activations=True, quantized_prefill_min_tokens=..)
// multiplies. Written once, read by every workgroup of the product.
// Bindings: the linear family's (docs/gpu-kernels.md): x (1), norm_weight (6), a as y (7): one
// buffer of vec4<u32>, the quants first ([tokens, cols / 16]: 16 int8 values a vec4), then at vec4
// tokens cols / 16 the scales ([tokens, cols / 64]: (d, d sum q) of two blocks a vec4, as f32 bits).
// The 8 threads of a block (consecutive lanes of one subgroup) share its maximum (quantize_x.wgsl)
// and its sum of quants through subgroupShuffleXor. Needs cols % 64 == 0, subgroups of at least 8 lanes.
// Grid: (tokens, 1, 1), 256 threads.

// #include linear_structs.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> norm_weight: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> a: array<vec4<u32>>;

const WG: u32 = 256u;

// #include row_norm.wgsl
// #include prep_row.wgsl
// #include quantize_x.wgsl

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
    let scales = params.tokens * params.cols / 16u + t * (params.cols / 64u);  // this row's (d, d sum q) pairs
    // Every thread of the workgroup takes part in each round's shuffles (cols % 64 == 0 and WG % 8
    // == 0: a block's 8 threads are all in or all out of the row).
    for (var base = 0u; base < c4s; base += WG) {
        let c = base + lid;
        var v = vec4<f32>(0.0);
        if (c < c4s) {
            v = row_value(t, c, c4s, silu) * s;
            if (norm) {
                v *= norm_weight[c];
            }
        }
        let xq4 = quantize_x4(v);
        let q = xq4.q;
        var qs = q.x + q.y + q.z + q.w;
        qs += subgroupShuffleXor(qs, 1u);
        qs += subgroupShuffleXor(qs, 2u);
        qs += subgroupShuffleXor(qs, 4u);
        if (c < c4s) {
            a[(t * c4s + c) / 4u][c % 4u] = pack4xI8(q);
            if (c % 8u == 0u) {
                let d = xq4.m / 127.0;
                let b = c / 8u;  // block of the row
                a[scales + b / 2u][2u * (b % 2u)] = bitcast<u32>(d);
                a[scales + b / 2u][2u * (b % 2u) + 1u] = bitcast<u32>(d * f32(qs));
            }
        }
    }
}
