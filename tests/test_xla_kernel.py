"""CPU checks of XLA's own kernel call as a way to launch our kernels (kernels/xla_kernel.py,
JAXSTITCH_TUNE=xla_kernels=1): which launches take it, and that what XLA parses is what we meant.
The GPU test is test_gpu_correctness.py::test_xla_kernel_calls_match_xla."""
import re

import jax
import jax.numpy as jnp
import pytest
from jax.interpreters import mlir

import jaxstitch
from jaxstitch.bench import workloads
from jaxstitch.integration import ffi
from jaxstitch.kernels import nvrtc, xla_kernel

needs_nvrtc = pytest.mark.skipif(not nvrtc.available(), reason="NVRTC is not installed")
S = jax.ShapeDtypeStruct


def _calls(monkeypatch, spec, fn, *shapes):
    monkeypatch.setenv("JAXSTITCH_TUNE", spec)
    monkeypatch.setenv("JAXSTITCH_POISON", "0")  # (poisoned results need the launcher; the GPU tests set it)
    lowered = jaxstitch.jit(fn, target="h100").trace(*shapes).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


@needs_nvrtc
def test_row_kernels_become_xla_kernel_calls(monkeypatch):
    """softmax forward and backward is one row kernel: with xla_kernels=1 it is XLA's kernel call,
    without, the launcher's."""
    x = S((4096, 1024), jnp.float32)
    assert set(re.findall(r"custom_call @([\w$.]+)", _calls(monkeypatch, "", workloads.softmax_fwdbwd, x, x))) \
        == {ffi.TARGET}
    text = _calls(monkeypatch, "xla_kernels=1", workloads.softmax_fwdbwd, x, x)
    assert re.findall(r"custom_call @([\w$.]+)", text) == [xla_kernel.TARGET]


@needs_nvrtc
def test_a_grid_barrier_keeps_the_launcher(monkeypatch):
    """layernorm's backward sums gamma's and beta's gradients over the rows across a grid barrier:
    a cooperative launch, which XLA's kernel call cannot make."""
    x, v = S((4096, 1024), jnp.float32), S((1024,), jnp.float32)
    text = _calls(monkeypatch, "xla_kernels=1", workloads.layernorm_fwdbwd, x, v, v, x)
    assert ffi.TARGET in re.findall(r"custom_call @([\w$.]+)", text)


@needs_nvrtc
def test_the_backend_config_parses_back_to_the_ptx():
    """XLA parses the backend config as an MLIR dictionary (xla/service/gpu/kernel_call.cc): parsed
    here by the same MLIR, every field reads back, the PTX byte for byte."""
    source = ("extern \"C\" __global__ void k(const float* a, float* b) {\n"
              "  // a \"quoted\" \\ comment\n  b[threadIdx.x] = a[threadIdx.x] * 2.0f;\n}\n")
    ptx = nvrtc.compile_ptx(source, "sm_90")
    assert ".entry k(" in ptx and "\t" in ptx  # (tabs: escaped in the config)
    config = xla_kernel.backend_config(ptx, "k", grid=3, block=128, smem=4096)
    with mlir.make_ir_context():
        attr = mlir.ir.DictAttr(mlir.ir.Attribute.parse(config))
        assert mlir.ir.StringAttr(attr["kernel_data"]).value == ptx
        assert mlir.ir.StringAttr(attr["name"]).value == "k"
        assert mlir.ir.StringAttr(attr["kernel_type"]).value == "ptx"
        ints = {k: mlir.ir.IntegerAttr(attr[k]).value for k in
                ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem_bytes")}
    assert ints == dict(grid_x=3, grid_y=1, grid_z=1, block_x=128, block_y=1, block_z=1, shared_mem_bytes=4096)


@needs_nvrtc
def test_the_fixed_row_kernel_takes_the_buffers_only():
    """XLA passes one pointer per operand and result, nothing more: the kernel compiled with its row
    count fixed declares exactly those, and the launcher's declares the row count after them."""
    from jaxstitch.core import config
    from jaxstitch.driver import pipeline
    from jaxstitch.targets import get_target

    x = jnp.ones((4096, 1024), jnp.float32)
    tree = jax.tree_util.tree_structure(((x, x), {}))
    program = pipeline.build(workloads.softmax_fwdbwd, [x, x], tree, get_target("h100"), config.load(), {})
    (c,) = [c for c in program.regions if c.stitched]
    r = c.plan.region
    buffers = len(r.inputs) + len(r.outputs)

    def params(ptx):
        head = ptx[ptx.index(".entry"):]
        return head[:head.index(")")].count(".param")

    rows = c.plan.kernel.mapping.n_rows
    assert params(nvrtc.compile_ptx(c.source, "sm_90")) == buffers + 1
    assert params(nvrtc.compile_ptx(xla_kernel.fixed_rows_source(c.source, rows), "sm_90")) == buffers


def test_what_needs_the_launcher():
    from jaxstitch.integration.primitive import Launch

    plain = Launch("k", b"", "jaxstitch_kernel", grid=8, block=256, smem=0, cooperative=False,
                   workspace_bytes=0, rows=100)
    assert xla_kernel.unsupported(plain, remote=False) is None
    for change, remote in [(dict(cooperative=True), False), (dict(rows_buffer=0), False),
                           (dict(poison=True), False), (dict(workspace_bytes=64), False),
                           (dict(buffers=3), False), ({}, True)]:
        assert xla_kernel.unsupported(Launch(**{**plain.__dict__, **change}), remote=remote), change


def test_the_ptx_version_is_one_the_driver_reads():
    """NVRTC 13.5 writes PTX 9.5, which a CUDA 13.0 driver refuses: lowered to 9.0 there, kept where
    the driver is as new, and left alone without a driver (lowering on a CPU)."""
    ptx = "//\n.version 9.5\n.target sm_90\n.address_size 64\n"
    assert xla_kernel.for_driver(ptx, (13, 0)) == ptx.replace(".version 9.5", ".version 9.0")
    assert xla_kernel.for_driver(ptx, (13, 5)) == ptx
    assert xla_kernel.for_driver(ptx, None) == ptx
    assert xla_kernel.for_driver(ptx.replace("9.5", "8.4"), (12, 6)) == ptx.replace("9.5", "8.4")
    assert xla_kernel.for_driver(ptx, (12, 6)) == ptx.replace(".version 9.5", ".version 8.5")
    assert xla_kernel.readable_isa((12, 8)) == (8, 7) and xla_kernel.readable_isa((13, 2)) == (9, 2)
