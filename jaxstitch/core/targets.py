"""GPU targets: the few numbers planning needs, so a CPU-only machine can plan for any of them."""
from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    """A GPU's rates where a kernel is bound by the instructions its SMs issue or by a loop's steps,
    not by HBM: what planning cannot derive from the datasheet. Each is measured on a GPU of the
    kind (the measurements: plan/cost.py and plan/scan.py), or derived and then `source` says how."""

    gather_ops_per_sm_us: float   # ops times elements a microsecond an SM, gathering kernels (cost.py)
    our_int_ops_per_sm_us: float  # integer ops times elements, our kernels drawing random bits
    xla_int_ops_per_sm_us: float  # the same, XLA's loop fusions
    xla_triton_slow_ns: tuple[tuple[str, float], ...]  # ns an element an SM each op adds in XLA's Triton rows
    scan_step_us: float           # a persistent scan's step: its loop, two barriers, the loads' latency
    scan_op_us: float             # one op's pass in shared memory, per element a thread
    scan_fma_per_us: float        # one SM's multiply-adds a microsecond from shared memory
    xla_iteration_us: float       # one iteration of XLA's while loop around a scan's kernels
    source: str

    def scaled(self, clock: float, source: str) -> "Calibration":
        """These rates on an SM of the same design at `clock` times the clock (the while loop's
        iteration, paced by its launches and the host, kept)."""
        return dataclasses.replace(
            self, gather_ops_per_sm_us=self.gather_ops_per_sm_us * clock,
            our_int_ops_per_sm_us=self.our_int_ops_per_sm_us * clock,
            xla_int_ops_per_sm_us=self.xla_int_ops_per_sm_us * clock,
            xla_triton_slow_ns=tuple((op, ns / clock) for op, ns in self.xla_triton_slow_ns),
            scan_step_us=self.scan_step_us / clock, scan_op_us=self.scan_op_us / clock,
            scan_fma_per_us=self.scan_fma_per_us * clock, source=source)


# Measured on an H100 (SXM, 132 SMs; each number's measurement is beside its use in plan/cost.py and
# plan/scan.py): the gathering kernels' float32 forward, the dropout kernels' slower dtype on each
# side, the exact GELU before a layernorm, and DIEN's GRU forward and backward.
H100_RATES = Calibration(
    gather_ops_per_sm_us=7.4e6 / 132,
    our_int_ops_per_sm_us=120 * 16384 * 4096 / 359.6 / 132,
    xla_int_ops_per_sm_us=120 * 16384 * 4096 / 425.9 / 132,
    xla_triton_slow_ns=(("erfc", 0.78),),
    scan_step_us=0.58, scan_op_us=0.044, scan_fma_per_us=5.0e4, xla_iteration_us=5.0,
    source="measured on an H100")

# An H200 is the H100's GH100 chip at the same clocks with faster memory. Measured on one (jax 0.11.2,
# GPU time, 2026-11-29): bias + GELU + dropout over [16384, 4096], ours 350.0 us (float32) and 296.0
# (bfloat16), XLA's 470.4 and 450.4; an exact GELU before a layernorm over [32768, 2048], XLA 615.0
# and 477.0 us where the layernorm alone takes 142.1 and 78.1 (0.93 and 0.78 ns an element an SM;
# ours 170.5 and 104.2). The gathering kernel and the scans keep the H100's rates: the same SMs, and
# the gathering forward and backward ran 7% faster on an H200 (341.9 us against 367.6).
H200_RATES = dataclasses.replace(
    H100_RATES, our_int_ops_per_sm_us=120 * 16384 * 4096 / 350.0 / 132,
    xla_int_ops_per_sm_us=120 * 16384 * 4096 / 450.4 / 132,
    xla_triton_slow_ns=(("erfc", (477.0 - 78.1) * 1e3 * 132 / (32768 * 2048)),),
    source="measured on an H200 (random bits, XLA's erfc); the H100's gathering and scan rates (the "
           "same SMs)")

# An A100 was not at hand to measure: its rates are the H100's scaled by the boost clocks (1410 MHz
# against 1980). Its SM has as many 32-bit integer lanes as Hopper's, so the random bits' rates
# scale so; it has half the float32 lanes, so the gathering rate, where float ops count, may be high.
A100_RATES = H100_RATES.scaled(1410 / 1980, source="derived from the H100's by the boost clocks "
                                                   "(1410/1980 MHz); not measured on an A100")


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    arch: str                 # NVRTC --gpu-architecture
    sm_count: int
    max_threads_per_sm: int
    regs_per_sm: int
    smem_per_block: int       # bytes without opting in
    smem_optin: int           # bytes one block may have after opting in
    smem_per_sm: int          # bytes the blocks resident on one SM share
    bandwidth_gbs: float      # achievable read+write HBM bandwidth of a plain elementwise kernel
    launch_us: float          # one kernel inside an XLA command buffer
    grid_sync_us: float       # one grid-wide barrier
    calibration: Calibration = H100_RATES

    def blocks_by_registers(self, block: int, registers: int) -> int:
        """Blocks of `block` threads an SM's register file holds at `registers` a thread (allocated
        per warp in units of 256)."""
        per_warp = -(-registers * 32 // 256) * 256
        return self.regs_per_sm // (block // 32 * per_warp)

    def resident_grid(self, grid: int, block: int, registers: int) -> int:
        """At most `grid` blocks, as many as are resident at once by registers: what a cooperative
        launch (a grid barrier, rows split over blocks) runs with, which the launcher clamps to one
        wave by the driver's occupancy."""
        return min(grid, max(1, self.blocks_by_registers(block, registers)) * self.sm_count)


# Bandwidths are what a plain elementwise kernel reached on our machines (DESIGN.md), not datasheets.
TARGETS = {
    "h100": Target("h100", "sm_90", 132, 2048, 65536, 48 * 1024, 227 * 1024, 228 * 1024, 3000.0, 2.7, 2.5, H100_RATES),
    "h200": Target("h200", "sm_90", 132, 2048, 65536, 48 * 1024, 227 * 1024, 228 * 1024, 4000.0, 2.7, 2.5, H200_RATES),
    "a100": Target("a100", "sm_80", 108, 2048, 65536, 48 * 1024, 163 * 1024, 164 * 1024, 1700.0, 3.0, 3.0, A100_RATES),
}


# A name is a key of TARGETS, or an alias of one: any case, an optional "nvidia" prefix, and after the
# name only a separated suffix, as in the device kinds jax reports ("NVIDIA H100 80GB HBM3", "NVIDIA
# A100-SXM4-80GB"). So "h1000" or "a100x" are unknown, not an h100 or an a100.
_ALIAS = re.compile(r"(?:nvidia[\s_-]*)?(?P<name>[a-z]\d+)(?:[\s_-].*)?", re.DOTALL)


def lookup(name: str) -> Target | None:
    """The target `name` or an alias of it names (see _ALIAS), else None."""
    m = _ALIAS.fullmatch(name.strip().lower())
    return TARGETS.get(m.group("name")) if m else None


def get_target(name: str | Target) -> Target:
    """The target for `name`: "h100", "h200", "a100", or an alias (_ALIAS), or a Target itself."""
    if isinstance(name, Target):
        return name
    if not isinstance(name, str):
        raise TypeError(f"target must be a GPU name like 'h100' or a Target, got {type(name).__name__}")
    tgt = lookup(name)
    if tgt is None:
        raise ValueError(f"target={name!r} is not a known GPU; known: {', '.join(sorted(TARGETS))} (any case, "
                         "optionally prefixed 'nvidia', or a device kind such as 'NVIDIA H100 80GB HBM3')")
    return tgt
