/* A skeleton of a vendor NPU device plugin for dt (hal/dt_hal_v4.h), to copy and fill in.
 *
 * What a port does, in order (Ascend CANN and Cambricon CNRT/CNNL names given as examples):
 *  1. Device and memory: open() picks the device and makes a context and a stream
 *     (aclrtSetDevice + aclrtCreateContext + aclrtCreateStream; cnrtSetDevice + cnrtQueueCreate),
 *     alloc/release/copy/fill_zero map to aclrtMalloc/aclrtFree/aclrtMemcpyAsync/aclrtMemsetAsync
 *     (cnrtMalloc/cnrtFree/cnrtMemcpyAsync/cnrtMemsetD8Async) on that stream, synchronize() to
 *     aclrtSynchronizeStream (cnrtQueueSync). Here they use host memory so the skeleton runs as is.
 *  2. Kernels, one table entry at a time, each with its case in a differential test against the
 *     CPU device (see tests/gpu/test_cuda_kernels.cpp for the pattern): gemm first (aclnnMatmul,
 *     cnnlMatMul), then the layers. An entry left NULL is reported by dt, by name, before any
 *     training starts (dt::require_training_kernels), never discovered mid-run.
 *  3. Mixed precision: gemm_ex, cast and scale_check_finite for bf16/fp16 training, then
 *     attention_fwd_ex/attention_bwd_ex so attention's products run in 16 bits too (without them
 *     dt runs attention in fp32), then flash_attention_fwd/flash_attention_bwd so attention keeps
 *     one log-sum-exp per row instead of its T x T probabilities (without them dt keeps the
 *     probabilities; the vendor's fused attention, aclnnFlashAttentionScore, fits here).
 *  4. Streams and events, then graph capture (aclmdlRI capture, cnrtQueueBeginCapture), if the
 *     runtime has them.
 *
 * Rules that hold for every entry (dt_hal.h): check arguments first and return DT_HAL_ERR_INVALID
 * with a message in the context (last_error), never abort or throw; nothing but C types crosses
 * the boundary; the table is static and lives as long as the library.
 *
 * As shipped, the skeleton provides device, memory, streams (no-ops) and two example kernels
 * (add, scale): it loads, describes itself, and dt refuses to train on it, naming the missing
 * kernels. Built as build/plugins/libdt_hal_template.so; try it with
 *     dt_train ... --runtime.device=template --runtime.plugin-path=build/plugins
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dt_hal_v4.h"

#define TPL_EXPORT __attribute__((visibility("default")))

typedef struct {
  char error[512];
  /* A port keeps its runtime handles here: aclrtContext, aclrtStream / cnrtQueue_t, ... */
} tpl_context;

/* Errors raised without a context (open); last_error(NULL) returns them. */
static _Thread_local char tpl_orphan_error[512];

static int tpl_fail(void* ctx, int status, const char* fmt, ...) {
  char* slot = ctx ? ((tpl_context*)ctx)->error : tpl_orphan_error;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(slot, 512, fmt, ap);
  va_end(ap);
  return status;
}

/* ---- device and memory ------------------------------------------------------------------- */

static int tpl_device_count(int* count) {
  if (!count) return tpl_fail(NULL, DT_HAL_ERR_INVALID, "device_count: count is null");
  *count = 1; /* aclrtGetDeviceCount / cnrtGetDeviceCount */
  return DT_HAL_OK;
}

static int tpl_open(int index, void** ctx) {
  if (!ctx) return tpl_fail(NULL, DT_HAL_ERR_INVALID, "open: ctx out-pointer is null");
  *ctx = NULL;
  if (index != 0)
    return tpl_fail(NULL, DT_HAL_ERR_INVALID, "open: device index %d does not exist (1 device)",
                    index);
  tpl_context* c = (tpl_context*)calloc(1, sizeof *c);
  if (!c) return tpl_fail(NULL, DT_HAL_ERR_NOMEM, "open: out of memory");
  *ctx = c;
  return DT_HAL_OK;
}

static void tpl_close(void* ctx) { free(ctx); }

static const char* tpl_last_error(void* ctx) {
  return ctx ? ((tpl_context*)ctx)->error : tpl_orphan_error;
}

static int tpl_alloc(void* ctx, size_t bytes, void** ptr) {
  if (!ctx || !ptr) return tpl_fail(ctx, DT_HAL_ERR_INVALID, "alloc: null argument");
  const size_t rounded = bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
  if (rounded < bytes)
    return tpl_fail(ctx, DT_HAL_ERR_NOMEM, "alloc: %zu bytes is too large", bytes);
  *ptr = aligned_alloc(64, rounded);
  if (!*ptr) return tpl_fail(ctx, DT_HAL_ERR_NOMEM, "alloc: out of memory for %zu bytes", bytes);
  return DT_HAL_OK;
}

static void tpl_release(void* ctx, void* ptr) {
  (void)ctx;
  free(ptr);
}

