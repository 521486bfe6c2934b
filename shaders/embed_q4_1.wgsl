// embed_q4_1: out[t, :] = dequant(table[ids[t], :]) for a Q4_1 table (layout: kjarni/gpu/quant.py).
// Bindings: params, ids, w_a, w_b, out (docs/gpu-kernels.md, embedding gather family).
// Grid: (min(tokens, 65535), 1, 1); workgroups stride over tokens, invocations over a row's units.
// A table split into row chunks is one dispatch per chunk: each writes the ids it holds.

// Q4_1: w_a = 4 words (16 qs bytes) per block, w_b = one word per block: d (low f16), m (high f16)
// (kjarni/gpu/quant.py). A unit is one qs word i of block b: values 4i .. 4i + 3 (low nibbles) and
// 16 + 4i .. (high), each d * q + m.
const UNIT: u32 = 8u;

fn unit_values(row: u32, u: u32) -> array<vec4<f32>, 2> {
    let nb = params.cols / 32u;
    let q = w_a[row * (nb * 4u) + u];
    let dm = unpack2x16float(w_b[row * nb + u / 4u]);
    let lo = vec4<f32>(unpack4xU8(q & 0x0F0F0F0Fu));
    let hi = vec4<f32>(unpack4xU8((q >> 4u) & 0x0F0F0F0Fu));
    return array<vec4<f32>, 2>(dm.x * lo + dm.y, dm.x * hi + dm.y);
}

fn unit_col(u: u32, k: u32) -> u32 {
    return (u / 4u) * 32u + (u % 4u) * 4u + 16u * k;
}

// #include embed_quant_body.wgsl
