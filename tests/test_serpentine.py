"""Passes over chunks read again from global memory walk them back and forth (Mapping.serpentine), on
the CPU: the planner turns it on exactly where a later pass re-reads chunks (a partial or global
stash) and no scan fixes the order, and the kernel's second chunk loop runs backward."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jaxstitch
from jaxstitch import targets
from jaxstitch.bench import workloads
from jaxstitch.lowering import codegen
from jaxstitch.plan import planner
from jaxstitch.core.config import Tuning
from test_views import _traced

BACK_AND_FORTH = "passes walk the chunks back and forth"


def _mapping(name: str, dtype: str, shape: tuple[int, int], tune: str | None = None) -> str:
    w = workloads.WORKLOADS[name]
    args = jax.eval_shape(lambda k: w.draw(k, jnp.dtype(dtype), *shape), jax.random.key(0))
    with pytest.MonkeyPatch.context() as mp:
        if tune is not None:
            mp.setenv("JAXSTITCH_TUNE", tune)
        (region,) = jaxstitch.explain(w.fn, *args, target="h200").regions
    return region.mapping or ""


@pytest.mark.parametrize("name,dtype,shape,stash", [
    ("softmax_fwdbwd", "float32", (32, 262144), "shared stash of 3"),  # split rows, part stashed
    ("softmax_fwdbwd", "float32", (270, 60001), "global stash"),       # nothing stashed
    # (3 of 4 chunks, or 6 of 8 where NVRTC finds that 4 spill under the register cap)
    ("xent_fwdbwd", "float32", (300, 32000), "shared stash of "),
])
def test_passes_that_read_chunks_again_turn_round(name, dtype, shape, stash):
    mapping = _mapping(name, dtype, shape)
    assert stash in mapping and BACK_AND_FORTH in mapping, mapping
    assert BACK_AND_FORTH not in _mapping(name, dtype, shape, tune="serpentine=0")


@pytest.mark.parametrize("name,dtype,shape", [
    ("softmax_fwdbwd", "bfloat16", (300, 20000)),  # every chunk stashed: nothing re-read
    ("top_p_filter", "float32", (64, 262144)),     # a scan's carry runs one way
    ("softmax_fwdbwd", "float32", (1024, 4096)),   # a row in registers: one chunk
])
def test_no_turn_where_nothing_is_read_again_or_the_order_is_fixed(name, dtype, shape):
    assert BACK_AND_FORTH not in _mapping(name, dtype, shape)


def test_the_second_pass_walks_the_chunks_backward():
    w = workloads.WORKLOADS["softmax_fwdbwd"]
    x = jax.ShapeDtypeStruct((32, 262144), jnp.float32)
    _, part = _traced(w.fn, (x, x))
    target = targets.get_target("h200")
    loops = {}
    for serpentine in (1, 0):
        (plan,) = [planner.plan_region(r, target, Tuning(serpentine=serpentine)) for r in part.regions]
        assert plan.kernel.mapping.serpentine == bool(serpentine)
        source = codegen.render(plan.kernel).code
        loops[serpentine] = re.findall(r"for \(int ch = (0; ch < CHUNKS|CHUNKS - 1; ch >= 0)", source)
    assert loops[1] == ["0; ch < CHUNKS", "CHUNKS - 1; ch >= 0"], loops
    assert loops[0] == ["0; ch < CHUNKS", "0; ch < CHUNKS"], loops
