// The parallel plan of a training job: layout (chosen or checked), micro-batches, pipeline cuts
// and each stage's graph, with the per-rank memory estimate checked against mem.limit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dt/graph.hpp"
#include "dt/mesh.hpp"

namespace dt {

struct PlanRequest {
  GptConfig model;
  std::int64_t batch = 8;         ///< global sequences per step
  std::int64_t micro_batch = 0;   ///< train.micro-batch (0: from microbatches or the share)
  std::int64_t microbatches = 0;  ///< parallel.microbatches (0: from micro_batch)
  Layout layout;                  ///< dp 0: world / (tp * pp)
  int zero = 0;                   ///< parallel.zero: state sharded over the dp ranks
  bool graph_engine = false;      ///< parallel.engine=graph (else the fused model at tp = pp = 1)
  std::size_t bucket_bytes = 0;   ///< train.bucket-mb (ZeRO-1's buckets)
  bool automatic = false;         ///< parallel.auto
  bool low_precision = false;     ///< train.dtype bf16/fp16: fp32 master copy, 16-bit GEMM operands
  bool grad_wire16 = false;  ///< train.grad-reduce=bf16: a 16-bit copy of the gradients (dp > 1)
  double mem_limit = 0;      ///< bytes per rank (0: none)
  int world = 1;
  int ranks_per_node = 1;  ///< smallest number of ranks on a node
  /// --eval-only: no training step is taken, so a batch that does not divide over the
  /// data-parallel ranks is rounded up to one that does (and a micro-batch size or count that
  /// does not divide the share is left to the plan) instead of being refused.
  bool evaluation_only = false;
};

struct Plan {
  Layout layout;
  std::int64_t local_batch = 0;  ///< sequences per data-parallel rank and step
  std::int64_t micro = 0;        ///< sequences per micro-batch
  int microbatches = 1;
  std::vector<int> first_layer;  ///< first layer of each stage
  graph::Graph full;             ///< tensor-parallel rewrite, pipeline split (all stages)
  std::vector<graph::MemoryEstimate> memory;  ///< per stage
  std::string why;                            ///< parallel.auto: the reasoning, one line
  /// Micro-batches of activations stage s keeps at once under 1F1B.
  int in_flight(int stage) const;
  graph::Graph stage(int s) const { return graph::stage_graph(full, s); }
};

/// Checks or chooses the layout and builds the plan; throws dt::ConfigError naming the options
/// (layout, micro-batches, memory over mem.limit) before anything is allocated.
Plan make_plan(const PlanRequest& r);

/// "12.3 MiB"
std::string format_bytes(double bytes);

}  // namespace dt
