// dt::ShmComm: collectives through a shared-memory segment among the ranks of a node, composed
// hierarchically across nodes; point-to-point and everything it does not accelerate go to MPI.
//
// Algorithm (all_reduce of n elements over L local ranks): every rank's data sits in its own region
// of a segment all local ranks map (either the caller's buffer was allocated in this rank's arena,
// see arena(), or it is first copied into the rank's staging area). Rank r reduces slice r of the
// buffer from every peer's region, chunk by chunk, in rank order 0..L-1, in place in its own
// region, and publishes a per-chunk progress counter; the other ranks copy each finished chunk out
// as soon as it is published (reduce-scatter and all-gather pipelined in chunks). With several
// nodes, slice r is all-reduced over MPI among the ranks with local rank r on every node before it
// is published (every local rank leads the inter-node traffic of its slice). Synchronisation is by
// sequence numbers in the segment: no MPI call on the fast path.
//
// Small collectives on one node (at most kSmallBytes from each rank, and kSmallTotal from all)
// take one synchronisation instead of three: each rank copies its part into one of two small
// slots beside its control block, arrives, and reads what it needs straight from the peers' slots
// (every rank reduces the whole buffer itself). The slots alternate by sequence number, so no rank
// waits for the others to leave: a rank that runs ahead into the next collective writes the other
// slot, and cannot reach the one after (which reuses this slot) before every peer has arrived
// there, that is, finished reading this one.
//
// Results: the reduction order per element is fixed (local ranks in order, then MPI's order across
// nodes), so a buffer gives the same bits whether reduced whole or cut into pieces, small or not.
//
// Used for all_reduce, all_gather, reduce_scatter and broadcast when the communicator is one node
// (all_reduce also across nodes when every node has the same number of ranks) and the message is
// at least `min_bytes`; MPI otherwise. Blocking calls without a timeout run on the calling thread;
// the i* forms and blocking calls with a timeout run on this communicator's progress thread in
// call order, so a timed-out operation stays pending and completes when the peers arrive, as
// MPI's do. Ranks that disagree about a call (sizes, or arena buffers on some ranks only) get a
// dt::CommError, after which the communicator refuses further collectives, as long as each took
// this communicator's path: sizes on both sides of min_bytes (or of the cross-node rule) send some
// ranks to MPI and the others here, and they wait for each other as in MPI. A rank that gives up
// a collective (an error in it, or destruction while one is pending after a call timed out, or
// 10 s after destruction began) or destroys the communicator marks its segment: the local peers
// waiting for it then fail with a CommError naming it instead of waiting forever, and the
// destructor does not wait for them. An operation waiting inside MPI (the cross-node step of the
// hierarchical path, barriers, messages below min_bytes) waits as MPI does. One thread at a time
// calls a ShmComm.
//
// The segment is POSIX shared memory (/dev/shm/dt-shm-[jJOB-]PID-N), unlinked as soon as every
// local rank has mapped it, so a job that crashes later leaves nothing behind in /dev/shm; one
// killed while its ranks map it may, and slurm/epilog removes the job's names.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dt/comm.hpp"
#include "mpi_comm.hpp"
#include "progress.hpp"
#include "shm_segment.hpp"

namespace dt {

struct ShmConfig {
  /// Bytes of this rank's arena: buffers allocated there skip the copy into the segment.
  std::size_t arena_bytes = 0;
  /// Bytes of this rank's staging area for buffers outside the arena (larger ones go in pieces).
  std::size_t staging_bytes = std::size_t{8} << 20;
  /// Pipelining granularity of the reduce/copy-out phases.
  std::size_t chunk_bytes = std::size_t{128} << 10;
  /// Messages smaller than this go to MPI.
  std::size_t min_bytes = 0;
  /// Testing only: pretend the ranks sit on this many nodes (contiguous blocks of world ranks),
  /// so the hierarchical path runs on one machine. 0: real nodes.
  int simulated_nodes = 0;
};

class ShmComm final : public Comm {
 public:
  /// Largest contribution of one rank (bytes) that takes the small path.
  static constexpr std::size_t kSmallBytes = 4096;
  /// Largest sum of all local ranks' contributions that takes the small path: every rank reads
  /// all of them, so the bound shrinks with the ranks of a node (1 KiB each with 64).
  static constexpr std::size_t kSmallTotal = 64 << 10;

  /// Collective over `parent` (which it duplicates). Throws dt::CommError when the segment cannot
  /// be created or mapped (naming the size and the system error).
  static std::unique_ptr<ShmComm> create(const MpiComm& parent, std::string name,
                                         const ShmConfig& cfg);
  ~ShmComm() override;

  int rank() const noexcept override { return mpi_->rank(); }
  int size() const noexcept override { return mpi_->size(); }
  const std::string& name() const noexcept override { return name_; }

  /// This rank's arena (cfg.arena_bytes, 64-byte aligned) inside the shared segment.
  void* arena() const noexcept { return arena_; }
  std::size_t arena_bytes() const noexcept { return cfg_.arena_bytes; }
  int local_rank() const noexcept { return local_->rank(); }
  int local_size() const noexcept { return local_->size(); }
  int num_nodes() const noexcept { return nodes_; }
  /// Ranks on the smallest and on the largest node (they differ on nodes of uneven sizes, where
  /// all_reduce runs over MPI across nodes).
  int min_local_size() const noexcept { return min_local_; }
  int max_local_size() const noexcept { return max_local_; }
  /// Testing: the synchronisation rounds so far, to run the rounds around a wrap of the 32 bits
  /// of it that the progress words hold. Every local rank sets the same value between
  /// collectives, then all meet in a barrier before the next one.
  void set_rounds_for_test(std::uint64_t rounds);
  /// True when all_reduce runs hierarchically across nodes (else MPI when num_nodes() > 1).
  bool hierarchical() const noexcept { return cross_ != nullptr; }
  /// Which path a collective of `bytes` takes: "shm-small", "shm", "hier" or "mpi". `bytes` is
  /// the buffer of all_reduce and broadcast, the input of all_gather, the output of reduce_scatter.
  const char* path(const char* op, std::size_t bytes) const noexcept;

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

