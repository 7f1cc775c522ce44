/* dt_hal_v2.h: the device plugin ABI of dt, version 2.
 *
 * Version 2 adds what mixed precision, multi-stream execution and graph replay need. A version-2
 * plugin exports
 *
 *     const dt_hal_v2_t* dt_hal_plugin_v2(void);
 *
 * The table starts with a complete version-1 table (`v1`) whose entries keep exactly their
 * version-1 meaning; only its api_version field differs: it holds DT_HAL_API_VERSION_2. So the
 * first int of every dt table, of any version, is its version. The rules of dt_hal.h hold for
 * every entry here too. New in version 2:
 *  - 16-bit storage types (dt_hal_dtype): bf16 and fp16 tensors are stored as uint16_t bit
 *    patterns; arithmetic on them happens in fp32 and is rounded once to the storage type.
 *  - "stream" and "event" handles are opaque (void*). A context has one current stream (set by
 *    set_stream; NULL selects the context's own default stream) and every kernel, copy and fill is
 *    ordered on it. Devices that run everything synchronously (the CPU) implement them as no-ops
 *    with non-NULL dummy handles.
 *  - "flag" arguments (found_inf) are device pointers to one int32 that a kernel may set to 1 and
 *    never clears: the caller zeroes it, runs the kernels, and copies it back (stream-ordered, so
 *    no kernel has to synchronise with the host, and the work can be captured into a graph).
 *
 * dt loads version-1 plugins through an adapter: their table is copied into the `v1` member of a
 * dt_hal_v2_t whose version-2 entries are all NULL, so the core asks for them like any optional
 * entry and names what is missing.
 */
#ifndef DT_HAL_V2_H
#define DT_HAL_V2_H

#include "dt_hal.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DT_HAL_API_VERSION_2 2

/* Element types of version-2 entries that take more than one type. */
typedef enum {
  DT_HAL_F32 = 0,  /* IEEE binary32 */
  DT_HAL_BF16 = 1, /* bfloat16 bits in uint16_t */
  DT_HAL_F16 = 2   /* IEEE binary16 bits in uint16_t */
} dt_hal_dtype;

typedef struct dt_hal_v2 {
  /* Every version-1 entry, same meaning; v1.api_version == DT_HAL_API_VERSION_2. */
  dt_hal_v1_t v1;

  /* (optional) One line describing the opened device ("NVIDIA H200, sm_90, 139.8 GiB, driver
   * 13.0, runtime 13.0") into buf (always NUL-terminated, truncated to len). */
  int (*describe)(void* ctx, char* buf, size_t len);

  /* ---- mixed precision ------------------------------------------------------------------- */
  /* C[M,N] = alpha * op(A) @ op(B) + beta * C as v1 gemm, with A and B of type ab_type and C of
   * type c_type (F32, BF16 or F16 each; any pairing). Products are accumulated in fp32 (at least),
   * alpha and beta applied in fp32, and C rounded once to c_type. */
  int (*gemm_ex)(void* ctx, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                 const void* A, int64_t lda, const void* B, int64_t ldb, float beta, void* C,
                 int64_t ldc, dt_hal_dtype ab_type, dt_hal_dtype c_type);
  /* out[i] = in[i] converted from in_type to out_type (equal types copy). Round to nearest even;
   * NaN stays NaN (quiet, sign kept); values beyond the target's range become +-Inf; fp16 keeps
   * subnormals. in and out must not overlap unless they are the same pointer of the same type. */
  int (*cast)(void* ctx, void* out, dt_hal_dtype out_type, const void* in, dt_hal_dtype in_type,
              int64_t n);
  /* x[i] *= s (fp32). If any x[i] is Inf or NaN before or after scaling, *found_inf = 1 (a device
   * flag, see above); the other elements are still scaled. Used to unscale loss-scaled gradients
   * and to find an overflow in one pass. */
  int (*scale_check_finite)(void* ctx, float* x, int64_t n, float s, int32_t* found_inf);
  /* Fused multi-tensor AdamW: for k < count, the v1 adamw update (same formula, same step t) of
   * params[k], grads[k], m[k], v[k], each of sizes[k] elements, with weight decay
   * weight_decay[k]. The pointer and size arrays are host arrays (read during the call) of device
   * pointers; count may be 0. */
  int (*adamw_multi)(void* ctx, int count, float* const* params, const float* const* grads,
                     float* const* m, float* const* v, const int64_t* sizes,
                     const float* weight_decay, float lr, float beta1, float beta2, float eps,
                     int64_t t);

  /* ---- streams and events (optional as a group) ---------------------------------------- */
  int (*stream_create)(void* ctx, void** stream);
  void (*stream_destroy)(void* ctx, void* stream);
  /* Later work on this context goes to `stream` (NULL: the context's default stream). */
  int (*set_stream)(void* ctx, void* stream);
  /* The native handle of the current stream (a cudaStream_t for CUDA), for libraries such as
   * NCCL that enqueue on it; NULL where the device has none. */
  int (*native_stream)(void* ctx, void** handle);
  int (*event_create)(void* ctx, void** event);
  void (*event_destroy)(void* ctx, void* event);
  /* Records `event` on the current stream. */
  int (*event_record)(void* ctx, void* event);
  /* Work later put on the current stream waits for `event` (no host wait). */
  int (*stream_wait_event)(void* ctx, void* event);
  /* Host waits for `event`. */
  int (*event_synchronize)(void* ctx, void* event);

  /* ---- graph capture and replay (optional as a group) ----------------------------------- */
  /* Starts capturing the work put on the current stream (which must not be the default
   * stream); nothing runs until the graph is launched. */
  int (*graph_begin)(void* ctx);
  /* Ends the capture; *graph receives a launchable graph. */
  int (*graph_end)(void* ctx, void** graph);
  /* Replays `graph` on the current stream. */
  int (*graph_launch)(void* ctx, void* graph);
  void (*graph_destroy)(void* ctx, void* graph);
} dt_hal_v2_t;

/* The entry of a version-2 plugin (C linkage and exported, as in dt_hal.h). */
DT_HAL_PLUGIN_EXPORT const dt_hal_v2_t* dt_hal_plugin_v2(void);
typedef const dt_hal_v2_t* (*dt_hal_plugin_v2_fn)(void);
#define DT_HAL_PLUGIN_V2_SYMBOL "dt_hal_plugin_v2"

#ifdef __cplusplus
}
#endif

#endif /* DT_HAL_V2_H */
