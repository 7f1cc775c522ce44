// dt::LossScaler: dynamic loss scaling for fp16 (and, fixed at 1, a uniform overflow check for
// bf16 and fp32) training.
//
// One step with it, on every rank:
//   1. loss (or dloss) *= scaler.scale();                        forward and backward
//   2. found = 0 (a device int32); scale_check_finite(grads, n, scaler.inv_scale(), &found) on
//      every gradient buffer (dt_hal_v2_t), then copy `found` to the host;
//   3. global = overflow_anywhere(comm, found != 0)              one all_reduce(max) of one int
//   4. if (scaler.update(global)) optimiser step; else skip it (parameters and moments untouched).
// Every rank gets the same `global`, so every rank skips the same steps and keeps the same scale.
//
// Policy (the defaults follow Megatron-LM's DynamicGradScaler and PyTorch's GradScaler):
//  - the scale starts at `initial` (2^16);
//  - after `growth_interval` (2000) clean steps in a row it is multiplied by `growth_factor` (2),
//    up to `max_scale`;
//  - an overflow step is always skipped; the scale is multiplied by `backoff_factor` (0.5), never
//    below `min_scale` (1), once `hysteresis` overflows have been seen since the last growth (1:
//    every overflow backs off; 2: the first overflow only uses up one unit of tolerance). With
//    reset_hysteresis_on_clean_step, a clean step restores the full tolerance (DeepSpeed's
//    consecutive_hysteresis) instead of only a growth doing so.
//  - dynamic = false keeps the scale at `initial` forever; update() then only reports whether the
//    step may be applied (bf16/fp32 runs use this with initial = 1).
// Costs: nothing on the device; update() is a few host operations. Header-only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "dt/comm.hpp"
#include "dt/error.hpp"
#include "dt/tensor.hpp"

namespace dt {

struct LossScaleConfig {
  bool dynamic = true;
  double initial = 65536.0;             ///< > 0
  std::int64_t growth_interval = 2000;  ///< >= 1 clean steps before growing
  double growth_factor = 2.0;           ///< > 1
  double backoff_factor = 0.5;          ///< in (0, 1)
  double min_scale = 1.0;               ///< > 0, <= initial
  double max_scale = 16777216.0;        ///< 2^24, >= initial; growth stops here
  int hysteresis = 1;                   ///< >= 1 overflows before a back-off
  bool reset_hysteresis_on_clean_step = false;
};

class LossScaler {
 public:
  /// Throws dt::ConfigError naming the setting (loss-scale.initial, ...) when `c` is out of range.
  explicit LossScaler(const LossScaleConfig& c = {});

  /// Multiply the loss (or the gradient of the loss) by this before the backward pass.
  float scale() const noexcept { return static_cast<float>(scale_); }
  /// Multiply the gradients by this (scale_check_finite) to undo the scaling.
  float inv_scale() const noexcept { return static_cast<float>(1.0 / scale_); }

  /// Ends a step. found_inf_anywhere: some rank saw an Inf or NaN in its gradients (the same
  /// value on every rank: see overflow_anywhere). Returns true when the optimiser step must be
  /// applied, false when it must be skipped; adjusts the scale as the policy above says.
  bool update(bool found_inf_anywhere);

  /// Counters since construction (or restore).
  std::int64_t steps_skipped() const noexcept { return skipped_; }
  std::int64_t clean_steps_in_a_row() const noexcept { return growth_tracker_; }
  const LossScaleConfig& config() const noexcept { return cfg_; }

  /// Everything a checkpoint needs to resume the same scale schedule.
  struct State {
    double scale = 0;
    std::int64_t growth_tracker = 0;
    int hysteresis_left = 0;
    std::int64_t skipped = 0;
  };
  State state() const noexcept { return {scale_, growth_tracker_, hysteresis_left_, skipped_}; }
  /// Throws dt::ConfigError when the state is impossible for this config (scale out of range...).
  void restore(const State& s);

