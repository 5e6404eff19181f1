"""GPU targets: the few numbers planning needs, so a CPU-only machine can plan for any of them."""
from __future__ import annotations

import dataclasses
import re


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
    "h100": Target("h100", "sm_90", 132, 2048, 65536, 48 * 1024, 227 * 1024, 228 * 1024, 3000.0, 2.7, 2.5),
    "h200": Target("h200", "sm_90", 132, 2048, 65536, 48 * 1024, 227 * 1024, 228 * 1024, 4000.0, 2.7, 2.5),
    "a100": Target("a100", "sm_80", 108, 2048, 65536, 48 * 1024, 163 * 1024, 164 * 1024, 1700.0, 3.0, 3.0),
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


def detect() -> Target | None:
    """The target for the first local CUDA device, or None without one."""
    import jax

    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    if not devices or devices[0].platform not in ("gpu", "cuda"):
        return None
    kind = devices[0].device_kind or ""
    if (tgt := lookup(kind)) is not None:
        return tgt
    for known, tgt in TARGETS.items():  # a variant's kind ("NVIDIA GH200 480GB": an h200's memory)
        if known in kind.lower():
            return tgt
    cc = getattr(devices[0], "compute_capability", "9.0")
    base = TARGETS["h100"]
    sms = getattr(devices[0], "core_count", base.sm_count)
    return dataclasses.replace(base, name=kind, arch="sm_" + str(cc).replace(".", ""), sm_count=sms)
