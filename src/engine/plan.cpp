#include "engine/plan.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "engine/pipeline.hpp"
#include "engine/zero.hpp"

namespace dt {

int Plan::in_flight(int stage) const {
  return std::max(1, std::min(layout.pp - stage, microbatches));
}

std::string format_bytes(double b) {
  char buf[32];
  if (b >= 1024.0 * 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024)
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  else
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  return buf;
}

namespace {
double worst(const Plan& p, int* stage = nullptr) {
  double w = -1;
  for (std::size_t s = 0; s < p.memory.size(); ++s)
    if (p.memory[s].total() > w) {
      w = p.memory[s].total();
      if (stage) *stage = static_cast<int>(s);
    }
  return w;
}

// --eval-only: the request with a batch that divides over l.dp (rounded up), and the micro-batch
// settings kept only where they divide the share.
PlanRequest for_evaluation(PlanRequest r, const Layout& l) {
  if (!r.evaluation_only || l.dp < 1) return r;
  const std::int64_t share = (r.batch + l.dp - 1) / l.dp;
  r.batch = share * l.dp;
  if (r.micro_batch > 0 && share % r.micro_batch != 0) r.micro_batch = 0;
  if (r.microbatches > 0 && share % r.microbatches != 0) r.microbatches = 0;
  if (r.micro_batch > 0 && r.microbatches > 0 && share / r.microbatches != r.micro_batch)
    r.microbatches = 0;
  return r;
}

Plan build(const PlanRequest& request, Layout l) {
  const PlanRequest r = for_evaluation(request, l);
  Plan p;
  check_layout(l, r.world, r.model, r.batch);
  p.layout = l;
  p.local_batch = r.batch / l.dp;
  const std::string share = std::to_string(p.local_batch) + " sequences of each of " +
                            std::to_string(l.dp) + " ranks (data-parallel degree)";
  if (r.microbatches > 0) {
    DT_CHECK(ConfigError, p.local_batch % r.microbatches == 0,
             "option --parallel.microbatches: ", r.microbatches,
             r.microbatches > p.local_batch ? " is more than the " : " does not divide the ",
             share);
    p.micro = p.local_batch / r.microbatches;
    DT_CHECK(ConfigError, r.micro_batch == 0 || r.micro_batch == p.micro,
             "options --parallel.microbatches=", r.microbatches,
             " and --train.micro-batch=", r.micro_batch, " disagree: ", r.microbatches,
             " micro-batches of the ", share, " have ", p.micro, " sequences each");
  } else if (r.micro_batch > 0) {
    DT_CHECK(ConfigError, p.local_batch % r.micro_batch == 0,
             "option --train.micro-batch: ", r.micro_batch,
             r.micro_batch > p.local_batch ? " is more than the " : " does not divide the ", share);
    p.micro = r.micro_batch;
  } else if (l.pp > 1) {
    // Enough micro-batches to keep the bubble (p-1)/(m+p-1) small, not so many that they get tiny.
    std::int64_t m = 1;
    for (std::int64_t k = 1; k <= std::min<std::int64_t>(p.local_batch, 4 * l.pp); ++k)
      if (p.local_batch % k == 0) m = k;
    p.micro = p.local_batch / m;
  } else {
    p.micro = p.local_batch;
  }
  p.microbatches = static_cast<int>(p.local_batch / p.micro);
  const graph::Graph g =
      graph::tp_rewrite(graph::build_gpt(r.model, static_cast<int>(p.micro), r.model.block), l.tp);
  p.first_layer = graph::partition(graph::layer_costs(g), l.pp);
  p.full = graph::pipeline_split(g, p.first_layer);
  const bool fused = l.tp == 1 && l.pp == 1 && !r.graph_engine;  // dt::Gpt, else the stage engine
  for (int s = 0; s < l.pp; ++s) {
    const graph::Graph sg = p.stage(s);
    graph::MemoryEstimate m = graph::estimate_memory(sg, p.in_flight(s));
    if (fused) {  // dt::Gpt's own buffers, as it allocates them (and its token buffer)
      const auto [acts, gacts] =
          Gpt::activation_floats(r.model, static_cast<int>(p.micro), r.model.flash_attention);
      m.activations = 4.0 * static_cast<double>(acts + gacts) +
                      8.0 * static_cast<double>(p.micro) * static_cast<double>(r.model.block);
    } else {  // the stage engine's, as it lays them out (attention as the graph asks)
      m.activations = static_cast<double>(StageEngine::layout_of(sg, [](const graph::Node& n) {
                                            return n.attr_or("flash", 0) != 0;
                                          }).bytes(p.in_flight(s)));
    }
    if (r.zero > 0) {  // the stage's state sharded layer by layer over the dp ranks
      const std::vector<ParamInfo> table =
          fused ? gpt_params(r.model) : StageEngine::param_table(sg);
      const std::vector<ZeroUnit> units = zero_units(
          r.zero, fused ? gpt_units(r.model) : layer_units(table), table, r.bucket_bytes);
      const ZeroMemory z =
          zero_memory(r.zero, table, units, l.dp, embedding_unit(units, table), r.low_precision);
      m.params = static_cast<double>(z.params);
      m.grads = static_cast<double>(z.grads);
      m.optim = static_cast<double>(z.optimizer);
    } else {
      const double p32 = m.params;  // 4 bytes per parameter
      if (r.low_precision) {
        m.optim += p32;       // the fp32 master copy next to the rounded working weights
        m.params += p32 / 2;  // and the working weights' 16-bit copy the products read
      }
      if (r.grad_wire16 && l.dp > 1)
        m.grads += p32 / 2;  // the bf16 copy of the gradients the all_reduce carries
    }
    if (r.low_precision) {  // the two 16-bit operand buffers of the matrix products
      m.activations += 2.0 * 2.0 * static_cast<double>(graph::gemm_operand_elements(sg));
      // and the fused model's fp32 scratch for the widest input it rounds (Gpt::set_compute)
      if (fused)
        m.activations += 4.0 * 4.0 * static_cast<double>(p.micro) *
                         static_cast<double>(r.model.block) * static_cast<double>(r.model.embd);
    }
    // model.pad-vocab on the stage with the head: its padded weights (in the compute type) and
    // bias (PaddedHead; the graph's logits are padded).
    const double V = static_cast<double>(r.model.vocab),
                 Vp = static_cast<double>(padded_vocab(r.model));
    const bool has_head = std::any_of(sg.nodes.begin(), sg.nodes.end(),
                                      [](const graph::Node& n) { return n.op == "lm_head"; });
    if (has_head && Vp > V)
      m.activations += Vp * r.model.embd * (r.low_precision ? 2.0 : 4.0) + 4.0 * Vp;
    p.memory.push_back(m);
  }
  return p;
}

int worst_stage(const Plan& p) {
  int s = 0;
  worst(p, &s);
  return s;
}

std::string memory_text(const Plan& p, int stage) {
  const graph::MemoryEstimate& m = p.memory[static_cast<std::size_t>(stage)];
  return format_bytes(m.total()) + " (parameters " + format_bytes(m.params) + ", gradients " +
         format_bytes(m.grads) + ", optimizer state " + format_bytes(m.optim) +
         ", activations of " + std::to_string(p.in_flight(stage)) + " micro-batches " +
         format_bytes(m.activations) + ")";
}
}  // namespace

Plan make_plan(const PlanRequest& r) {
  if (!r.automatic) {
    Layout l = r.layout;
    if (l.dp == 0) {
      DT_CHECK(ConfigError, l.tp >= 1 && l.pp >= 1 && r.world % (l.tp * l.pp) == 0,
               "options --parallel.tp=", l.tp, " and --parallel.pp=", l.pp,
               ": tp x pp = ", l.tp * l.pp, " does not divide the ", r.world, " ranks of the job");
      l.dp = r.world / (l.tp * l.pp);
    }
    Plan p = build(r, l);
    int s = 0;
    const double w = worst(p, &s);
    DT_CHECK(ConfigError, r.mem_limit <= 0 || w <= r.mem_limit, "parallel layout ", l.str(),
             " needs an estimated ", memory_text(p, s), " per rank on pipeline stage ", s,
             ", over --mem.limit=", format_bytes(r.mem_limit),
             ": raise --parallel.tp or --parallel.pp, lower --train.micro-batch, or try "
             "--parallel.auto=true");
    return p;
  }
  std::vector<Plan> fits;
  Plan smallest;
  double smallest_w = -1;
  for (int tp = 1; tp <= r.model.heads; ++tp) {
    if (r.model.heads % tp || tp > r.ranks_per_node || r.ranks_per_node % tp) continue;
    for (int pp = 1; pp <= r.model.layers; ++pp) {
      if (r.world % (tp * pp)) continue;
      Plan p;
      try {
        p = build(r, Layout{r.world / (tp * pp), tp, pp});
      } catch (const ConfigError&) {
        continue;  // this layout does not suit the batch or micro-batch settings
      }
      const double w = worst(p);
      if (smallest_w < 0 || w < smallest_w) {
        smallest_w = w;
        smallest = p;
      }
      if (r.mem_limit <= 0 || w <= r.mem_limit) fits.push_back(std::move(p));
    }
  }
  DT_CHECK(ConfigError, smallest_w >= 0, "option --parallel.auto: no layout of ", r.world,
           " ranks suits the model (", r.model.heads, " heads, ", r.model.layers,
           " layers), --train.batch=", r.batch, " and the micro-batch settings, with ",
           r.ranks_per_node, " ranks per node for tensor parallelism");
  DT_CHECK(ConfigError, !fits.empty(),
           "option --parallel.auto: no layout fits --mem.limit=", format_bytes(r.mem_limit),
           "; the smallest, ", smallest.layout.str(), ", needs ",
           memory_text(smallest, worst_stage(smallest)), " per rank");
  // Most data parallelism first (least communication per step), then tensor parallelism inside a
  // node before pipeline stages (no bubble).
  std::stable_sort(fits.begin(), fits.end(), [](const Plan& a, const Plan& b) {
    if (a.layout.dp != b.layout.dp) return a.layout.dp > b.layout.dp;
    return a.layout.tp > b.layout.tp;
  });
  Plan p = std::move(fits.front());
  int s = 0;
  worst(p, &s);
  p.why = "parallel.auto: " + p.layout.str() + ": " + memory_text(p, s) + " per rank" +
          (r.mem_limit > 0 ? " fits --mem.limit=" + format_bytes(r.mem_limit) : "") +
          (p.layout.dp == r.world
               ? "; plain data parallelism, the least communication"
               : "; the most data parallelism that fits, tensor parallelism inside a node of " +
                     std::to_string(r.ranks_per_node) + " ranks before pipeline stages");
  return p;
}

}  // namespace dt
