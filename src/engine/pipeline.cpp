#include "engine/pipeline.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <string>

#include "dt/trace.hpp"
#include "dt/watchdog.hpp"
#include "model/layers.hpp"

namespace dt {

using graph::Node;
using graph::Role;
using graph::TensorInfo;

std::vector<PipeAction> one_f_one_b(int stage, int stages, int micro) {
  DT_CHECK(InvalidArgument, stages >= 1 && stage >= 0 && stage < stages && micro >= 1,
           "1F1B needs 0 <= stage < stages and micro-batches >= 1 (stage ", stage, " of ", stages,
           ", ", micro, " micro-batches)");
  const int warmup = std::min(stages - stage - 1, micro);
  std::vector<PipeAction> a;
  int f = 0, b = 0;
  for (; f < warmup; ++f) a.push_back({PipeAction::Kind::forward, f});
  for (; f < micro; ++f, ++b) {
    a.push_back({PipeAction::Kind::forward, f});
    a.push_back({PipeAction::Kind::backward, b});
  }
  for (; b < micro; ++b) a.push_back({PipeAction::Kind::backward, b});
  return a;
}

int vote_lag(int stages) { return stages > 1 ? stages : 0; }

double simulate_1f1b(int stages, int micro, double tf, double tb) {
  DT_CHECK(InvalidArgument, stages >= 1 && micro >= 1, "simulate_1f1b: ", stages, " stages and ",
           micro, " micro-batches (at least one of each)");
  std::vector<std::vector<PipeAction>> sched;
  for (int s = 0; s < stages; ++s) sched.push_back(one_f_one_b(s, stages, micro));
  // done_f[s][m], done_b[s][m]: finish times (-1: not yet).
  std::vector<std::vector<double>> done_f(static_cast<std::size_t>(stages),
                                          std::vector<double>(static_cast<std::size_t>(micro), -1)),
      done_b = done_f;
  std::vector<std::size_t> next(static_cast<std::size_t>(stages), 0);
  std::vector<double> clock(static_cast<std::size_t>(stages), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < stages; ++s) {
      auto& pos = next[static_cast<std::size_t>(s)];
      while (pos < sched[static_cast<std::size_t>(s)].size()) {
        const PipeAction& a = sched[static_cast<std::size_t>(s)][pos];
        const std::size_t us = static_cast<std::size_t>(s), um = static_cast<std::size_t>(a.micro);
        double ready = clock[us];
        if (a.kind == PipeAction::Kind::forward) {
          if (s > 0) {
            if (done_f[us - 1][um] < 0) break;
            ready = std::max(ready, done_f[us - 1][um]);
          }
          done_f[us][um] = clock[us] = ready + tf;
        } else {
          if (done_f[us][um] < 0) break;
          if (s + 1 < stages) {
            if (done_b[us + 1][um] < 0) break;
            ready = std::max(ready, done_b[us + 1][um]);
          }
          done_b[us][um] = clock[us] = ready + tb;
        }
        ++pos;
        progress = true;
      }
    }
  }
  for (int s = 0; s < stages; ++s)
    DT_ASSERT(next[static_cast<std::size_t>(s)] == sched[static_cast<std::size_t>(s)].size(),
              "1F1B schedules deadlock at stage ", s);
  return *std::max_element(clock.begin(), clock.end());
}

// ---------------------------------------------------------------------------------------------

namespace {
// One tag per pipeline edge and direction: both ends send and receive the micro-batches of an
// edge in the same (increasing) order, and messages with the same (source, tag) are never
// overtaken, so the order itself pairs them (and a sealed transport's sequence check sees any
// message out of that order).
int tag_of(const Node& n, bool backward) {
  return static_cast<int>(n.attr("edge") % 4096) * 2 + (backward ? 1 : 0);
}
}  // namespace

// engine.cuda_graphs. A pass (the forward or the backward of a micro-batch) is cut into runs of
// nodes: runs of device work alone, which a graph can hold, and runs with host points (token
// copies, the loss read-back, tensor-parallel collectives, pipeline messages), which always run
// eagerly.
struct Run {
  std::vector<std::size_t> nodes;  // in the pass's order
  bool graph = false;              // device work alone
};

// A host point of the forward (backward) pass: the node copies to or from host memory, waits
// for the device, or communicates.
bool host_point(const std::string& op, bool backward) {
  if (backward) return op == "tp_copy" || op == "send" || op == "recv";
  return op == "embedding" || op == "xent" || op == "tp_reduce" || op == "send" || op == "recv";
}

std::vector<Run> cut_runs(const graph::Graph& g, bool backward) {
  std::vector<Run> runs;
  const std::size_t n = g.nodes.size();
  for (std::size_t j = 0; j < n; ++j) {
    const std::size_t i = backward ? n - 1 - j : j;
    const bool graph = !host_point(g.nodes[i].op, backward);
    if (runs.empty() || runs.back().graph != graph) runs.push_back(Run{{}, graph});
    runs.back().nodes.push_back(i);
  }
  return runs;
}

// The graphs of one slot's passes in one direction at one batch size: one per device-work run,
// for the loss scale they were captured with. `warm`: a pass ran eagerly at this batch (a device
// may allocate on first use, which a capture forbids).
struct PassGraphs {
  int B = 0;
  bool warm = false;
  float scale = 0;
  std::vector<Device::Graph> graphs;
};

