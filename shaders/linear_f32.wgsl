// linear_f32: y = rms_norm?(x) @ W.T (+ bias) (+ residual), W in f32 (parity format).
// Bindings: the linear family's (params, x, w_a, w_b, bias, residual, norm_weight, y).
// w_a: rows of f32, each row padded to a multiple of 8 values (two vec4<f32>); w_b unused.
// Entry points and grids: linear_body.wgsl.

// #include block_f32.wgsl

// #include linear_body.wgsl
