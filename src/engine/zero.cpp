#include "engine/zero.hpp"

#include <algorithm>
#include <cstring>

#include "dt/error.hpp"
#include "dt/trace.hpp"

namespace dt {

std::vector<ZeroUnit> gpt_units(const GptConfig& c) {
  const std::size_t per_layer = 12;
  std::vector<ZeroUnit> u;
  u.push_back({0, 2});
  for (int l = 0; l < c.layers; ++l)
    u.push_back({2 + static_cast<std::size_t>(l) * per_layer,
                 2 + static_cast<std::size_t>(l + 1) * per_layer});
  const std::size_t end = 2 + static_cast<std::size_t>(c.layers) * per_layer;
  u.push_back({end, end + 2});
  return u;
}

std::vector<ZeroUnit> layer_units(const std::vector<ParamInfo>& params) {
  auto key = [](const std::string& name) -> std::string {
    const std::string block = "transformer.h.", norm = "transformer.ln_f.";
    if (name.rfind(block, 0) == 0) return name.substr(0, name.find('.', block.size()));
    if (name.rfind(norm, 0) == 0) return norm;
    return name;
  };
  std::vector<ZeroUnit> u;
  for (std::size_t i = 0; i < params.size(); ++i)
    if (u.empty() || key(params[i].name) != key(params[i - 1].name))
      u.push_back({i, i + 1});
    else
      u.back().end = i + 1;
  return u;
}

std::vector<ZeroUnit> merge_units(const std::vector<ZeroUnit>& units,
                                  const std::vector<ParamInfo>& params, std::size_t max_bytes) {
  auto bytes = [&](const ZeroUnit& u) {
    return (params[u.end - 1].offset + params[u.end - 1].numel - params[u.first].offset) *
           sizeof(float);
  };
  std::vector<ZeroUnit> out;
  for (const ZeroUnit& u : units)
    if (!out.empty() && bytes({out.back().first, u.end}) <= max_bytes)
      out.back().end = u.end;
    else
      out.push_back(u);
  return out;
}

std::vector<ZeroUnit> zero_units(int stage, const std::vector<ZeroUnit>& layers,
                                 const std::vector<ParamInfo>& params, std::size_t bucket_bytes) {
  return stage == 1 ? merge_units(layers, params, bucket_bytes) : layers;
}

struct ZeroShards::Slot {
  int only = -1;       // the one unit this buffer is for (-1: any other unit)
  int unit = -1;       // the unit the buffer holds (or is being filled with)
  bool held = false;   // in use by the model
  Work work;           // the gather (parameters) or reduction (gradients) in flight
  bool in_flight = false;
  Device::Buffer buf;  // a padded unit
  Device::Buffer part;  // gradients: this rank's reduced slice before it is added
};

namespace {
std::size_t ceil_div(std::size_t a, std::size_t b) { return (a + b - 1) / b; }
}  // namespace

ZeroShards::ZeroShards(const Device& dev, int stage, std::vector<ParamInfo> params,
                       std::vector<ZeroUnit> units, std::unique_ptr<Comm> gather,
                       std::unique_ptr<Comm> reduce,
                       std::function<void(float*, std::size_t)> round, int own_buffer)
    : dev_(dev),
      stage_(stage),
      own_(own_buffer),
      n_(reduce ? reduce->size() : 0),
      r_(reduce ? reduce->rank() : 0),
      params_(std::move(params)),
      units_(std::move(units)),
      gather_comm_(std::move(gather)),
      reduce_comm_(std::move(reduce)),
      round_(std::move(round)) {
  DT_CHECK(InvalidArgument, stage_ >= 1 && stage_ <= 3, "parallel.zero stage ", stage_,
           " is not 1, 2 or 3");
  DT_CHECK(InvalidArgument, gather_comm_ && reduce_comm_, "ZeroShards needs a gather and a ",
           "reduce communicator");
  DT_CHECK(InvalidArgument, gather_comm_->size() == n_ && gather_comm_->rank() == r_,
           "ZeRO communicators differ");
  DT_CHECK(InvalidArgument, own_ >= 0 && static_cast<std::size_t>(own_) < units_.size(),
           "ZeRO unit ", own_, " with its own buffer is not one of the ", units_.size(), " units");
  const std::size_t N = static_cast<std::size_t>(n_), r = static_cast<std::size_t>(r_);
  padded_ = params_;
  std::size_t expect = 0;
  for (const ZeroUnit& u : units_) {
    DT_CHECK(InvalidArgument, u.first == expect && u.end > u.first && u.end <= params_.size(),
             "ZeRO units must cover the parameters in order");
    expect = u.end;
    const std::size_t S = params_[u.end - 1].offset + params_[u.end - 1].numel -
                          params_[u.first].offset;
    const std::size_t s = ceil_div(S, N);
    A_.push_back(padded_total_);
    S_.push_back(S);
    s_.push_back(s);
    loc_.push_back(n_loc_);
    for (std::size_t i = u.first; i < u.end; ++i)
      padded_[i].offset = padded_total_ + (params_[i].offset - params_[u.first].offset);
    // This rank's slice [lo, hi) of the padded unit: the pieces of its tensors.
    const std::size_t lo = padded_total_ + r * s, hi = lo + s;
    for (std::size_t i = u.first; i < u.end; ++i) {
      const std::size_t a = std::max(lo, padded_[i].offset);
      const std::size_t b = std::min(hi, padded_[i].offset + padded_[i].numel);
      if (a >= b) continue;
      ZeroPiece pc{i, a - padded_[i].offset, b - padded_[i].offset, n_loc_ + (a - lo)};
      pieces_.push_back(pc);
      ParamInfo pi;
      pi.name = params_[i].name;
      pi.shape = {static_cast<std::int64_t>(b - a)};
      pi.offset = pc.local;
      pi.numel = b - a;
      pi.decay = params_[i].decay;
      shard_params_.push_back(std::move(pi));
    }
    padded_total_ += s * N;
    n_loc_ += s;
  }
  DT_CHECK(InvalidArgument, expect == params_.size(), "ZeRO units must cover the parameters");
  auto zeroed = [&](std::size_t n) {
    Device::Buffer b(dev_, std::max<std::size_t>(n, 1) * sizeof(float));
    dev_.call(&dt_hal_v1_t::fill_zero, "fill_zero", b.get(), b.bytes());
    return b;
  };
  master_ = zeroed(n_loc_);
  grads_ = zeroed(n_loc_);
  if (round_) work_ = zeroed(n_loc_);  // the rounded master, what the ranks gather
  // Buffers: one unit (GPT's embeddings, tied to the head: used first and last in backward, its
  // gradients complete only at the end) has one of its own; the other units share two, so the
  // next unit's gather (or the last unit's reduction) proceeds while one computes.
  std::size_t others = 0;
  const std::size_t own = static_cast<std::size_t>(own_);
  for (std::size_t u = 0; u < units_.size(); ++u)
    if (u != own) others = std::max(others, s_[u] * N);
  auto add_slots = [&](std::vector<std::unique_ptr<Slot>>& pool, bool part) {
    for (int k = 0; k < (units_.size() > 1 ? 3 : 1); ++k) {
      pool.push_back(std::make_unique<Slot>());
      Slot& sl = *pool.back();
      sl.only = k == 0 ? own_ : -1;
      const std::size_t n = k == 0 ? s_[own] * N : others;
      sl.buf = zeroed(n);
      if (part) sl.part = zeroed(n / N);
    }
  };
  if (stage_ == 3) add_slots(param_slots_, false);
  if (stage_ >= 2) add_slots(grad_slots_, true);
  gather_q_ = std::make_unique<ProgressQueue>(r_, gather_comm_->name());
  reduce_q_ = std::make_unique<ProgressQueue>(r_, reduce_comm_->name());
}

ZeroShards::~ZeroShards() {
  gather_q_.reset();  // runs what is queued while the buffers are alive
  reduce_q_.reset();
}

int ZeroShards::unit_starting_at(std::size_t first) const {
  for (std::size_t u = 0; u < units_.size(); ++u)
    if (units_[u].first == first) return static_cast<int>(u);
  return -1;
}

void ZeroShards::take_shard(const float* padded_full, float* shard) {
  if (!shard) shard = master();
  for (std::size_t u = 0; u < units_.size(); ++u)
    dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(shard + loc_[u]),
              static_cast<const void*>(padded_full + A_[u] + static_cast<std::size_t>(r_) * s_[u]),
              s_[u] * sizeof(float), DT_HAL_DEVICE_TO_DEVICE);
}