// The graphs for a pass of `B` sequences at `scale` in a slot whose graphs are `set` (null:
// graphs are off). A new batch size (a shorter last validation batch) gets graphs of its own
// after an eager pass; a new scale (a kernel argument) captures them again.
PassGraphs* pass_graphs(bool on, std::vector<PassGraphs>& set, int B, float scale) {
  if (!on) return nullptr;
  auto it = std::find_if(set.begin(), set.end(), [B](const PassGraphs& p) { return p.B == B; });
  if (it == set.end()) {
    set.emplace_back();
    set.back().B = B;
    it = set.end() - 1;
  }
  if (it->scale != scale) {
    for (Device::Graph& g : it->graphs) g = Device::Graph();
    it->scale = scale;
  }
  return &*it;
}

// Runs the nodes of `runs` through `node`: eagerly without graphs (pg null or not warm yet);
// else each device-work run from its graph, captured first where there is none.
void run_pass(const Device& dev, const std::vector<Run>& runs, PassGraphs* pg,
              StageEngine::GraphCounts& counts, const std::function<void(std::size_t)>& node) {
  const bool graphs = pg != nullptr && pg->warm;
  std::size_t k = 0;
  for (const Run& r : runs) {
    if (!graphs || !r.graph) {
      for (std::size_t i : r.nodes) node(i);
      continue;
    }
    if (pg->graphs.size() <= k) pg->graphs.resize(k + 1);
    Device::Graph& g = pg->graphs[k++];
    if (!g) {
      const trace::Scope s("graph capture", "train");
      g = dev.capture([&] {
        for (std::size_t i : r.nodes) node(i);
      });
      ++counts.captured;
    }
    g.launch();
    ++counts.launched;
  }
  if (graphs) ++counts.passes;
  if (pg) pg->warm = true;
}

namespace {
// A pipeline message on its way to world rank `peer` (`count` floats), until a wait for it ends.
struct Sent {
  Work work;
  int peer = -1;
  std::size_t count = 0;
};
}  // namespace

struct StageEngine::Impl {
  // Per activation tensor: offset (floats) in a slot's activation area and in the gradient area.
  std::vector<std::size_t> act_off, grad_off;
  // Per node: offset of its kernel state (layernorm mean+rstd, attention probabilities, loss
  // probabilities and per-token losses) in a slot's area.
  std::vector<std::size_t> aux_off;
  std::vector<char> flash;  // per node: attention keeps one log-sum-exp per row (flash_attention)
  std::size_t slot_floats = 0, grad_floats = 0, scratch_floats = 0;
  std::vector<Device::Buffer> slot_buf;   // per slot: activations + kernel state
  std::vector<Device::Buffer> token_buf;  // per slot: inputs then targets (int32)
  Device::Buffer grad_buf, scratch;
  std::vector<Sent> fwd_sends;  // per slot
  std::vector<Sent> bwd_sends;
  std::vector<int> uses;    // per parameter: nodes still to run backward
  int B = 0, T = 0;         // the graph's (largest) micro-batch
  std::vector<int> slot_B;  // B of the micro-batch in each slot
  // Per slot: what its last forward left for a backward: none yet, or a forward without targets
  // (no loss state), or one with them.
  enum SlotState : char { kEmpty, kNoTargets, kTargets };
  std::vector<char> slot_state;
  bool has_loss = false;  // the stage computes the loss (a backward needs targets)
  std::vector<float> host_losses;
  double wait_s = 0;  // blocked on pipeline messages
  // Unit hooks (sharded parameters or gradients).
  std::vector<ZeroUnit> units;
  std::vector<int> unit_of;           // per parameter
  std::vector<std::size_t> unit_off;  // per unit: layout offset of its first parameter
  std::vector<std::vector<int>> fwd_units, bwd_units;  // per node: units its kernels read
  std::vector<int> fwd_next, bwd_next;  // per node: the next other unit the pass reads
  std::vector<int> held;                // units acquired and not released
  std::vector<const float*> pbase;      // per unit: acquired parameters
  std::vector<float*> gbase;            // per unit: this backward's gradient buffer
  std::vector<int> unit_left;           // per unit: parameters whose gradients are not final
  // engine.cuda_graphs (set_graphs): the passes' runs, each slot's graphs, what they did.
  bool graphs = false;
  std::vector<Run> fwd_runs, bwd_runs;
  std::vector<std::vector<PassGraphs>> fwd_graphs, bwd_graphs;  // per slot, per batch size
  GraphCounts counts;
};

