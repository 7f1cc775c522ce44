// The graph IR, the GPT builder, shape inference, the cost model and the printers.
#include <algorithm>
#include <set>
#include <sstream>

#include "dt/graph.hpp"

namespace dt::graph {

std::string Sharding::str() const {
  std::ostringstream os;
  switch (kind) {
    case Kind::replicated:
      return "replicated";
    case Kind::split:
      os << "split(dim=" << dim << ", " << parts << ")";
      break;
    case Kind::block:
      os << "block(dim=" << dim << ", " << blocks << "x" << parts << ")";
      break;
  }
  return os.str();
}

const char* role_name(Role r) noexcept {
  switch (r) {
    case Role::input:
      return "input";
    case Role::param:
      return "param";
    case Role::activation:
      return "activation";
    case Role::output:
      return "output";
  }
  return "?";
}

std::int64_t Node::attr(const std::string& key) const {
  auto it = attrs.find(key);
  DT_ASSERT(it != attrs.end(), "node ", name, " (", op, ") has no attribute ", key);
  return it->second;
}

std::int64_t Node::attr_or(const std::string& key, std::int64_t def) const {
  auto it = attrs.find(key);
  return it == attrs.end() ? def : it->second;
}

int Graph::add_tensor(TensorInfo t) {
  tensors.push_back(std::move(t));
  return static_cast<int>(tensors.size()) - 1;
}

Node& Graph::add_node(Node n) {
  nodes.push_back(std::move(n));
  return nodes.back();
}

int Graph::tensor(const std::string& name) const {
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].name == name) return static_cast<int>(i);
  DT_THROW(InvalidArgument, "graph has no tensor named '", name, "'");
}

int Graph::count(const std::string& op) const {
  return static_cast<int>(
      std::count_if(nodes.begin(), nodes.end(), [&](const Node& n) { return n.op == op; }));
}

