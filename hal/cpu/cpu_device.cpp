// The built-in CPU device: host memory, OpenBLAS sgemm, and loops written so that the compiler
// vectorises them at the project's default -O2.
//
// How the loops vectorise: GCC's -O2 cost model only vectorises a loop whose trip count is a known
// multiple of the vector width, so every elementwise loop runs over blocks of kW lanes (an inner
// loop of constant trip count, no branches, restrict pointers) with a scalar tail; -O3 vectorises
// those the same way. Reductions (sums, maxima) keep their partial results in 8-float vector values
// (GCC/Clang vector extensions), two per loop: that needs no -ffast-math reassociation, and unlike
// arrays of lane accumulators (fine at -O2) it survives -O3, which unrolls such arrays and then
// vectorises the outer loop with lane shuffles (layernorm_bwd measured 4x slower that way). On
// x86-64 GCC builds every kernel is cloned for x86-64-v3 (AVX2 + FMA) and a baseline, chosen once
// at load time (DT_KERNEL below), so one binary runs everywhere and uses AVX2 where it exists.
//
// Exponentials (softmax, GELU) use exp_approx(), a branch-free Cephes-style expf that vectorises;
// libm's expf / tanhf do not. Relative error is a few float ulps (see exp_approx).
//
// Failures: every entry validates its arguments before touching memory and returns
// DT_HAL_ERR_INVALID with a message in the context's last_error. No entry allocates except alloc
// and gemm_ex, which converts 16-bit operands into fp32 scratch kept (and grown) in the context.
//
// Version 2 (dt_hal_v2.h): bf16/fp16 are storage only, every 16-bit value is widened to fp32
// exactly, computed on in fp32 (OpenBLAS sgemm for gemm_ex) and rounded once on the way out. The
// CPU runs everything synchronously: streams and events are no-ops on dummy handles.
//
// Graph capture (graph_begin .. graph_end) records the calls the capturing thread makes instead of
// running them, with their arguments by value, and graph_launch runs the list again: what a CUDA
// graph does with kernel launches, and bound by the same rules, so code that captures correctly
// here captures correctly on a GPU. During a capture, work that reads or writes host memory
// (copies to or from the host, sum_squares' host result), waits for the device (synchronize,
// event_synchronize) or allocates is refused with DT_HAL_ERR_UNSUPPORTED and invalidates the
// capture, as CUDA does. Only the capturing thread's calls are recorded; other threads' calls run
// at once (on a GPU, work another thread puts on the capturing stream would join the graph, so
// dt captures only where no other thread uses the device).
// A recorded call's arguments are checked when the graph runs: a bad one fails graph_launch with
// the entry's own message. Replaying saves no time on a CPU; it is there so that the trainer's
// capture is tested on every machine.
//
// Built with DT_CPU_DEVICE_MEMORY (tests only: test-plugins/libdt_hal_devmem.so), the same kernels
// behave like a device whose memory the host cannot touch: alloc hands out pointers with bit 55
// set (non-canonical on x86-64, a kernel-half address on AArch64, so any host access faults at
// once) and every entry clears the bit before use. The table is named "devmem", so dt treats it as
// device memory (dt::Device::host_memory() is false) and must move data only through copy.
#include "cpu_device.h"

#include <cblas.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <new>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define DT_KERNEL __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define DT_KERNEL
#endif

#if defined(__GNUC__)
#define DT_INLINE inline __attribute__((always_inline))
#else
#define DT_INLINE inline
#endif

namespace {

// ---- context and errors -------------------------------------------------------------------------

constexpr size_t kErrorLen = 512;  // longer messages are truncated

// A captured graph: the recorded calls, in order.
struct Graph {
  std::vector<std::function<int(void*)>> ops;
};

struct Context {
  char error[kErrorLen] = "";
  float* scratch = nullptr;  // gemm_ex's fp32 copies of 16-bit operands
  size_t scratch_floats = 0;
  // Graph capture: the graph being recorded (null: none), the thread recording it, and the first
  // refused call's message once the capture is invalidated.
  std::atomic<Graph*> capture{nullptr};
  std::atomic<std::thread::id> capture_thread{};
  std::string capture_error;
  // Graphs captured and not destroyed. A CUDA graph holds the scratch pointers it was captured
  // with, so the scratch may not grow while one lives; the CPU device keeps that rule too.
  std::atomic<int> live_graphs{0};
  ~Context() {
    std::free(scratch);
    delete capture;
  }
};

// Errors raised without a usable context (open with a null out-pointer, a null ctx) land here;
// last_error(nullptr) returns it.
thread_local char t_orphan_error[kErrorLen] = "";

// Records the message (parts streamed in order) and returns status. Never throws: nothing may
// unwind through the C ABI, so a message that cannot be built is replaced by a fixed one.
template <class... A>
int fail(void* ctx, int status, const A&... parts) noexcept {
  char* slot = ctx != nullptr ? static_cast<Context*>(ctx)->error : t_orphan_error;
  try {
    std::ostringstream os;
    (os << ... << parts);
    std::snprintf(slot, kErrorLen, "%s", os.str().c_str());
  } catch (...) {
    std::snprintf(slot, kErrorLen, "%s", "out of memory while formatting an error message");
  }
  return status;
}

// Argument checks shared by the entries; each returns DT_HAL_OK or the failure it recorded.
#define DT_HAL_TRY(expr)                            \
  do {                                              \
    const int dt_hal_rc_ = (expr);                  \
    if (dt_hal_rc_ != DT_HAL_OK) return dt_hal_rc_; \
  } while (0)

int need_ctx(void* ctx, const char* fn) {
  if (ctx == nullptr) return fail(nullptr, DT_HAL_ERR_INVALID, fn, ": null context");
  return DT_HAL_OK;
}
int need_nonneg(void* ctx, const char* fn, const char* name, int64_t v) {
  if (v < 0) return fail(ctx, DT_HAL_ERR_INVALID, fn, ": ", name, " = ", v, " is negative");
  return DT_HAL_OK;
}
int need_ptr(void* ctx, const char* fn, const char* name, const void* p, int64_t count) {
  if (p == nullptr && count > 0)
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": ", name, " is null but ", count,
                " elements are needed");
  return DT_HAL_OK;
}
int need_heads(void* ctx, const char* fn, int64_t C, int64_t NH) {
  if (NH <= 0) return fail(ctx, DT_HAL_ERR_INVALID, fn, ": NH = ", NH, " must be positive");
  if (C % NH != 0)
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": NH = ", NH, " does not divide C = ", C);
  return DT_HAL_OK;
}

// ---- vectorisable building blocks ---------------------------------------------------------------

constexpr int kW = 16;  // lanes per block: two AVX registers or four SSE registers

// Eight floats (one AVX register; two SSE registers in the baseline clone). Passed by reference
// only: by value, GCC warns that the ABI depends on -mavx (-Wpsabi).
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef double f64x4 __attribute__((vector_size(32)));

DT_INLINE void load8(f32x8& v, const float* p) { std::memcpy(&v, p, sizeof v); }
DT_INLINE float hsum(const f32x8& v) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}
DT_INLINE void vmax(f32x8& m, const f32x8& v) { m = v > m ? v : m; }
DT_INLINE float hmax(const f32x8& v) {
  float m = v[0];
  for (int j = 1; j < 8; ++j) m = v[j] > m ? v[j] : m;
  return m;
}

// Sum of x[0..n).
DT_INLINE float row_sum(const float* __restrict x, int64_t n) {
  f32x8 a0 = {}, a1 = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    f32x8 v0, v1;
    load8(v0, x + i);
    load8(v1, x + i + 8);
    a0 += v0;
    a1 += v1;
  }
  a0 += a1;
  float s = hsum(a0);
  for (; i < n; ++i) s += x[i];
  return s;
}

// Maximum of x[0..n), n >= 1 (NaN entries may or may not win).
DT_INLINE float row_max(const float* __restrict x, int64_t n) {
  float m = x[0];
  int64_t i = 0;
  if (n >= 16) {
    f32x8 m0, m1;
    load8(m0, x);
    load8(m1, x + 8);
    for (; i + 16 <= n; i += 16) {
      f32x8 v0, v1;
      load8(v0, x + i);
      load8(v1, x + i + 8);
      vmax(m0, v0);
      vmax(m1, v1);
    }
    vmax(m0, m1);
    m = hmax(m0);
  }
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

DT_INLINE uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
DT_INLINE float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// e^x for x <= 0 (the only arguments used here), without branches so that loops calling it
// vectorise. Range reduction x = k ln2 + r, |r| <= ln2/2, by the 1.5*2^23 rounding trick with ln2
// split in two parts (Cody-Waite); Cephes' degree-6 minimax polynomial for e^r; 2^k built in the
// exponent bits. Relative error below 1.5 ulp (8.4e-8 measured) for x in [-87.3, 0]. Below that
// the result is +0 (true value under FLT_MIN: flushed, absolute error < 1.2e-38); -inf gives +0
// and NaN gives NaN. k is read from t's bits only while t is near kMagic: below -88 (where t
// falls under 2^23, and from -8.7e6 its bits no longer hold k) the result is +0 by x itself. Every
// select is a bit mask: a ?: on floats lets GCC's PRE split the loop body on the constant arm, and
// the loop no longer vectorises.
DT_INLINE float exp_approx(float x) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: x + kMagic rounds x to an integer
  const float t = x * 1.44269504088896341f + kMagic;
  const float k = t - kMagic;
  const int32_t ki = static_cast<int32_t>(bits_of(t) - bits_of(kMagic));  // k as an integer
  float r = x - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^k is a normal float (and x not below -88: NaN is kept)
  const uint32_t keep = 0u - static_cast<uint32_t>((ki >= -126) & !(x < -88.0f));
  const float res = p * float_of((static_cast<uint32_t>(ki) + 127u) << 23);
  return float_of(bits_of(res) & keep);
}

// c ? a : b as a bit mask (see exp_approx for why not ?:).
DT_INLINE float select(bool c, float a, float b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return float_of((bits_of(a) & mask) | (bits_of(b) & ~mask));
}

// out[i] = e^{x[i] - m} for i < n (out may be x); returns their sum. m >= every x[i].
DT_INLINE float exp_shifted(float* out, const float* x, float m, int64_t n) {
  f32x8 s0 = {}, s1 = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    float e[16];
    for (int j = 0; j < 16; ++j) e[j] = exp_approx(x[i + j] - m);
    std::memcpy(out + i, e, sizeof e);
    f32x8 e0, e1;
    load8(e0, e);
    load8(e1, e + 8);
    s0 += e0;
    s1 += e1;
  }
  s0 += s1;
  float s = hsum(s0);
  for (; i < n; ++i) {
    out[i] = exp_approx(x[i] - m);
    s += out[i];
  }
  return s;
}

// Sum over n of a[i] * b[i].
DT_INLINE float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  f32x8 s0 = {}, s1 = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    f32x8 a0, a1, b0, b1;
    load8(a0, a + i);
    load8(a1, a + i + 8);
    load8(b0, b + i);
    load8(b1, b + i + 8);
    s0 += a0 * b0;
    s1 += a1 * b1;
  }
  s0 += s1;
  float s = hsum(s0);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[i] += s * x[i]
DT_INLINE void axpy(float* __restrict y, float s, const float* __restrict x, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW)
    for (int j = 0; j < kW; ++j) y[i + j] += s * x[i + j];
  for (; i < n; ++i) y[i] += s * x[i];
}

