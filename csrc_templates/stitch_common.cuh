// Device helpers shared by every stitched kernel: storage <-> compute conversions, vector memory
// access, NaN-propagating min/max, row and block reductions, and the one-shot grid barrier.
// Storage types: float32 -> float, bfloat16/float16 -> unsigned short (bits), int32 -> int,
// uint32 -> unsigned, bool -> unsigned char. Half types are computed in float and rounded on store, like XLA with
// excess precision allowed.

// The row (or tile) count, JS_ROWS_PARAM at the end of a kernel's parameters: by default a parameter
// after the buffers (one cubin serves every count; the launcher passes it, kernels/ffi.py). Compiled
// with JS_FIXED_ROWS defined, for XLA's own kernel call, which passes the buffers only
// (kernels/xla_kernel.py), it is that constant and no parameter.
#ifdef JS_FIXED_ROWS
#define JS_ROWS_PARAM
#define js_n_rows ((long long)(JS_FIXED_ROWS))
#else
#define JS_ROWS_PARAM , const long long js_n_rows
#endif

#define JS_INF __int_as_float(0x7f800000)
#define JS_NAN __int_as_float(0x7fc00000)
#define JS_INT_MAX 2147483647
#define JS_INT_MIN (-2147483647 - 1)

struct js_bf16 { unsigned short bits; };
struct js_f16 { unsigned short bits; };

__device__ __forceinline__ float js_to_float(js_bf16 h) { return __uint_as_float(((unsigned int)h.bits) << 16); }
__device__ __forceinline__ float js_to_float(js_f16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits)); return f; }
__device__ __forceinline__ float js_to_float(float f) { return f; }

__device__ __forceinline__ float js_round_bf16(float f) {
  unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ float js_round_f16(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); float r; asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h)); return r;
}

template <typename S> struct js_io;
template <> struct js_io<float> {
  typedef float C;
  static __device__ __forceinline__ float get(float s) { return s; }
  static __device__ __forceinline__ float put(float c) { return c; }
};
template <> struct js_io<js_bf16> {
  typedef float C;
  static __device__ __forceinline__ float get(js_bf16 s) { return js_to_float(s); }
  static __device__ __forceinline__ js_bf16 put(float c) { js_bf16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(c)); return r; }
};
template <> struct js_io<js_f16> {
  typedef float C;
  static __device__ __forceinline__ float get(js_f16 s) { return js_to_float(s); }
  static __device__ __forceinline__ js_f16 put(float c) { js_f16 r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(c)); return r; }
};
template <> struct js_io<int> {
  typedef int C;
  static __device__ __forceinline__ int get(int s) { return s; }
  static __device__ __forceinline__ int put(int c) { return c; }
};
template <> struct js_io<unsigned> {
  typedef unsigned C;
  static __device__ __forceinline__ unsigned get(unsigned s) { return s; }
  static __device__ __forceinline__ unsigned put(unsigned c) { return c; }
};
template <> struct js_io<unsigned char> {
  typedef bool C;
  static __device__ __forceinline__ bool get(unsigned char s) { return s != 0; }
  static __device__ __forceinline__ unsigned char put(bool c) { return c ? 1 : 0; }
};

// A vector of V elements of S moves as one access of its size (uint4 for 16 bytes), packed and
// unpacked with shifts: a struct or union of V elements is copied element by element by the compiler,
// which split 16-byte loads and stores into 2- and 4-byte ones.
template <typename S> __device__ __forceinline__ unsigned int js_bits(S s);
template <> __device__ __forceinline__ unsigned int js_bits(float s) { return __float_as_uint(s); }
template <> __device__ __forceinline__ unsigned int js_bits(int s) { return (unsigned int)s; }
template <> __device__ __forceinline__ unsigned int js_bits(unsigned s) { return s; }
template <> __device__ __forceinline__ unsigned int js_bits(js_bf16 s) { return s.bits; }
template <> __device__ __forceinline__ unsigned int js_bits(js_f16 s) { return s.bits; }
template <> __device__ __forceinline__ unsigned int js_bits(unsigned char s) { return s; }
template <typename S> __device__ __forceinline__ S js_from_bits(unsigned int b);
template <> __device__ __forceinline__ float js_from_bits(unsigned int b) { return __uint_as_float(b); }
template <> __device__ __forceinline__ int js_from_bits(unsigned int b) { return (int)b; }
template <> __device__ __forceinline__ unsigned js_from_bits(unsigned int b) { return b; }
template <> __device__ __forceinline__ js_bf16 js_from_bits(unsigned int b) { js_bf16 r; r.bits = (unsigned short)b; return r; }
template <> __device__ __forceinline__ js_f16 js_from_bits(unsigned int b) { js_f16 r; r.bits = (unsigned short)b; return r; }
template <> __device__ __forceinline__ unsigned char js_from_bits(unsigned int b) { return (unsigned char)b; }