Graph build_gpt(const GptConfig& c, int B, int T) {
  DT_CHECK(InvalidArgument, B >= 1 && T >= 1 && T <= c.block, "micro-batch ", B, " x ", T,
           " tokens does not fit a model of seq-len ", c.block);
  DT_CHECK(InvalidArgument, c.heads >= 1, "model.heads ", c.heads, " must be at least 1");
  DT_CHECK(InvalidArgument, c.embd % c.heads == 0, "model.embd ", c.embd,
           " is not divisible by model.heads ", c.heads);
  Graph g;
  g.layers = c.layers;
  const std::int64_t C = c.embd;
  auto act = [&](std::string name, Shape s) {
    TensorInfo t;
    t.name = std::move(name);
    t.shape = std::move(s);
    return g.add_tensor(std::move(t));
  };
  // Parameters are added in nanoGPT's named_parameters() order, so the tensor order matches
  // gpt_params() and a stage's parameters form one flat buffer in that order.
  std::map<std::string, int> pid;
  for (const ParamInfo& p : gpt_params(c)) {
    TensorInfo t;
    t.name = p.name;
    t.shape = p.shape;
    t.global_shape = p.shape;
    t.role = Role::param;
    pid[p.name] = g.add_tensor(std::move(t));
  }
  TensorInfo tok;
  tok.name = "tokens";
  tok.shape = {B, T};
  tok.dtype = DType::i32;
  tok.role = Role::input;
  const int tokens = g.add_tensor(tok);
  tok.name = "targets";
  const int targets = g.add_tensor(tok);
  auto node = [&](std::string op, std::string name, std::vector<int> in, std::vector<int> out,
                  int layer, std::map<std::string, std::int64_t> attrs = {}) {
    Node n;
    n.op = std::move(op);
    n.name = std::move(name);
    n.in = std::move(in);
    n.out = std::move(out);
    n.layer = layer;
    n.attrs = std::move(attrs);
    g.add_node(std::move(n));
  };
  const Shape btc{B, T, C};
  int x = act("wte+wpe", btc);
  node("embedding", "transformer.wte+wpe",
       {tokens, pid["transformer.wte.weight"], pid["transformer.wpe.weight"]}, {x}, -1);
  for (int l = 0; l < c.layers; ++l) {
    const std::string h = "transformer.h." + std::to_string(l) + ".";
    const std::string a = "h." + std::to_string(l) + ".";
    const int ln1 = act(a + "ln_1", btc);
    node("layernorm", h + "ln_1", {x, pid[h + "ln_1.weight"], pid[h + "ln_1.bias"]}, {ln1}, l);
    const int qkv = act(a + "qkv", {B, T, 3 * C});
    // parallel: 1 column-parallel, 2 row-parallel (read by tp_rewrite); blocks: q|k|v segments.
    node("linear", h + "attn.c_attn",
         {ln1, pid[h + "attn.c_attn.weight"], pid[h + "attn.c_attn.bias"]}, {qkv}, l,
         {{"parallel", 1}, {"blocks", 3}, {"zero_key_bias", 1}});
    const int atty = act(a + "attn", btc);
    // flash: the state kept for the backward is one log-sum-exp per row (GptConfig).
    node("attention", h + "attn", {qkv}, {atty}, l,
         {{"heads", c.heads}, {"flash", c.flash_attention ? 1 : 0}});
    const int proj = act(a + "attn.proj", btc);
    node("linear", h + "attn.c_proj",
         {atty, pid[h + "attn.c_proj.weight"], pid[h + "attn.c_proj.bias"]}, {proj}, l,
         {{"parallel", 2}});
    const int res2 = act(a + "res2", btc);
    node("add", h + "res2", {x, proj}, {res2}, l);
    const int ln2 = act(a + "ln_2", btc);
    node("layernorm", h + "ln_2", {res2, pid[h + "ln_2.weight"], pid[h + "ln_2.bias"]}, {ln2}, l);
    const int fc = act(a + "mlp.fc", {B, T, 4 * C});
    node("linear", h + "mlp.c_fc", {ln2, pid[h + "mlp.c_fc.weight"], pid[h + "mlp.c_fc.bias"]},
         {fc}, l, {{"parallel", 1}, {"blocks", 1}});
    const int gelu = act(a + "mlp.gelu", {B, T, 4 * C});
    node("gelu", h + "mlp.gelu", {fc}, {gelu}, l);
    const int mproj = act(a + "mlp.proj", btc);
    node("linear", h + "mlp.c_proj",
         {gelu, pid[h + "mlp.c_proj.weight"], pid[h + "mlp.c_proj.bias"]}, {mproj}, l,
         {{"parallel", 2}});
    const int res3 = act(a + "res3", btc);
    node("add", h + "res3", {res2, mproj}, {res3}, l);
    x = res3;
  }
  const int lnf = act("ln_f", btc);
  node("layernorm", "transformer.ln_f",
       {x, pid["transformer.ln_f.weight"], pid["transformer.ln_f.bias"]}, {lnf}, c.layers);
  // model.pad-vocab: the logits over the padded vocabulary (the embedding keeps V rows).
  const std::int64_t Vp = padded_vocab(c);
  const int logits = act("logits", {B, T, Vp});
  node("lm_head", "lm_head", {lnf, pid["transformer.wte.weight"]}, {logits}, c.layers,
       {{"vocab_padded", Vp}});
  TensorInfo loss;
  loss.name = "loss";
  loss.shape = {};
  loss.role = Role::output;
  const int lid = g.add_tensor(loss);
  node("xent", "loss", {logits, targets}, {lid}, c.layers);
  return infer_shapes(std::move(g));
}

namespace {
[[noreturn]] void bad_shape(const Node& n, const TensorInfo& t, const std::string& want) {
  DT_THROW(InvalidArgument, "node ", n.name, " (", n.op, "): input ", t.name, " has shape ",
           shape_str(t.shape), ", expected ", want);
}
}  // namespace