namespace {
// Adds the lifetime of the scope to `acc` (seconds).
class WaitClock {
 public:
  explicit WaitClock(double& acc) : acc_(acc), t0_(std::chrono::steady_clock::now()) {}
  ~WaitClock() {
    acc_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  WaitClock(const WaitClock&) = delete;
  WaitClock& operator=(const WaitClock&) = delete;

 private:
  double& acc_;
  std::chrono::steady_clock::time_point t0_;
};

constexpr const char* kPipelineComm = "pipeline";  // the watchdog's name for stage messages

// Receives `cnt` floats from world rank `from` into `dst`: recorded for the hang watchdog with the
// rank it waits for (a stage that stops is named by the one waiting for it), and counted in
// `wait_s`.
void recv_recorded(P2p& p2p, float* dst, std::size_t cnt, int from, int tag, double& wait_s) {
  const WaitClock clock(wait_s);
  const watchdog::OpRecord rec(kPipelineComm, 0, "recv", "p2p", DType::f32, cnt, -1, from);
  p2p.recv(view_of(dst, cnt), from, tag);
}

// Waits until `s` (if any) has gone, its buffer free again: recorded for the hang watchdog with
// the rank it waits for (a message larger than the transport's eager limit waits for its
// receiver: a stage that stops before receiving it is named by the sender), and counted in
// `wait_s`. The send itself, started a pass earlier, is not recorded: the stage computed since.
// Nor is the wait counted in dt_comm_* or shown as a comm event: only the sends not done yet
// are waited for here, and for the wait's time alone.
void wait_sent(Sent& s, double& wait_s) {
  if (!s.work.valid()) return;
  if (!s.work.test()) {
    const WaitClock clock(wait_s);
    const watchdog::OpRecord rec(kPipelineComm, 0, "send", "p2p", DType::f32, s.count, -1, s.peer,
                                 false);
    s.work.wait();
  }
  s = Sent();
}
}  // namespace

namespace {
std::size_t numel_of(const TensorInfo& t) { return shape_numel(t.shape); }
}  // namespace

std::vector<ParamInfo> StageEngine::param_table(const graph::Graph& g) {
  std::vector<ParamInfo> out;
  std::size_t n = 0;
  for (const TensorInfo& ti : g.tensors) {
    if (ti.role != Role::param) continue;
    ParamInfo p;
    p.name = ti.name;
    p.shape = ti.shape;
    p.numel = numel_of(ti);
    p.offset = n;
    p.decay = ti.global_shape.size() >= 2;
    n += p.numel;
    out.push_back(std::move(p));
  }
  return out;
}

std::size_t StageEngine::count_params(const graph::Graph& g) {
  std::size_t n = 0;
  for (const TensorInfo& t : g.tensors)
    if (t.role == Role::param) n += numel_of(t);
  return n;
}

StageEngine::Layout StageEngine::layout_of(const graph::Graph& g,
                                           const std::function<bool(const Node&)>& flash) {
  Layout m;
  m.act_off.assign(g.tensors.size(), 0);
  m.grad_off.assign(g.tensors.size(), 0);
  m.aux_off.assign(g.nodes.size(), 0);
  m.flash.assign(g.nodes.size(), 0);
  for (std::size_t t = 0; t < g.tensors.size(); ++t) {
    const TensorInfo& ti = g.tensors[t];
    if (ti.role == Role::input && ti.shape.size() == 2) {
      m.B = static_cast<int>(ti.shape[0]);
      m.T = static_cast<int>(ti.shape[1]);
    }
    if (ti.role != Role::activation) continue;
    if (ti.shape.size() == 3) {
      m.B = static_cast<int>(ti.shape[0]);
      m.T = static_cast<int>(ti.shape[1]);
    }
    m.act_off[t] = m.slot_floats;
    m.slot_floats += numel_of(ti);
    m.grad_off[t] = m.grad_floats;
    m.grad_floats += numel_of(ti);
  }
  DT_ASSERT(m.B > 0 && m.T > 0, "stage graph without activations");
  const std::size_t BT = static_cast<std::size_t>(m.B) * static_cast<std::size_t>(m.T);
  for (std::size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    m.aux_off[i] = m.slot_floats;
    if (n.op == "layernorm") {
      m.slot_floats += 2 * BT;
    } else if (n.op == "attention") {
      m.flash[i] = flash(n) ? 1 : 0;
      const std::size_t att = attention_state_floats(m.flash[i] != 0, static_cast<std::size_t>(m.B),
                                                     static_cast<std::size_t>(n.attr("heads")),
                                                     static_cast<std::size_t>(m.T));
      m.slot_floats += att;
      m.scratch_floats = std::max(m.scratch_floats, att);
    } else if (n.op == "xent") {
      m.slot_floats += numel_of(g.tensors[static_cast<std::size_t>(n.in[0])]) + BT;
    } else if (n.op == "send") {
      m.scratch_floats =
          std::max(m.scratch_floats, numel_of(g.tensors[static_cast<std::size_t>(n.in[0])]));
    }
  }
  return m;
}

std::size_t StageEngine::Layout::bytes(int slots) const {
  const std::size_t BT = static_cast<std::size_t>(B) * static_cast<std::size_t>(T);
  return sizeof(float) *
             (std::max<std::size_t>(1, grad_floats) + std::max<std::size_t>(1, scratch_floats)) +
         static_cast<std::size_t>(slots) *
             (slot_floats * sizeof(float) + 2 * BT * sizeof(std::int32_t));
}

StageEngine::StageEngine(const Device& dev, graph::Graph g, const GptConfig& model, int stage,
                         int stages, int slots, StageComms comms, GptStorage storage)
    : dev_(dev),
      g_(std::move(g)),
      model_(model),
      stage_(stage),
      stages_(stages),
      slots_(std::max(1, slots)),
      comms_(std::move(comms)),
      impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  // Parameters: the flat buffer in graph order (nanoGPT order), packed or in the given layout.
  params_ = param_table(g_);
  param_index_.assign(g_.tensors.size(), -1);
  for (std::size_t t = 0; t < g_.tensors.size(); ++t)
    if (g_.tensors[t].role == Role::param) {
      param_index_[t] = static_cast<int>(param_tensor_id_.size());
      param_tensor_id_.push_back(static_cast<int>(t));
    }
  nparams_ = count_params(g_);
  std::size_t end = nparams_;
  if (!storage.layout.empty()) {
    DT_CHECK(InvalidArgument, storage.layout.size() == params_.size(), "a stage layout has ",
             storage.layout.size(), " parameters, the stage ", params_.size());
    end = 0;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      DT_CHECK(
          InvalidArgument,
          storage.layout[i].name == params_[i].name && storage.layout[i].numel == params_[i].numel,
          "a stage layout's parameter ", i, " is ", storage.layout[i].name, ", not ",
          params_[i].name);
      params_[i].offset = storage.layout[i].offset;
      end = std::max(end, params_[i].offset + params_[i].numel);
    }
  }
  const std::vector<ParamInfo> global = gpt_params(model_);
  for (const ParamInfo& p : params_) {
    std::size_t gi = 0;
    while (gi < global.size() && global[gi].name != p.name) ++gi;
    DT_ASSERT(gi < global.size(), "parameter ", p.name, " is not part of the model");
    global_index_.push_back(gi);
  }
  param_uses_.assign(params_.size(), 0);
  for (const Node& n : g_.nodes)
    for (int t : n.in)
      if (param_index_[static_cast<std::size_t>(t)] >= 0)
        ++param_uses_[static_cast<std::size_t>(param_index_[static_cast<std::size_t>(t)])];
  DT_CHECK(InvalidArgument, nparams_ > 0, "stage ", stage, " holds no parameters");
  DT_CHECK(InvalidArgument, !storage.grad_storage || (storage.layout.empty() && storage.own_grads),
           "a StageEngine with a padded layout keeps its own gradients");
  capacity_ = std::max(end, storage.numel);
  if (storage.own_params) {
    param_buf_ = Device::Buffer(dev_, capacity_ * sizeof(float));
    dev_.call(&dt_hal_v1_t::fill_zero, "fill_zero", param_buf_.get(), param_buf_.bytes());
  }
  if (storage.grad_storage) {
    grad_ = storage.grad_storage;
  } else if (storage.own_grads) {
    grad_buf_ = Device::Buffer(dev_, capacity_ * sizeof(float));
    grad_ = grad_buf_.as<float>();
  }
  // Activations and gradients.
  StageEngine::Layout l = layout_of(
      g_, [this](const Node& n) { return flash_attention(dev_, n.attr_or("flash", 0) != 0); });
  m.act_off = std::move(l.act_off);
  m.grad_off = std::move(l.grad_off);
  m.aux_off = std::move(l.aux_off);
  m.flash = std::move(l.flash);
  m.slot_floats = l.slot_floats;
  m.grad_floats = l.grad_floats;
  m.scratch_floats = l.scratch_floats;
  m.B = l.B;
  m.T = l.T;
  const std::size_t BT = static_cast<std::size_t>(m.B) * static_cast<std::size_t>(m.T);
  for (int s = 0; s < slots_; ++s) {
    m.slot_buf.emplace_back(dev_, m.slot_floats * sizeof(float));
    m.token_buf.emplace_back(dev_, 2 * BT * sizeof(std::int32_t));
  }
  m.slot_B.assign(static_cast<std::size_t>(slots_), m.B);
  m.slot_state.assign(static_cast<std::size_t>(slots_), Impl::kEmpty);
  for (const Node& n : g_.nodes) m.has_loss = m.has_loss || n.op == "xent";
  m.grad_buf = Device::Buffer(dev_, std::max<std::size_t>(1, m.grad_floats) * sizeof(float));
  m.scratch = Device::Buffer(dev_, std::max<std::size_t>(1, m.scratch_floats) * sizeof(float));
  m.fwd_sends.resize(static_cast<std::size_t>(slots_));
  m.host_losses.resize(BT);
  m.fwd_runs = cut_runs(g_, false);
  m.bwd_runs = cut_runs(g_, true);
  m.fwd_graphs.resize(static_cast<std::size_t>(slots_));
  m.bwd_graphs.resize(static_cast<std::size_t>(slots_));
  for (const Node& n : g_.nodes)
    if (n.op == "lm_head") {
      const Shape& w = g_.tensors[static_cast<std::size_t>(n.in[1])].shape;
      head_.init(dev_, w[0], g_.tensors[static_cast<std::size_t>(n.out[0])].shape.back(), w[1]);
    }
  zero_grad();
}

