// dt::Runtime: owns MPI, the topology and the job's communicators for one rank (RAII).
//
// Construction initialises MPI with MPI_THREAD_MULTIPLE (dt::CommError when the library cannot
// provide it, or when MPI has been finalised already: MPI starts once per process), duplicates
// MPI_COMM_WORLD so dt traffic never matches user traffic, discovers the topology and binds the
// rank. Destruction frees dt's communicators and finalises MPI; if MPI was already initialised by
// the caller, the caller finalises it. A rank that has failed and must take the job down calls
// abort(), never a plain exit, so that no peer hangs.
#pragma once

#include <memory>

#include "dt/comm.hpp"
#include "dt/topology.hpp"

namespace dt {

struct RuntimeOptions {
  BindMode bind = BindMode::automatic;
  bool use_pmix = true;  ///< ask PMIx for node and local rank when the launcher provides it
};

class Runtime {
 public:
  /// Starts MPI (unless the caller did) and reads the topology. Throws when this rank cannot
  /// start; MPI, once up, is then left up (finalising would wait for the other ranks): end the
  /// job with MPI_Abort, as start_runtime does.
  Runtime(int* argc, char*** argv, const RuntimeOptions& opts = {});
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  int rank() const noexcept;
  int size() const noexcept;
  /// All ranks of the job.
  Comm& world() noexcept;
  /// The ranks on this node (shared memory).
  Comm& node() noexcept;
  const Topology& topology() const noexcept;

  /// Terminates every rank of the job with `code` (MPI_Abort). Never returns.
  [[noreturn]] void abort(int code) noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The runtime of application `app`. When it cannot start on this rank (MPI without
/// MPI_THREAD_MULTIPLE, the topology unreadable), prints "APP: error: cannot start: WHY" and
/// ends the job with exit code 3: MPI_Abort when MPI is up, so that no other rank waits for this
/// one. Returns only a started runtime.
std::unique_ptr<Runtime> start_runtime(int* argc, char*** argv, const RuntimeOptions& opts,
                                       const char* app);

}  // namespace dt
