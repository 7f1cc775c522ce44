// dt::ZeroShards: sharded data parallelism (ZeRO stages 1-3, FSDP-style) over the data-parallel
// ranks of a model whose parameters are cut into units.
//
// A unit is a run of whole parameter tensors (GPT: the embeddings, each block, the final norm).
// The model's flat buffers use a padded layout in which every unit is padded with zeros to a
// multiple of the data-parallel size N; rank r owns the r-th of the N equal slices of every unit
// (its shard), so a unit's gradients reduce-scatter and its parameters all-gather with equal
// counts. Each rank keeps, for its shard only: the fp32 master parameters, the AdamW moments
// (the optimiser runs on the shard) and the reduced gradients.
//
//   stage 1: full parameters and gradients stay in the model; after the last micro-batch's
//            backward, each unit's gradients are reduce-scattered into the shard as soon as they
//            are final (overlapped with the rest of backward); after the step the updated shards
//            are all-gathered into the model's parameters.
//   stage 2: gradients also stay sharded: each unit's gradients are computed into a pooled
//            buffer, reduce-scattered and added into the shard during backward (every
//            micro-batch), and the buffer is reused.
//   stage 3: parameters also stay sharded: a unit's parameters are all-gathered into a buffer
//            just before its forward or backward and released after it, and the next unit's
//            gather runs on the communication thread while this one computes.
// Buffers (stages 2-3): one unit has one of its own (GPT's embeddings, tied to the head, so used
// first and last in backward; a pipeline's last stage: the head's tied word embedding, the
// largest unit); the other units share two, each the size of the largest of them.
//
// Collectives run on the ZeroShards' own communicators, each driven by its own progress thread:
// every rank of the data-parallel group must make the same sequence of calls.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/progress.hpp"
#include "dt/comm.hpp"
#include "dt/device.hpp"
#include "dt/gpt.hpp"

namespace dt {

/// Parameters [first, end) of a unit.
struct ZeroUnit {
  std::size_t first = 0, end = 0;
};

/// The piece of a parameter tensor in this rank's shard.
struct ZeroPiece {
  std::size_t param = 0;        ///< index into the packed parameter table
  std::size_t begin = 0, end = 0;  ///< row-major element range inside the tensor
  std::size_t local = 0;        ///< offset of element `begin` in the shard buffers
};

/// Bytes of model state per rank (see ZeroShards::memory()).
struct ZeroMemory {
  std::size_t params = 0;     ///< compute parameters (full, or shard + gather buffers)
  std::size_t grads = 0;      ///< gradients (full, or shard + reduce buffers)
  std::size_t optimizer = 0;  ///< fp32 master shard and the two AdamW moments
};

/// The unit holding GPT's word embedding (the largest, used first and last: it gets a buffer of
/// its own), else 0.
int embedding_unit(const std::vector<ZeroUnit>& units, const std::vector<ParamInfo>& params);

/// Bytes of model state per rank of ZeroShards(stage, params, units, ...) over `ranks` with
/// `own_buffer`, its buffers included (`low_precision`: also the rounded shard it gathers from).
ZeroMemory zero_memory(int stage, const std::vector<ParamInfo>& params,
                       const std::vector<ZeroUnit>& units, int ranks, int own_buffer,
                       bool low_precision);

class ZeroShards {
 public:
  /// `params`: the packed parameter table (offsets without padding); `units` cover it in order.
  /// `gather` and `reduce` are communicators over the same data-parallel ranks (duplicates: each
  /// is used by one progress thread). `low_precision`: the compute parameters are the master's
  /// rounding, made by `round` (n floats of device memory in place). `own_buffer`: the unit
  /// with a buffer of its own.
  ZeroShards(const Device& dev, int stage, std::vector<ParamInfo> params,
             std::vector<ZeroUnit> units, std::unique_ptr<Comm> gather,
             std::unique_ptr<Comm> reduce, std::function<void(float*, std::size_t)> round,
             int own_buffer = 0);
  ~ZeroShards();
  ZeroShards(const ZeroShards&) = delete;
  ZeroShards& operator=(const ZeroShards&) = delete;

  int stage() const noexcept { return stage_; }
  int ranks() const noexcept { return n_; }
  int rank() const noexcept { return r_; }
  /// The parameter table with padded offsets (the model's flat layout).
  const std::vector<ParamInfo>& padded() const noexcept { return padded_; }
  std::size_t padded_numel() const noexcept { return padded_total_; }
  const std::vector<ZeroUnit>& units() const noexcept { return units_; }
  /// The unit whose parameters start at `first` (-1 if none).
  int unit_starting_at(std::size_t first) const;
  /// Element offset of unit u in the padded layout.
  std::size_t unit_offset(int u) const { return A_[static_cast<std::size_t>(u)]; }
  /// Unit u's slice in the shard buffers: its offset and length (padding included).
  std::size_t unit_local(int u) const { return loc_[static_cast<std::size_t>(u)]; }
  std::size_t unit_slice(int u) const { return s_[static_cast<std::size_t>(u)]; }

