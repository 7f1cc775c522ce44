// Where this rank runs: the machine as hwloc sees it, the rank's place in the job (PMIx, with
// MPI_Comm_split_type as the fallback), and the CPU binding dt applied or found.
#pragma once

#include <string>
#include <vector>

namespace dt {

/// How the runtime binds each local rank to cores.
enum class BindMode {
  automatic,  ///< keep a binding the launcher made for each rank (srun --cpu-bind=cores), split
              ///< one that several local ranks share (mpirun --bind-to socket), else cores
  cores,      ///< always bind local rank r to its own share of the node's cores
  none,       ///< never change the binding
};
const char* bind_mode_name(BindMode m) noexcept;
/// "auto" | "cores" | "none"; throws dt::ConfigError naming the text otherwise.
BindMode parse_bind_mode(const std::string& s);

/// The node's hardware (hwloc, restricted to what this process may use).
struct MachineInfo {
  std::string host;
  int packages = 0;
  int numa_nodes = 0;
  int cores = 0;
  int pus = 0;
  std::vector<std::string> gpus;  ///< "cuda0", "nvml0", "card0", ... (empty when none)
};

/// The rank's place in the job.
struct Placement {
  int node_id = 0;  ///< 0 .. num_nodes-1, in order of the lowest world rank on each node
  int num_nodes = 1;
  int launcher_node_id = -1;  ///< the launcher's own node number (PMIx), -1 without PMIx
  int local_rank = 0;         ///< rank among the ranks of this node
  int local_size = 1;
  std::string source;  ///< "pmix" or "mpi" (MPI_Comm_split_type)
};

/// The CPU binding of this process after start-up.
struct Binding {
  std::string mode;  ///< "cores" (dt bound it), "split" (dt split a launcher's binding that
                     ///< several local ranks share), "launcher" (kept), "none" (unbound)
  std::string cpus;  ///< logical PU list, e.g. "0-1" or "2"
  std::string numa;  ///< NUMA nodes those PUs belong to, e.g. "0"
};

struct Topology {
  MachineInfo machine;
  Placement placement;
  Binding binding;
};

}  // namespace dt
