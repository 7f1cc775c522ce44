// Runtime, topology and MPI error conversion under real ranks.
//   test_runtime [cores|none|auto] [pmix|nopmix] [MODE]
// MODE: the binding mode every rank must report (cores, launcher, split, none).
#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "comm/mpi_comm.hpp"
#include "dt/runtime.hpp"

namespace {
int failures = 0;
int me = 0;
#define EXPECT(cond, ...)                                    \
  do {                                                       \
    if (!(cond)) {                                           \
      ++failures;                                            \
      std::fprintf(stderr, "rank %d: FAIL %s: ", me, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                     \
      std::fprintf(stderr, "\n");                            \
    }                                                        \
  } while (0)

std::vector<int> affinity() {
  cpu_set_t set;
  CPU_ZERO(&set);
  sched_getaffinity(0, sizeof set, &set);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

// Parses "0-1,3" into {0,1,3}.
std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  std::size_t i = 0;
  while (i < s.size()) {
    std::size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string part = s.substr(i, j - i);
    auto dash = part.find('-');
    int a = std::stoi(part.substr(0, dash));
    int b = dash == std::string::npos ? a : std::stoi(part.substr(dash + 1));
    for (int c = a; c <= b; ++c) out.push_back(c);
    i = j + 1;
  }
  return out;
}
}  // namespace

int main(int argc, char** argv) {
  const std::string bind = argc > 1 ? argv[1] : "auto";
  const bool use_pmix = !(argc > 2 && std::strcmp(argv[2], "nopmix") == 0);
  dt::RuntimeOptions ro;
  ro.bind = dt::parse_bind_mode(bind);
  ro.use_pmix = use_pmix;
  const std::string want_mode = argc > 3 ? argv[3] : "";
  const std::vector<int> launcher = affinity();  // as the launcher left it
  dt::Runtime rt(&argc, &argv, ro);
  me = rt.rank();
  const auto& t = rt.topology();

  int wsize = 0, wrank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &wsize);
  MPI_Comm_rank(MPI_COMM_WORLD, &wrank);
  EXPECT(rt.size() == wsize && rt.rank() == wrank, "world %d/%d vs MPI %d/%d", rt.rank(), rt.size(),
         wrank, wsize);

