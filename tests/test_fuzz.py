"""The fuzzer on the CPU: planning, code generation and NVRTC never raise on random programs.

Each program (tests/fuzz_programs.py: ranks 1-4, elementwise, reductions over any axes, converts,
iota masks, argmax, scans, roll/slice/pad/concatenate/transpose/reshape, forward and gradient) is
explained for an H200 under JAXSTITCH_STRICT (conftest.py), so an internal error or an NVRTC error in
our own source fails the test; half the programs are planned with the cost model's veto lifted
(strategies.force_stitching), so that their kernels are generated and compiled too. CI runs
JAXSTITCH_FUZZ_EXAMPLES programs (default 300, derandomized: the same programs every run);
`JAXSTITCH_FUZZ_EXAMPLES=5000 JAXSTITCH_FUZZ_SEED=random` is the nightly mode. The GPU half, against
jax.jit on fresh inputs, is tests/test_gpu_fuzz.py and scripts/fuzz_gpu.py.
"""
from __future__ import annotations

import contextlib
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxstitch
from fuzz_programs import argument_specs, programs
from strategies import force_stitching

EXAMPLES = int(os.environ.get("JAXSTITCH_FUZZ_EXAMPLES", "300"))
DERANDOMIZE = os.environ.get("JAXSTITCH_FUZZ_SEED", "fixed") != "random"


@settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE, print_blob=True,
          suppress_health_check=list(HealthCheck))
@given(programs(), st.booleans())
def test_random_programs_plan_and_compile(program, forced):
    fn = program.function()
    with force_stitching() if forced else contextlib.nullcontext():
        report = jaxstitch.explain(fn, *argument_specs(program), target="h200")
    assert all(not (r.reason or "").startswith("internal error") for r in report.regions)


def test_the_generator_covers_its_ops():
    """Over a fixed sample, every kind of step appears: a generator that stopped drawing some op would
    otherwise pass silently."""
    seen = set()

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(programs())
    def collect(program):
        seen.update(step[0] for step in program.steps)
        seen.add("grad" if program.grad else "forward")
        seen.update(program.inputs)

    collect()
    wanted = {"unary", "binary", "where", "convert", "reduce", "argmax", "mask", "scan", "roll", "slice", "pad",
              "concat", "transpose", "reshape", "softmax", "grad", "forward", "float32", "bfloat16", "float16",
              "int32", "uint32"}
    assert wanted <= seen, wanted - seen


@pytest.mark.parametrize("seed", range(3))
def test_fuzz_inputs_are_fresh_and_poisoned_as_asked(seed):
    from fuzz_programs import FuzzProgram, fuzz_inputs
    import numpy as np

    program = FuzzProgram(shape=(64, 33), inputs=("float32", "bfloat16"), steps=(("binary", "add", 0, 1),),
                          outputs=(2,), grad=False, nan_inf=True)
    a, b = fuzz_inputs(program, seed)
    a2, _ = fuzz_inputs(program, seed + 10)
    assert not np.array_equal(np.asarray(a), np.asarray(a2))
    assert np.isnan(np.asarray(a)).any() or np.isinf(np.asarray(a)).any() or np.isnan(np.asarray(b, np.float32)).any()
