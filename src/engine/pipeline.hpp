// The pipeline engine: the 1F1B schedule and the executor of one rank's stage graph.
//
// StageEngine interprets a stage graph (dt/graph.hpp) node by node on a dt::Device: forward in
// graph order, backward in reverse, with activations kept per in-flight micro-batch ("slot") and
// one set of activation gradients. Tensor-parallel collectives run on the TP communicator;
// pipeline edges are point-to-point messages (activations forward, their gradients backward).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "dt/comm.hpp"
#include "dt/device.hpp"
#include "dt/gpt.hpp"
#include "dt/graph.hpp"
#include "engine/zero.hpp"
#include "model/layers.hpp"

namespace dt {

struct PipeAction {
  enum class Kind { forward, backward };
  Kind kind = Kind::forward;
  int micro = 0;
};

/// The 1F1B order for `stage` of `stages` over `micro` micro-batches: a warm-up of
/// min(stages - stage - 1, micro) forwards, then one forward and one backward in turn, then the
/// remaining backwards (cool-down). Every micro-batch appears once as forward and once as backward.
std::vector<PipeAction> one_f_one_b(int stage, int stages, int micro);

/// How many micro-batches after taking it a pipeline of `stages` reads a vote that every rank
/// takes just before each forward (the drain vote): `stages`, the fewest for which every stage's
/// forward k, and so its vote k, has run before any stage's forward k + lag starts, by the
/// schedule's order alone, whatever the passes' times; so reading it waits for no stage of the
/// pipeline. (With one fewer, a read follows the pass each other stage ran just before its vote,
/// but not the vote itself.) 0 for one stage (no pass in flight: read at once).
int vote_lag(int stages);

/// Runs the 1F1B schedules of all stages against each other with forward time `tf` and backward
/// time `tb` per micro-batch on every stage and free communication; returns the time the last
/// stage finishes. Throws dt::InternalError when the schedules deadlock.
double simulate_1f1b(int stages, int micro, double tf, double tb);

/// Communicators a stage uses.
struct StageComms {
  Comm* tp = nullptr;  ///< tensor-parallel group (may be null when tp == 1)
  int tp_rank = 0;
  P2p* p2p = nullptr;           ///< pipeline messages (may be null with one stage)
  std::vector<int> stage_rank;  ///< p2p rank of every stage of this rank's pipeline
};

class StageEngine {
 public:
  /// `g`: this rank's stage graph (shapes with the largest micro-batch). `slots`: micro-batches
  /// whose activations are kept at once. `storage`: where parameters and gradients live, as for
  /// dt::Gpt: a padded layout of param_table(g) (sharded data parallelism), gradients in host
  /// memory (a shared-memory arena; packed layout only), or none of the engine's own (then
  /// set_unit_hooks supplies them unit by unit).
  StageEngine(const Device& dev, graph::Graph g, const GptConfig& model, int stage, int stages,
              int slots, StageComms comms, GptStorage storage = {});
  ~StageEngine();
  StageEngine(const StageEngine&) = delete;
  StageEngine& operator=(const StageEngine&) = delete;

