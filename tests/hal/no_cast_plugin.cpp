// libdt_hal_nocast.so: the CPU device without its cast entry. It has every kernel fp32 training
// needs, so the refusals that need cast alone (train.dtype=bf16|fp16, train.grad-reduce=bf16) are
// reached through it, and fp32 training on it runs.
#include "cpu_device.h"

extern "C" __attribute__((visibility("default"))) const dt_hal_v2_t* dt_hal_plugin_v2(void) {
  static const dt_hal_v2_t table = [] {
    dt_hal_v2_t t = *dt_hal_cpu_v2();
    t.cast = nullptr;
    return t;
  }();
  return &table;
}