static int tpl_copy(void* ctx, void* dst, const void* src, size_t bytes, dt_hal_copy_kind kind) {
  if (!ctx) return tpl_fail(NULL, DT_HAL_ERR_INVALID, "copy: null context");
  if (kind != DT_HAL_HOST_TO_DEVICE && kind != DT_HAL_DEVICE_TO_HOST &&
      kind != DT_HAL_DEVICE_TO_DEVICE)
    return tpl_fail(ctx, DT_HAL_ERR_INVALID, "copy: unknown copy kind %d", (int)kind);
  if (bytes == 0) return DT_HAL_OK;
  if (!dst || !src)
    return tpl_fail(ctx, DT_HAL_ERR_INVALID, "copy: null pointer for %zu bytes", bytes);
  memmove(dst, src, bytes);
  return DT_HAL_OK;
}

static int tpl_fill_zero(void* ctx, void* dst, size_t bytes) {
  if (!ctx) return tpl_fail(NULL, DT_HAL_ERR_INVALID, "fill_zero: null context");
  if (bytes && !dst) return tpl_fail(ctx, DT_HAL_ERR_INVALID, "fill_zero: dst is null");
  if (bytes) memset(dst, 0, bytes);
  return DT_HAL_OK;
}

static int tpl_synchronize(void* ctx) {
  return ctx ? DT_HAL_OK : tpl_fail(NULL, DT_HAL_ERR_INVALID, "synchronize: null context");
}

/* ---- example kernels: the pattern every kernel follows ----------------------------------- */

static int tpl_add(void* ctx, float* out, const float* a, const float* b, int64_t n) {
  if (!ctx) return tpl_fail(NULL, DT_HAL_ERR_INVALID, "add: null context");
  if (n < 0) return tpl_fail(ctx, DT_HAL_ERR_INVALID, "add: n = %lld is negative", (long long)n);
  if (n && (!out || !a || !b)) return tpl_fail(ctx, DT_HAL_ERR_INVALID, "add: null tensor");
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i]; /* a port launches its kernel here */
  return DT_HAL_OK;
}

static int tpl_scale(void* ctx, float* x, float s, int64_t n) {
  if (!ctx) return tpl_fail(NULL, DT_HAL_ERR_INVALID, "scale: null context");
  if (n < 0) return tpl_fail(ctx, DT_HAL_ERR_INVALID, "scale: n = %lld is negative", (long long)n);
  if (n && !x) return tpl_fail(ctx, DT_HAL_ERR_INVALID, "scale: x is null");
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
  return DT_HAL_OK;
}

static int tpl_describe(void* ctx, char* buf, size_t len) {
  if (!ctx || !buf || !len) return tpl_fail(ctx, DT_HAL_ERR_INVALID, "describe: null argument");
  /* A port names the chip, its memory and the runtime version (aclrtGetSocName, ...). */
  snprintf(buf, len, "template NPU skeleton (host memory stand-in; kernels: add, scale)");
  return DT_HAL_OK;
}

/* ---- streams and events: a synchronous stand-in ----------------------------------------- */
static char tpl_sync_tag;
static int tpl_handle_create(void* ctx, void** h) {
  if (!ctx || !h) return tpl_fail(ctx, DT_HAL_ERR_INVALID, "stream/event create: null argument");
  *h = &tpl_sync_tag;
  return DT_HAL_OK;
}
static void tpl_handle_destroy(void* ctx, void* h) {
  (void)ctx;
  (void)h;
}
static int tpl_handle_op(void* ctx, void* h) {
  (void)h;
  return ctx ? DT_HAL_OK : tpl_fail(NULL, DT_HAL_ERR_INVALID, "stream/event: null context");
}
static int tpl_native_stream(void* ctx, void** h) {
  if (!ctx || !h) return tpl_fail(ctx, DT_HAL_ERR_INVALID, "native_stream: null argument");
  *h = NULL; /* a port returns its aclrtStream / cnrtQueue_t for the vendor's collectives */
  return DT_HAL_OK;
}

/* Designated initialisers: every entry not named is NULL, which dt reports by name. */
static const dt_hal_v4_t tpl_table = {
    .v3 =
        {
            .v2 =
                {
                    .v1 =
                        {
                            .api_version = DT_HAL_API_VERSION_4,
                            .name = "template",
                            .open = tpl_open,
                            .close = tpl_close,
                            .last_error = tpl_last_error,
                            .device_count = tpl_device_count,
                            .alloc = tpl_alloc,
                            .release = tpl_release,
                            .copy = tpl_copy,
                            .fill_zero = tpl_fill_zero,
                            .synchronize = tpl_synchronize,
                            .add = tpl_add,
                            .scale = tpl_scale,
                            /* gemm, bias_add, ..., adamw, casts: NULL until ported */
                        },
                    .describe = tpl_describe,
                    .stream_create = tpl_handle_create,
                    .stream_destroy = tpl_handle_destroy,
                    .set_stream = tpl_handle_op,
                    .native_stream = tpl_native_stream,
                    .event_create = tpl_handle_create,
                    .event_destroy = tpl_handle_destroy,
                    .event_record = tpl_handle_op,
                    .stream_wait_event = tpl_handle_op,
                    .event_synchronize = tpl_handle_op,
                },
            /* attention_fwd_ex, attention_bwd_ex: NULL until ported */
        },
    /* flash_attention_fwd, flash_attention_bwd: NULL until ported */
};

TPL_EXPORT const dt_hal_v4_t* dt_hal_plugin_v4(void) { return &tpl_table; }
