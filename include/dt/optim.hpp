// AdamW with decoupled weight decay on fp32 master weights, the warmup + cosine learning-rate
// schedule of nanoGPT, and global-norm gradient clipping.
#pragma once

#include <cstdint>
#include <vector>

#include "dt/comm.hpp"
#include "dt/device.hpp"
#include "dt/gpt.hpp"

namespace dt {

struct OptimConfig {
  double lr = 1e-3;
  double min_lr = 1e-4;
  std::int64_t warmup = 10;
  std::int64_t decay_steps = 1000;  ///< cosine reaches min_lr here and stays
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;  ///< <= 0 disables clipping
};

/// Learning rate at 0-based step `step`: linear warmup (lr * (step + 1) / (warmup + 1)), then
/// cosine from lr to min_lr until decay_steps, then min_lr.
double lr_at(const OptimConfig& c, std::int64_t step);

class AdamW {
 public:
  /// Moments for `params` (zeroed) on `dev`; the table is copied. Throws InvalidArgument when a
  /// parameter lies outside the `numel` elements.
  AdamW(const Device& dev, const std::vector<ParamInfo>& params, std::size_t numel);

  /// Global L2 norm of `grads` (n elements); if above `clip` (> 0), scales grads to norm `clip`.
  /// Returns the norm before clipping.
  double clip_grad_norm(float* grads, double clip);
  /// The same for a rank holding part of the model: the norm is over the parameters marked in
  /// `counted` (one flag per parameter; every global element counted on exactly one rank) summed
  /// over `comm`; every rank scales all of its gradients. Collective over `comm`.
  double clip_grad_norm(float* grads, double clip, const std::vector<char>& counted, Comm& comm);
  /// One step (t is 1-based) with learning rate lr; decay only on params marked decay. One fused
  /// call (adamw_multi) where the device has it, else one adamw call per range of parameters.
  void step(float* params, const float* grads, double lr, const OptimConfig& c);

  std::int64_t steps() const noexcept { return t_; }
  float* m() const noexcept { return m_.as<float>(); }
  float* v() const noexcept { return v_.as<float>(); }
  /// For resuming: the number of steps already taken.
  void set_steps(std::int64_t t) noexcept { t_ = t; }

 private:
  void clip_to(float* grads, double norm, double clip);
  const Device& dev_;
  std::vector<ParamInfo> params_;  // a copy: a temporary table may be passed
  struct Range {
    std::int64_t offset, numel;
    bool decay;
  };
  std::vector<Range> ranges_;  // the parameters, neighbours with the same decay merged
  std::size_t n_;
  Device::Buffer m_, v_;
  std::int64_t t_ = 0;
};

}  // namespace dt
