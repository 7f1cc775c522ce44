// The CUDA device of dt (hal/dt_hal_v4.h): device memory, one stream per context (plus streams
// and events the caller makes), cuBLAS for every matrix product, and a kernel for every other
// entry of the CPU device. Built as libdt_hal_cuda.so for sm_90 with compute_90 PTX (so newer
// GPUs JIT it), linked with the static CUDA runtime: loading needs libcublas, not a GPU or a
// driver; open() is where a missing GPU or driver is reported.
//
// Numerics (what tests/gpu/test_cuda_kernels.cpp holds the kernels to against the CPU device):
//  - fp32 GEMMs run in full fp32 (no TF32: the cuBLAS default math mode); gemm_ex runs bf16 and
//    fp16 operands on tensor cores with fp32 accumulation (CUBLAS_COMPUTE_32F), with DT_CUDA_LT=1
//    through cuBLASLt (see "gemm_ex through cuBLASLt"; DT_CUDA_LT_TUNE=1 times its algorithms,
//    which may make the last bits differ between runs).
//  - Reductions (LayerNorm, softmax, sums) accumulate in fp32 in a different order than the CPU;
//    sum_squares accumulates in double. Exponentials use expf (the CPU its own, a few ulp off).
//  - embedding_bwd adds rows of repeated tokens with atomicAdd: the order, and so the last bits,
//    may differ from run to run. Everything else is deterministic.
//  - flash_attention_* (ABI version 4) in bf16 and fp16 with heads of 64 or 128 run tiled on
//    tensor cores with an online softmax with DT_CUDA_FLASH=tiled (see "attention without the
//    probabilities").
//  - casts and scale_check_finite are bit-exact with the CPU device (same bit-level rounding).
//
// Asynchrony: every entry enqueues on the context's current stream and returns; copies to the
// host wait for their data (so a host buffer may be read on return), and copies from the host
// return once the host buffer may be reused. While the current stream is being captured (by any
// thread: work on a capturing stream joins the graph), copies to the host, sum_squares,
// synchronize and alloc are refused with DT_HAL_ERR_UNSUPPORTED, as the CPU device refuses them.
// Any thread may call, one at a time for a context (its work buffers, error text and capture
// state serve all its streams; a capture ends on the thread that began it): each entry makes the
// context's GPU current. Token and target indices are
// checked on the device: a kernel that meets one out of range skips it and records it, and the next
// synchronize() returns DT_HAL_ERR_INVALID naming the entry, the position and the value (the check
// cannot be synchronous without a host wait).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "dt_hal_v2.h"
#include "dt_hal_v3.h"
#include "dt_hal_v4.h"

#define DT_CUDA_EXPORT __attribute__((visibility("default")))

namespace {

constexpr size_t kErrorLen = 512;
constexpr int kThreads = 256;
constexpr size_t kBlasWorkspace = size_t{32} << 20;  // fixed, so cuBLAS never allocates in capture

// Device-side record of the first bad index a kernel met (see synchronize).
struct DeviceError {
  int32_t code;  // 0: none; else a kBad* below
  int32_t pad;
  int64_t position;
  int64_t value;
  int64_t limit;
};
enum : int32_t { kBadToken = 1, kBadTokenBwd = 2, kBadTarget = 3, kBadTargetBwd = 4 };

// gemm_ex through cuBLASLt: per shape, layout, types and alignment, the algorithm chosen once
// (see lt_gemm) and the descriptors it runs with; ok false: that shape goes to cublasGemmEx.
struct LtPlan {
  std::atomic<bool> ok{false};
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};
using LtKey = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int,
                         uint32_t, uint32_t, uint32_t, bool>;

struct Context {
  int device = 0;
  cudaStream_t own = nullptr;     // the default stream of this context (non-blocking)
  cudaStream_t stream = nullptr;  // current
  cublasHandle_t blas = nullptr;
  void* blas_ws = nullptr;
  cublasLtHandle_t lt = nullptr;  // null: every gemm_ex through cublasGemmEx
  std::mutex lt_mu;
  std::map<LtKey, LtPlan> lt_plans;
  DeviceError* derr = nullptr;       // device memory
  DeviceError* derr_host = nullptr;  // page-locked: derr fetched behind a stream's work
  double* partials = nullptr;        // sum_squares' per-block sums (kSumBlocks + 1)
  void* scratch = nullptr;           // gemm_ex's fp32 result for pairings cuBLAS lacks
  size_t scratch_bytes = 0;
  void* lp = nullptr;  // attention_*_ex's 16-bit operands (qkv, dout, probabilities)
  size_t lp_bytes = 0;
  void* fa = nullptr;  // flash_attention's probabilities and their gradient, where it makes them
  size_t fa_bytes = 0;
  void* pad[2] = {nullptr, nullptr};  // gemm_ex's copies of A and B with 16-byte aligned rows
  size_t pad_bytes[2] = {0, 0};
  std::atomic<int> graphs{0};  // graphs not yet destroyed (they may hold scratch's address)
  std::mutex streams_mu;
  std::vector<cudaStream_t> streams;  // made by stream_create, not yet destroyed
  // A call of the capturing thread refused while capturing (as on the CPU device, graph_end then
  // fails naming it).
  std::thread::id capture_thread;
  bool capture_broken = false;
  char capture_error[kErrorLen] = "";
  // Memory released by the capturing thread while it captured: cudaFree is not allowed then, so
  // it is freed when the capture ends (graph_end), at the next release outside a capture, or at
  // close.
  std::vector<void*> capture_frees;
  char error[kErrorLen] = "";
  struct Profile* prof = nullptr;  // DT_CUDA_PROFILE: GPU time per entry (see "profile" below)
};

thread_local char t_orphan_error[kErrorLen] = "";

// DT_CUDA_PROFILE (defined with the tables below).
bool profile_requested();
void profile_start(Context* c);
void profile_read(Context* c);
void profile_finish(Context* c);

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

#define DT_HAL_TRY(expr)                            \
  do {                                              \
    const int dt_hal_rc_ = (expr);                  \
    if (dt_hal_rc_ != DT_HAL_OK) return dt_hal_rc_; \
  } while (0)

// A failed CUDA runtime call: DT_HAL_ERR_DEVICE naming the entry and the call.
#define CU(ctx, fn, call)                                                                          \
  do {                                                                                             \
    const cudaError_t e_ = (call);                                                                 \
    if (e_ != cudaSuccess) {                                                                       \
      (void)cudaGetLastError(); /* not the next launch's error */                                  \
      return fail(ctx, e_ == cudaErrorMemoryAllocation ? DT_HAL_ERR_NOMEM : DT_HAL_ERR_DEVICE, fn, \
                  ": ", #call, ": ", cudaGetErrorString(e_));                                      \
    }                                                                                              \
  } while (0)

#define CUBLAS(ctx, fn, call)                                                 \
  do {                                                                        \
    const cublasStatus_t s_ = (call);                                         \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                          \
      return fail(ctx,                                                        \
                  s_ == CUBLAS_STATUS_NOT_SUPPORTED  ? DT_HAL_ERR_UNSUPPORTED \
                  : s_ == CUBLAS_STATUS_ALLOC_FAILED ? DT_HAL_ERR_NOMEM       \
                                                     : DT_HAL_ERR_DEVICE,     \
                  fn, ": ", #call, ": ", cublasGetStatusString(s_));          \
  } while (0)

// After a kernel launch.
#define LAUNCHED(ctx, fn) CU(ctx, fn, cudaGetLastError())

// Every entry with a context makes the context's GPU current first: the caller may be any thread
// (a progress thread staging a collective, say), and CUDA's current device is per thread, so a
// thread that never chose one would launch onto GPU 0's context.
int need_ctx(void* ctx, const char* fn) {
  if (ctx == nullptr) return fail(nullptr, DT_HAL_ERR_INVALID, fn, ": null context");
  const cudaError_t e = cudaSetDevice(static_cast<const Context*>(ctx)->device);
  if (e != cudaSuccess)
    return fail(ctx, DT_HAL_ERR_DEVICE, fn, ": cudaSetDevice(",
                static_cast<const Context*>(ctx)->device, "): ", cudaGetErrorString(e));
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

Context* C(void* ctx) { return static_cast<Context*>(ctx); }

bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(s, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone;
}

// A call refused while capturing: DT_HAL_ERR_UNSUPPORTED, and the capture is marked broken, so
// that graph_end fails naming it, as on the CPU device, instead of returning a graph without it.
template <class... A>
int refuse_capturing(void* ctx, const A&... parts) {
  const int st = fail(ctx, DT_HAL_ERR_UNSUPPORTED, parts...);
  Context* c = C(ctx);
  if (!c->capture_broken && c->capture_thread == std::this_thread::get_id()) {
    c->capture_broken = true;
    std::snprintf(c->capture_error, kErrorLen, "%s", c->error);
  }
  return st;
}

// What a graph may not contain, refused as the CPU device refuses it (DT_HAL_ERR_UNSUPPORTED)
// before CUDA would invalidate the capture with an error of its own.
int refuse_in_capture(void* ctx, const char* fn, const char* what) {
  if (!capturing(C(ctx)->stream)) return DT_HAL_OK;
  return refuse_capturing(ctx, fn, ": ", what,
                          " is not allowed while the stream is being captured into a graph");
}

// cublasSetStream resets the handle to cuBLAS's default workspace pool, which allocates inside
// captures: every change of stream binds the fixed workspace again.
cublasStatus_t bind_blas(Context* c) {
  cublasStatus_t s = cublasSetStream(c->blas, c->stream);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetWorkspace(c->blas, c->blas_ws, kBlasWorkspace);
  return s;
}

unsigned blocks_for(int64_t n, int threads = kThreads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 65535 * 16 ? (b > 0 ? b : 1) : 65535 * 16);
}

// ---- bit-level 16-bit conversions (the CPU device's, so results are bit-identical) ----------

__host__ __device__ inline uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
__host__ __device__ inline float float_of(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
__device__ inline uint16_t bf16_of(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}
__device__ inline uint16_t f16_of(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x47800000u)
    return static_cast<uint16_t>(sign |
                                 (a > 0x7f800000u ? 0x7e00u | ((a >> 13) & 0x3ffu) : 0x7c00u));
  if (a < 0x38800000u) {
    // Round to nearest even at 2^-24 explicitly (the CPU adds a magic float; the device must not
    // let the compiler contract or flush that addition).
    const float denorm_magic = float_of(((127u - 15u) + (23u - 10u) + 1u) << 23);
    const float t = __fadd_rn(float_of(a), denorm_magic);
    return static_cast<uint16_t>(sign | (bits_of(t) - bits_of(denorm_magic)));
  }
  const uint32_t mant_odd = (a >> 13) & 1u;
  a += 0xc8000000u + 0xfffu;
  a += mant_odd;
  return static_cast<uint16_t>(sign | (a >> 13));
}
__device__ inline float f32_of_f16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) return float_of(sign | bits_of(__fmul_rn(static_cast<float>(m), 0x1p-24f)));
  if (e == 31) return float_of(sign | 0x7f800000u | (m << 13));
  return float_of(sign | ((e + 112u) << 23) | (m << 13));
}
__device__ inline float f32_of_bf16(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

__device__ inline float load_as_f32(const void* p, int64_t i, int type) {
  if (type == DT_HAL_F32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return type == DT_HAL_BF16 ? f32_of_bf16(h) : f32_of_f16(h);
}
__device__ inline void store_from_f32(void* p, int64_t i, int type, float x) {
  if (type == DT_HAL_F32)
    static_cast<float*>(p)[i] = x;
  else
    static_cast<uint16_t*>(p)[i] = type == DT_HAL_BF16 ? bf16_of(x) : f16_of(x);
}

// ---- reductions ---------------------------------------------------------------------------

template <class T>
__device__ inline T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
template <class T>
__device__ T block_sum(T v) {
  __shared__ T part[32];
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  T r = lane < nwarps ? part[lane] : T(0);
  return warp_sum(r);
}
__device__ float block_max(float v) {
  __shared__ float part[32];
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  float r = lane < nwarps ? part[lane] : -INFINITY;
  return warp_max(r);
}

__device__ void record_bad(DeviceError* e, int32_t code, int64_t pos, int64_t value,
                           int64_t limit) {
  if (atomicCAS(&e->code, 0, code) == 0) {
    e->position = pos;
    e->value = value;
    e->limit = limit;
  }
}

// ---- device and memory ----------------------------------------------------------------------

int cuda_device_count(int* count) {
  if (count == nullptr) return fail(nullptr, DT_HAL_ERR_INVALID, "device_count: count is null");
  *count = 0;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
    (void)cudaGetLastError();
    return DT_HAL_OK;  // no usable GPU is an answer, not a failure
  }
  if (e != cudaSuccess)
    return fail(nullptr, DT_HAL_ERR_DEVICE,
                "device_count: cudaGetDeviceCount: ", cudaGetErrorString(e));
  *count = n;
  return DT_HAL_OK;
}

void cuda_close(void* ctx);

// Launches nothing: whether the plugin holds code this GPU runs (machine code of its
// architecture, or PTX of one not newer) is asked of it at open (cudaFuncGetAttributes).
__global__ void probe_kernel() {}

int cuda_open(int index, void** out) {
  if (out == nullptr) return fail(nullptr, DT_HAL_ERR_INVALID, "open: ctx out-pointer is null");
  *out = nullptr;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return fail(nullptr, DT_HAL_ERR_DEVICE,
                "open: no usable CUDA device (cudaGetDeviceCount: ", cudaGetErrorString(e), ")");
  }
  if (index < 0 || index >= n)
    return fail(nullptr, DT_HAL_ERR_INVALID, "open: CUDA device index ", index,
                " does not exist (this node has ", n, ")");
  auto* c = new (std::nothrow) Context();
  if (c == nullptr) return fail(nullptr, DT_HAL_ERR_NOMEM, "open: out of memory");
  c->device = index;
  // Any failure below: report it without a context, then free what was made.
  auto bail = [&](const char* what, const char* msg) {
    fail(nullptr, DT_HAL_ERR_DEVICE, "open: CUDA device ", index, ": ", what, ": ", msg);
    cuda_close(c);
    return DT_HAL_ERR_DEVICE;
  };
  cudaError_t ce;
  if ((ce = cudaSetDevice(index)) != cudaSuccess)
    return bail("cudaSetDevice", cudaGetErrorString(ce));
  // A GPU the build has no code for would fail every launch ("no kernel image"): refused here,
  // naming it and the architectures built.
  cudaFuncAttributes probe{};
  if ((ce = cudaFuncGetAttributes(&probe, probe_kernel)) != cudaSuccess) {
    (void)cudaGetLastError();
    cudaDeviceProp p{};
    const bool known = cudaGetDeviceProperties(&p, index) == cudaSuccess;
    std::string built = DT_CUDA_ARCHITECTURES;  // "90-real 90-virtual", as CMake's list
    std::replace(built.begin(), built.end(), ' ', ';');
    char msg[512];
    std::snprintf(msg, sizeof msg,
                  "%s (%s, compute capability %d.%d): this plugin holds code for the CUDA "
                  "architectures %s only; build it for this GPU's too "
                  "(-DCMAKE_CUDA_ARCHITECTURES=\"%d%d-real;%s\")",
                  cudaGetErrorString(ce), known ? p.name : "?", known ? p.major : 0,
                  known ? p.minor : 0, DT_CUDA_ARCHITECTURES, known ? p.major : 0,
                  known ? p.minor : 0, built.c_str());
    return bail("no code for this GPU", msg);
  }
  if ((ce = cudaStreamCreateWithFlags(&c->own, cudaStreamNonBlocking)) != cudaSuccess)
    return bail("cudaStreamCreate", cudaGetErrorString(ce));
  c->stream = c->own;
  if ((ce = cudaMalloc(&c->derr, sizeof(DeviceError))) != cudaSuccess ||
      (ce = cudaMemsetAsync(c->derr, 0, sizeof(DeviceError), c->own)) != cudaSuccess ||
      (ce = cudaStreamSynchronize(c->own)) != cudaSuccess ||
      (ce = cudaMallocHost(&c->derr_host, sizeof(DeviceError))) != cudaSuccess ||
      (ce = cudaMalloc(&c->partials, sizeof(double) * 1025)) != cudaSuccess ||
      (ce = cudaMalloc(&c->blas_ws, kBlasWorkspace)) != cudaSuccess)
    return bail("cudaMalloc", cudaGetErrorString(ce));
  cublasStatus_t bs;
  if ((bs = cublasCreate(&c->blas)) != CUBLAS_STATUS_SUCCESS)
    return bail("cublasCreate", cublasGetStatusString(bs));
  if ((bs = bind_blas(c)) != CUBLAS_STATUS_SUCCESS)
    return bail("cublasSetStream/Workspace", cublasGetStatusString(bs));
  if (cublasLtCreate(&c->lt) != CUBLAS_STATUS_SUCCESS) c->lt = nullptr;  // cublasGemmEx then
  if (profile_requested()) profile_start(c);
  *out = c;
  return DT_HAL_OK;
}

void cuda_close(void* ctx) {
  Context* c = C(ctx);
  if (c == nullptr) return;
  cudaSetDevice(c->device);
  if (c->own) cudaStreamSynchronize(c->own);
  profile_finish(c);
  if (c->blas) cublasDestroy(c->blas);
  for (auto& kv : c->lt_plans) {
    LtPlan& p = kv.second;
    if (p.a) cublasLtMatrixLayoutDestroy(p.a);
    if (p.b) cublasLtMatrixLayoutDestroy(p.b);
    if (p.c) cublasLtMatrixLayoutDestroy(p.c);
    if (p.op) cublasLtMatmulDescDestroy(p.op);
  }
  if (c->lt) cublasLtDestroy(c->lt);
  cudaFree(c->blas_ws);
  cudaFree(c->derr);
  cudaFreeHost(c->derr_host);
  cudaFree(c->partials);
  cudaFree(c->scratch);
  cudaFree(c->lp);
  cudaFree(c->fa);
  cudaFree(c->pad[0]);
  cudaFree(c->pad[1]);
  for (void* p : c->capture_frees) cudaFree(p);
  if (c->own) cudaStreamDestroy(c->own);
  (void)cudaGetLastError();
  delete c;
}

const char* cuda_last_error(void* ctx) { return ctx ? C(ctx)->error : t_orphan_error; }

int cuda_alloc(void* ctx, size_t bytes, void** ptr) {
  DT_HAL_TRY(need_ctx(ctx, "alloc"));
  if (ptr == nullptr) return fail(ctx, DT_HAL_ERR_INVALID, "alloc: ptr out-pointer is null");
  *ptr = nullptr;
  DT_HAL_TRY(refuse_in_capture(ctx, "alloc", "allocating device memory"));
  const cudaError_t e = cudaMalloc(ptr, bytes == 0 ? 256 : bytes);  // 256-byte aligned
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    *ptr = nullptr;
    return fail(ctx, DT_HAL_ERR_NOMEM, "alloc: cudaMalloc of ", bytes,
                " bytes: ", cudaGetErrorString(e));
  }
  return DT_HAL_OK;
}

