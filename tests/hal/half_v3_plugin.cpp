// libdt_hal_halfattn.so: the CPU device's version-3 table with attention_fwd_ex but without
// attention_bwd_ex. The two go in pairs (a 16-bit forward with an fp32 backward would be neither
// precision), so dt must refuse it when it loads, naming both.
#include "cpu_device.h"

extern "C" __attribute__((visibility("default"))) const dt_hal_v3_t* dt_hal_plugin_v3(void) {
  static const dt_hal_v3_t table = [] {
    dt_hal_v3_t t = *dt_hal_cpu_v3();
    t.attention_bwd_ex = nullptr;
    return t;
  }();
  return &table;
}
