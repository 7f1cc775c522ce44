/* The built-in CPU device of dt (OpenBLAS for GEMM, vectorised loops for the rest). */
#ifndef DT_HAL_CPU_DEVICE_H
#define DT_HAL_CPU_DEVICE_H

#include "dt_hal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The CPU device's table; the same one a libdt_hal_cpu_shared.so build exports as
 * dt_hal_plugin_v1. */
const dt_hal_v1_t* dt_hal_cpu_v1(void);

#ifdef __cplusplus
}
#endif

#endif
