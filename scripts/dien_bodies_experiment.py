"""Experiment: the DIEN-like train step with every region inside its scan bodies stitched, the cost
model overruled there (and only there), against jax.jit.

Why it exists: the cost model declines the GRU cells (256 x 36, "only 16 of 132 SMs would have
work"), yet XLA runs each forward cell as ~11 kernels, one per stacked scan output. Stitched, the cell
is one kernel and XLA wraps the stacking into dynamic-slice fusions around our custom call (12 -> 6
kernels an iteration), but the step got slower: 4.24 ms against jax.jit's 3.50 (H200, 2026-11-21),
3.45 ms with XLA_FLAGS=--xla_gpu_enable_command_buffer=+DYNAMIC_SLICE_FUSION, 6.36 ms with dynamic-slice
fusion off. The step is bound by the loops' per-iteration control, not by kernel work, so the cost
model's refusal stands. Run it again when XLA's loops or our body kernels change:

    XLA_FLAGS=... python3 scripts/dien_bodies_experiment.py
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from jaxstitch import pipeline  # noqa: E402

_build, _plan, _depth = pipeline._build, pipeline.plan_region, [0]


def build_counting_depth(traced, target, cfg):
    _depth[0] += 1
    try:
        return _build(traced, target, cfg)
    finally:
        _depth[0] -= 1


def plan_bodies_without_cost_veto(*args, **kwargs):
    plan = _plan(*args, **kwargs)
    if _depth[0] > 1 and plan.kernel is not None and plan.reason is not None:
        plan = dataclasses.replace(plan, reason=None)
    return plan


def main():
    pipeline._build, pipeline.plan_region = build_counting_depth, plan_bodies_without_cost_veto
    pipeline.MIN_RESIDENT_WARPS = 0
    import dien_train
    import train_harness

    c = dien_train.Config()
    train_harness.compare("DIEN, loop bodies stitched", dien_train.train_step, dien_train.make_init(c, 0),
                          dien_train.make_batches(c, 0), 100, rtol=2e-3)


if __name__ == "__main__":
    main()
