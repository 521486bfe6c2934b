// linear_params: the dense linear family's Params, W8 and the bindings every format shares (the
// format file declares w_a / w_b at bindings 2 and 3). Pasted by linear_body.wgsl (matrix-vector
// kernels) and matmul.tmpl.wgsl (prefill), so both read the one layout kjarni/gpu/params.py's
// LINEAR describes (tests/test_gpu_kernels.py checks it).

// #include linear_structs.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(4) var<storage, read> bias: array<f32>;
@group(0) @binding(5) var<storage, read> residual: array<f32>;
@group(0) @binding(6) var<storage, read> norm_weight: array<f32>;
@group(0) @binding(7) var<storage, read_write> y: array<f32>;
