// libdt_hal_cxx.so: a device plugin written in C++ whose entry is defined as plainly as the header
// declares it, without an extern "C" or a visibility attribute of its own, and built with hidden
// visibility. The declaration in dt_hal_v4.h gives it C linkage and exports it, so dt finds
// dt_hal_plugin_v4 (a mangled or hidden symbol would be "not a dt device plugin"). Built by the
// consumer project against the installed dt::hal, and by tests/hal against the source tree.
#include <cstdlib>
#include <new>

#include "dt_hal_v4.h"

namespace {

struct Context {
  char error[64] = "";
};

int cxx_open(int index, void** ctx) {
  if (ctx == nullptr || index != 0) return DT_HAL_ERR_INVALID;
  *ctx = new (std::nothrow) Context;
  return *ctx != nullptr ? DT_HAL_OK : DT_HAL_ERR_NOMEM;
}
void cxx_close(void* ctx) { delete static_cast<Context*>(ctx); }
const char* cxx_last_error(void* ctx) { return ctx ? static_cast<Context*>(ctx)->error : ""; }
int cxx_alloc(void*, size_t bytes, void** ptr) {
  *ptr = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  return *ptr != nullptr || bytes == 0 ? DT_HAL_OK : DT_HAL_ERR_NOMEM;
}
void cxx_release(void*, void* ptr) { std::free(ptr); }
int cxx_scale(void*, float* x, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
  return DT_HAL_OK;
}

dt_hal_v4_t make_table() {
  dt_hal_v4_t t{};
  dt_hal_v1_t& v1 = t.v3.v2.v1;
  v1.api_version = DT_HAL_API_VERSION_4;
  v1.name = "cxx";
  v1.open = cxx_open;
  v1.close = cxx_close;
  v1.last_error = cxx_last_error;
  v1.alloc = cxx_alloc;
  v1.release = cxx_release;
  v1.scale = cxx_scale;
  return t;
}

}  // namespace

const dt_hal_v4_t* dt_hal_plugin_v4(void) {
  static const dt_hal_v4_t table = make_table();
  return &table;
}
