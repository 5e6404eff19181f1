"""The GPUs jaxstitch plans for, by name, and the one on this machine.

    jaxstitch.targets.get_target("h200")   # a Target: bandwidth, SMs, shared memory, calibration
    jaxstitch.targets.detect()             # the local GPU's Target, or None without one
    jaxstitch.targets.TARGETS              # every GPU known by name
"""
from .core.targets import TARGETS, Calibration, Target, get_target, lookup  # noqa: F401
from .integration.devices import detect  # noqa: F401

__all__ = ["TARGETS", "Calibration", "Target", "detect", "get_target", "lookup"]
