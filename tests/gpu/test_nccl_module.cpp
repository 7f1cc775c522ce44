// dt::NcclModule: libdt loads the NCCL communicator (libdt_nccl.so) from the plugin path as it
// loads device plugins, and refuses clearly what it cannot use: no copy in the path, a file that
// is not a shared library, a shared library that is not the communicator, one of another dt
// version (skipped for a later copy that serves), and the communicator without NCCL. No GPU is
// needed: loading touches no device.
//
// DT_TEST_NCCL_HIDDEN=1 (set by cpu_node.sh, in a namespace that hides the CUDA libraries): the
// build's own libdt_nccl.so must be refused, naming the NCCL library it lacks. Otherwise it must
// load, and stay the module for later calls.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <stdlib.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "../unit/temp_dir.hpp"
#include "comm/nccl_module.hpp"
#include "dt/error.hpp"

namespace {

const std::string kPlugins = DT_PLUGIN_DIR;       // the build's libdt_nccl.so
const std::string kOldModule = DT_OLD_NCCL_DIR;   // a libdt_nccl.so of dt 0.0.0
const std::string kForeign = DT_FOREIGN_LIBRARY;  // a shared library that is not the module

std::string load_error(const std::string& path) {
  try {
    dt::NcclModule::load(path);
  } catch (const dt::ConfigError& e) {
    return e.message();
  }
  return "(no error)";
}

bool hidden() {
  const char* e = std::getenv("DT_TEST_NCCL_HIDDEN");
  return e != nullptr && std::string(e) == "1";
}

}  // namespace

TEST_CASE("a path without libdt_nccl.so is refused, naming the file and the path") {
  const dt::test::TempDir tmp("dt-nccl-module");
  const std::string dir = tmp.path.string();
  const std::string e = load_error(dir + ":/nonexistent");
  CHECK(e.find("NCCL communicator: plugin libdt_nccl.so not found in the plugin path '" + dir +
               ":/nonexistent'") != std::string::npos);
}

TEST_CASE("a libdt_nccl.so that is no shared library is refused, naming it and why") {
  const dt::test::TempDir tmp("dt-nccl-module");
  const std::string dir = tmp.path.string(), bad = dir + "/libdt_nccl.so";
  std::ofstream(bad) << "not an ELF file\n";
  const std::string e = load_error(dir);
  CHECK(e.find("no copy of libdt_nccl.so in the plugin path '" + dir + "' could be loaded: " + bad +
               ": ") != std::string::npos);
}

TEST_CASE("a shared library that is not the communicator, or of another dt, is refused") {
  const dt::test::TempDir tmp("dt-nccl-module");
  const std::string dir = tmp.path.string(), lib = dir + "/libdt_nccl.so";
  std::ifstream src(kForeign, std::ios::binary);
  REQUIRE(src.good());
  std::ofstream(lib, std::ios::binary) << src.rdbuf();
  CHECK(load_error(dir).find(lib + ": not dt's NCCL communicator (no dt_nccl_module_version") !=
        std::string::npos);
  CHECK(
      load_error(kOldModule).find(kOldModule + "/libdt_nccl.so: built for dt 0.0.0, this is dt ") !=
      std::string::npos);
}

TEST_CASE("the build's communicator: loaded once, or refused naming NCCL where it is missing") {
  if (hidden()) {
    const std::string e = load_error(kPlugins);
    CHECK(e.find(kPlugins + "/libdt_nccl.so: libnccl.so") != std::string::npos);
    MESSAGE(e);
    return;
  }
  // A copy of another dt first in the path is skipped (with a warning) for this build's own.
  const dt::NcclModule& m = dt::NcclModule::load("/nonexistent:" + kOldModule + ":" + kPlugins);
  CHECK(m.path() == kPlugins + "/libdt_nccl.so");
  // Loaded once per process: a later call, whatever its path, returns the same module.
  CHECK(&dt::NcclModule::load("/nonexistent") == &m);
}

TEST_CASE("NCCL_COMM_BLOCKING=0, which would make NCCL's communicators non-blocking, is refused") {
  // Any value NCCL reads as 0 (strtoll, base 0); on every call, also after a load.
  for (const char* v : {"0", "0x0", "00"}) {
    CAPTURE(v);
    REQUIRE(setenv("NCCL_COMM_BLOCKING", v, 1) == 0);
    CHECK(load_error(kPlugins).find(std::string("the environment sets NCCL_COMM_BLOCKING='") + v +
                                    "': NCCL would make dt's communicators non-blocking") !=
          std::string::npos);
  }
  // 1, or an empty value (NCCL's default: blocking), is no reason to refuse.
  for (const char* v : {"1", ""}) {
    CAPTURE(v);
    REQUIRE(setenv("NCCL_COMM_BLOCKING", v, 1) == 0);
    CHECK(load_error(kPlugins).find("NCCL_COMM_BLOCKING") == std::string::npos);
  }
  REQUIRE(unsetenv("NCCL_COMM_BLOCKING") == 0);
}
