// linear_f16: y = rms_norm?(x) @ W.T (+ bias) (+ residual), W in f16 (docs/gpu-kernels.md).
// Bindings: the linear family's (params, x, w_a, w_b, bias, residual, norm_weight, y).
// w_a: rows of f16 pairs, each row padded to a multiple of 8 values (one vec4<u32> = 8 weights);
// w_b unused. Entry points and grids: linear_body.wgsl.

// #include block_f16.wgsl

// #include linear_body.wgsl
