// The one generic XLA FFI handler of jaxstitch: it launches a precompiled
// CUDA kernel whose cubin bytes travel in the custom call's attributes.
//
// Why one handler for every kernel: the HLO then holds only data (cubin bytes,
// a content hash, the kernel name, the launch shape), never a process-local
// pointer, so JAX's persistent compilation cache and jax.export keep working.
//
// Why dlopen: building needs no CUDA toolkit. XLA has libcuda loaded already;
// we declare the few driver types and entry points we use ourselves.
//
// Kernel ABI: one pointer parameter per buffer, every argument buffer in order,
// then every result buffer in order (the first `buffers` of them), then the
// row count as a long long.
//
// A call may carry alternative kernels of the same region (a shape family's
// variants, e.g. rows split over several blocks for few long rows): the first
// whose `below_rows` exceeds the actual row count runs instead of the main one.

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

// Python's build flags add -Wsign-compare, which fires only inside these
// third-party headers; keep the build log about our own code.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wreturn-type"
#include "xla/ffi/api/ffi.h"
#pragma GCC diagnostic pop

namespace ffi = xla::ffi;

// --- The driver API subset, declared by hand (same ABI as cuda.h) ----------

typedef int CUresult;  // an enum in cuda.h; 0 is CUDA_SUCCESS
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;

namespace {

constexpr CUresult kCudaSuccess = 0;
constexpr int kFuncAttrMaxDynamicSharedBytes = 8;  // CU_FUNC_ATTRIBUTE_...
constexpr int kDevAttrMultiprocessorCount = 16;    // CU_DEVICE_ATTRIBUTE_...
constexpr int kCaptureModeRelaxed = 2;             // CU_STREAM_CAPTURE_MODE_...

struct Driver {
  CUresult (*ModuleLoadData)(CUmodule*, const void*);
  CUresult (*ModuleUnload)(CUmodule);
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned,
                           unsigned, unsigned, unsigned, CUstream, void**,
                           void**);
  CUresult (*LaunchCooperativeKernel)(CUfunction, unsigned, unsigned, unsigned,
                                      unsigned, unsigned, unsigned, unsigned,
                                      CUstream, void**);
  CUresult (*FuncSetAttribute)(CUfunction, int, int);
  CUresult (*OccupancyMaxActiveBlocksPerMultiprocessor)(int*, CUfunction, int,
                                                        size_t);
  CUresult (*DeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*CtxGetDevice)(CUdevice*);
  CUresult (*StreamGetCtx)(CUstream, CUcontext*);
  CUresult (*CtxPushCurrent)(CUcontext);
  CUresult (*CtxPopCurrent)(CUcontext*);
  CUresult (*GetErrorString)(CUresult, const char**);
  CUresult (*ThreadExchangeStreamCaptureMode)(int*);
  CUresult (*MemsetD8Async)(unsigned long long, unsigned char, size_t, CUstream);
};