// ---- device and memory --------------------------------------------------------------------------

int cpu_open(int index, void** ctx) {
  if (ctx == nullptr) return fail(nullptr, DT_HAL_ERR_INVALID, "open: ctx out-pointer is null");
  *ctx = nullptr;
  if (index != 0)
    return fail(nullptr, DT_HAL_ERR_INVALID, "open: device index ", index,
                " does not exist (the CPU device has only index 0)");
  auto* c = new (std::nothrow) Context();
  if (c == nullptr) return fail(nullptr, DT_HAL_ERR_NOMEM, "open: out of memory");
  // One BLAS thread per rank until set_threads says otherwise (ranks are bound one per core). Only
  // the first open in the process sets it, so a later context does not undo set_threads.
  static const bool single_thread = (openblas_set_num_threads(1), true);
  (void)single_thread;
  *ctx = c;
  return DT_HAL_OK;
}

void cpu_close(void* ctx) { delete static_cast<Context*>(ctx); }

const char* cpu_last_error(void* ctx) {
  if (ctx == nullptr) return t_orphan_error;
  return static_cast<Context*>(ctx)->error;
}

int cpu_device_count(int* count) {
  if (count == nullptr) return fail(nullptr, DT_HAL_ERR_INVALID, "device_count: count is null");
  *count = 1;
  return DT_HAL_OK;
}

int cpu_alloc(void* ctx, size_t bytes, void** ptr) {
  DT_HAL_TRY(need_ctx(ctx, "alloc"));
  if (ptr == nullptr) return fail(ctx, DT_HAL_ERR_INVALID, "alloc: ptr out-pointer is null");
  *ptr = nullptr;
  constexpr size_t kAlign = 64;
  if (bytes > std::numeric_limits<size_t>::max() - kAlign)
    return fail(ctx, DT_HAL_ERR_NOMEM, "alloc: ", bytes, " bytes is too large");
  // aligned_alloc wants a multiple of the alignment; 0 bytes still gets a distinct pointer.
  const size_t rounded = bytes == 0 ? kAlign : (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, rounded);
  if (p == nullptr)
    return fail(ctx, DT_HAL_ERR_NOMEM, "alloc: out of memory for ", bytes, " bytes");
  *ptr = p;
  return DT_HAL_OK;
}

void cpu_release(void*, void* ptr) { std::free(ptr); }

int cpu_copy(void* ctx, void* dst, const void* src, size_t bytes, dt_hal_copy_kind kind) {
  DT_HAL_TRY(need_ctx(ctx, "copy"));
  if (kind != DT_HAL_HOST_TO_DEVICE && kind != DT_HAL_DEVICE_TO_HOST &&
      kind != DT_HAL_DEVICE_TO_DEVICE)
    return fail(ctx, DT_HAL_ERR_INVALID, "copy: unknown copy kind ", static_cast<int>(kind));
  if (bytes == 0) return DT_HAL_OK;
  if (dst == nullptr || src == nullptr)
    return fail(ctx, DT_HAL_ERR_INVALID, "copy: ", dst == nullptr ? "dst" : "src",
                " is null for a copy of ", bytes, " bytes");
  // Host memory on both sides: every kind is one memmove (overlap allowed, no extra cost).
  std::memmove(dst, src, bytes);
  return DT_HAL_OK;
}

int cpu_fill_zero(void* ctx, void* dst, size_t bytes) {
  DT_HAL_TRY(need_ctx(ctx, "fill_zero"));
  if (bytes == 0) return DT_HAL_OK;
  if (dst == nullptr)
    return fail(ctx, DT_HAL_ERR_INVALID, "fill_zero: dst is null for ", bytes, " bytes");
  std::memset(dst, 0, bytes);
  return DT_HAL_OK;
}

int cpu_synchronize(void* ctx) { return need_ctx(ctx, "synchronize"); }

int cpu_set_threads(void* ctx, int threads) {
  DT_HAL_TRY(need_ctx(ctx, "set_threads"));
  if (threads < 1)
    return fail(ctx, DT_HAL_ERR_INVALID, "set_threads: threads = ", threads, " must be >= 1");
  // OpenBLAS keeps one process-wide setting: the last call wins for every context.
  openblas_set_num_threads(threads);
  return DT_HAL_OK;
}

// ---- dense algebra ------------------------------------------------------------------------------

// Argument checks of gemm and gemm_ex (messages start with fn). Sets *empty when there is nothing
// to compute (M or N is 0).
int check_gemm(void* ctx, const char* fn, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K,
               const void* A, int64_t lda, const void* B, int64_t ldb, const void* C, int64_t ldc,
               bool* empty) {
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "M", M));
  DT_HAL_TRY(need_nonneg(ctx, fn, "N", N));
  DT_HAL_TRY(need_nonneg(ctx, fn, "K", K));
  // Row-major: op(A) is M x K, stored K x M when transposed; lda is the stored row length.
  const int64_t a_cols = trans_a ? M : K, a_rows = trans_a ? K : M;
  const int64_t b_cols = trans_b ? K : N, b_rows = trans_b ? N : K;
  const auto max1 = [](int64_t v) { return v > 1 ? v : int64_t{1}; };
  if (lda < max1(a_cols))
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": lda = ", lda, " < ", max1(a_cols),
                trans_a ? " (A is K x M, transposed)" : " (A is M x K)");
  if (ldb < max1(b_cols))
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": ldb = ", ldb, " < ", max1(b_cols),
                trans_b ? " (B is N x K, transposed)" : " (B is K x N)");
  if (ldc < max1(N)) return fail(ctx, DT_HAL_ERR_INVALID, fn, ": ldc = ", ldc, " < ", max1(N));
  *empty = M == 0 || N == 0;
  if (*empty) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "C", C, M * N));
  if (K > 0) {
    DT_HAL_TRY(need_ptr(ctx, fn, "A", A, a_rows * a_cols));
    DT_HAL_TRY(need_ptr(ctx, fn, "B", B, b_rows * b_cols));
  }
  constexpr int64_t kBlasMax = std::numeric_limits<blasint>::max();
  if (M > kBlasMax || N > kBlasMax || K > kBlasMax || lda > kBlasMax || ldb > kBlasMax ||
      ldc > kBlasMax)
    return fail(ctx, DT_HAL_ERR_UNSUPPORTED, fn, ": a size or leading dimension exceeds ", kBlasMax,
                " (the BLAS integer)");
  return DT_HAL_OK;
}

int cpu_gemm(void* ctx, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
             const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
             int64_t ldc) {
  bool empty = false;
  DT_HAL_TRY(check_gemm(ctx, "gemm", trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc, &empty));
  if (empty) return DT_HAL_OK;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(M), static_cast<blasint>(N),
              static_cast<blasint>(K), alpha, A, static_cast<blasint>(lda), B,
              static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
  return DT_HAL_OK;
}

DT_KERNEL void bias_add_kernel(float* __restrict out, const float* __restrict bias, int64_t N,
                               int64_t C) {
  for (int64_t n = 0; n < N; ++n) axpy(out + n * C, 1.0f, bias, C);
}

int cpu_bias_add(void* ctx, float* out, const float* bias, int64_t N, int64_t C) {
  const char* fn = "bias_add";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "N", N));
  DT_HAL_TRY(need_nonneg(ctx, fn, "C", C));
  if (N == 0 || C == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, N * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "bias", bias, C));
  bias_add_kernel(out, bias, N, C);
  return DT_HAL_OK;
}

// Column sums over tiles of kTile columns: rows go into a float partial in blocks of kRows (so a
// float sum never spans more than kRows terms), partials into a double total per column.
DT_KERNEL void bias_grad_kernel(float* __restrict dbias, const float* __restrict dout, int64_t N,
                                int64_t C) {
  constexpr int64_t kTile = 256, kRows = 64;
  for (int64_t c0 = 0; c0 < C; c0 += kTile) {
    const int64_t w = C - c0 < kTile ? C - c0 : kTile;
    double total[kTile] = {};
    for (int64_t n0 = 0; n0 < N; n0 += kRows) {
      const int64_t n1 = N - n0 < kRows ? N : n0 + kRows;
      float part[kTile] = {};
      for (int64_t n = n0; n < n1; ++n) axpy(part, 1.0f, dout + n * C + c0, w);
      for (int64_t j = 0; j < kTile; ++j) total[j] += part[j];
    }
    for (int64_t j = 0; j < w; ++j) dbias[c0 + j] += static_cast<float>(total[j]);
  }
}

int cpu_bias_grad(void* ctx, float* dbias, const float* dout, int64_t N, int64_t C) {
  const char* fn = "bias_grad";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "N", N));
  DT_HAL_TRY(need_nonneg(ctx, fn, "C", C));
  if (N == 0 || C == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "dbias", dbias, C));
  DT_HAL_TRY(need_ptr(ctx, fn, "dout", dout, N * C));
  bias_grad_kernel(dbias, dout, N, C);
  return DT_HAL_OK;
}

// out may be a or b (an in-place residual add): each block is read before it is written.
DT_KERNEL void add_kernel(float* out, const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    float t[kW];
    for (int j = 0; j < kW; ++j) t[j] = a[i + j] + b[i + j];
    for (int j = 0; j < kW; ++j) out[i + j] = t[j];
  }
  for (; i < n; ++i) out[i] = a[i] + b[i];
}

int cpu_add(void* ctx, float* out, const float* a, const float* b, int64_t n) {
  const char* fn = "add";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "a", a, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "b", b, n));
  add_kernel(out, a, b, n);
  return DT_HAL_OK;
}

DT_KERNEL void scale_kernel(float* __restrict x, float s, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW)
    for (int j = 0; j < kW; ++j) x[i + j] *= s;
  for (; i < n; ++i) x[i] *= s;
}

int cpu_scale(void* ctx, float* x, float s, int64_t n) {
  const char* fn = "scale";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  DT_HAL_TRY(need_ptr(ctx, fn, "x", x, n));
  scale_kernel(x, s, n);
  return DT_HAL_OK;
}

// Squares are exact in double (24-bit significands), so only the additions round.
DT_KERNEL double sum_squares_kernel(const float* __restrict x, int64_t n) {
  f64x4 a0 = {}, a1 = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    f32x4 v0, v1;
    std::memcpy(&v0, x + i, sizeof v0);
    std::memcpy(&v1, x + i + 4, sizeof v1);
    const f64x4 d0 = __builtin_convertvector(v0, f64x4), d1 = __builtin_convertvector(v1, f64x4);
    a0 += d0 * d0;
    a1 += d1 * d1;
  }
  a0 += a1;
  double s = (a0[0] + a0[2]) + (a0[1] + a0[3]);
  for (; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

int cpu_sum_squares(void* ctx, const float* x, int64_t n, double* out) {
  const char* fn = "sum_squares";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  DT_HAL_TRY(need_ptr(ctx, fn, "x", x, n));
  if (out == nullptr) return fail(ctx, DT_HAL_ERR_INVALID, "sum_squares: out is null");
  *out = sum_squares_kernel(x, n);
  return DT_HAL_OK;
}

// ---- transformer layers -------------------------------------------------------------------------

DT_KERNEL void embedding_fwd_kernel(float* __restrict out, const int32_t* __restrict tokens,
                                    const float* __restrict wte, const float* __restrict wpe,
                                    int64_t B, int64_t T, int64_t C) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      float* __restrict o = out + (b * T + t) * C;
      const float* __restrict e = wte + static_cast<int64_t>(tokens[b * T + t]) * C;
      const float* __restrict p = wpe + t * C;
      int64_t i = 0;
      for (; i + kW <= C; i += kW)
        for (int j = 0; j < kW; ++j) o[i + j] = e[i + j] + p[i + j];
      for (; i < C; ++i) o[i] = e[i] + p[i];
    }
}