StageEngine::~StageEngine() {
  // Sends still in flight read our buffers: finish them (errors were reported by the step).
  try {
    wait_sends();
  } catch (...) {
  }
}

void StageEngine::init_param(std::uint64_t seed, std::size_t i, float* out) const {
  std::vector<float> full(gpt_params(model_)[global_index_[i]].numel);
  gpt_init_param(model_, seed, global_index_[i], full.data());
  graph::take_shard(param_tensor(i), comms_.tp_rank, full.data(), out);
}

void StageEngine::init(std::uint64_t seed) {
  DT_CHECK(InvalidArgument, param_data() != nullptr,
           "StageEngine::init: the parameters come from the unit hooks (use init_param)");
  std::vector<float> host(capacity_, 0.0f);
  for (std::size_t i = 0; i < params_.size(); ++i)
    init_param(seed, i, host.data() + params_[i].offset);
  dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(param_data()),
            static_cast<const void*>(host.data()), capacity_ * sizeof(float),
            DT_HAL_HOST_TO_DEVICE);
}

void StageEngine::set_graphs(bool on) {
  Impl& m = *impl_;
  if (on) {
    DT_CHECK(InvalidArgument, !hooks_.acquire && !hooks_.grads,
             "StageEngine::set_graphs: the parameters or gradients come from unit hooks, whose "
             "calls a graph cannot hold");
    const dt_hal_v2_t& t = dev_.table2();
    DT_CHECK(ConfigError, t.graph_begin && t.graph_end && t.graph_launch && t.graph_destroy,
             "device '", dev_.name(), "' (", dev_.origin(), ") has no graph entries");
  }
  m.graphs = on;
  drop_graphs();
}

void StageEngine::drop_graphs() {
  Impl& m = *impl_;
  for (auto* set : {&m.fwd_graphs, &m.bwd_graphs}) {
    set->clear();
    set->resize(static_cast<std::size_t>(slots_));
  }
}

bool StageEngine::graphs() const noexcept { return impl_->graphs; }

StageEngine::GraphCounts StageEngine::graph_counts() const { return impl_->counts; }

void StageEngine::set_weights16(const void* w16, std::size_t n) {
  if (w16 != ws_.w16) drop_graphs();  // captured products read the old operands
  ws_.w32 = param_data();
  ws_.w16 = param_data() ? w16 : nullptr;
  ws_.wn = std::min(n, param_buf_.bytes() / sizeof(float));
}

