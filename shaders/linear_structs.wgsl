// linear_structs: the linear family's Params (LINEAR in kjarni/gpu/params.py; checked by
// tests/test_gpu_kernels.py) and W8, 8 consecutive weights as two vec4. Pasted by
// linear_params.wgsl, linear_quant_body.wgsl and embed.tmpl.wgsl.

struct Params {
    rows: u32,
    cols: u32,
    tokens: u32,
    flags: u32,
    row_offset: u32,
    y_stride: u32,
    eps: f32,
    _pad: u32,
}

struct W8 {
    a: vec4<f32>,
    b: vec4<f32>,
}
