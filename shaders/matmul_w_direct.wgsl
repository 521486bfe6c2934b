// matmul_w_direct: for a weight format whose block decoder has no split load (its load_w8 loads
// and dequantizes at once), the prefill matmul's fetch_w8 / finish_w8 pair is load_w8 and the
// identity: its loads are waited for at once rather than kept in flight through the step.
// Pasted by matmul.tmpl.wgsl through the variant table (kernels.TEMPLATES["matmul"]).

alias WRaw = W8;

fn fetch_w8(row: u32, c8: u32) -> WRaw {
    return load_w8(row, c8);
}

fn finish_w8(r: WRaw) -> W8 {
    return r;
}
