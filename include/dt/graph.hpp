// dt::graph: the model as a graph IR, and the passes that turn it into one plan per rank.
//
// A Graph holds tensors (shape, dtype, role, sharding) and nodes (op kind, inputs, outputs,
// integer attributes, the layer they belong to, the pipeline stage that runs them), in a
// topological order: a node only reads tensors produced by earlier nodes (or graph inputs and
// parameters). Activation shapes carry the micro-batch: [B, T, C].
//
// The passes are plain functions from graph to graph (or to figures about one), each tested on its
// own:
//   build_gpt          the GPT of dt/gpt.hpp as a graph (nanoGPT parameter names)
//   infer_shapes       recomputes every output shape from the inputs and attributes, and checks them
//   costs              FLOPs, bytes moved, activation and parameter memory per node
//   tp_rewrite         Megatron-style tensor parallelism: c_attn and c_fc column-parallel (heads
//                      split), c_proj row-parallel, with the forward/backward collectives inserted
//   partition          contiguous pipeline stages minimising the most expensive one (exact DP)
//   pipeline_split     assigns stages and inserts send/recv where a tensor crosses a cut
//   stage_graph        the nodes one stage runs
//   estimate_memory    bytes one rank needs for a plan (parameters, gradients, AdamW moments,
//                      activations kept in flight by the 1F1B schedule)
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dt/dtype.hpp"
#include "dt/gpt.hpp"
#include "dt/tensor.hpp"

namespace dt::graph {

/// How a tensor is laid out over the ranks of a mesh dimension.
struct Sharding {
  enum class Kind { replicated, split, block };
  Kind kind = Kind::replicated;
  int dim = -1;    ///< split: the dimension cut into `parts` equal pieces
  int parts = 1;   ///< split / block: pieces along `dim` (block: per grid cell)
  int blocks = 1;  ///< block: the dimension is a grid of `blocks` segments (q|k|v), each cut in parts
  /// "replicated", "split(dim=0, 2)", "block(dim=0, 3x2)"
  std::string str() const;
  bool operator==(const Sharding& o) const {
    return kind == o.kind && dim == o.dim && parts == o.parts && blocks == o.blocks;
  }
};

enum class Role { input, param, activation, output };
const char* role_name(Role r) noexcept;

struct TensorInfo {
  std::string name;  ///< parameters: the nanoGPT name; activations: "h.0.qkv"
  Shape shape;       ///< local shape (after sharding)
  DType dtype = DType::f32;
  Role role = Role::activation;
  Sharding sharding;  ///< over the tensor-parallel group
  Shape global_shape; ///< parameters: the unsharded shape
  bool tied = false;  ///< parameters used by more than one stage (wte: embedding and head)
};

/// Op kinds: embedding, layernorm, linear, attention, gelu, add, lm_head, xent (the model);
/// tp_copy (identity forward, all_reduce of the gradient over the tensor-parallel group),
/// tp_reduce (all_reduce forward, identity backward); send, recv (pipeline edges; attr "peer" is
/// the stage at the other end).
struct Node {
  std::string op;
  std::string name;  ///< "h.0.attn.c_attn"
  std::vector<int> in, out;
  std::map<std::string, std::int64_t> attrs;
  int layer = -1;  ///< -1: embedding; layers: the head (ln_f, lm_head, loss)
  int stage = 0;
  std::int64_t attr(const std::string& key) const;
  std::int64_t attr_or(const std::string& key, std::int64_t def) const;
};

struct Graph {
  std::vector<TensorInfo> tensors;
  std::vector<Node> nodes;
  int layers = 0;  ///< transformer blocks (the units pipeline cuts fall between)