  // Placement against an independent MPI_Comm_split_type.
  MPI_Comm shm;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, wrank, MPI_INFO_NULL, &shm);
  int lrank = 0, lsize = 0;
  MPI_Comm_rank(shm, &lrank);
  MPI_Comm_size(shm, &lsize);
  EXPECT(t.placement.local_size == lsize, "local_size %d, MPI says %d", t.placement.local_size,
         lsize);
  EXPECT(rt.node().size() == lsize, "node comm size %d", rt.node().size());
  EXPECT(t.placement.node_id >= 0 && t.placement.node_id < t.placement.num_nodes,
         "node id %d of %d", t.placement.node_id, t.placement.num_nodes);
  // Local ranks are a permutation of 0..lsize-1 on each node.
  std::vector<int> lranks(lsize, -1);
  int mine = t.placement.local_rank;
  MPI_Allgather(&mine, 1, MPI_INT, lranks.data(), 1, MPI_INT, shm);
  std::vector<int> seen(lsize, 0);
  for (int r : lranks)
    if (r >= 0 && r < lsize) seen[r]++;
  for (int i = 0; i < lsize; ++i)
    EXPECT(seen[i] == 1, "local rank %d appears %d times", i, seen[i]);
  // Node ids: the same on a node, and numbered 0.. in order of each node's lowest world rank.
  {
    int lowest = wrank;
    MPI_Allreduce(MPI_IN_PLACE, &lowest, 1, MPI_INT, MPI_MIN, shm);
    std::vector<int> lows(wsize), ids(wsize);
    int id = t.placement.node_id;
    MPI_Allgather(&lowest, 1, MPI_INT, lows.data(), 1, MPI_INT, MPI_COMM_WORLD);
    MPI_Allgather(&id, 1, MPI_INT, ids.data(), 1, MPI_INT, MPI_COMM_WORLD);
    std::vector<int> leaders;  // lowest world rank of each node, ascending
    for (int r = 0; r < wsize; ++r)
      if (lows[r] == r) leaders.push_back(r);
    EXPECT(t.placement.num_nodes == static_cast<int>(leaders.size()), "num_nodes %d, MPI sees %zu",
           t.placement.num_nodes, leaders.size());
    for (int r = 0; r < wsize; ++r) {
      int want = -1;
      for (std::size_t k = 0; k < leaders.size(); ++k)
        if (leaders[k] == lows[r]) want = static_cast<int>(k);
      EXPECT(ids[r] == want, "rank %d has node id %d, expected %d", r, ids[r], want);
    }
  }
  // DT_TEST_WANT_SOURCE: the source every rank must report (a job of ranks told differently).
  const char* told = std::getenv("DT_TEST_WANT_SOURCE");
  const std::string want_source = told ? told : use_pmix ? "pmix" : "mpi";
  EXPECT(t.placement.source == want_source, "placement source '%s', expected '%s'",
         t.placement.source.c_str(), want_source.c_str());

  // Machine: hwloc counts are sane and PUs match what the OS lets this process use at most.
  EXPECT(t.machine.cores >= 1 && t.machine.pus >= t.machine.cores, "cores %d pus %d",
         t.machine.cores, t.machine.pus);
  EXPECT(t.machine.packages >= 1 && t.machine.numa_nodes >= 1, "packages %d numa %d",
         t.machine.packages, t.machine.numa_nodes);
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  EXPECT(t.machine.host == host, "host '%s' vs '%s'", t.machine.host.c_str(), host);

  // Binding: what the runtime reports is what the kernel enforces.
  const std::vector<int> cpus = affinity();
  EXPECT(parse_list(t.binding.cpus) == cpus, "reported cpus '%s' differ from sched_getaffinity",
         t.binding.cpus.c_str());
  if (bind == "cores") {
    EXPECT(t.binding.mode == "cores", "mode '%s'", t.binding.mode.c_str());
    // With no more local ranks than cores, local ranks get disjoint, non-empty sets.
    if (lsize <= t.machine.cores) {
      std::vector<int> all(static_cast<std::size_t>(lsize) * 64, -1);
      std::vector<int> pad(64, -1);
      for (std::size_t i = 0; i < cpus.size() && i < 64; ++i) pad[i] = cpus[i];
      MPI_Allgather(pad.data(), 64, MPI_INT, all.data(), 64, MPI_INT, shm);
      std::vector<int> owner(4096, -1);
      for (int r = 0; r < lsize; ++r)
        for (int k = 0; k < 64; ++k) {
          int c = all[r * 64 + k];
          if (c < 0) continue;
          EXPECT(owner[c] == -1, "cpu %d bound to local ranks %d and %d", c, owner[c], r);
          owner[c] = r;
        }
      EXPECT(!cpus.empty(), "empty binding");
    }
  }
  if (bind == "none") EXPECT(t.binding.mode == "none", "mode '%s'", t.binding.mode.c_str());
  if (!want_mode.empty())
    EXPECT(t.binding.mode == want_mode, "mode '%s', expected '%s'", t.binding.mode.c_str(),
           want_mode.c_str());
  // A binding kept or split stays inside what the launcher gave.
  if (t.binding.mode == "launcher") EXPECT(cpus == launcher, "launcher binding changed");
  if (t.binding.mode == "split")
    for (int c : cpus)
      EXPECT(std::find(launcher.begin(), launcher.end(), c) != launcher.end(),
             "cpu %d is outside the launcher's binding", c);
  MPI_Comm_free(&shm);

  // node_peers (which ranks a sealed channel may exempt as node-local): the other ranks whose
  // host name is this rank's, by MPI's own knowledge of the node.
  {
    auto c = dt::MpiComm::dup(MPI_COMM_WORLD, "peers");
    std::vector<char> names(static_cast<std::size_t>(c->size()) * sizeof host);
    MPI_Allgather(host, sizeof host, MPI_CHAR, names.data(), sizeof host, MPI_CHAR, c->handle());
    std::vector<int> want;
    for (int r = 0; r < c->size(); ++r)
      if (r != c->rank() &&
          std::strcmp(&names[static_cast<std::size_t>(r) * sizeof host], host) == 0)
        want.push_back(r);
    const std::vector<int> got = c->node_peers();
    EXPECT(got == want, "node_peers gives %zu ranks, %zu share host %s", got.size(), want.size(),
           host);
  }

  // A real MPI failure becomes a dt::CommError naming the call and the rank.
  {
    auto c = dt::MpiComm::dup(MPI_COMM_WORLD, "probe");
    int x = 0;
    try {
      DT_MPI(MPI_Send(&x, 1, MPI_INT, c->size() + 7, 0, c->handle()), c->rank(), c->name());
      EXPECT(false, "MPI_Send to a rank outside the communicator did not fail");
    } catch (const dt::CommError& e) {
      const std::string m = e.what();
      const std::string want = "MPI_Send failed on rank " + std::to_string(c->rank()) + " of probe";
      EXPECT(m.find(want) != std::string::npos, "message '%s' lacks '%s'", m.c_str(), want.c_str());
    }
  }

  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rt.rank() == 0)
    std::printf("test_runtime (%s, %s): %d ranks, %d failures; rank 0 bound to %s (%s)\n",
                bind.c_str(), use_pmix ? "pmix" : "nopmix", rt.size(), total,
                t.binding.cpus.c_str(), t.binding.mode.c_str());
  return total == 0 ? 0 : 1;
}
