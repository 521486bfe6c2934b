// The quantized linear family's shared body: Params, bindings, the token tile and the entry
// points. A format file (linear_q*.wgsl) defines UNIT, `unit_values(row, u)` (the 8 weights of
// unit u of a row) and `unit_col(u, k)` (the column of their k-th vec4), then includes this.
// Entry points: main (subgroup per row, a tile of 4 tokens per pass), main_t (subgroup per row,
// QT tiles = up to 12 tokens per pass: each unit dequantized once for all of them; speculative
// verify); without the `subgroup` flag, main is one workgroup per row instead (no subgroups).
// Grid: (quant.workgroup_count(rows), 1, 1); rows are strided over, so any
// grid is correct.

// #include linear_structs.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;      // [tokens, cols / 4] (cols is a multiple of 32); [tokens, 2 cols / 4] with flags bit 3
// bindings 2 and 3 (w_a, w_b): the format's block decoder (block_<format>.wgsl)
@group(0) @binding(4) var<storage, read> bias: array<f32>;         // [y_stride] when flags bit 0
@group(0) @binding(5) var<storage, read> residual: array<f32>;     // [tokens, y_stride] when flags bit 1
@group(0) @binding(6) var<storage, read> norm_weight: array<vec4<f32>>;  // [cols / 4] when flags bit 2
@group(0) @binding(7) var<storage, read_write> y: array<f32>;      // [tokens, y_stride]

override WG: u32 = 128u;  // invocations of the subgroup variant (ROWS_PER_WORKGROUP rows on a 32-wide GPU)
const TILE: u32 = 4u;     // tokens sharing one dequantization of a unit

// Sums of one row over a tile of tokens: acc[k] = x[t0 + k] . (norm_weight * w), ss[k] = |x[t0 + k]|^2.
// The rms norm is a per-token scale, so it is applied once to acc when the row is finished.
struct Partial {
    acc: vec4<f32>,
    ss: vec4<f32>,
}


// Adds weights w of columns c .. c + 3, times the tile's x, to the partial sums.
fn add4(p: ptr<function, Partial>, w: vec4<f32>, c: u32, t0: u32, nt: u32) {
    let norm = (params.flags & 4u) != 0u;
    var wn = w;
    if (norm) {
        wn = w * norm_weight[c / 4u];
    }
    let x0 = load_x4(t0, c);
    if (nt == 1u) {  // decode: one token, no tile indexing
        (*p).acc.x += dot(x0, wn);
        if (norm) {
            (*p).ss.x += dot(x0, x0);
        }
        return;
    }
    let xs = array<vec4<f32>, 4>(x0, load_x4(t0 + min(1u, nt - 1u), c), load_x4(t0 + min(2u, nt - 1u), c),
                                 load_x4(t0 + min(3u, nt - 1u), c));
    (*p).acc += vec4<f32>(dot(xs[0], wn), dot(xs[1], wn), dot(xs[2], wn), dot(xs[3], wn));
    if (norm) {
        (*p).ss += vec4<f32>(dot(xs[0], xs[0]), dot(xs[1], xs[1]), dot(xs[2], xs[2]), dot(xs[3], xs[3]));
    }
}

// x[t, c .. c + 3] as the product reads it: with flags bit 3, x is [tokens, 2 cols] = [gate | up]
// and the value is silu(gate) * up (silu_mul fused into the down projection).
fn load_x4(t: u32, c: u32) -> vec4<f32> {
    if ((params.flags & 8u) != 0u) {
        let i = (t * 2u * params.cols + c) / 4u;
        let g = x[i];
        return g / (1.0 + exp(-g)) * x[i + params.cols / 4u];
    }
    return x[(t * params.cols + c) / 4u];
}

// Dequantizes unit u of the row once and applies it to every token of the tile.
fn accumulate_unit(p: ptr<function, Partial>, row: u32, u: u32, t0: u32, nt: u32) {
    let v = unit_values(row, u);
    for (var k = 0u; k < UNIT / 4u; k++) {
        add4(p, v[k], unit_col(u, k), t0, nt);
    }
}

// Applies dequantized unit u (values v) to every token of the tile.
fn apply_unit(p: ptr<function, Partial>, v: array<vec4<f32>, UNIT / 4u>, u: u32, t0: u32, nt: u32) {
    for (var k = 0u; k < UNIT / 4u; k++) {
        add4(p, v[k], unit_col(u, k), t0, nt);
    }
}