Graph infer_shapes(Graph g) {
  std::vector<char> known(g.tensors.size(), 0);
  for (std::size_t i = 0; i < g.tensors.size(); ++i)
    known[i] = g.tensors[i].role != Role::activation && g.tensors[i].role != Role::output;
  auto T = [&](const Node& n, std::size_t k) -> TensorInfo& {
    DT_CHECK(InvalidArgument, k < n.in.size(), "node ", n.name, " (", n.op, ") has ", n.in.size(),
             " inputs, needs more than ", k);
    TensorInfo& t = g.tensors[static_cast<std::size_t>(n.in[k])];
    DT_CHECK(InvalidArgument, known[static_cast<std::size_t>(n.in[k])], "node ", n.name, " reads ",
             t.name, " before any node produced it");
    return t;
  };
  auto rank_is = [&](const Node& n, const TensorInfo& t, std::size_t r, const char* what) {
    if (t.shape.size() != r) bad_shape(n, t, what);
  };
  for (Node& n : g.nodes) {
    Shape out;
    if (n.op == "embedding") {
      const TensorInfo &tok = T(n, 0), &wte = T(n, 1), &wpe = T(n, 2);
      rank_is(n, tok, 2, "[B, T]");
      rank_is(n, wte, 2, "[V, C]");
      if (wpe.shape.size() != 2 || wpe.shape[1] != wte.shape[1] || wpe.shape[0] < tok.shape[1])
        bad_shape(n, wpe, "[>= T, C] with C of wte");
      out = {tok.shape[0], tok.shape[1], wte.shape[1]};
    } else if (n.op == "layernorm") {
      const TensorInfo &x = T(n, 0), &w = T(n, 1), &b = T(n, 2);
      rank_is(n, x, 3, "[B, T, C]");
      if (w.shape != Shape{x.shape[2]}) bad_shape(n, w, "[C] with C of the input");
      if (b.shape != Shape{x.shape[2]}) bad_shape(n, b, "[C] with C of the input");
      out = x.shape;
    } else if (n.op == "linear") {
      const TensorInfo &x = T(n, 0), &w = T(n, 1), &b = T(n, 2);
      rank_is(n, x, 3, "[B, T, in]");
      if (w.shape.size() != 2 || w.shape[1] != x.shape[2])
        bad_shape(n, w, "[out, " + std::to_string(x.shape[2]) + "]");
      if (b.shape != Shape{w.shape[0]}) bad_shape(n, b, "[" + std::to_string(w.shape[0]) + "]");
      out = {x.shape[0], x.shape[1], w.shape[0]};
    } else if (n.op == "attention") {
      const TensorInfo& qkv = T(n, 0);
      const std::int64_t h = n.attr("heads");
      rank_is(n, qkv, 3, "[B, T, 3C]");
      if (qkv.shape[2] % (3 * h) != 0)
        bad_shape(n, qkv, "[B, T, 3C] with C divisible by " + std::to_string(h) + " heads");
      out = {qkv.shape[0], qkv.shape[1], qkv.shape[2] / 3};
    } else if (n.op == "gelu" || n.op == "tp_copy" || n.op == "tp_reduce" || n.op == "send") {
      out = T(n, 0).shape;
    } else if (n.op == "add") {
      const TensorInfo &a = T(n, 0), &b = T(n, 1);
      if (a.shape != b.shape) bad_shape(n, b, shape_str(a.shape) + " like " + a.name);
      out = a.shape;
    } else if (n.op == "lm_head") {
      const TensorInfo &x = T(n, 0), &w = T(n, 1);
      rank_is(n, x, 3, "[B, T, C]");
      if (w.shape.size() != 2 || w.shape[1] != x.shape[2]) bad_shape(n, w, "[V, C]");
      out = {x.shape[0], x.shape[1], std::max(w.shape[0], n.attr_or("vocab_padded", 0))};
    } else if (n.op == "xent") {
      const TensorInfo &lg = T(n, 0), &tg = T(n, 1);
      rank_is(n, lg, 3, "[B, T, V]");
      if (tg.shape != Shape{lg.shape[0], lg.shape[1]}) bad_shape(n, tg, "[B, T] of the logits");
      out = {};
    } else if (n.op == "recv") {
      DT_CHECK(InvalidArgument, n.out.size() == 1, "node ", n.name, " (recv) needs one output");
      out = g.tensors[static_cast<std::size_t>(n.out[0])].shape;
    } else {
      DT_THROW(InvalidArgument, "node ", n.name, ": unknown op '", n.op, "'");
    }
    if (n.op == "send") {
      DT_CHECK(InvalidArgument, n.out.empty(), "node ", n.name, " (send) has outputs");
      continue;
    }
    DT_CHECK(InvalidArgument, n.out.size() == 1, "node ", n.name, " (", n.op,
             ") needs exactly one output, has ", n.out.size());
    TensorInfo& o = g.tensors[static_cast<std::size_t>(n.out[0])];
    DT_CHECK(InvalidArgument, !known[static_cast<std::size_t>(n.out[0])], "node ", n.name,
             " writes ", o.name, ", which another node or the caller already defines");
    o.shape = out;
    known[static_cast<std::size_t>(n.out[0])] = 1;
  }
  return g;
}

