// embed.tmpl.wgsl: the embedding gather for every weight format, out[t, :] = W[ids[t] - row_offset, :]
// dequantized, for the ids inside this chunk of the table. kjarni/gpu/kernels.py renders it per
// format (`kernels.template("embed", format)`): {{BLOCK}} is the format's block decoder
// (kernels.BLOCKS: block_<format>.wgsl: w_a / w_b, UNIT, unit_values(row, u), unit_col(u, k)).
// Bindings: params (the linear family's Params: rows = rows of this chunk, cols = hidden size,
// tokens, row_offset = first table row of the chunk; flags, y_stride, eps unused), ids [tokens],
// w_a, w_b, out [tokens, cols] (read_write).
// Grid (min(tokens, 65535), 1, 1): workgroups stride over tokens, invocations over a row's units.
// Columns past cols (the zero padding of f16 / f32 rows to 8 values) are not written.

// #include linear_structs.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

// #include {{BLOCK}}.wgsl

override WG: u32 = 64u;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let cols = params.cols;
    let units = (cols + UNIT - 1u) / UNIT;
    for (var t = wid.x; t < params.tokens; t += nwg.x) {
        let id = ids[t];
        if (id < params.row_offset || id - params.row_offset >= params.rows) {
            continue;
        }
        for (var u = lid; u < units; u += WG) {
            let v = unit_values(id - params.row_offset, u);
            for (var k = 0u; k < UNIT / 4u; k++) {
                let c = unit_col(u, k);
                let o = t * cols + c;
                for (var i = 0u; i < 4u; i++) {
                    if (c + i < cols) {
                        out[o + i] = v[k][i];
                    }
                }
            }
        }
    }
}
