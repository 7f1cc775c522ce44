#include "dt/mesh.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <set>
#include <sstream>

namespace dt {

std::string Layout::str() const {
  return "dp=" + std::to_string(dp) + " tp=" + std::to_string(tp) + " pp=" + std::to_string(pp);
}

void check_model_split(int tp, int pp, const GptConfig& model) {
  DT_CHECK(ConfigError, model.heads % tp == 0, "option --parallel.tp: ", tp,
           " does not divide --model.heads=", model.heads,
           " (tensor parallelism splits the attention heads)");
  DT_CHECK(ConfigError, pp <= model.layers, "option --parallel.pp: ", pp,
           " pipeline stages are more than the ", model.layers,
           " layers of the model (--model.layers); each stage needs at least one layer");
}

void check_layout(const Layout& l, int world, const GptConfig& model, std::int64_t batch) {
  DT_CHECK(ConfigError, l.dp >= 1 && l.tp >= 1 && l.pp >= 1, "options --parallel.dp/tp/pp: ",
           l.str(), " must all be at least 1");
  DT_CHECK(ConfigError, l.size() == world, "options --parallel.dp/tp/pp: ", l.str(),
           " is a mesh of ", l.size(), " ranks, the job has ", world,
           " (dp x tp x pp must equal the number of ranks)");
  check_model_split(l.tp, l.pp, model);
  DT_CHECK(ConfigError, batch % l.dp == 0, "option --train.batch: ", batch,
           " sequences do not divide over ", l.dp, " ranks (the data-parallel degree, --parallel.dp)");
}

std::vector<MeshCoord> place(const Layout& l, const std::vector<RankSite>& sites) {
  const int n = static_cast<int>(sites.size());
  DT_CHECK_EQ(InvalidArgument, l.size(), n, "mesh size and number of ranks differ");
  std::vector<int> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const RankSite &x = sites[static_cast<std::size_t>(a)], &y = sites[static_cast<std::size_t>(b)];
    if (x.node != y.node) return x.node < y.node;
    if (x.numa != y.numa) return x.numa < y.numa;
    return x.local_rank < y.local_rank;
  });
  // Whole TP groups from each node first (in node order); the ranks a node cannot fill a group
  // with are grouped last, and only those groups span nodes.
  std::vector<int> grouped, rest;
  for (std::size_t i = 0; i < order.size();) {
    std::size_t j = i;
    const int node = sites[static_cast<std::size_t>(order[i])].node;
    while (j < order.size() && sites[static_cast<std::size_t>(order[j])].node == node) ++j;
    const std::size_t whole = (j - i) / static_cast<std::size_t>(l.tp) * static_cast<std::size_t>(l.tp);
    grouped.insert(grouped.end(), order.begin() + static_cast<std::ptrdiff_t>(i),
                   order.begin() + static_cast<std::ptrdiff_t>(i + whole));
    rest.insert(rest.end(), order.begin() + static_cast<std::ptrdiff_t>(i + whole),
                order.begin() + static_cast<std::ptrdiff_t>(j));
    i = j;
  }
  grouped.insert(grouped.end(), rest.begin(), rest.end());
  std::vector<MeshCoord> c(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    MeshCoord& m = c[static_cast<std::size_t>(grouped[static_cast<std::size_t>(i)])];
    m.tp = i % l.tp;
    m.pp = (i / l.tp) % l.pp;
    m.dp = i / (l.tp * l.pp);
  }
  return c;
}

std::string describe_placement(const Layout& l, const std::vector<MeshCoord>& coords,
                               const std::vector<RankSite>& sites) {
  std::ostringstream os;
  for (int d = 0; d < l.dp; ++d)
    for (int p = 0; p < l.pp; ++p) {
      os << "  dp " << d << " stage " << p << ": ranks";
      std::set<int> nodes;
      std::string hosts;
      for (int t = 0; t < l.tp; ++t)
        for (std::size_t r = 0; r < coords.size(); ++r)
          if (coords[r].dp == d && coords[r].pp == p && coords[r].tp == t) {
            os << " " << r;
            if (nodes.insert(sites[r].node).second)
              hosts += (hosts.empty() ? "" : ",") + sites[r].host;
          }
      os << " on " << hosts;
      if (nodes.size() > 1) os << " (tp group spans nodes: no node has room for " << l.tp << ")";
      os << "\n";
    }
  return os.str();
}

namespace {
constexpr std::size_t kHostLen = 64;
struct PackedSite {
  std::int32_t node, numa, local_rank;
  char host[kHostLen];
};
}  // namespace

std::vector<RankSite> gather_sites(Comm& world, const RankSite& mine) {
  PackedSite me{};
  me.node = mine.node;
  me.numa = mine.numa;
  me.local_rank = mine.local_rank;
  std::strncpy(me.host, mine.host.c_str(), kHostLen - 1);
  std::vector<PackedSite> all(static_cast<std::size_t>(world.size()));
  world.all_gather(ConstTensorView{&me, sizeof me, DType::u8},
                   TensorView{all.data(), all.size() * sizeof(PackedSite), DType::u8});
  std::vector<RankSite> sites;
  for (const PackedSite& p : all)
    sites.push_back(RankSite{p.node, p.numa, p.local_rank, std::string(p.host)});
  return sites;
}

DeviceMesh::DeviceMesh(Comm& world, const Layout& l, std::vector<RankSite> sites)
    : layout_(l), rank_(world.rank()), sites_(std::move(sites)) {
  DT_CHECK(ConfigError, l.dp >= 1 && l.tp >= 1 && l.pp >= 1, "mesh ", l.str(),
           ": every dimension must be at least 1");
  DT_CHECK_EQ(ConfigError, l.size(), world.size(), "mesh ", l.str(), " needs that many ranks");
  coords_ = place(l, sites_);
  const MeshCoord& m = coord();
  tp_ = world.split(m.dp * l.pp + m.pp, m.tp);
  pp_ = world.split(m.dp * l.tp + m.tp, m.pp);
  dp_ = world.split(m.pp * l.tp + m.tp, m.dp);
  const bool end_stage = l.pp > 1 && (m.pp == 0 || m.pp == l.pp - 1);
  tied_ = world.split(end_stage ? m.dp * l.tp + m.tp : -1, m.pp);
}

DeviceMesh::~DeviceMesh() = default;

int DeviceMesh::rank_of(int dp, int pp, int tp) const {
  for (std::size_t r = 0; r < coords_.size(); ++r)
    if (coords_[r].dp == dp && coords_[r].pp == pp && coords_[r].tp == tp)
      return static_cast<int>(r);
  DT_THROW(InvalidArgument, "no rank at mesh coordinates dp ", dp, " pp ", pp, " tp ", tp);
}

}  // namespace dt