void cuda_release(void* ctx, void* ptr) {
  if (ptr == nullptr) return;
  if (ctx) {
    cudaSetDevice(C(ctx)->device);
    Context* c = C(ctx);
    if (refuse_in_capture(ctx, "release", "freeing memory the graph may use") != DT_HAL_OK) {
      try {
        c->capture_frees.push_back(ptr);  // freed when the capture ends
        return;
      } catch (...) {  // out of memory: freed now, whatever the capture makes of it
      }
    }
    // Released during a capture that graph_end did not end (a caller's stream captured by the
    // caller): freed at the first release after it.
    for (void* p : c->capture_frees) cudaFree(p);
    c->capture_frees.clear();
  }
  cudaFree(ptr);  // waits for the work that may still use it
  // A failed free (a bad pointer, or inside a capture) must not be blamed on the next launch.
  (void)cudaGetLastError();
}

const char* bad_entry(int32_t code) {
  switch (code) {
    case kBadToken:
      return "embedding_fwd: token";
    case kBadTokenBwd:
      return "embedding_bwd: token";
    case kBadTarget:
      return "softmax_xent_fwd: target";
    case kBadTargetBwd:
      return "softmax_xent_bwd: target";
  }
  return "kernel: index";
}

// Waits for the current stream, after queueing derr's copy to the host behind its work, and
// reports (and clears) a bad index a kernel recorded there: every entry that waits for the device
// on the host (synchronize, a copy to the host, sum_squares) reports it, as the CPU device
// refuses such an index in the entry itself.
int finish_on_host(void* ctx, const char* fn) {
  Context* c = C(ctx);
  CU(ctx, fn,
     cudaMemcpyAsync(c->derr_host, c->derr, sizeof(DeviceError), cudaMemcpyDeviceToHost,
                     c->stream));
  CU(ctx, fn, cudaStreamSynchronize(c->stream));
  const DeviceError e = *c->derr_host;
  if (e.code == 0) return DT_HAL_OK;
  CU(ctx, fn, cudaMemsetAsync(c->derr, 0, sizeof e, c->stream));
  CU(ctx, fn, cudaStreamSynchronize(c->stream));
  if (e.limit <= 0)  // embedding_bwd knows no vocabulary size
    return fail(ctx, DT_HAL_ERR_INVALID, bad_entry(e.code), " ", e.value, " at position ",
                e.position, " is negative (found on the device; that row was not accumulated)");
  return fail(ctx, DT_HAL_ERR_INVALID, bad_entry(e.code), " ", e.value, " at position ", e.position,
              " is outside [0, ", e.limit,
              ") (found on the device after the kernel ran: that row holds no result)");
}

int cuda_copy(void* ctx, void* dst, const void* src, size_t bytes, dt_hal_copy_kind kind) {
  DT_HAL_TRY(need_ctx(ctx, "copy"));
  cudaMemcpyKind k;
  switch (kind) {
    case DT_HAL_HOST_TO_DEVICE:
      k = cudaMemcpyHostToDevice;
      break;
    case DT_HAL_DEVICE_TO_HOST:
      k = cudaMemcpyDeviceToHost;
      break;
    case DT_HAL_DEVICE_TO_DEVICE:
      k = cudaMemcpyDeviceToDevice;
      break;
    default:
      return fail(ctx, DT_HAL_ERR_INVALID, "copy: unknown copy kind ", static_cast<int>(kind));
  }
  if (bytes == 0) return DT_HAL_OK;
  if (dst == nullptr || src == nullptr)
    return fail(ctx, DT_HAL_ERR_INVALID, "copy: ", dst == nullptr ? "dst" : "src",
                " is null for a copy of ", bytes, " bytes");
  cudaStream_t s = C(ctx)->stream;
  // The host reads or reuses its buffer on return (the version-1 contract, as on the CPU device):
  // a copy to the host waits for its data, and one from the host would read it when the graph
  // runs, so neither can be part of a graph.
  if (kind != DT_HAL_DEVICE_TO_DEVICE)
    DT_HAL_TRY(refuse_in_capture(
        ctx, "copy",
        kind == DT_HAL_DEVICE_TO_HOST ? "a copy to host memory" : "a copy from host memory"));
  CU(ctx, "copy", cudaMemcpyAsync(dst, src, bytes, k, s));
  if (kind == DT_HAL_DEVICE_TO_HOST) return finish_on_host(ctx, "copy");
  if (kind == DT_HAL_HOST_TO_DEVICE) {
    // From pageable memory the call returns once the source is staged; from page-locked memory
    // (registered by MPI or UCX, say) only once the copy is queued: wait, so the caller may
    // reuse the buffer at once.
    cudaPointerAttributes a{};
    const bool locked =
        cudaPointerGetAttributes(&a, src) == cudaSuccess && a.type == cudaMemoryTypeHost;
    (void)cudaGetLastError();
    if (locked) CU(ctx, "copy", cudaStreamSynchronize(s));
  }
  return DT_HAL_OK;
}

int cuda_fill_zero(void* ctx, void* dst, size_t bytes) {
  DT_HAL_TRY(need_ctx(ctx, "fill_zero"));
  if (bytes == 0) return DT_HAL_OK;
  if (dst == nullptr)
    return fail(ctx, DT_HAL_ERR_INVALID, "fill_zero: dst is null for ", bytes, " bytes");
  CU(ctx, "fill_zero", cudaMemsetAsync(dst, 0, bytes, C(ctx)->stream));
  return DT_HAL_OK;
}

// Waits for the work of every stream of this context (its own, those made by stream_create),
// not for the whole device: NCCL's streams run collectives that their Works complete.
int cuda_synchronize(void* ctx) {
  DT_HAL_TRY(need_ctx(ctx, "synchronize"));
  Context* c = C(ctx);
  DT_HAL_TRY(refuse_in_capture(ctx, "synchronize", "waiting for the device"));
  std::vector<cudaStream_t> all;
  {
    std::lock_guard<std::mutex> lk(c->streams_mu);
    all = c->streams;
  }
  all.push_back(c->own);
  for (cudaStream_t st : all)
    if (st != c->stream) CU(ctx, "synchronize", cudaStreamSynchronize(st));
  const int rc = finish_on_host(ctx, "synchronize");
  profile_read(c);
  return rc;
}

int cuda_describe(void* ctx, char* buf, size_t len) {
  DT_HAL_TRY(need_ctx(ctx, "describe"));
  if (buf == nullptr || len == 0) return fail(ctx, DT_HAL_ERR_INVALID, "describe: no buffer");
  cudaDeviceProp p{};
  CU(ctx, "describe", cudaGetDeviceProperties(&p, C(ctx)->device));
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);
  std::snprintf(buf, len, "%s, sm_%d%d, %.1f GiB, %d SMs, driver %d.%d, runtime %d.%d", p.name,
                p.major, p.minor, static_cast<double>(p.totalGlobalMem) / (1u << 30),
                p.multiProcessorCount, drv / 1000, (drv % 1000) / 10, rt / 1000, (rt % 1000) / 10);
  return DT_HAL_OK;
}

// ---- matrix products (row-major through column-major cuBLAS) -------------------------------

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands and M/N.
int check_gemm(void* ctx, const char* fn, int ta, int tb, int64_t M, int64_t N, int64_t K,
               const void* A, int64_t lda, const void* B, int64_t ldb, const void* Cm, int64_t ldc,
               bool* empty) {
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "M", M));
  DT_HAL_TRY(need_nonneg(ctx, fn, "N", N));
  DT_HAL_TRY(need_nonneg(ctx, fn, "K", K));
  const int64_t a_cols = ta ? M : K, b_cols = tb ? K : N;
  const auto max1 = [](int64_t v) { return v > 1 ? v : int64_t{1}; };
  if (lda < max1(a_cols))
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": lda = ", lda, " < ", max1(a_cols),
                ta ? " (A is K x M, transposed)" : " (A is M x K)");
  if (ldb < max1(b_cols))
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": ldb = ", ldb, " < ", max1(b_cols),
                tb ? " (B is N x K, transposed)" : " (B is K x N)");
  if (ldc < max1(N)) return fail(ctx, DT_HAL_ERR_INVALID, fn, ": ldc = ", ldc, " < ", max1(N));
  *empty = M == 0 || N == 0;
  if (*empty) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "C", Cm, M * N));
  if (K > 0) {
    DT_HAL_TRY(need_ptr(ctx, fn, "A", A, M * K));
    DT_HAL_TRY(need_ptr(ctx, fn, "B", B, K * N));
  }
  constexpr int64_t kIntMax = 2147483647;
  if (M > kIntMax || N > kIntMax || K > kIntMax || lda > kIntMax || ldb > kIntMax || ldc > kIntMax)
    return fail(ctx, DT_HAL_ERR_UNSUPPORTED, fn, ": a size or leading dimension exceeds ", kIntMax,
                " (cuBLAS's int)");
  return DT_HAL_OK;
}

inline cublasOperation_t op(int t) { return t ? CUBLAS_OP_T : CUBLAS_OP_N; }

// Strided-batched fp32 row-major GEMM (batch 1 for a plain one).
int sgemm_rm(void* ctx, const char* fn, int ta, int tb, int64_t M, int64_t N, int64_t K,
             float alpha, const float* A, int64_t lda, int64_t sA, const float* B, int64_t ldb,
             int64_t sB, float beta, float* Cm, int64_t ldc, int64_t sC, int batch) {
  CUBLAS(ctx, fn,
         cublasSgemmStridedBatched(C(ctx)->blas, op(tb), op(ta), static_cast<int>(N),
                                   static_cast<int>(M), static_cast<int>(K), &alpha, B,
                                   static_cast<int>(ldb), sB, A, static_cast<int>(lda), sA, &beta,
                                   Cm, static_cast<int>(ldc), sC, batch));
  return DT_HAL_OK;
}

int cuda_gemm(void* ctx, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha,
              const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* Cm,
              int64_t ldc) {
  bool empty = false;
  DT_HAL_TRY(check_gemm(ctx, "gemm", ta, tb, M, N, K, A, lda, B, ldb, Cm, ldc, &empty));
  if (empty) return DT_HAL_OK;
  CUBLAS(ctx, "gemm",
         cublasSgemm(C(ctx)->blas, op(tb), op(ta), static_cast<int>(N), static_cast<int>(M),
                     static_cast<int>(K), &alpha, B, static_cast<int>(ldb), A,
                     static_cast<int>(lda), &beta, Cm, static_cast<int>(ldc)));
  return DT_HAL_OK;
}

cudaDataType_t cuda_type(dt_hal_dtype t) {
  return t == DT_HAL_F32 ? CUDA_R_32F : t == DT_HAL_BF16 ? CUDA_R_16BF : CUDA_R_16F;
}
bool known_dtype(dt_hal_dtype t) { return t == DT_HAL_F32 || t == DT_HAL_BF16 || t == DT_HAL_F16; }

// rows x cols of a matrix between fp32 (leading dimension ldf) and type t (leading dimension ld):
// blockIdx.y strides over rows, x over columns (no division per element).
__global__ void widen_matrix_kernel(float* out, int64_t ldf, const void* in, int type, int64_t rows,
                                    int64_t cols, int64_t ld) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < cols;
         j += int64_t{gridDim.x} * blockDim.x)
      out[r * ldf + j] = load_as_f32(in, r * ld + j, type);
}
__global__ void narrow_matrix_kernel(void* out, const float* in, int64_t ldf, int type,
                                     int64_t rows, int64_t cols, int64_t ld) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < cols;
         j += int64_t{gridDim.x} * blockDim.x)
      store_from_f32(out, r * ld + j, type, in[r * ldf + j]);
}
dim3 matrix_grid(int64_t rows, int64_t cols) {
  return dim3(static_cast<unsigned>(std::min<int64_t>((cols + kThreads - 1) / kThreads, 64)),
              static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(rows, 1), 65535)));
}

// *buf (of *have bytes) grown to at least `need` bytes. Refused while capturing (a capture may not
// allocate: run one step eagerly first) and while a graph exists (it may hold the old address).
int grow_scratch(void* ctx, const char* fn, void** buf, size_t* have, size_t need) {
  if (*have >= need) return DT_HAL_OK;
  Context* c = C(ctx);
  if (capturing(c->stream))
    return refuse_capturing(ctx, fn, ": the first call of this size needs ", need,
                            " bytes of scratch memory, which cannot be allocated while capturing "
                            "a graph: run one step before capturing");
  if (c->graphs > 0)
    return fail(ctx, DT_HAL_ERR_UNSUPPORTED, fn, ": this call needs ", need,
                " bytes of scratch memory, more than a live graph was captured with; growing it "
                "would free memory the graph uses: destroy the graphs first");
  cudaFree(*buf);
  *buf = nullptr;
  *have = 0;
  CU(ctx, fn, cudaMalloc(buf, need));
  *have = need;
  return DT_HAL_OK;
}

// Bytes of an element of t.
inline size_t size_of(dt_hal_dtype t) { return t == DT_HAL_F32 ? 4 : 2; }
// A matrix that starts on 16 bytes with rows of 16-byte multiples, which cuBLAS's fast kernels
// on Hopper want.
inline bool aligned16(const void* p, int64_t ld, dt_hal_dtype t) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && (ld * size_of(t)) % 16 == 0;
}
// cols rounded up to a whole number of 16 bytes of t.
inline int64_t aligned_ld(int64_t cols, dt_hal_dtype t) {
  const int64_t per = static_cast<int64_t>(16 / size_of(t));
  return (cols + per - 1) / per * per;
}

// An operand stored as rows x cols (leading dimension *ld) of type t, copied into the context's
// pad buffer `which` with aligned rows where it is not aligned; *p and *ld then name the copy.
int align_operand(void* ctx, const char* fn, int which, const void** p, int64_t* ld, int64_t rows,
                  int64_t cols, dt_hal_dtype t) {
  if (aligned16(*p, *ld, t) || rows == 0 || cols == 0) return DT_HAL_OK;
  Context* c = C(ctx);
  const int64_t lda = aligned_ld(cols, t);
  DT_HAL_TRY(grow_scratch(ctx, fn, &c->pad[which], &c->pad_bytes[which],
                          static_cast<size_t>(rows * lda) * size_of(t)));
  CU(ctx, fn,
     cudaMemcpy2DAsync(c->pad[which], static_cast<size_t>(lda) * size_of(t), *p,
                       static_cast<size_t>(*ld) * size_of(t),
                       static_cast<size_t>(cols) * size_of(t), static_cast<size_t>(rows),
                       cudaMemcpyDeviceToDevice, c->stream));
  *p = c->pad[which];
  *ld = lda;
  return DT_HAL_OK;
}

// ---- gemm_ex through cuBLASLt ----------------------------------------------------------------
//
// With DT_CUDA_LT=1 (opt-in until it has passed tests/gpu on a GPU; otherwise cublasGemmEx).
// cublasGemmEx takes cuBLAS's own choice of kernel. Here the product of a new shape (with its
// layouts, types and operand alignment) runs the first algorithm of cuBLASLt's heuristic, which
// is the same for the same shape, GPU and library, so runs stay bit for bit reproducible. With
// DT_CUDA_LT_TUNE=1 it asks for up to kLtCandidates and, outside a capture and where beta is 0
// (so that trying one leaves nothing behind: the real call overwrites the result), times each
// once after a warm-up run and keeps the fastest; the choice, and so the last bits of a sum, may
// then differ from one run to the next. On an H200 the qkv product (4096 x 2304 x 768) ran at a
// third of the rate of fc (4096 x 3072 x 768) through cublasGemmEx (perf/RESULTS.md). A shape
// cuBLASLt has no algorithm for, or refuses as not supported, goes to cublasGemmEx from then on.
// A timed first call runs 2 kLtCandidates products more
// (DT_CUDA_PROFILE counts them in that call).
constexpr int kLtCandidates = 4;

// The alignment cuBLASLt may assume of a matrix: the largest power of two (at most 256) that
// divides its address and its row pitch in bytes.
uint32_t lt_alignment(const void* p, int64_t ld, size_t elem) {
  const uint64_t v = reinterpret_cast<uintptr_t>(p) | static_cast<uint64_t>(ld * elem) | 256u;
  return static_cast<uint32_t>(v & (~v + 1));
}

