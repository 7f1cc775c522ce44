#include "dt/gpt.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "dt/graph.hpp"
#include "dt/trace.hpp"
#include "model/layers.hpp"

namespace dt {

std::vector<ParamInfo> gpt_params(const GptConfig& c) {
  const std::int64_t V = c.vocab, T = c.block, C = c.embd;
  std::vector<ParamInfo> p;
  auto add = [&](std::string name, Shape shape, bool decay) {
    ParamInfo i;
    i.name = std::move(name);
    i.numel = shape_numel(shape);
    i.shape = std::move(shape);
    i.decay = decay;
    i.offset = p.empty() ? 0 : p.back().offset + p.back().numel;
    p.push_back(std::move(i));
  };
  add("transformer.wte.weight", {V, C}, true);
  add("transformer.wpe.weight", {T, C}, true);
  for (int l = 0; l < c.layers; ++l) {
    const std::string h = "transformer.h." + std::to_string(l) + ".";
    add(h + "ln_1.weight", {C}, false);
    add(h + "ln_1.bias", {C}, false);
    add(h + "attn.c_attn.weight", {3 * C, C}, true);
    add(h + "attn.c_attn.bias", {3 * C}, false);
    add(h + "attn.c_proj.weight", {C, C}, true);
    add(h + "attn.c_proj.bias", {C}, false);
    add(h + "ln_2.weight", {C}, false);
    add(h + "ln_2.bias", {C}, false);
    add(h + "mlp.c_fc.weight", {4 * C, C}, true);
    add(h + "mlp.c_fc.bias", {4 * C}, false);
    add(h + "mlp.c_proj.weight", {C, 4 * C}, true);
    add(h + "mlp.c_proj.bias", {C}, false);
  }
  add("transformer.ln_f.weight", {C}, false);
  add("transformer.ln_f.bias", {C}, false);
  return p;
}

namespace {
constexpr int kPerLayer = 12;  // parameter tensors per block
// Offsets of block l's tensors: index 2 + l * kPerLayer + k.
enum : int { LN1W, LN1B, QKVW, QKVB, PROJW, PROJB, LN2W, LN2B, FCW, FCB, FCPW, FCPB };

// Counter-based normal numbers (splitmix64 + Box-Muller): identical on every platform.
struct Normal {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
  double operator()() {
    const double u1 = uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  }
};
}  // namespace

std::vector<std::pair<std::string, std::int64_t>> model_settings(const GptConfig& c) {
  return {{"model.vocab", c.vocab},
          {"model.seq-len", c.block},
          {"model.layers", c.layers},
          {"model.heads", c.heads},
          {"model.embd", c.embd}};
}

std::int64_t padded_vocab(const GptConfig& c) {
  DT_CHECK(InvalidArgument, c.pad_vocab >= 0, "model.pad-vocab ", c.pad_vocab, " is negative");
  const std::int64_t v = c.vocab, p = c.pad_vocab;
  return p > 1 ? (v + p - 1) / p * p : v;
}

Gpt::Gpt(const Device& dev, GptConfig c, int max_batch, float* grad_storage)
    : Gpt(dev, c, max_batch, GptStorage{grad_storage, {}, 0, true, true}) {}

Gpt::Gpt(const Device& dev, GptConfig c, int max_batch, GptStorage storage)
    : dev_(dev),
      cfg_(c),
      max_batch_(max_batch),
      params_(gpt_params(c)),
      ws_(std::make_unique<GemmWorkspace>()) {
  DT_CHECK(InvalidArgument, c.heads >= 1, "model.heads ", c.heads, " must be at least 1");
  DT_CHECK(InvalidArgument, c.embd % c.heads == 0, "model.embd ", c.embd,
           " is not divisible by model.heads ", c.heads);
  DT_CHECK(InvalidArgument, max_batch >= 1 && c.block >= 1 && c.layers >= 1 && c.vocab >= 1,
           "model sizes must be positive");
  nparams_ = params_.back().offset + params_.back().numel;
  if (!storage.layout.empty()) {
    DT_CHECK(InvalidArgument, storage.layout.size() == params_.size(),
             "a Gpt layout must list every parameter");
    for (std::size_t i = 0; i < params_.size(); ++i) {
      DT_CHECK(InvalidArgument, storage.layout[i].numel == params_[i].numel,
               "a Gpt layout must keep the parameter sizes");
      params_[i].offset = storage.layout[i].offset;
    }
    nparams_ = std::max(storage.numel, params_.back().offset + params_.back().numel);
  }
  storage_ = storage;
  storage_.layout.clear();
  if (storage.own_params) param_buf_ = Device::Buffer(dev, nparams_ * sizeof(float));
  if (storage.grad_storage) {
    grad_ = storage.grad_storage;
  } else if (storage.own_grads) {
    grad_buf_ = Device::Buffer(dev, nparams_ * sizeof(float));
    grad_ = grad_buf_.as<float>();
  }
  pp_.assign(params_.size(), nullptr);
  gp_.assign(params_.size(), nullptr);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (param_data()) pp_[i] = param_data() + params_[i].offset;
    if (grad_) gp_[i] = grad_ + params_[i].offset;
  }