int cpu_embedding_fwd(void* ctx, float* out, const int32_t* tokens, const float* wte,
                      const float* wpe, int64_t B, int64_t T, int64_t C, int64_t V) {
  const char* fn = "embedding_fwd";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "B", B));
  DT_HAL_TRY(need_nonneg(ctx, fn, "T", T));
  DT_HAL_TRY(need_nonneg(ctx, fn, "C", C));
  DT_HAL_TRY(need_nonneg(ctx, fn, "V", V));
  if (B * T == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "tokens", tokens, B * T));
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, B * T * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "wte", wte, V * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "wpe", wpe, T * C));
  for (int64_t i = 0; i < B * T; ++i)
    if (tokens[i] < 0 || tokens[i] >= V)
      return fail(ctx, DT_HAL_ERR_INVALID, "embedding_fwd: token ", tokens[i], " at position ", i,
                  " (b = ", i / T, ", t = ", i % T, ") is outside [0, V = ", V, ")");
  embedding_fwd_kernel(out, tokens, wte, wpe, B, T, C);
  return DT_HAL_OK;
}

DT_KERNEL void embedding_bwd_kernel(float* __restrict dwte, float* __restrict dwpe,
                                    const float* __restrict dout, const int32_t* __restrict tokens,
                                    int64_t B, int64_t T, int64_t C) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const float* __restrict d = dout + (b * T + t) * C;
      float* __restrict e = dwte + static_cast<int64_t>(tokens[b * T + t]) * C;
      float* __restrict p = dwpe + t * C;
      int64_t i = 0;
      for (; i + kW <= C; i += kW)
        for (int j = 0; j < kW; ++j) {
          e[i + j] += d[i + j];
          p[i + j] += d[i + j];
        }
      for (; i < C; ++i) {
        e[i] += d[i];
        p[i] += d[i];
      }
    }
}

int cpu_embedding_bwd(void* ctx, float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                      int64_t B, int64_t T, int64_t C) {
  const char* fn = "embedding_bwd";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "B", B));
  DT_HAL_TRY(need_nonneg(ctx, fn, "T", T));
  DT_HAL_TRY(need_nonneg(ctx, fn, "C", C));
  if (B * T == 0 || C == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "tokens", tokens, B * T));
  DT_HAL_TRY(need_ptr(ctx, fn, "dout", dout, B * T * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "dwte", dwte, C));
  DT_HAL_TRY(need_ptr(ctx, fn, "dwpe", dwpe, T * C));
  // V is not passed here: only the lower bound can be checked (the forward checked both).
  for (int64_t i = 0; i < B * T; ++i)
    if (tokens[i] < 0)
      return fail(ctx, DT_HAL_ERR_INVALID, "embedding_bwd: token ", tokens[i], " at position ", i,
                  " (b = ", i / T, ", t = ", i % T, ") is negative");
  embedding_bwd_kernel(dwte, dwpe, dout, tokens, B, T, C);
  return DT_HAL_OK;
}

DT_KERNEL void layernorm_fwd_kernel(float* __restrict out, float* __restrict mean,
                                    float* __restrict rstd, const float* __restrict inp,
                                    const float* __restrict w, const float* __restrict b, int64_t N,
                                    int64_t C) {
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int64_t n = 0; n < N; ++n) {
    const float* __restrict x = inp + n * C;
    float* __restrict o = out + n * C;
    const float m = row_sum(x, C) * inv_c;
    // Second pass over the row (in L1) for the variance: no cancellation of E[x^2] - m^2.
    f32x8 v0 = {}, v1 = {};
    int64_t i = 0;
    for (; i + 16 <= C; i += 16) {
      f32x8 x0, x1;
      load8(x0, x + i);
      load8(x1, x + i + 8);
      x0 -= m;
      x1 -= m;
      v0 += x0 * x0;
      v1 += x1 * x1;
    }
    v0 += v1;
    float v = hsum(v0);
    for (; i < C; ++i) v += (x[i] - m) * (x[i] - m);
    const float rs = 1.0f / std::sqrt(v * inv_c + 1e-5f);
    i = 0;
    for (; i + kW <= C; i += kW)
      for (int j = 0; j < kW; ++j) o[i + j] = (x[i + j] - m) * rs * w[i + j] + b[i + j];
    for (; i < C; ++i) o[i] = (x[i] - m) * rs * w[i] + b[i];
    mean[n] = m;
    rstd[n] = rs;
  }
}

int cpu_layernorm_fwd(void* ctx, float* out, float* mean, float* rstd, const float* inp,
                      const float* w, const float* b, int64_t N, int64_t C) {
  const char* fn = "layernorm_fwd";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "N", N));
  DT_HAL_TRY(need_nonneg(ctx, fn, "C", C));
  if (N == 0) return DT_HAL_OK;
  if (C == 0) return fail(ctx, DT_HAL_ERR_INVALID, "layernorm_fwd: C = 0 (empty rows)");
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, N * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "mean", mean, N));
  DT_HAL_TRY(need_ptr(ctx, fn, "rstd", rstd, N));
  DT_HAL_TRY(need_ptr(ctx, fn, "inp", inp, N * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "w", w, C));
  DT_HAL_TRY(need_ptr(ctx, fn, "b", b, C));
  layernorm_fwd_kernel(out, mean, rstd, inp, w, b, N, C);
  return DT_HAL_OK;
}

// llm.c's layernorm_backward: with xh = (x - mean) rstd and g = w * dout,
// dx = rstd (g - mean(g) - xh mean(g xh)); db += dout; dw += xh dout.
DT_KERNEL void layernorm_bwd_kernel(float* __restrict dinp, float* __restrict dw,
                                    float* __restrict db, const float* __restrict dout,
                                    const float* __restrict inp, const float* __restrict w,
                                    const float* __restrict mean, const float* __restrict rstd,
                                    int64_t N, int64_t C) {
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int64_t n = 0; n < N; ++n) {
    const float* __restrict x = inp + n * C;
    const float* __restrict d = dout + n * C;
    float* __restrict dx = dinp + n * C;
    const float m = mean[n], rs = rstd[n];
    f32x8 ag = {}, agx = {};
    int64_t i = 0;
    for (; i + 8 <= C; i += 8) {
      f32x8 wv, dv, xv;
      load8(wv, w + i);
      load8(dv, d + i);
      load8(xv, x + i);
      const f32x8 g = wv * dv;
      ag += g;
      agx += g * ((xv - m) * rs);
    }
    float sg = hsum(ag), sgx = hsum(agx);
    for (; i < C; ++i) {
      const float g = w[i] * d[i];
      sg += g;
      sgx += g * ((x[i] - m) * rs);
    }
    const float mg = sg * inv_c, mgx = sgx * inv_c;
    i = 0;
    for (; i + kW <= C; i += kW)
      for (int j = 0; j < kW; ++j) {
        const float xh = (x[i + j] - m) * rs;
        db[i + j] += d[i + j];
        dw[i + j] += xh * d[i + j];
        dx[i + j] += (w[i + j] * d[i + j] - mg - xh * mgx) * rs;
      }
    for (; i < C; ++i) {
      const float xh = (x[i] - m) * rs;
      db[i] += d[i];
      dw[i] += xh * d[i];
      dx[i] += (w[i] * d[i] - mg - xh * mgx) * rs;
    }
  }
}

int cpu_layernorm_bwd(void* ctx, float* dinp, float* dw, float* db, const float* dout,
                      const float* inp, const float* w, const float* mean, const float* rstd,
                      int64_t N, int64_t C) {
  const char* fn = "layernorm_bwd";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "N", N));
  DT_HAL_TRY(need_nonneg(ctx, fn, "C", C));
  if (N == 0 || C == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "dinp", dinp, N * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "dw", dw, C));
  DT_HAL_TRY(need_ptr(ctx, fn, "db", db, C));
  DT_HAL_TRY(need_ptr(ctx, fn, "dout", dout, N * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "inp", inp, N * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "w", w, C));
  DT_HAL_TRY(need_ptr(ctx, fn, "mean", mean, N));
  DT_HAL_TRY(need_ptr(ctx, fn, "rstd", rstd, N));
  layernorm_bwd_kernel(dinp, dw, db, dout, inp, w, mean, rstd, N, C);
  return DT_HAL_OK;
}

// GELU(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), evaluated as x * s with
// s = 0.5 (1 + tanh u) = 1 / (1 + e^{-2u}): the same function, without the cancellation of
// 1 + tanh(u) for u < 0.
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluA = 0.044715f;

// With e = e^{-2|u|} (never overflows) and sp = 1 / (1 + e): s = sp for u >= 0, e sp for u < 0.
DT_INLINE float gelu_one(float x) {
  const float u = kGeluK * (x + kGeluA * x * x * x);
  const float e = exp_approx(-2.0f * std::fabs(u));
  const float sp = 1.0f / (1.0f + e);
  return x * select(u >= 0.0f, sp, e * sp);
}

// d/dx GELU = s + 2 x s (1 - s) u'(x), and s (1 - s) = e sp^2 for either sign of u. The second
// term is 0 where e is (|u| above 44): x^2 may be +inf there (|x| above 1.8e19), and 0 * inf NaN.
DT_INLINE float gelu_grad_one(float x) {
  const float x2 = x * x;
  const float u = kGeluK * (x + kGeluA * x2 * x);
  const float e = exp_approx(-2.0f * std::fabs(u));
  const float sp = 1.0f / (1.0f + e);
  const float s = select(u >= 0.0f, sp, e * sp);
  return s +
         select(e > 0.0f, 2.0f * x * (e * sp * sp) * kGeluK * (1.0f + 3.0f * kGeluA * x2), 0.0f);
}

// out may be inp (each block is read before it is written).
DT_KERNEL void gelu_fwd_kernel(float* out, const float* inp, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    float t[kW];
    for (int j = 0; j < kW; ++j) t[j] = gelu_one(inp[i + j]);
    std::memcpy(out + i, t, sizeof t);
  }
  for (; i < n; ++i) out[i] = gelu_one(inp[i]);
}

DT_KERNEL void gelu_bwd_kernel(float* __restrict dinp, const float* __restrict inp,
                               const float* __restrict dout, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW)
    for (int j = 0; j < kW; ++j) dinp[i + j] += dout[i + j] * gelu_grad_one(inp[i + j]);
  for (; i < n; ++i) dinp[i] += dout[i] * gelu_grad_one(inp[i]);
}

int cpu_gelu_fwd(void* ctx, float* out, const float* inp, int64_t n) {
  const char* fn = "gelu_fwd";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "inp", inp, n));
  gelu_fwd_kernel(out, inp, n);
  return DT_HAL_OK;
}

int cpu_gelu_bwd(void* ctx, float* dinp, const float* inp, const float* dout, int64_t n) {
  const char* fn = "gelu_bwd";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  DT_HAL_TRY(need_ptr(ctx, fn, "dinp", dinp, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "inp", inp, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "dout", dout, n));
  gelu_bwd_kernel(dinp, inp, dout, n);
  return DT_HAL_OK;
}