void ZeroShards::init_shard(const std::function<void(std::size_t, float*)>& whole) {
  std::vector<float> host;
  for (const ZeroPiece& pc : pieces_) {
    host.resize(params_[pc.param].numel);
    whole(pc.param, host.data());
    dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(master() + pc.local),
              static_cast<const void*>(host.data() + pc.begin),
              (pc.end - pc.begin) * sizeof(float), DT_HAL_HOST_TO_DEVICE);
  }
}

void ZeroShards::publish(float* model_params) {
  const trace::Scope scope("zero.publish", "comm");
  for (auto& s : param_slots_) {  // stage 3: no gather may still read the old shard
    wait_slot(*s);
    s->unit = -1;
  }
  if (work_.bytes()) {
    dev_.call(&dt_hal_v1_t::copy, "copy", work_.get(), static_cast<const void*>(master()),
              n_loc_ * sizeof(float), DT_HAL_DEVICE_TO_DEVICE);
    round_(work_.as<float>(), n_loc_);
  }
  if (stage_ < 3) gather(work(), model_params);  // into the model's own buffer
}

namespace {
// The collectives of the progress threads (SCHED_FIFO in a QoS tier) wait by polling and
// sleeping, never by spinning inside MPI, which would keep the training thread of their core
// from running. Every rank calls them so, whatever its thread's policy: MPI does not match a
// blocking collective with a non-blocking one.
const CommOptions kPolled{kPolledWait};
}  // namespace