// Makes the descriptors and chooses the algorithm of plan p (see above); p->ok says whether it
// can run.
void lt_plan(Context* c, LtPlan* p, int ta, int tb, int64_t M, int64_t N, int64_t K,
             const float* alpha, const void* A, int64_t lda, const void* B, int64_t ldb,
             const float* beta, void* out, int64_t ldo, dt_hal_dtype ab, dt_hal_dtype ot,
             uint32_t al_a, uint32_t al_b, uint32_t al_c) {
  // Column-major, as cublasGemmEx is called in cuda_gemm_ex: the N x M result of op(B) op(A).
  const cublasOperation_t opa = op(tb), opb = op(ta);
  if (cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa) !=
          CUBLAS_STATUS_SUCCESS ||
      cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb) !=
          CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&p->a, cuda_type(ab), tb ? K : N, tb ? N : K, ldb) !=
          CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&p->b, cuda_type(ab), ta ? M : K, ta ? K : M, lda) !=
          CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&p->c, cuda_type(ot), N, M, ldo) != CUBLAS_STATUS_SUCCESS)
    return;
  cublasLtMatmulPreference_t pref = nullptr;
  if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return;
  const uint64_t ws = kBlasWorkspace;
  cublasLtMatmulHeuristicResult_t res[kLtCandidates] = {};
  int n = 0;
  const bool asked =
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                           sizeof ws) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_b,
                                           sizeof al_b) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_a,
                                           sizeof al_a) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c,
                                           sizeof al_c) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c,
                                           sizeof al_c) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->a, p->b, p->c, p->c, pref, kLtCandidates, res,
                                     &n) == CUBLAS_STATUS_SUCCESS;
  cublasLtMatmulPreferenceDestroy(pref);
  if (!asked || n <= 0) return;
  int best = 0;
  static const bool tune = [] {
    const char* v = std::getenv("DT_CUDA_LT_TUNE");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  if (tune && n > 1 && *beta == 0.0f && !capturing(c->stream)) {
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    float best_ms = 0.0f;
    best = -1;
    if (cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess) {
      for (int i = 0; i < n; ++i) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
        auto run = [&] {
          return cublasLtMatmul(c->lt, p->op, alpha, B, p->a, A, p->b, beta, out, p->c, out, p->c,
                                &res[i].algo, c->blas_ws, kBlasWorkspace,
                                c->stream) == CUBLAS_STATUS_SUCCESS;
        };
        float ms = 0.0f;
        if (!run() || cudaEventRecord(e0, c->stream) != cudaSuccess || !run() ||
            cudaEventRecord(e1, c->stream) != cudaSuccess ||
            cudaEventSynchronize(e1) != cudaSuccess ||
            cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess)
          continue;
        if (best < 0 || ms < best_ms) {
          best = i;
          best_ms = ms;
        }
      }
    }
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    (void)cudaGetLastError();
    if (best < 0) best = 0;  // nothing could be timed: the heuristic's first
  }
  p->algo = res[best].algo;
  p->ok = true;
}

// The product of cuda_gemm_ex (the same arguments, after its operand copies) through cuBLASLt;
// *done false where it must go through cublasGemmEx instead.
int lt_gemm(void* ctx, const char* fn, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha,
            const void* A, int64_t lda, const void* B, int64_t ldb, float beta, void* out,
            int64_t ldo, dt_hal_dtype ab, dt_hal_dtype ot, bool* done) {
  *done = false;
  Context* c = C(ctx);
  static const bool off = [] {
    const char* v = std::getenv("DT_CUDA_LT");
    return v == nullptr || std::strcmp(v, "1") != 0;
  }();
  if (off || c->lt == nullptr || K == 0) return DT_HAL_OK;
  const uint32_t al_a = lt_alignment(A, lda, size_of(ab)), al_b = lt_alignment(B, ldb, size_of(ab)),
                 al_c = lt_alignment(out, ldo, size_of(ot));
  const LtKey key{ta, tb, M, N, K, lda, ldb, ldo, ab, ot, al_a, al_b, al_c, beta == 0.0f};
  LtPlan* p = nullptr;
  {
    std::lock_guard<std::mutex> lock(c->lt_mu);
    auto it = c->lt_plans.find(key);
    if (it == c->lt_plans.end()) {
      it = c->lt_plans.try_emplace(key).first;
      lt_plan(c, &it->second, ta, tb, M, N, K, &alpha, A, lda, B, ldb, &beta, out, ldo, ab, ot,
              al_a, al_b, al_c);
    }
    p = &it->second;
  }
  if (!p->ok) return DT_HAL_OK;
  const cublasStatus_t st =
      cublasLtMatmul(c->lt, p->op, &alpha, B, p->a, A, p->b, &beta, out, p->c, out, p->c, &p->algo,
                     c->blas_ws, kBlasWorkspace, c->stream);
  if (st != CUBLAS_STATUS_SUCCESS) {
    // Refused before it ran (C untouched): cublasGemmEx, now and from now on. Anything else, or
    // any refusal inside a capture, is reported as cuBLAS's own errors are.
    const bool refused = st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE;
    if (!refused || capturing(c->stream))
      return fail(ctx,
                  st == CUBLAS_STATUS_NOT_SUPPORTED ? DT_HAL_ERR_UNSUPPORTED : DT_HAL_ERR_DEVICE,
                  fn, ": cublasLtMatmul: ", cublasGetStatusString(st));
    (void)cudaGetLastError();
    p->ok = false;
    return DT_HAL_OK;
  }
  *done = true;
  return DT_HAL_OK;
}

int cuda_gemm_ex(void* ctx, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha,
                 const void* A, int64_t lda, const void* B, int64_t ldb, float beta, void* Cm,
                 int64_t ldc, dt_hal_dtype ab_type, dt_hal_dtype c_type) {
  const char* fn = "gemm_ex";
  DT_HAL_TRY(need_ctx(ctx, fn));
  if (!known_dtype(ab_type) || !known_dtype(c_type))
    return fail(ctx, DT_HAL_ERR_INVALID, "gemm_ex: unknown dtype (ab ", static_cast<int>(ab_type),
                ", c ", static_cast<int>(c_type), ")");
  bool empty = false;
  DT_HAL_TRY(check_gemm(ctx, fn, ta, tb, M, N, K, A, lda, B, ldb, Cm, ldc, &empty));
  if (empty) return DT_HAL_OK;
  Context* c = C(ctx);
  // Operands without aligned rows are copied into aligned ones first: on an H200 the product of
  // a [50257 x 4096] bf16 operand with rows of 50257 elements ran at 142 TFLOP/s, and at 311 on
  // the aligned copy, the copy included (perf/RESULTS.md). The result is the same sum, up to the
  // order cuBLAS's kernels add in.
  if (K > 0) {
    DT_HAL_TRY(align_operand(ctx, fn, 0, &A, &lda, ta ? K : M, ta ? M : K, ab_type));
    DT_HAL_TRY(align_operand(ctx, fn, 1, &B, &ldb, tb ? N : K, tb ? K : N, ab_type));
  }
  // cuBLAS with fp32 compute takes C of the operand type or fp32 (fp32 operands: fp32 C only);
  // other pairings go through an fp32 result in scratch, rounded once to c_type. (An fp32 C
  // without aligned rows stays where it is: through scratch it was slower.)
  const bool direct = c_type == ab_type || c_type == DT_HAL_F32;
  void* out = Cm;
  int64_t ldo = ldc;
  dt_hal_dtype otype = c_type;
  if (!direct) {
    ldo = N;
    DT_HAL_TRY(grow_scratch(ctx, fn, &c->scratch, &c->scratch_bytes,
                            static_cast<size_t>(M * ldo) * sizeof(float)));
    out = c->scratch;
    otype = DT_HAL_F32;
    if (beta != 0.0f) {
      widen_matrix_kernel<<<matrix_grid(M, N), kThreads, 0, c->stream>>>(
          static_cast<float*>(out), ldo, Cm, c_type, M, N, ldc);
      LAUNCHED(ctx, fn);
    }
  }
  bool done = false;
  if (ab_type != DT_HAL_F32)
    DT_HAL_TRY(lt_gemm(ctx, fn, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, out, ldo, ab_type,
                       otype, &done));
  if (!done)
    CUBLAS(ctx, fn,
           cublasGemmEx(c->blas, op(tb), op(ta), static_cast<int>(N), static_cast<int>(M),
                        static_cast<int>(K), &alpha, B, cuda_type(ab_type), static_cast<int>(ldb),
                        A, cuda_type(ab_type), static_cast<int>(lda), &beta, out, cuda_type(otype),
                        static_cast<int>(ldo), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  if (!direct) {
    narrow_matrix_kernel<<<matrix_grid(M, N), kThreads, 0, c->stream>>>(
        Cm, static_cast<const float*>(out), ldo, c_type, M, N, ldc);
    LAUNCHED(ctx, fn);
  }
  return DT_HAL_OK;
}

// ---- elementwise and small reductions ------------------------------------------------------

#define GRID_STRIDE(i, n)                                                   \
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < (n); \
       i += int64_t{gridDim.x} * blockDim.x)

// Memory-bound work on the elements [0, n), U of them per thread a block's width apart (so that a
// warp's accesses stay coalesced), all U loaded before any is stored: U loads per thread are in
// flight, which a memory-bound kernel needs to come near the memory's bandwidth (one element per
// thread leaves it at a third to a half). load(i) reads what element i needs and computes its
// value, store(i, value) writes it; a thread reads its elements before it writes them, so calls
// in place stay right. The thread starts at `first` and steps by `threads` (all threads that
// share the work) times U.
template <int U, class T, class Load, class Store>
__device__ inline void unrolled(int64_t first, int64_t n, int64_t threads, Load load, Store store) {
  for (int64_t base = first; base < n; base += threads * U) {
    T v[U]{};
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int64_t i = base + int64_t{k} * blockDim.x;
      if (i < n) v[k] = load(i);
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int64_t i = base + int64_t{k} * blockDim.x;
      if (i < n) store(i, v[k]);
    }
  }
}
// unrolled() over [0, n) by the whole grid (launched with grid_for<U>(n) blocks of kThreads).
template <int U, class T, class Load, class Store>
__device__ inline void grid_unrolled(int64_t n, Load load, Store store) {
  unrolled<U, T>(int64_t{blockIdx.x} * blockDim.x * U + threadIdx.x, n,
                 int64_t{gridDim.x} * blockDim.x, load, store);
}
template <int U>
unsigned grid_for(int64_t n) {
  return blocks_for(n, kThreads * U);
}
// Blocks for one row each (grid-strided past the cap).
unsigned rows_grid(int64_t rows) {
  return static_cast<unsigned>(rows < 65535 * 16 ? (rows > 0 ? rows : 1) : 65535 * 16);
}

// A block per row (grid-strided), its threads over the row's columns.
__global__ void bias_add_kernel(float* out, const float* bias, int64_t N, int64_t Cc) {
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    float* row = out + r * Cc;
    unrolled<4, float>(
        threadIdx.x, Cc, blockDim.x, [&](int64_t j) { return row[j] + bias[j]; },
        [&](int64_t j, float x) { row[j] = x; });
  }
}

// Column sums: a block is kSumCols columns x kSumLanes row lanes; each lane sums a strided set of
// rows, and the lanes' partial sums of a column are added in shared memory by a tree of fixed
// shape (deterministic). Eight columns of fp32 are one 32-byte sector of memory, so a warp's loads
// (four rows of eight columns) waste none, and a width of 768 columns gives 96 blocks, enough to
// keep most of a large GPU's multiprocessors reading.
constexpr int kSumCols = 8, kSumLanes = 128;
const dim3 kSumBlock(kSumCols, kSumLanes);
unsigned column_blocks(int64_t Cc) { return static_cast<unsigned>((Cc + kSumCols - 1) / kSumCols); }
// Adds the lanes' partial sums part[lane][col] into part[0][col] (all threads of the block).
__device__ inline void sum_lanes(float (*part)[kSumCols + 1]) {
  for (int stride = kSumLanes / 2; stride > 0; stride /= 2) {
    __syncthreads();
    if (threadIdx.y < stride)
      part[threadIdx.y][threadIdx.x] += part[threadIdx.y + stride][threadIdx.x];
  }
  __syncthreads();
}
__global__ void __launch_bounds__(kSumCols* kSumLanes)
    column_sums_kernel(float* acc, const float* x, int64_t N, int64_t Cc) {
  __shared__ float part[kSumLanes][kSumCols + 1];
  const int64_t col = int64_t{blockIdx.x} * kSumCols + threadIdx.x;
  float s = 0.0f;
  if (col < Cc) {
#pragma unroll 4
    for (int64_t n = threadIdx.y; n < N; n += kSumLanes) s += x[n * Cc + col];
  }
  part[threadIdx.y][threadIdx.x] = s;
  sum_lanes(part);
  if (threadIdx.y == 0 && col < Cc) acc[col] += part[0][threadIdx.x];
}

int cuda_bias_add(void* ctx, float* out, const float* bias, int64_t N, int64_t Cc) {
  const char* fn = "bias_add";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "N", N));
  DT_HAL_TRY(need_nonneg(ctx, fn, "C", Cc));
  if (N == 0 || Cc == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, N * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "bias", bias, Cc));
  bias_add_kernel<<<rows_grid(N), kThreads, 0, C(ctx)->stream>>>(out, bias, N, Cc);
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

int cuda_bias_grad(void* ctx, float* dbias, const float* dout, int64_t N, int64_t Cc) {
  const char* fn = "bias_grad";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "N", N));
  DT_HAL_TRY(need_nonneg(ctx, fn, "C", Cc));
  if (N == 0 || Cc == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "dbias", dbias, Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "dout", dout, N * Cc));
  column_sums_kernel<<<column_blocks(Cc), kSumBlock, 0, C(ctx)->stream>>>(dbias, dout, N, Cc);
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

__global__ void add_kernel(float* out, const float* a, const float* b, int64_t n) {
  grid_unrolled<4, float>(
      n, [&](int64_t i) { return a[i] + b[i]; }, [&](int64_t i, float x) { out[i] = x; });
}
__global__ void scale_kernel(float* x, float s, int64_t n) {
  grid_unrolled<4, float>(
      n, [&](int64_t i) { return x[i] * s; }, [&](int64_t i, float y) { x[i] = y; });
}

int cuda_add(void* ctx, float* out, const float* a, const float* b, int64_t n) {
  const char* fn = "add";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "a", a, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "b", b, n));
  if (n == 0) return DT_HAL_OK;
  add_kernel<<<grid_for<4>(n), kThreads, 0, C(ctx)->stream>>>(out, a, b, n);
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

int cuda_scale(void* ctx, float* x, float s, int64_t n) {
  const char* fn = "scale";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  DT_HAL_TRY(need_ptr(ctx, fn, "x", x, n));
  if (n == 0) return DT_HAL_OK;
  scale_kernel<<<grid_for<4>(n), kThreads, 0, C(ctx)->stream>>>(x, s, n);
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

constexpr int kSumBlocks = 1024;  // fixed grid: the summation order does not depend on timing

__global__ void sum_squares_kernel(double* partials, const float* x, int64_t n) {
  double s = 0.0;
  GRID_STRIDE(i, n) s += static_cast<double>(x[i]) * x[i];
  s = block_sum(s);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}
__global__ void sum_partials_kernel(double* out, const double* partials, int count) {
  double s = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) s += partials[i];
  s = block_sum(s);
  if (threadIdx.x == 0) *out = s;
}

int cuda_sum_squares(void* ctx, const float* x, int64_t n, double* out) {
  const char* fn = "sum_squares";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  DT_HAL_TRY(need_ptr(ctx, fn, "x", x, n));
  if (out == nullptr) return fail(ctx, DT_HAL_ERR_INVALID, "sum_squares: out is null");
  DT_HAL_TRY(refuse_in_capture(ctx, fn, "returning a result to the host"));
  Context* c = C(ctx);
  sum_squares_kernel<<<kSumBlocks, kThreads, 0, c->stream>>>(c->partials, x, n);
  LAUNCHED(ctx, fn);
  sum_partials_kernel<<<1, 1024, 0, c->stream>>>(c->partials + kSumBlocks, c->partials, kSumBlocks);
  LAUNCHED(ctx, fn);
  // The result goes to the host: this entry waits for it.
  CU(ctx, fn,
     cudaMemcpyAsync(out, c->partials + kSumBlocks, sizeof(double), cudaMemcpyDeviceToHost,
                     c->stream));
  return finish_on_host(ctx, fn);
}

// ---- transformer layers ---------------------------------------------------------------------

__global__ void embedding_fwd_kernel(float* out, const int32_t* tokens, const float* wte,
                                     const float* wpe, int64_t B, int64_t T, int64_t Cc, int64_t V,
                                     DeviceError* err) {
  GRID_STRIDE(i, B * T * Cc) {
    const int64_t bt = i / Cc, ch = i % Cc, t = bt % T;
    const int32_t tok = tokens[bt];
    if (tok < 0 || tok >= V) {
      if (ch == 0) record_bad(err, kBadToken, bt, tok, V);
      out[i] = 0.0f;
      continue;
    }
    out[i] = wte[static_cast<int64_t>(tok) * Cc + ch] + wpe[t * Cc + ch];
  }
}

int cuda_embedding_fwd(void* ctx, float* out, const int32_t* tokens, const float* wte,
                       const float* wpe, int64_t B, int64_t T, int64_t Cc, int64_t V) {
  const char* fn = "embedding_fwd";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "B", B));
  DT_HAL_TRY(need_nonneg(ctx, fn, "T", T));
  DT_HAL_TRY(need_nonneg(ctx, fn, "C", Cc));
  DT_HAL_TRY(need_nonneg(ctx, fn, "V", V));
  if (B * T * Cc == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "tokens", tokens, B * T));
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, B * T * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "wte", wte, V * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "wpe", wpe, T * Cc));
  embedding_fwd_kernel<<<blocks_for(B * T * Cc), kThreads, 0, C(ctx)->stream>>>(
      out, tokens, wte, wpe, B, T, Cc, V, C(ctx)->derr);
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

__global__ void embedding_bwd_wte_kernel(float* dwte, const float* dout, const int32_t* tokens,
                                         int64_t BT, int64_t Cc, DeviceError* err) {
  GRID_STRIDE(i, BT * Cc) {
    const int64_t bt = i / Cc, ch = i % Cc;
    const int32_t tok = tokens[bt];
    if (tok < 0) {
      if (ch == 0) record_bad(err, kBadTokenBwd, bt, tok, 0);
      continue;
    }
    atomicAdd(&dwte[static_cast<int64_t>(tok) * Cc + ch], dout[i]);
  }
}
// dwpe[t, c] += sum_b dout[b, t, c], one thread per (t, c), b in order.
__global__ void embedding_bwd_wpe_kernel(float* dwpe, const float* dout, int64_t B, int64_t T,
                                         int64_t Cc) {
  GRID_STRIDE(i, T * Cc) {
    float s = 0.0f;
    for (int64_t b = 0; b < B; ++b) s += dout[b * T * Cc + i];
    dwpe[i] += s;
  }
}

int cuda_embedding_bwd(void* ctx, float* dwte, float* dwpe, const float* dout,
                       const int32_t* tokens, int64_t B, int64_t T, int64_t Cc) {
  const char* fn = "embedding_bwd";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "B", B));
  DT_HAL_TRY(need_nonneg(ctx, fn, "T", T));
  DT_HAL_TRY(need_nonneg(ctx, fn, "C", Cc));
  if (B * T == 0 || Cc == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "tokens", tokens, B * T));
  DT_HAL_TRY(need_ptr(ctx, fn, "dout", dout, B * T * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "dwte", dwte, Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "dwpe", dwpe, T * Cc));
  cudaStream_t s = C(ctx)->stream;
  embedding_bwd_wte_kernel<<<blocks_for(B * T * Cc), kThreads, 0, s>>>(dwte, dout, tokens, B * T,
                                                                       Cc, C(ctx)->derr);
  LAUNCHED(ctx, fn);
  embedding_bwd_wpe_kernel<<<blocks_for(T * Cc), kThreads, 0, s>>>(dwpe, dout, B, T, Cc);
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

