// The CPU device's version-2 table as a plugin of its own, for what dt does with an older device:
//   libdt_hal_cpu_v2.so  the whole version-2 table: dt sees ABI version 2 (no attention_*_ex), so
//                        16-bit training computes attention in fp32;
//   libdt_hal_nocast.so  (DT_TEST_NO_CAST) the same without cast. It has every kernel fp32
//                        training needs, so the refusals that need cast alone (train.dtype=bf16,
//                        train.grad-reduce=bf16) are reached through it, and fp32 training runs.
#include "cpu_device.h"

extern "C" __attribute__((visibility("default"))) const dt_hal_v2_t* dt_hal_plugin_v2(void) {
  static const dt_hal_v2_t table = [] {
    dt_hal_v2_t t = *dt_hal_cpu_v2();
#ifdef DT_TEST_NO_CAST
    t.cast = nullptr;
#endif
    return t;
  }();
  return &table;
}