void ZeroShards::gather(const float* shard, float* padded_full) {
  Work w = gather_q_->submit("ZeRO shard all_gather", [&] {
    for (std::size_t u = 0; u < units_.size(); ++u)
      gather_comm_->all_gather(ConstTensorView{shard + loc_[u], s_[u], DType::f32},
                               TensorView{padded_full + A_[u], s_[u] * n_, DType::f32}, kPolled);
  });
  w.wait();
}

std::vector<float> ZeroShards::gather_master() {
  std::vector<float> shard(std::max<std::size_t>(n_loc_, 1)), padded(padded_total_ + 1);
  dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(shard.data()),
            static_cast<const void*>(master()), n_loc_ * sizeof(float), DT_HAL_DEVICE_TO_HOST);
  gather(shard.data(), padded.data());
  std::vector<float> out(params_.back().offset + params_.back().numel);
  for (std::size_t i = 0; i < params_.size(); ++i)
    std::copy_n(padded.begin() + static_cast<std::ptrdiff_t>(padded_[i].offset), params_[i].numel,
                out.begin() + static_cast<std::ptrdiff_t>(params_[i].offset));
  return out;
}

void ZeroShards::begin_step() {
  dev_.call(&dt_hal_v1_t::fill_zero, "fill_zero", grads_.get(), grads_.bytes());
}

void ZeroShards::grads_final(int u, const float* unit_grads) {
  const std::size_t k = static_cast<std::size_t>(u);
  float* out = grads() + loc_[k];
  pending_.push_back(reduce_q_->submit(
      "ZeRO gradient reduce_scatter of unit " + std::to_string(u), [this, k, unit_grads, out] {
        reduce_comm_->reduce_scatter(ConstTensorView{unit_grads, s_[k] * n_, DType::f32},
                                     TensorView{out, s_[k], DType::f32}, ReduceOp::sum, kPolled);
      }));
}

void ZeroShards::wait_slot(Slot& s) {
  if (!s.in_flight) return;
  s.in_flight = false;
  s.work.wait();
}

bool ZeroShards::fits(const Slot& s, int u) const {
  return s.only == u || (s.only == -1 && u != own_);
}

float* ZeroShards::grads_buffer(int u) {
  Slot* pick = nullptr;
  for (auto& s : grad_slots_)
    if (fits(*s, u) && !s->held && !s->in_flight) {
      pick = s.get();
      break;
    }
  if (!pick)  // every buffer is held or reducing: wait for a reduction (queued in order)
    for (auto& s : grad_slots_)
      if (fits(*s, u) && !s->held) {
        wait_slot(*s);
        pick = s.get();
        break;
      }
  DT_ASSERT(pick != nullptr, "no free ZeRO gradient buffer");
  pick->unit = u;
  pick->held = true;
  const std::size_t k = static_cast<std::size_t>(u);
  dev_.call(&dt_hal_v1_t::fill_zero, "fill_zero", pick->buf.get(), s_[k] * n_ * sizeof(float));
  return pick->buf.as<float>();
}

void ZeroShards::grads_done(int u) {
  Slot* s = nullptr;
  for (auto& g : grad_slots_)
    if (g->held && g->unit == u) s = g.get();
  DT_ASSERT(s != nullptr, "ZeRO gradients of unit ", u, " were never taken");
  const std::size_t k = static_cast<std::size_t>(u);
  float* acc = grads() + loc_[k];
  s->held = false;
  s->in_flight = true;
  s->work = reduce_q_->submit("ZeRO gradient reduce_scatter of unit " + std::to_string(u),
                              [this, s, k, acc] {
                                reduce_comm_->reduce_scatter(
                                    ConstTensorView{s->buf.as<float>(), s_[k] * n_, DType::f32},
                                    TensorView{s->part.as<float>(), s_[k], DType::f32},
                                    ReduceOp::sum, kPolled);
                                dev_.call(&dt_hal_v1_t::add, "add", acc,
                                          static_cast<const float*>(acc),
                                          static_cast<const float*>(s->part.as<float>()),
                                          static_cast<std::int64_t>(s_[k]));
                              });
}

