// hwloc: what the node has, and binding a local rank to its share of the cores.
#pragma once

#include <hwloc.h>

#include <string>
#include <utility>
#include <vector>

#include "dt/topology.hpp"

namespace dt {

/// Member `index` of `count`'s share of `items` items, as [first, last): contiguous, near-equal
/// and disjoint when count <= items; item index mod items (one each, shared) otherwise.
std::pair<int, int> share_of(int items, int index, int count);

/// The local ranks whose binding is local rank `me`'s (`masks[r]`: local rank r's CPU list):
/// `me`'s position among them and their number.
std::pair<int, int> sharers_of(const std::vector<std::string>& masks, int me);

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
  /// Applies `mode` for local rank `local_rank` and reports the result. `masks` holds every local
  /// rank's binding as the launcher left it (current().cpus, by local rank; its size is the
  /// number of local ranks). The node's cores, or under BindMode::automatic a launcher's binding
  /// that several local ranks share (mpirun's --bind-to socket or numa, say), are split among the
  /// ranks that hold them (share_of over the cores, in local rank order): mode "cores" or
  /// "split". A launcher's binding of this rank alone, or one core shared, is kept ("launcher").
  /// A failed bind call is reported (mode "failed (...)"), not thrown.
  Binding bind(BindMode mode, int local_rank, const std::vector<std::string>& masks);
  /// The binding as it is now.
  Binding current(const char* mode) const;

 private:
  hwloc_topology_t t_ = nullptr;
};

}  // namespace dt
