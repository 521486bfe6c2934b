// embed_q8_0: out[t, :] = dequant(table[ids[t], :]) for a Q8_0 table (layout: kjarni/gpu/quant.py).
// Bindings: params, ids, w_a, w_b, out (docs/gpu-kernels.md, embedding gather family).
// Grid: (min(tokens, 65535), 1, 1); workgroups stride over tokens, invocations over a row's units.
// A table split into row chunks is one dispatch per chunk: each writes the ids it holds.

struct Params {
    rows: u32,        // vocabulary rows in this chunk of the table
    cols: u32,        // hidden size
    tokens: u32,      // ids to gather
    flags: u32,       // unused
    row_offset: u32,  // first vocabulary row of this chunk: ids outside the chunk are skipped
    y_stride: u32,    // unused
    eps: f32,         // unused
    _pad: u32,
}
@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;          // [tokens]
@group(0) @binding(2) var<storage, read> w_a: array<u32>;          // packed quants, [rows, words_a]
@group(0) @binding(3) var<storage, read> w_b: array<u32>;          // scales / mins, [rows, words_b]
@group(0) @binding(4) var<storage, read_write> out: array<f32>;    // [tokens, cols]

override WG: u32 = 64u;

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

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lane: u32) {
    let units = params.cols / UNIT;
    for (var t = wg.x; t < params.tokens; t += nwg.x) {
        let id = ids[t];
        if (id < params.row_offset || id - params.row_offset >= params.rows) {
            continue;
        }
        for (var u = lane; u < units; u += WG) {
            let v = unit_values(id - params.row_offset, u);
            for (var k = 0u; k < UNIT / 4u; k++) {
                let o = t * params.cols + unit_col(u, k);
                out[o] = v[k].x;
                out[o + 1u] = v[k].y;
                out[o + 2u] = v[k].z;
                out[o + 3u] = v[k].w;
            }
        }
    }
}
