"""GPU smoke test of jaxstitch's generic FFI launcher.

Compiles small CUDA C kernels with NVRTC, launches them through
``jaxstitch.integration.ffi.launch`` inside ``jax.jit`` and checks the results:
a plain launch, a cooperative launch whose kernel crosses a grid barrier, a
driver error surfacing as a Python exception, a jax.export round trip, a module
loaded lazily at execute (under CUDA-graph capture), an alternative kernel picked
by the row count, and the cost of a chain of 32 launches in one jit.

Run on a GPU machine after ``pip install --no-build-isolation --no-deps -e .``:

    python scripts/smoke_launcher.py

Without a GPU it only compiles the kernels (printing SKIP for the rest).
Exit status 1 if any check printed FAIL.
"""
import ctypes
import hashlib
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

N = 10**6 + 3
N_SMALL = 1024  # for the launch-overhead timing
BLOCK = 256
CHAIN = 32

SOURCE = r"""
#define N %(n)d

extern "C" __global__ void add1(const float* x, float* y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) y[i] = x[i] + 1.0f;
}

// A one-counter grid barrier (module globals start at zero). It only works
// when every block is resident, which the cooperative launch guarantees. The
// bounded spin turns a broken guarantee into wrong results instead of a hang.
__device__ unsigned int bar_count = 0;
__device__ volatile unsigned int bar_gen = 0;

__device__ void grid_sync() {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int gen = bar_gen;
    __threadfence();
    if (atomicAdd(&bar_count, 1u) == gridDim.x - 1) {
      bar_count = 0;
      __threadfence();
      atomicAdd((unsigned int*)&bar_gen, 1u);
    } else {
      for (long spin = 0; bar_gen == gen && spin < (1L << 28); ++spin) {
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// y = x + 0.5; barrier; z[i] = y[N-1-i] + 0.5, i.e. z = reverse(x) + 1: each
// block reads what other blocks wrote. Grid-stride, since the launcher clamps
// a cooperative grid to one wave.
extern "C" __global__ void add1_coop(const float* x, float* y, float* z) {
  int stride = gridDim.x * blockDim.x;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < N; i += stride)
    y[i] = x[i] + 0.5f;
  grid_sync();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < N; i += stride)
    z[i] = y[N - 1 - i] + 0.5f;
}
"""

# The same kernel name adding 2: an alternative of add1 (check 6).
SOURCE_ALT = r"""
#define N %(n)d

extern "C" __global__ void add1(const float* x, float* y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) y[i] = x[i] + 2.0f;
}
"""

failed = False


def short(e):
    """An exception in one line: XLA's messages quote the whole HLO op."""
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text if len(text) < 300 else text[:150] + " ... " + text[-150:]


def report(ok, name, detail=""):
    global failed
    failed |= not ok
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}",
          flush=True)