// ---- attention ----------------------------------------------------------------------------------

// Softmax of row[0..len) in place (len >= 1), then zeros in row[len..T).
DT_INLINE void softmax_causal_row(float* __restrict row, int64_t len, int64_t T) {
  const float s = exp_shifted(row, row, row_max(row, len), len);
  const float inv = 1.0f / s;
  int64_t i = 0;
  for (; i + kW <= len; i += kW)
    for (int j = 0; j < kW; ++j) row[i + j] *= inv;
  for (; i < len; ++i) row[i] *= inv;
  for (i = len; i < T; ++i) row[i] = 0.0f;
}

// In place: d[i] = scale * a[i] * (d[i] - sum_j a[j] d[j]) for i < len, then zeros in d[len..T).
DT_INLINE void softmax_bwd_row(float* __restrict d, const float* __restrict a, int64_t len,
                               int64_t T, float scale) {
  const float s = dot(a, d, len);
  int64_t i = 0;
  for (; i + kW <= len; i += kW)
    for (int j = 0; j < kW; ++j) d[i + j] = scale * a[i + j] * (d[i + j] - s);
  for (; i < len; ++i) d[i] = scale * a[i] * (d[i] - s);
  for (i = len; i < T; ++i) d[i] = 0.0f;
}

// Head h of batch entry b in a [B, T, 3C] tensor (q, k and v side by side, rows of 3C): where its
// q, k and v columns start.
template <class F>
struct HeadQkv {
  F *q, *k, *v;
};
template <class F>
DT_INLINE HeadQkv<F> head_qkv(F* base, int64_t b, int64_t h, int64_t T, int64_t C, int64_t hs) {
  F* q = base + b * T * 3 * C + h * hs;
  return {q, q + C, q + 2 * C};
}

// Attention runs on sgemm per (b, head): rows of the causal score matrix go in blocks of
// kAttnBlock queries, and block [r0, r1) needs keys [0, r1) only, so each GEMM skips the masked
// columns right of its diagonal block. Measured at T = 128, hs = 64 (gpt-tiny, 64 heads, one
// thread): fwd + bwd 13.9 ms with 32-row blocks, 14.3 (16 rows), 14.5 (64), 16.6 (one T x T GEMM,
// no skipping); per-score vectorised loops (dot products and axpys) were 4-5x slower than GEMM.
constexpr int64_t kAttnBlock = 32;

// out[i] = in[i] rounded to type t and widened back (exact for F32; in == out allowed).
void round_copy(float* out, const float* in, int64_t n, dt_hal_dtype t);
bool known_dtype(dt_hal_dtype t);
// The context's fp32 scratch, at least `floats` long.
int scratch(void* ctx, const char* fn, size_t floats, float** out);

void sgemm_rm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
              int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K), alpha, A,
              static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C,
              static_cast<blasint>(ldc));
}

// Per (b, h), with Q, K, V the T x hs slices of qkv (row stride 3C) and A the T x T block of att:
// A = softmax(scale Q K^T) on the causal part, zeros above; out slice (row stride C) = A V.
// With `lp` (kAttnBlock x T floats; attention_fwd_ex in a 16-bit type, qkv already rounded), each
// row block of A is rounded into lp for the product A V; A itself keeps the fp32 probabilities.
DT_KERNEL void attention_fwd_kernel(float* out, float* att, const float* qkv, int64_t B, int64_t T,
                                    int64_t C, int64_t NH, dt_hal_dtype dtype, float* lp) {
  const int64_t hs = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h) {
      const auto [q, k, v] = head_qkv(qkv, b, h, T, C, hs);
      float* A = att + (b * NH + h) * T * T;
      float* o = out + b * T * C + h * hs;
      for (int64_t r0 = 0; r0 < T; r0 += kAttnBlock) {
        const int64_t r1 = T - r0 < kAttnBlock ? T : r0 + kAttnBlock;
        sgemm_rm(false, true, r1 - r0, r1, hs, scale, q + r0 * C3, C3, k, C3, 0.0f, A + r0 * T, T);
        for (int64_t t = r0; t < r1; ++t) softmax_causal_row(A + t * T, t + 1, T);
        const float* P = A + r0 * T;
        if (lp != nullptr) {
          for (int64_t t = r0; t < r1; ++t) round_copy(lp + (t - r0) * T, A + t * T, r1, dtype);
          P = lp;
        }
        sgemm_rm(false, false, r1 - r0, hs, r1, 1.0f, P, T, v, C3, 0.0f, o + r0 * C, C);
      }
    }
}

int check_attention(void* ctx, const char* fn, int64_t B, int64_t T, int64_t C, int64_t NH) {
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "B", B));
  DT_HAL_TRY(need_nonneg(ctx, fn, "T", T));
  DT_HAL_TRY(need_nonneg(ctx, fn, "C", C));
  DT_HAL_TRY(need_heads(ctx, fn, C, NH));
  if (C == 0) return fail(ctx, DT_HAL_ERR_INVALID, fn, ": C = 0 (heads of size 0)");
  constexpr int64_t kBlasMax = std::numeric_limits<blasint>::max();
  if (T > kBlasMax || 3 * C > kBlasMax)
    return fail(ctx, DT_HAL_ERR_UNSUPPORTED, fn, ": T = ", T, " or 3C = ", 3 * C, " exceeds ",
                kBlasMax, " (the BLAS integer)");
  return DT_HAL_OK;
}

// attention_fwd, and attention_fwd_ex (ABI version 3) with its products in `dtype`: the 16-bit
// forms round qkv into the context's scratch and run the same kernel on the rounded copy, with the
// probabilities rounded where the product att v takes them. fn names the entry in errors.
int attention_fwd_entry(void* ctx, const char* fn, float* out, float* att, const float* qkv,
                        int64_t B, int64_t T, int64_t C, int64_t NH, dt_hal_dtype dtype) {
  DT_HAL_TRY(check_attention(ctx, fn, B, T, C, NH));
  if (!known_dtype(dtype))
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": unknown dtype ", static_cast<int>(dtype));
  if (B * T == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, B * T * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "att", att, B * NH * T * T));
  DT_HAL_TRY(need_ptr(ctx, fn, "qkv", qkv, B * T * 3 * C));
  if (dtype == DT_HAL_F32) {
    attention_fwd_kernel(out, att, qkv, B, T, C, NH, dtype, nullptr);
    return DT_HAL_OK;
  }
  const int64_t nqkv = B * T * 3 * C;
  float* s = nullptr;
  DT_HAL_TRY(scratch(ctx, fn, static_cast<size_t>(nqkv + kAttnBlock * T), &s));
  round_copy(s, qkv, nqkv, dtype);
  attention_fwd_kernel(out, att, s, B, T, C, NH, dtype, s + nqkv);
  return DT_HAL_OK;
}

int cpu_attention_fwd(void* ctx, float* out, float* att, const float* qkv, int64_t B, int64_t T,
                      int64_t C, int64_t NH) {
  return attention_fwd_entry(ctx, "attention_fwd", out, att, qkv, B, T, C, NH, DT_HAL_F32);
}
int cpu_attention_fwd_ex(void* ctx, float* out, float* att, const float* qkv, int64_t B, int64_t T,
                         int64_t C, int64_t NH, dt_hal_dtype dtype) {
  return attention_fwd_entry(ctx, "attention_fwd_ex", out, att, qkv, B, T, C, NH, dtype);
}

// Per (b, h), with dO the T x hs slice of dout and S the T x T block of scratch:
// S = dO V^T (causal part); dV += A^T dO; S = scale * A * (S - rowsum(A * S)) (softmax backward,
// zeros above the diagonal); dQ += S K; dK += S^T Q. Row block [r0, r1) of A and S has no
// non-zero right of column r1, and column block [r0, r1) none above row r0, so every GEMM skips the
// masked triangle outside its diagonal block.
// With `lp` (T x T floats; attention_bwd_ex in a 16-bit type, dout and qkv already rounded), the
// product A^T dO takes A rounded into lp, and S is rounded in place once the softmax backward,
// which reads the fp32 A, has made it.
DT_KERNEL void attention_bwd_kernel(float* dqkv, float* scratch, const float* dout,
                                    const float* qkv, const float* att, int64_t B, int64_t T,
                                    int64_t C, int64_t NH, dt_hal_dtype dtype, float* lp) {
  const int64_t hs = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h) {
      const auto [q, k, v] = head_qkv(qkv, b, h, T, C, hs);
      const auto [dq, dk, dv] = head_qkv(dqkv, b, h, T, C, hs);
      const float* dO = dout + b * T * C + h * hs;
      const float* A = att + (b * NH + h) * T * T;
      const float* Ap = A;  // A as the product A^T dO takes it
      if (lp != nullptr) {
        round_copy(lp, A, T * T, dtype);
        Ap = lp;
      }
      float* S = scratch + (b * NH + h) * T * T;
      for (int64_t r0 = 0; r0 < T; r0 += kAttnBlock) {
        const int64_t r1 = T - r0 < kAttnBlock ? T : r0 + kAttnBlock;
        sgemm_rm(false, true, r1 - r0, r1, hs, 1.0f, dO + r0 * C, C, v, C3, 0.0f, S + r0 * T, T);
        sgemm_rm(true, false, r1 - r0, hs, T - r0, 1.0f, Ap + r0 * T + r0, T, dO + r0 * C, C, 1.0f,
                 dv + r0 * C3, C3);
        for (int64_t t = r0; t < r1; ++t) softmax_bwd_row(S + t * T, A + t * T, t + 1, T, scale);
        if (lp != nullptr) round_copy(S + r0 * T, S + r0 * T, (r1 - r0) * T, dtype);
        sgemm_rm(false, false, r1 - r0, hs, r1, 1.0f, S + r0 * T, T, k, C3, 1.0f, dq + r0 * C3, C3);
      }
      for (int64_t r0 = 0; r0 < T; r0 += kAttnBlock) {
        const int64_t r1 = T - r0 < kAttnBlock ? T : r0 + kAttnBlock;
        sgemm_rm(true, false, r1 - r0, hs, T - r0, 1.0f, S + r0 * T + r0, T, q + r0 * C3, C3, 1.0f,
                 dk + r0 * C3, C3);
      }
    }
}

// attention_bwd, and attention_bwd_ex with its products in `dtype` (qkv and dout rounded into the
// context's scratch, with room for the rounded probabilities).
int attention_bwd_entry(void* ctx, const char* fn, float* dqkv, float* scratch_tt,
                        const float* dout, const float* qkv, const float* att, int64_t B, int64_t T,
                        int64_t C, int64_t NH, dt_hal_dtype dtype) {
  DT_HAL_TRY(check_attention(ctx, fn, B, T, C, NH));
  if (!known_dtype(dtype))
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": unknown dtype ", static_cast<int>(dtype));
  if (B * T == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "dqkv", dqkv, B * T * 3 * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "scratch", scratch_tt, B * NH * T * T));
  DT_HAL_TRY(need_ptr(ctx, fn, "dout", dout, B * T * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "qkv", qkv, B * T * 3 * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "att", att, B * NH * T * T));
  if (dtype == DT_HAL_F32) {
    attention_bwd_kernel(dqkv, scratch_tt, dout, qkv, att, B, T, C, NH, dtype, nullptr);
    return DT_HAL_OK;
  }
  const int64_t nqkv = B * T * 3 * C, nout = B * T * C;
  float* s = nullptr;
  DT_HAL_TRY(scratch(ctx, fn, static_cast<size_t>(nqkv + nout + T * T), &s));
  round_copy(s, qkv, nqkv, dtype);
  round_copy(s + nqkv, dout, nout, dtype);
  attention_bwd_kernel(dqkv, scratch_tt, s + nqkv, s, att, B, T, C, NH, dtype, s + nqkv + nout);
  return DT_HAL_OK;
}

