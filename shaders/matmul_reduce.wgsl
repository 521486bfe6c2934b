// matmul_reduce: adds the S partial sums of a prefill matmul split over K (matmul.tmpl.wgsl with
// grid z = S) and applies bias and residual.
// Bindings and Params: the linear family (docs/gpu-kernels.md); x holds the partials
// [S, tokens, y_stride] (rows at row_offset ..), w_a / w_b / norm_weight unused; Params.cols is S.
// Math: y[t, row_offset + r] = sum_z x[z, t, row_offset + r] (+ bias) (+ residual), partials added
//   in order z = 0, 1, .. (f32).
// Grid: (ceil(rows / 256), tokens, 1), 256 threads: one output each.

// #include linear_params.wgsl

@group(0) @binding(2) var<storage, read> w_a: array<u32>;
@group(0) @binding(3) var<storage, read> w_b: array<u32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r = gid.x;
    let t = gid.y;
    if (r >= params.rows || t >= params.tokens) {
        return;
    }
    let col = params.row_offset + r;
    let i = t * params.y_stride + col;
    let slice = params.tokens * params.y_stride;
    var o = x[i];
    for (var z = 1u; z < params.cols; z++) {
        o += x[z * slice + i];
    }
    if ((params.flags & 1u) != 0u) {
        o += bias[col];
    }
    if ((params.flags & 2u) != 0u) {
        o += residual[i];
    }
    y[i] = o;
}
