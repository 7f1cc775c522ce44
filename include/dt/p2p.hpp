// dt::make_p2p: the point-to-point transport for pipeline activations, chosen by the setting
// comm.p2p ("mpi" or "ucx").
#pragma once

#include <memory>
#include <string>

#include "dt/comm.hpp"

namespace dt {

/// The values comm.p2p accepts, for help texts and messages.
inline constexpr const char* kP2pKinds = "mpi, ucx";

/// Collective over `world` (every rank passes the same kind). "mpi": MPI point-to-point over a
/// duplicate of world's MPI communicator, so its tags never match world's own traffic. "ucx": a
/// UCX tag-matching transport (libucp) bootstrapped over world. Both name their messages
/// "<world name>/p2p" resp. "<world name>/ucx" and behave as dt/comm.hpp's P2p says.
/// Throws dt::ConfigError naming comm.p2p and the allowed values for any other kind (before any
/// traffic), dt::InvalidArgument when `world` is not backed by MPI, dt::CommError when the
/// transport cannot be set up.
std::unique_ptr<P2p> make_p2p(const std::string& kind, Comm& world);

}  // namespace dt