// Resolved once. The plain names stay exported by current drivers (binaries
// built against old toolkits keep working); cuCtxPush/PopCurrent are the _v2
// entry points cuda.h maps them to. cuStreamGetCtx stays plain: its _v2
// (CUDA 12.5+) has another signature (green contexts).
const Driver* GetDriver(std::string* why) {
  static std::string error;
  static const Driver* driver = []() -> const Driver* {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* e = dlerror();
      error = std::string("dlopen(libcuda.so.1) failed: ") + (e ? e : "?");
      return nullptr;
    }
    static Driver d;
    std::string missing;
    auto get = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(
          dlsym(lib, name));
      if (fn == nullptr) missing += std::string(" ") + name;
    };
    get(d.ModuleLoadData, "cuModuleLoadData");
    get(d.ModuleUnload, "cuModuleUnload");
    get(d.ModuleGetFunction, "cuModuleGetFunction");
    get(d.LaunchKernel, "cuLaunchKernel");
    get(d.LaunchCooperativeKernel, "cuLaunchCooperativeKernel");
    get(d.FuncSetAttribute, "cuFuncSetAttribute");
    get(d.OccupancyMaxActiveBlocksPerMultiprocessor,
        "cuOccupancyMaxActiveBlocksPerMultiprocessor");
    get(d.DeviceGetAttribute, "cuDeviceGetAttribute");
    get(d.CtxGetDevice, "cuCtxGetDevice");
    get(d.StreamGetCtx, "cuStreamGetCtx");
    get(d.CtxPushCurrent, "cuCtxPushCurrent_v2");
    get(d.CtxPopCurrent, "cuCtxPopCurrent_v2");
    get(d.GetErrorString, "cuGetErrorString");
    get(d.ThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode");
    get(d.MemsetD8Async, "cuMemsetD8Async");
    if (!missing.empty()) {
      error = "libcuda.so.1 lacks" + missing;
      return nullptr;
    }
    return &d;
  }();
  if (driver == nullptr) *why = error;
  return driver;
}

std::string Describe(std::string_view kernel) {
  return "jaxstitch_launch: kernel '" + std::string(kernel) + "': ";
}

// Every driver error becomes an ffi::Error naming the kernel (never abort).
ffi::Error DriverError(const Driver* d, CUresult r, const char* call,
                       std::string_view kernel) {
  const char* s = nullptr;
  if (d->GetErrorString(r, &s) != kCudaSuccess || s == nullptr) s = "unknown";
  return ffi::Error::Internal(Describe(kernel) + call + " failed: " + s +
                              " (CUresult " + std::to_string(r) + ")");
}

