// linear_f16: y = rms_norm?(x) @ W.T (+ bias) (+ residual), W in f16 (docs/gpu-kernels.md).
// Bindings: the linear family's (params, x, w_a, w_b, bias, residual, norm_weight, y).
// w_a: rows of f16 pairs, each row padded to a multiple of 8 values (one vec4<u32> = 8 weights);
// w_b unused. Entry points and grids: linear_body.wgsl.

// #include block_f16.wgsl

// Weights c8*8 .. c8*8+7 of `row` (columns past `cols` are the zero padding).
fn load_w8(row: u32, c8: u32) -> W8 {
    let v = unit_values(row, c8);
    return W8(v[0], v[1]);
}

// #include linear_body.wgsl
