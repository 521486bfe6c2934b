"""GpuTuning: every kernel-choice knob of the GPU backend in one place.

`WgpuOps` reads these when it plans a dispatch (kjarni/gpu/linear.py, attention.py, ops.py); a
benchmark or a sweep passes its own ``WgpuOps(..., tuning=GpuTuning(...))`` or sets fields on
``ops.tuning`` before the first product of the shapes it changes (plans are cached per shape once
made). The defaults are the H200 measurements recorded in docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

# (segment rows, cols) -> (TM, TN, BK, KSPLIT, NBUF, S): the H200 sweeps' fastest on Qwen2.5-0.5B's
# and 1.5B's products at 512 tokens, f16 (docs/benchmarks.md, fifth session; the 1.5B ones from the
# first sweep, before f16's loads were kept raw again), used for every format and token count of
# those shapes.
H200_MATMUL_CONFIGS: dict[tuple[int, int], tuple[int, int, int, int, int, int]] = {
    (1152, 896): (8, 16, 8, 4, 1, 1),  # 0.5B qkv (fused norm)
    (896, 896): (8, 16, 8, 4, 1, 2),  # 0.5B o_proj
    (9728, 896): (8, 16, 8, 1, 1, 1),  # 0.5B gate_up (fused norm)
    (896, 4864): (8, 16, 8, 4, 1, 2),  # 0.5B down_proj
    (2048, 1536): (8, 8, 8, 2, 2, 1),  # 1.5B qkv
    (1536, 1536): (8, 16, 8, 4, 1, 4),  # 1.5B o_proj
    (17920, 1536): (8, 16, 8, 1, 2, 1),  # 1.5B gate_up
    (1536, 8960): (8, 16, 8, 4, 1, 4),  # 1.5B down_proj
}


# (segment rows, cols) -> tile: the tensor-core sweep's fastest kernel per Qwen2.5 prefill product at
# 512 tokens on Dawn (tools/sweep_sgmat.py --tiles 64x128x32_2x4 --tc-tiles 12 tiles of SHARED 1-5,
# fifteenth session, on an H100: docs/benchmarks.md): matmul_tc (TM, TN, SM, SN, KU, SHARED); the
# first kernel matmul_sgmat (BM, BN, BK, SM, SN) where it won (H200_SGMAT_TILES). That sweep timed each
# product right after its compile, when an H100 may idle at 345 MHz (seventeenth session), so its
# microseconds below mix clocks; the 1.5B gate_up and down were re-measured on a warm GPU.
H200_TC_TILES: dict[tuple[int, int], tuple[int, int, int, int, int, int] | None] = {
    # qkv and o_proj: 2 x 2 subgroups of 2 x 2 matrices with no K split (H200_TC_SPLITS), in a
    # warm sweep with the split's reduce counted (eighteenth session, H100): 1.5B qkv 36.6 us
    # against 48.4-48.7 for the tiles below split or not, o_proj 33.5 against 45.3-45.6; 0.5B qkv
    # 25.0, o_proj 20.1 (the first kernel's o_proj tile, kept until then, not in that sweep). In
    # the model, bench_gpu in one call: 1.5B f16 31,656 -> 32,514 tok/s, 0.5B f16 69,401 -> 70,426.
    (1152, 896): (2, 2, 2, 2, 2, 5),  # 0.5B qkv
    (896, 896): (2, 2, 2, 2, 2, 5),  # 0.5B o_proj
    (9728, 896): (4, 2, 2, 4, 2, 5),  # 0.5B gate_up (fused norm): 100.1 us (SHARED 1's 4x4_2x2 190.7)
    (896, 4864): (4, 4, 2, 2, 2, 3),  # 0.5B down_proj: 90.7 us (the first kernel 114.2)
    (2048, 1536): (2, 2, 2, 2, 2, 5),  # 1.5B qkv
    (1536, 1536): (2, 2, 2, 2, 2, 5),  # 1.5B o_proj
    # 1.5B gate_up: in the model (tools/ablate_gpu.py --prefill --choices, seventeenth session, H100)
    # 232.6 us a layer against SHARED 1's 473.1 (4x2_2x4_k2_w 234.5); the warm sweep agrees (239.2
    # against 465.0). The fifteenth session's sweep had ranked SHARED 1 first (487.8 against 990-1090).
    (17920, 1536): (2, 4, 4, 2, 2, 3),
    (1536, 8960): (4, 2, 2, 4, 2, 5),  # 1.5B down_proj: warm sweep 147.4 us (2x4_4x2_k2_p 145.0, SHARED 1 245.9)
}
# (GGUF format, segment rows, cols) -> matmul_tc SHARED tile for quantized prefill weights (tc_quant):
# the sweep's fastest per Qwen2.5-0.5B product at 512 tokens on Dawn (tools/sweep_sgmat.py --format
# q8_0 / q4_k, SHARED 1, 3 and 5 tiles, seventeenth session, H100; its products timed at a low clock,
# so the ranking is checked in the model: bench_gpu's whole 0.5B prefill went from 52,435 to 70,263
# tok/s (Q8_0) and 49,454 to 57,295 (Q4_K) in the same call, docs/benchmarks.md); other shapes take
# tc_quant_tile.
H200_TC_QUANT_TILES: dict[tuple[str, int, int], tuple[int, int, int, int, int, int] | None] = {
    ("Q8_0", 1152, 896): (4, 4, 2, 2, 2, 1),  # 0.5B qkv
    ("Q8_0", 896, 896): (4, 2, 2, 4, 2, 5),  # 0.5B o_proj
    ("Q8_0", 9728, 896): (4, 2, 2, 4, 2, 5),  # 0.5B gate_up
    ("Q8_0", 896, 4864): (4, 2, 2, 4, 2, 5),  # 0.5B down_proj
    ("Q5_0", 1152, 896): (4, 4, 2, 2, 2, 1),  # 0.5B qkv (the Q4_K file's Q5_0 rows)
    ("Q5_0", 896, 896): (4, 2, 2, 4, 2, 5),  # 0.5B o_proj
    ("Q5_0", 9728, 896): (4, 2, 2, 4, 2, 5),  # 0.5B gate_up
    ("Q4_K", 896, 4864): (4, 2, 2, 4, 2, 5),  # 0.5B down_proj
}
# (segment rows, cols) -> matmul_tc's K splits of f16 weights, over the rule (the shapes above that
# run unsplit). Not for quantized weights: the 0.5B Q8_0 and Q4_K prefill lost 10-20% with their
# qkv and o_proj tiles unsplit (58,572 and 46,448 tok/s against 65,501 and 58,124, eighteenth session).
H200_TC_SPLITS: dict[tuple[int, int], int] = {(1152, 896): 1, (896, 896): 1, (2048, 1536): 1, (1536, 1536): 1}
# (segment rows, cols) -> the first kernel's tile (matmul_sgmat), where it beats matmul_tc: none
# since the eighteenth session (the 0.5B o_proj's (64, 128, 32, 2, 4), 36.2 us in the fifteenth
# session's sweep, went to matmul_tc's unsplit 2x2_2x2_k2_w: see H200_TC_TILES).
H200_SGMAT_TILES: dict[tuple[int, int], tuple[int, int, int, int, int] | None] = {}


# (format, segment rows, cols) -> (WG, LANES, R, UN, workgroups at most or 0): the fastest
# matvec_dot.tmpl.wgsl configuration per Qwen2.5-0.5B / 1.5B decode matrix in one H200 sweep
# (tools/sweep_matvec.py --variants mv0,dot,dotu, docs/benchmarks.md, sixth session).
H200_MATVEC_DOT_CONFIGS: dict[tuple[str, int, int], tuple[int, int, int, int, int]] = {
    ("Q8_0", 2048, 1536): (256, 32, 1, 1, 0),  # 1.5B qkv
    ("Q5_0", 2048, 1536): (128, 32, 1, 2, 0),  # 1.5B qkv
    ("Q4_K", 2048, 1536): (256, 32, 1, 2, 0),  # 1.5B qkv
    ("Q8_0", 1536, 1536): (256, 32, 1, 1, 0),  # 1.5B o_proj
    ("Q5_0", 1536, 1536): (256, 32, 1, 2, 0),  # 1.5B o_proj
    ("Q4_K", 1536, 1536): (256, 32, 1, 2, 0),  # 1.5B o_proj
    ("Q8_0", 17920, 1536): (128, 16, 4, 1, 0),  # 1.5B gate_up
    ("Q5_0", 17920, 1536): (128, 8, 1, 2, 0),  # 1.5B gate_up
    ("Q4_K", 17920, 1536): (128, 8, 2, 2, 0),  # 1.5B gate_up
    ("Q8_0", 1536, 8960): (256, 32, 1, 2, 0),  # 1.5B down_proj
    ("Q5_0", 1536, 8960): (256, 32, 1, 2, 0),  # 1.5B down_proj
    ("Q4_K", 1536, 8960): (256, 32, 2, 2, 0),  # 1.5B down_proj
    ("Q8_0", 151936, 1536): (128, 16, 2, 1, 1024),  # 1.5B LM head
    ("Q5_0", 151936, 1536): (128, 16, 4, 1, 0),  # 1.5B LM head
    ("Q4_K", 151936, 1536): (128, 8, 4, 2, 0),  # 1.5B LM head
    ("Q8_0", 1152, 896): (256, 32, 1, 1, 0),  # 0.5B qkv
    ("Q5_0", 1152, 896): (256, 32, 1, 1, 0),  # 0.5B qkv
    ("Q8_0", 896, 896): (256, 32, 1, 1, 0),  # 0.5B o_proj
    ("Q5_0", 896, 896): (256, 32, 1, 1, 0),  # 0.5B o_proj
    ("Q8_0", 9728, 896): (128, 16, 2, 2, 0),  # 0.5B gate_up
    ("Q5_0", 9728, 896): (128, 8, 1, 1, 0),  # 0.5B gate_up
    ("Q8_0", 896, 4864): (256, 32, 1, 2, 0),  # 0.5B down_proj
    ("Q5_0", 896, 4864): (256, 32, 1, 2, 0),  # 0.5B down_proj
    ("Q4_K", 896, 4864): (256, 32, 1, 2, 0),  # 0.5B down_proj
    ("Q8_0", 151936, 896): (256, 32, 4, 1, 1024),  # 0.5B LM head
    ("Q5_0", 151936, 896): (128, 8, 2, 1, 0),  # 0.5B LM head
}

# (segment rows, cols) -> (WG, LANES, R, UN, workgroups at most or 0): the fastest
# matvec_f16.tmpl.wgsl configuration per f16 decode matrix of Qwen2.5-0.5B / 1.5B and SmolLM2-135M
# in one H200 sweep (tools/sweep_matvec.py --variants mv0,h16,h16c, docs/benchmarks.md, seventh
# session); None: the float template (matvec.tmpl.wgsl) was faster.
H200_MATVEC_F16_CONFIGS: dict[tuple[int, int], tuple[int, int, int, int, int] | None] = {
    (2048, 1536): (256, 64, 2, 1, 0),  # 1.5B qkv
    (1536, 1536): (256, 64, 1, 1, 0),  # 1.5B o_proj
    (17920, 1536): (256, 32, 2, 2, 0),  # 1.5B gate_up
    (1536, 8960): None,  # 1.5B down: 14.9 us in the float template, 20.8 here (x staged 8960 wide)
    (151936, 1536): (256, 32, 2, 2, 0),  # 1.5B LM head
    (1152, 896): (256, 64, 1, 2, 0),  # 0.5B qkv
    (896, 896): (256, 64, 1, 1, 0),  # 0.5B o_proj
    (9728, 896): (128, 16, 2, 2, 0),  # 0.5B gate_up
    (896, 4864): (256, 64, 1, 4, 0),  # 0.5B down
    (151936, 896): (256, 16, 4, 2, 2112),  # 0.5B LM head
    (960, 576): (256, 64, 2, 1, 0),  # SmolLM2 qkv
    (576, 576): (256, 64, 2, 1, 0),  # SmolLM2 o_proj
    (3072, 576): (256, 64, 2, 1, 0),  # SmolLM2 gate_up
    (576, 1536): (256, 64, 2, 2, 0),  # SmolLM2 down
    (49152, 576): (256, 16, 2, 2, 1056),  # SmolLM2 LM head
}


@dataclass
class GpuTuning:
    """Kernel choices of `WgpuOps` (see the module docstring); each field says what it steers."""

    # ---------------------------------------------------------------- linear: which kernel family
    matvec_max_tokens: int = 9
    """Up to this many tokens (decode, a speculative verify of k <= 8) the matrix-vector kernels
    run; more tokens take the tiled matmul (prefill)."""

    # ---------------------------------------------------------------- linear: prefill matmul
    matmul_min_big_tiles: int = 1024
    """matmul.tmpl.wgsl: 128x128 output tiles (K split over 2 thread groups) from this many such
    tiles, else 64 tokens x 128 rows (rules from tools/sweep_matmul.py on the H200)."""
    matmul_split_k_below: int = 512
    """Fewer 64x128 tiles than this: 4 thread groups split K inside each workgroup."""
    matmul_splits: int | None = None
    """Prefill products split over K across workgroups too (grid z, summed by matmul_reduce): None =
    automatic (see ``matmul_split_tiles``), or a count; never with a fused norm."""
    matmul_split_tiles: int = 128
    """Automatic split: products of fewer tiles than this get about this many workgroups."""
    matmul_max_splits: int = 6
    """Automatic split: at most this many K splits per tile."""
    matmul_nbuf: int = 1
    """2: double-buffered matmul tiles (one barrier a K step) where workgroup memory allows."""
    matmul_unchecked: bool = True
    """Compile matmul.tmpl.wgsl without naga's runtime index checks (every access is in range by
    construction: x rows clamped to the prompt, columns guarded by the step's end, weight rows
    padded to whole units and clamped to the last row, workgroup tiles sized by the overrides).
    H200, wgpu-native, 512-token prefill (tools/ab_attention_gpu.py, 2 rounds): matmuls of the
    1.5B f16 shape 56.2 -> 49.0 ms (8,410 -> 9,548 tok/s), 0.5B f16 18.9 -> 16.5 ms (23,350 ->
    26,600), 0.5B Q8_0 20.9 -> 18.7 ms (docs/benchmarks.md, tenth session)."""
    matmul_configs: dict[tuple[int, int], tuple[int, int, int, int, int, int]] = field(
        default_factory=lambda: dict(H200_MATMUL_CONFIGS))
    """Per (segment rows, cols): (TM, TN, BK, KSPLIT, NBUF, S) measured by tools/sweep_matmul.py,
    overriding the rules above (S = 1 where a fused norm forbids the split)."""

    # ---------------------------------------------------------------- linear: tensor cores
    tensor_cores: bool = True
    """Tensor cores (f16 x f16, f32 sums) for the prefill of f16 segments where the device has an
    f16 subgroup-matrix configuration (Dawn; wgpu-native offers none, so nothing changes there):
    matmul_tc.tmpl.wgsl, or matmul_sgmat.tmpl.wgsl for the shapes of ``sgmat_tiles``. The
    activations are rounded to f16 for those products (``NumpyOps(activations="f16")`` is their
    reference). H200, Qwen2.5-0.5B f16, 512 tokens on Dawn: 46,740 prefill tok/s against 25,277
    with SIMT kernels (docs/benchmarks.md, sixth session); H100 with the fifteenth session's tiles:
    65,402 against 47,642 at the previous ones. False: SIMT kernels in float32."""
    tc_tile: tuple[int, int, int, int, int, int] | None = (4, 2, 2, 2, 2, 0)
    """matmul_tc.tmpl.wgsl's tile (TM, TN, SM, SN, KU, SHARED) of kernels.TC_TILES for shapes not in
    ``tc_tiles`` (not measured: 2 x 2 subgroups of 4 x 2 matrices, operands from storage)."""
    tc_tiles: dict[tuple[int, int], tuple[int, int, int, int, int, int] | None] = field(
        default_factory=lambda: dict(H200_TC_TILES))
    """Per (segment rows, cols): a matmul_tc tile, or None for the SIMT kernel (tools/sweep_sgmat.py)."""
    tc_quant: bool = True
    """Tensor cores also for quantized prefill weights (kernels.TC_QUANT_FORMATS: Q8_0, Q4_K, Q5_0, ..)
    where the device has an f16 subgroup-matrix configuration (Dawn; nothing changes on wgpu-native):
    matmul_tc dequantizes each weight tile to f16 in workgroup memory (one f16 rounding of the
    dequantized weight; ``NumpyOps(weight_format="f16", activations="f16")`` is the reference).
    H200, Qwen2.5-0.5B, 512 tokens on Dawn: Q8_0 50,665 prefill tok/s against 22,753 with the SIMT
    kernel, Q4_K 47,634 against 22,853 (docs/benchmarks.md, eighth session). False: the SIMT matmul
    in float32."""
    tc_quant_tile: tuple[int, int, int, int, int, int] = (4, 2, 2, 4, 2, 5)
    """matmul_tc's tile for quantized weights where ``tc_quant_tiles`` names none (a SHARED tile).
    4x2_2x4_k2_w: the Qwen2.5-1.5B Q4_K prefill (every product on this tile) 24,730 tok/s against
    19,777 with SHARED 1's 4x4_2x2_k2_s, bench_gpu in one call on an H100 (seventeenth session,
    docs/benchmarks.md)."""
    tc_quant_tiles: dict[tuple[str, int, int], tuple[int, int, int, int, int, int] | None] = field(
        default_factory=lambda: dict(H200_TC_QUANT_TILES))
    """Per (format, segment rows, cols): a SHARED matmul_tc tile, or None for the SIMT kernel."""
    tc_silu: bool = True
    """A SwiGLU MLP's gate_up on tensor cores (with an even TN tile and no K split) writes
    silu(gate) up as the down projection's f16 activations from its epilogue (matmul_tc's silu
    flag), instead of [gate | up] in f32 for matmul_tc_prep to read: a quarter of the bytes stored
    and a prep dispatch a layer fewer (`Linear.record_swiglu`)."""
    tc_reduce_prep: bool = True
    """A product split over K on tensor cores leaves its matmul_reduce to the next linear
    (`ReducePending`): where that one norms its input on tensor cores (down_proj then the next
    layer's qkv; with quantized weights also o_proj then gate_up), matmul_reduce_prep.wgsl writes
    the sums and the next f16 activations in one dispatch, the values of the two it replaces."""
    tc_tokens_first: bool = False
    """matmul_tc's grid order: token tiles fastest (the workgroups sharing a weight tile run side by
    side) instead of row tiles fastest (sharing an activation tile). Off: on an H100 it tied or lost
    on every product it was measured on (docs/benchmarks.md, sixteenth session)."""
    tc_tokens_first_for: dict[tuple[int, int], bool] = field(default_factory=dict)
    """Per (segment rows, cols): matmul_tc's grid order, over ``tc_tokens_first``."""
    tc_splits: int | None = None
    """K split of matmul_tc over workgroups: None = automatic (the ``sgmat_split_*`` rule), or a count."""
    tc_split_counts: dict[tuple[int, int], int] = field(default_factory=lambda: dict(H200_TC_SPLITS))
    """Per (rows, cols) of f16 weights: K splits of matmul_tc, over the rule (quantized weights keep the rule)."""
    sgmat_tiles: dict[tuple[int, int], tuple[int, int, int, int, int] | None] = field(
        default_factory=lambda: dict(H200_SGMAT_TILES))
    """The first tensor-core kernel (matmul_sgmat.tmpl.wgsl), only for the shapes named here:
    per (segment rows, cols) a tile (BM, BN, BK, SM, SN) of kernels.SGMAT_TILES."""
    sgmat_split_counts: dict[tuple[int, int], int] = field(default_factory=dict)
    """Per (rows, cols): K splits of the tensor-core matmul, over the rule below."""
    sgmat_splits: int | None = None
    """K split of the tensor-core matmul over workgroups: None = automatic, or a count."""
    sgmat_split_below: int = 264
    """Automatic: fewer tiles than this (2 waves of the H200's 132 SMs) split K."""
    sgmat_max_splits: int = 4
    """Automatic: at most this many tensor-core K splits."""

    # ---------------------------------------------------------------- linear: integer-dot prefill
    matmul_int_dot: bool = True
    """Prefill products by Q8_0, Q5_0, Q4_0, Q4_K, Q4_1, Q5_1 and Q6_K weights (kernels.DOT_SCALING)
    that do not run on tensor cores (all of them on wgpu-native) run matmul_dot.tmpl.wgsl: x
    quantized once per product to int8 blocks of 32 by matmul_dot_prep.wgsl (norm and silu_mul
    applied first), dot4I8Packed against the weights' quants in a 64-row tile, the scales in f32
    (``NumpyOps(quantized_prefill_min_tokens=matvec_max_tokens + 1)`` is the reference). H100, wgpu-native,
    512-token prefill (tools/ab_attention_gpu.py, 2 rounds, docs/benchmarks.md twenty-first
    session): Qwen2.5-0.5B Q8_0 24,315 / 24,394 -> 47,415 / 48,110 tok/s, Q4_K 24,863 / 25,036 ->
    43,559 / 44,572, 1.5B Q4_K 8,029 / 8,014 -> 16,207 / 16,509 (Q4_0, Q4_1, Q5_1 and Q6_K joined
    after that call: checked on lavapipe, not timed on a GPU). The rounding moves logits: the
    default model's (SmolLM2-135M-Instruct Q4_1) for a 41-token prompt by up to 1.0, mean 0.14,
    from float32, the top token unchanged at every position. False: the SIMT matmul in float32."""
    matmul_dot_tile: int = 4
    """matmul_dot's tile where ``matmul_dot_tiles`` names none: TI (kernels.DOT_TILES, 4 or 8)
    token registers a thread, 64 rows x 16 TI tokens a workgroup. TI 8 lost on every product on
    the H100 (0.5B Q8_0 prefill 43,356 / 43,239 against 47,415 / 48,110 tok/s)."""
    matmul_dot_tiles: dict[tuple[str, int, int], int] = field(default_factory=dict)
    """Per (format, segment rows, cols): matmul_dot's TI."""
    matmul_dot_splits: int | None = None
    """K split of matmul_dot over workgroups: None = automatic (fewer tiles than
    ``sgmat_split_below`` split, at most ``sgmat_max_splits`` ways, at least 4 steps of 64 each), or a count."""
    matmul_dot_unchecked: bool = False
    """Compile matmul_dot without naga's runtime index checks (its loads are clamped to the last
    token and row and its tiles sized by the variant, so every index is in range by construction).
    Off: slower on the H100 (0.5B Q8_0 prefill 43,896 / 44,116 against 47,415 / 48,110 tok/s)."""

    # ---------------------------------------------------------------- linear: decode matvec
    matvec_template: bool = True
    """One-token products run matvec.tmpl.wgsl or matvec_dot.tmpl.wgsl (False: the older linear_body
    and linear_q* kernels, to compare)."""
    matvec_template_configs: dict[tuple[str, int, int], tuple[int, int, int, int]] = field(default_factory=dict)
    """Per (format, segment rows, cols): (WG, LANES, R, UN) of matvec.tmpl.wgsl from
    tools/sweep_matvec.py, else `linear.matvec_config`'s defaults."""
    matvec_int_dot: bool = True
    """One-token products by Q8_0, Q5_0 and Q4_K weights run matvec_dot.tmpl.wgsl: x quantized to
    int8 blocks of 32 in each workgroup, dot4I8Packed against the quants (False: matvec.tmpl.wgsl
    in float32, to compare; NumpyOps(quantize_activations=True) is the reference of the first)."""
    matvec_dot_configs: dict[tuple[str, int, int], tuple[int, int, int, int, int]] = field(
        default_factory=lambda: dict(H200_MATVEC_DOT_CONFIGS))
    """Per (format, segment rows, cols): (WG, LANES, R, UN, workgroups at most, 0 = one per row
    set) of matvec_dot.tmpl.wgsl from tools/sweep_matvec.py, else `Linear.matvec_dot_config`'s rules."""
    matvec_dot_unchecked: bool = True
    """Compile matvec_dot without naga's runtime index checks (it clamps its rows itself and
    reads nothing past its buffers; H200 sweep: 5-65% faster than checked at the same shape)."""
    matvec_f16: bool = True
    """One-token products by f16 weights run matvec_f16.tmpl.wgsl (x staged in workgroup memory,
    R x UN weight loads a trip written out, a capped grid); False: matvec.tmpl.wgsl, to compare."""
    matvec_f16_configs: dict[tuple[int, int], tuple[int, int, int, int, int] | None] = field(
        default_factory=lambda: dict(H200_MATVEC_F16_CONFIGS))
    """Per (segment rows, cols): (WG, LANES, R, UN, workgroups at most, 0 = one per row set) of
    matvec_f16.tmpl.wgsl from tools/sweep_matvec.py, or None for the float template; other shapes:
    `Linear.matvec_f16_config`'s rules."""
    matvec_f16_unchecked: bool = True
    """Compile matvec_f16 without naga's runtime index checks (its indices are in range by
    construction: rows clamped, units below cols / 8)."""
    matvec_rows: int = 4
    """Rows per workgroup of linear_body's plain ``matvec``."""
    matvec_max_threads: int = 256
    """Threads per plain ``matvec`` workgroup: about one 8-column chunk each, 64 ..= this."""
    matvec_subgroup_max_chunks: int = 256
    """Rows of up to 8 x this columns: one subgroup per rows (``matvec_sg``)."""
    matvec_subgroup_threads: int = 256
    """Workgroup size of ``matvec_sg`` (8 subgroups of 32)."""
    matvec_configs: dict[tuple[int, int], tuple[int, int, int]] = field(default_factory=dict)
    """f16/f32 (segment rows, cols) -> (threads, rows, chunks per step) of ``matvec_u``, from
    tools/sweep_matvec.py; other shapes keep ``matvec_sg`` / ``matvec``."""
    matvec_u_default: bool = True
    """Rows of <= 2048 columns: ``matvec_u`` as the H200 sweep chose (else ``matvec_sg``)."""

    # ---------------------------------------------------------------- linear: a few tokens
    matvec_t_min_tokens: int = 2
    """From this many tokens to ``matvec_max_tokens``: linear_body's ``matvec_t`` (f16/f32), which
    loads each weight chunk once for up to 4 x ``matvec_t_quads`` tokens. Above
    ``matvec_max_tokens``: the per-token kernels (to compare)."""
    quant_t_min_tokens: int = 2
    """As ``matvec_t_min_tokens`` for the quantized ``main_t``."""
    matvec_t_quads: int = 3
    """Token quads (tiles of 4) per pass of ``matvec_t`` / ``main_t``: 1, 2 or 3."""
    matvec_t_configs: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    """f16/f32 (segment rows, cols) -> (threads, rows) of ``matvec_t``; other shapes: 128 threads
    on 4 rows (2 under 1024 rows), 32 threads from 65536 rows, 256 on 4 past 2048 columns."""
    quant_split_k_min_cols: int | None = None
    """Quantized decode rows at least this long: a workgroup per row (``SPLIT_K``); None: never."""
    quant_split_k_threads: int = 256
    """Threads sharing a row with ``SPLIT_K``."""

    # ---------------------------------------------------------------- fusions of the decode step
    fuse_silu: bool = True
    """silu_mul is applied inside the following linear (``LINEAR_SILU``)."""
    matvec_glu: bool = True
    """A one-token SwiGLU MLP's gate_up matvec (matvec_f16 or matvec_dot, an even number of rows a
    group) writes silu(gate) up itself (its ``glu`` flag), so the down projection reads a plain x
    instead of recomputing silu over [gate | up] in each of its workgroups (`Linear.glu_fusable`).
    H100, 512-token context: the 1.5B f16 step's down 557 -> 511 µs (twenty-second session); the
    0.5B Q8_0 step's matvec_dot 760 -> 734 µs, 1.5B Q4_K 1,208 -> 1,152 (twenty-fifth)."""
    fuse_rope: bool = True
    """A one-token rope_store is recorded by the next attention (attention_step.wgsl)."""
    attention_step_threads: int = 1024
    """Threads of an unsplit attention_step (at most; head_dim / 4 times a power of two)."""
    attention_step_splits: int = 16
    """Flash-decoding inside attention_step: workgroups per head, each over a run of the keys,
    merged by the o_proj matvec (1: one workgroup per head writes the output); needs subgroups.
    16 (with ``attention_step_lean``, 8 key lanes and 256 split threads): the H200 A/B of the
    eighth session (tools/ab_attention_gpu.py, docs/benchmarks.md), attention_step plus the merging
    o_proj 860-878 -> 780-788 us a step (1.5B), 548-550 -> 519-520 (0.5B), 658-662 -> 612-618
    (SmolLM2) at a 512-token context, against 8 splits of 128 threads, 4 lanes, not lean."""
    attention_step_split_keys: int = 256
    """A split attention_step's splits double from ``attention_step_splits`` while they would hold
    more than this many keys each, up to ``attention_step_max_splits`` (0: never double). H100, the
    twelfth session (tools/ab_attention_gpu.py, docs/benchmarks.md): 16 splits against 32 at 2,048
    positions 703 / 678 tok/s (0.5B), 403 / 406 (1.5B); at 8,192 555 / 605 and 299 / 346; 64
    splits lost everywhere (the merging o_proj reads every split's partial)."""
    attention_step_max_splits: int = 32
    """The most workgroups per head a split attention_step doubles to (each holds at most 1,024 keys)."""
    attention_step_max: int = 0
    """A one-token step runs attention_step up to this many positions (0: as far as its splits reach,
    ``attention_step_max_splits`` x 1,024 keys, or ``attention_single_max`` unsplit), else
    rope_store, attention_single or flash-decoding. H100, twelfth session: past the old limit of
    768 positions attention_step decodes 1.37x faster than rope_store + attention_decode +
    attention_combine at 2,048 positions and 1.6-1.9x at 8,192 (docs/benchmarks.md)."""
    attention_step_lean: bool = True
    """attention_step with fewer serial steps a workgroup: the new key scored by the parallel score
    loop (not one thread over all dims), the softmax sum in one barrier, the partial outputs added
    in one pass after one barrier (not a tree of log2(threads / (head_dim / 4)) barriers)."""
    attention_step_key_lanes: int = 8
    """Threads per key in attention_step's scores (with subgroups): the largest of 8, 4, 2, 1 at
    most this that divides head_dim / 4 (8: the smallest subgroup size seen, lavapipe's)."""
    attention_step_q_regs: bool = False
    """attention_step's score lanes rotate their own vec4s of q into registers (where one holds at
    most 4: head_dim / 4 / key lanes), so the cache keys' loads need no barrier before them and
    overlap q's and the new key's; the new key is stored and scored after them (the kernel's
    QREG). Off: not timed yet (the twenty-sixth and twenty-seventh sessions got no device;
    docs/benchmarks.md names the A/B to run)."""
    attention_step_one_barrier: bool = False
    """attention_step's softmax max and sum in one barrier (the kernel's ONE_BARRIER): each
    subgroup's (max, sum) pair of its scores through workgroup memory, combined by every thread,
    and the p v weights exp(s - m) taken from the raw scores; instead of a max, a pass over the
    scores and a sum (three barriers). Off: not timed yet, as ``attention_step_q_regs``."""
    attention_step_unchecked: bool = False
    """Compile attention_step without naga's runtime checks (index clamping, loop bounding): every
    access is in range by construction (cache rows clamped to the run's keys, the key runs at most
    MAX_KEYS, which `Attention.step_max_keys` keeps). The only checked kernel of a decode layer.
    Off: not timed yet, as ``attention_step_q_regs``."""
    attention_split_threads: int = 256
    """Threads of a split attention_step (at most; head_dim / 4 times a power of two)."""
    matvec_attn_merge: bool = True
    """The o_proj matvec merges a split attention_step's partials (False: attention_combine, one
    workgroup per head, then the plain o_proj: a dispatch more)."""
    matvec_attn_threads: int = 512
    """The merging matvec (o_proj after a split attention_step; matvec.tmpl.wgsl, or matvec_f16 with
    1 row a group, 2 units a trip, no cap): workgroup threads. Its workgroups
    each merge the whole x: fewer, larger ones read the partials fewer times (H200, 0.5B o_proj,
    256 / 32: 12.5 us against 7.4 unmerged). 512 over 256 (H100, twenty-fifth session,
    tools/ab_attention_gpu.py, 512-token context): the 1.5B f16 step's o_proj 311-329 against
    345-364 µs in seven rounds of two calls; 0.5B and SmolLM2 f16 unchanged (232-235 against
    234-237, 269-276 against 269-271); 128 lost (1.5B 373-380)."""
    matvec_attn_lanes: int = 32
    """The merging matvec: lanes per row (one row a group, 2 units a trip)."""
    matvec_attn_early: bool = True
    """The merging o_proj with quantized weights (matvec_dot's ``attn`` flag) fetches each thread's
    first trip of weights before it merges and quantizes x (matvec_dot's EARLY), so their latency
    overlaps that phase and its barrier. H100, twenty-fifth session, 512-token context: that o_proj
    221-224 against 234 µs a 0.5B Q8_0 step (decode 1,028-1,048 against 1,019-1,026 tok/s), 283-291
    against 324-335 on 1.5B Q4_K (677-688 against 657-670 tok/s). Only there: on the other
    quantized decode products the same fetch lost (0.5B Q8_0 760-794 against 734 µs a step, 1.5B Q4_K
    1,229-1,266 against 1,147-1,156), and it was removed from them."""

    # ---------------------------------------------------------------- attention
    attention_single_max: int = 768
    """Decode attends in one pass up to this many positions (H200: wins at 512, loses at 1000)."""
    attention_prefill_lanes: int = 8
    """Threads sharing a query row in attention_prefill (at most the smallest subgroup size)."""
    attention_tc: bool = True
    """Prefill with head_dim 64 or 128 on tensor cores where the device has a square f16
    subgroup-matrix configuration (Dawn; 16 x 16 on NVIDIA, 8 x 8 on Mesa's lavapipe):
    attention_tc.tmpl.wgsl, q (scaled) and the softmax weights rounded to f16 for its products
    (``NumpyOps(activations="f16")`` rounds the same). Else attention_tiled."""
    attention_tc_head_dims: tuple[int, ...] = (64, 128)
    """Head sizes attention_tc runs for (of 64 and 128). On an H100 in one call (nineteenth
    session, docs/benchmarks.md), attention GPU us over the layers: Qwen2.5-1.5B (128) 1,506 in
    one pass with 128-key splits against 2,435 with attention_tiled; the 0.5B (64) 865 in one
    pass (attention_tiled took 1,416 in the eighteenth session's call)."""
    attention_tc_warps: int = 4
    """Subgroups a workgroup of attention_tc (each MS query rows): 4 or 2."""
    attention_tc_keys: int = 32
    """Keys a tile of attention_tc: 32 or 64 (a variant beyond the device's workgroup memory falls
    back to 32, then to attention_tiled)."""
    attention_tc_prefetch: bool = False
    """attention_tc with its next tile's K (and V) loads issued before the current tile's
    products (the flag prefetch, attention_tiled's way) instead of right before the tile's
    stores. Off: on an H100 it was slower in two passes (0.5B attention 955 against 909 us) and
    even in one (0.5B 889 against 865, 1.5B 1,889 against 1,892 us; nineteenth session)."""
    attention_tc_online: bool = True
    """attention_tc in one pass over the keys (the flag online): S once a tile, each row's maximum
    raised only when a tile's exceeds it by more than 8 ln 2 (then O goes through workgroup memory
    to be rescaled), instead of a first pass for the maxima. H100, one call: 0.5B attention 865
    against 909 us, 1.5B 1,892 against 2,058 at 64-key splits (nineteenth session)."""
    attention_tc_half: bool = True
    """attention_combine after attention_tc also writes its output in f16 (`WithF16`), which a
    following linear on tensor cores (o_proj) reads instead of running matmul_tc_prep: one
    dispatch fewer a layer, the same values."""
    attention_tc_chunk: int = 64
    """Keys per workgroup of attention_tc at head size 64, and in proportion at other sizes (128
    keys at 128), past which the keys split over workgroups (a multiple of ``attention_tc_keys``;
    0: no split), merged by attention_combine as attention_tiled's splits are. H100, one pass, in
    one call: the 0.5B (64) 865 us at 64 keys, 949 at 128, 1,187 at 256; the 1.5B (128) 1,886 at
    64, 1,510 at 128, 1,678 at 256, 1,987 unsplit (nineteenth session)."""
    attention_tiled: bool = True
    """Prefill with head_dim 64 or 128: attention_tiled.tmpl.wgsl (else attention_prefill)."""
    attention_tiled_rows: int = 0
    """Query rows a workgroup of attention_tiled (16 or 32, with ``attention_tiled_keys``, for the
    head sizes `kernels.ATTENTION_TILED_SHAPES` has that tile for; 0: the per-head_dim default of
    `kjarni.gpu.attention.ATTENTION_TILED_DEFAULTS`)."""
    attention_tiled_keys: int = 0
    """Keys a tile of attention_tiled (16 or 32; 0: the default)."""
    attention_tiled_unchecked: bool = True
    """Compile attention_tiled without naga's runtime index checks (every access is in range by
    construction: keys past the tile's last are not loaded, rows past the prompt not stored).
    H200, wgpu-native, 512-token prefill, all layers (tools/ab_attention_gpu.py, 2 rounds): 1.5B
    5,813 -> 2,446 us, 0.5B 3,184 -> 1,355 us; no change on Dawn, whose fast toggles drop the
    checks anyway (docs/benchmarks.md, ninth session, call 2)."""
    attention_tiled_chunk: int = 128
    """Keys per workgroup of attention_tiled past this many (a multiple of 32; 0: no split)."""
    attention_prefill_chunk: int = 128
    """Keys per workgroup of attention_prefill (head sizes attention_tiled has no tile for) past
    this many (a multiple of 16; 0: no split)."""
    attention_partial_max_bytes: int = 64 << 20
    """attention_tiled's and attention_prefill's split partials: longer chunks beyond this many bytes."""

    # ---------------------------------------------------------------- submits and readback
    prefill_submit_every: int = 24
    """Prefill: submit after a linear once this many dispatches wait."""
    decode_ahead: int = 8
    """Greedy decode: steps submitted per readback, each fed the previous step's id on the GPU
    (the next burst is recorded and submitted while a burst's ids come back: kjarni.decode).
    With that overlap the burst size hardly matters: 8 / 16 / 32 gave 509 / 513 / 513 tok/s on
    the Qwen2.5-1.5B f16 shape and 897 / 910 / 916 on 0.5B (H100, twenty-second session,
    docs/benchmarks.md; without it 457 / 473 / 484 and 796 / 845 / 863). Larger bursts cost
    more discarded steps after an end of text the CPU has not yet seen (up to twice this many
    less one, delaying the next work), so 8."""
    finite_check: bool = True
    """argmax / top_k flag NaN and inf logits (False only to measure the check's cost)."""
    step_capture: bool = True
    """Decode steps (and verifies of up to ``matvec_max_tokens`` tokens) of a `DecoderModel` are
    recorded once into a tape and replayed from it while nothing they depend on changes
    (kjarni/gpu/capture.py): the model's Python runs once per tape, not once per step. False:
    every step is recorded by the model's forward (the same dispatches, tokens and logits)."""

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        # Counts assignments: a step tape recorded under other values is not replayed.
        object.__setattr__(self, "revision", self.__dict__.get("revision", 0) + 1)

    @classmethod
    def field_names(cls) -> list[str]:
        """The names of every knob, in declaration order."""
        return [f.name for f in fields(cls)]
