// The device plugin ABI end to end through dt::Device: a version-2 plugin (the CPU device built as
// a shared library, the vendor template), a version-1 plugin through the adapter, plugins of a
// wrong or future version, and require_training_kernels refusing what cannot train, by name.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <elf.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "../unit/temp_dir.hpp"
#include "dt/device.hpp"

namespace {

const std::string kPlugins = DT_PLUGIN_DIR;
const std::string kTestPlugins = DT_TEST_PLUGIN_DIR;

// What is written to stderr (fd 2) while alive: text() reads it back.
class StderrToText {
 public:
  StderrToText() : file_(std::tmpfile()), saved_(::dup(2)) {
    REQUIRE(file_ != nullptr);
    std::fflush(stderr);
    ::dup2(::fileno(file_), 2);
  }
  ~StderrToText() {
    restore();
    std::fclose(file_);
  }
  std::string text() {
    restore();
    std::string out;
    std::rewind(file_);
    for (int c; (c = std::fgetc(file_)) != EOF;) out += static_cast<char>(c);
    return out;
  }

 private:
  void restore() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
  }
  std::FILE* file_;
  int saved_;
};

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.message();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("a version-4 plugin: the CPU device as a shared library matches the built-in one") {
  dt::Device shared = dt::Device::open("cpu_shared", kPlugins);
  dt::Device builtin = dt::Device::open("cpu", "");
  CHECK(shared.abi_version() == 4);
  CHECK(builtin.abi_version() == 4);
  CHECK(shared.table().api_version == DT_HAL_API_VERSION_4);
  CHECK(shared.has(reinterpret_cast<const void*>(shared.table4().flash_attention_fwd)));
  CHECK(shared.has(reinterpret_cast<const void*>(shared.table4().flash_attention_bwd)));
  CHECK(shared.has(reinterpret_cast<const void*>(shared.table3().attention_fwd_ex)));
  CHECK(shared.has(reinterpret_cast<const void*>(shared.table3().attention_bwd_ex)));
  CHECK(shared.origin().find("libdt_hal_cpu_shared.so") != std::string::npos);
  CHECK(dt::missing_training_kernels(shared, dt::DType::bf16).empty());
  // bf16 x bf16 -> f16 through each: the same bits.
  std::vector<std::uint16_t> a(6 * 5), b(5 * 4);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<std::uint16_t>(0x3f80 + 7 * i);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::uint16_t>(0xbf00 + 5 * i);
  std::vector<std::uint16_t> c1(6 * 4), c2(6 * 4);
  for (auto* d : {&shared, &builtin}) {
    auto& c = d == &shared ? c1 : c2;
    d->call(&dt_hal_v2_t::gemm_ex, "gemm_ex", 0, 0, std::int64_t{6}, std::int64_t{4},
            std::int64_t{5}, 1.0f, static_cast<const void*>(a.data()), std::int64_t{5},
            static_cast<const void*>(b.data()), std::int64_t{4}, 0.0f, static_cast<void*>(c.data()),
            std::int64_t{4}, DT_HAL_BF16, DT_HAL_F16);
  }
  CHECK(c1 == c2);
}

TEST_CASE("a version-2 plugin loads through the adapter and lacks the version-3 entries") {
  dt::Device d = dt::Device::open("cpu_v2", kTestPlugins);  // the CPU device's v2 table
  CHECK(d.abi_version() == 2);
  CHECK(d.table().api_version == DT_HAL_API_VERSION_2);
  CHECK(d.has(reinterpret_cast<const void*>(d.table2().gemm_ex)));
  CHECK(!d.has(reinterpret_cast<const void*>(d.table3().attention_fwd_ex)));
  CHECK(!d.has(reinterpret_cast<const void*>(d.table3().attention_bwd_ex)));
  const std::string msg = error_of<dt::DeviceError>([&] {
    float x = 0.0f;
    d.call(&dt_hal_v3_t::attention_fwd_ex, "attention_fwd_ex", &x, &x,
           static_cast<const float*>(&x), std::int64_t{1}, std::int64_t{1}, std::int64_t{1},
           std::int64_t{1}, DT_HAL_BF16);
  });
  CHECK(msg.find("does not provide attention_fwd_ex") != std::string::npos);
}

