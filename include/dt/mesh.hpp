// dt::DeviceMesh: the ranks of a job arranged as data x pipeline x tensor parallelism.
//
// Placement is topology-aware: ranks are ordered by (node, NUMA domain, local rank) and the mesh
// is filled tensor-parallel fastest, then pipeline, then data parallel, so a TP group lies inside
// a node (inside a NUMA domain when the domain has room for it), pipeline stages come next, and
// data parallelism spans the nodes. Each mesh dimension gets its own sub-communicator.
//
// Test-only override: test.simulated-nodes = N maps the ranks to N simulated nodes, in blocks of
// consecutive ranks (test.simulated-placement = block, as srun --distribution=block) or round
// robin (cyclic), so multi-node placement is tested on one machine.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dt/comm.hpp"
#include "dt/gpt.hpp"

namespace dt {

struct Layout {
  int dp = 1, tp = 1, pp = 1;
  /// In 64 bits: the options allow products past INT_MAX, which check_layout refuses by name.
  std::int64_t size() const {
    return static_cast<std::int64_t>(dp) * static_cast<std::int64_t>(tp) *
           static_cast<std::int64_t>(pp);
  }
  std::string str() const;  ///< "dp=2 tp=1 pp=2"
};

/// Where one world rank runs, as placement sees it.
struct RankSite {
  int node = 0;
  int numa = 0;
  int local_rank = 0;
  std::string host;
};

/// A rank's coordinates in the mesh.
struct MeshCoord {
  int dp = 0, pp = 0, tp = 0;
};

/// The part of check_layout that needs no world size (callable before MPI starts): tp divides the
/// heads, pp is at most the layers. dt::ConfigError naming the option.
void check_model_split(int tp, int pp, const GptConfig& model);

/// Checks a layout against the world size and the model before anything is allocated: throws
/// dt::ConfigError naming the options (product not the world size, tp not dividing the heads,
/// pp larger than the layers, the global batch not dividing over dp).
void check_layout(const Layout& l, int world, const GptConfig& model, std::int64_t batch);

/// Mesh coordinates of every world rank (index = world rank) for `sites` (index = world rank):
/// ranks sorted by (node, numa, local rank, rank) and cut into TP groups, each node giving as many
/// whole groups as it holds (the remaining ranks of all nodes form the last groups, which span
/// nodes); groups then fill pp, then dp.
std::vector<MeshCoord> place(const Layout& l, const std::vector<RankSite>& sites);

/// Text lines naming each TP group's ranks and nodes; a group spread over several nodes (the node
/// sizes leave no other choice) is flagged "spans nodes".
std::string describe_placement(const Layout& l, const std::vector<MeshCoord>& coords,
                               const std::vector<RankSite>& sites);

/// Collective over `world`: every rank's site (index = world rank).
std::vector<RankSite> gather_sites(Comm& world, const RankSite& mine);

class DeviceMesh {
 public:
  /// Collective over `world`: places the ranks (`sites` from gather_sites) and splits one
  /// communicator per mesh dimension (and one for parameters shared by the first and last
  /// pipeline stage).
  DeviceMesh(Comm& world, const Layout& l, std::vector<RankSite> sites);
  ~DeviceMesh();

  const Layout& layout() const noexcept { return layout_; }
  const MeshCoord& coord() const noexcept { return coords_[static_cast<std::size_t>(rank_)]; }
  const std::vector<MeshCoord>& coords() const noexcept { return coords_; }
  const std::vector<RankSite>& sites() const noexcept { return sites_; }
  /// World rank at these coordinates.
  int rank_of(int dp, int pp, int tp) const;
  Comm& tp() noexcept { return *tp_; }
  Comm& pp() noexcept { return *pp_; }
  Comm& dp() noexcept { return *dp_; }
  /// The first and last pipeline stage of this rank's (dp, tp) column (nullptr when pp == 1 or
  /// this rank is on a middle stage).
  Comm* tied() noexcept { return tied_.get(); }

 private:
  Layout layout_;
  int rank_ = 0;
  std::vector<RankSite> sites_;
  std::vector<MeshCoord> coords_;
  std::unique_ptr<Comm> tp_, pp_, dp_, tied_;
};

}  // namespace dt
