// A dt user's program: a dt::Runtime, an all_reduce whose sum it checks, the built-in CPU device,
// the installation's CPU plugin, and the plugins built against the installation: cxx (its own
// project's) and npu (the installed template, built by npu/). Prints "consumer: rank R of N: ok"
// on every rank that passed and exits 1 on a failed check.
//   dt_consumer INSTALLED_PLUGIN_DIR OWN_PLUGIN_PATH (colon-separated: cxx's and npu's folders)
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "dt/device.hpp"
#include "dt/runtime.hpp"

namespace {

int failures = 0;

void check(bool ok, int rank, const std::string& what) {
  if (!ok) {
    std::printf("consumer: rank %d: FAIL: %s\n", rank, what.c_str());
    ++failures;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s INSTALLED_PLUGIN_DIR OWN_PLUGIN_PATH\n", argv[0]);
    return 2;
  }
  const std::string installed = argv[1], own = argv[2];
  dt::Runtime rt(&argc, &argv, {dt::BindMode::none, false});
  const int rank = rt.rank(), size = rt.size();

  std::vector<double> x = {double(rank + 1), 1.0};
  rt.world().all_reduce(dt::view_of(x), dt::ReduceOp::sum);
  check(x[0] == size * (size + 1) / 2.0 && x[1] == size, rank,
        "all_reduce gave " + std::to_string(x[0]) + ", " + std::to_string(x[1]));

  float v[3] = {1, 2, 3};
  dt::Device cpu = dt::Device::open("cpu", "");
  cpu.call(&dt_hal_v1_t::scale, "scale", v, 2.0f, std::int64_t{3});
  check(cpu.origin() == "built-in" && v[2] == 6.0f, rank, "the built-in cpu device");

  dt::Device shared = dt::Device::open("cpu_shared", installed);
  check(shared.abi_version() == DT_HAL_API_VERSION_4 &&
            shared.origin() == installed + "/libdt_hal_cpu_shared.so",
        rank, "the installed cpu_shared plugin: " + shared.origin());

  dt::Device cxx = dt::Device::open("cxx", own);
  cxx.call(&dt_hal_v1_t::scale, "scale", v, 0.5f, std::int64_t{3});
  check(cxx.abi_version() == DT_HAL_API_VERSION_4 && v[2] == 3.0f, rank, "its own plugin, cxx");

  dt::Device npu = dt::Device::open("npu", own);
  npu.call(&dt_hal_v1_t::scale, "scale", v, 2.0f, std::int64_t{3});
  check(npu.describe().find("template NPU skeleton") != std::string::npos && v[2] == 6.0f, rank,
        "the installed template built as npu: " + npu.describe());

  if (failures == 0) std::printf("consumer: rank %d of %d: ok\n", rank, size);
  return failures == 0 ? 0 : 1;
}
