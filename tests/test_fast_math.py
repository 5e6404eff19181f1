"""The fast forms of exp and erfc that half-precision regions use (planner.fast_exp), checked on the
CPU: js_erfc_fast's coefficients, read from the template, evaluated in float32 as the kernel does,
against math.erfc; and which regions get them."""
from __future__ import annotations

import math
import re
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np

import jaxstitch


def _erfc_fast_coefficients() -> list[float]:
    src = resources.files("jaxstitch.csrc_templates").joinpath("stitch_common.cuh").read_text()
    body = src[src.index("float js_erfc_fast(float a)"):]
    body = body[:body.index("\n}\n")]
    first = float(re.search(r"float p = (-?[\d.]+)f;", body).group(1))
    return [first] + [float(c) for c in re.findall(r"p = fmaf\(p, t, (-?[\d.]+)f\);", body)]


def _erfc_fast(a: np.ndarray) -> np.ndarray:
    """js_erfc_fast in float32 (exp exact here: the kernel's ex2.approx adds ~2^-22)."""
    a = a.astype(np.float32)
    z = np.abs(a)
    t = (np.float32(1) / (np.float32(0.5) * z + np.float32(1))).astype(np.float32)
    coef = _erfc_fast_coefficients()
    p = np.full_like(t, coef[0])
    for c in coef[1:]:
        p = (p * t + np.float32(c)).astype(np.float32)
    r = t * np.exp((-z * z + p).astype(np.float32))
    return np.where(a >= 0, r, np.float32(2) - r)


def test_erfc_fast_is_within_1e_5_of_erfc():
    coef = _erfc_fast_coefficients()
    assert len(coef) == 10, coef
    x = np.concatenate([np.linspace(-6, 9, 20001), [0.0, 1e-6, -1e-6, 0.5, -0.5]]).astype(np.float32)
    want = np.array([math.erfc(float(v)) for v in x])
    got = _erfc_fast(x).astype(np.float64)
    tiny = want < 1e-30  # (flushed to zero on the GPU)
    rel = np.abs(got - want)[~tiny] / want[~tiny]
    assert rel.max() < 1e-5, (rel.max(), x[~tiny][np.argmax(rel)])


def test_erfc_fast_limits():
    got = _erfc_fast(np.array([np.inf, -np.inf, np.nan], np.float32))
    assert got[0] == 0 and got[1] == 2 and np.isnan(got[2])


def test_only_half_precision_regions_use_the_fast_forms():
    def gelu_grad(x, dy):
        return jax.vjp(lambda x: jax.nn.gelu(x, approximate=False), x)[1](dy)[0]

    for dtype, fast in ((jnp.bfloat16, True), (jnp.float32, False)):
        spec = jax.ShapeDtypeStruct((1024, 1024), dtype)
        report = jaxstitch.explain(gelu_grad, spec, spec, target="h100")
        planned = [r for r in report.regions if r.mapping]
        assert planned and all(("fast exp" in r.mapping) == fast for r in planned), report
