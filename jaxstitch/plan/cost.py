"""A roofline cost model for one region: our single kernel against what XLA does with it.

Both sides are estimates from bytes and launches. XLA is modelled the way it fuses today: elementwise
chains and one-pass reductions become one kernel (so stitching them gains little), while every
reduction whose result is broadcast back splits the computation into another kernel that re-reads its
inputs and round-trips an intermediate, and every column reduction is its own kernel.
"""
from __future__ import annotations

import dataclasses

from ..core import ir
from ..core import ops as opdefs
from ..core.targets import Target
from .layout import COL, EPILOGUE, FULL, ROW, Layout

OUR_EFFICIENCY = 0.9        # fraction of copy bandwidth a register-resident row kernel reaches
XLA_ONE_PASS_EFFICIENCY = 0.85  # XLA's single-kernel row reductions (measured 75-88% on H200)
XLA_EFFICIENCY = 0.85
# A reduction XLA cannot fuse with the op reading its result back over the row (plan/diamonds.py)
# ends its kernel there; the op's kernel reads the row's inputs again. Both kernels only stream: on
# an H100 a softmax backward, 8x12x512x512 float32, took 165.9 us for five passes (two kernels),
# 101% of the copy bandwidth (96-103% over three shapes, float32 and bfloat16).
XLA_SPLIT_EFFICIENCY = 1.0
# Stitch only when the estimate wins by at least this much. Forced stitching on an H200 (earlier
# kernels), estimated -> measured: RMSNorm with residual, backward, 1.20x -> 1.17x (float32) and
# 1.34x -> 1.18x (bfloat16); bias+GELU backward over 1k columns 1.35x -> 1.32x. (With still older
# kernels the RMSNorm backward measured 0.89-1.14x, when this threshold was 1.5.)
MIN_GAIN = 1.15
# Rows of a few elements (several rows per warp, each thread a vector or two) reach less of the
# bandwidth than the model's OUR_EFFICIENCY: bias+GELU backward over 16 columns, float32, estimated
# 1.38x, measured 0.94x (those earlier kernels). With today's, unstaged (mapping.UNSTAGED_COLS), on an
# H200 by GPU time: 84% of the copy bandwidth in float32 (1.31x over XLA's two kernels), 48% in
# bfloat16 (1.45x; the exact erfc bounds it by instructions).
NARROW_COLS = 32
NARROW_EFFICIENCY = 0.9
# A row split over blocks runs its phases one after another, each ending at a grid barrier, so its
# loads, arithmetic and stores overlap only within a phase: measured on an H200 (softmax fwd+bwd over
# 32 rows of 256k, 4 slices a row, per call): bfloat16 54%, float32 64% of the bandwidth.
SPLIT_EFFICIENCY = 0.55
L2_SPEEDUP = 2.0             # re-reads of a chunked row served by L2, relative to HBM
# One SM alone draws somewhat more than its even share of HBM bandwidth: a grid on k of the target's
# S SMs gets min(1, SM_OVERDRIVE * k / S) of it (H200, softmax fwd+bwd over 32 rows of 256k on 32
# SMs: 25% of the roofline, where 1.0 * 32 / 132 predicts 24%; 1.5 keeps the estimate on our side).
SM_OVERDRIVE = 1.5
# XLA runs a scan along rows (cumsum & co., a reduce-window its rewriter splits into blocks of the
# row) as several kernels over float32 copies of the array: measured on an H100 (2026-11-21), a
# survival curve's cumsum and reverse cumsum over [65536, 512] float32 took 9 kernels and 656 us where
# moving its inputs and outputs once takes 180 us, ~240 us (~5.4 passes over a float32 copy) per
# scan; nucleus sampling's softmax, cumsum and renormalization over [2048, 32000], 13 kernels at 18%
# of the roofline. Counted low, so the estimate stays on XLA's side.
SCAN_XLA_KERNELS = 4
SCAN_XLA_PASSES = 4
# XLA fuses a row reduction with the elementwise ops after it (one pass), but not with a slice,
# concatenate or pad of its result: those run as a second kernel that reads the row inputs again.
# Measured on an H100: an RMS norm followed by a rotary embedding's slices and
# concatenate, [16384, 2048] float32: 2 XLA kernels, 188 us at 49% of the roofline.
# A kernel that reads full-size values through gathers (several shifted views of one input, each
# with its own index arithmetic) is bound by the instructions its SMs issue, not by HBM: it takes
# about its float32 time whatever the dtype, and about the same time on an H100 and an H200. Measured
# (RMS norm + rotary embedding, [16384, 2048], per op of the region that computes, times elements, per
# us): forward 7.4e6 (float32) and 8.7e6 (bfloat16), forward+backward 5.9e6 (both), on an H100's 132
# SMs; the forward+backward in float32 took 367.6 us on an H100 and 341.9 us on an H200, where the
# byte count alone predicted 209 and 158 us (and 0.89x on the H200). Calibrated on the
# float32 forward, the fastest of them, so the estimate stays on our side: the target's
# `calibration.gather_ops_per_sm_us` (targets.py).
# A kernel drawing dropout's random bits (threefry, ~120 integer ops an element, jaxstitch/frontend/prng.py)
# is bound by the integer ops its SMs issue (half the float rate on sm_80/sm_90), on both sides, and
# XLA's loop fusion issues fewer of them per microsecond than our row kernel. Measured on an H100
# (bias + GELU + dropout, [16384, 4096], 120 full-size integer ops an element): XLA
# 441.8 us (float32) and 425.9 us (bfloat16), ours forced 359.6 and 358.8 us; per SM and us,
# elements times integer ops. Ours from the slower of its two, XLA's from the faster of its two:
# the target's `calibration.our_int_ops_per_sm_us` and `xla_int_ops_per_sm_us`.
# XLA runs a region whose row reductions are read back over the row (a layernorm, a softmax) as one
# Triton kernel (kind=kCustom in its HLO) that holds the row in registers, and its erfc is slow there:
# it adds its time to the loads' rather than hiding under them. Measured on an H100
# (scripts/transcendental_probe.py, [32768, 2048]): an exact GELU (one erfc an element) before a
# layernorm took 663 us (float32) and 487 us (bfloat16) where the layernorm alone takes 181 and 94
# us: 0.78-0.95 ns more an element per SM; ours 193 and 106 us. tanh and exp cost XLA 0.02-0.1 ns an
# element per SM in the same kernels (fig7_chain, a tanh GELU, a soft-capped softmax), which the
# 85% of XLA_ONE_PASS_EFFICIENCY about covers; they are not counted. ns an element per SM, the lower
# of the two measurements: the target's `calibration.xla_triton_slow_ns`.
# XLA's GPU reduction emitter reduces a row in one kernel only up to 1024 threads x 16 elements (its
# race-free bound, reduction_utils.cc); a longer row reduction is rewritten into two (a partial sum
# per block of the row, then their sum), and is no hero that its readers fuse with. Each reduction
# level then costs two kernels and a pass over the row: a layer norm forward over 64 rows of 262144
# float32 ran as 7 XLA kernels at 44% of the roofline (H200, jax 0.11.2).
XLA_RACE_FREE_ROW = 1024 * 16


