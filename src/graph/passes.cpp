// Graph passes: tensor-parallel rewrite, pipeline partition and split, per-stage extraction.
#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include "dt/graph.hpp"

namespace dt::graph {

Graph tp_rewrite(const Graph& g, int tp) {
  DT_CHECK(ConfigError, tp >= 1, "option --parallel.tp: ", tp, " must be at least 1");
  if (tp == 1) return g;
  for (const Node& n : g.nodes)
    if (n.op == "attention")
      DT_CHECK(ConfigError, n.attr("heads") % tp == 0, "option --parallel.tp: ", tp,
               " does not divide --model.heads=", n.attr("heads"),
               " (tensor parallelism splits the attention heads)");
  Graph out;
  out.layers = g.layers;
  out.tensors = g.tensors;
  auto& T = out.tensors;
  auto shard_param = [&](int id, Sharding s) {
    TensorInfo& t = T[static_cast<std::size_t>(id)];
    t.sharding = s;
    t.shape[static_cast<std::size_t>(s.dim)] /= tp;
  };
  auto new_act = [&](const std::string& name, const Shape& shape) {
    TensorInfo t;
    t.name = name;
    t.shape = shape;
    return out.add_tensor(std::move(t));
  };
  for (const Node& n : g.nodes) {
    const std::int64_t par = n.op == "linear" ? n.attr_or("parallel", 0) : 0;
    if (par == 1) {
      // Column-parallel: every rank holds out/tp rows of W (per q|k|v block) and of b. The input
      // enters through tp_copy, whose backward sums the input gradient over the group.
      const int blocks = static_cast<int>(n.attr_or("blocks", 1));
      const std::int64_t rows = T[static_cast<std::size_t>(n.in[1])].shape[0];
      DT_CHECK(ConfigError, rows % (static_cast<std::int64_t>(blocks) * tp) == 0,
               "option --parallel.tp: ", tp, " does not divide the ", rows / blocks,
               " output features of ", n.name);
      Sharding s;
      s.kind = blocks > 1 ? Sharding::Kind::block : Sharding::Kind::split;
      s.dim = 0;
      s.parts = tp;
      s.blocks = blocks;
      shard_param(n.in[1], s);
      shard_param(n.in[2], s);
      const TensorInfo& x = T[static_cast<std::size_t>(n.in[0])];
      const int xc = new_act(x.name + "@tp", x.shape);
      Node copy;
      copy.op = "tp_copy";
      copy.name = n.name + ".tp_copy";
      copy.in = {n.in[0]};
      copy.out = {xc};
      copy.layer = n.layer;
      out.add_node(copy);
      Node lin = n;
      lin.in[0] = xc;
      out.add_node(lin);
    } else if (par == 2) {
      // Row-parallel: every rank holds in/tp columns of W; partial products are summed by
      // tp_reduce. The bias is added once, on tensor-parallel rank 0.
      Sharding s;
      s.kind = Sharding::Kind::split;
      s.dim = 1;
      s.parts = tp;
      shard_param(n.in[1], s);
      const TensorInfo& y = T[static_cast<std::size_t>(n.out[0])];
      const int partial = new_act(y.name + "@partial", y.shape);
      Node lin = n;
      lin.out = {partial};
      lin.attrs["bias_rank0"] = 1;
      out.add_node(lin);
      Node red;
      red.op = "tp_reduce";
      red.name = n.name + ".tp_reduce";
      red.in = {partial};
      red.out = {n.out[0]};
      red.layer = n.layer;
      out.add_node(red);
    } else if (n.op == "attention") {
      Node a = n;
      a.attrs["heads"] = n.attr("heads") / tp;
      out.add_node(a);
    } else {
      out.add_node(n);
    }
  }
  // Activation shapes follow from the sharded parameters.
  for (TensorInfo& t : T)
    if (t.role == Role::activation || t.role == Role::output) t.shape.clear();
  return infer_shapes(std::move(out));
}

std::vector<int> partition(const std::vector<double>& cost, int stages) {
  const int n = static_cast<int>(cost.size());
  DT_CHECK(InvalidArgument, stages >= 1 && stages <= n, "cannot cut ", n, " units into ", stages,
           " non-empty stages");
  std::vector<double> pre(static_cast<std::size_t>(n) + 1, 0.0);
  for (int i = 0; i < n; ++i) {
    DT_CHECK(InvalidArgument, cost[static_cast<std::size_t>(i)] >= 0, "unit ", i,
             " has a negative cost ", cost[static_cast<std::size_t>(i)]);
    pre[static_cast<std::size_t>(i) + 1] = pre[static_cast<std::size_t>(i)] + cost[static_cast<std::size_t>(i)];
  }
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: the smallest largest-stage cost of units [0, i) in k stages; cut[k][i]: where the
  // last of those k stages starts.
  std::vector<std::vector<double>> best(static_cast<std::size_t>(stages) + 1,
                                        std::vector<double>(static_cast<std::size_t>(n) + 1, inf));
  std::vector<std::vector<int>> cut(static_cast<std::size_t>(stages) + 1,
                                    std::vector<int>(static_cast<std::size_t>(n) + 1, -1));
  best[0][0] = 0;
  for (int k = 1; k <= stages; ++k)
    for (int i = k; i <= n; ++i)
      for (int j = k - 1; j < i; ++j) {
        const double prev = best[static_cast<std::size_t>(k) - 1][static_cast<std::size_t>(j)];
        if (prev == inf) continue;
        const double v = std::max(prev, pre[static_cast<std::size_t>(i)] - pre[static_cast<std::size_t>(j)]);
        if (v < best[static_cast<std::size_t>(k)][static_cast<std::size_t>(i)]) {
          best[static_cast<std::size_t>(k)][static_cast<std::size_t>(i)] = v;
          cut[static_cast<std::size_t>(k)][static_cast<std::size_t>(i)] = j;
        }
      }
  std::vector<int> first(static_cast<std::size_t>(stages));
  int i = n;
  for (int k = stages; k >= 1; --k) {
    i = cut[static_cast<std::size_t>(k)][static_cast<std::size_t>(i)];
    first[static_cast<std::size_t>(k) - 1] = i;
  }
  DT_ASSERT(first[0] == 0);
  return first;
}

double max_stage_cost(const std::vector<double>& cost, const std::vector<int>& first) {
  double worst = 0;
  for (std::size_t s = 0; s < first.size(); ++s) {
    const int end = s + 1 < first.size() ? first[s + 1] : static_cast<int>(cost.size());
    double sum = 0;
    for (int i = first[s]; i < end; ++i) sum += cost[static_cast<std::size_t>(i)];
    worst = std::max(worst, sum);
  }
  return worst;
}

Graph pipeline_split(const Graph& g, const std::vector<int>& first) {
  const int stages = static_cast<int>(first.size());
  DT_CHECK(InvalidArgument, stages >= 1 && first[0] == 0, "a pipeline cut starts at layer 0");
  for (int s = 1; s < stages; ++s)
    DT_CHECK(InvalidArgument,
             first[static_cast<std::size_t>(s)] > first[static_cast<std::size_t>(s) - 1] &&
                 first[static_cast<std::size_t>(s)] < g.layers,
             "pipeline stage ", s, " starts at layer ", first[static_cast<std::size_t>(s)],
             ": stages must be non-empty and in order within ", g.layers, " layers");
  auto stage_of = [&](int layer) {
    if (layer < 0) return 0;
    if (layer >= g.layers) return stages - 1;
    int s = 0;
    while (s + 1 < stages && first[static_cast<std::size_t>(s) + 1] <= layer) ++s;
    return s;
  };
  Graph out;
  out.layers = g.layers;
  out.tensors = g.tensors;
  std::vector<int> producer_stage(g.tensors.size(), -1);
  std::map<std::pair<int, int>, int> received;  // (tensor, stage) -> local copy
  std::map<int, std::set<int>> param_stages;
  int edge = 0;
  for (const Node& n0 : g.nodes) {
    Node n = n0;
    n.stage = stage_of(n.layer);
    for (int& t : n.in) {
      const TensorInfo ti = out.tensors[static_cast<std::size_t>(t)];  // add_tensor reallocates
      if (ti.role == Role::param) param_stages[t].insert(n.stage);
      const int ps = producer_stage[static_cast<std::size_t>(t)];
      if (ps < 0 || ps == n.stage) continue;
      const auto key = std::make_pair(t, n.stage);
      auto it = received.find(key);
      if (it == received.end()) {
        TensorInfo copy = ti;
        copy.name = ti.name + "@stage" + std::to_string(n.stage);
        const int local = out.add_tensor(copy);
        producer_stage.resize(out.tensors.size(), -1);
        Node send;
        send.op = "send";
        send.name = ti.name + ".send";
        send.in = {t};
        send.stage = ps;
        send.layer = n.layer;
        send.attrs = {{"peer", n.stage}, {"edge", edge}};
        Node recv;
        recv.op = "recv";
        recv.name = ti.name + ".recv";
        recv.out = {local};
        recv.stage = n.stage;
        recv.layer = n.layer;
        recv.attrs = {{"peer", ps}, {"edge", edge}};
        ++edge;
        out.add_node(send);
        out.add_node(recv);
        producer_stage[static_cast<std::size_t>(local)] = n.stage;
        it = received.emplace(key, local).first;
      }
      t = it->second;
    }
    for (int t : n.out) producer_stage[static_cast<std::size_t>(t)] = n.stage;
    out.add_node(std::move(n));
  }
  for (const auto& [t, st] : param_stages)
    if (st.size() > 1) out.tensors[static_cast<std::size_t>(t)].tied = true;
  // Keep every stage's nodes together, in their original order (sends right after producers).
  std::stable_sort(out.nodes.begin(), out.nodes.end(),
                   [](const Node& a, const Node& b) { return a.stage < b.stage; });
  return out;
}

Graph stage_graph(const Graph& g, int stage) {
  Graph out;
  out.layers = g.layers;
  std::map<int, int> remap;
  auto local = [&](int t) {
    auto it = remap.find(t);
    if (it != remap.end()) return it->second;
    const int id = out.add_tensor(g.tensors[static_cast<std::size_t>(t)]);
    remap.emplace(t, id);
    return id;
  };
  // Parameters first, in the graph's order (nanoGPT order), so a stage's flat parameter buffer
  // follows the global naming order.
  std::set<int> used;
  for (const Node& n : g.nodes)
    if (n.stage == stage)
      for (int t : n.in) used.insert(t);
  for (std::size_t t = 0; t < g.tensors.size(); ++t)
    if (g.tensors[t].role == Role::param && used.count(static_cast<int>(t)))
      local(static_cast<int>(t));
  for (const Node& n : g.nodes) {
    if (n.stage != stage) continue;
    Node m = n;
    for (int& t : m.in) t = local(t);
    for (int& t : m.out) t = local(t);
    out.add_node(std::move(m));
  }
  return out;
}

std::vector<ShardRun> shard_runs(const TensorInfo& t, int part) {
  // The sharded dimension d of extent D holds `blocks` segments, each cut into `parts` pieces;
  // the shard takes piece `part` of every segment.
  const Shape& gs = t.global_shape.empty() ? t.shape : t.global_shape;
  if (t.sharding.kind == Sharding::Kind::replicated) return {{0, 0, shape_numel(gs), 0, 1}};
  const int d = t.sharding.dim, parts = t.sharding.parts, blocks = t.sharding.blocks;
  DT_ASSERT(d >= 0 && static_cast<std::size_t>(d) < gs.size() && part >= 0 && part < parts);
  std::size_t outer = 1, inner = 1;
  for (int k = 0; k < d; ++k) outer *= static_cast<std::size_t>(gs[static_cast<std::size_t>(k)]);
  for (std::size_t k = static_cast<std::size_t>(d) + 1; k < gs.size(); ++k)
    inner *= static_cast<std::size_t>(gs[k]);
  const std::size_t D = static_cast<std::size_t>(gs[static_cast<std::size_t>(d)]);
  const std::size_t B = static_cast<std::size_t>(blocks), P = static_cast<std::size_t>(part);
  DT_ASSERT(D % (B * static_cast<std::size_t>(parts)) == 0);
  const std::size_t seg = D / (B * static_cast<std::size_t>(parts)), len = seg * inner;
  if (B == 1) return {{0, P * len, len, D * inner, outer}};  // one strided run
  std::vector<ShardRun> runs;  // q|k|v: one run per segment and outer index
  for (std::size_t o = 0; o < outer; ++o)
    for (std::size_t b = 0; b < B; ++b)
      runs.push_back({(o * B + b) * len, (o * D + b * (D / B)) * inner + P * len, len, 0, 1});
  return runs;
}

namespace {
// Copies between a global tensor and one shard, run by run.
void shard_copy(const TensorInfo& t, int part, float* global, float* local, bool to_local) {
  for (const ShardRun& r : shard_runs(t, part))
    for (std::size_t j = 0; j < r.count; ++j) {
      float* g = global + r.begin + j * r.stride;
      float* l = local + r.local + j * r.len;
      if (to_local)
        std::memcpy(l, g, r.len * sizeof(float));
      else
        std::memcpy(g, l, r.len * sizeof(float));
    }
}
}  // namespace

void take_shard(const TensorInfo& t, int part, const float* global, float* local) {
  // to_local: `global` is only read.
  shard_copy(t, part, const_cast<float*>(global), local, true);
}

void put_shard(const TensorInfo& t, int part, const float* local, float* global) {
  // !to_local: `local` is only read.
  shard_copy(t, part, global, const_cast<float*>(local), false);
}

}  // namespace dt::graph
