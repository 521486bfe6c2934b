// block_f32: f32 weights as the linear kernels read them (linear_f32.wgsl, matvec.tmpl.wgsl,
// matmul.tmpl.wgsl, embed.tmpl.wgsl): rows
// padded with zeros to a multiple of 8 values, two vec4<f32> = 8 weights. A unit is values
// 8u .. 8u + 7 of the row. Reads params.cols.

@group(0) @binding(2) var<storage, read> w_a: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> w_b: array<u32>;

const UNIT: u32 = 8u;

fn unit_values(row: u32, u: u32) -> array<vec4<f32>, 2> {
    let i = (row * ((params.cols + 7u) / 8u) + u) * 2u;
    return array<vec4<f32>, 2>(w_a[i], w_a[i + 1u]);
}

fn unit_col(u: u32, k: u32) -> u32 {
    return 8u * u + 4u * k;
}

// Values 8 c8 .. 8 c8 + 7 of a row (the prefill matmul's chunk): unit c8.
fn load_w8(row: u32, c8: u32) -> W8 {
    let v = unit_values(row, c8);
    return W8(v[0], v[1]);
}