std::vector<NodeCost> costs(const Graph& g) {
  std::vector<NodeCost> out(g.nodes.size());
  std::set<int> seen_params;
  auto numel = [&](int t) {
    return static_cast<double>(shape_numel(g.tensors[static_cast<std::size_t>(t)].shape));
  };
  for (std::size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    NodeCost& c = out[i];
    double io = 0;
    for (int t : n.in) io += numel(t);
    for (int t : n.out) io += numel(t);
    for (int t : n.in)
      if (g.tensors[static_cast<std::size_t>(t)].role == Role::param &&
          seen_params.insert(t).second)
        c.param_bytes += 4 * numel(t);
    for (int t : n.out)
      if (g.tensors[static_cast<std::size_t>(t)].role == Role::activation)
        c.act_bytes += 4 * numel(t);
    if (n.op == "linear" || n.op == "lm_head") {
      const Shape& x = g.tensors[static_cast<std::size_t>(n.in[0])].shape;
      const Shape& w = g.tensors[static_cast<std::size_t>(n.in[1])].shape;
      const double mnk = static_cast<double>(x[0] * x[1]) * static_cast<double>(w[0] * w[1]);
      c.fwd_flops = 2 * mnk;
      c.bwd_flops = 4 * mnk;
    } else if (n.op == "attention") {
      const Shape& q = g.tensors[static_cast<std::size_t>(n.in[0])].shape;
      const double BT = static_cast<double>(q[0] * q[1]), Cl = static_cast<double>(q[2] / 3);
      const bool flash = n.attr_or("flash", 0) != 0;
      const double att = static_cast<double>(q[0]) * static_cast<double>(n.attr("heads")) *
                         static_cast<double>(q[1]) * (flash ? 1.0 : static_cast<double>(q[1]));
      c.fwd_flops = 4 * BT * static_cast<double>(q[1]) * Cl;
      c.bwd_flops = 2 * c.fwd_flops;
      c.act_bytes += 4 * att;  // the probabilities, or one log-sum-exp per row (flash)
    } else if (n.op == "layernorm") {
      const Shape& x = g.tensors[static_cast<std::size_t>(n.in[0])].shape;
      c.fwd_flops = 8 * numel(n.in[0]);
      c.bwd_flops = 2 * c.fwd_flops;
      c.act_bytes += 8.0 * static_cast<double>(x[0] * x[1]);  // mean and rstd
    } else if (n.op == "xent") {
      c.fwd_flops = 4 * numel(n.in[0]);
      c.bwd_flops = 2 * numel(n.in[0]);
      c.act_bytes += 4 * numel(n.in[0]);  // the probabilities
    } else if (n.op == "gelu" || n.op == "add" || n.op == "embedding") {
      c.fwd_flops = 8 * numel(n.out[0]);
      c.bwd_flops = 2 * c.fwd_flops;
    } else if (n.op == "tp_copy" || n.op == "tp_reduce" || n.op == "send" || n.op == "recv") {
      c.comm_bytes = 4 * numel(n.op == "recv" ? n.out[0] : n.in[0]);
    }
    c.bytes = 4 * io * 2;
  }
  return out;
}

std::vector<double> layer_costs(const Graph& g) {
  DT_ASSERT(g.layers >= 1);
  std::vector<double> unit(static_cast<std::size_t>(g.layers), 0.0);
  const auto c = costs(g);
  for (std::size_t i = 0; i < g.nodes.size(); ++i) {
    const int l = std::clamp(g.nodes[i].layer, 0, g.layers - 1);
    unit[static_cast<std::size_t>(l)] += c[i].fwd_flops + c[i].bwd_flops;
  }
  return unit;
}

MemoryEstimate estimate_memory(const Graph& g, int in_flight) {
  MemoryEstimate m;
  double act_one = 0, act_grads = 0;
  for (const NodeCost& c : costs(g)) {
    m.params += c.param_bytes;
    act_one += c.act_bytes;
  }
  for (const TensorInfo& t : g.tensors)
    if (t.role == Role::activation) act_grads += 4.0 * static_cast<double>(shape_numel(t.shape));
  m.grads = m.params;
  m.optim = 2 * m.params;
  m.activations = act_one * std::max(1, in_flight) + act_grads;
  return m;
}