TEST_CASE("a version-3 plugin loads through the adapter and lacks the version-4 entries") {
  dt::Device d = dt::Device::open("cpu_v3", kTestPlugins);  // the CPU device's v3 table
  CHECK(d.abi_version() == 3);
  CHECK(d.table().api_version == DT_HAL_API_VERSION_3);
  CHECK(d.has(reinterpret_cast<const void*>(d.table3().attention_fwd_ex)));
  CHECK(!d.has(reinterpret_cast<const void*>(d.table4().flash_attention_fwd)));
  CHECK(!d.has(reinterpret_cast<const void*>(d.table4().flash_attention_bwd)));
  const std::string msg = error_of<dt::DeviceError>([&] {
    float x = 0.0f;
    d.call(&dt_hal_v4_t::flash_attention_fwd, "flash_attention_fwd", &x, &x,
           static_cast<const float*>(&x), std::int64_t{1}, std::int64_t{1}, std::int64_t{1},
           std::int64_t{1}, DT_HAL_F32);
  });
  CHECK(msg.find("does not provide flash_attention_fwd") != std::string::npos);
  // The built-in device is version 4 and has them.
  dt::Device cpu = dt::Device::open("cpu", "");
  CHECK(cpu.abi_version() == 4);
  CHECK(cpu.has(reinterpret_cast<const void*>(cpu.table4().flash_attention_bwd)));
}

TEST_CASE("a version-1 plugin loads through the adapter and lacks every version-2 entry") {
  dt::Device d = dt::Device::open("v1only", kTestPlugins);
  CHECK(d.abi_version() == 1);
  CHECK(d.table().api_version == DT_HAL_API_VERSION_1);
  CHECK(!d.has(reinterpret_cast<const void*>(d.table2().gemm_ex)));
  CHECK(!d.has(reinterpret_cast<const void*>(d.table2().stream_create)));
  float x[4] = {1, 2, 3, 4}, y[4] = {10, 20, 30, 40}, z[4] = {};
  d.call(&dt_hal_v1_t::add, "add", z, static_cast<const float*>(x), static_cast<const float*>(y),
         std::int64_t{4});
  CHECK(z[3] == 44.0f);
  // A failing version-1 entry still reports the plugin's own message.
  CHECK(error_of<dt::DeviceError>([&] {
          d.call(&dt_hal_v1_t::add, "add", z, static_cast<const float*>(x),
                 static_cast<const float*>(y), std::int64_t{-1});
        }).find("add failed (invalid argument): add: n = -1 is negative") != std::string::npos);
  int32_t flag = 0;
  const std::string missing = error_of<dt::DeviceError>([&] {
    d.call(&dt_hal_v2_t::scale_check_finite, "scale_check_finite", x, std::int64_t{4}, 1.0f, &flag);
  });
  CHECK(missing.find("device 'v1only'") != std::string::npos);
  CHECK(missing.find("does not provide scale_check_finite") != std::string::npos);
  const std::string refused =
      error_of<dt::ConfigError>([&] { dt::require_training_kernels(d, dt::DType::bf16); });
  CHECK(refused.find("ABI version 1) cannot train in bf16: it lacks the kernels gemm, bias_add,") !=
        std::string::npos);
  CHECK(refused.find("adamw, gemm_ex, cast, scale_check_finite") != std::string::npos);
  CHECK(d.describe().find("v1only (") == 0);
}

TEST_CASE("the template NPU plugin loads, describes itself and is refused for training") {
  dt::Device d = dt::Device::open("template", kPlugins);
  CHECK(d.abi_version() == 4);
  CHECK(!d.has(reinterpret_cast<const void*>(d.table3().attention_fwd_ex)));
  CHECK(!d.has(reinterpret_cast<const void*>(d.table4().flash_attention_fwd)));
  CHECK(d.describe().find("template NPU skeleton") != std::string::npos);
  // Its example kernels run.
  float x[3] = {1, 2, 3};
  d.call(&dt_hal_v1_t::scale, "scale", x, 2.0f, std::int64_t{3});
  CHECK(x[2] == 6.0f);
  const std::vector<std::string> lacks = dt::missing_training_kernels(d, dt::DType::f32);
  const std::vector<std::string> want = {
      "gemm",          "bias_add",      "bias_grad",        "sum_squares",      "embedding_fwd",
      "embedding_bwd", "layernorm_fwd", "layernorm_bwd",    "gelu_fwd",         "gelu_bwd",
      "attention_fwd", "attention_bwd", "softmax_xent_fwd", "softmax_xent_bwd", "adamw"};
  CHECK(lacks == want);
  const std::string msg =
      error_of<dt::ConfigError>([&] { dt::require_training_kernels(d, dt::DType::f32); });
  CHECK(msg.find("device 'template' (" + kPlugins +
                 "/libdt_hal_template.so, ABI version 4) "
                 "cannot train in f32: it lacks the kernels gemm, bias_add, bias_grad, "
                 "sum_squares, embedding_fwd, embedding_bwd, layernorm_fwd, layernorm_bwd, "
                 "gelu_fwd, gelu_bwd, attention_fwd, attention_bwd, softmax_xent_fwd, "
                 "softmax_xent_bwd, adamw") == 0);
  const std::string msg16 =
      error_of<dt::ConfigError>([&] { dt::require_training_kernels(d, dt::DType::f16); });
  CHECK(msg16.find("cannot train in f16") != std::string::npos);
  CHECK(msg16.find("adamw, gemm_ex, cast, scale_check_finite") != std::string::npos);
}