void StageEngine::set_compute(DType t) {
  drop_graphs();  // the graphs hold the operand buffers reserved below
  ws_.compute = t;
  ws_.reserve(dev_, graph::gemm_operand_elements(g_));
  head_.set_compute(dev_, t);
}

std::size_t StageEngine::activation_bytes() const {
  std::size_t b = impl_->grad_buf.bytes() + impl_->scratch.bytes() + ws_.a.bytes() + ws_.b.bytes() +
                  head_.bytes();
  for (const Device::Buffer& s : impl_->slot_buf) b += s.bytes();
  for (const Device::Buffer& s : impl_->token_buf) b += s.bytes();
  return b;
}

void StageEngine::set_unit_hooks(std::vector<ZeroUnit> units, UnitHooks hooks) {
  DT_CHECK(InvalidArgument, param_data() || hooks.acquire,
           "a StageEngine without its own parameters needs UnitHooks::acquire");
  DT_CHECK(InvalidArgument, grad_ || (hooks.grads && hooks.grads_done),
           "a StageEngine without its own gradients needs UnitHooks::grads and grads_done");
  Impl& m = *impl_;
  DT_CHECK(InvalidArgument, !m.graphs || (!hooks.acquire && !hooks.grads),
           "StageEngine::set_unit_hooks: the passes run from graphs, which cannot hold the hooks' "
           "calls");
  m.unit_of.assign(params_.size(), -1);
  m.unit_off.clear();
  std::size_t expect = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    DT_CHECK(
        InvalidArgument,
        units[u].first == expect && units[u].end > units[u].first && units[u].end <= params_.size(),
        "stage units must cover the parameters in order");
    expect = units[u].end;
    for (std::size_t i = units[u].first; i < units[u].end; ++i) m.unit_of[i] = static_cast<int>(u);
    m.unit_off.push_back(params_[units[u].first].offset);
  }
  DT_CHECK(InvalidArgument, expect == params_.size(), "stage units must cover the parameters");
  // What each node's kernels read: its parameters' units (the embedding's backward reads none).
  const std::size_t N = g_.nodes.size();
  m.fwd_units.assign(N, {});
  m.bwd_units.assign(N, {});
  for (std::size_t k = 0; k < N; ++k)
    for (int t : g_.nodes[k].in) {
      const int p = param_index_[static_cast<std::size_t>(t)];
      if (p < 0) continue;
      const int u = m.unit_of[static_cast<std::size_t>(p)];
      auto add = [u](std::vector<int>& v) {
        if (std::find(v.begin(), v.end(), u) == v.end()) v.push_back(u);
      };
      add(m.fwd_units[k]);
      if (g_.nodes[k].op != "embedding") add(m.bwd_units[k]);
    }
  // The next unit a pass reads after node k that node k does not (prefetched meanwhile).
  auto next_of = [&](const std::vector<std::vector<int>>& need, std::size_t k, bool backward) {
    for (std::size_t j = k;;) {
      if (backward ? j == 0 : j + 1 >= N) return -1;
      j = backward ? j - 1 : j + 1;
      for (int u : need[j])
        if (std::find(need[k].begin(), need[k].end(), u) == need[k].end()) return u;
    }
  };
  m.fwd_next.assign(N, -1);
  m.bwd_next.assign(N, -1);
  for (std::size_t k = 0; k < N; ++k) {
    m.fwd_next[k] = next_of(m.fwd_units, k, false);
    m.bwd_next[k] = next_of(m.bwd_units, k, true);
  }
  m.pbase.assign(units.size(), nullptr);
  m.gbase.assign(units.size(), nullptr);
  m.held.clear();
  m.units = std::move(units);
  hooks_ = std::move(hooks);
}

void StageEngine::use_units(std::size_t k, bool backward) {
  Impl& m = *impl_;
  if (!hooks_.acquire) return;
  const std::vector<int>& need = (backward ? m.bwd_units : m.fwd_units)[k];
  if (need.empty()) return;
  for (std::size_t j = 0; j < m.held.size();) {  // units the pass has finished with, for now
    const int u = m.held[j];
    if (std::find(need.begin(), need.end(), u) != need.end()) {
      ++j;
      continue;
    }
    hooks_.release(u);
    m.pbase[static_cast<std::size_t>(u)] = nullptr;
    m.held.erase(m.held.begin() + static_cast<std::ptrdiff_t>(j));
  }
  const int next = (backward ? m.bwd_next : m.fwd_next)[k];
  for (int u : need)
    if (!m.pbase[static_cast<std::size_t>(u)]) {
      m.pbase[static_cast<std::size_t>(u)] = hooks_.acquire(u, next);
      m.held.push_back(u);
    }
}

void StageEngine::release_units() {
  Impl& m = *impl_;
  for (int u : m.held) {
    hooks_.release(u);
    m.pbase[static_cast<std::size_t>(u)] = nullptr;
  }
  m.held.clear();
}

const float* StageEngine::param_ptr(std::size_t p) const {
  if (param_data()) return param_data() + params_[p].offset;
  const Impl& m = *impl_;
  const std::size_t u = static_cast<std::size_t>(m.unit_of[p]);
  DT_ASSERT(m.pbase[u] != nullptr, "parameter ", params_[p].name, " read outside its unit");
  return m.pbase[u] + (params_[p].offset - m.unit_off[u]);
}

float* StageEngine::grad_ptr(std::size_t p) {
  if (grad_) return grad_ + params_[p].offset;
  Impl& m = *impl_;
  const std::size_t u = static_cast<std::size_t>(m.unit_of[p]);
  if (!m.gbase[u]) m.gbase[u] = hooks_.grads(static_cast<int>(u));
  return m.gbase[u] + (params_[p].offset - m.unit_off[u]);
}