  const std::int64_t Vp = padded_vocab(c);
  const std::size_t B = static_cast<std::size_t>(max_batch), T = static_cast<std::size_t>(c.block),
                    C = static_cast<std::size_t>(c.embd), V = static_cast<std::size_t>(Vp),
                    NH = static_cast<std::size_t>(c.heads), BT = B * T;
  flash_ = flash_attention(dev, c.flash_attention);
  const std::size_t att = attention_state_floats(flash_, B, NH, T);
  const auto [acts, gacts] = activation_floats(c, max_batch, flash_);
  act_buf_ = Device::Buffer(dev, acts * sizeof(float));
  grad_act_buf_ = Device::Buffer(dev, gacts * sizeof(float));
  tokens_buf_ = Device::Buffer(dev, 2 * BT * sizeof(std::int32_t));

  float* p = act_buf_.as<float>();
  auto take = [&p](std::size_t n) {
    float* r = p;
    p += n;
    return r;
  };
  encoded_ = take(BT * C);
  L_.resize(static_cast<std::size_t>(c.layers));
  for (auto& l : L_) {
    l.ln1 = take(BT * C);
    l.ln1_mean = take(BT);
    l.ln1_rstd = take(BT);
    l.qkv = take(3 * BT * C);
    l.att = take(att);
    l.atty = take(BT * C);
    l.res2 = take(BT * C);
    l.ln2 = take(BT * C);
    l.ln2_mean = take(BT);
    l.ln2_rstd = take(BT);
    l.fch = take(4 * BT * C);
    l.fch_gelu = take(4 * BT * C);
    l.res3 = take(BT * C);
  }
  lnf_ = take(BT * C);
  lnf_mean_ = take(BT);
  lnf_rstd_ = take(BT);
  logits_ = take(BT * V);
  probs_ = take(BT * V);
  losses_ = take(BT);
  DT_ASSERT(static_cast<std::size_t>(p - act_buf_.as<float>()) == acts);

  p = grad_act_buf_.as<float>();
  dres_ = take(BT * C);
  dln_ = take(BT * C);
  datty_ = take(BT * C);
  dqkv_ = take(3 * BT * C);
  dfch_ = take(4 * BT * C);
  dfch_gelu_ = take(4 * BT * C);
  datt_ = take(att);
  dlogits_ = take(BT * V);
  DT_ASSERT(static_cast<std::size_t>(p - grad_act_buf_.as<float>()) == gacts);
  head_ = std::make_unique<PaddedHead>();
  head_->init(dev, c.vocab, Vp, c.embd);
  zero_grad();
}

const ParamInfo& Gpt::param(const std::string& name) const {
  for (const auto& p : params_)
    if (p.name == name) return p;
  DT_THROW(InvalidArgument, "no parameter named '", name, "'");
}

