// embed_q8_0: out[t, :] = dequant(table[ids[t], :]) for a Q8_0 table (layout: kjarni/gpu/quant.py).
// Bindings: params, ids, w_a, w_b, out (docs/gpu-kernels.md, embedding gather family).
// Grid: (min(tokens, 65535), 1, 1); workgroups stride over tokens, invocations over a row's units.
// A table split into row chunks is one dispatch per chunk: each writes the ids it holds.

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

// #include embed_quant_body.wgsl