// L2 eviction priorities (sm_80+) for rows partly re-read from global memory: KEEP (evict_last) on
// a read that a later pass repeats, else evict_first (the data's last use, or a streamed output).
template <bool KEEP> __device__ __forceinline__ unsigned long long js_l2_policy() {
  unsigned long long p;
  if constexpr (KEEP) asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  else asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
// More than 16 bytes (a vector wider than the widest access) moves as 16-byte pieces.
template <int WORDS> __device__ __forceinline__ void js_read_words(const void* p, unsigned int* w) {
  if constexpr (WORDS > 4) {
#pragma unroll
    for (int i = 0; i < WORDS; i += 4) js_read_words<4>(static_cast<const char*>(p) + 4 * i, w + i);
  }
  else if constexpr (WORDS == 4) { uint4 x = *reinterpret_cast<const uint4*>(p); w[0] = x.x; w[1] = x.y; w[2] = x.z; w[3] = x.w; }
  else if constexpr (WORDS == 2) { uint2 x = *reinterpret_cast<const uint2*>(p); w[0] = x.x; w[1] = x.y; }
  else { w[0] = *reinterpret_cast<const unsigned int*>(p); }
}
template <int WORDS> __device__ __forceinline__ void js_write_words(void* p, const unsigned int* w) {
  if constexpr (WORDS > 4) {
#pragma unroll
    for (int i = 0; i < WORDS; i += 4) js_write_words<4>(static_cast<char*>(p) + 4 * i, w + i);
  }
  else if constexpr (WORDS == 4) *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  else if constexpr (WORDS == 2) *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  else *reinterpret_cast<unsigned int*>(p) = w[0];
}
// As js_write_words to global memory, as one instruction: NVVM split the uint4 store above into four
// 4-byte stores in some kernels (layer norm's), a quarter of the bytes per store instruction.
// STREAM: 16-byte pieces are stored evict_first, leaving L2 to data read again.
template <int WORDS, bool STREAM = false> __device__ __forceinline__ void js_write_words_global(void* p, const unsigned int* w) {
  if constexpr (WORDS > 4) {
#pragma unroll
    for (int i = 0; i < WORDS; i += 4) js_write_words_global<4, STREAM>(static_cast<char*>(p) + 4 * i, w + i);
  }
  else if constexpr (WORDS == 4 && STREAM)
    asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;"
                 :: "l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]), "l"(js_l2_policy<false>()) : "memory");
  else if constexpr (WORDS == 4)
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
  else if constexpr (WORDS == 2)
    asm volatile("st.global.v2.b32 [%0], {%1, %2};" :: "l"(p), "r"(w[0]), "r"(w[1]) : "memory");
  else
    asm volatile("st.global.b32 [%0], %1;" :: "l"(p), "r"(w[0]) : "memory");
}

// V elements of S packed in words, converted to compute type.
template <typename S, int V, typename C>
__device__ __forceinline__ void js_unpack(const unsigned int* w, C* out) {
  constexpr int PER = 4 / (int)sizeof(S);
#pragma unroll
  for (int i = 0; i < V; ++i)
    out[i] = js_io<S>::get(js_from_bits<S>(PER == 1 ? w[i] : w[i / PER] >> (8 * (int)sizeof(S) * (i % PER))));
}

// Loads V contiguous elements (one vector access) and converts them to compute type.
template <typename S, int V, typename C>
__device__ __forceinline__ void js_load(const S* __restrict__ p, C* out) {
  constexpr int BYTES = V * (int)sizeof(S);
  if constexpr (BYTES >= 4) {
    unsigned int w[BYTES / 4];
    js_read_words<BYTES / 4>(p, w);
    js_unpack<S, V>(w, out);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = js_io<S>::get(p[i]);
  }
}

// As js_load from global memory, with an L2 eviction priority.
template <typename S, int V, bool KEEP, typename C>
__device__ __forceinline__ void js_load_l2(const S* __restrict__ p, C* out) {
  constexpr int BYTES = V * (int)sizeof(S);
  if constexpr (BYTES % 16 == 0) {
    const unsigned long long pol = js_l2_policy<KEEP>();
    unsigned int w[BYTES / 4];
#pragma unroll
    for (int b = 0; b < BYTES / 4; b += 4)
      asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                   : "=r"(w[b]), "=r"(w[b + 1]), "=r"(w[b + 2]), "=r"(w[b + 3])
                   : "l"(reinterpret_cast<const char*>(p) + 4 * b), "l"(pol));
    js_unpack<S, V>(w, out);
  } else {
    js_load<S, V>(p, out);
  }
}