void StageEngine::zero_grad() {
  if (!grad_) return;  // gradients in unit buffers start from zero in every backward
  dev_.call(&dt_hal_v1_t::fill_zero, "fill_zero", static_cast<void*>(grad_),
            (grad_buf_.bytes() ? capacity_ : nparams_) * sizeof(float));
}

double StageEngine::take_wait_seconds() {
  const double s = impl_->wait_s;
  impl_->wait_s = 0;
  return s;
}

void StageEngine::wait_sends() {
  for (Sent& w : impl_->fwd_sends) wait_sent(w, impl_->wait_s);
  for (Sent& w : impl_->bwd_sends) wait_sent(w, impl_->wait_s);
  impl_->bwd_sends.clear();
}

double StageEngine::forward(int slot, int micro, const std::int32_t* inputs,
                            const std::int32_t* targets, int B) {
  Impl& m = *impl_;
  DT_CHECK(InvalidArgument, slot >= 0 && slot < slots_ && B >= 1 && B <= m.B, "slot ", slot,
           " / batch ", B, " outside the engine's ", slots_, " slots / ", m.B, " sequences");
  const std::size_t us = static_cast<std::size_t>(slot);
  wait_sent(m.fwd_sends[us], m.wait_s);  // the slot's last activations may still be on their way
  m.slot_B[us] = B;
  m.slot_state[us] = Impl::kEmpty;  // until the pass is through
  const std::int64_t T = m.T, BT = std::int64_t{B} * T;
  float* A = m.slot_buf[us].as<float>();
  std::int32_t* tok = m.token_buf[us].as<std::int32_t>();
  std::int32_t* tgt = tok + static_cast<std::size_t>(m.B) * static_cast<std::size_t>(m.T);
  auto act = [&](int t) { return A + m.act_off[static_cast<std::size_t>(t)]; };
  auto prm = [&](int t) {
    return param_ptr(static_cast<std::size_t>(param_index_[static_cast<std::size_t>(t)]));
  };
  auto width = [&](int t) { return g_.tensors[static_cast<std::size_t>(t)].shape.back(); };
  double loss = 0;
  auto node = [&](std::size_t i) {
    const Node& n = g_.nodes[i];
    float* aux = A + m.aux_off[i];
    use_units(i, false);
    if (n.op == "embedding") {
      dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(tok),
                static_cast<const void*>(inputs), BT * sizeof(std::int32_t), DT_HAL_HOST_TO_DEVICE);
      dev_.call(&dt_hal_v1_t::embedding_fwd, "embedding_fwd", act(n.out[0]),
                static_cast<const std::int32_t*>(tok), prm(n.in[1]), prm(n.in[2]), std::int64_t{B},
                T, width(n.out[0]), g_.tensors[static_cast<std::size_t>(n.in[1])].shape[0]);
    } else if (n.op == "layernorm") {
      const trace::Scope s("forward", "model", "layer", n.layer);
      dev_.call(&dt_hal_v1_t::layernorm_fwd, "layernorm_fwd", act(n.out[0]), aux, aux + BT,
                static_cast<const float*>(act(n.in[0])), prm(n.in[1]), prm(n.in[2]), BT,
                width(n.in[0]));
    } else if (n.op == "linear") {
      const bool bias = n.attr_or("bias_rank0", 0) == 0 || comms_.tp_rank == 0;
      linear_fwd(dev_, &ws_, act(n.out[0]), act(n.in[0]), prm(n.in[1]),
                 bias ? prm(n.in[2]) : nullptr, BT, width(n.in[0]), width(n.out[0]));
    } else if (n.op == "attention") {
      attention_forward(dev_, &ws_, m.flash[i] != 0, act(n.out[0]), aux, act(n.in[0]), B, T,
                        width(n.out[0]), n.attr("heads"));
    } else if (n.op == "gelu") {
      dev_.call(&dt_hal_v1_t::gelu_fwd, "gelu_fwd", act(n.out[0]),
                static_cast<const float*>(act(n.in[0])), BT * width(n.out[0]));
    } else if (n.op == "add") {
      dev_.call(&dt_hal_v1_t::add, "add", act(n.out[0]), static_cast<const float*>(act(n.in[0])),
                static_cast<const float*>(act(n.in[1])), BT * width(n.out[0]));
    } else if (n.op == "lm_head") {
      const std::int64_t C = width(n.in[0]), V = width(n.out[0]);
      if (head_.on())
        head_.forward(dev_, &ws_, act(n.out[0]), act(n.in[0]), nullptr, prm(n.in[1]), BT);
      else
        matmul(dev_, &ws_, 0, 1, BT, V, C, 1.0f, act(n.in[0]), C, prm(n.in[1]), C, 0.0f,
               act(n.out[0]), V);
    } else if (n.op == "xent") {
      if (!targets) return;
      const std::int64_t V = width(n.in[0]);
      dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(tgt),
                static_cast<const void*>(targets), BT * sizeof(std::int32_t),
                DT_HAL_HOST_TO_DEVICE);
      float* losses = aux + static_cast<std::size_t>(m.B) * m.T * static_cast<std::size_t>(V);
      dev_.call(&dt_hal_v1_t::softmax_xent_fwd, "softmax_xent_fwd", losses, aux,
                static_cast<const float*>(act(n.in[0])), static_cast<const std::int32_t*>(tgt), BT,
                V);
      dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(m.host_losses.data()),
                static_cast<const void*>(losses), BT * sizeof(float), DT_HAL_DEVICE_TO_HOST);
      for (std::int64_t k = 0; k < BT; ++k) loss += m.host_losses[static_cast<std::size_t>(k)];
    } else if (n.op == "tp_copy") {
      dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(act(n.out[0])),
                static_cast<const void*>(act(n.in[0])), BT * width(n.out[0]) * sizeof(float),
                DT_HAL_DEVICE_TO_DEVICE);
    } else if (n.op == "tp_reduce") {
      float* y = act(n.out[0]);
      dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(y),
                static_cast<const void*>(act(n.in[0])), BT * width(n.out[0]) * sizeof(float),
                DT_HAL_DEVICE_TO_DEVICE);
      dev_.call(&dt_hal_v1_t::synchronize, "synchronize");
      comms_.tp->all_reduce(view_of(y, static_cast<std::size_t>(BT * width(n.out[0]))),
                            ReduceOp::sum);
    } else if (n.op == "send") {
      const trace::Scope s("send", "pipeline", "micro-batch", micro);
      dev_.call(&dt_hal_v1_t::synchronize, "synchronize");
      const std::size_t cnt = static_cast<std::size_t>(BT * width(n.in[0]));
      const int to = comms_.stage_rank[static_cast<std::size_t>(n.attr("peer"))];
      m.fwd_sends[us] = {
          comms_.p2p->isend(ConstTensorView{act(n.in[0]), cnt, DType::f32}, to, tag_of(n, false)),
          to, cnt};
    } else if (n.op == "recv") {
      const trace::Scope s("recv", "pipeline", "micro-batch", micro);
      recv_recorded(*comms_.p2p, act(n.out[0]), static_cast<std::size_t>(BT * width(n.out[0])),
                    comms_.stage_rank[static_cast<std::size_t>(n.attr("peer"))], tag_of(n, false),
                    m.wait_s);
    } else {
      DT_THROW(InvalidArgument, "node ", n.name, ": the engine cannot run op '", n.op, "'");
    }
  };
  run_pass(dev_, m.fwd_runs, pass_graphs(m.graphs, m.fwd_graphs[us], B, 0.0f), m.counts, node);
  release_units();
  m.slot_state[us] = targets ? Impl::kTargets : Impl::kNoTargets;
  return loss;
}