  /// Elements of the shard buffers (every unit's slice, padding included).
  std::size_t shard_numel() const noexcept { return n_loc_; }
  /// The shard as AdamW parameters (one per piece; padding belongs to none).
  const std::vector<ParamInfo>& shard_params() const noexcept { return shard_params_; }
  const std::vector<ZeroPiece>& pieces() const noexcept { return pieces_; }
  float* master() const noexcept { return master_.as<float>(); }
  float* grads() const noexcept { return grads_.as<float>(); }

  /// Copies this rank's slices out of a full padded buffer into `shard` (default: the master).
  void take_shard(const float* padded_full, float* shard = nullptr);
  /// All-gathers every rank's `shard` (host memory) into `padded_full` (host). Collective.
  void gather(const float* shard, float* padded_full);
  /// Fills the master shard piece by piece: `whole(i, out)` writes parameter i (host memory).
  void init_shard(const std::function<void(std::size_t, float*)>& whole);
  /// After the master shard changed (step, load): rounds it for compute (low precision) and,
  /// stages 1-2, all-gathers it into `model_params` (padded layout); stage 3 drops cached units.
  void publish(float* model_params);
  /// The whole packed (unpadded) master parameters, on every rank. Collective.
  std::vector<float> gather_master();

  // ---- gradients ----
  /// Zeroes the gradient shard (start of a step).
  void begin_step();
  /// Stage 1: unit u's gradients (padded layout, at `unit_grads`) are final for this step: queue
  /// their reduce-scatter into the shard.
  void grads_final(int u, const float* unit_grads);
  /// Stages 2-3: a zeroed buffer for unit u's gradients (padded unit layout) of one backward.
  float* grads_buffer(int u);
  /// Stages 2-3: unit u's gradients in its buffer are complete: queue reduce-scatter and add.
  void grads_done(int u);
  /// Waits for every queued reduction (errors rethrown).
  void finish_grads();

  // ---- stage 3 parameters ----
  /// Unit u's parameters (padded unit layout), gathered if not cached; starts gathering `next`
  /// (-1: none) into the other buffer when one is free.
  const float* acquire(int u, int next);
  void release(int u);

  /// The model's unit hooks for this stage: acquire/release (stage 3) and grads/grads_done
  /// (stages 2-3) call the functions above.
  UnitHooks hooks();

  /// Model state bytes this rank holds (the gather/reduce buffers included).
  ZeroMemory memory() const;

 private:
  struct Slot;
  Work gather_into(Slot& s, int u);
  void wait_slot(Slot& s);
  /// Whether buffer `s` may hold unit u (unit 0 has its own).
  bool fits(const Slot& s, int u) const;
  const Device& dev_;
  int stage_, own_, n_, r_;
  std::vector<ParamInfo> params_, padded_, shard_params_;
  std::vector<ZeroUnit> units_;
  std::vector<ZeroPiece> pieces_;
  std::vector<std::size_t> A_, S_, s_, loc_;  // per unit: padded offset, size, slice, local offset
  std::size_t padded_total_ = 0, n_loc_ = 0;
  std::unique_ptr<Comm> gather_comm_, reduce_comm_;
  std::function<void(float*, std::size_t)> round_;
  Device::Buffer master_, grads_, work_;  // work_: the rounded master (low precision) gathered
  std::vector<std::unique_ptr<Slot>> param_slots_, grad_slots_;
  std::vector<Work> pending_;  // stage 1 reductions in flight
  std::unique_ptr<ProgressQueue> gather_q_, reduce_q_;  // destroyed first (declared last)
  const float* work() const { return work_.bytes() ? work_.as<float>() : master_.as<float>(); }
};

/// GPT's units: the embeddings, each block, the final LayerNorm.
std::vector<ZeroUnit> gpt_units(const GptConfig& c);
/// Units of a parameter table in nanoGPT names (a pipeline stage's): each block
/// ("transformer.h.N.*"), the final LayerNorm, and every other tensor alone (so the word
/// embedding, tied to the head on the last stage, is a unit of its own on both stages and its
/// shards match).
std::vector<ZeroUnit> layer_units(const std::vector<ParamInfo>& params);
/// Gradient buckets of ZeRO-1: consecutive units merged while the merged unit holds at most
/// `max_bytes` of fp32 (a larger unit stays alone), so small layers reduce-scatter as one. A
/// merged unit's gradients are final when those of its first unit are (backward runs the units
/// in reverse).
std::vector<ZeroUnit> merge_units(const std::vector<ZeroUnit>& units,
                                  const std::vector<ParamInfo>& params, std::size_t max_bytes);
/// The units ZeroShards of `stage` shards by: `layers`, merged into gradient buckets of
/// `bucket_bytes` at stage 1 (it holds whole gradients anyway); stages 2-3 reduce and gather layer
/// by layer, their buffers a layer's size.
std::vector<ZeroUnit> zero_units(int stage, const std::vector<ZeroUnit>& layers,
                                 const std::vector<ParamInfo>& params, std::size_t bucket_bytes);

}  // namespace dt