void ZeroShards::finish_grads() {
  const trace::Scope scope("zero.reduce wait", "comm");
  for (auto& s : grad_slots_) wait_slot(*s);
  std::vector<Work> p = std::move(pending_);
  pending_.clear();
  for (Work& w : p) w.wait();
}

Work ZeroShards::gather_into(Slot& s, int u) {
  const std::size_t k = static_cast<std::size_t>(u);
  const float* src = work() + loc_[k];
  float* dst = s.buf.as<float>();
  s.unit = u;
  s.in_flight = true;
  return gather_q_->submit(
      "ZeRO parameter all_gather of unit " + std::to_string(u), [this, k, src, dst] {
        gather_comm_->all_gather(ConstTensorView{src, s_[k], DType::f32},
                                 TensorView{dst, s_[k] * n_, DType::f32}, kPolled);
      });
}

const float* ZeroShards::acquire(int u, int next) {
  DT_ASSERT(stage_ == 3, "ZeRO acquire() needs stage 3");
  Slot* mine = nullptr;
  for (auto& s : param_slots_)
    if (s->unit == u) mine = s.get();
  if (!mine) {
    for (auto& s : param_slots_)  // a free buffer: one not held, preferring an empty one
      if (fits(*s, u) && !s->held && (!mine || s->unit == -1)) mine = s.get();
    DT_ASSERT(mine != nullptr, "both ZeRO parameter buffers are held");
    wait_slot(*mine);
    mine->work = gather_into(*mine, u);
  }
  {
    const trace::Scope scope("zero.gather wait", "comm", "unit", u);
    wait_slot(*mine);
  }
  mine->held = true;
  if (next >= 0) {
    bool cached = false;
    Slot* other = nullptr;
    for (auto& s : param_slots_) {
      cached = cached || s->unit == next;
      if (fits(*s, next) && !s->held) other = s.get();
    }
    if (!cached && other) {
      wait_slot(*other);
      other->work = gather_into(*other, next);
    }
  }
  return mine->buf.as<float>();
}

void ZeroShards::release(int u) {
  for (auto& s : param_slots_)
    if (s->unit == u) s->held = false;
}

UnitHooks ZeroShards::hooks() {
  UnitHooks h;
  if (stage_ >= 3) {
    h.acquire = [this](int u, int next) { return acquire(u, next); };
    h.release = [this](int u) { release(u); };
  }
  if (stage_ >= 2) {
    h.grads = [this](int u) { return grads_buffer(u); };
    h.grads_done = [this](int u) { grads_done(u); };
  }
  return h;
}

ZeroMemory ZeroShards::memory() const {
  return zero_memory(stage_, params_, units_, n_, own_, work_.bytes() > 0);
}

int embedding_unit(const std::vector<ZeroUnit>& units, const std::vector<ParamInfo>& params) {
  for (std::size_t u = 0; u < units.size(); ++u)
    for (std::size_t i = units[u].first; i < units[u].end; ++i)
      if (params[i].name == "transformer.wte.weight") return static_cast<int>(u);
  return 0;
}

ZeroMemory zero_memory(int stage, const std::vector<ParamInfo>& params,
                       const std::vector<ZeroUnit>& units, int ranks, int own_buffer,
                       bool low_precision) {
  const std::size_t N = static_cast<std::size_t>(ranks), f = sizeof(float);
  std::size_t local = 0, own = 0, others = 0;  // shard; the own and the shared buffers' units
  for (std::size_t u = 0; u < units.size(); ++u) {
    const ZeroUnit& z = units[u];
    const std::size_t s =
        ceil_div(params[z.end - 1].offset + params[z.end - 1].numel - params[z.first].offset, N);
    local += s;
    if (static_cast<int>(u) == own_buffer)
      own = s * N;
    else
      others = std::max(others, s * N);
  }
  // Buffers (stages 2-3, see the constructor): the own unit's, and two shared when there are
  // other units; a gradient buffer also keeps the reduced slice.
  const std::size_t buffers = own + (units.size() > 1 ? 2 * others : 0);
  const std::size_t slices = buffers / N;
  ZeroMemory m;
  m.optimizer = 3 * local * f;  // master, exp_avg, exp_avg_sq
  // Low precision: the rounded shard to gather from, and (stages 1-2) the gathered weights'
  // 16-bit copy the matrix products read.
  m.params = (stage < 3 ? local * N : buffers) * f +
             (low_precision ? local * f + (stage < 3 ? local * N * 2 : 0) : 0);
  m.grads = local * f + (stage < 2 ? local * N : buffers + slices) * f;
  return m;
}

}  // namespace dt