// CU_CHECK(d, kernel, ModuleLoadData, &m, image) calls d->ModuleLoadData(...)
// and returns an error naming cuModuleLoadData if it fails.
#define CU_CHECK(d, kernel, fn, ...)                                   \
  do {                                                                 \
    CUresult r_ = (d)->fn(__VA_ARGS__);                                \
    if (r_ != kCudaSuccess) return DriverError(d, r_, "cu" #fn, kernel); \
  } while (0)

// --- Module cache ------------------------------------------------------------

// A cubin may hold several kernels and occupancy depends on block and smem,
// so all of them are in the key, with the context (a CUfunction is valid only
// in the context that loaded its module).
struct Entry {
  CUfunction fn;
  int64_t max_resident_blocks;  // occupancy per SM x SM count
};
struct Key {
  CUcontext ctx;
  std::string key, kernel;
  int64_t block, smem;
};
struct KeyView {
  CUcontext ctx;
  std::string_view key, kernel;
  int64_t block, smem;
};
template <typename K>
auto Tie(const K& k) {
  return std::make_tuple(reinterpret_cast<uintptr_t>(k.ctx),
                         std::string_view(k.key), std::string_view(k.kernel),
                         k.block, k.smem);
}
struct KeyLess {
  using is_transparent = void;  // find() by KeyView: no allocation on hits
  template <typename A, typename B>
  bool operator()(const A& a, const B& b) const { return Tie(a) < Tie(b); }
};

std::mutex cache_mu;
std::map<Key, Entry, KeyLess> cache;  // modules stay loaded for the process

// Finds the kernel in a freshly loaded module and sizes one wave of it.
ffi::Error Inspect(const Driver* d, CUmodule module, const KeyView& k,
                   Entry* out) {
  std::string name(k.kernel);  // NUL-terminated for the driver
  CUfunction fn;
  CU_CHECK(d, k.kernel, ModuleGetFunction, &fn, module, name.c_str());
  // Static plus dynamic shared memory above 48 KiB needs the opt-in: always opt in to the dynamic
  // size (48 KiB of stash next to the static reduction scratch once found no block fitting an SM).
  if (k.smem > 0)
    CU_CHECK(d, k.kernel, FuncSetAttribute, fn, kFuncAttrMaxDynamicSharedBytes,
             static_cast<int>(k.smem));
  int per_sm = 0, sms = 0;
  CUdevice dev;
  CU_CHECK(d, k.kernel, OccupancyMaxActiveBlocksPerMultiprocessor, &per_sm, fn,
           static_cast<int>(k.block), static_cast<size_t>(k.smem));
  CU_CHECK(d, k.kernel, CtxGetDevice, &dev);
  CU_CHECK(d, k.kernel, DeviceGetAttribute, &sms, kDevAttrMultiprocessorCount,
           dev);
  *out = Entry{fn, int64_t{per_sm} * sms};
  return ffi::Error::Success();
}

// Puts the stream's context current and relaxes stream capture for the
// thread; both restored on scope exit.
struct LoadScope {
  const Driver* d;
  int mode = kCaptureModeRelaxed;
  bool relaxed = false, pushed = false;
  ~LoadScope() {
    CUcontext ignored;
    if (pushed) d->CtxPopCurrent(&ignored);
    if (relaxed) d->ThreadExchangeStreamCaptureMode(&mode);
  }
};

ffi::Error Load(const Driver* d, const KeyView& k,
                ffi::Span<const uint8_t> cubin, Entry* out) {
  // Execute may run while XLA captures a CUDA graph, and loading a module is
  // not allowed under capture in the default (global) mode.
  LoadScope scope{d};
  scope.relaxed =
      d->ThreadExchangeStreamCaptureMode(&scope.mode) == kCudaSuccess;
  CU_CHECK(d, k.kernel, CtxPushCurrent, k.ctx);
  scope.pushed = true;

  // 8-byte aligned copy with a trailing NUL (which PTX text would need).
  std::vector<uint64_t> image(cubin.size() / 8 + 1, 0);
  std::copy(cubin.begin(), cubin.end(),
            reinterpret_cast<uint8_t*>(image.data()));
  CUmodule module;
  CU_CHECK(d, k.kernel, ModuleLoadData, &module, image.data());
  ffi::Error e = Inspect(d, module, k, out);
  if (e.failure()) d->ModuleUnload(module);
  return e;
}

ffi::Error GetOrLoad(const Driver* d, const KeyView& k,
                     ffi::Span<const uint8_t> cubin, Entry* out) {
  std::lock_guard<std::mutex> lock(cache_mu);  // held while loading: no races
  if (auto it = cache.find(k); it != cache.end()) {
    *out = it->second;
    return ffi::Error::Success();
  }
  if (ffi::Error e = Load(d, k, cubin, out); e.failure()) return e;
  cache.emplace(Key{k.ctx, std::string(k.key), std::string(k.kernel), k.block,
                    k.smem},
                *out);
  return ffi::Error::Success();
}

// Shared by both stages: driver, config check, cache lookup or load.
ffi::Error Prepare(CUstream stream, ffi::Span<const uint8_t> cubin,
                   std::string_view key, std::string_view kernel, int64_t grid,
                   int64_t block, int64_t smem, int64_t cooperative,
                   const Driver** d, Entry* entry) {
  std::string why;
  if ((*d = GetDriver(&why)) == nullptr)
    return ffi::Error::Internal(Describe(kernel) + why);
  if (block < 1 || block > 1024 || grid < 0 || grid > INT32_MAX || smem < 0 ||
      smem > INT32_MAX || (cooperative != 0 && cooperative != 1))
    return ffi::Error::InvalidArgument(
        Describe(kernel) + "bad launch config grid=" + std::to_string(grid) +
        " block=" + std::to_string(block) + " smem=" + std::to_string(smem) +
        " cooperative=" + std::to_string(cooperative));
  CUcontext ctx;
  CU_CHECK(*d, kernel, StreamGetCtx, stream, &ctx);
  return GetOrLoad(*d, KeyView{ctx, key, kernel, block, smem}, cubin, entry);
}

// --- Variants --------------------------------------------------------------------

// One kernel of the call: the main one from the scalar attributes, or an
// alternative from the packed ones.
struct Variant {
  ffi::Span<const uint8_t> cubin;
  std::string_view key;
  int64_t below_rows, grid, block, smem, cooperative, rows_per_block, splits,
      buffers;
};

// alt_launch packs, per alternative: below_rows, grid, block, smem,
// cooperative, rows_per_block, splits, buffers, cubin bytes. alt_cubins holds
// their cubins back to back; alt_keys their keys, space separated. A call
// without alternatives carries one 0 in each (XLA's empty arrays are avoided).
constexpr size_t kAltFields = 9;

ffi::Error Alternatives(std::string_view kernel, ffi::Span<const int64_t> launch,
                        ffi::Span<const uint8_t> cubins, std::string_view keys,
                        std::vector<Variant>* out) {
  const size_t n = launch.size() / kAltFields;
  size_t at = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t* f = launch.begin() + i * kAltFields;
    const size_t space = keys.find(' ');
    const std::string_view key = keys.substr(0, space);
    keys = space == std::string_view::npos ? std::string_view() : keys.substr(space + 1);
    if (f[8] < 1 || at + static_cast<size_t>(f[8]) > cubins.size() || key.empty())
      return ffi::Error::InvalidArgument(Describe(kernel) + "bad alternative " +
                                         std::to_string(i));
    out->push_back(Variant{ffi::Span<const uint8_t>(cubins.begin() + at, f[8]),
                           key, f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]});
    at += static_cast<size_t>(f[8]);
  }
  return ffi::Error::Success();
}