// As js_load, and keeps a copy of the raw vector in `stash` (shared memory) for later phases.
template <typename S, int V, typename C>
__device__ __forceinline__ void js_load_stash(const S* __restrict__ p, S* __restrict__ stash, C* out) {
  constexpr int BYTES = V * (int)sizeof(S);
  if constexpr (BYTES >= 4) {
    unsigned int w[BYTES / 4];
    js_read_words<BYTES / 4>(p, w);
    js_write_words<BYTES / 4>(stash, w);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) stash[i] = p[i];
  }
  js_load<S, V>(stash, out);
}

// Asynchronous copy of one vector (V elements of S) from global to shared memory (cp.async, sm_80+):
// 16-byte pieces, or one 4- or 8-byte copy. With ok == false nothing is read and zeros are written.
__device__ __forceinline__ unsigned int js_smem_addr(const void* p) {
  unsigned int a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
template <typename S, int V, bool STREAM = false>
__device__ __forceinline__ void js_stage(S* smem, const S* __restrict__ g, bool ok) {
  constexpr int BYTES = V * (int)sizeof(S);
  const unsigned int dst = js_smem_addr(smem);
  const char* src = reinterpret_cast<const char*>(g);
  if constexpr (STREAM && BYTES % 16 == 0) {  // read once: evict_first (see js_l2_policy)
    const unsigned long long pol = js_l2_policy<false>();
#pragma unroll
    for (int b = 0; b < BYTES; b += 16)
      asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;"
                   :: "r"(dst + b), "l"(src + b), "r"(ok ? 16 : 0), "l"(pol) : "memory");
  } else if constexpr (BYTES % 16 == 0) {
#pragma unroll
    for (int b = 0; b < BYTES; b += 16)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst + b), "l"(src + b), "r"(ok ? 16 : 0) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" :: "r"(dst), "l"(src), "n"(BYTES % 16), "r"(ok ? BYTES : 0) : "memory");
  }
}
__device__ __forceinline__ void js_stage_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed copy groups are still in flight; the landed data
// is then visible to this thread (each thread reads back only the slots it copied).
template <int N>
__device__ __forceinline__ void js_stage_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

template <typename S, int V, bool STREAM = false, typename C>
__device__ __forceinline__ void js_store(S* __restrict__ p, const C* in) {
  constexpr int BYTES = V * (int)sizeof(S), PER = 4 / (int)sizeof(S);
  if constexpr (BYTES >= 4) {
    unsigned int w[BYTES / 4];
#pragma unroll
    for (int j = 0; j < BYTES / 4; ++j) {
      w[j] = 0;
#pragma unroll
      for (int t = 0; t < PER; ++t) w[j] |= js_bits(js_io<S>::put(in[j * PER + t])) << (8 * (int)sizeof(S) * t);
    }
    js_write_words_global<BYTES / 4, STREAM>(p, w);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = js_io<S>::put(in[i]);
  }
}