std::size_t gemm_operand_elements(const Graph& g) {
  std::size_t most = 0;
  for (const Node& n : g.nodes) {
    if (n.op != "linear" && n.op != "lm_head") continue;
    // Forward x @ W^T; backward dy @ W and dy^T @ x: the operands are x, dy and W.
    for (int id : {n.in[0], n.in[1], n.out[0]})
      most = std::max(most, shape_numel(g.tensors[static_cast<std::size_t>(id)].shape));
  }
  return most;
}

std::string to_text(const Graph& g) {
  std::ostringstream os;
  auto tdesc = [&](int id) {
    const TensorInfo& t = g.tensors[static_cast<std::size_t>(id)];
    std::string s = t.name + " " + shape_str(t.shape);
    if (t.role == Role::param) {
      if (t.sharding.kind != Sharding::Kind::replicated)
        s += " " + t.sharding.str() + " of " + shape_str(t.global_shape);
      if (t.tied) s += " tied";
    }
    return s;
  };
  int stage = -1;
  for (const Node& n : g.nodes) {
    if (n.stage != stage) {
      stage = n.stage;
      os << "  stage " << stage << ":\n";
    }
    os << "    " << n.op << " " << n.name;
    if (n.op == "send" || n.op == "recv")
      os << (n.op == "send" ? " to stage " : " from stage ") << n.attr("peer");
    os << " (";
    for (std::size_t k = 0; k < n.in.size(); ++k) os << (k ? ", " : "") << tdesc(n.in[k]);
    os << ")";
    if (!n.out.empty()) os << " -> " << tdesc(n.out[0]);
    for (const auto& [k, v] : n.attrs)
      if (k == "heads" || k == "bias_rank0") os << " " << k << "=" << v;
    os << "\n";
  }
  return os.str();
}

std::string to_dot(const Graph& g, const std::string& title) {
  std::ostringstream os;
  // A quoted DOT string: quotes and backslashes escaped, a newline as DOT's line break \n.
  auto q = [](const std::string& s) {
    std::string r = "\"";
    for (char ch : s) {
      if (ch == '\n') {
        r += "\\n";
        continue;
      }
      if (ch == '"' || ch == '\\') r += '\\';
      r += ch;
    }
    return r + "\"";
  };
  os << "digraph " << q(title) << " {\n  rankdir=TB;\n  node [shape=box, fontsize=10];\n";
  std::map<int, std::vector<std::size_t>> by_stage;
  for (std::size_t i = 0; i < g.nodes.size(); ++i) by_stage[g.nodes[i].stage].push_back(i);
  for (const auto& [s, ids] : by_stage) {
    os << "  subgraph cluster_stage" << s << " {\n    label=" << q("stage " + std::to_string(s))
       << ";\n";
    for (std::size_t i : ids) {
      const Node& n = g.nodes[i];
      const bool comm =
          n.op == "tp_copy" || n.op == "tp_reduce" || n.op == "send" || n.op == "recv";
      os << "    n" << i << " [label=" << q(n.op + "\n" + n.name)
         << (comm ? ", style=filled, fillcolor=lightblue" : "") << "];\n";
    }
    os << "  }\n";
  }
  std::map<int, std::size_t> producer;
  for (std::size_t i = 0; i < g.nodes.size(); ++i)
    for (int t : g.nodes[i].out) producer[t] = i;
  for (std::size_t i = 0; i < g.nodes.size(); ++i)
    for (int t : g.nodes[i].in) {
      auto it = producer.find(t);
      if (it == producer.end()) continue;
      os << "  n" << it->second << " -> n" << i
         << " [label=" << q(shape_str(g.tensors[static_cast<std::size_t>(t)].shape))
         << ", fontsize=8];\n";
    }
  // Pipeline edges: each send to the recv with the same edge id.
  for (std::size_t i = 0; i < g.nodes.size(); ++i) {
    if (g.nodes[i].op != "send") continue;
    for (std::size_t j = 0; j < g.nodes.size(); ++j)
      if (g.nodes[j].op == "recv" && g.nodes[j].attr("edge") == g.nodes[i].attr("edge"))
        os << "  n" << i << " -> n" << j << " [style=dashed, color=blue];\n";
  }
  os << "}\n";
  return os.str();
}

}  // namespace dt::graph