  /// This rank's parameters (shards), nanoGPT names, offsets into the flat buffers.
  const std::vector<ParamInfo>& params() const noexcept { return params_; }
  /// The graph tensor of parameter i (its sharding and global shape).
  const graph::TensorInfo& param_tensor(std::size_t i) const {
    return g_.tensors[static_cast<std::size_t>(param_tensor_id_[i])];
  }
  /// Index of parameter i in gpt_params(model).
  std::size_t global_index(std::size_t i) const { return global_index_[i]; }
  /// The stage's parameter table, packed, in graph order (nanoGPT order): what params() is
  /// without a storage layout.
  static std::vector<ParamInfo> param_table(const graph::Graph& g);
  /// Number of parameters of the local flat buffer, for sizing a gradient arena before
  /// construction.
  static std::size_t count_params(const graph::Graph& g);
  std::size_t num_params() const noexcept { return nparams_; }
  /// Null when the parameters come from the unit hooks.
  float* param_data() const noexcept { return param_buf_.as<float>(); }
  /// Null when the gradients go to the unit hooks.
  float* grad_data() const noexcept { return grad_; }
  /// Sharded parameters or gradients: `units` cut params() into runs of whole tensors in order;
  /// each forward and backward asks `hooks` for a unit's parameters just before a node reads
  /// them (naming the next unit it will need) and releases them when a node needs others;
  /// each backward takes a gradient buffer per unit and hands it back when the unit's gradients
  /// are complete.
  void set_unit_hooks(std::vector<ZeroUnit> units, UnitHooks hooks);
  /// engine.cuda_graphs: each forward and backward runs the device work between its host points
  /// (token copies, the loss read-back, tensor-parallel collectives, pipeline messages) from
  /// graphs, one per stretch of device work: a slot's first pass in each direction at a batch
  /// size runs eagerly, the next is captured and launched, later ones replay (captured again for
  /// a new loss scale). Needs the device's graph entries and no unit hooks; a backward then takes
  /// no GradReady. Work goes to the device's current stream. Turn it on once every pass at the
  /// largest batch ran eagerly (a device may not grow its scratch memory while graphs live);
  /// off destroys the graphs.
  void set_graphs(bool on);
  bool graphs() const noexcept;
  struct GraphCounts {
    std::int64_t captured = 0;  ///< graphs captured
    std::int64_t launched = 0;  ///< graph launches
    std::int64_t passes = 0;    ///< forward or backward passes run from graphs
  };
  GraphCounts graph_counts() const;
  /// Matrix products in `t` (f32, bf16 or f16; see GemmWorkspace in model/layers.hpp); the
  /// 16-bit operand buffers are allocated here for the stage's largest product.
  void set_compute(DType t);
  /// The stage's parameters in the compute type, as for dt::Gpt::set_weights16.
  void set_weights16(const void* w16, std::size_t n);
  std::int64_t weight_copy_reads() const noexcept { return ws_.copy_reads; }
  /// Bytes of the activation, activation-gradient and scratch buffers.
  std::size_t activation_bytes() const;
  /// Where a stage graph's activations go: per slot (micro-batch in flight) its activations and
  /// the nodes' kernel state (layernorm mean and rstd, attention's probabilities or, where
  /// flash(node), one log-sum-exp per row, the loss's probabilities and per-token losses), once
  /// the activation gradients and a scratch area (the largest attention state or message sent).
  /// The engine lays its buffers out by it, and the plan counts them by it.
  struct Layout {
    std::vector<std::size_t> act_off, grad_off;  // per tensor, floats into a slot's / the grads
    std::vector<std::size_t> aux_off;            // per node, floats into a slot's area
    std::vector<char> flash;                     // per node
    std::size_t slot_floats = 0, grad_floats = 0, scratch_floats = 0;
    int B = 0, T = 0;  // the graph's micro-batch
    /// Bytes the engine allocates by it with `slots` in flight (with each slot's int32 inputs
    /// and targets), the parts activation_bytes() adds to it aside.
    std::size_t bytes(int slots) const;
  };
  static Layout layout_of(const graph::Graph& g,
                          const std::function<bool(const graph::Node&)>& flash);
  const graph::Graph& graph() const noexcept { return g_; }
  bool first_stage() const noexcept { return stage_ == 0; }
  bool last_stage() const noexcept { return stage_ == stages_ - 1; }

  /// Draws every parameter as dt::Gpt::init(seed) does and keeps this rank's shard.
  void init(std::uint64_t seed);
  /// Writes this rank's shard of parameter i as init(seed) draws it (params()[i].numel floats,
  /// host memory).
  void init_param(std::uint64_t seed, std::size_t i, float* out) const;
  void zero_grad();

  /// Forward of `micro` in `slot` on B sequences (B <= the graph's micro-batch): `inputs` and
  /// `targets` are host arrays of B x T tokens (read by the stage that embeds, resp. computes the
  /// loss). Returns the sum of token losses on the last stage, 0 elsewhere.
  double forward(int slot, int micro, const std::int32_t* inputs, const std::int32_t* targets,
                 int B);
  /// Backward of `micro` (whose forward ran in `slot`): gradients of loss_scale x sum of token
  /// losses are added to the gradient buffer. `ready(first, end)`, when set, is called as each
  /// parameter's gradient becomes final for this backward (indices into params()).
  using GradReady = std::function<void(std::size_t first, std::size_t end)>;
  void backward(int slot, int micro, float loss_scale, const GradReady& ready = {});
  /// Waits for every point-to-point send still in flight.
  void wait_sends();
  /// Seconds spent blocked on pipeline messages (receives, and sends not yet taken) since the
  /// last call: the stage's idle time, bubble included.
  double take_wait_seconds();

 private:
  struct Impl;
  /// Node k's parameters (its kernels read them) and gradients, through the unit hooks.
  void use_units(std::size_t k, bool backward);
  void release_units();
  /// Destroys every captured graph (the next passes run eagerly first, then capture again).
  void drop_graphs();
  const float* param_ptr(std::size_t p) const;
  float* grad_ptr(std::size_t p);
  const Device& dev_;
  graph::Graph g_;
  GptConfig model_;
  int stage_, stages_, slots_;
  StageComms comms_;
  std::vector<ParamInfo> params_;
  std::vector<int> param_index_;           // tensor id -> index into params_ (-1: not a parameter)
  std::vector<int> param_tensor_id_;       // index into params_ -> tensor id
  std::vector<std::size_t> global_index_;  // index into params_ -> index in gpt_params()
  std::vector<int> param_uses_;            // index into params_ -> nodes that read it
  std::size_t nparams_ = 0;
  std::size_t capacity_ = 0;  // floats in the parameter and gradient buffers (>= nparams_)
  Device::Buffer param_buf_, grad_buf_;
  float* grad_ = nullptr;
  UnitHooks hooks_;
  GemmWorkspace ws_;  // matrix products in the compute dtype (set_compute)
  PaddedHead head_;   // model.pad-vocab, when this stage holds the head
  std::unique_ptr<Impl> impl_;
};

}  // namespace dt