// NaN-propagating float min/max in one instruction (sm_80+), like XLA's.
__device__ __forceinline__ float js_max(float a, float b) { float r; asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float js_min(float a, float b) { float r; asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ int js_max(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ int js_min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ unsigned js_max(unsigned a, unsigned b) { return a > b ? a : b; }
__device__ __forceinline__ unsigned js_min(unsigned a, unsigned b) { return a < b ? a : b; }
__device__ __forceinline__ bool js_max(bool a, bool b) { return a || b; }
__device__ __forceinline__ bool js_min(bool a, bool b) { return a && b; }
__device__ __forceinline__ float js_sign(float a) { return a > 0.f ? 1.f : (a < 0.f ? -1.f : a); }
__device__ __forceinline__ int js_sign(int a) { return (a > 0) - (a < 0); }
// Shifts as XLA defines them: an amount of 32 or more (as unsigned) gives 0, or the sign for an
// arithmetic right shift (C leaves those undefined). Constant amounts fold the test away.
__device__ __forceinline__ unsigned js_shl(unsigned a, unsigned b) { return b < 32u ? a << b : 0u; }
__device__ __forceinline__ int js_shl(int a, int b) { return (int)js_shl((unsigned)a, (unsigned)b); }
__device__ __forceinline__ unsigned js_shrl(unsigned a, unsigned b) { return b < 32u ? a >> b : 0u; }
__device__ __forceinline__ int js_shrl(int a, int b) { return (int)js_shrl((unsigned)a, (unsigned)b); }
__device__ __forceinline__ int js_shra(int a, int b) { return a >> ((unsigned)b < 32u ? b : 31); }
__device__ __forceinline__ unsigned js_shra(unsigned a, unsigned b) { return (unsigned)js_shra((int)a, (int)b); }
__device__ __forceinline__ int js_f2i(float a) {
  return a != a ? 0 : (a >= 2147483648.f ? JS_INT_MAX : (a <= -2147483648.f ? JS_INT_MIN : (int)a));
}
// Float division as XLA does it on NVIDIA GPUs: div.full.f32, a full-range approximation (2 ulp):
// the operands scaled by 1/4 when |b| > 2^126, or by 2^24 when b is subnormal, then a * rcp(b).
__device__ __forceinline__ float js_div(float a, float b) {
  float r; asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
// The same split in two, for the E elements a of a row over one b: the scale and the reciprocal
// once per row (the compiler hoists them: the asm is pure), a multiply or two per element.
__device__ __forceinline__ float js_div_scale(float b) {
  const float m = fabsf(b);
  return m > 8.50705917e37f ? 0.25f : (m < 1.17549435e-38f ? 16777216.f : 1.f);
}
__device__ __forceinline__ float js_div_rcp(float b) {
  float r; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b * js_div_scale(b))); return r;
}
__device__ __forceinline__ float js_div_by(float a, float b) {
  return (a * js_div_scale(b)) * js_div_rcp(b);
}
// Integer division and remainder with XLA's answers where C's are undefined: x / 0 = -1, x % 0 = x,
// INT_MIN / -1 = INT_MIN, INT_MIN % -1 = 0.
__device__ __forceinline__ int js_idiv(int a, int b) {
  return b == 0 ? -1 : (b == -1 ? (int)(0u - (unsigned int)a) : a / b);
}
__device__ __forceinline__ int js_irem(int a, int b) { return b == 0 ? a : (b == -1 ? 0 : a % b); }
// exp(a) as 2^(a log2 e) on the SFU (planner.fast_exp says where): exp(-inf) = 0, exp(inf) = inf,
// NaN stays NaN; results under 2^-126 flush to zero.
__device__ __forceinline__ float js_exp_fast(float a) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a * 1.4426950408889634f));
  return r;
}
// erfc(a) where exp is fast (planner.fast_exp): Numerical Recipes' Chebyshev fit `erfcc`, fractional
// error under 1.2e-7 in exact arithmetic (~1e-6 in float), far under the 2^-9 / 2^-12 a bfloat16 /
// float16 input is known to; a reciprocal, nine FMAs and the fast exp, where erfcf divides and
// branches (an exact GELU's gradient in bfloat16 was bound by it). erfc(inf) = 0, erfc(-inf) = 2,
// NaN stays NaN. tests/test_fast_math.py checks the coefficients against math.erfc.
__device__ __forceinline__ float js_erfc_fast(float a) {
  const float z = fabsf(a);
  const float t = __fdividef(1.0f, fmaf(0.5f, z, 1.0f));
  float p = 0.17087277f;
  p = fmaf(p, t, -0.82215223f);
  p = fmaf(p, t, 1.48851587f);
  p = fmaf(p, t, -1.13520398f);
  p = fmaf(p, t, 0.27886807f);
  p = fmaf(p, t, -0.18628806f);
  p = fmaf(p, t, 0.09678418f);
  p = fmaf(p, t, 0.37409196f);
  p = fmaf(p, t, 1.00002368f);
  p = fmaf(p, t, -1.26551223f);
  const float r = t * js_exp_fast(fmaf(-z, z, p));
  return a >= 0.f ? r : 2.f - r;
}
__device__ __forceinline__ float js_logistic(float a) { return 1.f / (1.f + expf(-a)); }
__device__ __forceinline__ float js_ipow(float x, int n) {
  float r = 1.f; float b = n < 0 ? 1.f / x : x; int m = n < 0 ? -n : n;
  while (m) { if (m & 1) r *= b; b *= b; m >>= 1; }
  return r;
}
__device__ __forceinline__ int js_ipow(int x, int n) {
  int r = 1; int m = n; while (m > 0) { if (m & 1) r *= x; x *= x; m >>= 1; } return r;
}

