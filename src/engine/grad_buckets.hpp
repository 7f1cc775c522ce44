// dt::GradBuckets: data-parallel gradient reduction in buckets, overlapped with backward.
//
// The flat gradient buffer is cut into buckets of whole parameters in reverse parameter order
// (the order backward produces them), each a contiguous range of at most `bucket_bytes` (a larger
// parameter gets a bucket of its own; 0 gives one bucket per parameter), as PyTorch DDP does.
// Backward reports finished parameters through ready(); a bucket's all_reduce (sum) is queued on
// the communication progress thread as soon as all of its parameters are final, in plan order,
// so every rank issues the same sequence of collectives. finish() waits for all of them.
//
// Results: each element is reduced by exactly one all_reduce whatever the bucket size; with
// dt::ShmComm the reduction order per element is fixed, so any bucket size gives the same bits.
//
// GradWire (train.grad-reduce=bf16): each bucket is rounded to bf16 into a 16-bit copy on the
// device (the device's cast, on the progress thread), all-reduced as bf16 (summed in float,
// rounded once per reduction step, as dt::Comm defines bf16 sums), and widened back into the
// fp32 gradients: half the bytes on the wire for 2 bytes per gradient of device memory.
//
// `comm` must be used by nothing else while buckets are in flight (it is driven from the progress
// thread). Failures of an all_reduce are rethrown by finish().
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <vector>

#include "comm/progress.hpp"
#include "dt/comm.hpp"
#include "dt/device.hpp"
#include "dt/gpt.hpp"

namespace dt {

struct Bucket {
  std::size_t begin = 0, end = 0;              ///< element range of the flat buffer
  std::size_t first_param = 0, end_param = 0;  ///< parameter indices [first, end)
};

/// What the all_reduce carries: f32 (the gradients themselves) or bf16 (a rounded copy, made and
/// widened back by `dev`'s cast).
struct GradWire {
  DType type = DType::f32;
  const Device* dev = nullptr;
};

/// The bucket plan (same on every rank): buckets in the order they are reduced.
std::vector<Bucket> plan_buckets(const std::vector<ParamInfo>& params, std::size_t bucket_bytes);

class GradBuckets {
 public:
  GradBuckets(Comm& comm, float* grads, const std::vector<ParamInfo>& params,
              std::size_t bucket_bytes, GradWire wire = {});
  ~GradBuckets();

  const std::vector<Bucket>& plan() const noexcept { return plan_; }
  /// Device memory of the 16-bit copy (0 for f32).
  std::size_t wire_bytes() const noexcept { return wire_buf_.bytes(); }
  /// Parameters [first, end) are final for this step.
  void ready(std::size_t first, std::size_t end);
  /// Queues what is not queued yet, waits for every bucket (dt::CommError after `timeout`, each),
  /// and resets for the next step, also when a bucket failed or ran out of time: then the
  /// step's buckets not started yet are skipped and the first error is rethrown. A bucket still
  /// running after a timeout keeps using the gradient buffer (as any unfinished dt::Work does).
  void finish(Millis timeout = kNoTimeout);

 private:
  void launch_ready();
  void reset_step();
  Comm& comm_;
  float* grads_;
  std::vector<Bucket> plan_;
  std::vector<int> bucket_of_;        // parameter -> bucket
  std::vector<std::size_t> missing_;  // per bucket: parameters not final yet
  std::vector<char> final_;           // per parameter
  std::size_t next_ = 0;              // first bucket not queued yet
  std::vector<Work> works_;
  std::uint64_t step_ = 1;                   // steps begun (the buckets' tasks know theirs)
  std::atomic<std::uint64_t> abandoned_{0};  // last step whose unstarted buckets are skipped
  GradWire wire_;
  Device::Buffer wire_buf_;  // bf16: the rounded copy of the whole gradient buffer
  std::unique_ptr<ProgressQueue> queue_;
};

}  // namespace dt
