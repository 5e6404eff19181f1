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
from fuzz_programs import FuzzProgram, argument_specs, programs
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


def test_an_all_zero_reference_is_judged_at_the_inputs_scale():
    """A gradient that cancels to exactly 0 may carry one rounding of its O(1) terms, not more."""
    import numpy as np
    from fuzz_programs import check_against_jit

    zero = np.zeros(1, np.float32)
    ulp_noise = np.full(1, 0.0059, np.float32)  # under a bfloat16 ulp of 1.5
    assert check_against_jit([ulp_noise], [zero], [zero.astype(np.float64)], "bfloat16") == []
    assert check_against_jit([np.full(1, 0.1, np.float32)], [zero], [zero.astype(np.float64)], "bfloat16")
    assert check_against_jit([ulp_noise], [zero], [zero.astype(np.float64)], "float32")  # float32: 1e-4


def test_a_float64_residue_is_judged_as_a_cancellation_and_a_small_output_is_not():
    """A reference of 3.4e-21 (float64 rounding left over where terms of 3e-5 cancel) is a zero: one
    bfloat16 rounding of a term (2^-24) passes. A reference of 1e-6 is a value: 2^-24 off it fails."""
    import numpy as np
    from fuzz_programs import check_against_jit

    ours, theirs = np.full(2, 2.0 ** -24, np.float32), np.zeros(2, np.float32)
    residue = np.array([3.4e-21, -1e-22])
    assert check_against_jit([ours], [theirs], [residue], "bfloat16") == []
    assert check_against_jit([ours], [theirs + 1e-6], [residue + 1e-6], "bfloat16")


# Programs the GPU fuzzer found wrong (scripts/fuzz_gpu.py, H200), planned as by default: a size-1
# output made in the row loop after a scan but declared a scalar was stored nowhere (its poisoned
# NaN came back); codegen now stores it, and checks that every output is stored (UnwrittenOutput).
FOUND_ON_THE_GPU = [
    FuzzProgram(shape=(1, 4097), inputs=("bfloat16",), steps=(
        ("reduce", "max", 0, (1,), True), ("reshape", 0, (1, 241, 17)), ("concat", 1, 1, 0), ("concat", 3, 1, 0),
        ("mask", 3, 0, 1, -10000.0), ("scan", "cummax", 1, 0, False), ("mask", 3, 1, 0, 0.0),
        ("binary", "min", 1, 6)), outputs=(8, 5), grad=False, nan_inf=False),
    FuzzProgram(shape=(127,), inputs=("bfloat16", "bfloat16"), steps=(
        ("reduce", "min", 0, (0,), True), ("scan", "cumsum", 2, 0, True), ("reduce", "mean", 3, (0,), True),
        ("convert", 2, "bfloat16"), ("reduce", "min", 5, (0,), True), ("binary", "max", 6, 0), ("binary", "min", 0, 7),
        ("binary", "add", 3, 0)), outputs=(9, 8), grad=True, nan_inf=False),
    FuzzProgram(shape=(1,), inputs=("bfloat16",), steps=(
        ("pad", 0, 0, 2, 3, 0.0), ("slice", 1, 0, 0, 3), ("scan", "cummax", 0, 0, False), ("binary", "min", 2, 0),
        ("roll", 4, -1087, 0), ("scan", "cumsum", 0, 0, True), ("slice", 4, 0, 1, 1), ("concat", 3, 1, 0),
        ("unary", "cos", 8), ("binary", "sub", 0, 6)), outputs=(10,), grad=False, nan_inf=True),
]


@pytest.mark.parametrize("k", range(len(FOUND_ON_THE_GPU)))
def test_programs_found_on_the_gpu_store_every_output(k):
    program = FOUND_ON_THE_GPU[k]
    report = jaxstitch.explain(program.function(), *argument_specs(program), target="h200")
    assert any(r.stitched for r in report.regions)  # (the kernel that stored nothing is still planned)


def test_a_kernel_that_stores_an_output_nowhere_is_refused():
    from jaxstitch.lowering import codegen
    from jaxstitch.graph.partition import Region
    from jaxstitch.core import ir

    out = ir.Value(1, (4,), "float32")
    source = codegen.Source('extern "C" __global__ void k(const float* in0, float* out0) { }', "k", ())
    with pytest.raises(codegen.UnwrittenOutput):
        codegen._writing_every_output(source, Region(0, (), (ir.Value(0, (4,), "float32"),), (out,)))