  /// Splits over MPI: the result is a plain MPI communicator.
  std::unique_ptr<Comm> split(int color, int key) override;

  struct Control;

 private:
  ShmComm() = default;
  struct Form;
  // Runs `f` on the calling thread after the queued i* operations (call order is kept).
  template <class F>
  void run_blocking(std::string what, const CommOptions& opts, F&& f);
  Work queued(std::string what, std::function<void()> f);
  // Runs collective `f` (under run_mu_); an exception once it has started a round marks this
  // rank as having given up.
  template <class F>
  void run_round(F&& f);
  ProgressQueue& queue();

  void do_all_reduce(TensorView buf, ReduceOp op, const Form& dl);
  void do_broadcast(TensorView buf, int root, const Form& dl);
  void do_all_gather(ConstTensorView in, TensorView out, const Form& dl);
  void do_reduce_scatter(ConstTensorView in, TensorView out, ReduceOp op, const Form& dl);
  // One all_reduce of `n` elements whose copies sit at byte offset `off` of every rank's segment;
  // the result goes to `dest` (may be this rank's own region). `total`: the elements of the
  // call this round is a piece of (n where the call is one round).
  void reduce_region(std::size_t off, std::size_t n, DType t, ReduceOp op, void* dest,
                     const Form& dl, std::size_t total);
  // Publish "arrived at op seq with (off, n), a piece of a call of `total` elements" and wait
  // until every local rank has; throws CommError (breaking the communicator) where a rank's call
  // differs. The calls' totals are compared too: calls of different sizes cut into pieces can
  // have a first piece alike.
  void arrive(std::uint64_t seq, std::uint64_t off, std::uint64_t n, std::uint64_t kind,
              std::uint64_t total);
  void depart(std::uint64_t seq);
  // Waits until `a` of local rank `peer` has reached target (a progress word: `progress`), for
  // collective `seq`; throws CommError once a local rank has given up, or `peer` has left (their
  // `failed` words), or this communicator is being destroyed after a failure.
  void wait_for(const std::atomic<std::uint64_t>& a, std::uint64_t target, std::uint64_t seq,
                int peer, bool progress = false);
  // Throws CommError for collective `seq` when this communicator is being destroyed after a
  // failure, a local rank has given up, or the rank waited for (`peer`; -1: any rank arrive_all
  // still waits for) has left. The caller decides whether that breaks the communicator.
  void check_failures(std::uint64_t seq, int peer);
  // Waits until every local rank has arrived at `seq`, calling check(q) for each as it arrives.
  template <class Check>
  void arrive_all(std::uint64_t seq, Check&& check);
  // This rank's `failed` word: it gave up a collective (kGaveUp: also breaks this communicator)
  // or destroyed the communicator (kLeft); peers waiting for it then fail instead of waiting
  // forever. The first reason stays.
  static constexpr std::uint64_t kGaveUp = 1, kLeft = 2;
  void mark(std::uint64_t why) noexcept;
  // How long destruction waits for queued operations of a healthy communicator to finish.
  static constexpr std::chrono::seconds kDrainWait{10};
  // The small path: this rank's slot of collective `seq`, any rank's; `arrive_small` publishes
  // this rank's call (`kind`, n elements) and waits until every local rank has made the same one.
  char* small_slot(int q, std::uint64_t seq) const noexcept;
  void arrive_small(std::uint64_t seq, std::uint64_t kind, std::uint64_t n);
  bool small(std::size_t contribution) const noexcept;
  char* seg(int q) const noexcept { return bases_[static_cast<std::size_t>(q)]; }
  Control& ctl(int q) const noexcept;
  std::size_t staging_off() const noexcept;
  std::size_t region_off(const void* p, std::size_t bytes) const noexcept;
  bool use_shm(std::size_t bytes) const noexcept;
  void check_usable(const char* op) const;
  void check_root(int root) const;
  void check_gather(ConstTensorView in, ConstTensorView out) const;
  void check_scatter(ConstTensorView in, ConstTensorView out) const;
  std::string what(const char* op, ConstTensorView v, const char* extra = nullptr) const;

  std::string name_;
  ShmConfig cfg_;
  std::unique_ptr<MpiComm> mpi_, local_, cross_;
  int nodes_ = 1;
  int min_local_ = 1, max_local_ = 1;
  ShmSegment shm_;
  std::size_t seg_bytes_ = 0;
  std::vector<char*> bases_;
  std::vector<const void*> ins_;  // the inputs of one reduction, one per local rank
  std::vector<char> arrived_;     // arrive_all: which local ranks have arrived
  char* arena_ = nullptr;
  std::uint64_t seq_ = 0;    // synchronisation rounds through the segment
  std::uint64_t calls_ = 0;  // collectives called (the flight recorder's sequence numbers)
  std::atomic<bool> broken_{false};
  // Blocking calls that returned on their timeout: each one's flag is set once it has run
  // (guarded by queue_mu_).
  std::vector<std::shared_ptr<std::atomic<bool>>> timed_out_;
  std::atomic<bool> stop_{false};  // destruction after a failure: pending waits give up
  std::mutex run_mu_;              // one collective at a time (caller thread or progress thread)
  std::mutex queue_mu_;
  std::unique_ptr<ProgressQueue> queue_;
};

}  // namespace dt