@dataclasses.dataclass(frozen=True)
class Estimate:
    bytes: int
    us: float
    xla_kernels: int
    xla_bytes: int
    xla_us: float

    @property
    def speedup(self) -> float:
        return self.xla_us / self.us if self.us else 1.0


def _nbytes(p, layout: Layout, min_itemsize: int = 1) -> int:
    n, c = layout.n_rows, layout.n_cols
    elems = {FULL: n * c, ROW: n, COL: c}.get(p.declared, 1)
    return elems * max(p.value.itemsize, min_itemsize)


def reduction_levels(layout: Layout) -> int:
    """How many row reductions run one after another (each a pass over the row)."""
    return max((p.level for p in layout.values if p.level != EPILOGUE), default=0)


def chunk_passes(layout: Layout, ops, outputs, online=()) -> int:
    """Passes over the row's elements: the levels whose values a row reduction folds (an online
    sum's with its max's) or a full-size output stores, and the first. The last level may need none
    (its values are one per row): a log-softmax's statistics with their shifts taken out
    (plan/shifts.py) are one pass."""
    online_sums = {i for o in online for i in o.sum_ids}
    levels = {0}
    for op in ops:
        folds = opdefs.is_row_reduction(op) or (opdefs.is_grid_reduction(op) and layout.of(op.inputs[0]).declared == FULL)
        if folds and op.outputs[0].id not in online_sums and isinstance(op.inputs[0], ir.Value):
            levels.add(layout.of(op.inputs[0]).level)
    levels |= {layout.of(v).level for v in outputs if layout.of(v).declared in (FULL, COL)}
    return len(levels - {EPILOGUE})


