#include "grad_buckets.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <string>

#include "dt/error.hpp"

namespace dt {

std::vector<Bucket> plan_buckets(const std::vector<ParamInfo>& params, std::size_t bucket_bytes) {
  std::vector<Bucket> plan;
  // Parameters are laid out in order in the flat buffer: walking them backwards, a bucket grows
  // downwards while it stays within bucket_bytes.
  for (std::size_t i = params.size(); i-- > 0;) {
    const ParamInfo& p = params[i];
    const std::size_t bytes = p.numel * sizeof(float);
    if (!plan.empty()) {
      Bucket& b = plan.back();
      const std::size_t cur = (b.end - b.begin) * sizeof(float);
      DT_ASSERT(p.offset + p.numel == b.begin, "parameters are not contiguous");
      if (bucket_bytes > 0 && cur + bytes <= bucket_bytes) {
        b.begin = p.offset;
        b.first_param = i;
        continue;
      }
    }
    plan.push_back(Bucket{p.offset, p.offset + p.numel, i, i + 1});
  }
  return plan;
}

GradBuckets::GradBuckets(Comm& comm, float* grads, const std::vector<ParamInfo>& params,
                         std::size_t bucket_bytes, GradWire wire)
    : comm_(comm),
      grads_(grads),
      plan_(plan_buckets(params, bucket_bytes)),
      bucket_of_(params.size(), -1),
      missing_(plan_.size()),
      final_(params.size(), 0),
      wire_(wire) {
  DT_CHECK(InvalidArgument, wire_.type == DType::f32 || (wire_.type == DType::bf16 && wire_.dev),
           "gradient buckets: the all_reduce carries f32, or bf16 with a device to cast on; got ",
           dtype_name(wire_.type), wire_.dev ? "" : " without a device");
  if (wire_.type != DType::f32) {
    std::size_t end = 0;
    for (const Bucket& b : plan_) end = std::max(end, b.end);
    wire_buf_ = Device::Buffer(*wire_.dev, std::max<std::size_t>(end, 1) * dtype_size(wire_.type));
  }
  for (std::size_t b = 0; b < plan_.size(); ++b) {
    for (std::size_t i = plan_[b].first_param; i < plan_[b].end_param; ++i)
      bucket_of_[i] = static_cast<int>(b);
    missing_[b] = plan_[b].end_param - plan_[b].first_param;
  }
  queue_ = std::make_unique<ProgressQueue>(comm.rank(), comm.name());
}

GradBuckets::~GradBuckets() {
  queue_.reset();  // runs what is queued: the buffers stay valid until then
}

void GradBuckets::ready(std::size_t first, std::size_t end) {
  DT_ASSERT(first <= end && end <= final_.size(), "gradient range out of bounds");
  for (std::size_t i = first; i < end; ++i) {
    if (final_[i]) continue;
    final_[i] = 1;
    --missing_[static_cast<std::size_t>(bucket_of_[i])];
  }
  launch_ready();
}

void GradBuckets::launch_ready() {
  while (next_ < plan_.size() && missing_[next_] == 0) {
    const Bucket& b = plan_[next_];
    float* g = grads_ + b.begin;
    const std::size_t n = b.end - b.begin;
    const bool narrow = wire_.type != DType::f32;
    TensorView v{narrow ? static_cast<void*>(wire_buf_.as<std::uint16_t>() + b.begin)
                        : static_cast<void*>(g),
                 n, wire_.type};
    std::string what = "gradient bucket " + std::to_string(next_) + " (" + std::to_string(n) +
                       " floats" + (narrow ? std::string(" as ") + dtype_name(wire_.type) : "") +
                       ") all_reduce on " + comm_.name();
    Comm* c = &comm_;
    const Device* dev = wire_.dev;
    std::atomic<std::uint64_t>* abandoned = &abandoned_;
    const std::uint64_t step = step_;
    works_.push_back(queue_->submit(std::move(what), [c, v, g, n, narrow, dev, abandoned, step] {
      // A failed bucket abandons its step here, on the progress thread, before the next bucket
      // starts (finish also does when its wait runs out of time).
      DT_CHECK(CommError, abandoned->load() < step,
               "not started: an earlier bucket of this step failed");
      try {
        const dt_hal_dtype lp = narrow ? hal_dtype(v.dtype) : DT_HAL_F32;
        const auto count = static_cast<std::int64_t>(n);
        if (narrow)
          dev->call(&dt_hal_v2_t::cast, "cast", v.data, lp, static_cast<const void*>(g), DT_HAL_F32,
                    count);
        // A blocking MPI call would spin in MPI's progress loop for the whole wait, which a
        // SCHED_FIFO progress thread must not do: every communicator waits by polling, sleeping
        // between polls (the shared-memory one for what it sends through MPI across nodes).
        c->all_reduce(v, ReduceOp::sum, CommOptions{kPolledWait});
        if (narrow)
          dev->call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(g), DT_HAL_F32,
                    static_cast<const void*>(v.data), lp, count);
      } catch (...) {
        abandoned->store(step);
        throw;
      }
    }));
    ++next_;
  }
}

void GradBuckets::finish(Millis timeout) {
  std::fill(missing_.begin(), missing_.end(), 0);
  launch_ready();
  // After a bucket fails, the buckets of this step not started yet are skipped (they would
  // reduce into a step that is over), so waiting for them takes a moment (kSkipGrace at most:
  // they may sit behind one that runs on); then the step is reset whatever happened.
  constexpr Millis kSkipGrace{1000};
  std::exception_ptr first;
  std::chrono::steady_clock::time_point grace{};
  for (Work& w : works_) {
    Millis left = timeout;
    if (first) left = millis_until(grace);
    try {
      w.wait(left);
    } catch (...) {
      if (first) continue;
      first = std::current_exception();
      abandoned_.store(step_);
      grace = std::chrono::steady_clock::now() + kSkipGrace;
    }
  }
  reset_step();
  if (first) std::rethrow_exception(first);
}

void GradBuckets::reset_step() {
  works_.clear();
  ++step_;
  next_ = 0;
  std::fill(final_.begin(), final_.end(), 0);
  for (std::size_t b = 0; b < plan_.size(); ++b)
    missing_[b] = plan_[b].end_param - plan_[b].first_param;
}

}  // namespace dt
