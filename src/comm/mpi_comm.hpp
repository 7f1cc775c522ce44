// MPI implementation of dt::Comm for host tensors.
//
// Costs: collectives map one-to-one onto MPI calls (blocking ones onto the blocking MPI call, so
// Open MPI's tuned algorithms apply), except a blocking reduce_scatter of 1 MiB or more: it runs
// a ring of point-to-point messages in pieces of 1 MiB (one piece of temporary memory; Open MPI
// would hold the whole input on rank 0, or on every rank), on tag 32767, which point-to-point
// calls refuse. bf16/f16 reductions use MPI user ops that accumulate each
// pair in float; avg adds one local pass. Buffers above max_chunk elements are split into several
// MPI calls so counts never overflow MPI's int.
#pragma once

#include <mpi.h>

#include <atomic>
#include <climits>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "dt/comm.hpp"
#include "dt/error.hpp"
#include "dt/watchdog.hpp"

namespace dt {

/// Throws dt::CommError "CALL failed on rank R of NAME: <MPI error string>" when rc != MPI_SUCCESS.
void mpi_check(int rc, const char* call, int rank, const std::string& comm_name, const char* file,
               int line);
#define DT_MPI(call, rank, name) ::dt::mpi_check((call), #call, (rank), (name), __FILE__, __LINE__)

/// Runs `f` (this rank's part of a step that every rank of `comm` takes, such as a transport's
/// start-up), then tells every rank whether every rank got through it: a rank that failed
/// rethrows its error, the others throw a CommError naming the first rank that failed ("NAME on
/// rank R: rank F could not STEP (see its message)"), all at the same point, so that none waits
/// in a later collective for a rank that gave up. Collective over `comm`.
template <class F>
void on_every_rank(MPI_Comm comm, int rank, const std::string& name, const char* step, F&& f) {
  std::exception_ptr err;
  try {
    f();
  } catch (...) {
    err = std::current_exception();
  }
  int first = err ? rank : INT_MAX;
  DT_MPI(MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, comm), rank, name);
  if (err) std::rethrow_exception(err);
  DT_CHECK(CommError, first == INT_MAX, name, " on rank ", rank, ": rank ", first, " could not ",
           step, " (see its message)");
}

class MpiOps;

/// The name of the `nth` split (counting from 1) of communicator `parent` for `color`:
/// "PARENT/split(COLOR)" for the first, "PARENT/splitN(COLOR)" after it, so that communicators
/// split from one parent never share a name (the hang watchdog tells them apart by it).
std::string split_name(const std::string& parent, int nth, int color);

class MpiComm final : public Comm {
 public:
  /// Duplicates `parent` (so dt traffic never matches user traffic), sets MPI_ERRORS_RETURN.
  /// MPI must be initialised and must outlive this object's use; destruction after MPI_Finalize
  /// is safe (the handle is then left alone).
  static std::unique_ptr<MpiComm> dup(MPI_Comm parent, std::string name);
  ~MpiComm() override;

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  const std::string& name() const noexcept override { return name_; }
  MPI_Comm handle() const noexcept { return comm_; }

  Work iall_reduce(TensorView buf, ReduceOp op) override;
  Work ibroadcast(TensorView buf, int root) override;
  Work iall_gather(ConstTensorView in, TensorView out) override;
  Work ireduce_scatter(ConstTensorView in, TensorView out, ReduceOp op) override;
  Work isend(ConstTensorView buf, int dst, int tag) override;
  Work irecv(TensorView buf, int src, int tag) override;
  Work ibarrier() override;

  void all_reduce(TensorView buf, ReduceOp op, const CommOptions& opts = {}) override;
  void broadcast(TensorView buf, int root, const CommOptions& opts = {}) override;
  void all_gather(ConstTensorView in, TensorView out, const CommOptions& opts = {}) override;
  void reduce_scatter(ConstTensorView in, TensorView out, ReduceOp op,
                      const CommOptions& opts = {}) override;
  void send(ConstTensorView buf, int dst, int tag, const CommOptions& opts = {}) override;
  void recv(TensorView buf, int src, int tag, const CommOptions& opts = {}) override;
  void barrier(const CommOptions& opts = {}) override;

  std::unique_ptr<Comm> split(int color, int key) override;
  /// split() with the MPI type kept.
  std::unique_ptr<MpiComm> split_mpi(int color, int key);
  /// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED): the ranks that share this node's memory.
  std::unique_ptr<MpiComm> split_shared();
  /// The other ranks of this communicator on the caller's node, as MPI itself knows them
  /// (MPI_Comm_split_type SHARED, translated into this communicator's ranks): nothing gathered
  /// from other nodes decides it. Collective.
  std::vector<int> node_peers();
  /// The world rank of each member (empty when MPI could not tell).
  const std::vector<int>& world_ranks() const noexcept { return world_ranks_; }

  /// Largest element count passed to one MPI call for element-wise operations (all_reduce,
  /// broadcast, send/recv). Default 2^30; lowered only by tests to exercise the chunking.
  void set_max_chunk(std::size_t elements);

 private:
  MpiComm(MPI_Comm c, std::string name, std::shared_ptr<MpiOps> ops);
  std::string what(const char* op, ConstTensorView v, const char* extra = nullptr) const;
  /// Flight-recorder entry of this communicator's next collective.
  watchdog::OpRecord record(const char* op, ConstTensorView v);
  void check_root(int root, const char* op) const;
  void check_peer(int peer, int tag, const char* op) const;

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::string name_;
  std::shared_ptr<MpiOps> ops_;
  std::size_t max_chunk_ = std::size_t{1} << 30;
  int tag_ub_ = 32767;  // MPI_TAG_UB: the largest tag this MPI takes (32767 at least)
  std::vector<int> world_ranks_;
  int splits_ = 0;           // split_mpi calls so far (collective: the same count on every member)
  std::uint64_t calls_ = 0;  // collectives called so far (the sequence number of the last)
  /// Set when the Work of a collective is given up unfinished (a wait that timed out): this
  /// rank's part of it is still pending in MPI, so the communicator is never freed. Open MPI
  /// drops the pending part of a freed communicator, and the peers that come to the collective
  /// later would wait for it forever.
  std::shared_ptr<std::atomic<bool>> left_pending_ = std::make_shared<std::atomic<bool>>(false);
};

}  // namespace dt