void Gpt::set_unit_hooks(UnitHooks hooks) {
  DT_CHECK(InvalidArgument, storage_.own_params || hooks.acquire,
           "a Gpt without its own parameters needs UnitHooks::acquire");
  DT_CHECK(InvalidArgument, storage_.own_grads || (hooks.grads && hooks.grads_done),
           "a Gpt without its own gradients needs UnitHooks::grads and grads_done");
  hooks_ = std::move(hooks);
}

std::pair<std::size_t, std::size_t> Gpt::unit_params(int unit) const {
  if (unit == 0) return {0, 2};
  if (unit == cfg_.layers + 1) return {params_.size() - 2, params_.size()};
  const std::size_t first = 2 + static_cast<std::size_t>(unit - 1) * kPerLayer;
  return {first, first + kPerLayer};
}

void Gpt::use_params(int unit, int next) {
  if (!hooks_.acquire) return;
  const float* base = hooks_.acquire(unit, next);
  const auto [a, b] = unit_params(unit);
  for (std::size_t i = a; i < b; ++i) pp_[i] = base + (params_[i].offset - params_[a].offset);
}

void Gpt::drop_params(int unit) {
  if (!hooks_.release) return;
  hooks_.release(unit);
  const auto [a, b] = unit_params(unit);
  for (std::size_t i = a; i < b; ++i) pp_[i] = nullptr;
}

void Gpt::use_grads(int unit) {
  if (!hooks_.grads) return;
  float* base = hooks_.grads(unit);
  const auto [a, b] = unit_params(unit);
  for (std::size_t i = a; i < b; ++i) gp_[i] = base + (params_[i].offset - params_[a].offset);
}

void gpt_init_param(const GptConfig& c, std::uint64_t seed, std::size_t index, float* out) {
  const std::vector<ParamInfo> params = gpt_params(c);
  DT_CHECK(InvalidArgument, index < params.size(), "parameter index ", index, " outside [0, ",
           params.size(), ")");
  const ParamInfo& pi = params[index];
  // Each tensor draws from its own stream, so adding layers does not shift earlier tensors.
  Normal rng{seed * 0x100000001b3ULL + index * 0x9e3779b97f4a7c15ULL};
  const bool is_norm_w =
      pi.name.find("ln_") != std::string::npos && pi.name.find(".weight") != std::string::npos;
  if (pi.shape.size() == 1) {
    for (std::size_t k = 0; k < pi.numel; ++k) out[k] = is_norm_w ? 1.0f : 0.0f;
    return;
  }
  const bool resid = pi.name.find("c_proj.weight") != std::string::npos;
  const double std = resid ? 0.02 / std::sqrt(2.0 * c.layers) : 0.02;
  for (std::size_t k = 0; k < pi.numel; ++k) out[k] = static_cast<float>(rng() * std);
}

Gpt::~Gpt() = default;

std::pair<std::size_t, std::size_t> Gpt::activation_floats(const GptConfig& c, int max_batch,
                                                           bool flash) {
  const std::size_t B = static_cast<std::size_t>(max_batch), T = static_cast<std::size_t>(c.block),
                    C = static_cast<std::size_t>(c.embd),
                    V = static_cast<std::size_t>(padded_vocab(c)),
                    NH = static_cast<std::size_t>(c.heads), BT = B * T;
  const std::size_t att = attention_state_floats(flash, B, NH, T);
  const std::size_t per_layer = BT * C * 16 + BT * 4 + att;
  return {BT * C * 2 + BT * 3 + BT * V * 2 + per_layer * static_cast<std::size_t>(c.layers),
          BT * C * 3 + BT * 3 * C + BT * 8 * C + att + BT * V};
}

std::size_t Gpt::activation_bytes() const noexcept {
  return act_buf_.bytes() + grad_act_buf_.bytes() + ws_->a.bytes() + ws_->b.bytes() +
         round_buf_.bytes() + head_->bytes();
}

