"""Adaptive thread mapping for row kernels, chosen from the row length and register budget.

Short rows pack several rows into one warp (TPR < 32 lanes per row: horizontal packing), medium rows
take a warp, long rows a whole block (reduced through shared memory: AStitch's regional scheme). Each
thread keeps E elements of its row per live array in registers; E is bounded so that the arrays fit.
Rows longer than a block can hold in registers are walked in CHUNKS of E elements per thread; each
phase after the first reads its inputs again from a stash: the block's shared memory when the row fits
there (the row leaves HBM once), else global memory (re-reads mostly served by L2).

Row inputs are *staged*: copied to shared memory with asynchronous copies (cp.async) one row group
ahead, so a block's next rows are in flight while it reduces the current ones (two stages), or at least
all of a chunked row at once (one stage). Without that, a thread's loads wait at the top of every row
and HBM idles while the row's reductions run.
"""
from __future__ import annotations

import dataclasses
import math

from ..core import ir
from ..core.config import Tuning
from ..core.targets import Target
from .layout import COL, FULL, Layout, ReasonKind, Unplannable

MAX_ELEMS_PER_THREAD = 32
CHUNKED_TPR = 512
# Elements a thread of a paired mapping holds at most (plan/pairs.py), unless JAXSTITCH_TUNE's
# `elems` says otherwise; a paired kernel that spills is planned with half as many (pipeline.py).
# RMS norm + rotary over [16384, 2048] bfloat16 on an H200, GPU time: the forward 39.3 us at 16
# (86% of the roofline) against 48.7 at 8; the fwd+bwd spills at 16 (157 registers once its cap is
# lifted, one block of 256 an SM: 157.8 us) and ran 113.7 us at 8 (80 registers).
PAIRED_MAX_ELEMS = 16
# Rows this short load directly, without async staging: a thread's share of a row group is a vector
# or two, and its copies cost more than they hide. H200, GPU time, bias + GELU backward over 16
# columns forced: float32 65.2 us staged, 56.4 unstaged (XLA 73.9); bfloat16 50.5 and 49.6. (At 1k
# columns staging wins: layernorm forward, bfloat16, 41.2 us staged against 46.7.)
UNSTAGED_COLS = 32
# Threads a row streamed once in chunks takes (nothing stashed; a JAXSTITCH_TUNE max_tpr overrides):
# four warps, so that more rows are in flight on an SM and each row's reduction spans fewer warps.
# H200, GPU time, a per-token log-probability over [4096, 32000] bfloat16 (one pass, online
# softmax): 512 threads a row 96.7 us, 256 78.4, 128 75.2.
ONE_PASS_TPR = 128
REGISTERS, SHARED, GLOBAL = "registers", "shared", "global"
STATIC_SMEM_RESERVE = 4 * 1024  # reduction scratch next to a shared stash
SMEM_PER_BLOCK_SYSTEM = 1024    # what the hardware reserves per resident block (sm_80+)
# One (row, slice) task per SM leaving fewer SMs busy than this share splits rows two to an SM
# instead (`split_count`), even where two do not stash whole. H100, log-softmax statistics over 256k
# float32, the family bench (calls in turns with jax.jit's): 34 rows (77% busy at 3 slices) 27.6 ->
# 26.9-27.8 us on 7 slices (a tie with jax.jit's 27.2: both bandwidth-bound, the input in L2), 47
# rows (71%) 33.2 -> 31.1 on 5, 67 rows (51%, a block per row) 59.0 -> 44.9 on 3. At 27 rows (82%
# busy) 9 slices two to an SM, a part of each re-read, ran 19.0-19.4 us against 4 slices' 18.4.
BUSY_SM_SHARE = 0.8