int cpu_attention_bwd(void* ctx, float* dqkv, float* scratch_tt, const float* dout,
                      const float* qkv, const float* att, int64_t B, int64_t T, int64_t C,
                      int64_t NH) {
  return attention_bwd_entry(ctx, "attention_bwd", dqkv, scratch_tt, dout, qkv, att, B, T, C, NH,
                             DT_HAL_F32);
}
int cpu_attention_bwd_ex(void* ctx, float* dqkv, float* scratch_tt, const float* dout,
                         const float* qkv, const float* att, int64_t B, int64_t T, int64_t C,
                         int64_t NH, dt_hal_dtype dtype) {
  return attention_bwd_entry(ctx, "attention_bwd_ex", dqkv, scratch_tt, dout, qkv, att, B, T, C, NH,
                             dtype);
}

// ---- softmax cross-entropy ----------------------------------------------------------------------

// Per row: max, e = exp(x - max) into probs with their sum, probs *= 1/sum; the loss is
// log(sum) - (x_target - max), which stays finite when probs[target] underflows.
DT_KERNEL void softmax_xent_fwd_kernel(float* __restrict losses, float* __restrict probs,
                                       const float* __restrict logits,
                                       const int32_t* __restrict targets, int64_t N, int64_t V) {
  for (int64_t n = 0; n < N; ++n) {
    const float* __restrict x = logits + n * V;
    float* __restrict p = probs + n * V;
    const float m = row_max(x, V);
    const float s = exp_shifted(p, x, m, V);
    const float inv = 1.0f / s;
    int64_t i = 0;
    for (; i + kW <= V; i += kW)
      for (int j = 0; j < kW; ++j) p[i + j] *= inv;
    for (; i < V; ++i) p[i] *= inv;
    losses[n] = std::log(s) - (x[targets[n]] - m);
  }
}

int check_targets(void* ctx, const char* fn, const int32_t* targets, int64_t N, int64_t V) {
  for (int64_t n = 0; n < N; ++n)
    if (targets[n] < 0 || targets[n] >= V)
      return fail(ctx, DT_HAL_ERR_INVALID, fn, ": target ", targets[n], " at row ", n,
                  " is outside [0, V = ", V, ")");
  return DT_HAL_OK;
}

int cpu_softmax_xent_fwd(void* ctx, float* losses, float* probs, const float* logits,
                         const int32_t* targets, int64_t N, int64_t V) {
  const char* fn = "softmax_xent_fwd";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "N", N));
  DT_HAL_TRY(need_nonneg(ctx, fn, "V", V));
  if (N == 0) return DT_HAL_OK;
  if (V == 0) return fail(ctx, DT_HAL_ERR_INVALID, "softmax_xent_fwd: V = 0 (no classes)");
  DT_HAL_TRY(need_ptr(ctx, fn, "losses", losses, N));
  DT_HAL_TRY(need_ptr(ctx, fn, "probs", probs, N * V));
  DT_HAL_TRY(need_ptr(ctx, fn, "logits", logits, N * V));
  DT_HAL_TRY(need_ptr(ctx, fn, "targets", targets, N));
  DT_HAL_TRY(check_targets(ctx, fn, targets, N, V));
  softmax_xent_fwd_kernel(losses, probs, logits, targets, N, V);
  return DT_HAL_OK;
}

// dlogits may be probs (the target entry is read before the row is overwritten).
DT_KERNEL void softmax_xent_bwd_kernel(float* dlogits, const float* probs,
                                       const int32_t* __restrict targets, float dloss, int64_t N,
                                       int64_t V) {
  for (int64_t n = 0; n < N; ++n) {
    float* d = dlogits + n * V;
    const float* p = probs + n * V;
    const float dt = (p[targets[n]] - 1.0f) * dloss;
    int64_t i = 0;
    for (; i + kW <= V; i += kW) {
      float t[kW];
      for (int j = 0; j < kW; ++j) t[j] = p[i + j] * dloss;
      std::memcpy(d + i, t, sizeof t);
    }
    for (; i < V; ++i) d[i] = p[i] * dloss;
    d[targets[n]] = dt;
  }
}

int cpu_softmax_xent_bwd(void* ctx, float* dlogits, const float* probs, const int32_t* targets,
                         float dloss, int64_t N, int64_t V) {
  const char* fn = "softmax_xent_bwd";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "N", N));
  DT_HAL_TRY(need_nonneg(ctx, fn, "V", V));
  if (N == 0) return DT_HAL_OK;
  if (V == 0) return fail(ctx, DT_HAL_ERR_INVALID, "softmax_xent_bwd: V = 0 (no classes)");
  DT_HAL_TRY(need_ptr(ctx, fn, "dlogits", dlogits, N * V));
  DT_HAL_TRY(need_ptr(ctx, fn, "probs", probs, N * V));
  DT_HAL_TRY(need_ptr(ctx, fn, "targets", targets, N));
  DT_HAL_TRY(check_targets(ctx, fn, targets, N, V));
  softmax_xent_bwd_kernel(dlogits, probs, targets, dloss, N, V);
  return DT_HAL_OK;
}

// ---- optimiser and casts ------------------------------------------------------------------------

// Three passes over each block of kW: the first and last vectorise; sqrt sits alone in the middle
// because, with errno semantics (no -ffast-math), GCC will not vectorise a loop calling it. That
// split made the update 1.6x faster (10.5 -> 6.7 ms for 3.3 M parameters: memory bound now).
DT_KERNEL void adamw_kernel(float* __restrict p, const float* __restrict g, float* __restrict m,
                            float* __restrict v, int64_t n, float lr, float b1, float b2, float eps,
                            float wd, float inv_bc1, float inv_bc2) {
  const float c1 = 1.0f - b1, c2 = 1.0f - b2;
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    float den[kW];
    for (int j = 0; j < kW; ++j) {
      const float mi = b1 * m[i + j] + c1 * g[i + j];
      const float vi = b2 * v[i + j] + c2 * g[i + j] * g[i + j];
      m[i + j] = mi;
      v[i + j] = vi;
      den[j] = vi * inv_bc2;
    }
    for (int j = 0; j < kW; ++j) den[j] = std::sqrt(den[j]) + eps;
    for (int j = 0; j < kW; ++j) p[i + j] -= lr * ((m[i + j] * inv_bc1) / den[j] + wd * p[i + j]);
  }
  for (; i < n; ++i) {
    const float mi = b1 * m[i] + c1 * g[i];
    const float vi = b2 * v[i] + c2 * g[i] * g[i];
    m[i] = mi;
    v[i] = vi;
    p[i] -= lr * ((mi * inv_bc1) / (std::sqrt(vi * inv_bc2) + eps) + wd * p[i]);
  }
}

int cpu_adamw(void* ctx, float* params, const float* grads, float* m, float* v, int64_t n, float lr,
              float beta1, float beta2, float eps, float weight_decay, int64_t t) {
  const char* fn = "adamw";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  if (t < 1) return fail(ctx, DT_HAL_ERR_INVALID, "adamw: step t = ", t, " must be >= 1");
  if (!(beta1 >= 0.0f && beta1 < 1.0f) || !(beta2 >= 0.0f && beta2 < 1.0f))
    return fail(ctx, DT_HAL_ERR_INVALID, "adamw: beta1 = ", beta1, ", beta2 = ", beta2,
                " must lie in [0, 1)");
  DT_HAL_TRY(need_ptr(ctx, fn, "params", params, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "grads", grads, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "m", m, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "v", v, n));
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(t));
  adamw_kernel(params, grads, m, v, n, lr, beta1, beta2, eps, weight_decay,
               static_cast<float>(1.0 / bc1), static_cast<float>(1.0 / bc2));
  return DT_HAL_OK;
}

// Round to nearest even on the 16 dropped bits (a carry into the exponent gives Inf correctly);
// NaN keeps sign and payload top bits and is made quiet.
DT_INLINE uint16_t bf16_of(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

DT_KERNEL void f32_to_bf16_kernel(uint16_t* __restrict out, const float* __restrict in, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW)
    for (int j = 0; j < kW; ++j) out[i + j] = bf16_of(in[i + j]);
  for (; i < n; ++i) out[i] = bf16_of(in[i]);
}

DT_KERNEL void bf16_to_f32_kernel(float* __restrict out, const uint16_t* __restrict in, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW)
    for (int j = 0; j < kW; ++j) out[i + j] = float_of(static_cast<uint32_t>(in[i + j]) << 16);
  for (; i < n; ++i) out[i] = float_of(static_cast<uint32_t>(in[i]) << 16);
}

int cpu_cast_f32_to_bf16(void* ctx, uint16_t* out, const float* in, int64_t n) {
  const char* fn = "cast_f32_to_bf16";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "in", in, n));
  f32_to_bf16_kernel(out, in, n);
  return DT_HAL_OK;
}

int cpu_cast_bf16_to_f32(void* ctx, float* out, const uint16_t* in, int64_t n) {
  const char* fn = "cast_bf16_to_f32";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "in", in, n));
  bf16_to_f32_kernel(out, in, n);
  return DT_HAL_OK;
}

// ---- version 2: 16-bit storage, loss scaling, fused AdamW, streams ----------------------------

// IEEE binary16 from float, round to nearest even (F. Giesen's float_to_half_fast3_rtne): values
// from 65520 up become Inf, results below 2^-14 are subnormal (rounded by one float addition),
// NaN stays NaN (quiet, sign and top payload bits kept).
DT_INLINE uint16_t f16_of(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x47800000u)  // 2^16 and up, Inf, NaN
    return static_cast<uint16_t>(sign |
                                 (a > 0x7f800000u ? 0x7e00u | ((a >> 13) & 0x3ffu) : 0x7c00u));
  if (a < 0x38800000u) {  // below 2^-14: the sum's low bits are the subnormal result
    const float denorm_magic = float_of(((127u - 15u) + (23u - 10u) + 1u) << 23);
    const float t = float_of(a) + denorm_magic;
    return static_cast<uint16_t>(sign | (bits_of(t) - bits_of(denorm_magic)));
  }
  const uint32_t mant_odd = (a >> 13) & 1u;
  a += 0xc8000000u + 0xfffu;  // rebias the exponent by (15 - 127) and round half up...
  a += mant_odd;              // ...or to even on a tie
  return static_cast<uint16_t>(sign | (a >> 13));
}

// Exact.
DT_INLINE float f32_of_f16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) return float_of(sign | bits_of(static_cast<float>(m) * 0x1p-24f));
  if (e == 31) return float_of(sign | 0x7f800000u | (m << 13));
  return float_of(sign | ((e + 112u) << 23) | (m << 13));
}

