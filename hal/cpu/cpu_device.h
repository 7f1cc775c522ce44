/* The built-in CPU device of dt (OpenBLAS for GEMM, vectorised loops for the rest). */
#ifndef DT_HAL_CPU_DEVICE_H
#define DT_HAL_CPU_DEVICE_H

#include "dt_hal.h"
#include "dt_hal_v2.h"
#include "dt_hal_v3.h"
#include "dt_hal_v4.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The CPU device's table; the same one a libdt_hal_cpu_shared.so build exports as
 * dt_hal_plugin_v1. */
const dt_hal_v1_t* dt_hal_cpu_v1(void);
/* The version-2 table (the v1 entries plus 16-bit storage, loss scaling, fused AdamW and no-op
 * streams), exported as dt_hal_plugin_v2 by the shared build. */
const dt_hal_v2_t* dt_hal_cpu_v2(void);
/* The version-3 table (the v2 entries plus attention in a given precision), exported as
 * dt_hal_plugin_v3 by the shared build. */
const dt_hal_v3_t* dt_hal_cpu_v3(void);
/* The version-4 table (the v3 entries plus attention that keeps the log-sum-exp), exported as
 * dt_hal_plugin_v4 by the shared build; dt uses this one. */
const dt_hal_v4_t* dt_hal_cpu_v4(void);

#ifdef __cplusplus
}
#endif

#endif