 private:
  LossScaleConfig cfg_;
  double scale_;
  std::int64_t growth_tracker_ = 0;
  int hysteresis_left_;
  std::int64_t skipped_ = 0;
};

/// The global overflow decision: an all_reduce(max) of one int32 over `comm` (host tensors, e.g.
/// the data-parallel MpiComm). Collective: every rank of `comm` must call it for the same step.
/// Returns true when any rank passed local_found_inf = true.
bool overflow_anywhere(Comm& comm, bool local_found_inf, const CommOptions& opts = {});

// ---- implementation (header-only: nothing here needs more than the host) --------------------

inline LossScaler::LossScaler(const LossScaleConfig& c) : cfg_(c) {
  DT_CHECK(ConfigError, std::isfinite(c.initial) && c.initial > 0,
           "loss-scale.initial = ", c.initial, " must be a finite number > 0");
  DT_CHECK(ConfigError, c.growth_interval >= 1, "loss-scale.growth-interval = ", c.growth_interval,
           " must be >= 1");
  DT_CHECK(ConfigError, std::isfinite(c.growth_factor) && c.growth_factor > 1,
           "loss-scale.growth-factor = ", c.growth_factor, " must be > 1");
  DT_CHECK(ConfigError, c.backoff_factor > 0 && c.backoff_factor < 1,
           "loss-scale.backoff-factor = ", c.backoff_factor, " must lie in (0, 1)");
  DT_CHECK(ConfigError, c.min_scale > 0 && c.min_scale <= c.initial,
           "loss-scale.min = ", c.min_scale,
           " must be > 0 and <= loss-scale.initial = ", c.initial);
  DT_CHECK(ConfigError, std::isfinite(c.max_scale) && c.max_scale >= c.initial,
           "loss-scale.max = ", c.max_scale,
           " must be finite and >= loss-scale.initial = ", c.initial);
  DT_CHECK(ConfigError, c.hysteresis >= 1, "loss-scale.hysteresis = ", c.hysteresis,
           " must be >= 1");
  scale_ = c.initial;
  hysteresis_left_ = c.hysteresis;
}

inline bool LossScaler::update(bool found_inf_anywhere) {
  if (found_inf_anywhere) {
    ++skipped_;
    growth_tracker_ = 0;
    if (cfg_.dynamic) {
      hysteresis_left_ = std::max(0, hysteresis_left_ - 1);
      if (hysteresis_left_ == 0) scale_ = std::max(cfg_.min_scale, scale_ * cfg_.backoff_factor);
    }
    return false;
  }
  if (!cfg_.dynamic) return true;
  if (cfg_.reset_hysteresis_on_clean_step) hysteresis_left_ = cfg_.hysteresis;
  if (++growth_tracker_ >= cfg_.growth_interval) {
    growth_tracker_ = 0;
    hysteresis_left_ = cfg_.hysteresis;
    scale_ = std::min(cfg_.max_scale, scale_ * cfg_.growth_factor);
  }
  return true;
}

inline void LossScaler::restore(const State& s) {
  DT_CHECK(ConfigError, s.scale >= cfg_.min_scale && s.scale <= cfg_.max_scale,
           "loss scaler state: scale ", s.scale, " lies outside [loss-scale.min = ", cfg_.min_scale,
           ", loss-scale.max = ", cfg_.max_scale, "]");
  DT_CHECK(ConfigError, s.growth_tracker >= 0 && s.growth_tracker < cfg_.growth_interval,
           "loss scaler state: ", s.growth_tracker,
           " clean steps in a row lies outside [0, loss-scale.growth-interval = ",
           cfg_.growth_interval, ")");
  DT_CHECK(ConfigError, s.hysteresis_left >= 0 && s.hysteresis_left <= cfg_.hysteresis,
           "loss scaler state: hysteresis left ", s.hysteresis_left,
           " lies outside [0, loss-scale.hysteresis = ", cfg_.hysteresis, "]");
  DT_CHECK(ConfigError, s.skipped >= 0, "loss scaler state: skipped steps ", s.skipped,
           " is negative");
  scale_ = s.scale;
  growth_tracker_ = s.growth_tracker;
  hysteresis_left_ = s.hysteresis_left;
  skipped_ = s.skipped;
}

inline bool overflow_anywhere(Comm& comm, bool local_found_inf, const CommOptions& opts) {
  std::int32_t flag = local_found_inf ? 1 : 0;
  comm.all_reduce(view_of(&flag, 1), ReduceOp::max, opts);
  return flag != 0;
}

}  // namespace dt