struct js_sum_op { template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; } };
struct js_max_op { template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return js_max(a, b); } };
struct js_min_op { template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return js_min(a, b); } };
struct js_prod_op { template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a * b; } };

// Scans along a row (cumsum and its kin), N vectors of a thread at once: each lane's totals t[k] of
// its vectors become inclusive scans over the aligned group of W lanes (W a power of two <= 32),
// from lane 0 up, or with REV from the last lane down. Folds run in scan order: op(before, after).
template <int W, bool REV, int N, typename T, typename Op>
__device__ __forceinline__ void js_lanes_scan(T (&t)[N], Op op) {
  const int l = (threadIdx.x & 31) % W;
#pragma unroll
  for (int d = 1; d < W; d <<= 1) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const T o = REV ? __shfl_down_sync(0xffffffffu, t[k], d, W) : __shfl_up_sync(0xffffffffu, t[k], d, W);
      if (REV ? l + d < W : l >= d) t[k] = op(o, t[k]);
    }
  }
}
// From the inclusive scans `t`: what comes before each lane (`before`, `ident` for the first lane in
// scan order) and the group's total (`total`).
template <int W, bool REV, int N, typename T>
__device__ __forceinline__ void js_lanes_split(const T (&t)[N], T (&before)[N], T (&total)[N], T ident) {
  const int l = (threadIdx.x & 31) % W;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const T o = REV ? __shfl_down_sync(0xffffffffu, t[k], 1, W) : __shfl_up_sync(0xffffffffu, t[k], 1, W);
    before[k] = (REV ? l == W - 1 : l == 0) ? ident : o;
    total[k] = __shfl_sync(0xffffffffu, t[k], REV ? 0 : W - 1, W);
  }
}
// A row over NW warps: each warp's totals meet in `s` (this row's NW * N slots in shared memory);
// every lane adds the warps before its own (in scan order) to `before` and takes the row's totals.
// Every thread of the block calls it (two barriers).
template <int NW, bool REV, int N, typename T, typename Op>
__device__ __forceinline__ void js_warps_scan(T (&before)[N], T (&total)[N], T* s, int warp, T ident, Op op) {
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) s[warp * N + k] = total[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    T pre = ident, all = ident;
    for (int j = 0; j < NW; ++j) {
      const int w = REV ? NW - 1 - j : j;
      const T x = s[w * N + k];
      if (REV ? w > warp : w < warp) pre = op(pre, x);
      all = op(all, x);
    }
    before[k] = op(pre, before[k]);
    total[k] = all;
  }
  __syncthreads();  // before s is written again
}