  int add_tensor(TensorInfo t);
  Node& add_node(Node n);
  /// The tensor named `name`; throws dt::InvalidArgument when there is none.
  int tensor(const std::string& name) const;
  /// Number of nodes of kind `op`.
  int count(const std::string& op) const;
};

/// The GPT of `c` for micro-batches of B sequences of T tokens (T <= c.block).
Graph build_gpt(const GptConfig& c, int B, int T);

/// Recomputes the shape of every node output from its inputs and attributes and checks each
/// input against what the op needs; throws dt::InvalidArgument naming the node, the tensor and
/// both shapes. Returns the graph with the shapes filled in.
Graph infer_shapes(Graph g);

struct NodeCost {
  double fwd_flops = 0, bwd_flops = 0;
  double bytes = 0;           ///< bytes read and written by forward + backward
  double act_bytes = 0;       ///< activations (and kernel state) kept from forward to backward
  double param_bytes = 0;     ///< parameters the node owns (tied parameters counted once)
  double comm_bytes = 0;      ///< bytes a collective or point-to-point node moves per direction
};
std::vector<NodeCost> costs(const Graph& g);
/// Sum of forward + backward FLOPs per unit: unit 0 is layer 0 with the embedding, the last unit
/// is the last layer with the head, as pipeline cuts fall between layers.
std::vector<double> layer_costs(const Graph& g);

/// Megatron tensor parallelism over `tp` ranks: every rank runs the returned graph with its own
/// shard (shapes are local). Throws dt::ConfigError when tp does not divide the heads (and so the
/// embedding width).
Graph tp_rewrite(const Graph& g, int tp);

/// Cuts `cost` (one entry per unit, >= 0) into `stages` contiguous non-empty groups minimising
/// the largest group sum, exactly (dynamic programming, O(n^2 stages)); ties go to the earliest
/// cut. Returns the first unit of each stage (stages entries, starting with 0). Needs
/// 1 <= stages <= cost.size().
std::vector<int> partition(const std::vector<double>& cost, int stages);
/// The largest group sum of a cut as partition() returns it.
double max_stage_cost(const std::vector<double>& cost, const std::vector<int>& first);

/// Assigns every node its stage (layers [first[s], first[s+1]) on stage s; the embedding on stage
/// 0, the head on the last) and inserts a send on the producer's stage and a recv on the
/// consumer's stage for every activation that crosses a cut (its gradient travels back the same
/// way). Parameters used on two stages (wte) are marked tied.
Graph pipeline_split(const Graph& g, const std::vector<int>& first);
/// The nodes of `stage`, in order, with only the tensors they touch kept (ids renumbered).
Graph stage_graph(const Graph& g, int stage);

struct MemoryEstimate {
  double params = 0, grads = 0, optim = 0, activations = 0;
  double total() const { return params + grads + optim + activations; }
};
/// Bytes for one rank running stage graph `g` with `in_flight` micro-batches of activations
/// alive at once (1F1B: min(stages - stage, micro-batches)), fp32 parameters, gradients and two
/// AdamW moments.
MemoryEstimate estimate_memory(const Graph& g, int in_flight);
/// Elements of the largest operand of a matrix product in `g` (linear and lm_head nodes, forward
/// and backward): what each of the two 16-bit operand buffers of bf16/fp16 training must hold.
std::size_t gemm_operand_elements(const Graph& g);

/// Where part `part` of parameter `t` lies in its global tensor: local elements
/// [local, local + len * count) are the global row-major elements begin + j * stride + [0, len),
/// j in [0, count), row j at local + j * len. The runs cover the shard in local order.
struct ShardRun {
  std::size_t local = 0, begin = 0, len = 0, stride = 0, count = 1;
};
std::vector<ShardRun> shard_runs(const TensorInfo& t, int part);

/// Copies part `part` (0 .. parts-1) of parameter `t`'s global tensor (t.global_shape) into
/// `local` (t.shape), as t.sharding lays it out; replicated tensors are copied whole.
void take_shard(const TensorInfo& t, int part, const float* global, float* local);
/// The inverse of take_shard: writes `local` into its place in `global`.
void put_shard(const TensorInfo& t, int part, const float* local, float* global);

/// Human-readable listing of a (stage) graph: one line per node with its inputs and outputs,
/// shapes and shardings.
std::string to_text(const Graph& g);
/// Graphviz DOT of a graph; nodes are clustered by stage.
std::string to_dot(const Graph& g, const std::string& title);

}  // namespace dt::graph