// One warp per row.
__global__ void layernorm_fwd_kernel(float* out, float* mean, float* rstd, const float* inp,
                                     const float* w, const float* b, int64_t N, int64_t Cc) {
  const int64_t n = blockIdx.x * int64_t{blockDim.y} + threadIdx.y;
  if (n >= N) return;
  const float* x = inp + n * Cc;
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < Cc; i += 32) s += x[i];
  const float m = warp_sum(s) / static_cast<float>(Cc);
  float v = 0.0f;
  for (int64_t i = threadIdx.x; i < Cc; i += 32) v += (x[i] - m) * (x[i] - m);
  const float rs = 1.0f / sqrtf(warp_sum(v) / static_cast<float>(Cc) + 1e-5f);
  float* o = out + n * Cc;
  for (int64_t i = threadIdx.x; i < Cc; i += 32) o[i] = (x[i] - m) * rs * w[i] + b[i];
  if (threadIdx.x == 0) {
    mean[n] = m;
    rstd[n] = rs;
  }
}

int cuda_layernorm_fwd(void* ctx, float* out, float* mean, float* rstd, const float* inp,
                       const float* w, const float* b, int64_t N, int64_t Cc) {
  const char* fn = "layernorm_fwd";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "N", N));
  DT_HAL_TRY(need_nonneg(ctx, fn, "C", Cc));
  if (N == 0) return DT_HAL_OK;
  if (Cc == 0) return fail(ctx, DT_HAL_ERR_INVALID, "layernorm_fwd: C = 0 (empty rows)");
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, N * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "mean", mean, N));
  DT_HAL_TRY(need_ptr(ctx, fn, "rstd", rstd, N));
  DT_HAL_TRY(need_ptr(ctx, fn, "inp", inp, N * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "w", w, Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "b", b, Cc));
  layernorm_fwd_kernel<<<static_cast<unsigned>((N + 7) / 8), dim3(32, 8), 0, C(ctx)->stream>>>(
      out, mean, rstd, inp, w, b, N, Cc);
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

// dinp (acc), one warp per row: dx += (w d - mean(w d) - xh mean(w d xh)) rstd.
__global__ void layernorm_bwd_dx_kernel(float* dinp, const float* dout, const float* inp,
                                        const float* w, const float* mean, const float* rstd,
                                        int64_t N, int64_t Cc) {
  const int64_t n = blockIdx.x * int64_t{blockDim.y} + threadIdx.y;
  if (n >= N) return;
  const float* x = inp + n * Cc;
  const float* d = dout + n * Cc;
  const float m = mean[n], rs = rstd[n];
  float sg = 0.0f, sgx = 0.0f;
  for (int64_t i = threadIdx.x; i < Cc; i += 32) {
    const float g = w[i] * d[i];
    sg += g;
    sgx += g * ((x[i] - m) * rs);
  }
  const float mg = warp_sum(sg) / static_cast<float>(Cc);
  const float mgx = warp_sum(sgx) / static_cast<float>(Cc);
  float* dx = dinp + n * Cc;
  for (int64_t i = threadIdx.x; i < Cc; i += 32)
    dx[i] += (w[i] * d[i] - mg - (x[i] - m) * rs * mgx) * rs;
}
// dw += sum_n xh dout, db += sum_n dout (acc), column tiles as in column_sums_kernel.
__global__ void __launch_bounds__(kSumCols* kSumLanes)
    layernorm_bwd_dwdb_kernel(float* dw, float* db, const float* dout, const float* inp,
                              const float* mean, const float* rstd, int64_t N, int64_t Cc) {
  __shared__ float pw[kSumLanes][kSumCols + 1], pb[kSumLanes][kSumCols + 1];
  const int64_t col = int64_t{blockIdx.x} * kSumCols + threadIdx.x;
  float sw = 0.0f, sb = 0.0f;
  if (col < Cc) {
#pragma unroll 4
    for (int64_t n = threadIdx.y; n < N; n += kSumLanes) {
      const float d = dout[n * Cc + col];
      sb += d;
      sw += (inp[n * Cc + col] - mean[n]) * rstd[n] * d;
    }
  }
  pw[threadIdx.y][threadIdx.x] = sw;
  pb[threadIdx.y][threadIdx.x] = sb;
  sum_lanes(pw);
  sum_lanes(pb);
  if (threadIdx.y == 0 && col < Cc) {
    dw[col] += pw[0][threadIdx.x];
    db[col] += pb[0][threadIdx.x];
  }
}

int cuda_layernorm_bwd(void* ctx, float* dinp, float* dw, float* db, const float* dout,
                       const float* inp, const float* w, const float* mean, const float* rstd,
                       int64_t N, int64_t Cc) {
  const char* fn = "layernorm_bwd";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "N", N));
  DT_HAL_TRY(need_nonneg(ctx, fn, "C", Cc));
  if (N == 0 || Cc == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "dinp", dinp, N * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "dw", dw, Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "db", db, Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "dout", dout, N * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "inp", inp, N * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "w", w, Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "mean", mean, N));
  DT_HAL_TRY(need_ptr(ctx, fn, "rstd", rstd, N));
  cudaStream_t s = C(ctx)->stream;
  layernorm_bwd_dx_kernel<<<static_cast<unsigned>((N + 7) / 8), dim3(32, 8), 0, s>>>(
      dinp, dout, inp, w, mean, rstd, N, Cc);
  LAUNCHED(ctx, fn);
  layernorm_bwd_dwdb_kernel<<<column_blocks(Cc), kSumBlock, 0, s>>>(dw, db, dout, inp, mean, rstd,
                                                                    N, Cc);
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

constexpr float kGeluK = 0.7978845608028654f;
constexpr float kGeluA = 0.044715f;

// The CPU device's formulation: s = 0.5 (1 + tanh u) = 1 / (1 + e^{-2u}), computed from
// e = e^{-2|u|} so that nothing cancels for u < 0 (1 + tanhf(u) would lose most of its digits).
__device__ inline void gelu_parts(float x, float& s, float& e, float& sp) {
  const float u = kGeluK * (x + kGeluA * x * x * x);
  e = expf(-2.0f * fabsf(u));
  sp = 1.0f / (1.0f + e);
  s = u >= 0.0f ? sp : e * sp;
}
__global__ void gelu_fwd_kernel(float* out, const float* inp, int64_t n) {
  grid_unrolled<4, float>(
      n,
      [&](int64_t i) {
        const float x = inp[i];
        float s, e, sp;
        gelu_parts(x, s, e, sp);
        return x * s;
      },
      [&](int64_t i, float y) { out[i] = y; });
}
// d/dx GELU = s + 2 x s (1 - s) u'(x), with s (1 - s) = e sp^2 for either sign of u; the second
// term is 0 where e is (x^2 may be +inf there, and 0 * inf NaN).
__global__ void gelu_bwd_kernel(float* dinp, const float* inp, const float* dout, int64_t n) {
  grid_unrolled<4, float>(
      n,
      [&](int64_t i) {
        const float x = inp[i];
        float s, e, sp;
        gelu_parts(x, s, e, sp);
        const float d =
            e > 0.0f ? 2.0f * x * (e * sp * sp) * kGeluK * (1.0f + 3.0f * kGeluA * x * x) : 0.0f;
        return dinp[i] + dout[i] * (s + d);
      },
      [&](int64_t i, float y) { dinp[i] = y; });
}

int cuda_gelu_fwd(void* ctx, float* out, const float* inp, int64_t n) {
  const char* fn = "gelu_fwd";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "inp", inp, n));
  if (n == 0) return DT_HAL_OK;
  gelu_fwd_kernel<<<grid_for<4>(n), kThreads, 0, C(ctx)->stream>>>(out, inp, n);
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

int cuda_gelu_bwd(void* ctx, float* dinp, const float* inp, const float* dout, int64_t n) {
  const char* fn = "gelu_bwd";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  DT_HAL_TRY(need_ptr(ctx, fn, "dinp", dinp, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "inp", inp, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "dout", dout, n));
  if (n == 0) return DT_HAL_OK;
  gelu_bwd_kernel<<<grid_for<4>(n), kThreads, 0, C(ctx)->stream>>>(dinp, inp, dout, n);
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

// Row r (of B*NH*T rows, t = r % T): softmax over [0, t], zeros after; with lse, its
// log-sum-exp max + log(sum) into lse[r]. One block per row.
__global__ void causal_softmax_kernel(float* att, float* lse, int64_t T) {
  const int64_t r = blockIdx.x;
  const int64_t len = r % T + 1;
  float* row = att + r * T;
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) m = fmaxf(m, row[i]);
  m = block_max(m);
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    const float e = expf(row[i] - m);
    row[i] = e;
    s += e;
  }
  s = block_sum(s);
  if (lse != nullptr && threadIdx.x == 0) lse[r] = m + logf(s);
  const float inv = 1.0f / s;
  for (int64_t i = threadIdx.x; i < T; i += blockDim.x) row[i] = i < len ? row[i] * inv : 0.0f;
}
// d[i] = scale a[i] (d[i] - sum_j a[j] d[j]) on [0, t], zeros after.
__global__ void causal_softmax_bwd_kernel(float* d, const float* a, int64_t T, float scale) {
  const int64_t r = blockIdx.x;
  const int64_t len = r % T + 1;
  float* dr = d + r * T;
  const float* ar = a + r * T;
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) s += ar[i] * dr[i];
  s = block_sum(s);
  for (int64_t i = threadIdx.x; i < T; i += blockDim.x)
    dr[i] = i < len ? scale * ar[i] * (dr[i] - s) : 0.0f;
}

// The same two softmaxes with a row held in registers (T at most kSoftmaxThreads * kPer): one read
// and one write of the row instead of three and two, and the 16-bit rounding the products take
// (type, into lp; none when lp is null) written in the same pass. The sums run in the same order
// as above, so the results are the same bits.
constexpr int kSoftmaxThreads = 256;
int narrow_into(void* ctx, const char* fn, uint16_t* out, const float* in, int64_t n,
                dt_hal_dtype t);
template <int kPer>
__global__ void causal_softmax_rows_kernel(float* att, uint16_t* lp, float* lse, int type,
                                           int64_t T) {
  const int64_t r = blockIdx.x;
  const int64_t len = r % T + 1;
  float* row = att + r * T;
  float v[kPer];
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int64_t i = threadIdx.x + int64_t{k} * blockDim.x;
    v[k] = i < len ? row[i] : -INFINITY;
    m = fmaxf(m, v[k]);
  }
  m = block_max(m);
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int64_t i = threadIdx.x + int64_t{k} * blockDim.x;
    if (i < len) {
      v[k] = expf(v[k] - m);
      s += v[k];
    }
  }
  s = block_sum(s);
  if (lse != nullptr && threadIdx.x == 0) lse[r] = m + logf(s);
  const float inv = 1.0f / s;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int64_t i = threadIdx.x + int64_t{k} * blockDim.x;
    if (i >= T) break;
    const float x = i < len ? v[k] * inv : 0.0f;
    row[i] = x;
    if (lp != nullptr) lp[r * T + i] = type == DT_HAL_BF16 ? bf16_of(x) : f16_of(x);
  }
}
template <int kPer>
__global__ void causal_softmax_bwd_rows_kernel(float* d, uint16_t* lp, int type, const float* a,
                                               int64_t T, float scale) {
  const int64_t r = blockIdx.x;
  const int64_t len = r % T + 1;
  float* dr = d + r * T;
  const float* ar = a + r * T;
  float av[kPer], dv[kPer];
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int64_t i = threadIdx.x + int64_t{k} * blockDim.x;
    av[k] = i < len ? ar[i] : 0.0f;
    dv[k] = i < len ? dr[i] : 0.0f;
    if (i < len) s += av[k] * dv[k];
  }
  s = block_sum(s);
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int64_t i = threadIdx.x + int64_t{k} * blockDim.x;
    if (i >= T) break;
    const float x = i < len ? scale * av[k] * (dv[k] - s) : 0.0f;
    dr[i] = x;
    if (lp != nullptr) lp[r * T + i] = type == DT_HAL_BF16 ? bf16_of(x) : f16_of(x);
  }
}

// Calls launch(std::integral_constant<int, kPer>{}) with the smallest kPer of 1, 2, 4, 8 whose
// register rows hold T; false when T is longer (the looped kernels then).
template <class F>
bool with_row_registers(int64_t T, F&& launch) {
  if (T <= kSoftmaxThreads) return launch(std::integral_constant<int, 1>{}), true;
  if (T <= 2 * kSoftmaxThreads) return launch(std::integral_constant<int, 2>{}), true;
  if (T <= 4 * kSoftmaxThreads) return launch(std::integral_constant<int, 4>{}), true;
  if (T <= 8 * kSoftmaxThreads) return launch(std::integral_constant<int, 8>{}), true;
  return false;
}

// The softmax of attention_fwd_run over `rows` rows of T, with the 16-bit copy in lp (null: none)
// and the rows' log-sum-exp in lse (null: none).
int causal_softmax(void* ctx, const char* fn, float* att, uint16_t* lp, float* lse,
                   dt_hal_dtype type, int64_t rows, int64_t T) {
  const cudaStream_t st = C(ctx)->stream;
  const unsigned grid = static_cast<unsigned>(rows);
  const bool fast = with_row_registers(T, [&](auto per) {
    causal_softmax_rows_kernel<decltype(per)::value>
        <<<grid, kSoftmaxThreads, 0, st>>>(att, lp, lse, static_cast<int>(type), T);
  });
  if (!fast) causal_softmax_kernel<<<grid, kThreads, 0, st>>>(att, lse, T);
  LAUNCHED(ctx, fn);
  if (!fast && lp != nullptr) return narrow_into(ctx, fn, lp, att, rows * T, type);
  return DT_HAL_OK;
}
// The softmax backward of attention_bwd_run: S into d (fp32), and its 16-bit rounding into lp.
int causal_softmax_bwd(void* ctx, const char* fn, float* d, uint16_t* lp, dt_hal_dtype type,
                       const float* a, int64_t rows, int64_t T, float scale) {
  const cudaStream_t st = C(ctx)->stream;
  const unsigned grid = static_cast<unsigned>(rows);
  const bool fast = with_row_registers(T, [&](auto per) {
    causal_softmax_bwd_rows_kernel<decltype(per)::value>
        <<<grid, kSoftmaxThreads, 0, st>>>(d, lp, static_cast<int>(type), a, T, scale);
  });
  if (!fast) causal_softmax_bwd_kernel<<<grid, kThreads, 0, st>>>(d, a, T, scale);
  LAUNCHED(ctx, fn);
  if (!fast && lp != nullptr) return narrow_into(ctx, fn, lp, d, rows * T, type);
  return DT_HAL_OK;
}

int check_attention(void* ctx, const char* fn, int64_t B, int64_t T, int64_t Cc, int64_t NH) {
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "B", B));
  DT_HAL_TRY(need_nonneg(ctx, fn, "T", T));
  DT_HAL_TRY(need_nonneg(ctx, fn, "C", Cc));
  if (NH <= 0) return fail(ctx, DT_HAL_ERR_INVALID, fn, ": NH = ", NH, " must be positive");
  if (Cc % NH != 0)
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": NH = ", NH, " does not divide C = ", Cc);
  if (Cc == 0) return fail(ctx, DT_HAL_ERR_INVALID, fn, ": C = 0 (heads of size 0)");
  if (T > 2147483647 || 3 * Cc > 2147483647 || B * NH > 2147483647)
    return fail(ctx, DT_HAL_ERR_UNSUPPORTED, fn, ": T = ", T, " or 3C = ", 3 * Cc,
                " exceeds cuBLAS's int");
  return DT_HAL_OK;
}

// The arguments of attention_fwd and attention_fwd_ex (fn names the entry); *empty when there is
// nothing to do.
int attention_fwd_args(void* ctx, const char* fn, const float* out, const float* att,
                       const float* qkv, int64_t B, int64_t T, int64_t Cc, int64_t NH,
                       dt_hal_dtype dtype, bool* empty) {
  DT_HAL_TRY(check_attention(ctx, fn, B, T, Cc, NH));
  if (!known_dtype(dtype))
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": unknown dtype ", static_cast<int>(dtype));
  *empty = B * T == 0;
  if (*empty) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, B * T * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "att", att, B * NH * T * T));
  DT_HAL_TRY(need_ptr(ctx, fn, "qkv", qkv, B * T * 3 * Cc));
  return DT_HAL_OK;
}

// The same for attention_bwd and attention_bwd_ex.
int attention_bwd_args(void* ctx, const char* fn, const float* dqkv, const float* scratch,
                       const float* dout, const float* qkv, const float* att, int64_t B, int64_t T,
                       int64_t Cc, int64_t NH, dt_hal_dtype dtype, bool* empty) {
  DT_HAL_TRY(check_attention(ctx, fn, B, T, Cc, NH));
  if (!known_dtype(dtype))
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": unknown dtype ", static_cast<int>(dtype));
  *empty = B * T == 0;
  if (*empty) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "dqkv", dqkv, B * T * 3 * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "scratch", scratch, B * NH * T * T));
  DT_HAL_TRY(need_ptr(ctx, fn, "dout", dout, B * T * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "qkv", qkv, B * T * 3 * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "att", att, B * NH * T * T));
  return DT_HAL_OK;
}