// Butterfly all-reduce inside aligned groups of W lanes (W a power of two <= 32). Every lane ends
// with the same bits: each step combines the same pair of operands, and the ops are commutative.
template <int W, typename T, typename Op>
__device__ __forceinline__ T js_group_reduce(T x, Op op) {
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Online softmax partials (m, s): s is the sum of exp(x - m) over the elements folded so far. Partials
// merge at the largest max, each sum rescaled to it. A max of -inf (no element yet, or only -inf ones)
// shifts by 0: their terms are exp(-inf) = 0, never exp(-inf - -inf) = NaN.
__device__ __forceinline__ float js_lse_shift(float m) { return m == -JS_INF ? 0.0f : m; }
__device__ __forceinline__ void js_lse_combine(float& m, float& s, float m2, float s2) {
  const float mn = js_max(m, m2), sh = js_lse_shift(mn);
  s = s * expf(m - sh) + s2 * expf(m2 - sh);
  m = mn;
}
// Over aligned groups of W lanes: the group's max first, then each lane's sum rescaled to it (one exp
// per lane) and summed; every lane ends with the group's pair.
template <int W>
__device__ __forceinline__ void js_group_lse(float& m, float& s) {
  const float mx = js_group_reduce<W>(m, js_max_op());
  s = js_group_reduce<W>(s * expf(m - js_lse_shift(mx)), js_sum_op());
  m = mx;
}
// The pairs of the NW warps of a row (NW <= 32), from shared memory: lane j takes warp j's pair.
template <int NW>
__device__ __forceinline__ void js_warps_lse(float& m, float& s, const float* ms, const float* ss) {
  const int j = threadIdx.x & 31;
  m = j < NW ? ms[j] : -JS_INF;
  s = j < NW ? ss[j] : 0.0f;
  js_group_lse<32>(m, s);
}
// With weighted online sums (sums of g * exp(x - m) beside the sum of exp(x - m)) every sum is
// rescaled by the same factor: these give the factors, and move m to the larger max.
__device__ __forceinline__ void js_lse_rescale(float& m, float m2, float& f, float& f2) {
  const float mn = js_max(m, m2), sh = js_lse_shift(mn);
  f = expf(m - sh);
  f2 = expf(m2 - sh);
  m = mn;
}
template <int W>
__device__ __forceinline__ float js_group_rescale(float& m) {
  const float mx = js_group_reduce<W>(m, js_max_op());
  const float f = expf(m - js_lse_shift(mx));
  m = mx;
  return f;
}
// Lane j's view of warp j's partial among NW warps (NW <= 32), `empty` past them.
template <int NW>
__device__ __forceinline__ float js_warp_partial(const float* partials, float empty) {
  const int j = threadIdx.x & 31;
  return j < NW ? partials[j] : empty;
}

// (value, index) pairs for argmax/argmin: ties and NaNs resolve to the smallest index, like XLA.
// LATER: i2 is known to be larger than i (a thread's later element), so ties keep (v, i).
template <bool IS_MAX, bool LATER = false>
__device__ __forceinline__ void js_arg_combine(float& v, int& i, float v2, int i2) {
  const bool first = !LATER && i2 < i;
  bool nan1 = v != v, nan2 = v2 != v2;
  bool take;
  if (nan1 || nan2) take = nan2 && (!nan1 || first);
  else take = (IS_MAX ? v2 > v : v2 < v) || (v2 == v && first);
  if (take) { v = v2; i = i2; }
}
template <int W, bool IS_MAX>
__device__ __forceinline__ void js_group_arg_reduce(float& v, int& i) {
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) {
    float v2 = __shfl_xor_sync(0xffffffffu, v, o);
    int i2 = __shfl_xor_sync(0xffffffffu, i, o);
    js_arg_combine<IS_MAX>(v, i, v2, i2);
  }
}

// The grid barrier's state: globals of the loaded module, so zero when the launcher loads it, and left
// as found by every completed barrier (the arrivals wrap back to 0; the generation only grows). No
// launch needs a memset before it (which cost a launch ~1 us of GPU time and up to ~20 us of waiting
// for the kernel behind it, H100). The grid is cooperatively launched (all blocks co-resident); one
// module's launches run one after another on XLA's stream, never two at once.
__device__ unsigned int js_bar_arrived;
__device__ unsigned int js_bar_generation;