TEST_CASE("a plugin in C++ needs no extern \"C\" nor export attribute of its own") {
  // tests/install/consumer/cxx_plugin.cpp, built with hidden visibility: the header's declaration
  // of dt_hal_plugin_v4 makes its definition an exported C symbol.
  dt::Device d = dt::Device::open("cxx", kTestPlugins);
  CHECK(d.abi_version() == 4);
  CHECK(std::string(d.table().name) == "cxx");
  float x[2] = {1, -2};
  d.call(&dt_hal_v1_t::scale, "scale", x, 3.0f, std::int64_t{2});
  CHECK(x[1] == -6.0f);
}

TEST_CASE("plugins of another ABI version are refused, naming both versions") {
  CHECK(error_of<dt::ConfigError>([] {
          dt::Device::open("wrongver", kTestPlugins);
        }).find("has ABI version 2, this dt needs ABI version 1 behind dt_hal_plugin_v1") !=
        std::string::npos);
  CHECK(error_of<dt::ConfigError>([] {
          dt::Device::open("halfattn", kTestPlugins);
        }).find("provides only one of attention_fwd_ex and attention_bwd_ex") != std::string::npos);
  CHECK(error_of<dt::ConfigError>([] {
          dt::Device::open("halfflash", kTestPlugins);
        }).find("provides only one of flash_attention_fwd and flash_attention_bwd") !=
        std::string::npos);
  CHECK(error_of<dt::ConfigError>([] { dt::Device::open("v5only", kTestPlugins); })
            .find("provides ABI version 5 (dt_hal_plugin_v5), this dt supports ABI versions 1 to "
                  "4") != std::string::npos);
  CHECK(error_of<dt::ConfigError>([] {
          dt::Device::open("nosuch", kTestPlugins);
        }).find("plugin libdt_hal_nosuch.so not found") != std::string::npos);
  // A plugin that fails to open: its own message is part of dt's.
  CHECK(error_of<dt::DeviceError>([] {
          dt::Device::open("v1only", kTestPlugins, 3);
        }).find("open(3) failed (invalid argument): open: legacy test device has no index 3") !=
        std::string::npos);
}

TEST_CASE("a copy of a plugin that cannot be loaded is skipped for a later one in the path") {
  // A directory ahead of the good copy holds a libdt_hal_v1only.so that is not a shared library
  // (a stale or foreign build, say).
  const dt::test::TempDir tmp("dt-hal-test");
  const std::string dir = tmp.path.string(), bad = dir + "/libdt_hal_v1only.so";
  {
    std::ofstream f(bad);
    f << "not an ELF file\n";
  }
  dt::Device d = dt::Device::open("v1only", dir + ":" + kTestPlugins);
  CHECK(d.origin() == kTestPlugins + "/libdt_hal_v1only.so");
  CHECK(d.abi_version() == 1);
  // Only copies that cannot be loaded: refused, naming each and why.
  const std::string none =
      error_of<dt::ConfigError>([&] { dt::Device::open("v1only", dir + ":" + dir); });
  CHECK(none.find("no copy of libdt_hal_v1only.so in the plugin path") != std::string::npos);
  CHECK(none.find(bad + ": ") != std::string::npos);
  // A kernel's failure names the plugin file it came from.
  float x[1] = {1}, z[1] = {};
  CHECK(error_of<dt::DeviceError>([&] {
          d.call(&dt_hal_v1_t::add, "add", z, static_cast<const float*>(x),
                 static_cast<const float*>(x), std::int64_t{-1});
        }).find("device 'v1only' (" + kTestPlugins + "/libdt_hal_v1only.so): add failed") !=
        std::string::npos);
  // A copy that loads but is no plugin this dt can use (a newer dt's build, of ABI version 5,
  // or one whose table carries another version than its symbol says) is skipped too, naming why;
  // with no other copy it is refused so.
  for (const char* other : {"v5only", "wrongver"}) {
    std::ifstream in(kTestPlugins + "/libdt_hal_" + other + ".so", std::ios::binary);
    std::ofstream out(bad, std::ios::binary | std::ios::trunc);
    out << in.rdbuf();
    out.close();
    REQUIRE(out.good());
    std::string warned;
    {
      StderrToText cap;
      dt::Device later = dt::Device::open("v1only", dir + ":" + kTestPlugins);
      CHECK(later.origin() == kTestPlugins + "/libdt_hal_v1only.so");
      warned = cap.text();
    }
    const std::string why = std::string(other) == "v5only"
                                ? "provides ABI version 5 (dt_hal_plugin_v5)"
                                : "has ABI version 2, this dt needs ABI version 1";
    CHECK(warned.find("device 'v1only': skipped " + bad + ": " + why) != std::string::npos);
    CHECK(warned.find("(using " + kTestPlugins + "/libdt_hal_v1only.so)") != std::string::npos);
    CHECK(error_of<dt::ConfigError>([&] {
            dt::Device::open("v1only", dir);
          }).find(bad + ": " + why) != std::string::npos);
  }
}