// (m, s) of a set of values: their maximum and the sum of e^(x - m); two sets combined.
struct MaxSum {
  float m, s;
};
__device__ inline MaxSum combine(MaxSum a, MaxSum b) {
  if (a.m < b.m) {
    const MaxSum t = a;
    a = b;
    b = t;
  }
  // a.m >= b.m (or both -inf: nothing seen yet)
  return {a.m, b.s == 0.0f ? a.s : a.s + b.s * expf(b.m - a.m)};
}
__device__ MaxSum block_maxsum(MaxSum v) {
  __shared__ MaxSum part[32];
  for (int o = 16; o > 0; o >>= 1)
    v = combine(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  MaxSum r = lane < nwarps ? part[lane] : MaxSum{-INFINITY, 0.0f};
  for (int o = 16; o > 0; o >>= 1)
    r = combine(r, {__shfl_xor_sync(0xffffffffu, r.m, o), __shfl_xor_sync(0xffffffffu, r.s, o)});
  return r;
}

// One block per row: probs = softmax(x), loss = log(sum e^(x - max)) - (x_target - max). The
// maximum and the sum come from one pass over the row (the sum rescaled as the maximum grows),
// the probabilities from a second: two reads of the logits instead of three.
__global__ void softmax_xent_fwd_kernel(float* losses, float* probs, const float* logits,
                                        const int32_t* targets, int64_t V, DeviceError* err) {
  const int64_t n = blockIdx.x;
  const float* x = logits + n * V;
  float* p = probs + n * V;
  // Each thread's elements in their order (threadIdx.x + k blockDim.x), kUnroll of them loaded
  // ahead of their use.
  constexpr int kUnroll = 4;
  MaxSum ms{-INFINITY, 0.0f};
  unrolled<kUnroll, float>(
      threadIdx.x, V, blockDim.x, [&](int64_t i) { return x[i]; },
      [&](int64_t, float xi) {
        if (xi > ms.m) {
          ms.s = ms.s * expf(ms.m - xi) + 1.0f;
          ms.m = xi;
        } else if (xi != -INFINITY) {  // -inf adds nothing (and e^(-inf - -inf) would be NaN)
          ms.s += expf(xi - ms.m);
        }
      });
  ms = block_maxsum(ms);
  const float m = ms.m, s = ms.s;
  const float inv = 1.0f / s;
  unrolled<kUnroll, float>(
      threadIdx.x, V, blockDim.x, [&](int64_t i) { return expf(x[i] - m) * inv; },
      [&](int64_t i, float pi) { p[i] = pi; });
  if (threadIdx.x == 0) {
    const int32_t t = targets[n];
    if (t < 0 || t >= V) {
      record_bad(err, kBadTarget, n, t, V);
      losses[n] = NAN;
    } else {
      losses[n] = logf(s) - (x[t] - m);
    }
  }
}

// A block per row (grid-strided).
__global__ void softmax_xent_bwd_kernel(float* dlogits, const float* probs, const int32_t* targets,
                                        float dloss, int64_t N, int64_t V, DeviceError* err) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const int32_t t = targets[n];
    const float* p = probs + n * V;
    float* d = dlogits + n * V;
    const auto put = [&](int64_t j, float x) { d[j] = x; };
    if (t < 0 || t >= V) {  // reported by the next wait on the host; the row is still written
      if (threadIdx.x == 0) record_bad(err, kBadTargetBwd, n, t, V);
      unrolled<4, float>(
          threadIdx.x, V, blockDim.x, [](int64_t) { return 0.0f; }, put);
      continue;
    }
    unrolled<4, float>(
        threadIdx.x, V, blockDim.x,
        [&](int64_t j) { return (p[j] - (j == t ? 1.0f : 0.0f)) * dloss; }, put);
  }
}

int check_xent(void* ctx, const char* fn, int64_t N, int64_t V) {
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "N", N));
  DT_HAL_TRY(need_nonneg(ctx, fn, "V", V));
  if (N > 0 && V == 0) return fail(ctx, DT_HAL_ERR_INVALID, fn, ": V = 0 (no classes)");
  if (N > 2147483647) return fail(ctx, DT_HAL_ERR_UNSUPPORTED, fn, ": N = ", N, " rows");
  return DT_HAL_OK;
}

int cuda_softmax_xent_fwd(void* ctx, float* losses, float* probs, const float* logits,
                          const int32_t* targets, int64_t N, int64_t V) {
  const char* fn = "softmax_xent_fwd";
  DT_HAL_TRY(check_xent(ctx, fn, N, V));
  if (N == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "losses", losses, N));
  DT_HAL_TRY(need_ptr(ctx, fn, "probs", probs, N * V));
  DT_HAL_TRY(need_ptr(ctx, fn, "logits", logits, N * V));
  DT_HAL_TRY(need_ptr(ctx, fn, "targets", targets, N));
  softmax_xent_fwd_kernel<<<static_cast<unsigned>(N), kThreads, 0, C(ctx)->stream>>>(
      losses, probs, logits, targets, V, C(ctx)->derr);
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

int cuda_softmax_xent_bwd(void* ctx, float* dlogits, const float* probs, const int32_t* targets,
                          float dloss, int64_t N, int64_t V) {
  const char* fn = "softmax_xent_bwd";
  DT_HAL_TRY(check_xent(ctx, fn, N, V));
  if (N == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "dlogits", dlogits, N * V));
  DT_HAL_TRY(need_ptr(ctx, fn, "probs", probs, N * V));
  DT_HAL_TRY(need_ptr(ctx, fn, "targets", targets, N));
  softmax_xent_bwd_kernel<<<rows_grid(N), kThreads, 0, C(ctx)->stream>>>(dlogits, probs, targets,
                                                                         dloss, N, V, C(ctx)->derr);
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

// ---- optimiser, casts, loss scaling ----------------------------------------------------------

__device__ inline void adamw_one(float* p, const float* g, float* m, float* v, int64_t i, float lr,
                                 float b1, float b2, float eps, float wd, float inv_bc1,
                                 float inv_bc2) {
  const float gi = g[i];
  const float mi = b1 * m[i] + (1.0f - b1) * gi;
  const float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
  m[i] = mi;
  v[i] = vi;
  p[i] -= lr * ((mi * inv_bc1) / (sqrtf(vi * inv_bc2) + eps) + wd * p[i]);
}

__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n, float lr,
                             float b1, float b2, float eps, float wd, float inv_bc1,
                             float inv_bc2) {
  GRID_STRIDE(i, n) adamw_one(p, g, m, v, i, lr, b1, b2, eps, wd, inv_bc1, inv_bc2);
}

int check_adam(void* ctx, const char* fn, float beta1, float beta2, int64_t t) {
  if (t < 1) return fail(ctx, DT_HAL_ERR_INVALID, fn, ": step t = ", t, " must be >= 1");
  if (!(beta1 >= 0.0f && beta1 < 1.0f) || !(beta2 >= 0.0f && beta2 < 1.0f))
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": beta1 = ", beta1, ", beta2 = ", beta2,
                " must lie in [0, 1)");
  return DT_HAL_OK;
}

int cuda_adamw(void* ctx, float* params, const float* grads, float* m, float* v, int64_t n,
               float lr, float beta1, float beta2, float eps, float weight_decay, int64_t t) {
  const char* fn = "adamw";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  DT_HAL_TRY(check_adam(ctx, fn, beta1, beta2, t));
  DT_HAL_TRY(need_ptr(ctx, fn, "params", params, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "grads", grads, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "m", m, n));
  DT_HAL_TRY(need_ptr(ctx, fn, "v", v, n));
  if (n == 0) return DT_HAL_OK;
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(t));
  adamw_kernel<<<blocks_for(n), kThreads, 0, C(ctx)->stream>>>(
      params, grads, m, v, n, lr, beta1, beta2, eps, weight_decay, static_cast<float>(1.0 / bc1),
      static_cast<float>(1.0 / bc2));
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

// Up to kMultiTensors tensors per launch, passed by value in the kernel parameters (2.1 KB, under
// the 4 KB limit): blockIdx.y picks the tensor, x strides over its elements.
constexpr int kMultiTensors = 48;
struct MultiTensorArgs {
  float* p[kMultiTensors];
  const float* g[kMultiTensors];
  float* m[kMultiTensors];
  float* v[kMultiTensors];
  int64_t n[kMultiTensors];
  float wd[kMultiTensors];
};

__global__ void adamw_multi_kernel(MultiTensorArgs a, float lr, float b1, float b2, float eps,
                                   float inv_bc1, float inv_bc2) {
  const int k = blockIdx.y;
  const int64_t n = a.n[k];
  GRID_STRIDE(i, n)
  adamw_one(a.p[k], a.g[k], a.m[k], a.v[k], i, lr, b1, b2, eps, a.wd[k], inv_bc1, inv_bc2);
}

int cuda_adamw_multi(void* ctx, int count, float* const* params, const float* const* grads,
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
  for (int k = 0; k < count; ++k) {
    if (sizes[k] < 0)
      return fail(ctx, DT_HAL_ERR_INVALID, fn, ": sizes[", k, "] = ", sizes[k], " is negative");
    if (sizes[k] > 0 && (!params[k] || !grads[k] || !m[k] || !v[k]))
      return fail(ctx, DT_HAL_ERR_INVALID, fn, ": tensor ", k, " of ", sizes[k],
                  " elements has a null pointer");
  }
  DT_HAL_TRY(check_adam(ctx, fn, beta1, beta2, t));
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(t));
  for (int k0 = 0; k0 < count; k0 += kMultiTensors) {
    const int kn = count - k0 < kMultiTensors ? count - k0 : kMultiTensors;
    MultiTensorArgs a{};
    int64_t most = 0;
    for (int j = 0; j < kn; ++j) {
      a.p[j] = params[k0 + j];
      a.g[j] = grads[k0 + j];
      a.m[j] = m[k0 + j];
      a.v[j] = v[k0 + j];
      a.n[j] = sizes[k0 + j];
      a.wd[j] = weight_decay[k0 + j];
      most = a.n[j] > most ? a.n[j] : most;
    }
    if (most == 0) continue;
    const unsigned bx = blocks_for(most) < 1024 ? blocks_for(most) : 1024;
    adamw_multi_kernel<<<dim3(bx, static_cast<unsigned>(kn)), kThreads, 0, C(ctx)->stream>>>(
        a, lr, beta1, beta2, eps, static_cast<float>(1.0 / bc1), static_cast<float>(1.0 / bc2));
    LAUNCHED(ctx, fn);
  }
  return DT_HAL_OK;
}

// The types are template arguments, so that each element's conversion has no branch on them.
constexpr int kCastUnroll = 8;
template <int In, int Out>
__global__ void cast_kernel(void* out, const void* in, int64_t n) {
  grid_unrolled<kCastUnroll, float>(
      n, [&](int64_t i) { return load_as_f32(in, i, In); },
      [&](int64_t i, float x) { store_from_f32(out, i, Out, x); });
}
template <int In>
void launch_cast(void* out, int out_type, const void* in, int64_t n, cudaStream_t s) {
  const unsigned g = grid_for<kCastUnroll>(n);
  if (out_type == DT_HAL_F32)
    cast_kernel<In, DT_HAL_F32><<<g, kThreads, 0, s>>>(out, in, n);
  else if (out_type == DT_HAL_BF16)
    cast_kernel<In, DT_HAL_BF16><<<g, kThreads, 0, s>>>(out, in, n);
  else
    cast_kernel<In, DT_HAL_F16><<<g, kThreads, 0, s>>>(out, in, n);
}

int cuda_cast(void* ctx, void* out, dt_hal_dtype out_type, const void* in, dt_hal_dtype in_type,
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
    if (out != in)
      CU(ctx, fn,
         cudaMemcpyAsync(out, in, static_cast<size_t>(n) * (in_type == DT_HAL_F32 ? 4 : 2),
                         cudaMemcpyDeviceToDevice, C(ctx)->stream));
    return DT_HAL_OK;
  }
  // Each element is read before it is written by the same thread: in == out (same size) is fine.
  const cudaStream_t st = C(ctx)->stream;
  if (in_type == DT_HAL_F32)
    launch_cast<DT_HAL_F32>(out, out_type, in, n, st);
  else if (in_type == DT_HAL_BF16)
    launch_cast<DT_HAL_BF16>(out, out_type, in, n, st);
  else
    launch_cast<DT_HAL_F16>(out, out_type, in, n, st);
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

// ---- attention: the version-1 entries in fp32, the version-3 ones with 16-bit products ------

