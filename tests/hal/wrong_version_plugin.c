/* A plugin whose table claims ABI version 2 behind the version-1 symbol: dt must refuse it. */
#include "dt_hal.h"

static const dt_hal_v1_t table = {2, "wrongver"};

__attribute__((visibility("default"))) const dt_hal_v1_t* dt_hal_plugin_v1(void) { return &table; }
