/* dt_hal_v4.h: the device plugin ABI of dt, version 4.
 *
 * Version 4 adds causal self-attention that keeps, per query row, only the log-sum-exp of its
 * scores instead of the T x T probabilities, and whose backward recomputes the probabilities from
 * it (the method of FlashAttention): attention's saved state shrinks from B NH T T to B NH T
 * floats, and a GPU can run the whole of it in on-chip memory. A version-4 plugin exports
 *
 *     const dt_hal_v4_t* dt_hal_plugin_v4(void);
 *
 * The table starts with a complete version-3 table (`v3`) whose entries keep exactly their
 * version-3 meaning; only v3.v2.v1.api_version differs: it holds DT_HAL_API_VERSION_4. The rules
 * of dt_hal.h, dt_hal_v2.h and dt_hal_v3.h hold here too. dt loads older plugins through adapters
 * whose version-4 entries are NULL; on such a device dt computes attention with the entries of
 * version 3 (or 1), keeping the probabilities.
 */
#ifndef DT_HAL_V4_H
#define DT_HAL_V4_H

#include "dt_hal_v3.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DT_HAL_API_VERSION_4 4

typedef struct dt_hal_v4 {
  /* Every version-3 entry, same meaning; v3.v2.v1.api_version == DT_HAL_API_VERSION_4. */
  dt_hal_v3_t v3;

  /* ---- attention without the probabilities (optional as a pair: dt refuses a table with one) */
  /* The layout of attention_fwd: qkv[B,T,3C] (q, k, v; head h at columns h*hs.. of each, C =
   * NH hs), out[B,T,C], scale 1/sqrt(hs), causal. Instead of the probabilities,
   * lse[B,NH,T] receives per query row t the log-sum-exp of its scaled scores,
   * lse = log sum_{j<=t} exp(scale q_t . k_j), so that the probabilities are
   * exp(scale q_t . k_j - lse). The products take q, k, v and the probabilities rounded to `dtype`
   * (round to nearest even) and accumulate in fp32; the exponentials run in fp32. out agrees with
   * attention_fwd_ex of the same dtype within its rounding (a device may normalise at the end, as
   * an online softmax does, where attention_fwd_ex rounds normalised probabilities). */
  int (*flash_attention_fwd)(void* ctx, float* out, float* lse, const float* qkv, int64_t B,
                             int64_t T, int64_t C, int64_t NH, dt_hal_dtype dtype);
  /* dqkv (acc) from dout[B,T,C], with qkv and lse as flash_attention_fwd took and left them and
   * out its output, stored in out_dtype (DT_HAL_F32, or `dtype`: the output rounded as the
   * caller keeps it). The probabilities P are recomputed from lse; with dP = dout v^T and
   * D = rowsum(dout * out) (the output's form of rowsum(P * dP), which a device may compute
   * instead: the same value up to rounding), dS = scale P (dP - D), and
   * dv += P^T dout, dq += dS k, dk += dS^T q, the products taking their operands (q, k, v, dout,
   * P and dS) rounded to `dtype` and accumulating in fp32. scratch[B,NH,T] is workspace (D). */
  int (*flash_attention_bwd)(void* ctx, float* dqkv, float* scratch, const float* dout,
                             const float* qkv, const void* out, dt_hal_dtype out_dtype,
                             const float* lse, int64_t B, int64_t T, int64_t C, int64_t NH,
                             dt_hal_dtype dtype);
} dt_hal_v4_t;

/* The entry of a version-4 plugin (C linkage and exported, as in dt_hal.h). */
DT_HAL_PLUGIN_EXPORT const dt_hal_v4_t* dt_hal_plugin_v4(void);
typedef const dt_hal_v4_t* (*dt_hal_plugin_v4_fn)(void);
#define DT_HAL_PLUGIN_V4_SYMBOL "dt_hal_plugin_v4"

#ifdef __cplusplus
}
#endif

#endif /* DT_HAL_V4_H */
