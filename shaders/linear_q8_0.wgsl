// linear_q8_0: y[t, row_offset + r] = sum_c xn[t, c] * W[r, c] (+ bias[row_offset + r]) (+ residual[t, row_offset + r])
// with W a Q8_0 weight kept quantized (layout: kjarni/gpu/quant.py) and xn = x or rms_norm(x) * norm_weight.
// Bindings and Params: the linear family of docs/gpu-kernels.md.
// Grid: (quant.workgroup_count(rows), 1, 1). Rows are strided over, so any grid is correct.
// Entry points: `main` takes one subgroup per row (device feature "subgroup"); `main_shared` one
// workgroup per row; quant.shader_source() keeps the one the device can run. Tokens go TILE at a
// time so each dequantized weight serves the whole tile.

// Q8_0: w_a = 8 words (32 int8 values) per block, w_b = block scales d as f16 pairs (kjarni/gpu/quant.py).
// A unit is two words of the row: values 8u .. 8u + 7, each d * q.
const UNIT: u32 = 8u;

fn unit_values(row: u32, u: u32) -> array<vec4<f32>, 2> {
    let nb = params.cols / 32u;
    let a = row * (nb * 8u) + 2u * u;
    let blk = u / 4u;
    let d = unpack2x16float(w_b[row * ((nb + 1u) / 2u) + blk / 2u])[blk & 1u];
    return array<vec4<f32>, 2>(vec4<f32>(unpack4xI8(w_a[a])) * d, vec4<f32>(unpack4xI8(w_a[a + 1u])) * d);
}

fn unit_col(u: u32, k: u32) -> u32 {
    return 8u * u + 4u * k;
}

// #include linear_quant_body.wgsl