// Units lane, lane + team, ... of the row; four at a time, all four loaded before any is used,
// so each lane keeps several loads in flight instead of one per loop trip.
fn row_partial(row: u32, t0: u32, nt: u32, lane: u32, team: u32) -> Partial {
    var p = Partial(vec4<f32>(0.0), vec4<f32>(0.0));
    let units = params.cols / UNIT;
    var u = lane;
    while (u + 3u * team < units) {
        let v0 = unit_values(row, u);
        let v1 = unit_values(row, u + team);
        let v2 = unit_values(row, u + 2u * team);
        let v3 = unit_values(row, u + 3u * team);
        apply_unit(&p, v0, u, t0, nt);
        apply_unit(&p, v1, u + team, t0, nt);
        apply_unit(&p, v2, u + 2u * team, t0, nt);
        apply_unit(&p, v3, u + 3u * team, t0, nt);
        u += 4u * team;
    }
    while (u < units) {
        accumulate_unit(&p, row, u, t0, nt);
        u += team;
    }
    return p;
}

fn finish_row(row: u32, t0: u32, nt: u32, acc: vec4<f32>, ss: vec4<f32>) {
    let out = params.row_offset + row;
    for (var k = 0u; k < nt; k++) {
        let i = (t0 + k) * params.y_stride + out;
        var v = acc[k];
        if ((params.flags & 4u) != 0u) {
            v *= inverseSqrt(ss[k] / f32(params.cols) + params.eps);
        }
        if ((params.flags & 1u) != 0u) {
            v += bias[out];
        }
        if ((params.flags & 2u) != 0u) {
            v += residual[i];
        }
        y[i] = v;
    }
}

// #if subgroup
// One subgroup per row, lanes stride over the row's units, subgroupAdd reduces. With SPLIT_K the
// whole workgroup (WG threads) shares each row instead: long rows (an MLP down projection) with
// few rows get WG / 32 times the loads in flight; subgroupAdd, then one barrier across subgroups.
override SPLIT_K: bool = false;
var<workgroup> team_part: array<Partial, 32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(subgroup_id) sg: u32, @builtin(num_subgroups) nsg: u32,
        @builtin(subgroup_invocation_id) lane: u32, @builtin(subgroup_size) sg_size: u32,
        @builtin(local_invocation_index) lid: u32) {
    if (SPLIT_K) {
        for (var row = wg.x; row < params.rows; row += nwg.x) {
            for (var t0 = 0u; t0 < params.tokens; t0 += TILE) {
                let nt = min(TILE, params.tokens - t0);
                let p = row_partial(row, t0, nt, lid, WG);
                let acc = subgroupAdd(p.acc);
                let ss = subgroupAdd(p.ss);
                if (lane == 0u) {
                    team_part[sg] = Partial(acc, ss);
                }
                workgroupBarrier();
                if (lid == 0u) {
                    var total = team_part[0];
                    for (var i = 1u; i < nsg; i++) {
                        total.acc += team_part[i].acc;
                        total.ss += team_part[i].ss;
                    }
                    finish_row(row, t0, nt, total.acc, total.ss);
                }
                workgroupBarrier();
            }
        }
        return;
    }
    for (var row = wg.x * nsg + sg; row < params.rows; row += nwg.x * nsg) {
        for (var t0 = 0u; t0 < params.tokens; t0 += TILE) {
            let nt = min(TILE, params.tokens - t0);
            let p = row_partial(row, t0, nt, lane, sg_size);
            let acc = subgroupAdd(p.acc);
            let ss = subgroupAdd(p.ss);
            if (lane == 0u) {
                finish_row(row, t0, nt, acc, ss);
            }
        }
    }
}

// Several tokens (speculative verify): as main's subgroup per row, but one pass takes up to QT
// tiles (4 QT tokens), so each unit is loaded and dequantized once for all of them.
override QT: u32 = 3u;  // tiles per pass of main_t (1, 2 or 3)

struct Partials {
    p0: Partial,  // tokens t0 .. t0 + 3
    p1: Partial,  // t0 + 4 .. t0 + 7
    p2: Partial,  // t0 + 8 .. t0 + 11
}

// Applies dequantized unit u (values v) to the pass's tiles of n.x, n.y, n.z tokens (n.y, n.z may
// be 0). Three pointers, not one to Partials: naga 29 fails on a pointer to a member of a pointee.
fn apply_unit_t(p0: ptr<function, Partial>, p1: ptr<function, Partial>, p2: ptr<function, Partial>,
                v: array<vec4<f32>, UNIT / 4u>, u: u32, t0: u32, n: vec3<u32>) {
    for (var k = 0u; k < UNIT / 4u; k++) {
        let c = unit_col(u, k);
        add4(p0, v[k], c, t0, n.x);
        if (n.y > 0u) {
            add4(p1, v[k], c, t0 + 4u, n.y);
        }
        if (n.z > 0u) {
            add4(p2, v[k], c, t0 + 8u, n.z);
        }
    }
}

