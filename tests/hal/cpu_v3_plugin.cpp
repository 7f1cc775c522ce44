// The CPU device's version-3 table as a plugin of its own, for what dt does with a device that
// has no flash_attention entries:
//   libdt_hal_cpu_v3.so    the whole version-3 table: dt sees ABI version 3, so attention keeps
//                          its probabilities whatever model.attention says;
//   libdt_hal_halfflash.so (DT_TEST_HALF_FLASH) the version-4 table with flash_attention_fwd but
//                          without flash_attention_bwd, which dt refuses when it loads (they go in
//                          pairs: a forward that keeps no probabilities needs its backward).
#include "cpu_device.h"

#ifdef DT_TEST_HALF_FLASH
extern "C" __attribute__((visibility("default"))) const dt_hal_v4_t* dt_hal_plugin_v4(void) {
  static const dt_hal_v4_t table = [] {
    dt_hal_v4_t t = *dt_hal_cpu_v4();
    t.flash_attention_bwd = nullptr;
    return t;
  }();
  return &table;
}
#else
extern "C" __attribute__((visibility("default"))) const dt_hal_v3_t* dt_hal_plugin_v3(void) {
  return dt_hal_cpu_v3();
}
#endif