// --- Stages --------------------------------------------------------------------

// Initialize: load the modules before execute, outside any graph capture.
ffi::Error Initialize(CUstream stream, ffi::Span<const uint8_t> cubin,
                      std::string_view key, std::string_view kernel,
                      int64_t grid, int64_t block, int64_t smem,
                      int64_t cooperative, int64_t /*poison*/, int64_t /*rows*/,
                      int64_t /*rows_buffer*/, int64_t /*row_elems*/,
                      int64_t /*rows_per_block*/, int64_t /*splits*/,
                      int64_t /*buffers*/, ffi::Span<const int64_t> alt_launch,
                      ffi::Span<const uint8_t> alt_cubins,
                      std::string_view alt_keys) {
  const Driver* d;
  Entry entry;
  if (ffi::Error e = Prepare(stream, cubin, key, kernel, grid, block, smem,
                             cooperative, &d, &entry);
      e.failure())
    return e;
  std::vector<Variant> alts;
  if (ffi::Error e = Alternatives(kernel, alt_launch, alt_cubins, alt_keys, &alts);
      e.failure())
    return e;
  for (const Variant& v : alts)
    if (ffi::Error e = Prepare(stream, v.cubin, v.key, kernel, v.grid, v.block,
                               v.smem, v.cooperative, &d, &entry);
        e.failure())
      return e;
  return ffi::Error::Success();
}

