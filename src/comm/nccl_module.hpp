// The NCCL communicator for device tensors (dt::NcclComm, comm/nccl_comm.cpp) is built into a
// library of its own, libdt_nccl.so, next to the CUDA device plugin (build/plugins, or
// lib/dt/plugins of an installation): the one part of dt that links NCCL and the CUDA runtime.
// libdt loads it from the plugin path when a run asks for it, so dt's programs start on nodes
// without CUDA or NCCL; only a run on CUDA devices needs them.
#pragma once

#include <memory>
#include <string>

#include "dt/comm.hpp"

namespace dt {

class NcclModule {
 public:
  /// Loads libdt_nccl.so from the colon-separated `plugin_path` (the first copy that loads, as
  /// for device plugins), once per process: later calls return the module loaded first, and it
  /// is never unloaded (communicators made from it may live until exit, and NCCL keeps threads).
  /// Throws dt::ConfigError naming the file, the path and the loader's reason (libnccl.so.2 not
  /// found, ...), or a copy built for another version of dt. Also throws dt::ConfigError, on
  /// every call, while the environment sets NCCL_COMM_BLOCKING to 0 (or any value NCCL reads as
  /// 0): it would make NCCL's communicators non-blocking, which dt's are not written for.
  static const NcclModule& load(const std::string& plugin_path);

  /// dt::NcclComm::create: collective over `bootstrap` (an MPI communicator, every rank, same
  /// order); cuda_device: this rank's CUDA device; stream: the cudaStream_t to order after.
  /// Throws dt::ConfigError when `bootstrap` is not an MPI communicator, dt::CommError when NCCL or
  /// CUDA set-up fails.
  std::unique_ptr<Comm> create(Comm& bootstrap, int cuda_device, void* stream,
                               const std::string& name) const;

  /// The file loaded.
  const std::string& path() const noexcept;

  struct Impl;

 private:
  explicit NcclModule(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dt