DT_INLINE float f32_of_bf16(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

bool known_dtype(dt_hal_dtype t) { return t == DT_HAL_F32 || t == DT_HAL_BF16 || t == DT_HAL_F16; }
size_t dtype_bytes(dt_hal_dtype t) { return t == DT_HAL_F32 ? 4 : 2; }

void round_copy(float* out, const float* in, int64_t n, dt_hal_dtype t) {
  if (t == DT_HAL_BF16) {
    for (int64_t i = 0; i < n; ++i) out[i] = f32_of_bf16(bf16_of(in[i]));
  } else if (t == DT_HAL_F16) {
    for (int64_t i = 0; i < n; ++i) out[i] = f32_of_f16(f16_of(in[i]));
  } else if (out != in) {
    std::memmove(out, in, static_cast<size_t>(n) * sizeof(float));
  }
}

// Widens n elements of type t to fp32 (out must not overlap in unless t is f32 and out == in).
DT_KERNEL void widen(float* out, const void* in, dt_hal_dtype t, int64_t n) {
  if (t == DT_HAL_F32) {
    if (out != in) std::memmove(out, in, static_cast<size_t>(n) * 4);
  } else if (t == DT_HAL_BF16) {
    const auto* p = static_cast<const uint16_t*>(in);
    for (int64_t i = 0; i < n; ++i) out[i] = f32_of_bf16(p[i]);
  } else {
    const auto* p = static_cast<const uint16_t*>(in);
    for (int64_t i = 0; i < n; ++i) out[i] = f32_of_f16(p[i]);
  }
}

// Rounds n fp32 values to type t.
DT_KERNEL void narrow(void* out, const float* in, dt_hal_dtype t, int64_t n) {
  if (t == DT_HAL_F32) {
    if (out != in) std::memmove(out, in, static_cast<size_t>(n) * 4);
  } else if (t == DT_HAL_BF16) {
    auto* p = static_cast<uint16_t*>(out);
    for (int64_t i = 0; i < n; ++i) p[i] = bf16_of(in[i]);
  } else {
    auto* p = static_cast<uint16_t*>(out);
    for (int64_t i = 0; i < n; ++i) p[i] = f16_of(in[i]);
  }
}

int cpu_cast(void* ctx, void* out, dt_hal_dtype out_type, const void* in, dt_hal_dtype in_type,
             int64_t n) {
  const char* fn = "cast";
  DT_HAL_TRY(need_ctx(ctx, fn));
  if (!known_dtype(out_type) || !known_dtype(in_type))
    return fail(ctx, DT_HAL_ERR_INVALID, "cast: unknown dtype (in ", static_cast<int>(in_type),
                ", out ", static_cast<int>(out_type), ")");
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "in", in, n));
  if (n == 0) return DT_HAL_OK;
  if (in_type == out_type) {
    if (out != in) std::memmove(out, in, static_cast<size_t>(n) * dtype_bytes(in_type));
  } else if (in_type == DT_HAL_F32) {
    narrow(out, static_cast<const float*>(in), out_type, n);
  } else if (out_type == DT_HAL_F32) {
    widen(static_cast<float*>(out), in, in_type, n);
  } else {  // bf16 <-> f16 through fp32 (exact), rounded once; blocks allow in == out
    float t[256];
    for (int64_t i = 0; i < n; i += 256) {
      const int64_t k = n - i < 256 ? n - i : 256;
      widen(t, static_cast<const uint16_t*>(in) + i, in_type, k);
      narrow(static_cast<uint16_t*>(out) + i, t, out_type, k);
    }
  }
  return DT_HAL_OK;
}

// The context's scratch, at least `floats` long.
int scratch(void* ctx, const char* fn, size_t floats, float** out) {
  auto* c = static_cast<Context*>(ctx);
  if (c->scratch_floats < floats) {
    if (c->live_graphs.load() > 0)
      return fail(ctx, DT_HAL_ERR_UNSUPPORTED, fn, ": this call needs ", floats * sizeof(float),
                  " bytes of scratch memory, more than a live graph was captured with; growing "
                  "it would free memory the graph uses: destroy the graphs first");
    std::free(c->scratch);
    c->scratch_floats = 0;
    c->scratch = static_cast<float*>(std::malloc(floats * sizeof(float)));
    if (c->scratch == nullptr)
      return fail(ctx, DT_HAL_ERR_NOMEM, fn, ": out of memory for ", floats * sizeof(float),
                  " bytes of fp32 scratch");
    c->scratch_floats = floats;
  }
  *out = c->scratch;
  return DT_HAL_OK;
}

// ---- attention without the probabilities (ABI version 4) ----------------------------------------

// flash_attention_fwd per (b, h): the row blocks of attention_fwd_kernel with the block's scores
// in `blk` (kAttnBlock x T floats, the only T-long state) instead of att. Row t's softmax keeps
// lse = max + log(sum), and the block's probabilities are rounded in place (16-bit dtype) for the
// product with v, so out has exactly attention_fwd_ex's bits.
DT_KERNEL void flash_attention_fwd_kernel(float* out, float* lse, const float* qkv, int64_t B,
                                          int64_t T, int64_t C, int64_t NH, dt_hal_dtype dtype,
                                          float* blk) {
  const int64_t hs = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h) {
      const auto [q, k, v] = head_qkv(qkv, b, h, T, C, hs);
      float* o = out + b * T * C + h * hs;
      float* L = lse + (b * NH + h) * T;
      for (int64_t r0 = 0; r0 < T; r0 += kAttnBlock) {
        const int64_t r1 = T - r0 < kAttnBlock ? T : r0 + kAttnBlock;
        sgemm_rm(false, true, r1 - r0, r1, hs, scale, q + r0 * C3, C3, k, C3, 0.0f, blk, T);
        for (int64_t t = r0; t < r1; ++t) {
          float* row = blk + (t - r0) * T;
          const float m = row_max(row, t + 1);
          const float s = exp_shifted(row, row, m, t + 1);
          const float inv = 1.0f / s;
          for (int64_t j = 0; j <= t; ++j) row[j] *= inv;
          for (int64_t j = t + 1; j < r1; ++j) row[j] = 0.0f;
          L[t] = m + std::log(s);
          if (dtype != DT_HAL_F32) round_copy(row, row, r1, dtype);
        }
        sgemm_rm(false, false, r1 - r0, hs, r1, 1.0f, blk, T, v, C3, 0.0f, o + r0 * C, C);
      }
    }
}

// flash_attention_bwd per (b, h), a row block [r0, r1) at a time (keys [0, r1)): P recomputed
// from lse into `p`, dP = dO V^T into `d`, dV[0, r1) += P^T dO with P rounded into `pr`, then
// dS = scale P (dP - D) in place of dP (rounded), dQ[r0, r1) += dS K and dK[0, r1) += dS^T Q.
// D[t] = dout_t . out_t comes from `dfull` (fp32 dout as given) and the widened output; `dO` is
// dout as the products take it (rounded for a 16-bit dtype).
DT_KERNEL void flash_attention_bwd_kernel(float* dqkv, float* D, const float* dO_all,
                                          const float* dfull, const void* out,
                                          dt_hal_dtype out_dtype, const float* qkv,
                                          const float* lse, int64_t B, int64_t T, int64_t C,
                                          int64_t NH, dt_hal_dtype dtype, float* p, float* d,
                                          float* pr) {
  const int64_t hs = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const size_t ob = dtype_bytes(out_dtype);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h) {
      const auto [q, k, v] = head_qkv(qkv, b, h, T, C, hs);
      const auto [dq, dk, dv] = head_qkv(dqkv, b, h, T, C, hs);
      const float* dO = dO_all + b * T * C + h * hs;
      const float* L = lse + (b * NH + h) * T;
      float* Dh = D + (b * NH + h) * T;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t at = (b * T + t) * C + h * hs;
        widen(pr, static_cast<const char*>(out) + static_cast<size_t>(at) * ob, out_dtype, hs);
        Dh[t] = dot(dfull + at, pr, hs);
      }
      for (int64_t r0 = 0; r0 < T; r0 += kAttnBlock) {
        const int64_t r1 = T - r0 < kAttnBlock ? T : r0 + kAttnBlock, n = r1 - r0;
        sgemm_rm(false, true, n, r1, hs, scale, q + r0 * C3, C3, k, C3, 0.0f, p, T);
        sgemm_rm(false, true, n, r1, hs, 1.0f, dO + r0 * C, C, v, C3, 0.0f, d, T);
        for (int64_t t = r0; t < r1; ++t) {
          float* pt = p + (t - r0) * T;
          float* dt = d + (t - r0) * T;
          exp_shifted(pt, pt, L[t], t + 1);  // lse >= every score of the row
          for (int64_t j = t + 1; j < r1; ++j) pt[j] = 0.0f;
          const float Dt = Dh[t];
          for (int64_t j = 0; j <= t; ++j) dt[j] = scale * pt[j] * (dt[j] - Dt);
          for (int64_t j = t + 1; j < r1; ++j) dt[j] = 0.0f;
          if (dtype != DT_HAL_F32) {
            round_copy(pr + (t - r0) * T, pt, r1, dtype);
            round_copy(dt, dt, r1, dtype);
          }
        }
        sgemm_rm(true, false, r1, hs, n, 1.0f, dtype != DT_HAL_F32 ? pr : p, T, dO + r0 * C, C,
                 1.0f, dv, C3);
        sgemm_rm(false, false, n, hs, r1, 1.0f, d, T, k, C3, 1.0f, dq + r0 * C3, C3);
        sgemm_rm(true, false, r1, hs, n, 1.0f, d, T, q + r0 * C3, C3, 1.0f, dk, C3);
      }
    }
}

int cpu_flash_attention_fwd(void* ctx, float* out, float* lse, const float* qkv, int64_t B,
                            int64_t T, int64_t C, int64_t NH, dt_hal_dtype dtype) {
  const char* fn = "flash_attention_fwd";
  DT_HAL_TRY(check_attention(ctx, fn, B, T, C, NH));
  if (!known_dtype(dtype))
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": unknown dtype ", static_cast<int>(dtype));
  if (B * T == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, B * T * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "lse", lse, B * NH * T));
  DT_HAL_TRY(need_ptr(ctx, fn, "qkv", qkv, B * T * 3 * C));
  const int64_t nqkv = dtype == DT_HAL_F32 ? 0 : B * T * 3 * C;
  float* s = nullptr;
  DT_HAL_TRY(scratch(ctx, fn, static_cast<size_t>(nqkv + kAttnBlock * T), &s));
  if (nqkv > 0) round_copy(s, qkv, nqkv, dtype);
  flash_attention_fwd_kernel(out, lse, nqkv > 0 ? s : qkv, B, T, C, NH, dtype, s + nqkv);
  return DT_HAL_OK;
}