@dataclasses.dataclass(frozen=True)
class Mapping:
    """How a row kernel's threads cover its rows: threads a row (`tpr`), elements a thread and vector,
    chunks of a long row, rows a block, the grid, row splits over blocks, and the launch bounds
    (`min_blocks` a SM) and staging it is compiled with (`choose` decides; codegen renders it)."""

    n_rows: int
    n_cols: int
    vec: int              # elements per vector access
    tpr: int              # threads per row
    vpt: int              # vectors per thread per row
    rows_per_block: int
    block: int
    grid: int             # upper bound; a cooperative launch clamps it to the resident blocks
    cooperative: bool
    chunks: int = 1       # E-element chunks per thread per row
    stash: str = REGISTERS  # where inputs wait between phases: registers, shared or global memory
    smem_bytes: int = 0   # dynamic shared memory per block (the stash)
    stages: int = 0       # row-group buffers the stash is filled through with async copies (0: none)
    min_blocks: int = 1   # blocks per SM the compiler must leave registers for (`__launch_bounds__`)
    splits: int = 1       # blocks sharing one row (task splitting: few long rows), each a slice of it
    slice_cols: int = 0   # columns of each slice (the row length when splits == 1)
    stash_chunks: int = 0  # chunks a shared stash holds, the first ones; the rest are read from
    #                        global memory in every pass (0: all of them)
    max_grid: int = 0     # the grid for any number of rows (one wave); `grid` is this row count's
    pair: int = 0         # h > 0: a thread's vector slots 2i and 2i + 1 are h columns apart (plan/pairs.py)
    # Chunks read from global memory again in a later pass (a partial or global stash): each pass
    # walks them in the opposite order of the pass before, so that it starts with those read last,
    # which L2 still holds (in one order every pass, a row larger than L2 starts each pass with the
    # chunk evicted longest ago, and its re-reads miss L2 one after another).
    serpentine: bool = False
    # (slices, stashed chunks, chunks) of the one-round split passed over for more rounds with a
    # bigger stash share (_stash_in_rounds; the report says why), else ()
    one_round: tuple[int, ...] = ()

    @property
    def rounds(self) -> int:
        """Rounds of (row, slice) tasks the planned grid walks (1 unless rows are split)."""
        step = self.grid // self.splits * self.splits
        return -(-self.n_rows * self.splits // step) if self.splits > 1 and step else 1

    @property
    def grid_cap(self) -> int:
        """Blocks a launch may have whatever the row count: what per-block workspace is sized for,
        so that the kernel's source does not depend on the row count."""
        return max(self.max_grid, self.grid)

    @property
    def stashed_chunks(self) -> int:
        return self.stash_chunks or self.chunks

    @property
    def elems_per_thread(self) -> int:
        return self.vec * self.vpt

    @property
    def name(self) -> str:
        if self.tpr < 32:
            name = f"{32 // self.tpr} rows per warp"
        elif self.tpr == 32:
            name = "warp per row"
        elif self.tpr == self.block:
            name = "block per row"
        else:
            name = f"{self.tpr // 32} warps per row"
        if self.splits > 1:
            name += f", rows split over {self.splits} blocks"
        if self.chunks > 1:
            name += f", {self.chunks} chunks"
        if (self.chunks > 1 or self.splits > 1) and self.stash == REGISTERS:
            name += ", one pass"  # (nothing kept for a later pass)
        elif self.chunks > 1 or self.splits > 1:
            name += f", {self.stash} stash"
            if self.stashed_chunks < self.chunks:
                name += f" of {self.stashed_chunks}"
        if self.serpentine:
            name += ", passes walk the chunks back and forth"
        if self.stages:
            name += f", {self.stages}-stage async loads"
        if self.pair:
            name += f", halves of {self.pair} paired"
        return name


def _pow2_at_most(x: int) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def _async_copyable(vec: int, itemsizes) -> bool:
    """cp.async moves 4, 8 or 16 bytes: each stashed vector must be one of those, or 16-byte pieces."""
    return bool(itemsizes) and all(vec * i in (4, 8) or (vec * i) % 16 == 0 for i in itemsizes)


def stash_slot_bytes(block: int, chunks: int, vpt: int, vec: int, itemsize: int) -> int:
    """Bytes one row input takes in a stash buffer: every thread's vectors of every chunk."""
    return block * chunks * vpt * vec * itemsize


def _row_shape(length: int, vec: int, budget: int, max_tpr: int) -> tuple[int, int, int]:
    """Threads per row, vectors per thread and chunks for rows of `length` elements."""
    tpr = min(max_tpr, _pow2_at_least(math.ceil(length / budget)))
    tpr = max(1, min(tpr, _pow2_at_least(math.ceil(length / vec))))
    vpt = math.ceil(length / (tpr * vec))
    chunks = 1
    if vpt * vec > budget:  # even at the most threads per row, the row does not fit in registers
        # Half-block rows: a 1024-thread row spends its time at barriers, one block per SM (measured on
        # an H200, cross-entropy over 32k classes: 512 threads 1.5x faster than 1024, 256 no better).
        tpr = min(tpr, CHUNKED_TPR)
        vpt = math.ceil(length / (tpr * vec))
        chunks = math.ceil(vpt * vec / budget)
        vpt = math.ceil(vpt / chunks)
    return tpr, vpt, chunks


def _resident_rows(shape: tuple[int, int, int], vec: int, stash_itemsizes, target: Target, tuning: Tuning) -> int:
    """Chunked rows (a block each) an SM holds at once with a shared stash: by shared memory, threads
    and the registers the launch bounds leave (see `choose`'s min_blocks); 0 when the stash would not
    fit. A row's first pass only reads its stash, so HBM stays busy through another row's last pass:
    cross-entropy bfloat16 over 32k classes ran 4% faster as three 256-thread rows per SM than as two
    512-thread ones (H200)."""
    tpr, vpt, chunks = shape
    stage = sum(stash_slot_bytes(tpr, chunks, vpt, vec, i) for i in stash_itemsizes)
    if not stage or stage > target.smem_optin - STATIC_SMEM_RESERVE:
        return 0
    by_regs = 2 if tpr >= 512 else max(1, tuning.min_threads // tpr)
    return min(_per_sm_by_smem(stage, target), target.max_threads_per_sm // tpr, by_regs)


def _per_sm_by_smem(smem: int, target: Target) -> int:
    return target.smem_per_sm // (smem + STATIC_SMEM_RESERVE + SMEM_PER_BLOCK_SYSTEM)


def _partial_stash(chunk_bytes: int, chunks: int, block: int, target: Target) -> int:
    """Chunks to stash when a whole row's stash leaves an SM one row: the most that let it hold two
    (at least half the row), the rest read from global memory in each pass (L2 serves the re-read,
    a row-pass later). With one row, HBM idles for this SM while the row's first pass reads only
    its stash; with two, the other row's last pass keeps it busy. 0: stash the whole row."""
    if _per_sm_by_smem(chunk_bytes * chunks, target) >= 2 or target.max_threads_per_sm < 2 * block:
        return 0
    return _most_chunks(chunk_bytes, chunks - 1, (chunks + 1) // 2, 2, target)


def _split_stash(chunk_bytes: int, chunks: int, want: int, target: Target) -> int:
    """Chunks of a split row's slice to stash so that `want` blocks fit on an SM, which puts every
    (row, slice) task in one round of resident blocks: a second round would cross every grid barrier
    again after a full refill. The chunks left out are re-read through L2 in each pass. 0: not even
    one chunk fits (a global stash)."""
    return _most_chunks(chunk_bytes, chunks, 1, want, target)


def _most_chunks(chunk_bytes: int, most: int, least: int, per_sm: int, target: Target) -> int:
    """The most chunks, from `most` down to `least`, whose stash lets `per_sm` blocks share an SM;
    0 when none does."""
    for held in range(most, least - 1, -1):
        if _per_sm_by_smem(chunk_bytes * held, target) >= per_sm:
            return held
    return 0


def split_count(n: int, c: int, vec: int, target: Target) -> int:
    """Blocks per row for few long rows: at most one (row, slice) task per SM (8 rows: 16), unless
    that leaves more than a fifth of the SMs idle, where two to an SM take more slices than twice as
    many (34 rows: 7 slices, not 3; 67 rows: 3, not a block per row; see BUSY_SM_SHARE). A few
    tasks more than SMs leave those SMs two while the rest wait at the barriers (H100, log-softmax
    statistics over 8 rows of 256k float32: 17 slices 15.3 us, 16 slices 12.1). Two per SM
    measured slower where one per SM keeps the SMs busy (H200, softmax fwd+bwd over 32 rows of
    256k, 8 slices against 4: bfloat16 38.6 against 33.6 us, float32 66 against 60, by the wall
    clock, which for calls this short is mostly the host's dispatch: by GPU time 8
    slices are faster in bfloat16 and `_two_per_sm_same_share` takes them; H100 statistics, 9
    rows: 29 slices 18.0 us against 14 slices 11.6). Two to an SM need the
    kernel's registers to allow 1024 threads an SM (59 here), else its grid is capped and blocks
    loop over tasks. `_stashing_splits` takes more slices where they stash whole. Slices hold at
    least two vectors per thread of a 512-thread block; never more slices than SMs (a round holds
    whole rows: see codegen's js_step)."""
    one = min(most_splits(c, vec, target), target.sm_count // max(1, n))
    two = two_per_sm_splits(n, c, vec, target)
    if two and n * one < BUSY_SM_SHARE * target.sm_count:
        return two
    return one if one >= 2 else 1


def two_per_sm_splits(n: int, c: int, vec: int, target: Target) -> int:
    """Slices a row for two (row, slice) tasks to an SM, where they are more than twice one to an
    SM's, so that the busiest SM reads less of a row; 0 where they are not."""
    most = most_splits(c, vec, target)
    one = min(most, target.sm_count // max(1, n))
    two = min(most, 2 * target.sm_count // max(1, n))
    return two if two > 2 * one and n * two > target.sm_count else 0


def tasks_per_sm(rows: int, splits: int, target: Target) -> int:
    """(row, slice) tasks on the busiest SM when `rows` of `splits` slices run in one round."""
    return -(-rows * splits // target.sm_count)


def busiest_sm_share(rows: int, splits: int, target: Target) -> float:
    """The share of a row the busiest SM reads: what a split kernel's time follows (about 5 us plus
    the bytes each SM reads, H100)."""
    return tasks_per_sm(rows, splits, target) / splits


def most_splits(c: int, vec: int, target: Target) -> int:
    """Slices of at least two vectors per thread of a 512-thread block, no more than SMs (a row's
    blocks all resident)."""
    return max(1, min(c // (2 * CHUNKED_TPR * vec), target.sm_count))


def _slice_stage(c: int, k: int, vec: int, budget: int, itemsizes, max_tpr: int) -> tuple[int, int, int]:
    """(threads, chunks, stash bytes of a whole slice) of a row of `c` split in `k` slices."""
    tpr, vpt, chunks = _row_shape(math.ceil(c / k / vec) * vec, vec, budget, max_tpr)
    return tpr, chunks, sum(stash_slot_bytes(tpr, chunks, vpt, vec, i) for i in itemsizes)


def _stashing_splits(n: int, c: int, vec: int, budget: int, first: int, itemsizes, target: Target,
                     max_tpr: int) -> int:
    """The fewest blocks per row, from `first` up, whose slices all fit in the shared memory of one
    round of resident blocks: then HBM serves each row once, where `first` would re-read the part
    of every slice left out of the stash in each pass after the first (H100, log-softmax statistics
    over 24 rows of 256k float32: 11 slices wholly stashed 15.6-18.0 us in three runs, 6 slices
    half stashed 22.0 us in one; 5 and 10 slices, partly stashed, 18.5 and 18.8: a small gain at
    most). `first` when no count does (the rows outgrow the GPU's shared memory)."""
    for k in range(first, most_splits(c, vec, target) + 1):
        tpr, _, stage = _slice_stage(c, k, vec, budget, itemsizes, max_tpr)
        want = tasks_per_sm(n, k, target)  # blocks per SM for one round of (row, slice) tasks
        if want * tpr > target.max_threads_per_sm:
            break
        if _per_sm_by_smem(stage, target) >= want:
            return k
    return first


def _two_per_sm_whole(n: int, c: int, vec: int, budget: int, current: int, itemsizes, target: Target,
                      max_tpr: int) -> int:
    """Twice the slices of one task per SM, where two to an SM then stash whole and the busiest SM
    reads less of a row than at `current` (H100, log-softmax statistics over 256k float32, timed in
    turns: 17 rows 15 slices 14.6-15.0 us against 7 slices 15.6; 19 rows 13 against 6 slices 15.9
    against 17.2; 27 rows, 9 slices not whole, 19.0-19.4 against 4 slices 18.4). Only slices walked
    in chunks: 9 rows on 29 register-held slices of 1024 threads ran 18.2 us against 14 slices'
    11.5. `current` otherwise."""
    k = two_per_sm_splits(n, c, vec, target)
    if not k or busiest_sm_share(n, k, target) >= busiest_sm_share(n, current, target):
        return current
    tpr, chunks, stage = _slice_stage(c, k, vec, budget, itemsizes, max_tpr)
    if chunks == 1 or 2 * tpr > target.max_threads_per_sm:
        return current
    return k if _per_sm_by_smem(stage, target) >= 2 else current


def _stashed_share(n: int, c: int, vec: int, budget: int, k: int, itemsizes, target: Target,
                   max_tpr: int) -> tuple[float, int]:
    """(the share of each slice its stash holds, blocks an SM holds for one round of tasks) with
    rows split in `k` slices, as `choose` will size that stash."""
    tpr, chunks, stage = _slice_stage(c, k, vec, budget, itemsizes, max_tpr)
    want = min(tasks_per_sm(n, k, target), target.max_threads_per_sm // tpr)
    return _split_stash(stage // chunks, chunks, want, target) / chunks, want


def _stash_in_rounds(n: int, c: int, vec: int, budget: int, current: int, itemsizes, target: Target,
                     max_tpr: int) -> tuple[int, int, tuple[int, ...]]:
    """(slices, blocks an SM their stash is sized for (0: one round's), the one-round split passed
    over as Mapping.one_round (or ())): where one round of (row,
    slice) tasks stashes less than half of each slice, twice the slices, walked in twice the rounds
    by the same blocks, as long as the share stashed doubles too. A block then copies its next
    task's stash while it writes this task's outputs, and fewer bytes are read again through L2.
    H100, GPU time (CUPTI), softmax fwd+bwd over 32 rows of 256k float32: 4 slices in one round,
    3/8 stashed, 57.7-59.2 us; 8 slices in two rounds, 3/4 stashed, 53.0-53.7; whole slices in
    more rounds lost that again (16 slices, one block an SM, 60.0; 32 slices, three, 55.0). In
    bfloat16, where one round already stashes 3/4, two rounds of whole slices ran 30.8 against 26.2."""
    share, want = _stashed_share(n, c, vec, budget, current, itemsizes, target, max_tpr)
    k = current
    while 0 < share < 0.5 and 2 * k <= most_splits(c, vec, target):
        tpr, chunks, stage = _slice_stage(c, 2 * k, vec, budget, itemsizes, max_tpr)
        more = _split_stash(stage // chunks, chunks, want, target) / chunks
        if want * tpr > target.max_threads_per_sm or more < 2 * share:
            break
        k, share = 2 * k, more
    if k == current:
        return k, 0, ()
    _, chunks, stage = _slice_stage(c, current, vec, budget, itemsizes, max_tpr)
    return k, want, (current, _split_stash(stage // chunks, chunks, want, target), chunks)


def _two_per_sm_same_share(n: int, c: int, vec: int, budget: int, current: int, itemsizes,
                           target: Target, max_tpr: int) -> int:
    """Half-precision rows: twice the slices, two blocks to an SM in one round, where one to an SM
    leaves part of each slice out of the stash and two keep at least the same share. The re-reads
    through L2 then have twice the warps to hide their latency (the blocks of 512 threads drop from
    ~105 registers to 64; Nsight Compute on one to an SM: 16 warps an SM stalled on loads, the
    inputs read from HBM once). GPU time (CUPTI) on an H200, softmax fwd+bwd, bfloat16: 32 rows of
    256k, 8 slices against 4, 23.3 against 25.6 us (3/4 of a slice stashed in both); 64 rows, 4
    slices against 2, 55.3 against 71.5 (3/8 in both). Not taken, as measured: where one to an SM
    stashes whole (bfloat16, 16 rows, 16 slices against 8: 15.6 against 12.4 us), where the share
    falls (float32, 32 rows, 8 slices 1/4 against 4 slices 3/8: 47.7 against 47.5), and float32
    rows (log-softmax statistics over 27 rows of 256k on an H100: 9 slices 19.0-19.4 us against
    4 slices 18.4; their elements carry half the work per byte). `current` otherwise."""
    if not itemsizes or max(itemsizes) > 2:
        return current
    share, want = _stashed_share(n, c, vec, budget, current, itemsizes, target, max_tpr)
    k = 2 * current
    if want != 1 or not 0 < share < 1 or k > most_splits(c, vec, target) or tasks_per_sm(n, k, target) != 2:
        return current
    share2, want2 = _stashed_share(n, c, vec, budget, k, itemsizes, target, max_tpr)
    return k if want2 == 2 and share2 >= share else current


def _thread_shape(layout: Layout, region_io: list[ir.Value], n_live_arrays: int, target: Target, tuning: Tuning,
                  one_pass: bool, pair: int) -> tuple[int, int, int, int, int]:
    """(vector, element budget per thread and array, threads per row, vectors per thread, chunks) of an unsplit
    row: `choose`'s first step, apart so that `choose` stays readable."""
    c = layout.n_cols
    # Every array moved per element, by its declared kind too: a broadcast row stored as an output
    # is written at full size though it is held as one register.
    # (A column reduction's result is not one of them: the epilogue writes it once, not per vector.)
    wide = [p.value for p in layout.values
            if (p.storage in (FULL, COL) or p.declared in (FULL, COL)) and p.value in region_io
            and not (p.declared == COL and p.level < 0)]
    vec = min([16 // v.itemsize for v in wide] + [8])
    while vec > 1 and c % vec:
        vec //= 2
    # About 64 registers of held elements per thread leaves room for temporaries and 2-3 blocks per SM.
    budget = max(vec, 4, min(MAX_ELEMS_PER_THREAD, _pow2_at_least(64 // max(1, n_live_arrays) + 1) // 2))
    if tuning.elems:
        budget = max(vec, tuning.elems)
    tpr, vpt, chunks = _row_shape(c, vec, budget, tuning.max_tpr)
    if tpr < 32 and chunks == 1 and not tuning.elems and not pair:
        # Rows several to a warp (horizontal packing) hold elements in all the registers the launch
        # bounds leave a thread (65536 / MIN_THREADS_PER_SM = 85), not only 64: every thread of a row
        # pays each row reduction's log2(TPR) shuffle rounds and the row's scalar work for its E
        # elements, so fewer threads a row with more elements each issue less per element. A kernel
        # that spills is planned again with half as many (candidates.narrower). H100, CuPy,
        # moe_router's row kernel over [1M, 64] (an argmax, a softmax sum, two column means; 5
        # arrays held): bfloat16 4 threads a row of 16 elements 85.5 us against 8 of 8 107.2 (72
        # against 56 registers).
        packed = _pow2_at_most(target.regs_per_sm // tuning.min_threads // max(1, n_live_arrays))
        tpr, vpt, chunks = _row_shape(c, vec, max(budget, min(MAX_ELEMS_PER_THREAD, packed)), tuning.max_tpr)
    if one_pass and chunks > 1 and tpr > ONE_PASS_TPR and tuning.max_tpr == Tuning.max_tpr:
        tpr, vpt, chunks = _row_shape(c, vec, budget, ONE_PASS_TPR)
    if pair:
        vec, tpr, vpt = _paired_shape(c, vec, tpr, vpt, chunks, pair, tuning.elems or PAIRED_MAX_ELEMS)
    return vec, budget, tpr, vpt, chunks


def _row_splits(n: int, c: int, vec: int, budget: int, target: Target, tuning: Tuning, stash_itemsizes,
                one_pass: bool) -> tuple[int, int, tuple[int, ...]]:
    """(blocks per row, blocks an SM the stash is sized for (0: one round's), Mapping.one_round) for few long
    rows that may be split: `choose`'s choice of the split count, apart so that `choose` stays readable."""
    stash_per_sm, one_round = 0, ()
    # (a forced K is kept to the SMs: a round of tasks must hold a whole row)
    if tuning.splits:
        splits = min(tuning.splits, target.sm_count)
    else:
        splits = split_count(n, c, vec, target)
        if splits > 1 and not one_pass and _async_copyable(vec, stash_itemsizes):
            splits = _stashing_splits(n, c, vec, budget, splits, stash_itemsizes, target, tuning.max_tpr)
            splits = _two_per_sm_whole(n, c, vec, budget, splits, stash_itemsizes, target, tuning.max_tpr)
            splits = _two_per_sm_same_share(n, c, vec, budget, splits, stash_itemsizes, target, tuning.max_tpr)
            splits, stash_per_sm, one_round = _stash_in_rounds(n, c, vec, budget, splits, stash_itemsizes,
                                                               target, tuning.max_tpr)
    return splits, stash_per_sm, one_round


def _choose_stash(n: int, c: int, vec: int, vpt: int, chunks: int, block: int, splits: int, stash_per_sm: int,
                  stash_itemsizes, target: Target, tuning: Tuning) -> tuple[str, int, int, int]:
    """(stash, async stages, stashed chunks (0: all), shared memory bytes) for a row group's inputs: `choose`'s
    choice of where the rows wait between passes, apart so that `choose` stays readable."""
    stage = sum(stash_slot_bytes(block, chunks, vpt, vec, i) for i in stash_itemsizes)  # a row group's
    room = target.smem_optin - STATIC_SMEM_RESERVE
    copyable = _async_copyable(vec, stash_itemsizes)
    stash, stages = REGISTERS, 0
    if (chunks > 1 or splits > 1) and stash_itemsizes:  # (a split row's slice is walked as a chunked row is)
        stash = SHARED if stage <= room else GLOBAL
        # One stage: a second row buffer would halve the blocks a long row's SM holds.
        stages = 1 if stash == SHARED and copyable else 0
    elif tuning.stages is not None:
        stages = tuning.stages if copyable and stage * tuning.stages <= room else 0
    elif copyable and 2 * stage <= target.smem_per_sm // 4 - STATIC_SMEM_RESERVE and c > UNSTAGED_COLS:
        # A next-row buffer that still leaves room for 4 blocks per SM. More groups in flight
        # (JAXSTITCH_TUNE stages=3 or 4: a ring of buffers) did not help: H100, inputs from HBM
        # (ncu), 4096 x 768 norm backwards and a 49152 x 512 softmax fwd+bwd took 2% less to 21% more, a
        # GPT bfloat16 step 1.4% (busy 11.69 -> 11.85 ms), BERT bfloat16 0.9%.
        stages = 2
    stash_chunks = 0
    if splits > 1 and copyable:
        rows = min(n, tuning.split_rows or n)
        want = stash_per_sm or min(tasks_per_sm(rows, splits, target), target.max_threads_per_sm // block)
        held = _split_stash(stage // chunks, chunks, want, target)
        if held:
            stash, stages = SHARED, 1
            stash_chunks = 0 if held == chunks else held
            stage = stage // chunks * held
    elif stash == SHARED and stages == 1 and chunks > 1:
        stash_chunks = _partial_stash(stage // chunks, chunks, block, target)
        stage = stage // chunks * (stash_chunks or chunks)
    smem = stage * max(stages, 1) if stash == SHARED or stages else 0
    return stash, stages, stash_chunks, smem


def choose(layout: Layout, region_io: list[ir.Value], n_live_arrays: int, grid_reduced: bool,
           target: Target, tuning: Tuning = Tuning(), stash_itemsizes: tuple[int, ...] = (),
           splittable: bool = True, one_pass: bool = False, pair: int = 0) -> Mapping:
    """`pair`: a thread holds each column with the one `pair` after it (plan/pairs.py), else
    Unplannable. `stash_itemsizes`: the item sizes of the row inputs (those a stash would keep); `splittable`:
    whether a row's reductions may be combined across blocks (not ops.PICKING, not scans);
    `one_pass`: the kernel reads each row once (cost.chunk_passes), so a row walked in chunks or
    split keeps nothing in a stash, and its slices need not fit one."""
    n, c = layout.n_rows, layout.n_cols
    vec, budget, tpr, vpt, chunks = _thread_shape(layout, region_io, n_live_arrays, target, tuning, one_pass, pair)
    col_partials = grid_reduced and any(p.declared == COL and p.level < 0 for p in layout.values)
    splits, slice_cols, stash_per_sm, one_round = 1, c, 0, ()
    # Few long rows: each split over several blocks (JAXSTITCH_TUNE splits=1 never splits).
    if chunks > 1 and splittable and not col_partials and tuning.splits != 1 and not pair:
        splits, stash_per_sm, one_round = _row_splits(n, c, vec, budget, target, tuning, stash_itemsizes, one_pass)
        if splits > 1:
            slice_cols = math.ceil(c / splits / vec) * vec  # slices start on a vector
            splits = math.ceil(c / slice_cols)
            tpr, vpt, chunks = _row_shape(slice_cols, vec, budget, tuning.max_tpr)
    if one_pass and (chunks > 1 or splits > 1):
        stash_itemsizes = ()
    if chunks > 1 and splits == 1 and tpr == CHUNKED_TPR:
        half = _row_shape(c, vec, budget, CHUNKED_TPR // 2)
        if _resident_rows(half, vec, stash_itemsizes, target, tuning) > _resident_rows(
                (tpr, vpt, chunks), vec, stash_itemsizes, target, tuning):
            tpr, vpt, chunks = half
    rows_per_block = 1 if splits > 1 else max(1, 256 // tpr)  # a split row's slice is a block's task
    block = tpr * rows_per_block
    if chunks > 1 and col_partials:
        raise Unplannable(ReasonKind.OP,
                          f"column reductions over rows of {c} elements (longer than a block "
                          "holds in registers) are not implemented")
    stash, stages, stash_chunks, smem = _choose_stash(n, c, vec, vpt, chunks, block, splits, stash_per_sm,
                                                      stash_itemsizes, target, tuning)
    groups = math.ceil(n * splits / rows_per_block)
    per_sm = max(1, target.max_threads_per_sm // block)
    if smem:
        per_sm = max(1, min(per_sm, _per_sm_by_smem(smem, target)))
    if col_partials:  # a row of partials per block goes through global memory: keep the grid small
        per_sm = max(1, min(per_sm, 1024 // block))
    grid = max(1, min(groups, target.sm_count * per_sm))
    # Registers for enough resident threads; big blocks two per SM, so one computes while the other
    # waits at a barrier; never more blocks than shared memory holds.
    min_blocks = min(per_sm, 2 if block >= 512 else max(1, tuning.min_threads // block))
    return Mapping(n, c, vec, tpr, vpt, rows_per_block, block, grid, grid_reduced or splits > 1, chunks,
                   stash, smem, stages, min_blocks, splits, slice_cols, stash_chunks,
                   max_grid=target.sm_count * per_sm, pair=pair, one_round=one_round)


def _paired_shape(c: int, vec: int, tpr: int, vpt: int, chunks: int, h: int,
                  most: int = PAIRED_MAX_ELEMS) -> tuple[int, int, int]:
    """(vector, threads per row, vectors per thread) whose vector slots 2i and 2i + 1 can be a column
    and the one h after it (plan/pairs.py): an even number of vectors, the h/vec lanes of a half
    within one row's threads, the row held whole (no chunks, no padding). Until the vectors are even,
    halves the threads per row, or where a thread would then hold more than `most`, the vector."""
    if chunks > 1 or c % (2 * h):
        raise Unplannable(ReasonKind.LAYOUT,
                          f"halves of {h} columns cannot be paired in rows of {c} held in {chunks} chunks")
    while vpt % 2:
        if 2 * vpt * vec > most and vec > 1:
            vec, vpt = vec // 2, vpt * 2
        elif h % vec == 0 and tpr % (2 * h // vec) == 0:
            tpr, vpt = tpr // 2, vpt * 2
        else:
            break
    if vpt % 2 or h % vec or tpr % (h // vec) or tpr * vpt * vec != c:
        raise Unplannable(ReasonKind.LAYOUT,
                          f"no pairing of halves of {h} columns with {tpr} threads of {vpt} vectors "
                          f"of {vec} per row of {c}")
    return vec, tpr, vpt


def one_wave(mp: Mapping, registers: int, target) -> Mapping:
    """A grid-stride row kernel's grid as the blocks resident at once by its compiled registers,
    block size and shared memory (Tuning.one_wave): every block then walks about as many row
    groups as the others, with no late wave of blocks starting while the first ones finish. A
    cooperative kernel already runs one wave (the launcher clamps it)."""
    if mp.cooperative or not registers:
        return mp
    per_sm = min(target.max_threads_per_sm // mp.block, target.blocks_by_registers(mp.block, registers),
                 _per_sm_by_smem(mp.smem_bytes, target))
    wave = max(1, per_sm) * target.sm_count
    return dataclasses.replace(mp, grid=min(mp.grid, wave), max_grid=min(mp.max_grid, wave))