void Gpt::set_compute(DType t) {
  ws_->compute = t;
  // The widest input of a product is fch_gelu (4 C a token).
  const std::size_t widest = 4 * static_cast<std::size_t>(max_batch_) *
                             static_cast<std::size_t>(cfg_.block) *
                             static_cast<std::size_t>(cfg_.embd);
  round_buf_ = t == DType::f32 ? Device::Buffer() : Device::Buffer(dev_, widest * sizeof(float));
  head_->set_compute(dev_, t);
  // The model's products are those of its graph (which the plan's estimate counts too).
  ws_->reserve(dev_, graph::gemm_operand_elements(graph::build_gpt(cfg_, max_batch_, cfg_.block)));
}

void Gpt::set_weights16(const void* w16, std::size_t n) {
  ws_->w32 = param_data();
  ws_->w16 = param_data() ? w16 : nullptr;
  ws_->wn = std::min(n, param_buf_.bytes() / sizeof(float));
}

std::int64_t Gpt::weight_copy_reads() const noexcept { return ws_->copy_reads; }

void Gpt::init(std::uint64_t seed) {
  DT_CHECK(
      InvalidArgument, param_data() != nullptr,
      "Gpt::init needs the model's own parameters (sharded ones are initialised by their owner)");
  std::vector<float> host(nparams_, 0.0f);
  for (std::size_t i = 0; i < params_.size(); ++i)
    gpt_init_param(cfg_, seed, i, host.data() + params_[i].offset);
  dev_.call(&dt_hal_v1_t::copy, "copy", param_data(), host.data(), nparams_ * sizeof(float),
            DT_HAL_HOST_TO_DEVICE);
}

void Gpt::zero_grad() {
  if (!grad_) return;  // gradients in UnitHooks buffers start from zero in every backward
  dev_.call(&dt_hal_v1_t::fill_zero, "fill_zero", static_cast<void*>(grad_data()),
            nparams_ * sizeof(float));
}

const float* Gpt::logits(int b, int t) const {
  return logits_ + (static_cast<std::size_t>(b) * T_ + t) * static_cast<std::size_t>(head_->Vp);
}

void Gpt::logits_row(int b, int t, float* out) const {
  dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(out),
            static_cast<const void*>(logits(b, t)), cfg_.vocab * sizeof(float),
            DT_HAL_DEVICE_TO_HOST);
}

double gpt_flops_per_token(const GptConfig& c, int T) {
  const std::vector<ParamInfo> p = gpt_params(c);
  const double n = static_cast<double>(p.back().offset + p.back().numel - p[1].numel);
  return 6.0 * n + 12.0 * c.layers * c.embd * static_cast<double>(T);
}

double Gpt::flops_per_token(int T) const { return gpt_flops_per_token(cfg_, T); }

double Gpt::forward(const std::int32_t* inputs, const std::int32_t* targets, int B, int T) {
  stage(inputs, targets, B, T);
  run_forward();
  return loss_sum();
}

void Gpt::stage(const std::int32_t* inputs, const std::int32_t* targets, int B, int T) {
  DT_CHECK(InvalidArgument, B >= 1 && B <= max_batch_, "batch ", B, " outside [1, ", max_batch_,
           "]");
  DT_CHECK(InvalidArgument, T >= 1 && T <= cfg_.block, "sequence length ", T, " outside [1, ",
           cfg_.block, "]");
  B_ = B;
  T_ = T;
  have_targets_ = targets != nullptr;
  const std::int64_t BT = std::int64_t{B} * T;
  // With a padded head the loss kernel sees the padded vocabulary and takes a padding column's
  // index for a target (its logit is -inf: an infinite loss). Checked here against the real one.
  if (targets && head_->on())
    for (std::int64_t i = 0; i < BT; ++i)
      DT_CHECK(InvalidArgument, targets[i] >= 0 && targets[i] < cfg_.vocab, "target ", targets[i],
               " at position ", i, " is outside [0, vocab = ", cfg_.vocab, ")");
  std::int32_t* tok = tokens_buf_.as<std::int32_t>();
  std::int32_t* tgt = tok + static_cast<std::size_t>(max_batch_) * cfg_.block;
  dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(tok), static_cast<const void*>(inputs),
            BT * sizeof(std::int32_t), DT_HAL_HOST_TO_DEVICE);
  if (targets)
    dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(tgt),
              static_cast<const void*>(targets), BT * sizeof(std::int32_t), DT_HAL_HOST_TO_DEVICE);
}