int cpu_flash_attention_bwd(void* ctx, float* dqkv, float* scratch_d, const float* dout,
                            const float* qkv, const void* out, dt_hal_dtype out_dtype,
                            const float* lse, int64_t B, int64_t T, int64_t C, int64_t NH,
                            dt_hal_dtype dtype) {
  const char* fn = "flash_attention_bwd";
  DT_HAL_TRY(check_attention(ctx, fn, B, T, C, NH));
  if (!known_dtype(dtype))
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": unknown dtype ", static_cast<int>(dtype));
  if (out_dtype != DT_HAL_F32 && out_dtype != dtype)
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": out_dtype ", static_cast<int>(out_dtype),
                " must be F32 or the products' dtype ", static_cast<int>(dtype));
  if (B * T == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "dqkv", dqkv, B * T * 3 * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "scratch", scratch_d, B * NH * T));
  DT_HAL_TRY(need_ptr(ctx, fn, "dout", dout, B * T * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "qkv", qkv, B * T * 3 * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, B * T * C));
  DT_HAL_TRY(need_ptr(ctx, fn, "lse", lse, B * NH * T));
  const bool r16 = dtype != DT_HAL_F32;
  const int64_t nqkv = r16 ? B * T * 3 * C : 0, nout = r16 ? B * T * C : 0;
  // p and d hold a row block each; pr a row block (rounded P) and also a row of out (head size
  // floats), which is the larger for short sequences of wide heads (T 1, hs 64).
  const int64_t blk = kAttnBlock * T, npr = std::max(blk, C / NH);
  float* s = nullptr;
  DT_HAL_TRY(scratch(ctx, fn, static_cast<size_t>(nqkv + nout + 2 * blk + npr), &s));
  if (r16) {
    round_copy(s, qkv, nqkv, dtype);
    round_copy(s + nqkv, dout, nout, dtype);
  }
  float* p = s + nqkv + nout;
  flash_attention_bwd_kernel(dqkv, scratch_d, r16 ? s + nqkv : dout, dout, out, out_dtype,
                             r16 ? s : qkv, lse, B, T, C, NH, dtype, p, p + blk, p + 2 * blk);
  return DT_HAL_OK;
}

// Widens the used rows x cols of a matrix with leading dimension ld into dense fp32.
void widen_matrix(float* out, const void* in, dt_hal_dtype t, int64_t rows, int64_t cols,
                  int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
    widen(out + r * cols, static_cast<const char*>(in) + r * ld * dtype_bytes(t), t, cols);
}

int cpu_gemm_ex(void* ctx, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                const void* A, int64_t lda, const void* B, int64_t ldb, float beta, void* C,
                int64_t ldc, dt_hal_dtype ab_type, dt_hal_dtype c_type) {
  const char* fn = "gemm_ex";
  DT_HAL_TRY(need_ctx(ctx, fn));
  if (!known_dtype(ab_type) || !known_dtype(c_type))
    return fail(ctx, DT_HAL_ERR_INVALID, "gemm_ex: unknown dtype (ab ", static_cast<int>(ab_type),
                ", c ", static_cast<int>(c_type), ")");
  bool empty = false;
  DT_HAL_TRY(check_gemm(ctx, fn, trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc, &empty));
  if (empty) return DT_HAL_OK;
  const int64_t a_rows = trans_a ? K : M, a_cols = trans_a ? M : K;
  const int64_t b_rows = trans_b ? N : K, b_cols = trans_b ? K : N;
  const bool wide_ab = ab_type != DT_HAL_F32, wide_c = c_type != DT_HAL_F32;
  const size_t na = wide_ab ? static_cast<size_t>(a_rows * a_cols) : 0;
  const size_t nb = wide_ab ? static_cast<size_t>(b_rows * b_cols) : 0;
  const size_t nc = wide_c ? static_cast<size_t>(M * N) : 0;
  float* s = nullptr;
  if (na + nb + nc > 0) DT_HAL_TRY(scratch(ctx, fn, na + nb + nc, &s));
  const float* a = static_cast<const float*>(A);
  const float* b = static_cast<const float*>(B);
  int64_t la = lda, lb = ldb;
  if (wide_ab) {
    if (K > 0) {
      widen_matrix(s, A, ab_type, a_rows, a_cols, lda);
      widen_matrix(s + na, B, ab_type, b_rows, b_cols, ldb);
    }
    a = s;
    b = s + na;
    la = a_cols > 1 ? a_cols : 1;
    lb = b_cols > 1 ? b_cols : 1;
  }
  float* c = static_cast<float*>(C);
  int64_t lc = ldc;
  if (wide_c) {
    c = s + na + nb;
    lc = N;
    // beta == 0 must ignore C (it may hold anything, NaN included), as BLAS does.
    if (beta != 0.0f)
      widen_matrix(c, C, c_type, M, N, ldc);
    else
      std::memset(c, 0, nc * sizeof(float));
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(M), static_cast<blasint>(N),
              static_cast<blasint>(K), alpha, a, static_cast<blasint>(la), b,
              static_cast<blasint>(lb), beta, c, static_cast<blasint>(lc));
  if (wide_c)
    for (int64_t r = 0; r < M; ++r)
      narrow(static_cast<char*>(C) + r * ldc * 2, c + r * N, c_type, N);
  return DT_HAL_OK;
}

// Returns nonzero when some x[i] * s is not finite (Inf * s and NaN * s never are, so checking
// after scaling also catches values that were not finite before).
DT_KERNEL uint32_t scale_check_kernel(float* __restrict x, float s, int64_t n) {
  uint32_t bad = 0;
  int64_t i = 0;
  for (; i + kW <= n; i += kW)
    for (int j = 0; j < kW; ++j) {
      const float y = x[i + j] * s;
      x[i + j] = y;
      bad |= static_cast<uint32_t>((bits_of(y) & 0x7f800000u) == 0x7f800000u);
    }
  for (; i < n; ++i) {
    const float y = x[i] * s;
    x[i] = y;
    bad |= static_cast<uint32_t>((bits_of(y) & 0x7f800000u) == 0x7f800000u);
  }
  return bad;
}

int cpu_scale_check_finite(void* ctx, float* x, int64_t n, float s, int32_t* found_inf) {
  const char* fn = "scale_check_finite";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  DT_HAL_TRY(need_ptr(ctx, fn, "x", x, n));
  if (found_inf == nullptr) return fail(ctx, DT_HAL_ERR_INVALID, fn, ": found_inf is null");
  if (scale_check_kernel(x, s, n)) *found_inf = 1;
  return DT_HAL_OK;
}

int cpu_adamw_multi(void* ctx, int count, float* const* params, const float* const* grads,
                    float* const* m, float* const* v, const int64_t* sizes,
                    const float* weight_decay, float lr, float beta1, float beta2, float eps,
                    int64_t t) {
  const char* fn = "adamw_multi";
  DT_HAL_TRY(need_ctx(ctx, fn));
  if (count < 0) return fail(ctx, DT_HAL_ERR_INVALID, fn, ": count = ", count, " is negative");
  if (count == 0) return DT_HAL_OK;
  if (!params || !grads || !m || !v || !sizes || !weight_decay)
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": a pointer or size array is null for ", count,
                " tensors");
  // Everything is checked before any tensor is touched: a bad tensor k leaves all unchanged.
  for (int k = 0; k < count; ++k) {
    if (sizes[k] < 0)
      return fail(ctx, DT_HAL_ERR_INVALID, fn, ": sizes[", k, "] = ", sizes[k], " is negative");
    if (sizes[k] > 0 && (!params[k] || !grads[k] || !m[k] || !v[k]))
      return fail(ctx, DT_HAL_ERR_INVALID, fn, ": tensor ", k, " of ", sizes[k],
                  " elements has a null pointer");
  }
  if (t < 1) return fail(ctx, DT_HAL_ERR_INVALID, fn, ": step t = ", t, " must be >= 1");
  if (!(beta1 >= 0.0f && beta1 < 1.0f) || !(beta2 >= 0.0f && beta2 < 1.0f))
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": beta1 = ", beta1, ", beta2 = ", beta2,
                " must lie in [0, 1)");
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(t));
  for (int k = 0; k < count; ++k)
    if (sizes[k] > 0)
      adamw_kernel(params[k], grads[k], m[k], v[k], sizes[k], lr, beta1, beta2, eps,
                   weight_decay[k], static_cast<float>(1.0 / bc1), static_cast<float>(1.0 / bc2));
  return DT_HAL_OK;
}

int cpu_describe(void* ctx, char* buf, size_t len) {
  DT_HAL_TRY(need_ctx(ctx, "describe"));
  if (buf == nullptr || len == 0)
    return fail(ctx, DT_HAL_ERR_INVALID, "describe: buf is null or len is 0");
  std::snprintf(buf, len, "CPU, OpenBLAS %s, %d BLAS thread(s)", openblas_get_config(),
                openblas_get_num_threads());
  return DT_HAL_OK;
}

// Synchronous device: a stream or an event is a name for "now". Handles point at this tag.
char g_sync_tag;

int cpu_stream_create(void* ctx, void** stream) {
  DT_HAL_TRY(need_ctx(ctx, "stream_create"));
  if (stream == nullptr) return fail(ctx, DT_HAL_ERR_INVALID, "stream_create: stream is null");
  *stream = &g_sync_tag;
  return DT_HAL_OK;
}
void cpu_handle_destroy(void*, void*) {}
int cpu_set_stream(void* ctx, void*) { return need_ctx(ctx, "set_stream"); }
int cpu_native_stream(void* ctx, void** handle) {
  DT_HAL_TRY(need_ctx(ctx, "native_stream"));
  if (handle == nullptr) return fail(ctx, DT_HAL_ERR_INVALID, "native_stream: handle is null");
  *handle = nullptr;
  return DT_HAL_OK;
}
int cpu_event_create(void* ctx, void** event) {
  DT_HAL_TRY(need_ctx(ctx, "event_create"));
  if (event == nullptr) return fail(ctx, DT_HAL_ERR_INVALID, "event_create: event is null");
  *event = &g_sync_tag;
  return DT_HAL_OK;
}
int cpu_event_op(void* ctx, void* event) {
  DT_HAL_TRY(need_ctx(ctx, "event"));
  if (event == nullptr) return fail(ctx, DT_HAL_ERR_INVALID, "event: null event");
  return DT_HAL_OK;
}

// ---- device memory the host cannot touch (DT_CPU_DEVICE_MEMORY) ---------------------------------

#ifdef DT_CPU_DEVICE_MEMORY
constexpr uintptr_t kDeviceTag = uintptr_t{1} << 55;
constexpr const char* kTableName = "devmem";
#else
constexpr uintptr_t kDeviceTag = 0;
constexpr const char* kTableName = "cpu";
#endif

// A pointer argument as the kernels use it (the tag cleared; host pointers have no tag); any
// other argument unchanged.
template <class T>
T untag(T v) {
  if constexpr (std::is_pointer_v<T>) {
    if constexpr (kDeviceTag != 0)
      return reinterpret_cast<T>(reinterpret_cast<uintptr_t>(v) & ~kDeviceTag);
  }
  return v;
}
template <class T>
T* tag(T* p) {
  if (p == nullptr || kDeviceTag == 0) return p;
  return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(p) | kDeviceTag);
}

// ---- graph capture ------------------------------------------------------------------------------

// The context when the calling thread is capturing on it, else null.
Context* capturing(void* ctx) {
  auto* c = static_cast<Context*>(ctx);
  if (c == nullptr || c->capture.load(std::memory_order_acquire) == nullptr) return nullptr;
  return c->capture_thread == std::this_thread::get_id() ? c : nullptr;
}

// Refuses entry `fn` during a capture and invalidates the capture (graph_end says why).
int refuse_in_capture(Context* c, const char* fn, const char* why) {
  const int st = fail(c, DT_HAL_ERR_UNSUPPORTED, fn, " cannot be captured into a graph: ", why);
  if (c->capture_error.empty()) {
    try {
      c->capture_error = c->error;
    } catch (...) {
      return fail(c, DT_HAL_ERR_NOMEM, "out of memory while capturing a graph");
    }
  }
  return st;
}