__device__ __forceinline__ unsigned int js_load_acquire(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The generation a launch starts at: read by each block at its start, where the load's latency hides
// (no barrier can complete before every block has arrived at it).
__device__ __forceinline__ unsigned int js_grid_generation() {
  return threadIdx.x == 0 ? js_load_acquire(&js_bar_generation) : 0u;
}

// An atomic increment (wrapping to 0 past `wrap`) with acquire and release semantics at GPU scope:
// the block's writes (ordered before it by __syncthreads) are released with the arrival, and the last
// arrival acquires every earlier one's, so no separate fence is needed (the long rows' kernel alone,
// H100: 0.6-1% faster than with __threadfence around atomicInc).
__device__ __forceinline__ unsigned int js_arrive(unsigned int* counter, unsigned int wrap) {
  unsigned int old;
  asm volatile("atom.acq_rel.gpu.inc.u32 %0, [%1], %2;" : "=r"(old) : "l"(counter), "r"(wrap) : "memory");
  return old;
}

// A barrier of `parties` blocks over one arrivals counter and one generation word; `generation`: the
// block's count of barriers opened there. The last block to arrive (the arrivals wrap back to 0)
// opens the next generation, which the others wait for. Readers of what other blocks wrote before
// the barrier load it with __ldcg (L2), never through a possibly stale L1 line.
__device__ __forceinline__ void js_barrier(unsigned int* arrived, unsigned int* opened, unsigned int parties,
                                           unsigned int& generation) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (js_arrive(arrived, parties - 1) == parties - 1) {
      asm volatile("st.release.gpu.u32 [%0], %1;" :: "l"(opened), "r"(generation + 1) : "memory");
    } else {
      while (js_load_acquire(opened) == generation) {}
    }
    ++generation;
  }
  __syncthreads();
}

// A grid-wide barrier (js_grid_generation gives a block its first `generation`).
__device__ __forceinline__ void js_grid_sync(unsigned int& generation) {
  js_barrier(&js_bar_arrived, &js_bar_generation, gridDim.x, generation);
}

// The barrier of one row's blocks: a row split over SPLITS blocks (blocks SPLITS * g .. SPLITS * g +
// SPLITS - 1 of row group g, in every round) combines its slices' partials, which only those blocks
// read, so they wait for each other and not for the grid: on an H100 a bfloat16 softmax fwd+bwd over
// 32 rows of 256k (256 blocks, 8 a row) took 26.1 us against 27.9 at a grid barrier (float32, 4 a
// row: the same). Counters by row group, as the grid barrier's: zero at load, left as found.
#define JS_ROW_GROUPS 2048
__device__ unsigned int js_group_arrived[JS_ROW_GROUPS];
__device__ unsigned int js_group_generation[JS_ROW_GROUPS];

__device__ __forceinline__ unsigned int js_row_group_generation(unsigned int group) {
  return threadIdx.x == 0 ? js_load_acquire(js_group_generation + group) : 0u;
}

__device__ __forceinline__ void js_row_group_sync(unsigned int group, unsigned int splits, unsigned int& generation) {
  js_barrier(js_group_arrived + group, js_group_generation + group, splits, generation);
}

// Copy COUNT elements from global to shared memory with the BLOCK threads working on one tile (the
// block's, or a warp's of a block of several tiles), `tid` this thread's index among them, element
// by element (the tile kernels' inputs that are no whole number of 16-byte pieces).
template <typename S, int COUNT, int BLOCK>
__device__ __forceinline__ void js_block_copy(S* __restrict__ dst, const S* __restrict__ src, int tid) {
  for (int i = tid; i < COUNT; i += BLOCK) dst[i] = src[i];
}
// The same copy into floats, converted on the way (a half-precision input stashed as float32).
template <typename S, int COUNT, int BLOCK>
__device__ __forceinline__ void js_block_copy_wide(float* __restrict__ dst, const S* __restrict__ src, int tid) {
  for (int i = tid; i < COUNT; i += BLOCK) dst[i] = js_io<S>::get(src[i]);
}
// The same copy started asynchronously (cp.async, evict-first in L2), when COUNT elements are a
// whole number of 16-byte pieces: it lands after js_stage_commit and js_stage_wait.
template <typename S, int COUNT, int BLOCK>
__device__ __forceinline__ void js_block_copy_async(S* __restrict__ dst, const S* __restrict__ src, int tid) {
  static_assert((COUNT * sizeof(S)) % 16 == 0, "js_block_copy_async copies 16-byte pieces");
  float* d = reinterpret_cast<float*>(dst);
  const float* s = reinterpret_cast<const float*>(src);
#pragma unroll 4
  for (int i = tid; i < (int)(COUNT * sizeof(S) / 16); i += BLOCK)
    js_stage<float, 4, true>(d + 4 * i, s + 4 * i, true);
}

// ---- end of the common helpers (kernels/cache.canonical renames value names only below this line)
