// hwloc: what the node has, and binding a local rank to its share of the cores.
#pragma once

#include <hwloc.h>

#include "dt/topology.hpp"

namespace dt {

/// Move-only owner of a loaded hwloc topology (I/O devices included, for GPUs).
class HwlocTopology {
 public:
  /// Loads the topology; throws dt::Error naming the hwloc call that failed.
  HwlocTopology();
  ~HwlocTopology();
  HwlocTopology(HwlocTopology&& o) noexcept : t_(o.t_) { o.t_ = nullptr; }
  HwlocTopology& operator=(HwlocTopology&&) = delete;
  HwlocTopology(const HwlocTopology&) = delete;
  HwlocTopology& operator=(const HwlocTopology&) = delete;

  /// Counts packages, NUMA nodes, cores, PUs and GPUs this process may use.
  MachineInfo describe() const;
  /// Applies `mode` for local rank `local_rank` of `local_size` and reports the result.
  /// Cores are split into contiguous, near-equal shares; with more ranks than cores, rank r
  /// gets core r mod cores. A failed bind call is reported (mode "failed: ..."), not thrown.
  Binding bind(BindMode mode, int local_rank, int local_size);
  /// The binding as it is now.
  Binding current(const char* mode) const;

 private:
  hwloc_topology_t t_ = nullptr;
};

}  // namespace dt
