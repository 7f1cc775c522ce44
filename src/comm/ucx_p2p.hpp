// UCX implementation of dt::P2p: libucp tag matching, bootstrapped over an MPI communicator.
//
// Wire format: one UCX tag message per isend, any size (no chunking), 64-bit UCX tag =
// (sender rank << 32) | (uint32_t)user tag, received with a full mask, so a receive from `src`
// with `tag` matches only that pair; UCX keeps the order of messages on one endpoint, so messages
// with the same (source, tag) arrive in send order. The receiver checks the delivered length
// against buf.nbytes(): a longer message is UCS_ERR_MESSAGE_TRUNCATED, a shorter one is caught from
// ucp_tag_recv_info; both fail the receive's Work with dt::CommError.
//
// Costs: creation is collective over the bootstrap communicator (two MPI_Allgather of worker
// addresses) and creates one endpoint per peer, itself included; connections are wired up by UCX
// on first use. Small messages go eagerly (buffered by UCX, the send completes at once), large ones
// by rendezvous (zero-copy CMA on one machine, TCP across machines), which needs both sides to
// progress: a Work completes only while test()/wait() of some Work of this UcxP2p is called on
// both sides.
//
// Transports: UCX's own choice (UCX_TLS and the other UCX_* variables are honoured); on one
// machine that is shared memory (posix/sysv FIFOs, CMA for large messages), across machines TCP.
//
// Threads: every UCX call of a UcxP2p and its Works is made under one internal mutex (the worker
// runs in UCS_THREAD_MODE_SERIALIZED), so Works may be tested and waited on from several threads;
// waiting threads release the mutex between polls.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>

#include "dt/comm.hpp"

namespace dt {

class UcxP2p final : public P2p {
 public:
  /// Collective over `bootstrap` (which is duplicated and kept for the closing fence): creates a
  /// UCX context and worker, exchanges worker addresses and creates an endpoint to every rank.
  /// Throws dt::CommError naming the UCX call and ucs_status_string on any UCX failure.
  static std::unique_ptr<UcxP2p> create(MPI_Comm bootstrap, std::string name);
  /// Closes the endpoints (flushing what was sent), then waits, progressing UCX, until every rank
  /// has closed (MPI_Ibarrier on the bootstrap duplicate; skipped after MPI_Finalize), then
  /// destroys the worker and the context. Both waits together take at most 10 s, or 1 s where an
  /// exception is unwinding (its peers may be waiting on this rank and never close). Never throws.
  /// Works that outlive this object keep the worker alive and still complete.
  ~UcxP2p() override;
  UcxP2p(const UcxP2p&) = delete;
  UcxP2p& operator=(const UcxP2p&) = delete;

  int rank() const noexcept override;
  int size() const noexcept override;
  const std::string& name() const noexcept override;

  Work isend(ConstTensorView buf, int dst, int tag) override;
  Work irecv(TensorView buf, int src, int tag) override;

  /// This transport's duplicate of the bootstrap communicator (same ranks): for collective setup
  /// of layers above it (MPI_Comm_split_type and the like); its traffic must stay collective.
  MPI_Comm bootstrap() const noexcept;

  /// The 64-bit UCX tag of a message from `src` with user tag `tag` (exposed for tests).
  static std::uint64_t wire_tag(int src, int tag) noexcept {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(src)) << 32) |
           static_cast<std::uint32_t>(tag);
  }

  struct State;

 private:
  explicit UcxP2p(std::shared_ptr<State> st);
  std::shared_ptr<State> st_;
};

}  // namespace dt
