"""A kernel's registers and spills as the cubin records them (kernels/nvrtc.cubin_resources): the
GPU machines' NVRTC (13.0) sometimes leaves ptxas's report out of the program log, which read as 0
registers and no spills, and sized tile grids for more blocks than fit."""
from __future__ import annotations

import pytest

from jaxstitch.kernels import nvrtc

pytestmark = pytest.mark.skipif(not nvrtc.available(), reason="NVRTC is not installed")

SMALL = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.f; }'
# Many values live at once under a tight register cap: ptxas spills them to the stack.
SPILLING = """
extern "C" __global__ void __launch_bounds__(1024, 2) k(float* x) {
  float v[48];
  #pragma unroll
  for (int i = 0; i < 48; ++i) v[i] = x[threadIdx.x + i * 1024];
  float s = 0.f;
  #pragma unroll
  for (int i = 0; i < 48; ++i) s += v[i] * v[47 - i] + v[(i * 7) % 48];
  #pragma unroll
  for (int i = 0; i < 48; ++i) x[threadIdx.x + i * 1024] = v[i] * s;
}
"""


@pytest.mark.parametrize("source", [SMALL, SPILLING], ids=["small", "spilling"])
def test_the_cubin_records_what_ptxas_reports(source):
    cubin, reported = nvrtc.compile_cubin(source, "sm_90")
    recorded = nvrtc.cubin_resources(cubin)
    assert recorded is not None and recorded.registers == reported.registers > 0
    assert (recorded.spill_bytes > 0) == (reported.spill_bytes > 0)
    assert recorded.stack_bytes == reported.stack_bytes


def test_a_log_without_the_report_falls_back_to_the_cubin(monkeypatch):
    monkeypatch.setattr(nvrtc, "_log", lambda lib, prog: "")
    _, res = nvrtc.compile_cubin(SPILLING, "sm_90")
    assert res.registers > 0 and res.spill_bytes > 0


def test_not_a_cubin():
    assert nvrtc.cubin_resources(b"\x7fELF" + bytes(60)) is None
    assert nvrtc.cubin_resources(b"junk") is None