def compile_cubin(source, arch):
    """CUDA C -> cubin with NVRTC (cuda.bindings, else CuPy's binding)."""
    opts = [f"--gpu-architecture={arch}", "--std=c++17"]
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        nvrtc = None
    if nvrtc is not None:
        ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
        err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"smoke.cu", 0, [], [])
        assert err == ok, err
        try:
            (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
            if err != ok:
                _, size = nvrtc.nvrtcGetProgramLogSize(prog)
                log = b" " * size
                nvrtc.nvrtcGetProgramLog(prog, log)
                raise RuntimeError(f"NVRTC: {err}\n{log.decode(errors='replace')}")
            err, size = nvrtc.nvrtcGetCUBINSize(prog)
            assert err == ok, err
            cubin = b" " * size
            (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
            assert err == ok, err
            return cubin
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
    from cupy_backends.cuda.libs import nvrtc as cupy_nvrtc
    prog = cupy_nvrtc.createProgram(source, "smoke.cu", [], [])
    try:
        cupy_nvrtc.compileProgram(prog, opts)
        return cupy_nvrtc.getCUBIN(prog)
    finally:
        cupy_nvrtc.destroyProgram(prog)


def time_chain(f, x, reps=50):
    """Median seconds of one call of f(x), after a warm-up call."""
    f(x).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def gpu_arch():
    import jax
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None, None
    cc = getattr(gpus[0], "compute_capability", "9.0")
    return gpus[0], "sm_" + str(cc).replace(".", "")


def main():
    device, arch = gpu_arch()
    arch = arch or "sm_90"
    t0 = time.perf_counter()
    try:
        cubin = compile_cubin(SOURCE % {"n": N}, arch)
        cubin_small = compile_cubin(SOURCE % {"n": N_SMALL}, arch)
    except Exception as e:
        report(False, "nvrtc compile", short(e))
        return
    report(cubin[:4] == b"\x7fELF", "nvrtc compile",
           f"{len(cubin)} bytes cubin for {arch} "
           f"in {(time.perf_counter() - t0) / 2:.2f} s")
    if device is None:
        print("SKIP GPU checks: no GPU device")
        return

    import jax
    import jax.numpy as jnp
    from jaxstitch.integration import ffi

    ok, note = ffi.register()
    report(ok, "register", note or "")
    if not ok:
        return
    print(f"device: {device.device_kind}, jax {jax.__version__}")

    def add1(x, cubin=cubin, kernel="add1", key=None, target=ffi.TARGET):
        """y = x + 1 through the launcher (via ffi_call for another target)."""
        n = x.shape[0]
        attrs = dict(cubin=cubin, key=key or hashlib.sha256(cubin).hexdigest(),
                     kernel=kernel, grid=math.ceil(n / BLOCK), block=BLOCK,
                     smem=0, cooperative=False)
        spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return ffi.launch([x], out_types=[spec], target=target, **attrs)[0]

    def chain_of(fn):
        def chain(x):
            for _ in range(CHAIN):
                x = fn(x)
            return x
        return jax.jit(chain)

    spec = jax.ShapeDtypeStruct((N,), jnp.float32)
    x = jax.random.normal(jax.random.key(0), (N,), jnp.float32)
    x_np = np.asarray(x)

    # 1. Plain launch.
    try:
        y = np.asarray(jax.jit(add1)(x))
        report(np.array_equal(y, x_np + np.float32(1)), "plain launch",
               f"max err {np.max(np.abs(y - (x_np + 1))):.3g}")
    except Exception as e:
        report(False, "plain launch", short(e))

    # 2. Cooperative launch over a grid barrier, asking for more blocks than
    # fit in one wave (the launcher clamps the grid).
    def coop(x):
        return ffi.launch([x], out_types=[spec, spec], cubin=cubin,
                          key=hashlib.sha256(cubin).hexdigest(),
                          kernel="add1_coop", grid=math.ceil(N / BLOCK),
                          block=BLOCK, smem=0, cooperative=True)
    try:
        yc, zc = (np.asarray(a) for a in jax.jit(coop)(x))
        ok = (np.array_equal(yc, x_np + np.float32(0.5))
              and np.allclose(zc, x_np[::-1] + 1, atol=1e-6))
        report(ok, "cooperative launch with grid barrier",
               f"max err {np.max(np.abs(zc - (x_np[::-1] + 1))):.3g}")
    except Exception as e:
        report(False, "cooperative launch with grid barrier", short(e))

    # 3. A driver error is an exception naming the kernel, not an abort.
    try:
        jax.block_until_ready(jax.jit(lambda x: add1(x, kernel="no_such_kernel"))(x))
        report(False, "driver error surfaces", "no exception")
    except Exception as e:
        msg = str(e)
        at = msg.find("jaxstitch_launch: kernel 'no_such_kernel'")
        report(at >= 0 and "cuModuleGetFunction" in msg[at:],
               "driver error surfaces", msg[at:at + 160] if at >= 0 else short(e))

    # 4. jax.export: the cubin travels in the serialized module.
    try:
        exp = jax.export.export(jax.jit(add1), disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(ffi.TARGET)])(spec)
        again = jax.export.deserialize(exp.serialize())
        y = np.asarray(again.call(x))
        report(np.array_equal(y, x_np + 1), "jax.export round trip")
    except Exception as e:
        report(False, "jax.export round trip", short(e))

    # 5. Lazy load at execute: a target registered without its initialize
    # stage and a key not cached yet, inside a chain that XLA records into a
    # command buffer (CUDA-graph capture).
    try:
        lib = ctypes.cdll.LoadLibrary(ffi._find_library())
        jax.ffi.register_ffi_target(
            "jaxstitch_smoke_execute_only",
            jax.ffi.pycapsule(lib.JaxstitchLaunchExecute), platform="CUDA")
        f = chain_of(lambda x: add1(x, key="smoke-lazy-load",
                                    target="jaxstitch_smoke_execute_only"))
        y = np.asarray(f(x))
        report(np.allclose(y, x_np + CHAIN, atol=1e-4),
               "lazy load at execute under graph capture")
    except Exception as e:
        report(False, "lazy load at execute under graph capture", short(e))

    # 6. Alternatives: the launcher runs the first one made for more rows than
    # the call has (here `rows`, given), else the main kernel. The alternative's
    # add1 adds 2 and takes one buffer fewer: the workspace it does not use.
    try:
        cubin_alt = compile_cubin(SOURCE_ALT % {"n": N}, arch)
        ws = jax.ShapeDtypeStruct((16,), jnp.uint8)

        def picked(x, rows, below):
            alt = ffi.Alternative(below, cubin_alt, hashlib.sha256(cubin_alt).hexdigest(),
                                  math.ceil(N / BLOCK), BLOCK, 0, False, 0, buffers=2)
            return ffi.launch([x], out_types=[spec, ws], cubin=cubin,
                              key=hashlib.sha256(cubin).hexdigest(), kernel="add1",
                              grid=math.ceil(N / BLOCK), block=BLOCK, smem=0,
                              cooperative=False, rows=rows, buffers=2,
                              alternatives=[alt])[0]
        below = np.asarray(jax.jit(lambda v: picked(v, 10, 11))(x))
        at = np.asarray(jax.jit(lambda v: picked(v, 11, 11))(x))
        report(np.array_equal(below, x_np + np.float32(2)) and np.array_equal(at, x_np + np.float32(1)),
               "alternative kernel picked by the row count")
    except Exception as e:
        report(False, "alternative kernel picked by the row count", short(e))

    # 7. Chains of launches in one jit: per-call cost on 10^6 floats and on
    # 1024 floats (mostly launch overhead), with XLA's own kernels for scale.
    # Inside XLA command buffers a custom call is a traced command: when its
    # buffer addresses change between runs XLA re-captures it (~10 us), while
    # its own kernel nodes only get new parameters; so the small-array number
    # moves between ~3 us (stable addresses) and ~10 us.
    try:
        f = chain_of(add1)
        y = np.asarray(f(x))
        report(np.allclose(y, x_np + CHAIN, atol=1e-4), f"chain of {CHAIN}")
        xs = x[:N_SMALL]
        y = np.asarray(chain_of(lambda v: add1(v, cubin=cubin_small))(xs))
        report(np.allclose(y, x_np[:N_SMALL] + CHAIN, atol=1e-4),
               f"chain of {CHAIN}, {N_SMALL} floats")
        xla = chain_of(lambda v: jax.lax.optimization_barrier(v + 1))
        for name, arg, ours, theirs in (
                (f"{N} floats", x, f, xla),
                (f"{N_SMALL} floats", xs,
                 chain_of(lambda v: add1(v, cubin=cubin_small)), xla)):
            t_ours = time_chain(ours, arg) / CHAIN
            t_xla = time_chain(theirs, arg) / CHAIN
            print(f"chain of {CHAIN}, {name}: {t_ours * 1e6:.2f} us per launch "
                  f"(unfused XLA add: {t_xla * 1e6:.2f} us per op)")
    except Exception as e:
        report(False, f"chain of {CHAIN}", short(e))


if __name__ == "__main__":
    main()
    sys.exit(1 if failed else 0)
