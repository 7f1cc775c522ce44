#include "dt/runtime.hpp"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../comm/mpi_comm.hpp"
#include "../topo/hwloc_topo.hpp"
#include "../topo/pmix_info.hpp"
#include "dt/error.hpp"

namespace dt {

namespace {

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
  }
  return "unknown";
}

// Owns MPI initialisation: finalises on destruction when it initialised MPI itself.
struct MpiSession {
  bool owns = false;
  MpiSession(int* argc, char*** argv) {
    // MPI starts once per process: after MPI_Finalize (an earlier Runtime's, or the caller's)
    // even MPI_Query_thread is erroneous, and Open MPI aborts the process on it.
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin)
      DT_THROW(CommError,
               "MPI has already been finalised in this process (by an earlier dt::Runtime or by "
               "the caller) and cannot be started again: keep one dt::Runtime for the whole "
               "program");
    int init = 0;
    MPI_Initialized(&init);
    int provided = MPI_THREAD_SINGLE;
    if (init) {
      MPI_Query_thread(&provided);
    } else {
      if (MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
        DT_THROW(CommError, "MPI_Init_thread failed");
      owns = true;
    }
    if (provided < MPI_THREAD_MULTIPLE) {
      if (owns) MPI_Finalize();
      DT_THROW(CommError, "the MPI library provides ", thread_level_name(provided),
               " but dt needs MPI_THREAD_MULTIPLE; use an MPI built with thread support");
    }
  }
  ~MpiSession() {
    int fin = 0;
    MPI_Finalized(&fin);
    if (owns && !fin) MPI_Finalize();
  }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
};

// Node id and count from MPI alone: node leaders (local rank 0) numbered by world rank.
Placement mpi_placement(MpiComm& world, MpiComm& node) {
  Placement p;
  p.local_rank = node.rank();
  p.local_size = node.size();
  p.source = "mpi";
  int ids[2] = {0, 0};
  auto leaders = world.split(node.rank() == 0 ? 0 : -1, world.rank());
  if (leaders) {
    ids[0] = leaders->rank();
    ids[1] = leaders->size();
  }
  node.broadcast(view_of(ids, 2), 0);
  p.node_id = ids[0];
  p.num_nodes = ids[1];
  return p;
}

// Every local rank's CPU list `mine`, by local rank (`local_rank` of each, which PMIx may order
// otherwise than `node`'s ranks).
std::vector<std::string> local_masks(MpiComm& node, int local_rank, const std::string& mine) {
  int longest = static_cast<int>(mine.size());
  node.all_reduce(view_of(&longest, 1), ReduceOp::max);
  const std::size_t width = sizeof(int) + static_cast<std::size_t>(longest);
  std::vector<std::uint8_t> own(width, 0), all(width * static_cast<std::size_t>(node.size()));
  std::memcpy(own.data(), &local_rank, sizeof(int));
  std::memcpy(own.data() + sizeof(int), mine.data(), mine.size());
  node.all_gather(view_of(own), view_of(all));
  std::vector<std::string> masks(static_cast<std::size_t>(node.size()));
  for (int r = 0; r < node.size(); ++r) {
    const char* rec =
        reinterpret_cast<const char*>(all.data()) + width * static_cast<std::size_t>(r);
    int lr = 0;
    std::memcpy(&lr, rec, sizeof(int));
    DT_ASSERT(lr >= 0 && lr < node.size(), "local rank ", lr, " of ", node.size());
    masks[static_cast<std::size_t>(lr)].assign(rec + sizeof(int),
                                               strnlen(rec + sizeof(int), width - sizeof(int)));
  }
  return masks;
}

}  // namespace

struct Runtime::Impl {
  MpiSession mpi;
  std::unique_ptr<MpiComm> world;
  std::unique_ptr<MpiComm> node;
  std::unique_ptr<PmixClient> pmix;
  Topology topo;

  Impl(int* argc, char*** argv, const RuntimeOptions& opts) : mpi(argc, argv) {
    try {
      start(opts);
    } catch (...) {
      // MPI stays up: MPI_Finalize would wait for the other ranks, which go on into their first
      // collective and wait for this one. The caller ends the job (start_runtime: MPI_Abort).
      mpi.owns = false;
      throw;
    }
  }

  void start(const RuntimeOptions& opts) {
    // Testing: this world rank fails to start once MPI is up (a node whose topology cannot be
    // read, say), to check that no other rank waits for it.
    if (const char* r = std::getenv("DT_TEST_START_FAIL_RANK")) {
      int me = -1;
      MPI_Comm_rank(MPI_COMM_WORLD, &me);
      DT_CHECK(Error, std::atoi(r) != me, "DT_TEST_START_FAIL_RANK: rank ", me,
               " fails to start (testing)");
    }
    world = MpiComm::dup(MPI_COMM_WORLD, "world");
    node = world->split_shared();
    topo.placement = mpi_placement(*world, *node);
    // Node ids stay MPI's (contiguous, in order of each node's lowest world rank): launchers
    // number nodes their own way (Open MPI counts its head node). Local rank and size come from
    // PMIx where every rank asks PMIx and its view agrees with the shared-memory communicator.
    // Every rank takes part in the agreement, also one told not to ask PMIx (the option is read
    // from each node's config file, which may differ): it votes no.
    std::optional<Placement> p;
    if (opts.use_pmix) {
      pmix = std::make_unique<PmixClient>();
      p = pmix->placement();
    }
    int agree = p && p->local_size == topo.placement.local_size && p->local_rank >= 0 &&
                p->local_rank < p->local_size && p->num_nodes == topo.placement.num_nodes;
    world->all_reduce(view_of(&agree, 1), ReduceOp::min);
    if (agree) {
      topo.placement.local_rank = p->local_rank;
      topo.placement.launcher_node_id = p->node_id;
      topo.placement.source = "pmix";
    } else if (pmix && pmix->active()) {
      topo.placement.source = "mpi (pmix disagreed)";
    }
    HwlocTopology hw;
    topo.machine = hw.describe();
    const std::vector<std::string> masks =
        opts.bind == BindMode::automatic
            ? local_masks(*node, topo.placement.local_rank, hw.current("launcher").cpus)
            : std::vector<std::string>(static_cast<std::size_t>(topo.placement.local_size));
    topo.binding = hw.bind(opts.bind, topo.placement.local_rank, masks);
  }

  ~Impl() {
    node.reset();
    world.reset();
    pmix.reset();
  }
};

Runtime::Runtime(int* argc, char*** argv, const RuntimeOptions& opts)
    : impl_(std::make_unique<Impl>(argc, argv, opts)) {}

Runtime::~Runtime() = default;

std::unique_ptr<Runtime> start_runtime(int* argc, char*** argv, const RuntimeOptions& opts,
                                       const char* app) {
  try {
    return std::make_unique<Runtime>(argc, argv, opts);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: cannot start: %s\n", app, message_of(e).c_str());
    std::fflush(stderr);
    int up = 0, down = 0;
    MPI_Initialized(&up);
    MPI_Finalized(&down);
    if (up && !down) MPI_Abort(MPI_COMM_WORLD, 3);
    std::exit(3);
  }
}

int Runtime::rank() const noexcept { return impl_->world->rank(); }
int Runtime::size() const noexcept { return impl_->world->size(); }
Comm& Runtime::world() noexcept { return *impl_->world; }
Comm& Runtime::node() noexcept { return *impl_->node; }
const Topology& Runtime::topology() const noexcept { return impl_->topo; }

void Runtime::abort(int code) noexcept {
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

}  // namespace dt