void StageEngine::backward(int slot, int micro, float loss_scale, const GradReady& ready) {
  Impl& m = *impl_;
  const std::size_t us = static_cast<std::size_t>(slot);
  DT_CHECK(InvalidArgument, slot >= 0 && slot < slots_, "slot ", slot, " outside [0, ", slots_,
           ")");
  DT_CHECK(InvalidArgument, m.slot_state[us] != Impl::kEmpty, "StageEngine::backward: slot ", slot,
           " holds no finished forward pass");
  DT_CHECK(InvalidArgument, !m.has_loss || m.slot_state[us] == Impl::kTargets,
           "StageEngine::backward: the forward pass of slot ", slot,
           " had no targets, and this stage's backward starts from the loss");
  // The previous micro-batch's gradient messages read the gradient area we are about to clear.
  for (Sent& w : m.bwd_sends) wait_sent(w, m.wait_s);
  m.bwd_sends.clear();
  dev_.call(&dt_hal_v1_t::fill_zero, "fill_zero", m.grad_buf.get(), m.grad_floats * sizeof(float));
  const int B = m.slot_B[us];
  const std::int64_t T = m.T, BT = std::int64_t{B} * T;
  float* A = m.slot_buf[us].as<float>();
  float* D = m.grad_buf.as<float>();
  const std::int32_t* tok = m.token_buf[us].as<std::int32_t>();
  const std::int32_t* tgt = tok + static_cast<std::size_t>(m.B) * static_cast<std::size_t>(m.T);
  auto act = [&](int t) {
    return static_cast<const float*>(A + m.act_off[static_cast<std::size_t>(t)]);
  };
  auto grad = [&](int t) { return D + m.grad_off[static_cast<std::size_t>(t)]; };
  auto pidx = [&](int t) { return param_index_[static_cast<std::size_t>(t)]; };
  auto prm = [&](int t) { return param_ptr(static_cast<std::size_t>(pidx(t))); };
  auto dprm = [&](int t) { return grad_ptr(static_cast<std::size_t>(pidx(t))); };
  auto width = [&](int t) { return g_.tensors[static_cast<std::size_t>(t)].shape.back(); };
  const bool count = ready || hooks_.grads_done;
  if (count) m.uses = param_uses_;
  if (hooks_.grads_done) {
    m.unit_left.clear();
    for (const ZeroUnit& u : m.units) m.unit_left.push_back(static_cast<int>(u.end - u.first));
  }
  DT_CHECK(InvalidArgument, !m.graphs || !count,
           "StageEngine::backward: a pass run from graphs cannot hand gradients over node by "
           "node (no ready callback or unit hooks with set_graphs)");
  auto node = [&](std::size_t k) {
    const Node& n = g_.nodes[k];
    use_units(k, true);
    const float* aux = A + m.aux_off[k];
    if (n.op == "xent") {
      const std::int64_t V = width(n.in[0]);
      dev_.call(&dt_hal_v1_t::softmax_xent_bwd, "softmax_xent_bwd", grad(n.in[0]), aux, tgt,
                loss_scale, BT, V);
    } else if (n.op == "lm_head") {
      const std::int64_t C = width(n.in[0]), V = width(n.out[0]);
      const float* dl = grad(n.out[0]);
      if (head_.on())
        head_.backward(dev_, &ws_, grad(n.in[0]), 1.0f, dprm(n.in[1]), dl, act(n.in[0]), nullptr,
                       BT);
      else
        linear_bwd(dev_, &ws_, grad(n.in[0]), 1.0f, dprm(n.in[1]), nullptr, dl, act(n.in[0]),
                   prm(n.in[1]), BT, C, V);
    } else if (n.op == "layernorm") {
      const trace::Scope s("backward", "model", "layer", n.layer);
      dev_.call(&dt_hal_v1_t::layernorm_bwd, "layernorm_bwd", grad(n.in[0]), dprm(n.in[1]),
                dprm(n.in[2]), static_cast<const float*>(grad(n.out[0])), act(n.in[0]),
                prm(n.in[1]), aux, aux + BT, BT, width(n.in[0]));
    } else if (n.op == "linear") {
      const std::int64_t in = width(n.in[0]), out = width(n.out[0]);
      linear_bwd(dev_, &ws_, grad(n.in[0]), 1.0f, dprm(n.in[1]), dprm(n.in[2]), grad(n.out[0]),
                 act(n.in[0]), prm(n.in[1]), BT, in, out);
      if (n.attr_or("zero_key_bias", 0)) {
        // The key bias adds q_i . b_k to every score of row i, which softmax ignores: its
        // gradient is exactly zero (dt::Gpt keeps it so too).
        const std::int64_t seg = out / 3;
        dev_.call(&dt_hal_v1_t::fill_zero, "fill_zero", static_cast<void*>(dprm(n.in[2]) + seg),
                  static_cast<std::size_t>(seg) * sizeof(float));
      }
    } else if (n.op == "attention") {
      attention_backward(dev_, &ws_, m.flash[k] != 0, grad(n.in[0]), m.scratch.as<float>(),
                         grad(n.out[0]), act(n.in[0]), act(n.out[0]), DType::f32, aux, B, T,
                         width(n.out[0]), n.attr("heads"));
    } else if (n.op == "gelu") {
      dev_.call(&dt_hal_v1_t::gelu_bwd, "gelu_bwd", grad(n.in[0]), act(n.in[0]),
                static_cast<const float*>(grad(n.out[0])), BT * width(n.out[0]));
    } else if (n.op == "add") {
      const std::int64_t cnt = BT * width(n.out[0]);
      for (int in : n.in)
        dev_.call(&dt_hal_v1_t::add, "add", grad(in), static_cast<const float*>(grad(in)),
                  static_cast<const float*>(grad(n.out[0])), cnt);
    } else if (n.op == "embedding") {
      dev_.call(&dt_hal_v1_t::embedding_bwd, "embedding_bwd", dprm(n.in[1]), dprm(n.in[2]),
                static_cast<const float*>(grad(n.out[0])), tok, std::int64_t{B}, T,
                width(n.out[0]));
    } else if (n.op == "tp_copy") {
      const std::int64_t cnt = BT * width(n.out[0]);
      float* dy = grad(n.out[0]);
      dev_.call(&dt_hal_v1_t::synchronize, "synchronize");
      comms_.tp->all_reduce(view_of(dy, static_cast<std::size_t>(cnt)), ReduceOp::sum);
      dev_.call(&dt_hal_v1_t::add, "add", grad(n.in[0]), static_cast<const float*>(grad(n.in[0])),
                static_cast<const float*>(dy), cnt);
    } else if (n.op == "tp_reduce") {
      const std::int64_t cnt = BT * width(n.out[0]);
      dev_.call(&dt_hal_v1_t::add, "add", grad(n.in[0]), static_cast<const float*>(grad(n.in[0])),
                static_cast<const float*>(grad(n.out[0])), cnt);
    } else if (n.op == "recv") {
      // The gradient of what we received goes back to the stage that sent it.
      const trace::Scope s("send", "pipeline", "micro-batch", micro);
      dev_.call(&dt_hal_v1_t::synchronize, "synchronize");
      const std::size_t cnt = static_cast<std::size_t>(BT * width(n.out[0]));
      const int to = comms_.stage_rank[static_cast<std::size_t>(n.attr("peer"))];
      m.bwd_sends.push_back(
          {comms_.p2p->isend(ConstTensorView{grad(n.out[0]), cnt, DType::f32}, to, tag_of(n, true)),
           to, cnt});
    } else if (n.op == "send") {
      const trace::Scope s("recv", "pipeline", "micro-batch", micro);
      const std::int64_t cnt = BT * width(n.in[0]);
      float* tmp = m.scratch.as<float>();
      recv_recorded(*comms_.p2p, tmp, static_cast<std::size_t>(cnt),
                    comms_.stage_rank[static_cast<std::size_t>(n.attr("peer"))], tag_of(n, true),
                    m.wait_s);
      dev_.call(&dt_hal_v1_t::add, "add", grad(n.in[0]), static_cast<const float*>(grad(n.in[0])),
                static_cast<const float*>(tmp), cnt);
    } else {
      DT_THROW(InvalidArgument, "node ", n.name, ": the engine cannot run op '", n.op, "'");
    }
    if (!count) return;
    for (int t : n.in) {
      const int p = pidx(t);
      if (p < 0 || --m.uses[static_cast<std::size_t>(p)] > 0) continue;
      dev_.call(&dt_hal_v1_t::synchronize, "synchronize");
      if (ready) ready(static_cast<std::size_t>(p), static_cast<std::size_t>(p) + 1);
      if (!hooks_.grads_done) continue;
      const std::size_t u = static_cast<std::size_t>(m.unit_of[static_cast<std::size_t>(p)]);
      if (--m.unit_left[u] > 0) continue;
      hooks_.grads_done(static_cast<int>(u));  // the unit's gradients of this backward
      m.gbase[u] = nullptr;
    }
  };
  run_pass(dev_, m.bwd_runs, pass_graphs(m.graphs, m.bwd_graphs[us], B, loss_scale), m.counts,
           node);
  release_units();
}

}  // namespace dt
