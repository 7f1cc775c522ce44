/* dt_hal.h: the device plugin ABI of dt, version 1.
 *
 * A device plugin is a shared library libdt_hal_NAME.so that exports
 *
 *     const dt_hal_v1_t* dt_hal_plugin_v1(void);
 *
 * returning a table that lives as long as the library is loaded. dt calls nothing else. The
 * built-in CPU device is reached through the very same table. Only C types cross this boundary.
 *
 * Rules for every entry:
 *  - Returns DT_HAL_OK (0) or an error status; after an error, last_error(ctx) describes it.
 *  - Pointers to tensors are device pointers obtained from alloc() (host memory for the CPU
 *    device). All tensors are dense, row-major, float32 unless the name says otherwise.
 *  - Kernels may run asynchronously; synchronize() waits for all of them.
 *  - "acc" in a comment: the kernel ADDS into that output (gradients accumulate); others overwrite.
 *  - Entries marked (optional) may be NULL; dt asks before use and reports what is missing.
 *
 * A new ABI version gets a new header (dt_hal_v2_t, dt_hal_plugin_v2) and an adapter in dt for
 * the old one; a version-1 table never changes layout. Version 2 is in dt_hal_v2.h: it embeds
 * this table and adds 16-bit storage, loss scaling, fused AdamW, streams, events and graphs.
 */
#ifndef DT_HAL_H
#define DT_HAL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DT_HAL_API_VERSION_1 1

/* Marks a plugin's entry function for export, so a plugin built with -fvisibility=hidden still
 * exports it; the declarations below carry it, so a definition needs nothing more. */
#if defined(__GNUC__) || defined(__clang__)
#define DT_HAL_PLUGIN_EXPORT __attribute__((visibility("default")))
#else
#define DT_HAL_PLUGIN_EXPORT
#endif

typedef enum {
  DT_HAL_OK = 0,
  DT_HAL_ERR_INVALID = 1,    /* bad argument */
  DT_HAL_ERR_NOMEM = 2,      /* allocation failed */
  DT_HAL_ERR_DEVICE = 3,     /* the device or its library failed */
  DT_HAL_ERR_UNSUPPORTED = 4 /* valid request this device cannot do */
} dt_hal_status;

typedef enum {
  DT_HAL_HOST_TO_DEVICE = 0,
  DT_HAL_DEVICE_TO_HOST = 1,
  DT_HAL_DEVICE_TO_DEVICE = 2
} dt_hal_copy_kind;

