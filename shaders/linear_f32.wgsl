// linear_f32: y = rms_norm?(x) @ W.T (+ bias) (+ residual), W in f32 (parity format).
// Bindings: the linear family's (params, x, w_a, w_b, bias, residual, norm_weight, y).
// w_a: rows of f32, each row padded to a multiple of 8 values (two vec4<f32>); w_b unused.
// Entry points and grids: linear_body.wgsl.

// #include block_f32.wgsl

// Weights c8*8 .. c8*8+7 of `row` (columns past `cols` are the zero padding).
fn load_w8(row: u32, c8: u32) -> W8 {
    let v = unit_values(row, c8);
    return W8(v[0], v[1]);
}

// #include linear_body.wgsl