TEST_CASE("a copy of a plugin cut short is skipped, not loaded (dlopen would die of SIGBUS)") {
  // The good copy's first 4096 bytes, and all but the last byte of its loaded segments, as a copy
  // still being written leaves it: its headers read, its segments end past the end of the file.
  const dt::test::TempDir tmp("dt-hal-test");
  const std::string dir = tmp.path.string(), cut = dir + "/libdt_hal_cpu_v3.so";
  std::ifstream good(kTestPlugins + "/libdt_hal_cpu_v3.so", std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(good)), std::istreambuf_iterator<char>());
  REQUIRE(bytes.size() > 8192);
  Elf64_Ehdr eh{};
  std::memcpy(&eh, bytes.data(), sizeof eh);
  std::size_t loaded = 0;
  for (int i = 0; i < eh.e_phnum; ++i) {
    Elf64_Phdr ph{};
    std::memcpy(&ph, bytes.data() + eh.e_phoff + i * sizeof ph, sizeof ph);
    if (ph.p_type == PT_LOAD) loaded = std::max<std::size_t>(loaded, ph.p_offset + ph.p_filesz);
  }
  REQUIRE(loaded > 8192);
  for (const std::size_t keep : {std::size_t{4096}, loaded - 1}) {
    CAPTURE(keep);
    {
      std::ofstream f(cut, std::ios::binary | std::ios::trunc);
      f.write(bytes.data(), static_cast<std::streamsize>(keep));
    }
    dt::Device d = dt::Device::open("cpu_v3", dir + ":" + kTestPlugins);
    CHECK(d.origin() == kTestPlugins + "/libdt_hal_cpu_v3.so");
    const std::string none = error_of<dt::ConfigError>([&] { dt::Device::open("cpu_v3", dir); });
    CHECK(none.find(cut + ": the file is cut short: ") != std::string::npos);
    CHECK(none.find("the file has " + std::to_string(keep) + " (a copy not yet complete?)") !=
          std::string::npos);
  }
}

TEST_CASE("devmem: device memory the host cannot touch; dt moves it only through copy") {
  dt::Device d = dt::Device::open("devmem", kTestPlugins);
  CHECK(!d.host_memory());
  CHECK(dt::Device::open("cpu", "").host_memory());
  CHECK(dt::Device::open("cpu_shared", kPlugins).host_memory());
  CHECK(dt::missing_training_kernels(d, dt::DType::bf16, true).empty());
  dt::Device::Buffer buf(d, 4 * sizeof(float));
  CHECK((reinterpret_cast<std::uintptr_t>(buf.get()) & (std::uintptr_t{1} << 55)) != 0);
  const float in[4] = {1, 2, 3, 4};
  float out[4] = {};
  d.call(&dt_hal_v1_t::copy, "copy", buf.get(), static_cast<const void*>(in), sizeof in,
         DT_HAL_HOST_TO_DEVICE);
  d.call(&dt_hal_v1_t::scale, "scale", buf.as<float>(), 2.0f, std::int64_t{4});
  d.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(out), static_cast<const void*>(buf.get()),
         sizeof out, DT_HAL_DEVICE_TO_HOST);
  CHECK(out[3] == 8.0f);
  // A host access faults at once.
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    std::signal(SIGSEGV, SIG_DFL);  // not a sanitizer's report: the plain fault
    std::signal(SIGBUS, SIG_DFL);
    *static_cast<volatile float*>(buf.get()) = 1.0f;
    _exit(0);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK((WTERMSIG(status) == SIGSEGV || WTERMSIG(status) == SIGBUS));
}

TEST_CASE("a Device moves while nothing holds it; moving one that a buffer holds aborts") {
  dt::Device a = dt::Device::open("cpu_shared", kPlugins);
  { dt::Device::Buffer b(a, 64); }
  dt::Device moved(std::move(a));
  dt::Device::Buffer b(moved, 64);
  CHECK(b.get() != nullptr);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // the buffer b holds `moved`: moving it again would leave b dangling
    std::signal(SIGABRT, SIG_DFL);
    dt::Device again(std::move(moved));
    _exit(0);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGABRT);
}
