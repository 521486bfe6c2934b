// The quantized embedding family's shared body: Params, bindings and `main`. A format file
// (embed_q*.wgsl) defines UNIT, `unit_values(row, u)` and `unit_col(u, k)`, then includes this.
// Grid: (min(tokens, 65535), 1, 1); workgroups stride over tokens, invocations over a row's units.

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
