/* dt_hal_v3.h: the device plugin ABI of dt, version 3.
 *
 * Version 3 adds causal self-attention whose matrix products run in a 16-bit type, as every other
 * matrix product of mixed-precision training does (gemm_ex): on a GPU the attention products then
 * run on tensor cores instead of fp32 units. A version-3 plugin exports
 *
 *     const dt_hal_v3_t* dt_hal_plugin_v3(void);
 *
 * The table starts with a complete version-2 table (`v2`) whose entries keep exactly their
 * version-2 meaning; only v2.v1.api_version differs: it holds DT_HAL_API_VERSION_3. The rules of
 * dt_hal.h and dt_hal_v2.h hold here too. dt loads version-2 and version-1 plugins through adapters
 * whose version-3 entries are NULL; on such a device dt computes attention with the version-1
 * entries, in fp32, whatever train.dtype says.
 */
#ifndef DT_HAL_V3_H
#define DT_HAL_V3_H

#include "dt_hal_v2.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DT_HAL_API_VERSION_3 3

typedef struct dt_hal_v3 {
  /* Every version-2 entry, same meaning; v2.v1.api_version == DT_HAL_API_VERSION_3. */
  dt_hal_v2_t v2;

  /* ---- attention in a given precision (optional as a pair: dt refuses a table with one) -- */
  /* attention_fwd of version 1 (same arguments, layout and outputs) with its two products,
   * scale q k^T and att v, taking their operands rounded to `dtype` (round to nearest even) and
   * accumulating in fp32. The softmax runs in fp32 on the fp32 scores, and `att` keeps the fp32
   * probabilities; the product att v takes them rounded. dtype F32 is exactly attention_fwd. */
  int (*attention_fwd_ex)(void* ctx, float* out, float* att, const float* qkv, int64_t B, int64_t T,
                          int64_t C, int64_t NH, dt_hal_dtype dtype);
  /* attention_bwd of version 1 with its four products taking their operands rounded to `dtype`
   * and accumulating in fp32: S = dout v^T, dv += att^T dout, dq += S' k and dk += S'^T q, where
   * S' = scale att (S - rowsum(att S)) is computed in fp32 from the fp32 att and S and then
   * rounded. dtype F32 is exactly attention_bwd. */
  int (*attention_bwd_ex)(void* ctx, float* dqkv, float* scratch, const float* dout,
                          const float* qkv, const float* att, int64_t B, int64_t T, int64_t C,
                          int64_t NH, dt_hal_dtype dtype);
} dt_hal_v3_t;

/* The entry of a version-3 plugin (C linkage and exported, as in dt_hal.h). */
DT_HAL_PLUGIN_EXPORT const dt_hal_v3_t* dt_hal_plugin_v3(void);
typedef const dt_hal_v3_t* (*dt_hal_plugin_v3_fn)(void);
#define DT_HAL_PLUGIN_V3_SYMBOL "dt_hal_plugin_v3"

#ifdef __cplusplus
}
#endif

#endif /* DT_HAL_V3_H */