// A strided-batched row-major product on operands of type t with an fp32 C: fp32 operands through
// sgemm_rm, 16-bit ones through cublasGemmStridedBatchedEx with fp32 accumulation.
int gemm_rm_t(void* ctx, const char* fn, int ta, int tb, int64_t M, int64_t N, int64_t K,
              float alpha, const void* A, int64_t lda, int64_t sA, const void* B, int64_t ldb,
              int64_t sB, float beta, float* Cm, int64_t ldc, int64_t sC, int batch,
              dt_hal_dtype t) {
  if (t == DT_HAL_F32)
    return sgemm_rm(ctx, fn, ta, tb, M, N, K, alpha, static_cast<const float*>(A), lda, sA,
                    static_cast<const float*>(B), ldb, sB, beta, Cm, ldc, sC, batch);
  CUBLAS(ctx, fn,
         cublasGemmStridedBatchedEx(
             C(ctx)->blas, op(tb), op(ta), static_cast<int>(N), static_cast<int>(M),
             static_cast<int>(K), &alpha, B, cuda_type(t), static_cast<int>(ldb), sB, A,
             cuda_type(t), static_cast<int>(lda), sA, &beta, Cm, CUDA_R_32F, static_cast<int>(ldc),
             sC, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return DT_HAL_OK;
}

// p advanced by i elements of type t.
const void* at(const void* p, int64_t i, dt_hal_dtype t) {
  return static_cast<const char*>(p) + i * (t == DT_HAL_F32 ? 4 : 2);
}

// n rounded up to a multiple of 8: 16-bit sub-buffers start 16-byte aligned, as tensor-core
// GEMMs want.
inline int64_t aligned8(int64_t n) { return (n + 7) / 8 * 8; }

// n fp32 values rounded to t into out (16-bit), on the current stream.
int narrow_into(void* ctx, const char* fn, uint16_t* out, const float* in, int64_t n,
                dt_hal_dtype t) {
  if (n == 0) return DT_HAL_OK;
  launch_cast<DT_HAL_F32>(out, t, in, n, C(ctx)->stream);
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

// Per batch entry b, one strided-batched GEMM over the NH heads (head h of q, k, v starts at
// column h*hs of the row; att blocks are T x T apart): att = softmax(scale Q K^T), out = att V.
// With a 16-bit dtype the products take 16-bit copies of qkv and of the probabilities, made in
// the context's lp buffer; att keeps the fp32 probabilities. With lse, the rows' log-sum-exp
// goes there too; a null out computes the probabilities alone.
int attention_fwd_run(void* ctx, const char* fn, float* out, float* att, const float* qkv,
                      int64_t B, int64_t T, int64_t Cc, int64_t NH, dt_hal_dtype dtype,
                      float* lse = nullptr) {
  const int64_t hs = Cc / NH, C3 = 3 * Cc, TT = T * T, nqkv = B * T * C3;
  Context* c = C(ctx);
  const void* q = qkv;  // the operands as the products take them
  const void* p = att;
  uint16_t* p16 = nullptr;
  if (dtype != DT_HAL_F32) {
    DT_HAL_TRY(grow_scratch(ctx, fn, &c->lp, &c->lp_bytes,
                            static_cast<size_t>(aligned8(nqkv) + B * NH * TT) * sizeof(uint16_t)));
    uint16_t* q16 = static_cast<uint16_t*>(c->lp);
    p16 = q16 + aligned8(nqkv);
    DT_HAL_TRY(narrow_into(ctx, fn, q16, qkv, nqkv, dtype));
    q = q16;
    p = p16;
  }
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  const int nh = static_cast<int>(NH);
  for (int64_t b = 0; b < B; ++b)
    DT_HAL_TRY(gemm_rm_t(ctx, fn, 0, 1, T, T, hs, scale, at(q, b * T * C3, dtype), C3, hs,
                         at(q, b * T * C3 + Cc, dtype), C3, hs, 0.0f, att + b * NH * TT, T, TT, nh,
                         dtype));
  DT_HAL_TRY(
      causal_softmax(ctx, fn, att, out != nullptr ? p16 : nullptr, lse, dtype, B * NH * T, T));
  if (out == nullptr) return DT_HAL_OK;
  for (int64_t b = 0; b < B; ++b)
    DT_HAL_TRY(gemm_rm_t(ctx, fn, 0, 0, T, hs, T, 1.0f, at(p, b * NH * TT, dtype), T, TT,
                         at(q, b * T * C3 + 2 * Cc, dtype), C3, hs, 0.0f, out + b * T * Cc, Cc, hs,
                         nh, dtype));
  return DT_HAL_OK;
}

// S = dO V^T; dV += A^T dO; S = scale A (S - rowsum(A S)); dQ += S K; dK += S^T Q. With a 16-bit
// dtype the products take 16-bit copies of qkv, dout and the probabilities; the softmax backward
// runs in fp32 in scratch, and S is rounded into the probabilities' place for dQ and dK.
int attention_bwd_run(void* ctx, const char* fn, float* dqkv, float* scratch, const float* dout,
                      const float* qkv, const float* att, int64_t B, int64_t T, int64_t Cc,
                      int64_t NH, dt_hal_dtype dtype) {
  const int64_t hs = Cc / NH, C3 = 3 * Cc, TT = T * T, nqkv = B * T * C3, nout = B * T * Cc;
  Context* c = C(ctx);
  const void* q = qkv;  // the operands as the products take them
  const void* o = dout;
  const void* a = att;
  const void* s = scratch;
  uint16_t* a16 = nullptr;
  if (dtype != DT_HAL_F32) {
    DT_HAL_TRY(grow_scratch(
        ctx, fn, &c->lp, &c->lp_bytes,
        static_cast<size_t>(aligned8(nqkv) + aligned8(nout) + B * NH * TT) * sizeof(uint16_t)));
    uint16_t* q16 = static_cast<uint16_t*>(c->lp);
    uint16_t* o16 = q16 + aligned8(nqkv);
    a16 = o16 + aligned8(nout);  // the probabilities, then S
    DT_HAL_TRY(narrow_into(ctx, fn, q16, qkv, nqkv, dtype));
    DT_HAL_TRY(narrow_into(ctx, fn, o16, dout, nout, dtype));
    DT_HAL_TRY(narrow_into(ctx, fn, a16, att, B * NH * TT, dtype));
    q = q16;
    o = o16;
    a = a16;
    s = a16;
  }
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  const int nh = static_cast<int>(NH);
  for (int64_t b = 0; b < B; ++b) {
    float* dq = dqkv + b * T * C3;
    DT_HAL_TRY(gemm_rm_t(ctx, fn, 0, 1, T, T, hs, 1.0f, at(o, b * T * Cc, dtype), Cc, hs,
                         at(q, b * T * C3 + 2 * Cc, dtype), C3, hs, 0.0f, scratch + b * NH * TT, T,
                         TT, nh, dtype));
    DT_HAL_TRY(gemm_rm_t(ctx, fn, 1, 0, T, hs, T, 1.0f, at(a, b * NH * TT, dtype), T, TT,
                         at(o, b * T * Cc, dtype), Cc, hs, 1.0f, dq + 2 * Cc, C3, hs, nh, dtype));
  }
  DT_HAL_TRY(causal_softmax_bwd(ctx, fn, scratch, a16, dtype, att, B * NH * T, T, scale));
  for (int64_t b = 0; b < B; ++b) {
    float* dq = dqkv + b * T * C3;
    DT_HAL_TRY(gemm_rm_t(ctx, fn, 0, 0, T, hs, T, 1.0f, at(s, b * NH * TT, dtype), T, TT,
                         at(q, b * T * C3 + Cc, dtype), C3, hs, 1.0f, dq, C3, hs, nh, dtype));
    DT_HAL_TRY(gemm_rm_t(ctx, fn, 1, 0, T, hs, T, 1.0f, at(s, b * NH * TT, dtype), T, TT,
                         at(q, b * T * C3, dtype), C3, hs, 1.0f, dq + Cc, C3, hs, nh, dtype));
  }
  return DT_HAL_OK;
}

int cuda_attention_fwd(void* ctx, float* out, float* att, const float* qkv, int64_t B, int64_t T,
                       int64_t Cc, int64_t NH) {
  const char* fn = "attention_fwd";
  bool empty = false;
  DT_HAL_TRY(attention_fwd_args(ctx, fn, out, att, qkv, B, T, Cc, NH, DT_HAL_F32, &empty));
  return empty ? DT_HAL_OK : attention_fwd_run(ctx, fn, out, att, qkv, B, T, Cc, NH, DT_HAL_F32);
}
int cuda_attention_fwd_ex(void* ctx, float* out, float* att, const float* qkv, int64_t B, int64_t T,
                          int64_t Cc, int64_t NH, dt_hal_dtype dtype) {
  const char* fn = "attention_fwd_ex";
  bool empty = false;
  DT_HAL_TRY(attention_fwd_args(ctx, fn, out, att, qkv, B, T, Cc, NH, dtype, &empty));
  return empty ? DT_HAL_OK : attention_fwd_run(ctx, fn, out, att, qkv, B, T, Cc, NH, dtype);
}
int cuda_attention_bwd(void* ctx, float* dqkv, float* scratch, const float* dout, const float* qkv,
                       const float* att, int64_t B, int64_t T, int64_t Cc, int64_t NH) {
  const char* fn = "attention_bwd";
  bool empty = false;
  DT_HAL_TRY(
      attention_bwd_args(ctx, fn, dqkv, scratch, dout, qkv, att, B, T, Cc, NH, DT_HAL_F32, &empty));
  return empty
             ? DT_HAL_OK
             : attention_bwd_run(ctx, fn, dqkv, scratch, dout, qkv, att, B, T, Cc, NH, DT_HAL_F32);
}
int cuda_attention_bwd_ex(void* ctx, float* dqkv, float* scratch, const float* dout,
                          const float* qkv, const float* att, int64_t B, int64_t T, int64_t Cc,
                          int64_t NH, dt_hal_dtype dtype) {
  const char* fn = "attention_bwd_ex";
  bool empty = false;
  DT_HAL_TRY(
      attention_bwd_args(ctx, fn, dqkv, scratch, dout, qkv, att, B, T, Cc, NH, dtype, &empty));
  return empty ? DT_HAL_OK
               : attention_bwd_run(ctx, fn, dqkv, scratch, dout, qkv, att, B, T, Cc, NH, dtype);
}

// ---- attention without the probabilities (ABI version 4) ----------------------------------------
//
// Two ways, chosen per call:
//  - Tiled (with DT_CUDA_FLASH=tiled, for bf16 and fp16 with heads of 64 or 128, the shapes of
//    GPT-2 and most models; opt-in until these kernels have passed tests/gpu on a GPU): the
//    method of FlashAttention-2 on tensor cores (WMMA 16x16x16, fp32 accumulation). The forward
//    keeps a 64-query tile's scores, probabilities and output in shared memory and walks the key
//    tiles with an online softmax: the output is rescaled as the running maximum grows and divided
//    by the sum at the end, so the probabilities the product with v takes are exp(s - running max)
//    rounded, not the normalised ones attention_fwd_ex rounds (the ABI allows it). The backward
//    recomputes each tile's probabilities from lse, in two kernels so that no gradient needs an
//    atomic add (deterministic): one per key tile for dk and dv, one per query tile for dq.
//  - Otherwise (the default; fp32, other head sizes): the kernels of attention_fwd_ex and
//    attention_bwd_ex on
//    probabilities made for the call in the context's fa buffer, which the forward's softmax also
//    leaves lse from; the backward recomputes them (the same bits as the forward's) and runs
//    attention_bwd_ex on them. The state between the calls is still lse alone; the buffer is
//    reused by every layer.
namespace flash {

// bf16 tensor-core fragments exist from sm_80 on: a build for older GPUs compiles the tiled
// kernels empty, and tiled() never chooses them there (the fallback runs).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define DT_FLASH_ARCH 1
#else
#define DT_FLASH_ARCH 0
#endif

constexpr int kTile = 64;  // queries and keys per tile
constexpr int kWarps = 4;  // each owns 16 rows of a tile
constexpr int kBlock = 32 * kWarps;
constexpr int kLdS = kTile + 4;  // fp32 tile rows (floats; WMMA wants multiples of 4)

template <int HS>
struct Dims {
  static constexpr int kLd16 = HS + 8;  // 16-bit tile rows (elements; multiples of 8)
  static constexpr int kLdO = HS + 4;   // fp32 output rows
  static constexpr size_t k16 = size_t{kTile} * kLd16 * 2;         // bytes of a 16-bit tile
  static constexpr size_t kS = size_t{kTile} * kLdS * 4;           // bytes of a score tile
  static constexpr size_t kO = size_t{kTile} * kLdO * 4;           // bytes of an output tile
  static constexpr size_t kP16 = size_t{kTile} * (kTile + 8) * 2;  // 16-bit probabilities
  static constexpr size_t kRows = size_t{kTile} * 4;               // one float per row
  static constexpr size_t fwd = 3 * k16 + kS + kP16 + kO + 2 * kRows;
  static constexpr size_t bwd_kv = 4 * k16 + 2 * kS + 2 * kP16 + 2 * kRows;
  static constexpr size_t bwd_q = 4 * k16 + 2 * kS + kP16 + 2 * kRows;
};

template <class T16>
__device__ inline uint16_t round16(float x);
template <>
__device__ inline uint16_t round16<__nv_bfloat16>(float x) {
  return bf16_of(x);
}
template <>
__device__ inline uint16_t round16<__half>(float x) {
  return f16_of(x);
}

// rows [r0, r0 + kTile) x HS columns of an fp32 matrix with row stride ld into a 16-bit tile
// (rounded as the CPU device rounds), zeros for rows at or past T.
template <class T16, int HS>
__device__ void load_tile(T16* dst, const float* src, int64_t ld, int64_t r0, int64_t T) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int i = threadIdx.x; i < kTile * HS; i += blockDim.x) {
    const int r = i / HS, c = i % HS;
    const float x = r0 + r < T ? src[(r0 + r) * ld + c] : 0.0f;
    d[r * Dims<HS>::kLd16 + c] = round16<T16>(x);
  }
}

using namespace nvcuda;
template <class T16>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T16, wmma::row_major>;
template <class T16, class Layout>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T16, Layout>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// out (16 x 64, row stride kLdS) = A (16 x HS rows of a, stride lda) times B^T, B the 64 x HS
// tile b (stride ldb): the scores of a warp's rows against a tile's keys.
template <class T16, int HS>
__device__ void rows_times_tile_t(float* out, const T16* a, int lda, const T16* b, int ldb) {
#pragma unroll
  for (int n = 0; n < kTile / 16; ++n) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int k = 0; k < HS / 16; ++k) {
      FragA<T16> fa;
      FragB<T16, wmma::col_major> fb;  // B^T: element (k, n) is b[n][k]
      wmma::load_matrix_sync(fa, a + k * 16, lda);
      wmma::load_matrix_sync(fb, b + n * 16 * ldb + k * 16, ldb);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + n * 16, acc, kLdS, wmma::mem_row_major);
  }
}

// Forward: block (query tile, b * NH + h); warp w owns queries q0 + 16 w ...
template <class T16, int HS>
__global__ void __launch_bounds__(kBlock)
    fwd_kernel(float* out, float* lse, const float* qkv, int64_t T, int64_t Cc, int64_t NH,
               float scale) {
#if DT_FLASH_ARCH
  using D = Dims<HS>;
  extern __shared__ __align__(128) unsigned char smem[];
  T16* Qs = reinterpret_cast<T16*>(smem);
  T16* Ks = reinterpret_cast<T16*>(smem + D::k16);
  T16* Vs = reinterpret_cast<T16*>(smem + 2 * D::k16);
  float* Ss = reinterpret_cast<float*>(smem + 3 * D::k16);
  T16* Ps = reinterpret_cast<T16*>(smem + 3 * D::k16 + D::kS);
  float* Os = reinterpret_cast<float*>(smem + 3 * D::k16 + D::kS + D::kP16);
  float* Ms = reinterpret_cast<float*>(smem + 3 * D::k16 + D::kS + D::kP16 + D::kO);
  float* Ls = Ms + kTile;
  constexpr int kLdP = kTile + 8;
  const int64_t qt = blockIdx.x, bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int64_t C3 = 3 * Cc, q0 = qt * kTile;
  const float* base = qkv + b * T * C3 + h * HS;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  load_tile<T16, HS>(Qs, base, C3, q0, T);
  for (int i = threadIdx.x; i < kTile * D::kLdO; i += blockDim.x) Os[i] = 0.0f;
  if (threadIdx.x < kTile) {
    Ms[threadIdx.x] = -INFINITY;
    Ls[threadIdx.x] = 0.0f;
  }
  const int r0 = warp * 16;
  for (int64_t kt = 0; kt <= qt; ++kt) {
    __syncthreads();  // the previous tile's K and V are no longer read
    load_tile<T16, HS>(Ks, base + Cc, C3, kt * kTile, T);
    load_tile<T16, HS>(Vs, base + 2 * Cc, C3, kt * kTile, T);
    __syncthreads();
    rows_times_tile_t<T16, HS>(Ss + r0 * kLdS, Qs + r0 * D::kLd16, D::kLd16, Ks, D::kLd16);
    __syncwarp();
    // Online softmax of the warp's 16 rows: lane covers columns lane and lane + 32.
    uint16_t* P = reinterpret_cast<uint16_t*>(Ps);
    for (int r = r0; r < r0 + 16; ++r) {
      const int64_t q = q0 + r;
      float s[2];
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = lane + 32 * j;
        const int64_t key = kt * kTile + c;
        s[j] = key <= q && q < T ? Ss[r * kLdS + c] * scale : -INFINITY;
        mx = fmaxf(mx, s[j]);
      }
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = Ms[r];
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float e = s[j] == -INFINITY ? 0.0f : expf(s[j] - m_new);
        sum += e;
        P[r * kLdP + lane + 32 * j] = round16<T16>(e);
      }
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      // A row past T has m_new = -inf: it keeps zeros.
      const float alpha = m_new == -INFINITY ? 1.0f : expf(m_old - m_new);
      for (int c = lane; c < HS; c += 32) Os[r * D::kLdO + c] *= alpha;
      __syncwarp();
      if (lane == 0) {
        Ms[r] = m_new;
        Ls[r] = Ls[r] * alpha + sum;
      }
    }
    __syncwarp();
    // O (warp's rows) += P V.
#pragma unroll
    for (int n = 0; n < HS / 16; ++n) {
      FragC acc;
      float* o = Os + r0 * D::kLdO + n * 16;
      wmma::load_matrix_sync(acc, o, D::kLdO, wmma::mem_row_major);
#pragma unroll
      for (int k = 0; k < kTile / 16; ++k) {
        FragA<T16> fa;
        FragB<T16, wmma::row_major> fb;
        wmma::load_matrix_sync(fa, Ps + r0 * kLdP + k * 16, kLdP);
        wmma::load_matrix_sync(fb, Vs + k * 16 * D::kLd16 + n * 16, D::kLd16);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(o, acc, D::kLdO, wmma::mem_row_major);
    }
    __syncwarp();
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kTile * HS; i += blockDim.x) {
    const int r = i / HS, c = i % HS;
    const int64_t q = q0 + r;
    if (q < T) out[(b * T + q) * Cc + h * HS + c] = Os[r * D::kLdO + c] / Ls[r];
  }
  if (threadIdx.x < kTile && q0 + threadIdx.x < T)
    lse[bh * T + q0 + threadIdx.x] = Ms[threadIdx.x] + logf(Ls[threadIdx.x]);
#endif
}

// D[bh, t] = dout_t . out_t over the head's columns (out in out_type).
__global__ void rowdot_kernel(float* D, const float* dout, const void* out, int out_type,
                              int64_t rows, int64_t T, int64_t Cc, int64_t NH) {
  const int64_t hs = Cc / NH;
  GRID_STRIDE(r, rows) {
    const int64_t bh = r / T, t = r % T, b = bh / NH, h = bh % NH;
    const int64_t at = (b * T + t) * Cc + h * hs;
    float s = 0.0f;
    for (int64_t i = 0; i < hs; ++i) s += dout[at + i] * load_as_f32(out, at + i, out_type);
    D[r] = s;
  }
}

// P (exp(scale s - lse), 0 where masked) and dS = scale P (dP - D) of the warp's 16 rows of a
// tile, both rounded to 16 bits into P16 and dS16 (row stride kTile + 8), P also in fp32 where
// wanted. Row r, column c are (query, key) through qk(r, c); lse and D per query.
template <class T16, class QK>
__device__ void probs_and_grad(const float* Ss, const float* dPs, uint16_t* P16, uint16_t* dS16,
                               int r0, float scale, const float* lse_q, const float* D_q, QK qk) {
  constexpr int kLdP = kTile + 8;
  const int lane = threadIdx.x % 32;
  for (int i = lane; i < 16 * kTile; i += 32) {
    const int r = r0 + i / kTile, c = i % kTile;
    int qi = 0;
    const bool valid = qk(r, c, &qi);
    const float p = valid ? expf(Ss[r * kLdS + c] * scale - lse_q[qi]) : 0.0f;
    const float ds = valid ? scale * p * (dPs[r * kLdS + c] - D_q[qi]) : 0.0f;
    if (P16 != nullptr) P16[r * kLdP + c] = round16<T16>(p);
    dS16[r * kLdP + c] = round16<T16>(ds);
  }
}

// acc[n] += A (16 x 64 rows of a, stride kTile + 8) times the 64 x HS tile b.
template <class T16, int HS>
__device__ void accumulate(FragC (&acc)[HS / 16], const T16* a, const T16* b) {
  constexpr int kLdP = kTile + 8;
#pragma unroll
  for (int n = 0; n < HS / 16; ++n)
#pragma unroll
    for (int k = 0; k < kTile / 16; ++k) {
      FragA<T16> fa;
      FragB<T16, wmma::row_major> fb;
      wmma::load_matrix_sync(fa, a + k * 16, kLdP);
      wmma::load_matrix_sync(fb, b + k * 16 * Dims<HS>::kLd16 + n * 16, Dims<HS>::kLd16);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
}

// dst rows (stride ld, fp32) += the warp's 16 x HS accumulators, through the staging tile st.
template <int HS>
__device__ void add_rows(float* dst, int64_t ld, int64_t row0, int64_t T, FragC (&acc)[HS / 16],
                         float* st) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < HS / 16; ++n)
    wmma::store_matrix_sync(st + n * 16, acc[n], Dims<HS>::kLdO, wmma::mem_row_major);
  __syncwarp();
  for (int i = lane; i < 16 * HS; i += 32) {
    const int r = i / HS, c = i % HS;
    if (row0 + r < T) dst[(row0 + r) * ld + c] += st[r * Dims<HS>::kLdO + c];
  }
  __syncwarp();
}

// dk and dv of a key tile: block (key tile, b * NH + h), warp w owns keys k0 + 16 w ...; walks the
// query tiles from its own. Rows of the score tiles are keys, columns queries (S^T).
template <class T16, int HS>
__global__ void __launch_bounds__(kBlock)
    bwd_kv_kernel(float* dqkv, const float* dout, const float* qkv, const float* lse,
                  const float* Dv, int64_t T, int64_t Cc, int64_t NH, float scale) {
#if DT_FLASH_ARCH
  using D = Dims<HS>;
  constexpr int kLdP = kTile + 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T16* Ks = reinterpret_cast<T16*>(smem);
  T16* Vs = reinterpret_cast<T16*>(smem + D::k16);
  T16* Qs = reinterpret_cast<T16*>(smem + 2 * D::k16);
  T16* Os = reinterpret_cast<T16*>(smem + 3 * D::k16);  // dout, rounded
  float* Ss = reinterpret_cast<float*>(smem + 4 * D::k16);
  float* dPs = reinterpret_cast<float*>(smem + 4 * D::k16 + D::kS);
  T16* P16 = reinterpret_cast<T16*>(smem + 4 * D::k16 + 2 * D::kS);
  T16* dS16 = reinterpret_cast<T16*>(smem + 4 * D::k16 + 2 * D::kS + D::kP16);
  float* Lq = reinterpret_cast<float*>(smem + 4 * D::k16 + 2 * D::kS + 2 * D::kP16);
  float* Dq = Lq + kTile;
  const int64_t kt = blockIdx.x, bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int64_t C3 = 3 * Cc, k0 = kt * kTile, nt = (T + kTile - 1) / kTile;
  const float* base = qkv + b * T * C3 + h * HS;
  const float* obase = dout + b * T * Cc + h * HS;
  const int warp = threadIdx.x / 32, r0 = warp * 16;
  load_tile<T16, HS>(Ks, base + Cc, C3, k0, T);
  load_tile<T16, HS>(Vs, base + 2 * Cc, C3, k0, T);
  FragC dk[HS / 16], dv[HS / 16];
#pragma unroll
  for (int n = 0; n < HS / 16; ++n) {
    wmma::fill_fragment(dk[n], 0.0f);
    wmma::fill_fragment(dv[n], 0.0f);
  }
  for (int64_t qt = kt; qt < nt; ++qt) {
    const int64_t q0 = qt * kTile;
    __syncthreads();  // the previous query tile is no longer read
    load_tile<T16, HS>(Qs, base, C3, q0, T);
    load_tile<T16, HS>(Os, obase, Cc, q0, T);
    if (threadIdx.x < kTile) {
      const int64_t q = q0 + threadIdx.x;
      Lq[threadIdx.x] = q < T ? lse[bh * T + q] : 0.0f;
      Dq[threadIdx.x] = q < T ? Dv[bh * T + q] : 0.0f;
    }
    __syncthreads();
    rows_times_tile_t<T16, HS>(Ss + r0 * kLdS, Ks + r0 * D::kLd16, D::kLd16, Qs, D::kLd16);
    rows_times_tile_t<T16, HS>(dPs + r0 * kLdS, Vs + r0 * D::kLd16, D::kLd16, Os, D::kLd16);
    __syncwarp();
    probs_and_grad<T16>(Ss, dPs, reinterpret_cast<uint16_t*>(P16),
                        reinterpret_cast<uint16_t*>(dS16), r0, scale, Lq, Dq,
                        [&](int r, int c, int* qi) {
                          *qi = c;
                          const int64_t key = k0 + r, q = q0 + c;
                          return key <= q && q < T && key < T;
                        });
    __syncwarp();
    accumulate<T16, HS>(dv, P16 + r0 * kLdP, Os);
    accumulate<T16, HS>(dk, dS16 + r0 * kLdP, Qs);
  }
  __syncthreads();
  float* st = reinterpret_cast<float*>(smem + 4 * D::k16) + r0 * D::kLdO;  // Ss and dPs: free now
  float* drow = dqkv + b * T * C3 + h * HS;
  add_rows<HS>(drow + Cc, C3, k0 + r0, T, dk, st);
  add_rows<HS>(drow + 2 * Cc, C3, k0 + r0, T, dv, st);
#endif
}

