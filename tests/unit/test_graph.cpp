// The graph IR and its passes (shape inference, cost model, tensor-parallel rewrite, pipeline
// partition and split, shards), the 1F1B schedule, topology-aware placement and the plan, each
// checked against figures derived here by hand or by brute force, not read back from the code.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "dt/device.hpp"
#include "dt/error.hpp"
#include "dt/gpt.hpp"
#include "dt/graph.hpp"
#include "dt/mesh.hpp"
#include "engine/pipeline.hpp"
#include "engine/plan.hpp"

namespace g = dt::graph;
using dt::Shape;

namespace {

dt::GptConfig tiny(int layers = 4, int heads = 4, int embd = 32) {
  dt::GptConfig c;
  c.vocab = 64;
  c.block = 8;
  c.layers = layers;
  c.heads = heads;
  c.embd = embd;
  return c;
}

// Runs f, which must throw E; returns the message (empty, and the check fails, otherwise).
template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL_CHECK("threw another type: " << e.what());
    return {};
  }
  FAIL_CHECK("did not throw");
  return {};
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

const g::Node& node(const g::Graph& gr, const std::string& name) {
  for (const g::Node& n : gr.nodes)
    if (n.name == name) return n;
  FAIL("no node " << name);
  return gr.nodes.front();
}

const g::TensorInfo& tensor(const g::Graph& gr, const std::string& name) {
  return gr.tensors[static_cast<std::size_t>(gr.tensor(name))];
}

// Nodes reading tensor t.
std::vector<const g::Node*> readers(const g::Graph& gr, int t) {
  std::vector<const g::Node*> r;
  for (const g::Node& n : gr.nodes)
    if (std::find(n.in.begin(), n.in.end(), t) != n.in.end()) r.push_back(&n);
  return r;
}

const g::Node* producer(const g::Graph& gr, int t) {
  for (const g::Node& n : gr.nodes)
    if (std::find(n.out.begin(), n.out.end(), t) != n.out.end()) return &n;
  return nullptr;
}

std::string lname(int l, const std::string& rest) {
  return "transformer.h." + std::to_string(l) + "." + rest;
}

g::Sharding split(int dim, int parts) {
  g::Sharding s;
  s.kind = g::Sharding::Kind::split;
  s.dim = dim;
  s.parts = parts;
  return s;
}