void Gpt::run_forward() {
  const std::int64_t B = B_, T = T_;
  const std::int64_t C = cfg_.embd, V = cfg_.vocab, NH = cfg_.heads, BT = B * T;
  const std::int32_t* tok = tokens_buf_.as<std::int32_t>();
  const std::int32_t* tgt = tok + static_cast<std::size_t>(max_batch_) * cfg_.block;

  auto W = [&](int l, int k) { return pp_[static_cast<std::size_t>(2 + l * kPerLayer + k)]; };
  const int head = cfg_.layers + 1;  // unit of the final LayerNorm
  // In a 16-bit compute type the inputs of the products are computed into round_buf_ and rounded
  // into their slots once, for the forward's product and the backward's (see round_buf_).
  const bool r16 = round_buf_.bytes() > 0;  // set_compute made it for a 16-bit type
  float* fp32_out = r16 ? round_buf_.as<float>() : nullptr;
  auto out32 = [&](float* slot) { return r16 ? fp32_out : slot; };
  auto round_into = [&](float* slot, std::int64_t n) -> const void* {
    if (!r16) return nullptr;
    dev_.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(slot), hal_dtype(ws_->compute),
              static_cast<const void*>(fp32_out), DT_HAL_F32, n);
    return slot;
  };
  use_params(0, 1);
  dev_.call(&dt_hal_v1_t::embedding_fwd, "embedding_fwd", encoded_, tok, pp_[0], pp_[1],
            std::int64_t{B}, std::int64_t{T}, C, V);
  drop_params(0);
  const float* x = encoded_;
  for (int l = 0; l < cfg_.layers; ++l) {
    const trace::Scope layer_scope("forward", "model", "layer", l);
    use_params(l + 1, l + 2);
    Layer& a = L_[static_cast<std::size_t>(l)];
    dev_.call(&dt_hal_v1_t::layernorm_fwd, "layernorm_fwd", out32(a.ln1), a.ln1_mean, a.ln1_rstd, x,
              W(l, LN1W), W(l, LN1B), BT, C);
    linear_fwd(dev_, ws_.get(), a.qkv, a.ln1, W(l, QKVW), W(l, QKVB), BT, C, 3 * C,
               round_into(a.ln1, BT * C));
    attention_forward(dev_, ws_.get(), flash_, out32(a.atty), a.att, a.qkv, B, T, C, NH);
    linear_fwd(dev_, ws_.get(), a.res2, a.atty, W(l, PROJW), W(l, PROJB), BT, C, C,
               round_into(a.atty, BT * C));
    dev_.call(&dt_hal_v1_t::add, "add", a.res2, a.res2, x, BT * C);
    dev_.call(&dt_hal_v1_t::layernorm_fwd, "layernorm_fwd", out32(a.ln2), a.ln2_mean, a.ln2_rstd,
              a.res2, W(l, LN2W), W(l, LN2B), BT, C);
    linear_fwd(dev_, ws_.get(), a.fch, a.ln2, W(l, FCW), W(l, FCB), BT, C, 4 * C,
               round_into(a.ln2, BT * C));
    dev_.call(&dt_hal_v1_t::gelu_fwd, "gelu_fwd", out32(a.fch_gelu), a.fch, 4 * BT * C);
    linear_fwd(dev_, ws_.get(), a.res3, a.fch_gelu, W(l, FCPW), W(l, FCPB), BT, 4 * C, C,
               round_into(a.fch_gelu, 4 * BT * C));
    dev_.call(&dt_hal_v1_t::add, "add", a.res3, a.res3, a.res2, BT * C);
    drop_params(l + 1);
    x = a.res3;
  }
  const std::size_t lnf = params_.size() - 2;
  use_params(head, 0);
  use_params(0, -1);
  dev_.call(&dt_hal_v1_t::layernorm_fwd, "layernorm_fwd", out32(lnf_), lnf_mean_, lnf_rstd_, x,
            pp_[lnf], pp_[lnf + 1], BT, C);
  // logits = lnf @ wte^T
  const void* lnf16 = round_into(lnf_, BT * C);
  if (head_->on())  // over the padded weights; the padding's logits are -inf
    head_->forward(dev_, ws_.get(), logits_, lnf_, lnf16, pp_[0], BT);
  else
    linear_fwd(dev_, ws_.get(), logits_, lnf_, pp_[0], nullptr, BT, C, V, lnf16);
  drop_params(head);
  drop_params(0);
  if (!have_targets_) return;
  dev_.call(&dt_hal_v1_t::softmax_xent_fwd, "softmax_xent_fwd", losses_, probs_,
            static_cast<const float*>(logits_), tgt, BT, head_->Vp);
}

