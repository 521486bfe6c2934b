// linear_q8_0: y[t, row_offset + r] = sum_c xn[t, c] * W[r, c] (+ bias[row_offset + r]) (+ residual[t, row_offset + r])
// with W a Q8_0 weight kept quantized (layout: kjarni/gpu/quant.py) and xn = x or rms_norm(x) * norm_weight.
// Bindings and Params: the linear family of docs/gpu-kernels.md.
// Grid: (quant.workgroup_count(rows), 1, 1). Rows are strided over, so any grid is correct.
// Entry points: `main` takes one subgroup per row (the `subgroup` flag, device feature "subgroup"),
// else one workgroup per row (linear_quant_body.wgsl's #if subgroup). Tokens go TILE at a
// time so each dequantized weight serves the whole tile.

// #include block_q8_0.wgsl
// #include linear_quant_body.wgsl