// dq of a query tile: block (query tile, b * NH + h), warp w owns queries q0 + 16 w ...; walks the
// key tiles up to its own.
template <class T16, int HS>
__global__ void __launch_bounds__(kBlock)
    bwd_q_kernel(float* dqkv, const float* dout, const float* qkv, const float* lse,
                 const float* Dv, int64_t T, int64_t Cc, int64_t NH, float scale) {
#if DT_FLASH_ARCH
  using D = Dims<HS>;
  constexpr int kLdP = kTile + 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T16* Qs = reinterpret_cast<T16*>(smem);
  T16* Os = reinterpret_cast<T16*>(smem + D::k16);  // dout, rounded
  T16* Ks = reinterpret_cast<T16*>(smem + 2 * D::k16);
  T16* Vs = reinterpret_cast<T16*>(smem + 3 * D::k16);
  float* Ss = reinterpret_cast<float*>(smem + 4 * D::k16);
  float* dPs = reinterpret_cast<float*>(smem + 4 * D::k16 + D::kS);
  T16* dS16 = reinterpret_cast<T16*>(smem + 4 * D::k16 + 2 * D::kS);
  float* Lq = reinterpret_cast<float*>(smem + 4 * D::k16 + 2 * D::kS + D::kP16);
  float* Dq = Lq + kTile;
  const int64_t qt = blockIdx.x, bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int64_t C3 = 3 * Cc, q0 = qt * kTile;
  const float* base = qkv + b * T * C3 + h * HS;
  const int warp = threadIdx.x / 32, r0 = warp * 16;
  load_tile<T16, HS>(Qs, base, C3, q0, T);
  load_tile<T16, HS>(Os, dout + b * T * Cc + h * HS, Cc, q0, T);
  if (threadIdx.x < kTile) {
    const int64_t q = q0 + threadIdx.x;
    Lq[threadIdx.x] = q < T ? lse[bh * T + q] : 0.0f;
    Dq[threadIdx.x] = q < T ? Dv[bh * T + q] : 0.0f;
  }
  FragC dq[HS / 16];
#pragma unroll
  for (int n = 0; n < HS / 16; ++n) wmma::fill_fragment(dq[n], 0.0f);
  for (int64_t kt = 0; kt <= qt; ++kt) {
    const int64_t k0 = kt * kTile;
    __syncthreads();  // the previous key tile is no longer read
    load_tile<T16, HS>(Ks, base + Cc, C3, k0, T);
    load_tile<T16, HS>(Vs, base + 2 * Cc, C3, k0, T);
    __syncthreads();
    rows_times_tile_t<T16, HS>(Ss + r0 * kLdS, Qs + r0 * D::kLd16, D::kLd16, Ks, D::kLd16);
    rows_times_tile_t<T16, HS>(dPs + r0 * kLdS, Os + r0 * D::kLd16, D::kLd16, Vs, D::kLd16);
    __syncwarp();
    probs_and_grad<T16>(Ss, dPs, nullptr, reinterpret_cast<uint16_t*>(dS16), r0, scale, Lq, Dq,
                        [&](int r, int c, int* qi) {
                          *qi = r;
                          const int64_t q = q0 + r, key = k0 + c;
                          return key <= q && q < T;
                        });
    __syncwarp();
    accumulate<T16, HS>(dq, dS16 + r0 * kLdP, Ks);
  }
  __syncthreads();
  float* st = reinterpret_cast<float*>(smem + 4 * D::k16) + r0 * D::kLdO;
  add_rows<HS>(dqkv + b * T * C3 + h * HS, C3, q0 + r0, T, dq, st);
#endif
}

// Dynamic shared memory above 48 KiB must be allowed per kernel and device, once (before any
// capture: the first call of a shape runs eagerly, as grow_scratch already requires).
template <auto Kernel>
int allow_smem(void* ctx, const char* fn, size_t bytes) {
  static std::atomic<uint64_t> done{0};
  const uint64_t bit = uint64_t{1} << (C(ctx)->device & 63);
  if (done.load() & bit) return DT_HAL_OK;
  CU(ctx, fn,
     cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          static_cast<int>(bytes)));
  done.fetch_or(bit);
  return DT_HAL_OK;
}

template <class T16, int HS>
int fwd(void* ctx, const char* fn, float* out, float* lse, const float* qkv, int64_t B, int64_t T,
        int64_t Cc, int64_t NH) {
  const size_t smem = Dims<HS>::fwd;
  DT_HAL_TRY((allow_smem<fwd_kernel<T16, HS>>(ctx, fn, smem)));
  const dim3 grid(static_cast<unsigned>((T + kTile - 1) / kTile), static_cast<unsigned>(B * NH));
  fwd_kernel<T16, HS>
      <<<grid, kBlock, smem, C(ctx)->stream>>>(out, lse, qkv, T, Cc, NH, 1.0f / sqrtf(float(HS)));
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

template <class T16, int HS>
int bwd(void* ctx, const char* fn, float* dqkv, const float* Dv, const float* dout,
        const float* qkv, const float* lse, int64_t B, int64_t T, int64_t Cc, int64_t NH) {
  DT_HAL_TRY((allow_smem<bwd_kv_kernel<T16, HS>>(ctx, fn, Dims<HS>::bwd_kv)));
  DT_HAL_TRY((allow_smem<bwd_q_kernel<T16, HS>>(ctx, fn, Dims<HS>::bwd_q)));
  const dim3 grid(static_cast<unsigned>((T + kTile - 1) / kTile), static_cast<unsigned>(B * NH));
  const float scale = 1.0f / sqrtf(float(HS));
  bwd_kv_kernel<T16, HS><<<grid, kBlock, Dims<HS>::bwd_kv, C(ctx)->stream>>>(dqkv, dout, qkv, lse,
                                                                             Dv, T, Cc, NH, scale);
  LAUNCHED(ctx, fn);
  bwd_q_kernel<T16, HS><<<grid, kBlock, Dims<HS>::bwd_q, C(ctx)->stream>>>(dqkv, dout, qkv, lse, Dv,
                                                                           T, Cc, NH, scale);
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

// The tiled kernels for this call, or false (the fallback): DT_CUDA_FLASH=tiled, a 16-bit type,
// heads of 64 or 128, B NH within a grid's second dimension, and a GPU of compute capability 8.0
// or later.
bool tiled(void* ctx, dt_hal_dtype dtype, int64_t hs, int64_t heads) {
  static const bool off = [] {
    const char* v = std::getenv("DT_CUDA_FLASH");
    return v == nullptr || std::strcmp(v, "tiled") != 0;
  }();
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, C(ctx)->device) !=
      cudaSuccess)
    major = 0;
  return !off && major >= 8 && dtype != DT_HAL_F32 && (hs == 64 || hs == 128) && heads <= 65535;
}

template <class F>
int dispatch(dt_hal_dtype dtype, int64_t hs, F&& f) {
  if (dtype == DT_HAL_BF16)
    return hs == 64 ? f(__nv_bfloat16{}, std::integral_constant<int, 64>{})
                    : f(__nv_bfloat16{}, std::integral_constant<int, 128>{});
  return hs == 64 ? f(__half{}, std::integral_constant<int, 64>{})
                  : f(__half{}, std::integral_constant<int, 128>{});
}

}  // namespace flash

int cuda_flash_attention_fwd(void* ctx, float* out, float* lse, const float* qkv, int64_t B,
                             int64_t T, int64_t Cc, int64_t NH, dt_hal_dtype dtype) {
  const char* fn = "flash_attention_fwd";
  DT_HAL_TRY(check_attention(ctx, fn, B, T, Cc, NH));
  if (!known_dtype(dtype))
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": unknown dtype ", static_cast<int>(dtype));
  if (B * T == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, B * T * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "lse", lse, B * NH * T));
  DT_HAL_TRY(need_ptr(ctx, fn, "qkv", qkv, B * T * 3 * Cc));
  const int64_t hs = Cc / NH;
  if (flash::tiled(ctx, dtype, hs, B * NH))
    return flash::dispatch(dtype, hs, [&](auto t16, auto HS) {
      return flash::fwd<decltype(t16), decltype(HS)::value>(ctx, fn, out, lse, qkv, B, T, Cc, NH);
    });
  Context* c = C(ctx);
  DT_HAL_TRY(grow_scratch(ctx, fn, &c->fa, &c->fa_bytes,
                          static_cast<size_t>(B * NH * T * T) * sizeof(float)));
  return attention_fwd_run(ctx, fn, out, static_cast<float*>(c->fa), qkv, B, T, Cc, NH, dtype, lse);
}

int cuda_flash_attention_bwd(void* ctx, float* dqkv, float* scratch, const float* dout,
                             const float* qkv, const void* out, dt_hal_dtype out_dtype,
                             const float* lse, int64_t B, int64_t T, int64_t Cc, int64_t NH,
                             dt_hal_dtype dtype) {
  const char* fn = "flash_attention_bwd";
  DT_HAL_TRY(check_attention(ctx, fn, B, T, Cc, NH));
  if (!known_dtype(dtype))
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": unknown dtype ", static_cast<int>(dtype));
  if (out_dtype != DT_HAL_F32 && out_dtype != dtype)
    return fail(ctx, DT_HAL_ERR_INVALID, fn, ": out_dtype ", static_cast<int>(out_dtype),
                " must be F32 or the products' dtype ", static_cast<int>(dtype));
  if (B * T == 0) return DT_HAL_OK;
  DT_HAL_TRY(need_ptr(ctx, fn, "dqkv", dqkv, B * T * 3 * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "scratch", scratch, B * NH * T));
  DT_HAL_TRY(need_ptr(ctx, fn, "dout", dout, B * T * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "qkv", qkv, B * T * 3 * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "out", out, B * T * Cc));
  DT_HAL_TRY(need_ptr(ctx, fn, "lse", lse, B * NH * T));
  const int64_t hs = Cc / NH;
  if (flash::tiled(ctx, dtype, hs, B * NH)) {
    flash::rowdot_kernel<<<blocks_for(B * NH * T), kThreads, 0, C(ctx)->stream>>>(
        scratch, dout, out, static_cast<int>(out_dtype), B * NH * T, T, Cc, NH);
    LAUNCHED(ctx, fn);
    return flash::dispatch(dtype, hs, [&](auto t16, auto HS) {
      return flash::bwd<decltype(t16), decltype(HS)::value>(ctx, fn, dqkv, scratch, dout, qkv, lse,
                                                            B, T, Cc, NH);
    });
  }
  // The probabilities again (the forward's bits), then attention_bwd_ex on them.
  Context* c = C(ctx);
  const int64_t TT = B * NH * T * T;
  DT_HAL_TRY(
      grow_scratch(ctx, fn, &c->fa, &c->fa_bytes, static_cast<size_t>(2 * TT) * sizeof(float)));
  float* att = static_cast<float*>(c->fa);
  DT_HAL_TRY(attention_fwd_run(ctx, fn, nullptr, att, qkv, B, T, Cc, NH, dtype));
  return attention_bwd_run(ctx, fn, dqkv, att + TT, dout, qkv, att, B, T, Cc, NH, dtype);
}

int cuda_cast_f32_to_bf16(void* ctx, uint16_t* out, const float* in, int64_t n) {
  return cuda_cast(ctx, out, DT_HAL_BF16, in, DT_HAL_F32, n);
}
int cuda_cast_bf16_to_f32(void* ctx, float* out, const uint16_t* in, int64_t n) {
  return cuda_cast(ctx, out, DT_HAL_F32, in, DT_HAL_BF16, n);
}

__global__ void scale_check_kernel(float* x, float s, int64_t n, int32_t* found) {
  bool bad = false;
  grid_unrolled<4, float>(
      n, [&](int64_t i) { return x[i] * s; },
      [&](int64_t i, float y) {
        x[i] = y;
        bad |= (bits_of(y) & 0x7f800000u) == 0x7f800000u;
      });
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found = 1;
}

int cuda_scale_check_finite(void* ctx, float* x, int64_t n, float s, int32_t* found_inf) {
  const char* fn = "scale_check_finite";
  DT_HAL_TRY(need_ctx(ctx, fn));
  DT_HAL_TRY(need_nonneg(ctx, fn, "n", n));
  DT_HAL_TRY(need_ptr(ctx, fn, "x", x, n));
  if (found_inf == nullptr) return fail(ctx, DT_HAL_ERR_INVALID, fn, ": found_inf is null");
  if (n == 0) return DT_HAL_OK;
  scale_check_kernel<<<grid_for<4>(n), kThreads, 0, C(ctx)->stream>>>(x, s, n, found_inf);
  LAUNCHED(ctx, fn);
  return DT_HAL_OK;
}

// ---- streams, events, graphs ------------------------------------------------------------------

int cuda_stream_create(void* ctx, void** stream) {
  DT_HAL_TRY(need_ctx(ctx, "stream_create"));
  if (stream == nullptr) return fail(ctx, DT_HAL_ERR_INVALID, "stream_create: stream is null");
  cudaStream_t s = nullptr;
  CU(ctx, "stream_create", cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  try {
    std::lock_guard<std::mutex> lk(C(ctx)->streams_mu);
    C(ctx)->streams.push_back(s);
  } catch (...) {
    cudaStreamDestroy(s);
    return fail(ctx, DT_HAL_ERR_NOMEM, "stream_create: out of memory");
  }
  *stream = s;
  return DT_HAL_OK;
}
void cuda_stream_destroy(void* ctx, void* stream) {
  if (stream == nullptr) return;
  auto* c = C(ctx);
  if (c) {
    cudaSetDevice(c->device);
    if (c->stream == stream) {
      c->stream = c->own;
      bind_blas(c);
    }
    std::lock_guard<std::mutex> lk(c->streams_mu);
    c->streams.erase(
        std::remove(c->streams.begin(), c->streams.end(), static_cast<cudaStream_t>(stream)),
        c->streams.end());
  }
  cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}
int cuda_set_stream(void* ctx, void* stream) {
  DT_HAL_TRY(need_ctx(ctx, "set_stream"));
  Context* c = C(ctx);
  c->stream = stream ? static_cast<cudaStream_t>(stream) : c->own;
  CUBLAS(ctx, "set_stream", bind_blas(c));
  return DT_HAL_OK;
}
int cuda_native_stream(void* ctx, void** handle) {
  DT_HAL_TRY(need_ctx(ctx, "native_stream"));
  if (handle == nullptr) return fail(ctx, DT_HAL_ERR_INVALID, "native_stream: handle is null");
  *handle = C(ctx)->stream;
  return DT_HAL_OK;
}
int cuda_event_create(void* ctx, void** event) {
  DT_HAL_TRY(need_ctx(ctx, "event_create"));
  if (event == nullptr) return fail(ctx, DT_HAL_ERR_INVALID, "event_create: event is null");
  cudaEvent_t e = nullptr;
  CU(ctx, "event_create", cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  *event = e;
  return DT_HAL_OK;
}
void cuda_event_destroy(void*, void* event) {
  if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}
int cuda_event_record(void* ctx, void* event) {
  DT_HAL_TRY(need_ctx(ctx, "event_record"));
  if (!event) return fail(ctx, DT_HAL_ERR_INVALID, "event_record: null event");
  CU(ctx, "event_record", cudaEventRecord(static_cast<cudaEvent_t>(event), C(ctx)->stream));
  return DT_HAL_OK;
}
int cuda_stream_wait_event(void* ctx, void* event) {
  DT_HAL_TRY(need_ctx(ctx, "stream_wait_event"));
  if (!event) return fail(ctx, DT_HAL_ERR_INVALID, "stream_wait_event: null event");
  CU(ctx, "stream_wait_event",
     cudaStreamWaitEvent(C(ctx)->stream, static_cast<cudaEvent_t>(event), 0));
  return DT_HAL_OK;
}
int cuda_event_synchronize(void* ctx, void* event) {
  DT_HAL_TRY(need_ctx(ctx, "event_synchronize"));
  if (!event) return fail(ctx, DT_HAL_ERR_INVALID, "event_synchronize: null event");
  DT_HAL_TRY(refuse_in_capture(ctx, "event_synchronize", "the host waiting for work"));
  CU(ctx, "event_synchronize", cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  return DT_HAL_OK;
}

int cuda_graph_begin(void* ctx) {
  DT_HAL_TRY(need_ctx(ctx, "graph_begin"));
  Context* c = C(ctx);
  CU(ctx, "graph_begin", cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
  c->capture_thread = std::this_thread::get_id();
  c->capture_broken = false;
  c->capture_error[0] = '\0';
  return DT_HAL_OK;
}
int cuda_graph_end(void* ctx, void** graph) {
  DT_HAL_TRY(need_ctx(ctx, "graph_end"));
  if (graph == nullptr) return fail(ctx, DT_HAL_ERR_INVALID, "graph_end: graph is null");
  *graph = nullptr;
  Context* c = C(ctx);
  cudaGraph_t g = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(c->stream, &g);
  for (void* p : c->capture_frees) cudaFree(p);  // released during the capture
  c->capture_frees.clear();
  if (c->capture_broken) {  // a call was refused: the graph would lack it
    if (g) cudaGraphDestroy(g);
    (void)cudaGetLastError();
    c->capture_broken = false;
    return fail(ctx, DT_HAL_ERR_UNSUPPORTED,
                "graph_end: the capture was invalidated: ", c->capture_error);
  }
  CU(ctx, "graph_end", ended);
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  if (e != cudaSuccess)
    return fail(ctx, DT_HAL_ERR_DEVICE, "graph_end: cudaGraphInstantiate: ", cudaGetErrorString(e));
  *graph = exec;
  ++C(ctx)->graphs;
  return DT_HAL_OK;
}
int cuda_graph_launch(void* ctx, void* graph) {
  DT_HAL_TRY(need_ctx(ctx, "graph_launch"));
  if (!graph) return fail(ctx, DT_HAL_ERR_INVALID, "graph_launch: null graph");
  CU(ctx, "graph_launch", cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), C(ctx)->stream));
  return DT_HAL_OK;
}
void cuda_graph_destroy(void* ctx, void* graph) {
  if (!graph) return;
  cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph));
  if (!ctx) return;
  // One decrement, never below zero, even when two threads destroy a context's last graphs.
  std::atomic<int>& live = C(ctx)->graphs;
  int n = live.load();
  while (n > 0 && !live.compare_exchange_weak(n, n - 1)) {
  }
}

