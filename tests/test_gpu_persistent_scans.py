"""Persistent scans on a GPU (plan/scan.py): each case of tests/recurrent.py under jaxstitch.jit
against jax.jit, outputs poisoned first, run twice (a result that moves between runs is a race).

Both sides run with float32 matrix products at full precision: by default XLA may run them in TF32
on this GPU, while a scan kernel multiplies in float32."""
import jax
import numpy as np
import pytest

import jaxstitch
from recurrent import CASES
from test_gpu_correctness import compare

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", sorted(CASES))
def test_scan_kernel_matches_jax_jit(name, monkeypatch):
    monkeypatch.setenv("JAXSTITCH_POISON", "1")
    fn, make, planned = CASES[name]
    args = make()
    scans = [r for r in jaxstitch.explain(fn, *args).regions if r.ops == ("scan",)]
    assert scans and all(r.stitched == planned for r in scans), [(r.stitched, r.reason) for r in scans]
    if planned:
        assert "jaxstitch_launch" in jaxstitch.jit(fn).lower(*args).as_text()
    with jax.default_matmul_precision("highest"):
        want = jax.jit(fn)(*args)
        first = jax.block_until_ready(jaxstitch.jit(fn)(*args))
        again = jax.block_until_ready(jaxstitch.jit(fn)(*args))
    for i, (g, h, w) in enumerate(zip(jax.tree.leaves(first), jax.tree.leaves(again), jax.tree.leaves(want))):
        compare(g, w, f"{name} output {i}")
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h), err_msg=f"{name} output {i} moved between runs")


def test_grad_of_a_stitched_scan(monkeypatch):
    """jax.grad of jaxstitch.jit(gru): the stitch primitive's transformation rules plan the forward
    and backward scans again, each one kernel."""
    monkeypatch.setenv("JAXSTITCH_POISON", "1")
    from recurrent import gru, gru_inputs
    kernel, h0, gx, mask = gru_inputs(256, seed=9)

    def loss(f):
        return lambda k, g: (f(k, h0, g, mask) ** 2).sum()
    with jax.default_matmul_precision("highest"):
        got = jax.jit(jax.grad(loss(jaxstitch.jit(gru)), argnums=(0, 1)))(kernel, gx)
        want = jax.jit(jax.grad(loss(gru), argnums=(0, 1)))(kernel, gx)
    for i, (g, w) in enumerate(zip(got, want)):
        compare(g, w, f"grad {i}")


@pytest.mark.parametrize("name", ["gru_grad", "gru_grad_bf16"])
def test_sums_in_place_give_the_written_forms_bits(name, monkeypatch):
    """The weight gradient summed into its carry in place (plan/scan.py's InPlaceSum) is the same
    float sum, in the same order, as the product, transpose and add as written (scan_sums=0): the
    outputs must agree bit for bit, for float32 and bfloat16 carries."""
    monkeypatch.setenv("JAXSTITCH_POISON", "1")
    fn, make, _ = CASES[name]
    args = make()
    outs = []
    for spec in ("", "scan_sums=0"):
        monkeypatch.setenv("JAXSTITCH_TUNE", spec)
        [_, backward] = [r for r in jaxstitch.explain(fn, *args).regions if r.ops == ("scan",)]
        assert backward.stitched, backward.reason
        outs.append(jax.block_until_ready(jaxstitch.jit(fn)(*args)))
    in_place, written = outs
    for i, (a, b) in enumerate(zip(jax.tree.leaves(in_place), jax.tree.leaves(written))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} output {i}")