typedef struct dt_hal_v1 {
  int api_version; /* DT_HAL_API_VERSION_1 */
  const char* name;

  /* ---- device and memory ---------------------------------------------------------------- */
  /* Opens device `index` (0 for the CPU); *ctx receives the plugin's state. */
  int (*open)(int index, void** ctx);
  void (*close)(void* ctx);
  /* Text of the last error on this context ("" if none); valid until the next call. With ctx
   * NULL: the last error of a call without a context (open, device_count), which dt asks for
   * after either fails. */
  const char* (*last_error)(void* ctx);
  /* Number of devices of this kind on the node. */
  int (*device_count)(int* count);
  /* 64-byte aligned (at least) device memory; contents undefined. */
  int (*alloc)(void* ctx, size_t bytes, void** ptr);
  void (*release)(void* ctx, void* ptr);
  int (*copy)(void* ctx, void* dst, const void* src, size_t bytes, dt_hal_copy_kind kind);
  int (*fill_zero)(void* ctx, void* dst, size_t bytes);
  int (*synchronize)(void* ctx);
  /* (optional) Threads the device may use for host-side work (BLAS threads on the CPU). */
  int (*set_threads)(void* ctx, int threads);

  /* ---- dense algebra -------------------------------------------------------------------- */
  /* C[M,N] = alpha * op(A) @ op(B) + beta * C; op(X) = X^T when trans_x. Row-major with leading
   * dimensions lda, ldb, ldc (elements). */
  int (*gemm)(void* ctx, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
              const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
              int64_t ldc);
  /* out[n, c] += bias[c] for n < N, c < C. */
  int (*bias_add)(void* ctx, float* out, const float* bias, int64_t N, int64_t C);
  /* dbias[c] += sum_n dout[n, c]   (acc) */
  int (*bias_grad)(void* ctx, float* dbias, const float* dout, int64_t N, int64_t C);
  /* out[i] = a[i] + b[i] */
  int (*add)(void* ctx, float* out, const float* a, const float* b, int64_t n);
  /* x[i] *= s */
  int (*scale)(void* ctx, float* x, float s, int64_t n);
  /* *out = sum_i x[i]^2, accumulated in double. */
  int (*sum_squares)(void* ctx, const float* x, int64_t n, double* out);

  /* ---- transformer layers ----------------------------------------------------------------- */
  /* out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]; tokens in [0, V) (checked: DT_HAL_ERR_INVALID). */
  int (*embedding_fwd)(void* ctx, float* out, const int32_t* tokens, const float* wte,
                       const float* wpe, int64_t B, int64_t T, int64_t C, int64_t V);
  /* dwte[tokens[b,t],:] += dout[b,t,:]; dwpe[t,:] += dout[b,t,:]   (acc) */
  int (*embedding_bwd)(void* ctx, float* dwte, float* dwpe, const float* dout,
                       const int32_t* tokens, int64_t B, int64_t T, int64_t C);
  /* Per row n of inp[N,C]: mean[n], rstd[n] = 1/sqrt(var + 1e-5) (biased variance),
   * out = (inp - mean) * rstd * w + b. */
  int (*layernorm_fwd)(void* ctx, float* out, float* mean, float* rstd, const float* inp,
                       const float* w, const float* b, int64_t N, int64_t C);
  /* dinp, dw, db   (all acc) */
  int (*layernorm_bwd)(void* ctx, float* dinp, float* dw, float* db, const float* dout,
                       const float* inp, const float* w, const float* mean, const float* rstd,
                       int64_t N, int64_t C);
  /* GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
  int (*gelu_fwd)(void* ctx, float* out, const float* inp, int64_t n);
  /* dinp += dout * gelu'(inp)   (acc) */
  int (*gelu_bwd)(void* ctx, float* dinp, const float* inp, const float* dout, int64_t n);
  /* Causal multi-head self-attention core. qkv[B,T,3C] holds q, k, v (each C = NH * hs, head h
   * at columns h*hs..), att[B,NH,T,T] receives the softmax probabilities (entries above the
   * diagonal are 0), out[B,T,C] = att @ v per head, scale 1/sqrt(hs). */
  int (*attention_fwd)(void* ctx, float* out, float* att, const float* qkv, int64_t B, int64_t T,
                       int64_t C, int64_t NH);
  /* dqkv (acc) from dout[B,T,C]; scratch[B,NH,T,T] is workspace. */
  int (*attention_bwd)(void* ctx, float* dqkv, float* scratch, const float* dout, const float* qkv,
                       const float* att, int64_t B, int64_t T, int64_t C, int64_t NH);
  /* Per row n: probs[n,:] = softmax(logits[n,:]), losses[n] = -log probs[n, targets[n]].
   * targets in [0, V) (checked). */
  int (*softmax_xent_fwd)(void* ctx, float* losses, float* probs, const float* logits,
                          const int32_t* targets, int64_t N, int64_t V);
  /* dlogits[n,:] = (probs[n,:] - onehot(targets[n])) * dloss   (overwrites) */
  int (*softmax_xent_bwd)(void* ctx, float* dlogits, const float* probs, const int32_t* targets,
                          float dloss, int64_t N, int64_t V);

  /* ---- optimiser and casts ---------------------------------------------------------------- */
  /* AdamW step t (1-based) with bias correction; decoupled weight decay:
   * m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (mhat / (sqrt(vhat) + eps) + wd p). */
  int (*adamw)(void* ctx, float* params, const float* grads, float* m, float* v, int64_t n,
               float lr, float beta1, float beta2, float eps, float weight_decay, int64_t t);
  /* Round to nearest even; NaN stays NaN. */
  int (*cast_f32_to_bf16)(void* ctx, uint16_t* out, const float* in, int64_t n);
  int (*cast_bf16_to_f32)(void* ctx, float* out, const uint16_t* in, int64_t n);
} dt_hal_v1_t;

/* The one symbol a plugin exports. Declared here with C linkage, so a plugin written in C++
 * defines it unmangled without an extern "C" of its own; a plugin defines the entries of the
 * versions it provides and no others. */
DT_HAL_PLUGIN_EXPORT const dt_hal_v1_t* dt_hal_plugin_v1(void);
typedef const dt_hal_v1_t* (*dt_hal_plugin_v1_fn)(void);
#define DT_HAL_PLUGIN_V1_SYMBOL "dt_hal_plugin_v1"

#ifdef __cplusplus
}
#endif

#endif /* DT_HAL_H */
