// linear_q5_1: y[t, row_offset + r] = sum_c xn[t, c] * W[r, c] (+ bias[row_offset + r]) (+ residual[t, row_offset + r])
// with W a Q5_1 weight kept quantized (layout: kjarni/gpu/quant.py) and xn = x or rms_norm(x) * norm_weight.
// Bindings and Params: the linear family of docs/gpu-kernels.md.
// Grid: (quant.workgroup_count(rows), 1, 1). Rows are strided over, so any grid is correct.
// Entry points: `main` takes one subgroup per row (device feature "subgroup"); `main_shared` one
// workgroup per row; quant.shader_source() keeps the one the device can run. Tokens go TILE at a
// time so each dequantized weight serves the whole tile.

// Q5_1: w_a = 5 words per block (4 qs words, then qh: bit j is value j's fifth bit), w_b = one word
// per block: d (low f16), m (high f16) (kjarni/gpu/quant.py). A unit is one qs word i of block b:
// values 4i .. 4i + 3 (low nibbles) and 16 + 4i .. (high), each d * q + m.
const UNIT: u32 = 8u;

// Bits 0..3 of h as the fifth bit (16) of four values.
fn high4(h: u32) -> vec4<u32> {
    return (vec4<u32>(h, h >> 1u, h >> 2u, h >> 3u) & vec4<u32>(1u)) << vec4<u32>(4u);
}

fn unit_values(row: u32, u: u32) -> array<vec4<f32>, 2> {
    let nb = params.cols / 32u;
    let blk = u / 4u;
    let i = u % 4u;
    let base = row * (nb * 5u) + blk * 5u;
    let q = w_a[base + i];
    let qh = w_a[base + 4u];
    let dm = unpack2x16float(w_b[row * nb + blk]);
    let lo = vec4<f32>(unpack4xU8(q & 0x0F0F0F0Fu) | high4(qh >> (4u * i)));
    let hi = vec4<f32>(unpack4xU8((q >> 4u) & 0x0F0F0F0Fu) | high4(qh >> (16u + 4u * i)));
    return array<vec4<f32>, 2>(dm.x * lo + dm.y, dm.x * hi + dm.y);
}

fn unit_col(u: u32, k: u32) -> u32 {
    return (u / 4u) * 32u + (u % 4u) * 4u + 16u * k;
}

// #include linear_quant_body.wgsl