double Gpt::loss_sum() const {
  if (!have_targets_) return 0.0;
  const std::int64_t BT = std::int64_t{B_} * T_;
  std::vector<float> host(static_cast<std::size_t>(BT));
  dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(host.data()),
            static_cast<const void*>(losses_), BT * sizeof(float), DT_HAL_DEVICE_TO_HOST);
  double sum = 0;
  for (float v : host) sum += v;
  return sum;
}

void Gpt::backward(float loss_scale, const GradReady& ready) {
  DT_CHECK(InvalidArgument, have_targets_, "backward() needs a forward() with targets");
  const std::int64_t B = B_, T = T_, C = cfg_.embd, V = cfg_.vocab, NH = cfg_.heads, BT = B * T;
  const std::int32_t* tok = tokens_buf_.as<std::int32_t>();
  const std::int32_t* tgt = tok + static_cast<std::size_t>(max_batch_) * cfg_.block;
  auto W = [&](int l, int k) { return pp_[static_cast<std::size_t>(2 + l * kPerLayer + k)]; };
  auto dW = [&](int l, int k) { return gp_[static_cast<std::size_t>(2 + l * kPerLayer + k)]; };
  const std::size_t lnf = params_.size() - 2;
  const int head = cfg_.layers + 1;  // unit of the final LayerNorm
  // In a 16-bit compute type the products' inputs hold their rounding (see run_forward).
  const bool r16 = round_buf_.bytes() > 0;
  auto in16 = [&](const float* slot) { return r16 ? static_cast<const void*>(slot) : nullptr; };
  // Gradients of a unit are final: let the caller start reducing them (after the device
  // finished writing them).
  auto notify = [&](int unit) {
    if (!ready && !hooks_.grads_done) return;
    dev_.call(&dt_hal_v1_t::synchronize, "synchronize");
    if (hooks_.grads_done) {
      hooks_.grads_done(unit);
      const auto [a, b] = unit_params(unit);
      for (std::size_t i = a; i < b; ++i) gp_[i] = nullptr;
    } else {
      const auto [a, b] = unit_params(unit);
      ready(a, b);
    }
  };

  use_params(0, head);
  use_grads(0);
  dev_.call(&dt_hal_v1_t::softmax_xent_bwd, "softmax_xent_bwd", dlogits_,
            static_cast<const float*>(probs_), tgt, loss_scale, BT, head_->Vp);
  if (head_->on()) {
    head_->backward(dev_, ws_.get(), dln_, 0.0f, gp_[0], dlogits_, lnf_, in16(lnf_), BT);
  } else {
    // logits = lnf @ wte^T: the backward of a linear layer (in C, out V) without bias
    linear_bwd(dev_, ws_.get(), dln_, 0.0f, gp_[0], nullptr, dlogits_, lnf_, pp_[0], BT, C, V,
               in16(lnf_));
  }
  drop_params(0);
  dev_.call(&dt_hal_v1_t::fill_zero, "fill_zero", static_cast<void*>(dres_),
            static_cast<std::size_t>(BT * C) * sizeof(float));
  const float* last = cfg_.layers > 0 ? L_.back().res3 : encoded_;
  use_params(head, cfg_.layers);
  use_grads(head);
  dev_.call(&dt_hal_v1_t::layernorm_bwd, "layernorm_bwd", dres_, gp_[lnf], gp_[lnf + 1],
            static_cast<const float*>(dln_), last, pp_[lnf], static_cast<const float*>(lnf_mean_),
            static_cast<const float*>(lnf_rstd_), BT, C);
  drop_params(head);
  notify(head);

  for (int l = cfg_.layers - 1; l >= 0; --l) {
    const trace::Scope layer_scope("backward", "model", "layer", l);
    use_params(l + 1, l > 0 ? l : -1);
    use_grads(l + 1);
    Layer& a = L_[static_cast<std::size_t>(l)];
    const float* x = l == 0 ? encoded_ : L_[static_cast<std::size_t>(l - 1)].res3;
    // res3 = res2 + fch_gelu @ Wfcp^T + b: dres flows to res2 unchanged.
    linear_bwd(dev_, ws_.get(), dfch_gelu_, 0.0f, dW(l, FCPW), dW(l, FCPB), dres_, a.fch_gelu,
               W(l, FCPW), BT, 4 * C, C, in16(a.fch_gelu));
    dev_.call(&dt_hal_v1_t::fill_zero, "fill_zero", static_cast<void*>(dfch_),
              static_cast<std::size_t>(4 * BT * C) * sizeof(float));
    dev_.call(&dt_hal_v1_t::gelu_bwd, "gelu_bwd", dfch_, static_cast<const float*>(a.fch),
              static_cast<const float*>(dfch_gelu_), 4 * BT * C);
    linear_bwd(dev_, ws_.get(), dln_, 0.0f, dW(l, FCW), dW(l, FCB), dfch_, a.ln2, W(l, FCW), BT, C,
               4 * C, in16(a.ln2));
    dev_.call(&dt_hal_v1_t::layernorm_bwd, "layernorm_bwd", dres_, dW(l, LN2W), dW(l, LN2B),
              static_cast<const float*>(dln_), static_cast<const float*>(a.res2), W(l, LN2W),
              static_cast<const float*>(a.ln2_mean), static_cast<const float*>(a.ln2_rstd), BT, C);
    // res2 = x + atty @ Wproj^T + b
    linear_bwd(dev_, ws_.get(), datty_, 0.0f, dW(l, PROJW), dW(l, PROJB), dres_, a.atty,
               W(l, PROJW), BT, C, C, in16(a.atty));
    dev_.call(&dt_hal_v1_t::fill_zero, "fill_zero", static_cast<void*>(dqkv_),
              static_cast<std::size_t>(3 * BT * C) * sizeof(float));
    attention_backward(dev_, ws_.get(), flash_, dqkv_, datt_, datty_, a.qkv, a.atty,
                       r16 ? ws_->compute : DType::f32, a.att, B, T, C, NH);
    linear_bwd(dev_, ws_.get(), dln_, 0.0f, dW(l, QKVW), dW(l, QKVB), dqkv_, a.ln1, W(l, QKVW), BT,
               C, 3 * C, in16(a.ln1));
    // The key bias adds q_i . b_k to every score of row i, which softmax ignores: its gradient
    // is exactly zero, and what the float sums leave there is rounding noise that AdamW would
    // blow up to lr-sized steps. Keep it exactly zero.
    dev_.call(&dt_hal_v1_t::fill_zero, "fill_zero", static_cast<void*>(dW(l, QKVB) + C),
              static_cast<std::size_t>(C) * sizeof(float));
    dev_.call(&dt_hal_v1_t::layernorm_bwd, "layernorm_bwd", dres_, dW(l, LN1W), dW(l, LN1B),
              static_cast<const float*>(dln_), x, W(l, LN1W), static_cast<const float*>(a.ln1_mean),
              static_cast<const float*>(a.ln1_rstd), BT, C);
    drop_params(l + 1);
    notify(l + 1);
  }
  dev_.call(&dt_hal_v1_t::embedding_bwd, "embedding_bwd", gp_[0], gp_[1],
            static_cast<const float*>(dres_), tok, B, T, C);
  notify(0);
}

}  // namespace dt
