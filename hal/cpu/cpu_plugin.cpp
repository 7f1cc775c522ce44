// The entry points of libdt_hal_cpu_shared.so, the CPU device built as a loadable plugin so that
// the dlopen path of the ABI runs with real kernels. The kernels are the object libdt has built in
// (cpu_device.cpp, compiled once for both); the plugin is linked with -Bsymbolic, so these calls
// reach the plugin's own copy even in a process that has libdt loaded.
#include "cpu_device.h"

#define DT_HAL_CPU_EXPORT __attribute__((visibility("default")))

extern "C" DT_HAL_CPU_EXPORT const dt_hal_v1_t* dt_hal_plugin_v1(void) { return dt_hal_cpu_v1(); }
extern "C" DT_HAL_CPU_EXPORT const dt_hal_v2_t* dt_hal_plugin_v2(void) { return dt_hal_cpu_v2(); }
extern "C" DT_HAL_CPU_EXPORT const dt_hal_v3_t* dt_hal_plugin_v3(void) { return dt_hal_cpu_v3(); }
extern "C" DT_HAL_CPU_EXPORT const dt_hal_v4_t* dt_hal_plugin_v4(void) { return dt_hal_cpu_v4(); }