// Appends a call to the graph being captured.
int record(Context* c, std::function<int(void*)> op) {
  try {
    c->capture.load()->ops.push_back(std::move(op));
  } catch (...) {
    return refuse_in_capture(c, "a call", "out of memory while recording it");
  }
  return DT_HAL_OK;
}

// Entry Fn as seen through the table: run at once, or appended to the graph being captured with
// its arguments (device pointers and values) copied.
template <auto Fn>
struct Rec;
template <class... A, int (*Fn)(void*, A...)>
struct Rec<Fn> {
  static int entry(void* ctx, A... a) {
    Context* c = capturing(ctx);
    if (c == nullptr) return Fn(ctx, untag(a)...);
    return record(c, [a...](void* x) { return Fn(x, untag(a)...); });
  }
};

int rec_alloc(void* ctx, size_t bytes, void** ptr) {
  if (Context* c = capturing(ctx))
    return refuse_in_capture(c, "alloc", "memory cannot be allocated while capturing");
  const int st = cpu_alloc(ctx, bytes, ptr);
  if (st == DT_HAL_OK) *ptr = tag(*ptr);
  return st;
}
void rec_release(void* ctx, void* ptr) {
  if (Context* c = capturing(ctx))
    refuse_in_capture(c, "release", "memory the graph may use was freed while capturing");
  cpu_release(ctx, untag(ptr));
}
int rec_copy(void* ctx, void* dst, const void* src, size_t bytes, dt_hal_copy_kind kind) {
  Context* c = capturing(ctx);
  if (c != nullptr && kind == DT_HAL_HOST_TO_DEVICE)
    return refuse_in_capture(c, "copy",
                             "it reads host memory, which may change before the graph runs");
  if (c != nullptr && kind == DT_HAL_DEVICE_TO_HOST)
    return refuse_in_capture(
        c, "copy", "it writes host memory, which the host would read before the graph runs");
  return Rec<cpu_copy>::entry(ctx, dst, src, bytes, kind);
}
int rec_synchronize(void* ctx) {
  if (Context* c = capturing(ctx))
    return refuse_in_capture(c, "synchronize", "the host cannot wait for work that has not run");
  return cpu_synchronize(ctx);
}
int rec_sum_squares(void* ctx, const float* x, int64_t n, double* out) {
  if (Context* c = capturing(ctx))
    return refuse_in_capture(c, "sum_squares", "its result is written to host memory");
  return cpu_sum_squares(ctx, untag(x), n, out);
}
int rec_event_synchronize(void* ctx, void* event) {
  if (Context* c = capturing(ctx))
    return refuse_in_capture(c, "event_synchronize",
                             "the host cannot wait for work that has not run");
  return cpu_event_op(ctx, event);
}
// The pointer and size arrays are host arrays read during the call: the graph keeps copies.
int rec_adamw_multi(void* ctx, int count, float* const* params, const float* const* grads,
                    float* const* m, float* const* v, const int64_t* sizes,
                    const float* weight_decay, float lr, float beta1, float beta2, float eps,
                    int64_t t) {
  Context* c = capturing(ctx);
  if (count <= 0 || !params || !grads || !m || !v || !sizes || !weight_decay ||
      (c == nullptr && kDeviceTag == 0))  // nothing to record: run it (or report the bad arrays)
    return cpu_adamw_multi(ctx, count, params, grads, m, v, sizes, weight_decay, lr, beta1, beta2,
                           eps, t);
  try {
    const auto n = static_cast<size_t>(count);
    std::vector<float*> P(n), M(n), Vv(n);
    std::vector<const float*> G(n);
    for (size_t k = 0; k < n; ++k) {
      P[k] = untag(params[k]);
      M[k] = untag(m[k]);
      Vv[k] = untag(v[k]);
      G[k] = untag(grads[k]);
    }
    std::vector<int64_t> S(sizes, sizes + n);
    std::vector<float> W(weight_decay, weight_decay + n);
    if (c == nullptr)
      return cpu_adamw_multi(ctx, count, P.data(), G.data(), M.data(), Vv.data(), S.data(),
                             W.data(), lr, beta1, beta2, eps, t);
    return record(c, [=](void* x) {
      return cpu_adamw_multi(x, count, P.data(), G.data(), M.data(), Vv.data(), S.data(), W.data(),
                             lr, beta1, beta2, eps, t);
    });
  } catch (...) {
    if (c != nullptr)
      return refuse_in_capture(c, "adamw_multi", "out of memory while recording it");
    return fail(ctx, DT_HAL_ERR_NOMEM, "adamw_multi: out of memory");
  }
}

int cpu_graph_begin(void* ctx) {
  DT_HAL_TRY(need_ctx(ctx, "graph_begin"));
  auto* c = static_cast<Context*>(ctx);
  if (c->capture.load() != nullptr)
    return fail(ctx, DT_HAL_ERR_INVALID, "graph_begin: a capture is already in progress");
  auto* g = new (std::nothrow) Graph();
  if (g == nullptr) return fail(ctx, DT_HAL_ERR_NOMEM, "graph_begin: out of memory");
  c->capture_error.clear();
  c->capture_thread = std::this_thread::get_id();
  c->capture.store(g, std::memory_order_release);
  return DT_HAL_OK;
}

int cpu_graph_end(void* ctx, void** graph) {
  DT_HAL_TRY(need_ctx(ctx, "graph_end"));
  if (graph == nullptr) return fail(ctx, DT_HAL_ERR_INVALID, "graph_end: graph is null");
  *graph = nullptr;
  Context* c = capturing(ctx);
  if (c == nullptr)
    return fail(ctx, DT_HAL_ERR_INVALID,
                "graph_end: this thread is not capturing (no graph_begin)");
  Graph* g = c->capture.exchange(nullptr);
  if (!c->capture_error.empty()) {
    delete g;
    return fail(ctx, DT_HAL_ERR_UNSUPPORTED,
                "graph_end: the capture was invalidated: ", c->capture_error);
  }
  *graph = g;
  ++c->live_graphs;
  return DT_HAL_OK;
}

int cpu_graph_launch(void* ctx, void* graph) {
  DT_HAL_TRY(need_ctx(ctx, "graph_launch"));
  if (graph == nullptr) return fail(ctx, DT_HAL_ERR_INVALID, "graph_launch: null graph");
  if (Context* c = capturing(ctx))
    return refuse_in_capture(c, "graph_launch", "graphs are not launched inside a capture");
  const auto& ops = static_cast<Graph*>(graph)->ops;
  for (size_t k = 0; k < ops.size(); ++k) {
    const int st = ops[k](ctx);
    if (st != DT_HAL_OK) {
      const std::string why = static_cast<Context*>(ctx)->error;
      return fail(ctx, st, "graph_launch: call ", k + 1, " of ", ops.size(), " failed: ", why);
    }
  }
  return DT_HAL_OK;
}

void cpu_graph_destroy(void* ctx, void* graph) {
  if (graph == nullptr) return;
  delete static_cast<Graph*>(graph);
  if (ctx == nullptr) return;
  // One decrement, never below zero, even when two threads destroy a context's last graphs.
  std::atomic<int>& live = static_cast<Context*>(ctx)->live_graphs;
  int n = live.load();
  while (n > 0 && !live.compare_exchange_weak(n, n - 1)) {
  }
}

// The version-1 entries after api_version and name, in table order.
// Work on device memory goes through Rec (recorded while capturing); the rest through rec_*.
#define DT_CPU_V1_ENTRIES                                                                          \
  cpu_open, cpu_close, cpu_last_error, cpu_device_count, rec_alloc, rec_release, rec_copy,         \
      Rec<cpu_fill_zero>::entry, rec_synchronize, cpu_set_threads, Rec<cpu_gemm>::entry,           \
      Rec<cpu_bias_add>::entry, Rec<cpu_bias_grad>::entry, Rec<cpu_add>::entry,                    \
      Rec<cpu_scale>::entry, rec_sum_squares, Rec<cpu_embedding_fwd>::entry,                       \
      Rec<cpu_embedding_bwd>::entry, Rec<cpu_layernorm_fwd>::entry, Rec<cpu_layernorm_bwd>::entry, \
      Rec<cpu_gelu_fwd>::entry, Rec<cpu_gelu_bwd>::entry, Rec<cpu_attention_fwd>::entry,           \
      Rec<cpu_attention_bwd>::entry, Rec<cpu_softmax_xent_fwd>::entry,                             \
      Rec<cpu_softmax_xent_bwd>::entry, Rec<cpu_adamw>::entry, Rec<cpu_cast_f32_to_bf16>::entry,   \
      Rec<cpu_cast_bf16_to_f32>::entry

// The version-1 table (exported as dt_hal_plugin_v1 by the shared build, for dt builds that only
// know version 1) and the version-2 table; they share every version-1 entry.
const dt_hal_v1_t kCpuTable = {DT_HAL_API_VERSION_1, kTableName, DT_CPU_V1_ENTRIES};

// The version-2 entries after the version-1 table, in table order.
#define DT_CPU_V2_ENTRIES                                                                          \
  cpu_describe, Rec<cpu_gemm_ex>::entry, Rec<cpu_cast>::entry, Rec<cpu_scale_check_finite>::entry, \
      rec_adamw_multi, cpu_stream_create, cpu_handle_destroy, cpu_set_stream, cpu_native_stream,   \
      cpu_event_create, cpu_handle_destroy, cpu_event_op,                                          \
      /* event_record */ cpu_event_op, /* stream_wait_event */                                     \
      rec_event_synchronize, cpu_graph_begin, cpu_graph_end, cpu_graph_launch, cpu_graph_destroy

const dt_hal_v2_t kCpuTableV2 = {{DT_HAL_API_VERSION_2, kTableName, DT_CPU_V1_ENTRIES},
                                 DT_CPU_V2_ENTRIES};

// The version-3 table: the same entries and attention in a precision (constant-initialised, like
// the others, so it is complete before any static initialiser may ask for it).
const dt_hal_v3_t kCpuTableV3 = {
    {{DT_HAL_API_VERSION_3, kTableName, DT_CPU_V1_ENTRIES}, DT_CPU_V2_ENTRIES},
    Rec<cpu_attention_fwd_ex>::entry,
    Rec<cpu_attention_bwd_ex>::entry,
};

// The version-4 table: the same entries and attention that keeps the log-sum-exp.
const dt_hal_v4_t kCpuTableV4 = {
    {{{DT_HAL_API_VERSION_4, kTableName, DT_CPU_V1_ENTRIES}, DT_CPU_V2_ENTRIES},
     Rec<cpu_attention_fwd_ex>::entry,
     Rec<cpu_attention_bwd_ex>::entry},
    Rec<cpu_flash_attention_fwd>::entry,
    Rec<cpu_flash_attention_bwd>::entry,
};

}  // namespace

extern "C" const dt_hal_v1_t* dt_hal_cpu_v1(void) { return &kCpuTable; }
extern "C" const dt_hal_v2_t* dt_hal_cpu_v2(void) { return &kCpuTableV2; }
extern "C" const dt_hal_v3_t* dt_hal_cpu_v3(void) { return &kCpuTableV3; }
extern "C" const dt_hal_v4_t* dt_hal_cpu_v4(void) { return &kCpuTableV4; }