def xla_slow_ns(ops, layout: Layout, target: Target) -> float:
    """ns an element per SM that XLA's one Triton kernel of the region spends on its slow full-size
    ops (the target's `calibration.xla_triton_slow_ns`), were XLA to run it as one."""
    slow = dict(target.calibration.xla_triton_slow_ns)
    return sum(slow.get(op.prim, 0.0) for op in ops if op.outputs and layout.of(op.outputs[0]).storage == FULL)


def _xla_side(layout: Layout, outputs, target: Target, bw: float, must_move: int, full_in: int, row_levels: int,
              n_grid_reductions: int, n_scans: int, views_after_reduction: bool, xla_row_levels: int | None,
              integer_ops: int, xla_unfused: int, xla_slow: float, xla_copied: int) -> tuple[int, int, float]:
    """XLA's side of `estimate` (its parameters mean the same there): (kernels, bytes, us) of the way XLA
    fuses the region, kept apart from our kernel's side. `bw`: bytes per microsecond."""
    rates = target.calibration
    elems = layout.n_rows * layout.n_cols
    n_full_out = sum(1 for v in outputs if layout.of(v).declared == FULL)
    if xla_row_levels is not None:
        row_levels = max(row_levels, xla_row_levels)
    f32_full = layout.n_rows * layout.n_cols * 4
    triton_us = 0.0
    if row_levels == 0 and n_grid_reductions == 0:
        xla_kernels, xla_bytes, eff = 1, must_move, OUR_EFFICIENCY
    elif layout.n_cols > XLA_RACE_FREE_ROW:
        xla_kernels = 2 * row_levels + 1 + n_grid_reductions
        xla_bytes = must_move + row_levels * full_in + n_grid_reductions * f32_full
        eff = XLA_EFFICIENCY
    elif n_grid_reductions == 0 and row_levels <= 2 and n_full_out <= 1 and views_after_reduction:
        xla_kernels, xla_bytes, eff = 2, must_move + full_in, XLA_EFFICIENCY
    elif n_grid_reductions == 0 and row_levels <= 2 and n_full_out <= 1 and xla_unfused:
        xla_kernels, xla_bytes, eff = 1 + xla_unfused, must_move + xla_unfused * full_in, XLA_SPLIT_EFFICIENCY
    elif n_grid_reductions == 0 and row_levels <= 2 and n_full_out <= 1:
        xla_kernels, xla_bytes, eff = 1, must_move, XLA_ONE_PASS_EFFICIENCY
        if row_levels and n_full_out:  # (XLA's Triton kernel: its slow ops' time adds to the loads')
            triton_us = xla_slow * elems / target.sm_count / 1e3
    else:
        splits = max(0, row_levels - 1)
        xla_kernels = 1 + splits + n_grid_reductions
        xla_bytes = must_move + splits * (full_in + 2 * f32_full) + n_grid_reductions * f32_full
        if views_after_reduction:  # (the data-moving ops' kernel, as in the two-kernel case above)
            xla_kernels, xla_bytes = xla_kernels + 1, xla_bytes + full_in
        eff = XLA_EFFICIENCY
    if n_scans:
        xla_kernels += SCAN_XLA_KERNELS * n_scans
        xla_bytes += SCAN_XLA_PASSES * n_scans * f32_full
    if xla_copied:
        xla_kernels, xla_bytes = xla_kernels + 1, xla_bytes + 2 * xla_copied
    xla = max(xla_bytes / (bw * eff), integer_ops * elems / (rates.xla_int_ops_per_sm_us * target.sm_count))
    xla += triton_us
    xla += xla_kernels * target.launch_us
    return xla_kernels, xla_bytes, xla


