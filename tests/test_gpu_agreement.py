"""GPU: the three random programs whose gradients came out wrong, and a sample of the fuzzer, against
jax.jit on fresh inputs (each judged against a float64 reference: tests/fuzz_programs.py's check),
outputs poisoned. The CPU half is tests/test_agreement.py; scripts/fuzz_gpu.py runs the fuzzer at
scale."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxstitch
from fuzz_programs import check_against_jit, float64_reference, fuzz_inputs, programs, reference
from strategies import force_stitching
from test_agreement import _grad, column_max_of_a_round_trip, column_softmax_bf16, round_trip_cumsum

pytestmark = pytest.mark.gpu

CASES = {
    "round_trip_cumsum": (_grad(round_trip_cumsum, 2), [((31, 3, 2, 127), jnp.float32)] * 2, [(31, 3, 2, 127)]),
    "round_trip_cumsum_small": (_grad(round_trip_cumsum, 2), [((7, 2, 2, 127), jnp.float32)] * 2, [(7, 2, 2, 127)]),
    "column_max_of_a_round_trip": (_grad(column_max_of_a_round_trip, 2), [((127, 4097), jnp.float32)] * 2,
                                   [(127, 4097), (1, 4097)]),
    "column_softmax_bf16": (_grad(column_softmax_bf16, 1), [((2793, 4096), jnp.bfloat16)], [(2793, 4096)]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_the_three_wrong_gradients_match_jax_jit(name, seed, monkeypatch):
    monkeypatch.setenv("JAXSTITCH_POISON", "1")
    fn, arg_specs, ct_shapes = CASES[name]
    rng = np.random.default_rng(seed)
    args = [jnp.asarray(rng.standard_normal(s), d) for s, d in arg_specs]
    args.append(tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ct_shapes))
    got, want = jaxstitch.jit(fn)(*args), jax.jit(fn)(*args)
    assert check_against_jit(got, want, float64_reference(fn, args)) == []
    for g in jax.tree_util.tree_leaves(got):
        assert np.isfinite(np.asarray(g, np.float32)).all()


@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(programs(), st.booleans(), st.integers(0, 2 ** 31 - 1))
def test_random_programs_match_jax_jit(program, forced, seed):
    """A fixed sample of the fuzzer's programs (scripts/fuzz_gpu.py runs thousands)."""
    import contextlib
    import os

    os.environ["JAXSTITCH_POISON"] = "1"
    try:
        fn = program.function()
        args = fuzz_inputs(program, seed)
        want = jax.jit(fn)(*args)
        with force_stitching() if forced else contextlib.nullcontext():
            got = jaxstitch.jit(fn)(*args)
        ref = want if not program.floating else reference(program, args)
        assert check_against_jit(got, want, ref, program.lossy) == []
    finally:
        os.environ.pop("JAXSTITCH_POISON", None)
