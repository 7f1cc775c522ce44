#include "comm/nccl_module.hpp"

#include <cstdlib>
#include <mutex>

#include "comm/mpi_comm.hpp"
#include "dt/error.hpp"
#include "hal/library_path.hpp"

#ifndef DT_VERSION
#define DT_VERSION "0.1.0"
#endif

namespace dt {

namespace {
// The entry points of libdt_nccl.so (end of comm/nccl_comm.cpp).
using VersionFn = const char* (*)();
using CreateFn = Comm* (*)(MpiComm* bootstrap, int cuda_device, void* stream, const char* name);
constexpr const char* kFile = "libdt_nccl.so";
constexpr const char* kVersionSymbol = "dt_nccl_module_version";
constexpr const char* kCreateSymbol = "dt_nccl_module_create";

// NCCL reads NCCL_COMM_BLOCKING as an integer (strtoll, base 0) when it is set and not empty, and
// lets it override the blocking flag of every communicator's config.
void refuse_non_blocking() {
  const char* v = std::getenv("NCCL_COMM_BLOCKING");
  if (v == nullptr || *v == '\0' || std::strtoll(v, nullptr, 0) != 0) return;
  throw ConfigError(std::string("the environment sets NCCL_COMM_BLOCKING='") + v +
                        "': NCCL would make dt's communicators non-blocking, and dt needs "
                        "blocking ones (it orders and checks NCCL's work itself); unset it or set "
                        "it to 1",
                    __FILE__, __LINE__);
}
}  // namespace

struct NcclModule::Impl {
  detail::SharedLibrary lib;
  CreateFn create = nullptr;
};

NcclModule::NcclModule(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

const NcclModule& NcclModule::load(const std::string& plugin_path) {
  refuse_non_blocking();
  static std::mutex mu;
  static const NcclModule* loaded = nullptr;  // never unloaded (see the header)
  std::lock_guard<std::mutex> lock(mu);
  if (loaded) return *loaded;
  auto impl = std::make_unique<Impl>();
  // A copy of another dt (an older installation first in the path) is skipped like one that
  // does not load, so it does not hide this build's own.
  detail::load_from_path(
      kFile, plugin_path, "NCCL communicator", impl->lib,
      [](const detail::SharedLibrary& lib) -> std::string {
        const auto version = reinterpret_cast<VersionFn>(detail::find_symbol(lib, kVersionSymbol));
        if (version == nullptr || detail::find_symbol(lib, kCreateSymbol) == nullptr)
          return std::string("not dt's NCCL communicator (no ") + kVersionSymbol + " or " +
                 kCreateSymbol + ")";
        if (std::string(version()) != DT_VERSION)
          return std::string("built for dt ") + version() + ", this is dt " + DT_VERSION +
                 " (install both from one build)";
        return "";
      });
  impl->create = reinterpret_cast<CreateFn>(detail::find_symbol(impl->lib, kCreateSymbol));
  // Intentionally leaked: see the header.
  loaded = new NcclModule(std::move(impl));
  return *loaded;
}

std::unique_ptr<Comm> NcclModule::create(Comm& bootstrap, int cuda_device, void* stream,
                                         const std::string& name) const {
  auto* mpi = dynamic_cast<MpiComm*>(&bootstrap);
  DT_CHECK(ConfigError, mpi != nullptr, "NCCL over ", bootstrap.name(),
           " needs an MPI communicator to bootstrap from");
  return std::unique_ptr<Comm>(impl_->create(mpi, cuda_device, stream, name.c_str()));
}

const std::string& NcclModule::path() const noexcept { return impl_->lib.path; }

}  // namespace dt