def estimate(layout: Layout, inputs, outputs, n_grid_reductions: int, workspace_bytes: int,
             target: Target, rereads: bool = False, busy_sms: int | None = None,
             split_rounds: int = 0, gathered_bytes: int = 0, n_scans: int = 0,
             views_after_reduction: bool = False, gather_compute_ops: int = 0,
             xla_row_levels: int | None = None, passes: int | None = None,
             integer_ops: int = 0, xla_unfused: int = 0, xla_slow: float = 0.0,
             xla_copied: int = 0, skipped_bytes: int = 0) -> Estimate:
    """`rereads`: phases after the first read their row inputs again from global memory (L2);
    `busy_sms`: the SMs our grid occupies (fewer than the target has when there are few rows);
    `split_rounds`: rounds of (row, slice) tasks when rows are split over blocks, each crossing a
    grid barrier per row reduction level; `gathered_bytes`: what gathers read of inputs not in
    `inputs` (plan/views.py); `n_scans`: scans along rows (XLA's extra kernels, SCAN_XLA_*);
    `views_after_reduction`: a data-moving op reads a row reduction's result (XLA: a second kernel
    re-reading the row inputs, see above);
    `passes`: our passes over the rows (chunk_passes; all but the first re-read the row inputs
    where they are not stashed); `xla_row_levels`: the row reductions' levels as XLA meets them,
    when our layout has fewer (a
    softmax's sum of exponentials taken in its max's pass, plan/online.py): a log-softmax picked
    and summed per row is three levels to XLA, 6 kernels at 32% of the roofline (H200, [4096,
    32000] float32), where one online pass and a second reduction made it look like one kernel;
    `gather_compute_ops`: set when the kernel reads full-size values through gathers, the region's
    ops that compute (per element of the row space; see the gathers' rate above); `integer_ops`: the
    full-size integer ops an element (the random bits' rates above), which bound both sides;
    `xla_unfused`: row reductions XLA runs apart from the ops reading their result back
    (diamonds.unfused_reductions), each a kernel re-reading the row inputs where XLA would otherwise
    run the region as one kernel; `xla_slow`: xla_slow_ns of the region's ops, added where XLA runs
    a row reduction read back over the row as one kernel; `xla_copied`: bytes of the concatenations
    merged_products.py wrote for products, which XLA copies in a kernel of their own after writing
    their operands (SwiGLU's gradients at GPT's shapes, H100: XLA's kernels around the
    merged products 324 us against 311 as written, ours 286); `skipped_bytes`: what our kernel
    need not read of its inputs (past a causal mask's prefix of each row: plan/prefixes.py), which
    XLA reads."""
    bw = target.bandwidth_gbs * 1e3  # bytes per microsecond
    io = [layout.of(v) for v in inputs] + [layout.of(v) for v in outputs]
    must_move = sum(_nbytes(p, layout) for p in io) + gathered_bytes
    efficiency = SPLIT_EFFICIENCY if split_rounds else OUR_EFFICIENCY
    ours = (must_move - skipped_bytes + 2 * workspace_bytes) / (bw * efficiency)
    full_in = sum(_nbytes(layout.of(v), layout) for v in inputs if layout.of(v).declared == FULL)
    row_levels = reduction_levels(layout)
    if rereads:
        ours += (row_levels if passes is None else passes - 1) * full_in / (bw * L2_SPEEDUP)
    if busy_sms is not None:  # only the moving of bytes slows down on fewer SMs, not the launch
        ours /= min(1.0, SM_OVERDRIVE * busy_sms / target.sm_count)
    if layout.n_cols <= NARROW_COLS:
        ours /= NARROW_EFFICIENCY
    rates = target.calibration
    elems = layout.n_rows * layout.n_cols
    issue = gather_compute_ops * elems / (rates.gather_ops_per_sm_us * target.sm_count)
    ours = max(ours, issue, integer_ops * elems / (rates.our_int_ops_per_sm_us * target.sm_count))
    grid_syncs = (1 if n_grid_reductions else 0) + row_levels * split_rounds
    ours += target.launch_us + grid_syncs * target.grid_sync_us
    xla_kernels, xla_bytes, xla = _xla_side(layout, outputs, target, bw, must_move, full_in, row_levels,
                                            n_grid_reductions, n_scans, views_after_reduction, xla_row_levels,
                                            integer_ops, xla_unfused, xla_slow, xla_copied)
    return Estimate(must_move - skipped_bytes, ours, xla_kernels, xla_bytes, xla)
