"""The local GPU as a planning target: jax's first CUDA device, looked up in `core/targets.py`'s
table (an unknown GPU plans with the H100's numbers at its own SM count, with a warning)."""
from __future__ import annotations

import dataclasses
import logging

import jax

from ..core.targets import TARGETS, Target, lookup

log = logging.getLogger("jaxstitch")


def detect() -> Target | None:
    """The target for the first local CUDA device, or None without one."""
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
    return _unknown(devices[0], kind)


_WARNED: set[str] = set()  # the unknown kinds warned of


def _unknown(device, kind: str) -> Target:
    """A GPU none of TARGETS names: the H100's numbers at its own architecture and SM count, which
    a warning says (its estimates, and so which regions stitch, may be off; the kernels are right)."""
    cc = getattr(device, "compute_capability", "9.0")
    base = TARGETS["h100"]
    sms = getattr(device, "core_count", base.sm_count)
    if kind not in _WARNED:
        _WARNED.add(kind)
        log.warning(
            "jaxstitch: %r is not a GPU it knows (%s); planning with the H100's bandwidth and rates at "
            "its %s SMs", kind, ", ".join(sorted(TARGETS)), sms)
    calibration = dataclasses.replace(base.calibration, source=f"the H100's (an unknown GPU: {kind})")
    return dataclasses.replace(base, name=kind, arch="sm_" + str(cc).replace(".", ""), sm_count=sms,
                               calibration=calibration)
