"""What a cooperative launch costs the host, against a plain one: an empty kernel launched through
the CUDA driver (cuda.bindings), with and without the 16-byte memset our launcher once put before a
grid-barrier kernel, at several dynamic shared-memory sizes.

    python3 scripts/coop_launch_probe.py

Per case: the host's µs per launch call (median of single calls) and the µs per launch of a
back-to-back loop after synchronizing (what a stream of such launches sustains). A diagnosis
tool for the GPU machines, not a test.
"""
import statistics
import time

from cuda.bindings import driver as cu

from jaxstitch.kernels import nvrtc

SRC = r"""
extern "C" __global__ void k(unsigned int* c) {
  extern __shared__ unsigned char s[];
  if (threadIdx.x == 0 && blockIdx.x == 0 && c) atomicAdd(c, 1u);
}
"""


def check(res):
    err, *rest = res if isinstance(res, tuple) else (res,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(err)
    return rest[0] if len(rest) == 1 else rest


def main():
    check(cu.cuInit(0))
    dev = check(cu.cuDeviceGet(0))
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev))
    check(cu.cuCtxSetCurrent(ctx))
    major = check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
    minor = check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
    sms = check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
    cubin, _ = nvrtc.compile_cubin(SRC, f"sm_{major}{minor}")
    mod = check(cu.cuModuleLoadData(cubin))
    fn = check(cu.cuModuleGetFunction(mod, b"k"))
    check(cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                200 * 1024))
    stream = check(cu.cuStreamCreate(1))
    counter = check(cu.cuMemAlloc(16))
    import ctypes
    ptr = ctypes.c_uint64(int(counter))
    params = (ctypes.c_void_p * 1)(ctypes.addressof(ptr))
    print("| smem KB | block | grid | launch | memset first | host us per call (median) | us per launch, 200 back to back |")
    print("|---:|---:|---:|---|---|---:|---:|")
    for smem_kb in (0, 16, 96, 200):
        smem, block = smem_kb * 1024, 512
        per_sm = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, block, smem))
        grid = per_sm * sms
        for coop in (False, True):
            for memset in (False, True):
                def launch():
                    if memset:
                        check(cu.cuMemsetD8Async(counter, 0, 16, stream))
                    if coop:
                        check(cu.cuLaunchCooperativeKernel(fn, grid, 1, 1, block, 1, 1, smem, stream,
                                                           ctypes.addressof(params)))
                    else:
                        check(cu.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, smem, stream,
                                                ctypes.addressof(params), 0))
                for _ in range(20):
                    launch()
                check(cu.cuStreamSynchronize(stream))
                single = []
                for _ in range(50):
                    t0 = time.perf_counter()
                    launch()
                    single.append((time.perf_counter() - t0) * 1e6)
                    check(cu.cuStreamSynchronize(stream))
                t0 = time.perf_counter()
                for _ in range(200):
                    launch()
                check(cu.cuStreamSynchronize(stream))
                loop = (time.perf_counter() - t0) * 1e6 / 200
                print(f"| {smem_kb} | {block} | {grid} | {'cooperative' if coop else 'plain'} | "
                      f"{'yes' if memset else 'no'} | {statistics.median(single):.1f} | {loop:.1f} |", flush=True)


if __name__ == "__main__":
    main()