ffi::Error Execute(CUstream stream, ffi::RemainingArgs args,
                   ffi::RemainingRets rets, ffi::Span<const uint8_t> cubin,
                   std::string_view key, std::string_view kernel, int64_t grid,
                   int64_t block, int64_t smem, int64_t cooperative,
                   int64_t poison, int64_t rows, int64_t rows_buffer,
                   int64_t row_elems, int64_t rows_per_block, int64_t splits,
                   int64_t buffers, ffi::Span<const int64_t> alt_launch,
                   ffi::Span<const uint8_t> alt_cubins,
                   std::string_view alt_keys) {
  // The row count: given, or read off a buffer's size (a kernel of a shape
  // family, lowered with symbolic dimensions). With rows_per_block the grid
  // is at most the given one and at most one block per row group.
  int64_t n_rows = rows;
  if (rows_buffer >= 0) {
    const size_t i = static_cast<size_t>(rows_buffer);
    if (i >= args.size() + rets.size() || row_elems < 1)
      return ffi::Error::InvalidArgument(
          Describe(kernel) + "bad row source buffer=" +
          std::to_string(rows_buffer) + " row_elems=" + std::to_string(row_elems));
    int64_t count = 1;
    if (i < args.size()) {
      auto buf = args.get<ffi::AnyBuffer>(i);
      if (buf.has_error()) return buf.error();
      for (int64_t dim : buf.value().dimensions()) count *= dim;
    } else {
      auto buf = rets.get<ffi::AnyBuffer>(i - args.size());
      if (buf.has_error()) return buf.error();
      for (int64_t dim : buf.value()->dimensions()) count *= dim;
    }
    n_rows = count / row_elems;
  }
  // The kernel for this row count: the first alternative made for fewer rows
  // than `below_rows`, else the main one.
  std::vector<Variant> alts;
  if (ffi::Error e = Alternatives(kernel, alt_launch, alt_cubins, alt_keys, &alts);
      e.failure())
    return e;
  for (const Variant& v : alts) {
    if (n_rows < v.below_rows) {
      cubin = v.cubin, key = v.key, grid = v.grid, block = v.block, smem = v.smem;
      cooperative = v.cooperative, rows_per_block = v.rows_per_block;
      splits = v.splits, buffers = v.buffers;
      break;
    }
  }
  const Driver* d;
  Entry entry;  // loaded lazily here if initialize did not run
  if (ffi::Error e = Prepare(stream, cubin, key, kernel, grid, block, smem,
                             cooperative, &d, &entry);
      e.failure())
    return e;
  if (rows_per_block > 0)  // one block per row group, or per slice of a split row
    grid = std::min(grid, (n_rows * std::max<int64_t>(splits, 1) + rows_per_block - 1) /
                              rows_per_block);
  if (grid <= 0) return ffi::Error::Success();  // empty region: nothing to do

  // params[i] points at the i-th device pointer. Inline storage for the usual
  // case; the heap only for unusually many buffers.
  // The last parameter is the row count (a remote kernel, whose one
  // parameter is the table of pointers, takes no more: the driver reads only
  // the parameters the kernel declares).
  constexpr size_t kInline = 32;
  const size_t n = args.size() + rets.size();
  void* inline_storage[2 * kInline + 1];
  std::vector<void*> heap;
  void** ptrs = inline_storage;
  if (n > kInline) {
    heap.resize(2 * n + 1);
    ptrs = heap.data();
  }
  void** params = ptrs + n;
  for (size_t i = 0; i < args.size(); ++i) {
    auto buf = args.get<ffi::AnyBuffer>(i);
    if (buf.has_error()) return buf.error();
    ptrs[i] = buf.value().untyped_data();
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buf = rets.get<ffi::AnyBuffer>(i);
    if (buf.has_error()) return buf.error();
    ptrs[args.size() + i] = buf.value()->untyped_data();
  }
  // The kernel takes the first `buffers` pointers (a variant without a
  // workspace leaves out the call's last result), then the row count.
  const size_t used = buffers < 0 ? n : std::min(n, static_cast<size_t>(buffers));
  for (size_t i = 0; i < used; ++i) params[i] = &ptrs[i];
  params[used] = &n_rows;

  // Testing aid: fill every result with 0xFF bytes (NaN for floats) so that an
  // element the kernel forgets to write cannot pass for a right answer.
  if (poison) {
    for (size_t i = 0; i < rets.size(); ++i) {
      auto buf = rets.get<ffi::AnyBuffer>(i);
      CU_CHECK(d, kernel, MemsetD8Async,
               reinterpret_cast<unsigned long long>(ptrs[args.size() + i]),
               0xFF, buf.value()->size_bytes(), stream);
    }
  }
  // (A kernel with a grid barrier keeps the barrier's state in its module:
  // its arrival count is zero at load and after every barrier, so no memset.)

  const unsigned b = static_cast<unsigned>(block);
  const unsigned s = static_cast<unsigned>(smem);
  if (cooperative) {
    // A grid barrier needs every block resident: clamp to one wave (kernels
    // launched cooperatively loop over their work, grid-stride).
    if (entry.max_resident_blocks < 1)
      return ffi::Error::Internal(
          Describe(kernel) + "no block fits on an SM (block=" +
          std::to_string(block) + " smem=" + std::to_string(smem) + ")");
    const auto g = static_cast<unsigned>(std::min(grid, entry.max_resident_blocks));
    CU_CHECK(d, kernel, LaunchCooperativeKernel, entry.fn, g, 1, 1, b, 1, 1, s,
             stream, params);
  } else {
    CU_CHECK(d, kernel, LaunchKernel, entry.fn, static_cast<unsigned>(grid), 1,
             1, b, 1, 1, s, stream, params, nullptr);
  }
  return ffi::Error::Success();
}

