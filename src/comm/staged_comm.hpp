// dt::StagedComm: collectives and point-to-point on device tensors, for devices whose memory the
// host cannot touch and which have no communicator of their own (NCCL is the CUDA device's). Each
// operation copies the device buffers into host memory through the device's copy entry, runs the
// same operation on a host communicator (MPI, shared memory, sealed: whatever dt uses for host
// tensors), and copies the result back. Results are the host communicator's, bit for bit.
//
// The non-blocking collectives run the whole operation before they return (their Work is
// complete; the host communicator polls and sleeps rather than spinning in MPI: the kPolledWait
// form of comm.hpp, which every rank then uses for that call, never a timeout), so overlap comes
// from the caller's progress thread (dt::GradBuckets), not from here;
// one host buffer, grown to the largest message, serves them, one at a time. isend and irecv are
// truly non-blocking: each holds a host copy of its own (from a pool, reused), and a receive lands
// in the device buffer when its Work completes.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dt/comm.hpp"
#include "dt/device.hpp"

namespace dt {

/// Host buffers of point-to-point messages, reused: a pipeline sends the same few shapes every
/// micro-batch, so after the first ones no message allocates (or touches fresh pages). Shared by a
/// StagedP2p and its Works, which may outlive it. Thread-safe.
class HostBufferPool {
 public:
  struct Buffer {
    std::unique_ptr<unsigned char[]> data;
    std::size_t capacity = 0;
  };
  /// A buffer of at least `bytes` (contents unspecified): the smallest free one that fits, or a
  /// new one.
  Buffer take(std::size_t bytes);
  /// Returns `b` for reuse (the largest kMaxFree are kept).
  void give(Buffer b);
  /// Buffers allocated so far.
  std::size_t allocations() const;

  static constexpr std::size_t kMaxFree = 16;

 private:
  mutable std::mutex mu_;
  std::vector<Buffer> free_;
  std::size_t allocations_ = 0;
};

/// Point-to-point messages of device tensors over a host transport (MPI, UCX, sealed): each send
/// copies to a host buffer and sends that; each receive lands in a host buffer and is copied into
/// the device buffer when its Work completes. Both are non-blocking. The host buffers come from a
/// HostBufferPool and go back to it when their Work is complete and dropped.
class StagedP2p final : public P2p {
 public:
  /// Over `host`, owned.
  StagedP2p(const Device& dev, std::unique_ptr<P2p> host);
  /// Over `host`, which must outlive this.
  StagedP2p(const Device& dev, P2p& host);

  int rank() const noexcept override { return host_.rank(); }
  int size() const noexcept override { return host_.size(); }
  const std::string& name() const noexcept override { return name_; }
  Work isend(ConstTensorView buf, int dst, int tag) override;
  Work irecv(TensorView buf, int src, int tag) override;
  /// Host buffers allocated so far (the rest were reused).
  std::size_t host_allocations() const { return pool_->allocations(); }

 private:
  const Device& dev_;
  std::unique_ptr<P2p> owned_;
  P2p& host_;
  std::string name_;
  std::shared_ptr<HostBufferPool> pool_ = std::make_shared<HostBufferPool>();
};

class StagedComm final : public Comm {
 public:
  /// `dev` must outlive the communicator; `host` is owned.
  StagedComm(const Device& dev, std::unique_ptr<Comm> host);

  int rank() const noexcept override { return host_->rank(); }
  int size() const noexcept override { return host_->size(); }
  const std::string& name() const noexcept override { return name_; }
  Comm& host() const noexcept { return *host_; }

  Work iall_reduce(TensorView buf, ReduceOp op) override;
  Work ibroadcast(TensorView buf, int root) override;
  Work iall_gather(ConstTensorView in, TensorView out) override;
  Work ireduce_scatter(ConstTensorView in, TensorView out, ReduceOp op) override;
  Work isend(ConstTensorView buf, int dst, int tag) override;
  Work irecv(TensorView buf, int src, int tag) override;
  Work ibarrier() override;

  void all_reduce(TensorView buf, ReduceOp op, const CommOptions& opts = {}) override;
  void broadcast(TensorView buf, int root, const CommOptions& opts = {}) override;
  void all_gather(ConstTensorView in, TensorView out, const CommOptions& opts = {}) override;
  void reduce_scatter(ConstTensorView in, TensorView out, ReduceOp op,
                      const CommOptions& opts = {}) override;
  void barrier(const CommOptions& opts = {}) override;

  std::unique_ptr<Comm> split(int color, int key) override;
  /// What isend and irecv run on.
  const StagedP2p& p2p() const noexcept { return p2p_; }

 private:
  void down(void* host, const void* dev, std::size_t bytes) const;
  void up(void* dev, const void* host, std::size_t bytes) const;
  unsigned char* staging(std::size_t bytes);
  // Runs the host communicator's part of an operation on the staging buffer.
  template <class F>
  void on_host(F&& f);
  const Device& dev_;
  std::unique_ptr<Comm> host_;
  StagedP2p p2p_;  // isend and irecv over host_
  std::string name_;
  std::mutex mu_;
  HostBufferPool::Buffer buf_;  // the staging buffer of the collectives
};

}  // namespace dt
