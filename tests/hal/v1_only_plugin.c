/* A version-1 plugin as built before ABI version 2 existed: host memory and two kernels (add,
 * scale). dt must load it through its adapter, run its kernels, report every version-2 entry as
 * missing, and refuse to train on it naming the missing kernels. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dt_hal.h"

static char orphan[256];
typedef struct {
  char error[256];
} ctx_t;

static int v1_open(int index, void** ctx) {
  if (!ctx) return DT_HAL_ERR_INVALID;
  *ctx = NULL;
  if (index != 0) {
    snprintf(orphan, sizeof orphan, "open: legacy test device has no index %d", index);
    return DT_HAL_ERR_INVALID;
  }
  *ctx = calloc(1, sizeof(ctx_t));
  return *ctx ? DT_HAL_OK : DT_HAL_ERR_NOMEM;
}
static void v1_close(void* ctx) { free(ctx); }
static const char* v1_last_error(void* ctx) { return ctx ? ((ctx_t*)ctx)->error : orphan; }
static int v1_device_count(int* n) {
  *n = 1;
  return DT_HAL_OK;
}
static int v1_alloc(void* ctx, size_t bytes, void** p) {
  (void)ctx;
  *p = aligned_alloc(64, bytes ? (bytes + 63) / 64 * 64 : 64);
  return *p ? DT_HAL_OK : DT_HAL_ERR_NOMEM;
}
static void v1_release(void* ctx, void* p) {
  (void)ctx;
  free(p);
}
static int v1_copy(void* ctx, void* dst, const void* src, size_t bytes, dt_hal_copy_kind k) {
  (void)ctx;
  (void)k;
  if (bytes) memmove(dst, src, bytes);
  return DT_HAL_OK;
}
static int v1_fill_zero(void* ctx, void* dst, size_t bytes) {
  (void)ctx;
  if (bytes) memset(dst, 0, bytes);
  return DT_HAL_OK;
}
static int v1_sync(void* ctx) {
  (void)ctx;
  return DT_HAL_OK;
}
static int v1_add(void* ctx, float* out, const float* a, const float* b, int64_t n) {
  if (n < 0) {
    snprintf(((ctx_t*)ctx)->error, 256, "add: n = %lld is negative", (long long)n);
    return DT_HAL_ERR_INVALID;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
  return DT_HAL_OK;
}
static int v1_scale(void* ctx, float* x, float s, int64_t n) {
  (void)ctx;
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
  return DT_HAL_OK;
}

static const dt_hal_v1_t table = {
    .api_version = DT_HAL_API_VERSION_1,
    .name = "legacy",
    .open = v1_open,
    .close = v1_close,
    .last_error = v1_last_error,
    .device_count = v1_device_count,
    .alloc = v1_alloc,
    .release = v1_release,
    .copy = v1_copy,
    .fill_zero = v1_fill_zero,
    .synchronize = v1_sync,
    .add = v1_add,
    .scale = v1_scale,
};

__attribute__((visibility("default"))) const dt_hal_v1_t* dt_hal_plugin_v1(void) { return &table; }