template <typename B>
auto BindAttrs(B&& binding) {
  return std::move(binding)
      .template Attr<ffi::Span<const uint8_t>>("cubin")
      .template Attr<std::string_view>("key")
      .template Attr<std::string_view>("kernel")
      .template Attr<int64_t>("grid")
      .template Attr<int64_t>("block")
      .template Attr<int64_t>("smem")
      .template Attr<int64_t>("cooperative")
      .template Attr<int64_t>("poison")
      .template Attr<int64_t>("rows")
      .template Attr<int64_t>("rows_buffer")
      .template Attr<int64_t>("row_elems")
      .template Attr<int64_t>("rows_per_block")
      .template Attr<int64_t>("splits")
      .template Attr<int64_t>("buffers")
      .template Attr<ffi::Span<const int64_t>>("alt_launch")
      .template Attr<ffi::Span<const uint8_t>>("alt_cubins")
      .template Attr<std::string_view>("alt_keys");
}

}  // namespace

// --- Exported handlers -----------------------------------------------------------

// setup.py compiles with -fvisibility=hidden; these declarations export the
// three symbols that XLA_FFI_DEFINE_HANDLER_SYMBOL defines below.
#define JAXSTITCH_EXPORT __attribute__((visibility("default")))
extern "C" JAXSTITCH_EXPORT XLA_FFI_Error* JaxstitchLaunchExecute(
    XLA_FFI_CallFrame* call_frame);
extern "C" JAXSTITCH_EXPORT XLA_FFI_Error* JaxstitchLaunchExecutePlain(
    XLA_FFI_CallFrame* call_frame);
extern "C" JAXSTITCH_EXPORT XLA_FFI_Error* JaxstitchLaunchInitialize(
    XLA_FFI_CallFrame* call_frame);

// XLA reads handler traits from the execute handler's metadata only, so
// kCmdBufferCompatible (launches may be recorded into CUDA graphs) goes here.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxstitchLaunchExecute, Execute,
    BindAttrs(ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<CUstream>>()
                  .RemainingArgs()
                  .RemainingRets()),
    {ffi::Traits::kCmdBufferCompatible});

// The same handler without the trait (ffi.py's TARGET_PLAIN): XLA launches
// such a call between its command buffers instead of tracing it into one.
// Which costs the host less depends on the program,
// so a program picks (core/config.py Tuning.cmd_buffers).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxstitchLaunchExecutePlain, Execute,
    BindAttrs(ffi::Ffi::Bind()
                  .Ctx<ffi::PlatformStream<CUstream>>()
                  .RemainingArgs()
                  .RemainingRets()));

// Initialize needs no buffers; it binds the stream (to find the CUcontext) and
// all the attributes (XLA checks their number).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxstitchLaunchInitialize, Initialize,
    BindAttrs(ffi::Ffi::BindInitialize().Ctx<ffi::PlatformStream<CUstream>>()));
