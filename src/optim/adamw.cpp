#include <algorithm>
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
  // Neighbouring parameters with the same weight decay are one range of the update (AdamW is
  // elementwise), all of them updated by one fused call where the device has it.
  for (const ParamInfo& p : params_) {
    if (p.numel == 0) continue;
    const auto off = static_cast<std::int64_t>(p.offset), len = static_cast<std::int64_t>(p.numel);
    if (!ranges_.empty() && ranges_.back().decay == p.decay &&
        ranges_.back().offset + ranges_.back().numel == off)
      ranges_.back().numel += len;
    else
      ranges_.push_back(Range{off, len, p.decay});
  }
  // The fused update runs the ranges at once: no two parameters may share an element.
  std::vector<Range> sorted = ranges_;
  std::sort(sorted.begin(), sorted.end(),
            [](const Range& a, const Range& b) { return a.offset < b.offset; });
  for (std::size_t k = 1; k < sorted.size(); ++k)
    DT_CHECK(InvalidArgument, sorted[k - 1].offset + sorted[k - 1].numel <= sorted[k].offset,
             "AdamW: parameters overlap at element ", sorted[k].offset,
             " of the optimizer state (each element belongs to one parameter)");
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
  const auto f = [](double x) { return static_cast<float>(x); };
  const float wd = f(c.weight_decay);
  if (dev_.table2().adamw_multi == nullptr) {  // a device without the fused entry
    for (const Range& r : ranges_)
      dev_.call(&dt_hal_v1_t::adamw, "adamw", params + r.offset, grads + r.offset, m() + r.offset,
                v() + r.offset, r.numel, f(lr), f(c.beta1), f(c.beta2), f(c.eps),
                r.decay ? wd : 0.0f, t_);
    return;
  }
  const std::size_t n = ranges_.size();
  std::vector<float*> pp(n), mp(n), vp(n);
  std::vector<const float*> gp(n);
  std::vector<std::int64_t> sizes(n);
  std::vector<float> wds(n);
  for (std::size_t k = 0; k < n; ++k) {
    const Range& r = ranges_[k];
    pp[k] = params + r.offset;
    gp[k] = grads + r.offset;
    mp[k] = m() + r.offset;
    vp[k] = v() + r.offset;
    sizes[k] = r.numel;
    wds[k] = r.decay ? wd : 0.0f;
  }
  dev_.call(&dt_hal_v2_t::adamw_multi, "adamw_multi", static_cast<int>(n), pp.data(),
            static_cast<const float* const*>(gp.data()), mp.data(), vp.data(),
            static_cast<const std::int64_t*>(sizes.data()), static_cast<const float*>(wds.data()),
            f(lr), f(c.beta1), f(c.beta2), f(c.eps), t_);
}

}  // namespace dt