g::Sharding block(int dim, int blocks, int parts) {
  g::Sharding s;
  s.kind = g::Sharding::Kind::block;
  s.dim = dim;
  s.blocks = blocks;
  s.parts = parts;
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// build_gpt, infer_shapes

TEST_CASE(
    "graph build_gpt: node and tensor counts, activation shapes, parameters in gpt_params order") {
  const dt::GptConfig c = tiny(3, 4, 32);
  const std::int64_t B = 2, T = 6, C = 32, V = 64;
  const g::Graph gr = g::build_gpt(c, static_cast<int>(B), static_cast<int>(T));
  CHECK(gr.layers == 3);
  // Per layer: 2 layernorms, 4 linears, attention, gelu, 2 adds = 10 nodes; plus embedding,
  // ln_f, lm_head, xent.
  CHECK(gr.nodes.size() == 3u * 10 + 4);
  CHECK(gr.count("linear") == 4 * 3);
  CHECK(gr.count("layernorm") == 2 * 3 + 1);
  CHECK(gr.count("attention") == 3);
  CHECK(gr.count("gelu") == 3);
  CHECK(gr.count("add") == 2 * 3);
  CHECK(gr.count("embedding") == 1);
  CHECK(gr.count("lm_head") == 1);
  CHECK(gr.count("xent") == 1);
  CHECK(gr.count("tp_copy") == 0);
  CHECK(gr.count("send") == 0);
  // Every node has exactly one output, so the tensors are the parameters, two inputs (tokens,
  // targets) and one per node.
  const auto params = dt::gpt_params(c);
  CHECK(gr.tensors.size() == params.size() + 2 + gr.nodes.size());

  // Parameters: the first tensors, in gpt_params() order, same shapes, global shape = shape,
  // replicated, not tied.
  REQUIRE(gr.tensors.size() >= params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const g::TensorInfo& t = gr.tensors[i];
    INFO(params[i].name);
    CHECK(t.name == params[i].name);
    CHECK(t.role == g::Role::param);
    CHECK(t.shape == params[i].shape);
    CHECK(t.global_shape == params[i].shape);
    CHECK(t.sharding == g::Sharding{});
    CHECK_FALSE(t.tied);
  }
  int nparam = 0;
  for (const auto& t : gr.tensors) nparam += t.role == g::Role::param;
  CHECK(nparam == static_cast<int>(params.size()));

  CHECK(tensor(gr, "tokens").shape == Shape{B, T});
  CHECK(tensor(gr, "tokens").dtype == dt::DType::i32);
  CHECK(tensor(gr, "tokens").role == g::Role::input);
  CHECK(tensor(gr, "targets").shape == Shape{B, T});
  CHECK(tensor(gr, "wte+wpe").shape == Shape{B, T, C});
  for (int l = 0; l < 3; ++l) {
    const std::string a = "h." + std::to_string(l) + ".";
    INFO("layer " << l);
    CHECK(tensor(gr, a + "ln_1").shape == Shape{B, T, C});
    CHECK(tensor(gr, a + "qkv").shape == Shape{B, T, 3 * C});
    CHECK(tensor(gr, a + "attn").shape == Shape{B, T, C});
    CHECK(tensor(gr, a + "attn.proj").shape == Shape{B, T, C});
    CHECK(tensor(gr, a + "res2").shape == Shape{B, T, C});
    CHECK(tensor(gr, a + "mlp.fc").shape == Shape{B, T, 4 * C});
    CHECK(tensor(gr, a + "mlp.gelu").shape == Shape{B, T, 4 * C});
    CHECK(tensor(gr, a + "mlp.proj").shape == Shape{B, T, C});
    CHECK(tensor(gr, a + "res3").shape == Shape{B, T, C});
    CHECK(node(gr, lname(l, "attn")).attr("heads") == 4);
    int in_layer = 0;
    for (const auto& n : gr.nodes) in_layer += n.layer == l;
    CHECK(in_layer == 10);
  }
  CHECK(tensor(gr, "ln_f").shape == Shape{B, T, C});
  CHECK(tensor(gr, "logits").shape == Shape{B, T, V});
  CHECK(tensor(gr, "loss").shape == Shape{});
  CHECK(tensor(gr, "loss").role == g::Role::output);
  // The head reads the token embedding (tied), and is unit `layers`.
  const g::Node& head = node(gr, "lm_head");
  CHECK(head.in[1] == gr.tensor("transformer.wte.weight"));
  CHECK(head.layer == 3);
  CHECK(node(gr, "transformer.wte+wpe").layer == -1);
  // Topological order: every input is a parameter/input or produced by an earlier node.
  std::set<int> ready;
  for (std::size_t i = 0; i < gr.tensors.size(); ++i)
    if (gr.tensors[i].role == g::Role::param || gr.tensors[i].role == g::Role::input)
      ready.insert(static_cast<int>(i));
  for (const auto& n : gr.nodes) {
    for (int t : n.in) CHECK_MESSAGE(ready.count(t), n.name << " reads " << t << " early");
    for (int t : n.out) ready.insert(t);
  }
  // T above the block size and a width the heads do not divide are refused.
  CHECK_THROWS_AS(g::build_gpt(c, 1, c.block + 1), dt::InvalidArgument);
  dt::GptConfig odd = c;
  odd.embd = 30;
  CHECK_THROWS_AS(g::build_gpt(odd, 1, 4), dt::InvalidArgument);
  dt::GptConfig headless = c;  // refused, not a division by zero
  headless.heads = 0;
  CHECK_THROWS_WITH_AS(g::build_gpt(headless, 1, 4),
                       doctest::Contains("model.heads 0 must be at least 1"), dt::InvalidArgument);
}

TEST_CASE("graph infer_shapes: a wrong weight shape is refused, naming the node and the tensor") {
  const dt::GptConfig c = tiny(2, 4, 32);
  const g::Graph gr = g::build_gpt(c, 2, 4);
  // The graph as built is consistent: inference from scratch gives the same shapes.
  {
    g::Graph blank = gr;
    for (auto& t : blank.tensors)
      if (t.role == g::Role::activation || t.role == g::Role::output) t.shape = {7, 7};
    const g::Graph again = g::infer_shapes(blank);
    for (std::size_t i = 0; i < gr.tensors.size(); ++i)
      CHECK_MESSAGE(again.tensors[i].shape == gr.tensors[i].shape, gr.tensors[i].name);
  }
  {
    g::Graph bad = gr;
    bad.tensors[static_cast<std::size_t>(bad.tensor(lname(1, "mlp.c_fc.weight")))].shape = {128,
                                                                                            33};
    const std::string m = error_of<dt::InvalidArgument>([&] { g::infer_shapes(bad); });
    INFO(m);
    CHECK(has(m, "transformer.h.1.mlp.c_fc"));
    CHECK(has(m, "transformer.h.1.mlp.c_fc.weight"));
  }
  {
    g::Graph bad = gr;
    bad.tensors[static_cast<std::size_t>(bad.tensor(lname(0, "ln_2.weight")))].shape = {31};
    const std::string m = error_of<dt::InvalidArgument>([&] { g::infer_shapes(bad); });
    INFO(m);
    CHECK(has(m, "transformer.h.0.ln_2"));
    CHECK(has(m, "transformer.h.0.ln_2.weight"));
  }
  {
    g::Graph bad = gr;
    bad.tensors[static_cast<std::size_t>(bad.tensor(lname(0, "attn.c_proj.bias")))].shape = {64};
    const std::string m = error_of<dt::InvalidArgument>([&] { g::infer_shapes(bad); });
    INFO(m);
    CHECK(has(m, "transformer.h.0.attn.c_proj"));
    CHECK(has(m, "transformer.h.0.attn.c_proj.bias"));
  }
  {
    g::Graph bad = gr;  // the head's (tied) weight of the wrong width
    bad.tensors[static_cast<std::size_t>(bad.tensor("transformer.wte.weight"))].shape = {64, 16};
    CHECK_THROWS_AS(g::infer_shapes(bad), dt::InvalidArgument);
  }
}

// ---------------------------------------------------------------------------------------------
// costs, layer_costs

TEST_CASE("graph costs: attention keeps B NH T T probabilities, or B NH T with flash") {
  dt::GptConfig c = tiny(2, 4, 32);
  const double B = 3, T = 5, NH = c.heads;
  for (const bool flash : {false, true}) {
    c.flash_attention = flash;
    const g::Graph gr = g::build_gpt(c, 3, 5);
    const auto cost = g::costs(gr);
    int seen = 0;
    for (std::size_t i = 0; i < gr.nodes.size(); ++i) {
      if (gr.nodes[i].op != "attention") continue;
      ++seen;
      CHECK(gr.nodes[i].attr("flash") == (flash ? 1 : 0));
      // Its output activation (B T C floats) and its state.
      CHECK(cost[i].act_bytes == 4 * (B * T * 32 + B * NH * T * (flash ? 1 : T)));
    }
    CHECK(seen == 2);
  }
}

TEST_CASE("graph costs: linear FLOPs 2*B*T*in*out forward, 4x backward; layer costs add up") {
  const dt::GptConfig c = tiny(4, 4, 32);
  const double B = 3, T = 5, C = 32, V = 64;
  const g::Graph gr = g::build_gpt(c, 3, 5);
  const auto cost = g::costs(gr);
  REQUIRE(cost.size() == gr.nodes.size());
  const std::map<std::string, std::pair<double, double>> io = {{"attn.c_attn", {C, 3 * C}},
                                                               {"attn.c_proj", {C, C}},
                                                               {"mlp.c_fc", {C, 4 * C}},
                                                               {"mlp.c_proj", {4 * C, C}}};
  int linears = 0;
  double param_bytes = 0, total_flops = 0;
  for (std::size_t i = 0; i < gr.nodes.size(); ++i) {
    const g::Node& n = gr.nodes[i];
    param_bytes += cost[i].param_bytes;
    total_flops += cost[i].fwd_flops + cost[i].bwd_flops;
    CHECK(cost[i].fwd_flops >= 0);
    if (n.op == "linear") {
      const std::string suffix = n.name.substr(n.name.find('.', n.name.find("h.") + 2) + 1);
      REQUIRE_MESSAGE(io.count(suffix), n.name);
      const double in = io.at(suffix).first, out = io.at(suffix).second;
      INFO(n.name);
      CHECK(cost[i].fwd_flops == 2 * B * T * in * out);
      CHECK(cost[i].bwd_flops == 4 * B * T * in * out);
      ++linears;
    }
    if (n.op == "lm_head") {
      CHECK(cost[i].fwd_flops == 2 * B * T * C * V);
      CHECK(cost[i].bwd_flops == 4 * B * T * C * V);
    }
    if (n.op == "add" || n.op == "gelu") CHECK(cost[i].param_bytes == 0);
  }
  CHECK(linears == 16);
  // Every parameter counted once (wte read by embedding and head): 4 bytes per element.
  std::size_t numel = 0;
  for (const auto& p : dt::gpt_params(c)) numel += p.numel;
  CHECK(param_bytes == 4.0 * static_cast<double>(numel));

  const auto unit = g::layer_costs(gr);
  REQUIRE(unit.size() == 4u);
  const double sum_units = std::accumulate(unit.begin(), unit.end(), 0.0);
  CHECK(sum_units == doctest::Approx(total_flops).epsilon(1e-12));
  // The middle layers are alike; unit 0 adds the embedding, the last unit adds the head.
  double emb = 0, head = 0;
  for (std::size_t i = 0; i < gr.nodes.size(); ++i) {
    const double f = cost[i].fwd_flops + cost[i].bwd_flops;
    if (gr.nodes[i].layer < 0) emb += f;
    if (gr.nodes[i].layer >= c.layers) head += f;
  }
  CHECK(head >= 6 * B * T * C * V);  // at least the head matmul
  CHECK(emb > 0);
  CHECK(unit[1] == unit[2]);
  CHECK(unit[0] == doctest::Approx(unit[1] + emb).epsilon(1e-12));
  CHECK(unit[3] == doctest::Approx(unit[1] + head).epsilon(1e-12));
  CHECK(unit[3] > unit[1]);
}

// ---------------------------------------------------------------------------------------------
// tp_rewrite

TEST_CASE("graph tp_rewrite: collectives, local shapes and shardings for tp = 2 and 4") {
  const dt::GptConfig c = tiny(2, 4, 32);
  const std::int64_t B = 2, T = 4, C = 32;
  const g::Graph base = g::build_gpt(c, static_cast<int>(B), static_cast<int>(T));
  for (const int tp : {2, 4}) {
    CAPTURE(tp);
    const g::Graph gr = g::tp_rewrite(base, tp);
    CHECK(gr.layers == c.layers);
    CHECK(gr.count("tp_copy") == 2 * c.layers);
    CHECK(gr.count("tp_reduce") == 2 * c.layers);
    CHECK(gr.nodes.size() == base.nodes.size() + 4u * static_cast<std::size_t>(c.layers));
    for (int l = 0; l < c.layers; ++l) {
      CAPTURE(l);
      int copies = 0, reduces = 0;
      for (const auto& n : gr.nodes) {
        copies += n.layer == l && n.op == "tp_copy";
        reduces += n.layer == l && n.op == "tp_reduce";
      }
      CHECK(copies == 2);
      CHECK(reduces == 2);
      for (const char* col : {"attn.c_attn", "mlp.c_fc"}) {
        const g::Node& lin = node(gr, lname(l, col));
        const g::Node* p = producer(gr, lin.in[0]);
        REQUIRE(p != nullptr);
        CHECK(p->op == "tp_copy");
        CHECK(p->layer == l);
        CHECK(lin.attr_or("bias_rank0", 0) == 0);
        // The copy reads the layernorm output the linear read before.
        const g::Node* ln = producer(gr, p->in[0]);
        REQUIRE(ln != nullptr);
        CHECK(ln->op == "layernorm");
      }
      for (const char* row : {"attn.c_proj", "mlp.c_proj"}) {
        const g::Node& lin = node(gr, lname(l, row));
        CHECK(lin.attr("bias_rank0") == 1);
        REQUIRE(lin.out.size() == 1u);
        const auto rd = readers(gr, lin.out[0]);
        REQUIRE(rd.size() == 1u);
        CHECK(rd[0]->op == "tp_reduce");
        // The reduce's output is what the residual add reads, with the full width.
        const auto after = readers(gr, rd[0]->out[0]);
        REQUIRE(after.size() == 1u);
        CHECK(after[0]->op == "add");
        CHECK(gr.tensors[static_cast<std::size_t>(rd[0]->out[0])].shape == Shape{B, T, C});
        CHECK(gr.tensors[static_cast<std::size_t>(lin.out[0])].shape == Shape{B, T, C});
      }
      CHECK(node(gr, lname(l, "attn")).attr("heads") == 4 / tp);

      auto p = [&](const std::string& rest) -> const g::TensorInfo& {
        return tensor(gr, lname(l, rest));
      };
      CHECK(p("attn.c_attn.weight").shape == Shape{3 * C / tp, C});
      CHECK(p("attn.c_attn.weight").global_shape == Shape{3 * C, C});
      CHECK(p("attn.c_attn.weight").sharding == block(0, 3, tp));
      CHECK(p("attn.c_attn.bias").shape == Shape{3 * C / tp});
      CHECK(p("attn.c_attn.bias").sharding == block(0, 3, tp));
      CHECK(p("attn.c_proj.weight").shape == Shape{C, C / tp});
      CHECK(p("attn.c_proj.weight").global_shape == Shape{C, C});
      CHECK(p("attn.c_proj.weight").sharding == split(1, tp));
      CHECK(p("attn.c_proj.bias").shape == Shape{C});
      CHECK(p("attn.c_proj.bias").sharding == g::Sharding{});
      CHECK(p("mlp.c_fc.weight").shape == Shape{4 * C / tp, C});
      CHECK(p("mlp.c_fc.weight").sharding == split(0, tp));
      CHECK(p("mlp.c_fc.bias").shape == Shape{4 * C / tp});
      CHECK(p("mlp.c_fc.bias").sharding == split(0, tp));
      CHECK(p("mlp.c_proj.weight").shape == Shape{C, 4 * C / tp});
      CHECK(p("mlp.c_proj.weight").global_shape == Shape{C, 4 * C});
      CHECK(p("mlp.c_proj.weight").sharding == split(1, tp));
      CHECK(p("mlp.c_proj.bias").sharding == g::Sharding{});
      for (const char* ln : {"ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias"}) {
        CHECK(p(ln).sharding == g::Sharding{});
        CHECK(p(ln).shape == Shape{C});
      }
      const std::string a = "h." + std::to_string(l) + ".";
      CHECK(tensor(gr, a + "qkv").shape == Shape{B, T, 3 * C / tp});
      CHECK(tensor(gr, a + "attn").shape == Shape{B, T, C / tp});
      CHECK(tensor(gr, a + "mlp.fc").shape == Shape{B, T, 4 * C / tp});
      CHECK(tensor(gr, a + "mlp.gelu").shape == Shape{B, T, 4 * C / tp});
      CHECK(tensor(gr, a + "res3").shape == Shape{B, T, C});
    }
    for (const char* name : {"transformer.wte.weight", "transformer.wpe.weight",
                             "transformer.ln_f.weight", "transformer.ln_f.bias"}) {
      CHECK(tensor(gr, name).sharding == g::Sharding{});
      CHECK(tensor(gr, name).shape == tensor(base, name).shape);
    }
    CHECK(tensor(gr, "logits").shape == tensor(base, "logits").shape);
    // Each rank does 1/tp of the linear FLOPs.
    const auto c1 = g::costs(base), ct = g::costs(gr);
    double f1 = 0, ft = 0;
    for (std::size_t i = 0; i < base.nodes.size(); ++i)
      if (base.nodes[i].op == "linear") f1 += c1[i].fwd_flops;
    for (std::size_t i = 0; i < gr.nodes.size(); ++i)
      if (gr.nodes[i].op == "linear") ft += ct[i].fwd_flops;
    CHECK(ft * tp == doctest::Approx(f1).epsilon(1e-12));
    // The rewritten graph is consistent under shape inference.
    CHECK_NOTHROW(g::infer_shapes(gr));
  }
  // tp = 1 changes nothing.
  const g::Graph same = g::tp_rewrite(base, 1);
  CHECK(same.nodes.size() == base.nodes.size());
  CHECK(same.count("tp_copy") == 0);
  // tp = 3 does not divide 4 heads.
  const std::string m = error_of<dt::ConfigError>([&] { g::tp_rewrite(base, 3); });
  INFO(m);
  CHECK(has(m, "--parallel.tp"));
  CHECK_THROWS_AS(g::tp_rewrite(base, 0), dt::ConfigError);
  // 8 heads allow tp = 8 with C = 32 (4 features per head).
  const g::Graph g8 = g::tp_rewrite(g::build_gpt(tiny(1, 8, 32), 1, 2), 8);
  CHECK(node(g8, lname(0, "attn")).attr("heads") == 1);
  CHECK(tensor(g8, lname(0, "attn.c_attn.weight")).shape == Shape{12, 32});
}

// ---------------------------------------------------------------------------------------------
// partition

namespace {
// The smallest largest-stage cost over every way to cut `cost` into `stages` non-empty groups.
double brute_force(const std::vector<double>& cost, int stages) {
  const int n = static_cast<int>(cost.size());
  double best = INFINITY;
  std::vector<int> first{0};
  std::function<void(int)> rec = [&](int from) {
    if (static_cast<int>(first.size()) == stages) {
      double worst = 0;
      for (std::size_t s = 0; s < first.size(); ++s) {
        const int end = s + 1 < first.size() ? first[s + 1] : n;
        double sum = 0;
        for (int i = first[s]; i < end; ++i) sum += cost[static_cast<std::size_t>(i)];
        worst = std::max(worst, sum);
      }
      best = std::min(best, worst);
      return;
    }
    for (int c = from; c < n; ++c) {
      first.push_back(c);
      rec(c + 1);
      first.pop_back();
    }
  };
  rec(1);
  return best;
}
}  // namespace

TEST_CASE("graph partition: equals brute force on random cost lists") {
  std::mt19937 rng(20261130);
  int cases = 0;
  for (int round = 0; round < 60; ++round)
    for (int n = 1; n <= 10; ++n) {
      // Small integers (exact sums) with many zeros and repeats; every third list all equal.
      std::vector<double> cost(static_cast<std::size_t>(n));
      const int top = round % 3 == 0 ? 0 : (round % 3 == 1 ? 3 : 50);
      std::uniform_int_distribution<int> d(0, top);
      const double same = static_cast<double>(round % 4);
      for (auto& x : cost) x = round % 3 == 0 ? same : static_cast<double>(d(rng));
      for (int stages = 1; stages <= n; ++stages) {
        CAPTURE(n);
        CAPTURE(stages);
        const std::vector<int> first = g::partition(cost, stages);
        REQUIRE(first.size() == static_cast<std::size_t>(stages));
        CHECK(first[0] == 0);
        for (int s = 1; s < stages; ++s) {
          CHECK(first[static_cast<std::size_t>(s)] > first[static_cast<std::size_t>(s) - 1]);
          CHECK(first[static_cast<std::size_t>(s)] < n);
        }
        // max_stage_cost computed here too, not trusted.
        double worst = 0;
        for (int s = 0; s < stages; ++s) {
          const int end = s + 1 < stages ? first[static_cast<std::size_t>(s) + 1] : n;
          double sum = 0;
          for (int i = first[static_cast<std::size_t>(s)]; i < end; ++i)
            sum += cost[static_cast<std::size_t>(i)];
          worst = std::max(worst, sum);
        }
        const double bf = brute_force(cost, stages);
        if (worst != bf) {
          std::string list;
          for (double x : cost) list += std::to_string(static_cast<int>(x)) + " ";
          FAIL_CHECK("costs [" << list << "] into " << stages << ": partition " << worst
                               << ", brute force " << bf);
        }
        CHECK(g::max_stage_cost(cost, first) == worst);
        ++cases;
      }
    }
  CHECK(cases == 60 * 55);
  // [1..9] into 3: 17 ({1..5}=15, {6,7}=13, {8,9}=17); 16 would leave {9} last and 36 for two.
  const std::vector<double> seq{1, 2, 3, 4, 5, 6, 7, 8, 9};
  CHECK(g::max_stage_cost(seq, g::partition(seq, 3)) == 17);
  CHECK(g::partition(std::vector<double>{5, 1, 1, 1, 1, 1}, 2) == std::vector<int>{0, 1});
  CHECK(g::partition(std::vector<double>{1, 1, 1, 1}, 2) == std::vector<int>{0, 2});
  CHECK(g::partition(std::vector<double>{1, 1, 1, 1}, 4) == std::vector<int>{0, 1, 2, 3});
  // Invalid stage counts and costs.
  CHECK_THROWS_AS(g::partition({1, 2, 3}, 0), dt::InvalidArgument);
  CHECK_THROWS_AS(g::partition({1, 2, 3}, 4), dt::InvalidArgument);
  CHECK_THROWS_AS(g::partition({1, 2, 3}, -1), dt::InvalidArgument);
  CHECK_THROWS_AS(g::partition({}, 1), dt::InvalidArgument);
  CHECK_THROWS_AS(g::partition({1, -2, 3}, 2), dt::InvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// pipeline_split, stage_graph

TEST_CASE("graph pipeline_split and stage_graph: send/recv pairs, tied wte, per-stage graphs") {
  const dt::GptConfig c = tiny(4, 4, 32);
  const g::Graph base = g::build_gpt(c, 2, 4);
  struct Case {
    int tp;
    std::vector<int> first;
  };
  const std::vector<Case> cases = {{1, {0}},
                                   {1, {0, 2}},
                                   {1, {0, 1}},
                                   {1, {0, 3}},
                                   {1, {0, 1, 3}},
                                   {1, {0, 2, 3}},
                                   {2, {0, 2}},
                                   {2, {0, 1, 2}},
                                   {1, {0, 1, 2, 3}},
                                   {1, g::partition(g::layer_costs(base), 2)},
                                   {1, g::partition(g::layer_costs(base), 3)}};
  for (const Case& k : cases) {
    const int pp = static_cast<int>(k.first.size());
    CAPTURE(k.tp);
    CAPTURE(pp);
    CAPTURE(k.first.back());
    const g::Graph in = g::tp_rewrite(base, k.tp);
    const g::Graph full = g::pipeline_split(in, k.first);
    CHECK(full.count("send") == pp - 1);
    CHECK(full.count("recv") == pp - 1);
    CHECK(full.nodes.size() == in.nodes.size() + 2u * static_cast<std::size_t>(pp - 1));
    // Stage of every model node: layers [first[s], first[s+1]) on s, embedding on 0, head last.
    auto stage_of = [&](int layer) {
      if (layer < 0) return 0;
      if (layer >= c.layers) return pp - 1;
      int s = 0;
      for (int i = 0; i < pp; ++i)
        if (k.first[static_cast<std::size_t>(i)] <= layer) s = i;
      return s;
    };
    std::set<std::int64_t> edges;
    int last_stage = 0;
    for (const g::Node& n : full.nodes) {
      CHECK(n.stage >= last_stage);  // stages kept together, in order
      last_stage = n.stage;
      if (n.op != "send" && n.op != "recv") {
        CHECK_MESSAGE(n.stage == stage_of(n.layer), n.name);
        continue;
      }
      if (n.op != "send") continue;
      edges.insert(n.attr("edge"));
      CHECK(n.out.empty());
      REQUIRE(n.in.size() == 1u);
      int recvs = 0;
      for (const g::Node& r : full.nodes) {
        if (r.op != "recv" || r.attr("edge") != n.attr("edge")) continue;
        ++recvs;
        CHECK(r.attr("peer") == n.stage);
        CHECK(n.attr("peer") == r.stage);
        CHECK(r.stage == n.stage + 1);  // the residual stream crosses each cut once
        REQUIRE(r.out.size() == 1u);
        CHECK(full.tensors[static_cast<std::size_t>(r.out[0])].shape ==
              full.tensors[static_cast<std::size_t>(n.in[0])].shape);
        // The received copy is read only on the receiving stage.
        for (const g::Node* rd : readers(full, r.out[0])) CHECK(rd->stage == r.stage);
      }
      CHECK(recvs == 1);
    }
    CHECK(edges.size() == static_cast<std::size_t>(pp - 1));
    // No model node reads a tensor produced on another stage.
    for (const g::Node& n : full.nodes)
      for (int t : n.in) {
        const g::Node* p = producer(full, t);
        if (p) CHECK_MESSAGE(p->stage == n.stage, n.name << " reads " << p->name);
      }
    // wte is tied exactly when embedding and head sit on different stages; nothing else is.
    for (const auto& t : full.tensors)
      if (t.name == "transformer.wte.weight")
        CHECK(t.tied == (pp > 1));
      else
        CHECK_FALSE(t.tied);

    std::size_t nodes = 0;
    for (int s = 0; s < pp; ++s) {
      CAPTURE(s);
      const g::Graph sg = g::stage_graph(full, s);
      nodes += sg.nodes.size();
      REQUIRE_FALSE(sg.nodes.empty());
      for (const g::Node& n : sg.nodes) {
        CHECK(n.stage == s);
        for (int t : n.in) CHECK((t >= 0 && t < static_cast<int>(sg.tensors.size())));
        for (int t : n.out) CHECK((t >= 0 && t < static_cast<int>(sg.tensors.size())));
      }
      CHECK(sg.count("send") == (s + 1 < pp ? 1 : 0));
      CHECK(sg.count("recv") == (s > 0 ? 1 : 0));
      CHECK(sg.count("embedding") == (s == 0 ? 1 : 0));
      CHECK(sg.count("xent") == (s == pp - 1 ? 1 : 0));
      const g::Graph inferred = g::infer_shapes(sg);
      for (std::size_t i = 0; i < sg.tensors.size(); ++i)
        CHECK_MESSAGE(inferred.tensors[i].shape == sg.tensors[i].shape, sg.tensors[i].name);
      // Parameters come first, in gpt_params order.
      std::vector<std::string> names;
      for (const auto& t : sg.tensors)
        if (t.role == g::Role::param) names.push_back(t.name);
      std::size_t k2 = 0;
      for (const auto& t : sg.tensors) {
        if (t.role != g::Role::param) break;
        ++k2;
      }
      CHECK(k2 == names.size());
      std::vector<std::string> order;
      for (const auto& p : dt::gpt_params(c))
        if (std::find(names.begin(), names.end(), p.name) != names.end()) order.push_back(p.name);
      CHECK(order == names);
    }
    CHECK(nodes == full.nodes.size());
  }
  CHECK_THROWS_AS(g::pipeline_split(base, {1, 2}), dt::InvalidArgument);
  CHECK_THROWS_AS(g::pipeline_split(base, {0, 2, 2}), dt::InvalidArgument);
  CHECK_THROWS_AS(g::pipeline_split(base, {0, 4}), dt::InvalidArgument);
  CHECK_THROWS_AS(g::pipeline_split(base, {}), dt::InvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// take_shard, put_shard

TEST_CASE("graph take_shard/put_shard: split dim 0, split dim 1, 3-block shards round-trip") {
  auto make = [](Shape global, g::Sharding s) {
    g::TensorInfo t;
    t.role = g::Role::param;
    t.global_shape = global;
    t.shape = global;
    t.shape[static_cast<std::size_t>(s.dim)] /= s.parts;
    t.sharding = s;
    return t;
  };
  auto iota = [](std::size_t n) {
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i) + 0.5f;
    return v;
  };
  auto round_trip = [&](const g::TensorInfo& t, const std::vector<float>& global) {
    const std::size_t nl = dt::shape_numel(t.shape);
    std::vector<float> back(global.size(), -1.0f);
    std::vector<std::vector<float>> shards;
    for (int p = 0; p < t.sharding.parts; ++p) {
      std::vector<float> local(nl, -2.0f);
      g::take_shard(t, p, global.data(), local.data());
      for (float x : local) CHECK(x >= 0);  // every element written
      g::put_shard(t, p, local.data(), back.data());
      shards.push_back(local);
    }
    CHECK(back == global);
    return shards;
  };

  SUBCASE("split dim 0: rows") {
    const auto t = make({6, 4}, split(0, 3));  // 3 parts of 2 rows
    const auto global = iota(24);
    const auto sh = round_trip(t, global);
    // part p, local (r, c) = global (2p + r, c)
    for (int p = 0; p < 3; ++p)
      for (int r = 0; r < 2; ++r)
        for (int c = 0; c < 4; ++c)
          CHECK(sh[p][static_cast<std::size_t>(r * 4 + c)] ==
                global[static_cast<std::size_t>((2 * p + r) * 4 + c)]);
    CHECK(sh[1][0] == 8.5f);
    CHECK(sh[2][7] == 23.5f);
  }
  SUBCASE("split dim 1: columns") {
    const auto t = make({3, 8}, split(1, 4));  // 4 parts of 2 columns
    const auto global = iota(24);
    const auto sh = round_trip(t, global);
    for (int p = 0; p < 4; ++p)
      for (int r = 0; r < 3; ++r)
        for (int c = 0; c < 2; ++c)
          CHECK(sh[p][static_cast<std::size_t>(r * 2 + c)] ==
                global[static_cast<std::size_t>(r * 8 + 2 * p + c)]);
    CHECK(sh[3][0] == 6.5f);   // global (0, 6)
    CHECK(sh[1][5] == 19.5f);  // local (2, 1) = global (2, 3)
  }
  SUBCASE("block: q|k|v segments, each cut in 2") {
    const auto t = make({12, 3}, block(0, 3, 2));  // segments of 4 rows, 2 rows per part each
    const auto global = iota(36);
    const auto sh = round_trip(t, global);
    for (int p = 0; p < 2; ++p)
      for (int b = 0; b < 3; ++b)
        for (int r = 0; r < 2; ++r)
          for (int c = 0; c < 3; ++c)
            CHECK(sh[p][static_cast<std::size_t>((b * 2 + r) * 3 + c)] ==
                  global[static_cast<std::size_t>((b * 4 + p * 2 + r) * 3 + c)]);
    // part 1 row 2 is the first row of part 1 in the k segment: global row 6
    CHECK(sh[1][6] == 18.5f);
    // a 1-D bias of 3 segments in 3 parts
    const auto bias = make({9}, block(0, 3, 3));
    const auto bg = iota(9);
    const auto bs = round_trip(bias, bg);
    CHECK(bs[2] == std::vector<float>{2.5f, 5.5f, 8.5f});
  }
  SUBCASE("shards of a tensor-parallel c_attn weight and c_proj weight") {
    const g::Graph gr = g::tp_rewrite(g::build_gpt(tiny(1, 4, 8), 1, 2), 2);
    const auto& w = tensor(gr, lname(0, "attn.c_attn.weight"));  // [24, 8] -> [12, 8]
    REQUIRE(w.shape == Shape{12, 8});
    const auto global = iota(24 * 8);
    const auto sh = round_trip(w, global);
    // tp rank 1 holds rows 4..7 (q), 12..15 (k), 20..23 (v)
    CHECK(sh[1][0] == global[4 * 8]);
    CHECK(sh[1][4 * 8] == global[12 * 8]);
    CHECK(sh[1][8 * 8 + 3] == global[20 * 8 + 3]);
    const auto& wp = tensor(gr, lname(0, "mlp.c_proj.weight"));  // [8, 32] -> [8, 16]
    REQUIRE(wp.shape == Shape{8, 16});
    const auto gp = iota(8 * 32);
    const auto sp = round_trip(wp, gp);
    CHECK(sp[1][0] == gp[16]);
    CHECK(sp[1][16 + 5] == gp[32 + 16 + 5]);
  }
  SUBCASE("replicated: the whole tensor") {
    g::TensorInfo t;
    t.shape = t.global_shape = {5};
    const auto global = iota(5);
    std::vector<float> local(5, -1.0f);
    g::take_shard(t, 0, global.data(), local.data());
    CHECK(local == global);
  }
}

// ---------------------------------------------------------------------------------------------
// 1F1B

TEST_CASE("1F1B schedule: every micro-batch once each way, warm-up, order and in-flight count") {
  using K = dt::PipeAction::Kind;
  for (int stages = 1; stages <= 5; ++stages)
    for (int stage = 0; stage < stages; ++stage)
      for (int micro = 1; micro <= 8; ++micro) {
        CAPTURE(stages);
        CAPTURE(stage);
        CAPTURE(micro);
        const auto a = dt::one_f_one_b(stage, stages, micro);
        REQUIRE(a.size() == 2u * static_cast<std::size_t>(micro));
        std::vector<int> fpos(static_cast<std::size_t>(micro), -1),
            bpos(static_cast<std::size_t>(micro), -1);
        int next_f = 0, next_b = 0, live = 0, most_live = 0;
        for (std::size_t i = 0; i < a.size(); ++i) {
          REQUIRE((a[i].micro >= 0 && a[i].micro < micro));
          auto& pos = (a[i].kind == K::forward ? fpos : bpos)[static_cast<std::size_t>(a[i].micro)];
          CHECK(pos == -1);  // once
          pos = static_cast<int>(i);
          if (a[i].kind == K::forward) {
            CHECK(a[i].micro == next_f++);
            most_live = std::max(most_live, ++live);
          } else {
            CHECK(a[i].micro == next_b++);
            --live;
          }
        }
        for (int m = 0; m < micro; ++m) {
          CHECK(fpos[static_cast<std::size_t>(m)] >= 0);
          CHECK(bpos[static_cast<std::size_t>(m)] > fpos[static_cast<std::size_t>(m)]);
        }
        // Warm-up: w = min(stages - stage - 1, micro) forwards; then (while forwards remain) the
        // steady state starts with one more forward, so w + 1 forwards precede the first backward.
        const int w = std::min(stages - stage - 1, micro);
        int leading = 0;
        while (a[static_cast<std::size_t>(leading)].kind == K::forward) ++leading;
        CHECK(leading == (w < micro ? w + 1 : micro));
        // Activations alive at once: what Plan::in_flight promises.
        CHECK(most_live == std::min(stages - stage, micro));
        // Steady state: after the warm-up, forwards and backwards alternate while forwards last.
        for (int i = 0; i < micro - w; ++i) {
          CHECK(a[static_cast<std::size_t>(w + 2 * i)].kind == K::forward);
          CHECK(a[static_cast<std::size_t>(w + 2 * i + 1)].kind == K::backward);
        }
      }
  CHECK_THROWS_AS(dt::one_f_one_b(2, 2, 4), dt::InvalidArgument);
  CHECK_THROWS_AS(dt::one_f_one_b(0, 2, 0), dt::InvalidArgument);
  CHECK_THROWS_AS(dt::one_f_one_b(-1, 2, 1), dt::InvalidArgument);
}

TEST_CASE("1F1B: a shorter step's schedule is a prefix, up to its end, of a longer one's") {
  // A step given up before forward k runs one_f_one_b(k) from where one_f_one_b(m) stood.
  using K = dt::PipeAction::Kind;
  for (int stages = 1; stages <= 5; ++stages)
    for (int stage = 0; stage < stages; ++stage)
      for (int m = 2; m <= 9; ++m)
        for (int k = 1; k < m; ++k) {
          CAPTURE(stages);
          CAPTURE(stage);
          CAPTURE(m);
          CAPTURE(k);
          const auto whole = dt::one_f_one_b(stage, stages, m),
                     cut = dt::one_f_one_b(stage, stages, k);
          std::size_t at = 0;  // forward k's place in the whole schedule
          while (!(whole[at].kind == K::forward && whole[at].micro == k)) ++at;
          REQUIRE(at <= cut.size());
          for (std::size_t i = 0; i < at; ++i) {
            CHECK(cut[i].kind == whole[i].kind);
            CHECK(cut[i].micro == whole[i].micro);
          }
          for (std::size_t i = at; i < cut.size(); ++i) CHECK(cut[i].kind == K::backward);
        }
}

namespace {
// Whether, in the 1F1B schedules of `stages` over m micro-batches, every stage's forward k (run
// after the vote taken just before it) has run before every stage starts forward k + lag, for
// every k: by the schedules' order alone (each stage in turn; a forward after the previous
// stage's, a backward after the next stage's), whatever the passes' times.
bool votes_taken_before_read(int stages, int m, int lag) {
  using K = dt::PipeAction::Kind;
  std::vector<std::vector<dt::PipeAction>> sched;
  for (int s = 0; s < stages; ++s) sched.push_back(dt::one_f_one_b(s, stages, m));
  auto place = [&](int s, K kind, int micro) {
    const auto& a = sched[static_cast<std::size_t>(s)];
    for (std::size_t i = 0; i < a.size(); ++i)
      if (a[i].kind == kind && a[i].micro == micro) return i;
    return a.size();
  };
  // before[s][i]: for each stage, how many of its actions must have finished before action i of
  // stage s can start (a prefix, so a count).
  const std::size_t n = 2 * static_cast<std::size_t>(m);
  std::vector<std::vector<std::vector<std::size_t>>> before(
      static_cast<std::size_t>(stages),
      std::vector<std::vector<std::size_t>>(n, std::vector<std::size_t>(sched.size(), 0)));
  // Actions in an order that respects the dependencies: the simulation's, run to completion.
  std::vector<std::size_t> next(sched.size(), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < stages; ++s) {
      const std::size_t us = static_cast<std::size_t>(s);
      while (next[us] < n) {
        const std::size_t i = next[us];
        const dt::PipeAction a = sched[us][i];
        const int peer = a.kind == K::forward ? s - 1 : s + 1;
        std::vector<std::size_t> need(sched.size(), 0);
        if (i > 0) {
          need = before[us][i - 1];
          need[us] = i;
        }
        if (peer >= 0 && peer < stages) {
          const std::size_t up = static_cast<std::size_t>(peer), j = place(peer, a.kind, a.micro);
          if (next[up] <= j) break;  // the peer's pass is not done yet
          for (std::size_t t = 0; t < need.size(); ++t)
            need[t] = std::max(need[t], before[up][j][t]);
          need[up] = std::max(need[up], j + 1);
        }
        before[us][i] = need;
        ++next[us];
        progress = true;
      }
    }
  }
  for (std::size_t s = 0; s < sched.size(); ++s) REQUIRE(next[s] == n);  // no deadlock
  for (int k = 1; k + lag < m; ++k)
    for (int s = 0; s < stages; ++s) {
      const auto& need = before[static_cast<std::size_t>(s)][place(s, K::forward, k + lag)];
      for (int t = 0; t < stages; ++t)  // stage t's forward k (its vote k is taken before it)
        if (need[static_cast<std::size_t>(t)] <= place(t, K::forward, k)) return false;
    }
  return true;
}
}  // namespace

TEST_CASE("1F1B: a vote taken before every forward is taken everywhere vote_lag forwards later") {
  CHECK(dt::vote_lag(1) == 0);
  for (int stages = 2; stages <= 6; ++stages)
    for (int m = stages + 2; m <= stages + 8; ++m) {
      CAPTURE(stages);
      CAPTURE(m);
      CHECK(votes_taken_before_read(stages, m, dt::vote_lag(stages)));
      // The fewest: with one less, some stage's read does not follow another stage's forward k.
      CHECK_FALSE(votes_taken_before_read(stages, m, dt::vote_lag(stages) - 1));
    }
}

TEST_CASE("1F1B simulation: makespan (m+p-1)(tf+tb), bubble (p-1)/(m+p-1)") {
  const double tf = 1, tb = 2;
  for (int p = 1; p <= 6; ++p)
    for (int m = 1; m <= 10; ++m) {
      CAPTURE(p);
      CAPTURE(m);
      const double t = dt::simulate_1f1b(p, m, tf, tb);
      CHECK(t == (m + p - 1) * (tf + tb));
      const double bubble = 1 - m * (tf + tb) / t;
      CHECK(bubble == doctest::Approx(static_cast<double>(p - 1) / (m + p - 1)).epsilon(1e-12));
    }
  // With equal forward and backward times the same law holds.
  CHECK(dt::simulate_1f1b(4, 8, 1, 1) == (8 + 4 - 1) * 2.0);
  CHECK_THROWS_AS(dt::simulate_1f1b(0, 4, 1, 1), dt::InvalidArgument);
  CHECK_THROWS_AS(dt::simulate_1f1b(-2, 4, 1, 1), dt::InvalidArgument);
  CHECK_THROWS_AS(dt::simulate_1f1b(2, 0, 1, 1), dt::InvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// placement, check_layout

namespace {
std::vector<dt::RankSite> sites_of(const std::vector<int>& node, const std::vector<int>& numa) {
  std::vector<dt::RankSite> s(node.size());
  std::map<int, int> seen;
  for (std::size_t r = 0; r < node.size(); ++r) {
    s[r].node = node[r];
    s[r].numa = numa.empty() ? 0 : numa[r];
    s[r].local_rank = seen[node[r]]++;
    s[r].host = "n" + std::to_string(node[r]);
  }
  return s;
}

// Every mesh coordinate is taken by exactly one rank.
void check_bijective(const dt::Layout& l, const std::vector<dt::MeshCoord>& c) {
  std::set<std::tuple<int, int, int>> seen;
  for (const auto& m : c) {
    CHECK((m.dp >= 0 && m.dp < l.dp && m.pp >= 0 && m.pp < l.pp && m.tp >= 0 && m.tp < l.tp));
    seen.insert({m.dp, m.pp, m.tp});
  }
  CHECK(seen.size() == c.size());
  CHECK(static_cast<int>(c.size()) == l.size());
}

// Set of nodes (or NUMA domains) of each TP group.
std::vector<std::set<std::pair<int, int>>> tp_groups(const dt::Layout& l,
                                                     const std::vector<dt::MeshCoord>& c,
                                                     const std::vector<dt::RankSite>& s,
                                                     bool numa) {
  std::map<std::pair<int, int>, std::set<std::pair<int, int>>> groups;
  for (std::size_t r = 0; r < c.size(); ++r)
    groups[{c[r].dp, c[r].pp}].insert({s[r].node, numa ? s[r].numa : 0});
  std::vector<std::set<std::pair<int, int>>> out;
  for (auto& kv : groups) out.push_back(kv.second);
  CHECK(static_cast<int>(out.size()) == l.dp * l.pp);
  return out;
}
}  // namespace

TEST_CASE("placement: TP groups inside a node and a NUMA domain; spans flagged") {
  {
    // 4 ranks given to 2 nodes cyclically: node = rank % 2.
    const auto s = sites_of({0, 1, 0, 1}, {});
    const dt::Layout l{2, 2, 1};
    const auto c = dt::place(l, s);
    check_bijective(l, c);
    for (const auto& grp : tp_groups(l, c, s, false)) CHECK(grp.size() == 1u);
    // Ranks 0 and 2 share node 0, so they form one TP group.
    CHECK(c[0].dp == c[2].dp);
    CHECK(c[1].dp == c[3].dp);
    CHECK(c[0].dp != c[1].dp);
    const std::string d = dt::describe_placement(l, c, s);
    INFO(d);
    CHECK_FALSE(has(d, "spans nodes"));
  }
  {
    // 8 ranks, 2 nodes given cyclically, 2 NUMA domains per node interleaved by local rank.
    std::vector<int> on_node, on_numa;
    for (int r = 0; r < 8; ++r) {
      on_node.push_back(r % 2);
      on_numa.push_back((r / 2) % 2);
    }
    const auto s = sites_of(on_node, on_numa);
    for (const dt::Layout l : {dt::Layout{4, 2, 1}, dt::Layout{2, 2, 2}, dt::Layout{1, 2, 4}}) {
      CAPTURE(l.str());
      const auto c = dt::place(l, s);
      check_bijective(l, c);
      for (const auto& grp : tp_groups(l, c, s, true)) CHECK(grp.size() == 1u);
    }
    // tp = 4 fills a node; pp = 2 then spans the two nodes, dp = 1.
    const dt::Layout l4{1, 4, 2};
    const auto c4 = dt::place(l4, s);
    check_bijective(l4, c4);
    for (const auto& grp : tp_groups(l4, c4, s, false)) CHECK(grp.size() == 1u);
    CHECK_FALSE(has(dt::describe_placement(l4, c4, s), "spans nodes"));
  }
  {
    // 2 ranks per node: tp = 4 must span nodes and says so; tp = 2 and tp = 1 never do.
    for (const auto& nodes : {std::vector<int>{0, 0, 1, 1}, std::vector<int>{0, 1, 0, 1}}) {
      const auto s = sites_of(nodes, {});
      const dt::Layout l4{1, 4, 1};
      const auto c4 = dt::place(l4, s);
      check_bijective(l4, c4);
      const std::string d4 = dt::describe_placement(l4, c4, s);
      INFO(d4);
      CHECK(has(d4, "spans nodes"));
      for (const dt::Layout l : {dt::Layout{2, 2, 1}, dt::Layout{1, 2, 2}, dt::Layout{4, 1, 1},
                                 dt::Layout{1, 1, 4}, dt::Layout{2, 1, 2}}) {
        const auto c = dt::place(l, s);
        check_bijective(l, c);
        const std::string d = dt::describe_placement(l, c, s);
        INFO(l.str() << "\n" << d);
        CHECK_FALSE(has(d, "spans nodes"));
        for (const auto& grp : tp_groups(l, c, s, false)) CHECK(grp.size() == 1u);
      }
    }
  }
  CHECK_THROWS_AS(dt::place(dt::Layout{2, 2, 1}, sites_of({0, 0, 1}, {})), dt::InvalidArgument);
}

TEST_CASE("placement of uneven nodes: a node that can hold a TP group gets one") {
  // Nodes of 1, 2 and 1 ranks (node = 0, 1, 1, 2), tp = 2, dp = 2. Node 1 has room for a whole
  // TP group, so at most one group needs to span nodes; describe_placement promises that a group
  // is flagged only when "the node sizes leave no other choice" (filling the sorted order
  // tp-fastest would give groups {0, 1} and {2, 3}, both across nodes).
  const auto s = sites_of({0, 1, 1, 2}, {});
  const dt::Layout l{2, 2, 1};
  const auto c = dt::place(l, s);
  check_bijective(l, c);
  int inside = 0;
  for (const auto& grp : tp_groups(l, c, s, false)) inside += grp.size() == 1u;
  CHECK(inside >= 1);
}

TEST_CASE("placement check_layout: errors are dt::ConfigError naming the options") {
  const dt::GptConfig c = tiny(4, 4, 32);
  CHECK_NOTHROW(dt::check_layout({2, 2, 2}, 8, c, 8));
  // A product past INT_MAX (the options' ranges allow it) is counted, not wrapped.
  CHECK(has(error_of<dt::ConfigError>([&] { dt::check_layout({1 << 20, 4, 1024}, 8, c, 8); }),
            "is a mesh of 4294967296 ranks, the job has 8"));
  {
    const std::string m = error_of<dt::ConfigError>([&] { dt::check_layout({2, 2, 1}, 8, c, 8); });
    INFO(m);
    CHECK(has(m, "--parallel.dp"));
    CHECK(has(m, "tp"));
    CHECK(has(m, "pp"));
  }
  {
    const std::string m = error_of<dt::ConfigError>([&] { dt::check_layout({1, 3, 1}, 3, c, 8); });
    INFO(m);
    CHECK(has(m, "--parallel.tp"));
    CHECK(has(m, "--model.heads"));
  }
  {
    const std::string m = error_of<dt::ConfigError>([&] { dt::check_layout({1, 1, 5}, 5, c, 8); });
    INFO(m);
    CHECK(has(m, "--parallel.pp"));
    CHECK(has(m, "--model.layers"));
  }
  {
    const std::string m = error_of<dt::ConfigError>([&] { dt::check_layout({3, 1, 1}, 3, c, 8); });
    INFO(m);
    CHECK(has(m, "--train.batch"));
    CHECK(has(m, "--parallel.dp"));
  }
  CHECK_THROWS_AS(dt::check_layout({0, 1, 1}, 0, c, 8), dt::ConfigError);
  CHECK_NOTHROW(dt::check_layout({1, 1, 4}, 4, c, 8));  // pp = layers is allowed
}

// ---------------------------------------------------------------------------------------------
// make_plan, estimate_memory

namespace {
dt::PlanRequest request(int world, dt::Layout l, std::int64_t batch) {
  dt::PlanRequest r;
  r.model = tiny(4, 4, 32);
  r.world = world;
  r.layout = l;
  r.batch = batch;
  r.ranks_per_node = world;
  return r;
}
double worst_total(const dt::Plan& p) {
  double w = 0;
  for (const auto& m : p.memory) w = std::max(w, m.total());
  return w;
}
}  // namespace

TEST_CASE("plan make_plan: micro-batches, stages and in-flight counts of explicit layouts") {
  {
    auto r = request(2, {2, 1, 1}, 8);
    r.microbatches = 2;
    const dt::Plan p = dt::make_plan(r);
    CHECK(p.local_batch == 4);
    CHECK(p.micro == 2);
    CHECK(p.microbatches == 2);
    CHECK(p.first_layer == std::vector<int>{0});
    CHECK(p.memory.size() == 1u);
    CHECK(p.in_flight(0) == 1);
  }
  {
    auto r = request(2, {2, 1, 1}, 8);
    r.micro_batch = 1;
    const dt::Plan p = dt::make_plan(r);
    CHECK(p.micro == 1);
    CHECK(p.microbatches == 4);
    r.microbatches = 4;  // agreeing settings
    CHECK(dt::make_plan(r).micro == 1);
    r.microbatches = 2;  // 2 micro-batches of 4 are 2 sequences, not 1
    const std::string m = error_of<dt::ConfigError>([&] { dt::make_plan(r); });
    INFO(m);
    CHECK(has(m, "--parallel.microbatches"));
    CHECK(has(m, "--train.micro-batch"));
  }
  {
    auto r = request(2, {2, 1, 1}, 8);
    r.microbatches = 3;
    CHECK(has(error_of<dt::ConfigError>([&] { dt::make_plan(r); }), "--parallel.microbatches"));
    r.microbatches = 0;
    r.micro_batch = 3;
    CHECK(has(error_of<dt::ConfigError>([&] { dt::make_plan(r); }), "--train.micro-batch"));
  }
  {
    // Defaults: one micro-batch without a pipeline; with one, the most micro-batches up to 4 pp
    // that divide the local batch.
    const dt::Plan p1 = dt::make_plan(request(1, {1, 1, 1}, 8));
    CHECK(p1.micro == 8);
    CHECK(p1.microbatches == 1);
    const dt::Plan p2 = dt::make_plan(request(2, {1, 1, 2}, 8));
    CHECK(p2.microbatches == 8);
    CHECK(p2.micro == 1);
    const dt::Plan p3 = dt::make_plan(request(2, {1, 1, 2}, 12));  // divisors of 12 up to 8: 6
    CHECK(p3.microbatches == 6);
    CHECK(p3.micro == 2);
    const dt::Plan p4 = dt::make_plan(request(4, {2, 1, 2}, 4));  // local batch 2
    CHECK(p4.microbatches == 2);
    CHECK(p4.micro == 1);
  }
  {
    // dp 0: the rest of the world.
    const dt::Plan p = dt::make_plan(request(8, {0, 2, 2}, 8));
    CHECK(p.layout.dp == 2);
    CHECK(p.layout.tp == 2);
    CHECK(p.layout.pp == 2);
    CHECK(p.local_batch == 4);
    CHECK(has(error_of<dt::ConfigError>([&] {
                dt::make_plan(request(6, {0, 4, 1}, 8));
              }),
              "--parallel.tp"));
  }
  // in_flight(s) = min(pp - s, m), and the stage graphs are those of the split graph.
  for (const int pp : {1, 2, 3, 4})
    for (const std::int64_t mb : {1, 2, 3, 6}) {
      CAPTURE(pp);
      CAPTURE(mb);
      auto r = request(pp, {1, 1, pp}, 6);
      r.microbatches = mb;
      r.model.flash_attention = mb != 2;  // attention's whole probabilities where mb is 2
      const dt::Plan p = dt::make_plan(r);
      CHECK(p.microbatches == mb);
      CHECK(p.micro == 6 / mb);
      REQUIRE(p.first_layer.size() == static_cast<std::size_t>(pp));
      REQUIRE(p.memory.size() == static_cast<std::size_t>(pp));
      CHECK(p.full.count("send") == pp - 1);
      for (int s = 0; s < pp; ++s) {
        CHECK(p.in_flight(s) == std::min<std::int64_t>(pp - s, mb));
        const g::MemoryEstimate want = g::estimate_memory(p.stage(s), p.in_flight(s));
        const g::MemoryEstimate& got = p.memory[static_cast<std::size_t>(s)];
        CHECK(got.params == want.params);
        CHECK(got.grads == want.grads);
        CHECK(got.optim == want.optim);
        // The activations are what the engine allocates, checked against one built on the CPU
        // device: the stage engine's buffers (pp > 1; its scratch and token buffers too), and
        // dt::Gpt's activation buffers and its token buffer (tp = pp = 1).
        if (pp > 1) {
          const dt::Device cpu = dt::Device::open("cpu", "");
          const dt::StageEngine engine(cpu, p.stage(s), r.model, s, pp,
                                       static_cast<int>(p.in_flight(s)), dt::StageComms{});
          CHECK(got.activations == static_cast<double>(engine.activation_bytes()));
        } else {
          const dt::Device cpu = dt::Device::open("cpu", "");
          const dt::Gpt model(cpu, r.model, static_cast<int>(p.micro));
          CHECK(got.activations == static_cast<double>(model.activation_bytes()) +
                                       8.0 * static_cast<double>(p.micro) * r.model.block);
          CHECK(got.activations < want.activations);  // the graph's figure overstated it
        }
      }
      CHECK(tensor(p.full, "h.0.qkv").shape == Shape{6 / mb, 8, 96});
    }
  CHECK_THROWS_AS(dt::make_plan(request(4, {2, 2, 2}, 8)), dt::ConfigError);  // 8 != 4 ranks
}

TEST_CASE("plan make_plan: mem.limit refuses an explicit layout and steers the automatic one") {
  {
    auto r = request(1, {1, 1, 1}, 4);
    const double need = worst_total(dt::make_plan(r));
    REQUIRE(need > 0);
    r.mem_limit = need * 1.01;
    CHECK_NOTHROW(dt::make_plan(r));
    r.mem_limit = need * 0.99;
    const std::string m = error_of<dt::ConfigError>([&] { dt::make_plan(r); });
    INFO(m);
    CHECK(has(m, "mem.limit"));
    CHECK(has(m, "dp=1 tp=1 pp=1"));
  }
  {
    // No limit: plain data parallelism.
    auto r = request(4, {0, 1, 1}, 8);
    r.automatic = true;
    const dt::Plan p = dt::make_plan(r);
    CHECK(p.layout.dp == 4);
    CHECK(p.layout.tp == 1);
    CHECK(p.layout.pp == 1);
    CHECK_FALSE(p.why.empty());
    CHECK(has(p.why, "dp=4"));
  }
  {
    // A model whose parameters dominate (wide, short sequences, one sequence per micro-batch):
    // the limit lies below the dp=4 layout's need, so a sharded layout must be chosen.
    dt::PlanRequest r;
    r.model.vocab = 512;
    r.model.block = 4;
    r.model.layers = 4;
    r.model.heads = 4;
    r.model.embd = 64;
    r.world = 4;
    r.ranks_per_node = 4;
    r.batch = 4;
    r.micro_batch = 1;
    // Every candidate layout, measured with explicit plans.
    std::vector<std::pair<dt::Layout, double>> cand;
    for (int tp : {1, 2, 4})
      for (int pp : {1, 2, 4}) {
        if (4 % (tp * pp)) continue;
        dt::PlanRequest e = r;
        e.layout = dt::Layout{4 / (tp * pp), tp, pp};
        cand.push_back({e.layout, worst_total(dt::make_plan(e))});
      }
    double plain = 0, least = INFINITY;
    for (const auto& [l, w] : cand) {
      if (l.dp == 4) plain = w;
      least = std::min(least, w);
    }
    REQUIRE(least < plain);
    r.mem_limit = (least + plain) / 2;
    // The expected pick: the most data parallelism among those that fit, then the most tp.
    dt::Layout want{0, 0, 0};
    for (const auto& [l, w] : cand)
      if (w <= r.mem_limit && (l.dp > want.dp || (l.dp == want.dp && l.tp > want.tp))) want = l;
    r.automatic = true;
    const dt::Plan p = dt::make_plan(r);
    INFO(p.why);
    CHECK(p.layout.dp < 4);
    CHECK(p.layout.str() == want.str());
    CHECK(worst_total(p) <= r.mem_limit);
    CHECK(has(p.why, p.layout.str()));
    CHECK(has(p.why, "mem.limit"));
    // A limit nothing meets.
    r.mem_limit = least * 0.5;
    CHECK(has(error_of<dt::ConfigError>([&] { dt::make_plan(r); }), "mem.limit"));
    // Tensor parallelism is kept inside a node: with 2 ranks per node tp = 4 is never chosen,
    // with 1 rank per node only tp = 1.
    for (const int per_node : {2, 1}) {
      CAPTURE(per_node);
      r.ranks_per_node = per_node;
      r.mem_limit = (least + plain) / 2;
      dt::Layout want_n{0, 0, 0};
      for (const auto& [l, w] : cand)
        if (w <= r.mem_limit && l.tp <= per_node &&
            (l.dp > want_n.dp || (l.dp == want_n.dp && l.tp > want_n.tp)))
          want_n = l;
      if (want_n.dp == 0)
        CHECK(has(error_of<dt::ConfigError>([&] { dt::make_plan(r); }), "mem.limit"));
      else
        CHECK(dt::make_plan(r).layout.str() == want_n.str());
    }
  }
}

TEST_CASE(
    "plan make_plan: with no layout under mem.limit, the message gives the smallest "
    "layout's need on its worst stage") {
  // A large vocabulary and long sequences put most memory on the last stage (the head's logits
  // and probabilities), so the worst stage of the pp = 2 layout is stage 1, not stage 0.
  dt::PlanRequest r;
  r.model.vocab = 2048;
  r.model.block = 64;
  r.model.layers = 2;
  r.model.heads = 2;
  r.model.embd = 8;
  r.world = 2;
  r.ranks_per_node = 1;
  r.batch = 2;
  r.micro_batch = 1;
  dt::PlanRequest e = r;
  e.layout = dt::Layout{2, 1, 1};
  const double plain = worst_total(dt::make_plan(e));
  e.layout = dt::Layout{1, 1, 2};
  const dt::Plan piped = dt::make_plan(e);
  REQUIRE(piped.memory.size() == 2u);
  REQUIRE(piped.memory[1].total() > piped.memory[0].total());
  REQUIRE(worst_total(piped) < plain);  // the smallest layout is dp=1 tp=1 pp=2
  r.automatic = true;
  r.mem_limit = 1000;
  const std::string m = error_of<dt::ConfigError>([&] { dt::make_plan(r); });
  INFO(m);
  CHECK(has(m, "mem.limit"));
  CHECK(has(m, "dp=1 tp=1 pp=2"));
  CHECK(has(m, "needs " + dt::format_bytes(worst_total(piped))));
}

TEST_CASE("plan estimate_memory: in-flight micro-batches add activations, tp shrinks the rest") {
  const dt::GptConfig c = tiny(2, 4, 32);
  const g::Graph gr = g::build_gpt(c, 2, 8);
  const auto m1 = g::estimate_memory(gr, 1), m2 = g::estimate_memory(gr, 2),
             m3 = g::estimate_memory(gr, 3);
  std::size_t numel = 0;
  for (const auto& p : dt::gpt_params(c)) numel += p.numel;
  CHECK(m1.params == 4.0 * static_cast<double>(numel));
  CHECK(m1.grads == m1.params);
  CHECK(m1.optim == 2 * m1.params);
  CHECK(m1.total() == m1.params + m1.grads + m1.optim + m1.activations);
  CHECK(m2.params == m1.params);
  CHECK(m2.activations > m1.activations);
  CHECK(m3.activations - m2.activations == doctest::Approx(m2.activations - m1.activations));
  CHECK(m3.total() > m2.total());
  CHECK(m2.total() > m1.total());
  // A larger micro-batch needs more activation memory.
  CHECK(g::estimate_memory(g::build_gpt(c, 4, 8), 1).activations > m1.activations);
  // Tensor parallelism shrinks parameters and the total.
  const auto t2 = g::estimate_memory(g::tp_rewrite(gr, 2), 2);
  const auto t4 = g::estimate_memory(g::tp_rewrite(gr, 4), 2);
  CHECK(t2.params < m2.params);
  CHECK(t4.params < t2.params);
  CHECK(t2.total() < m2.total());
  CHECK(t4.total() < t2.total());
  // A pipeline stage holds fewer parameters than the whole model.
  const g::Graph full = g::pipeline_split(gr, {0, 1});
  CHECK(g::estimate_memory(g::stage_graph(full, 0), 1).params < m1.params);
  CHECK(g::estimate_memory(g::stage_graph(full, 1), 1).params < m1.params);
}