// ---- profile (DT_CUDA_PROFILE=1) -------------------------------------------------------------
//
// With DT_CUDA_PROFILE=1 in the environment when the plugin is loaded, dt_hal_plugin_v4 (and _v3)
// returns a
// table whose work entries record a CUDA event on the current stream before and after their work
// (not while capturing: a graph's replay is timed as one graph_launch). The events are read at
// every synchronize, every 4096 calls and at close, which prints to stderr, per entry, the calls,
// the GPU time between each pair of events, and the share of the time between the first and the
// last event: the rest is time the GPU waited for the host (or, where streams overlap, the shares
// add up to more than 100%). The events order nothing, but reading them is a host wait, so a
// profiled run is a little slower than an unprofiled one.

constexpr const char* kProfNames[] = {
    "gemm",
    "bias_add",
    "bias_grad",
    "add",
    "scale",
    "sum_squares",
    "embedding_fwd",
    "embedding_bwd",
    "layernorm_fwd",
    "layernorm_bwd",
    "gelu_fwd",
    "gelu_bwd",
    "attention_fwd",
    "attention_bwd",
    "softmax_xent_fwd",
    "softmax_xent_bwd",
    "adamw",
    "cast_f32_to_bf16",
    "cast_bf16_to_f32",
    "gemm_ex",
    "cast",
    "scale_check_finite",
    "adamw_multi",
    "attention_fwd_ex",
    "attention_bwd_ex",
    "copy",
    "fill_zero",
    "graph_launch",
    "flash_attention_fwd",
    "flash_attention_bwd",
};
constexpr int kProfSlots = sizeof kProfNames / sizeof kProfNames[0];
// The slot of an entry by its name (a compile-time error where there is none).
constexpr bool same_name(const char* a, const char* b) {
  while (*a != '\0' && *a == *b) ++a, ++b;
  return *a == *b;
}
constexpr int prof_slot(const char* name) {
  for (int i = 0; i < kProfSlots; ++i)
    if (same_name(kProfNames[i], name)) return i;
  return kProfSlots;  // refused by timed_for's static_assert
}

struct Profile {
  struct Pending {
    int slot;
    cudaEvent_t begin, end;
    int shape;  // index into shapes (matrix products), else -1
  };
  // The matrix products by shape: op(A) M x K times op(B) K x N, and the operand type.
  struct Shape {
    int ta, tb, type;
    int64_t M, N, K;
    double ms;
    int64_t calls;
  };
  std::vector<Shape> shapes;
  std::mutex mu;
  std::vector<Pending> pending;
  std::vector<cudaEvent_t> spare;
  cudaEvent_t first = nullptr, last = nullptr;  // the first begin and the latest end read
  double ms[kProfSlots] = {};
  int64_t calls[kProfSlots] = {};
  double span_ms = 0;

  cudaEvent_t take() {  // under mu
    if (!spare.empty()) {
      cudaEvent_t e = spare.back();
      spare.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    return cudaEventCreate(&e) == cudaSuccess ? e : nullptr;
  }
  // Reads every pending pair (waiting for the last), under mu.
  void read() {
    for (const Pending& p : pending) {
      float t = 0;
      if (cudaEventSynchronize(p.end) == cudaSuccess &&
          cudaEventElapsedTime(&t, p.begin, p.end) == cudaSuccess) {
        ms[p.slot] += t;
        ++calls[p.slot];
        if (p.shape >= 0) {
          shapes[p.shape].ms += t;
          ++shapes[p.shape].calls;
        }
      }
      if (first == nullptr) {
        first = p.begin;
      } else {
        spare.push_back(p.begin);
      }
      if (last != nullptr) spare.push_back(last);
      last = p.end;
    }
    pending.clear();
    float t = 0;
    if (first && last && cudaEventElapsedTime(&t, first, last) == cudaSuccess) span_ms = t;
    (void)cudaGetLastError();
  }
  int shape_of(int ta, int tb, int type, int64_t M, int64_t N, int64_t K) {  // under mu
    for (size_t i = 0; i < shapes.size(); ++i) {
      const Shape& h = shapes[i];
      if (h.ta == ta && h.tb == tb && h.type == type && h.M == M && h.N == N && h.K == K)
        return static_cast<int>(i);
    }
    shapes.push_back({ta, tb, type, M, N, K, 0.0, 0});
    return static_cast<int>(shapes.size() - 1);
  }
  void report(int device) {
    int order[kProfSlots];
    double total = 0;
    for (int i = 0; i < kProfSlots; ++i) {
      order[i] = i;
      total += ms[i];
    }
    std::sort(order, order + kProfSlots, [&](int a, int b) { return ms[a] > ms[b]; });
    std::fprintf(stderr,
                 "dt cuda profile (GPU %d): %.1f ms from the first timed call to the last, %.1f ms "
                 "in entries\n%-20s %9s %12s %10s %7s\n",
                 device, span_ms, total, "entry", "calls", "GPU ms", "mean us", "share");
    for (int i : order) {
      if (calls[i] == 0) continue;
      std::fprintf(stderr, "%-20s %9lld %12.2f %10.1f %6.1f%%\n", kProfNames[i],
                   static_cast<long long>(calls[i]), ms[i], 1000.0 * ms[i] / calls[i],
                   span_ms > 0 ? 100.0 * ms[i] / span_ms : 0.0);
    }
    std::sort(shapes.begin(), shapes.end(),
              [](const Shape& a, const Shape& b) { return a.ms > b.ms; });
    if (!shapes.empty())
      std::fprintf(stderr, "%-34s %9s %12s %10s %9s\n", "matrix product (M x N x K, ops, type)",
                   "calls", "GPU ms", "mean us", "TFLOP/s");
    for (const Shape& h : shapes) {
      if (h.calls == 0) continue;
      char name[64];
      std::snprintf(name, sizeof name, "%lld x %lld x %lld %c%c %s", static_cast<long long>(h.M),
                    static_cast<long long>(h.N), static_cast<long long>(h.K), h.ta ? 'T' : 'N',
                    h.tb ? 'T' : 'N',
                    h.type == DT_HAL_F32    ? "f32"
                    : h.type == DT_HAL_BF16 ? "bf16"
                                            : "f16");
      std::fprintf(stderr, "%-34s %9lld %12.2f %10.1f %9.1f\n", name,
                   static_cast<long long>(h.calls), h.ms, 1000.0 * h.ms / h.calls,
                   h.ms > 0 ? 2.0 * h.M * h.N * h.K * h.calls / (h.ms * 1e9) : 0.0);
    }
  }
  ~Profile() {
    for (cudaEvent_t e : spare) cudaEventDestroy(e);
    for (const Pending& p : pending) {
      cudaEventDestroy(p.begin);
      cudaEventDestroy(p.end);
    }
    if (first) cudaEventDestroy(first);
    if (last) cudaEventDestroy(last);
  }
};

void profile_start(Context* c) { c->prof = new (std::nothrow) Profile(); }
void profile_read(Context* c) {
  if (c->prof == nullptr) return;
  std::lock_guard<std::mutex> lk(c->prof->mu);
  c->prof->read();
}
void profile_finish(Context* c) {
  if (c->prof == nullptr) return;
  profile_read(c);
  c->prof->report(c->device);
  delete c->prof;
  c->prof = nullptr;
}

// Timed<Slot, A...>::call<Fn>: Fn, an entry taking (void* ctx, A...), between two events.
template <int Slot, class... A>
struct Timed {
  // The shape of a matrix product (gemm, gemm_ex), under p.mu; else -1.
  template <class... R>
  static int shape(Profile& p, int ta, int tb, int64_t M, int64_t N, int64_t K, R... rest) {
    if constexpr (Slot == prof_slot("gemm_ex")) {
      const dt_hal_dtype ab = std::get<sizeof...(R) - 2>(std::make_tuple(rest...));
      return p.shape_of(ta, tb, static_cast<int>(ab), M, N, K);
    } else if constexpr (Slot == prof_slot("gemm")) {
      return p.shape_of(ta, tb, static_cast<int>(DT_HAL_F32), M, N, K);
    }
    return -1;
  }
  template <class... R>
  static int shape(Profile&, R...) {
    return -1;
  }

  template <int (*Fn)(void*, A...)>
  static int call(void* ctx, A... a) {
    Context* c = C(ctx);
    if (c == nullptr || c->prof == nullptr || cudaSetDevice(c->device) != cudaSuccess ||
        capturing(c->stream))
      return Fn(ctx, a...);
    Profile& p = *c->prof;
    const cudaStream_t s = c->stream;
    cudaEvent_t begin, end;
    {
      std::lock_guard<std::mutex> lk(p.mu);
      begin = p.take();
      end = p.take();
    }
    if (begin) cudaEventRecord(begin, s);
    const int rc = Fn(ctx, a...);
    if (end) cudaEventRecord(end, s);
    std::lock_guard<std::mutex> lk(p.mu);
    if (begin && end) {
      p.pending.push_back({Slot, begin, end, shape(p, a...)});
    } else {
      if (begin) p.spare.push_back(begin);
      if (end) p.spare.push_back(end);
    }
    if (p.pending.size() >= 4096) p.read();
    return rc;
  }
};

const dt_hal_v2_t kCudaTable = {
    {
        DT_HAL_API_VERSION_2,
        "cuda",
        cuda_open,
        cuda_close,
        cuda_last_error,
        cuda_device_count,
        cuda_alloc,
        cuda_release,
        cuda_copy,
        cuda_fill_zero,
        cuda_synchronize,
        nullptr,  // set_threads: host threads are not the GPU's business
        cuda_gemm,
        cuda_bias_add,
        cuda_bias_grad,
        cuda_add,
        cuda_scale,
        cuda_sum_squares,
        cuda_embedding_fwd,
        cuda_embedding_bwd,
        cuda_layernorm_fwd,
        cuda_layernorm_bwd,
        cuda_gelu_fwd,
        cuda_gelu_bwd,
        cuda_attention_fwd,
        cuda_attention_bwd,
        cuda_softmax_xent_fwd,
        cuda_softmax_xent_bwd,
        cuda_adamw,
        cuda_cast_f32_to_bf16,
        cuda_cast_bf16_to_f32,
    },
    cuda_describe,
    cuda_gemm_ex,
    cuda_cast,
    cuda_scale_check_finite,
    cuda_adamw_multi,
    cuda_stream_create,
    cuda_stream_destroy,
    cuda_set_stream,
    cuda_native_stream,
    cuda_event_create,
    cuda_event_destroy,
    cuda_event_record,
    cuda_stream_wait_event,
    cuda_event_synchronize,
    cuda_graph_begin,
    cuda_graph_end,
    cuda_graph_launch,
    cuda_graph_destroy,
};

// The version-3 table: the version-2 one (its version field aside) and attention in a precision.
const dt_hal_v3_t kCudaTableV3 = [] {
  dt_hal_v3_t t{};
  t.v2 = kCudaTable;
  t.v2.v1.api_version = DT_HAL_API_VERSION_3;
  t.attention_fwd_ex = cuda_attention_fwd_ex;
  t.attention_bwd_ex = cuda_attention_bwd_ex;
  return t;
}();

// The version-4 table: the version-3 one (its version field aside) and attention that keeps the
// log-sum-exp.
const dt_hal_v4_t kCudaTableV4 = [] {
  dt_hal_v4_t t{};
  t.v3 = kCudaTableV3;
  t.v3.v2.v1.api_version = DT_HAL_API_VERSION_4;
  t.flash_attention_fwd = cuda_flash_attention_fwd;
  t.flash_attention_bwd = cuda_flash_attention_bwd;
  return t;
}();

// The version-4 table with every work entry timed (DT_CUDA_PROFILE=1).
template <int Slot, class... A>
constexpr Timed<Slot, A...> timed_for(int (*)(void*, A...)) {
  static_assert(Slot < kProfSlots, "a slot without a name");
  return {};
}
#define DT_TIMED(slot, fn) (&decltype(timed_for<slot>(fn))::template call<fn>)
const dt_hal_v4_t kCudaTableProfiled = [] {
  dt_hal_v4_t t4 = kCudaTableV4;
  dt_hal_v3_t& t = t4.v3;
  dt_hal_v1_t& v1 = t.v2.v1;
  v1.gemm = DT_TIMED(prof_slot("gemm"), cuda_gemm);
  v1.bias_add = DT_TIMED(prof_slot("bias_add"), cuda_bias_add);
  v1.bias_grad = DT_TIMED(prof_slot("bias_grad"), cuda_bias_grad);
  v1.add = DT_TIMED(prof_slot("add"), cuda_add);
  v1.scale = DT_TIMED(prof_slot("scale"), cuda_scale);
  v1.sum_squares = DT_TIMED(prof_slot("sum_squares"), cuda_sum_squares);
  v1.embedding_fwd = DT_TIMED(prof_slot("embedding_fwd"), cuda_embedding_fwd);
  v1.embedding_bwd = DT_TIMED(prof_slot("embedding_bwd"), cuda_embedding_bwd);
  v1.layernorm_fwd = DT_TIMED(prof_slot("layernorm_fwd"), cuda_layernorm_fwd);
  v1.layernorm_bwd = DT_TIMED(prof_slot("layernorm_bwd"), cuda_layernorm_bwd);
  v1.gelu_fwd = DT_TIMED(prof_slot("gelu_fwd"), cuda_gelu_fwd);
  v1.gelu_bwd = DT_TIMED(prof_slot("gelu_bwd"), cuda_gelu_bwd);
  v1.attention_fwd = DT_TIMED(prof_slot("attention_fwd"), cuda_attention_fwd);
  v1.attention_bwd = DT_TIMED(prof_slot("attention_bwd"), cuda_attention_bwd);
  v1.softmax_xent_fwd = DT_TIMED(prof_slot("softmax_xent_fwd"), cuda_softmax_xent_fwd);
  v1.softmax_xent_bwd = DT_TIMED(prof_slot("softmax_xent_bwd"), cuda_softmax_xent_bwd);
  v1.adamw = DT_TIMED(prof_slot("adamw"), cuda_adamw);
  v1.cast_f32_to_bf16 = DT_TIMED(prof_slot("cast_f32_to_bf16"), cuda_cast_f32_to_bf16);
  v1.cast_bf16_to_f32 = DT_TIMED(prof_slot("cast_bf16_to_f32"), cuda_cast_bf16_to_f32);
  t.v2.gemm_ex = DT_TIMED(prof_slot("gemm_ex"), cuda_gemm_ex);
  t.v2.cast = DT_TIMED(prof_slot("cast"), cuda_cast);
  t.v2.scale_check_finite = DT_TIMED(prof_slot("scale_check_finite"), cuda_scale_check_finite);
  t.v2.adamw_multi = DT_TIMED(prof_slot("adamw_multi"), cuda_adamw_multi);
  t.attention_fwd_ex = DT_TIMED(prof_slot("attention_fwd_ex"), cuda_attention_fwd_ex);
  t.attention_bwd_ex = DT_TIMED(prof_slot("attention_bwd_ex"), cuda_attention_bwd_ex);
  v1.copy = DT_TIMED(prof_slot("copy"), cuda_copy);
  v1.fill_zero = DT_TIMED(prof_slot("fill_zero"), cuda_fill_zero);
  t.v2.graph_launch = DT_TIMED(prof_slot("graph_launch"), cuda_graph_launch);
  t4.flash_attention_fwd = DT_TIMED(prof_slot("flash_attention_fwd"), cuda_flash_attention_fwd);
  t4.flash_attention_bwd = DT_TIMED(prof_slot("flash_attention_bwd"), cuda_flash_attention_bwd);
  return t4;
}();
#undef DT_TIMED

bool profile_requested() {
  const char* v = std::getenv("DT_CUDA_PROFILE");
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

}  // namespace

extern "C" DT_CUDA_EXPORT const dt_hal_v2_t* dt_hal_plugin_v2(void) { return &kCudaTable; }
extern "C" DT_CUDA_EXPORT const dt_hal_v3_t* dt_hal_plugin_v3(void) {
  static const dt_hal_v3_t profiled = [] {  // its version field says 3
    dt_hal_v3_t t = kCudaTableProfiled.v3;
    t.v2.v1.api_version = DT_HAL_API_VERSION_3;
    return t;
  }();
  return profile_requested() ? &profiled : &kCudaTableV3;
}
extern "C" DT_CUDA_EXPORT const dt_hal_v4_t* dt_hal_plugin_v4(void) {
  return profile_requested() ? &kCudaTableProfiled : &kCudaTableV4;
}
