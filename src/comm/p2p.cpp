#include "dt/p2p.hpp"

#include "comm/mpi_comm.hpp"
#include "comm/ucx_p2p.hpp"

namespace dt {

std::unique_ptr<P2p> make_p2p(const std::string& kind, Comm& world) {
  if (kind != "mpi" && kind != "ucx")
    DT_THROW(ConfigError, "comm.p2p: '", kind, "' is not one of ", kP2pKinds);
  auto* mpi = dynamic_cast<MpiComm*>(&world);
  DT_CHECK(InvalidArgument, mpi != nullptr, "make_p2p(", kind, "): communicator ", world.name(),
           " is not an MPI communicator");
  if (kind == "mpi") return MpiComm::dup(mpi->handle(), world.name() + "/p2p");
  return UcxP2p::create(mpi->handle(), world.name() + "/ucx");
}

}  // namespace dt
