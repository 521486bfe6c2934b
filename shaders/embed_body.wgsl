// The embedding gather's shared body (a format file declares w_a / w_b and load_w8).
// Params: the linear family's struct (flags, y_stride, eps unused), as the quantized embed kernels.
// Grid (min(tokens, 65535), 1, 1): workgroups stride over tokens, threads over 8-column chunks.
// out[t, c] = W[ids[t] - row_offset, c] for the ids inside this chunk of the table.

// #include linear_structs.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

override WG: u32 = 64u;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let chunks = (params.cols + 7u) / 8u;
    for (var t = wid.x; t < params.tokens; t += nwg.x) {
        let id = ids[t];
        if (id < params.row_offset || id - params.row_offset >= params.rows) {
            continue;
        }
        for (var c8 = lid; c8 < chunks; c8 += WG) {
            let w = load_w8(id - params.row_offset, c8);
            let c = c8 * 8u;
            let base = t * params.cols + c;
            for (var i = 0u; i < 4u; i++) {
                if (c + i < params.cols) { out[base + i] = w.a[i]; }
                if (c + 4u + i < params.cols) { out[base + 4u + i] = w.b[i]; }
            }
        }
    }
}
