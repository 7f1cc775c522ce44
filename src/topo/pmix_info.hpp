// PMIx job information: the launcher's view of node id, local rank and local size.
#pragma once

#include <optional>

#include "dt/topology.hpp"

namespace dt {

/// Holds a PMIx client session for its lifetime (PMIx_Init .. PMIx_Finalize).
class PmixClient {
 public:
  /// Connects only when the launcher exported a PMIx server (PMIX_NAMESPACE set); otherwise,
  /// or when PMIx_Init fails, the client is inactive and placement() returns nothing.
  PmixClient();
  ~PmixClient();
  PmixClient(const PmixClient&) = delete;
  PmixClient& operator=(const PmixClient&) = delete;

  bool active() const noexcept { return active_; }
  /// node_id, num_nodes, local_rank, local_size from PMIx; nothing if any key is missing.
  std::optional<Placement> placement() const;

 private:
  bool active_ = false;
  char nspace_[256] = {0};
  unsigned rank_ = 0;
};

}  // namespace dt
