#include <cmath>

#include "dt/optim.hpp"

namespace dt {

double lr_at(const OptimConfig& c, std::int64_t step) {
  if (step < c.warmup)
    return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup + 1);
  if (step >= c.decay_steps) return c.min_lr;
  const double ratio = static_cast<double>(step - c.warmup) /
                       static_cast<double>(std::max<std::int64_t>(1, c.decay_steps - c.warmup));
  const double coeff = 0.5 * (1.0 + std::cos(M_PI * ratio));
  return c.min_lr + coeff * (c.lr - c.min_lr);
}

AdamW::AdamW(const Device& dev, const std::vector<ParamInfo>& params, std::size_t numel)
    : dev_(dev),
      params_(params),
      n_(numel),
      m_(dev, numel * sizeof(float)),
      v_(dev, numel * sizeof(float)) {
  for (const ParamInfo& p : params_)
    DT_CHECK(InvalidArgument, p.offset + p.numel <= numel, "AdamW: parameter ", p.name, " [",
             p.offset, ", ", p.offset + p.numel, ") lies outside the ", numel,
             " elements of the optimizer state");
  dev_.call(&dt_hal_v1_t::fill_zero, "fill_zero", m_.get(), numel * sizeof(float));
  dev_.call(&dt_hal_v1_t::fill_zero, "fill_zero", v_.get(), numel * sizeof(float));
}

double AdamW::clip_grad_norm(float* grads, double clip) {
  double ss = 0;
  dev_.call(&dt_hal_v1_t::sum_squares, "sum_squares", static_cast<const float*>(grads),
            static_cast<std::int64_t>(n_), &ss);
  const double norm = std::sqrt(ss);
  clip_to(grads, norm, clip);
  return norm;
}

double AdamW::clip_grad_norm(float* grads, double clip, const std::vector<char>& counted,
                             Comm& comm) {
  DT_CHECK_EQ(InvalidArgument, counted.size(), params_.size(), "one flag per parameter");
  double ss = 0;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!counted[i]) continue;
    double part = 0;
    dev_.call(&dt_hal_v1_t::sum_squares, "sum_squares",
              static_cast<const float*>(grads + params_[i].offset),
              static_cast<std::int64_t>(params_[i].numel), &part);
    ss += part;
  }
  comm.all_reduce(view_of(&ss, 1), ReduceOp::sum);
  const double norm = std::sqrt(ss);
  clip_to(grads, norm, clip);
  return norm;
}

void AdamW::clip_to(float* grads, double norm, double clip) {
  if (clip > 0 && norm > clip)
    dev_.call(&dt_hal_v1_t::scale, "scale", grads, static_cast<float>(clip / (norm + 1e-6)),
              static_cast<std::int64_t>(n_));
}

void AdamW::step(float* params, const float* grads, double lr, const OptimConfig& c) {
  ++t_;
  for (const ParamInfo& p : params_)
    dev_.call(&dt_hal_v1_t::adamw, "adamw", params + p.offset, grads + p.offset, m() + p.offset,
              v() + p.offset, static_cast<std::int64_t>(p.numel), static_cast<float>(lr),
              static_cast<float>(c.beta1), static_cast<float>(c.beta2), static_cast<float>(c.eps),
              static_cast<float>(p.decay ? c.weight_decay : 0.0), t_);
}

}  // namespace dt