// row_partial for the pass's tiles: units lane, lane + team, ..., four loaded before any is used.
fn row_partials(row: u32, t0: u32, n: vec3<u32>, lane: u32, team: u32) -> Partials {
    var p0 = Partial(vec4<f32>(0.0), vec4<f32>(0.0));
    var p1 = p0;
    var p2 = p0;
    let units = params.cols / UNIT;
    var u = lane;
    while (u + 3u * team < units) {
        let v0 = unit_values(row, u);
        let v1 = unit_values(row, u + team);
        let v2 = unit_values(row, u + 2u * team);
        let v3 = unit_values(row, u + 3u * team);
        apply_unit_t(&p0, &p1, &p2, v0, u, t0, n);
        apply_unit_t(&p0, &p1, &p2, v1, u + team, t0, n);
        apply_unit_t(&p0, &p1, &p2, v2, u + 2u * team, t0, n);
        apply_unit_t(&p0, &p1, &p2, v3, u + 3u * team, t0, n);
        u += 4u * team;
    }
    while (u < units) {
        apply_unit_t(&p0, &p1, &p2, unit_values(row, u), u, t0, n);
        u += team;
    }
    return Partials(p0, p1, p2);
}

// Sums a tile's partials over the subgroup (the sums of squares only with the fused norm) and lane
// 0 writes its nt tokens.
fn finish_tile(p: Partial, row: u32, t0: u32, nt: u32, lane: u32) {
    let acc = subgroupAdd(p.acc);
    var ss = p.ss;
    if ((params.flags & 4u) != 0u) {
        ss = subgroupAdd(ss);
    }
    if (lane == 0u) {
        finish_row(row, t0, nt, acc, ss);
    }
}

// #include subgroup_fold.wgsl

@compute @workgroup_size(WG)
fn main_t(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(subgroup_id) sg: u32, @builtin(num_subgroups) nsg: u32,
          @builtin(subgroup_invocation_id) lane: u32, @builtin(subgroup_size) sg_size: u32) {
    for (var row = wg.x * nsg + sg; row < params.rows; row += nwg.x * nsg) {
        for (var t0 = 0u; t0 < params.tokens; t0 += 4u * QT) {
            let left = params.tokens - t0;  // tokens of the pass's tiles: 4, 4, then the rest
            let n = vec3<u32>(min(left, 4u), select(0u, min(left - 4u, 4u), QT > 1u && left > 4u),
                              select(0u, min(left - 8u, 4u), QT > 2u && left > 8u));
            let p = row_partials(row, t0, n, lane, sg_size);
            if (QT == 1u) {
                finish_tile(p.p0, row, t0, n.x, lane);
                continue;
            }
            // 8 slots (tile k's sums at 2k, its sums of squares at 2k + 1, two spare) halved over
            // lane ^ 1 and lane ^ 2 (4 + 2 shuffles), then xor-added: 12 vec4 shuffles on 32 lanes
            // instead of 30 for 6 subgroupAdds. Lane 0 then holds tile 0, lane 2 tile 1, lane 1 tile 2.
            let zero = vec4<f32>(0.0);
            let u0 = fold(p.p0.acc, p.p2.acc, lane, 1u);
            let u1 = fold(p.p0.ss, p.p2.ss, lane, 1u);
            let u2 = fold(p.p1.acc, zero, lane, 1u);
            let u3 = fold(p.p1.ss, zero, lane, 1u);
            var acc = fold(u0, u2, lane, 2u);
            var ss = fold(u1, u3, lane, 2u);
            for (var m = 4u; m < min(sg_size, WG); m <<= 1u) {
                acc += subgroupShuffleXor(acc, m);
                ss += subgroupShuffleXor(ss, m);
            }
            let k = min(2u * (lane & 1u) + ((lane >> 1u) & 1u), 2u);  // the tile lane 0, 1, 2 holds
            if (lane < 3u && n[k] > 0u) {
                finish_row(row, t0 + 4u * k, n[k], acc, ss);
            }
        }
    }
}
// #else
// For adapters without subgroups: one workgroup per row, tree reduction in workgroup memory.
const SHARED_WG: u32 = 64u;
var<workgroup> partials: array<Partial, SHARED_WG>;

@compute @workgroup_size(SHARED_WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lane: u32) {
    for (var row = wg.x; row < params.rows; row += nwg.x) {
        for (var t0 = 0u; t0 < params.tokens; t0 += TILE) {
            let nt = min(TILE, params.tokens - t0);
            partials[lane] = row_partial(row, t0, nt, lane, SHARED_WG);
            workgroupBarrier();
            for (var s = SHARED_WG / 2u; s > 0u; s >>= 1u) {
                if (lane < s) {
                    partials[lane].acc += partials[lane + s].acc;
                    partials[lane].ss += partials[lane + s].ss;
                }
                workgroupBarrier();
            }
            if (lane == 0u) {
                finish_row(row, t0, nt, partials[0].acc, partials[0].ss);
            }
            workgroupBarrier();
        }
    }
}
// #endif
