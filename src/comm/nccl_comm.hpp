// NCCL implementation of dt::Comm for device tensors (CUDA device pointers in every view).
//
// Bootstrap: create() is collective over an MPI communicator: rank 0 makes the ncclUniqueId,
// MPI_Bcast hands it to the others, every rank calls ncclCommInitRank on its CUDA device. One
// NcclComm per mesh dimension: build each from that dimension's MpiComm (or split() one).
//
// Stream order: every operation is enqueued on the stream given at creation (the compute stream
// of the CUDA device, Device::native_stream), after the kernels already on it and before those
// enqueued later, so a kernel that consumes an all_reduce needs no host wait. The i* forms
// return at once with a Work that completes when the stream has passed the operation (an event);
// the blocking forms also wait for that, so on return the host may read or free the buffers.
//
// Contracts of dt::Comm hold, with NCCL's own limits stated here:
//  - ReduceOp::avg is ncclAvg; bf16 and f16 reductions happen inside NCCL (fp32 accumulation is
//    NCCL's choice per algorithm, not guaranteed).
//  - Point-to-point: NCCL has no tags and no message sizes; messages between one pair arrive in
//    the order they were sent, tags are checked to be >= 0 and otherwise ignored, and a receive
//    whose size differs from the send is not detected (both sides must agree, as in every dt
//    pipeline schedule).
//  - Failures (a dead peer, a network error) are found by polling ncclCommGetAsyncError while a
//    Work waits; they throw dt::CommError naming the operation, and the communicator is aborted
//    (every later call throws). A Work that times out throws dt::CommError and stays pending.
// Costs: one cudaEvent per non-blocking operation; a blocking one adds a host wait.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "comm/mpi_comm.hpp"
#include "dt/comm.hpp"

namespace dt {

class NcclComm final : public Comm {
 public:
  /// Collective over `bootstrap` (every rank, same order). cuda_device: the CUDA device index this
  /// rank uses; stream: the cudaStream_t to enqueue on (nullptr: the legacy default stream).
  /// Throws dt::CommError naming the NCCL or CUDA call and its message when set-up fails.
  static std::unique_ptr<NcclComm> create(MpiComm& bootstrap, int cuda_device, void* stream,
                                          std::string name);
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  const std::string& name() const noexcept override { return name_; }
  /// The stream operations are enqueued on (a cudaStream_t).
  void* stream() const noexcept { return stream_; }

  Work iall_reduce(TensorView buf, ReduceOp op) override;
  Work ibroadcast(TensorView buf, int root) override;
  Work iall_gather(ConstTensorView in, TensorView out) override;
  Work ireduce_scatter(ConstTensorView in, TensorView out, ReduceOp op) override;
  Work isend(ConstTensorView buf, int dst, int tag) override;
  Work irecv(TensorView buf, int src, int tag) override;
  Work ibarrier() override;

  /// ncclCommSplit: collective over this communicator; a negative color gets nullptr.
  std::unique_ptr<Comm> split(int color, int key) override;

  struct State;  // NCCL and CUDA handles (nccl_comm.cpp)

 private:
  NcclComm(std::shared_ptr<State> s, int rank, int size, std::string name, void* stream,
           int device);
  Work enqueue(const char* op, ConstTensorView v, const std::function<int()>& call);

  std::shared_ptr<State> state_;
  int rank_ = 0;
  int size_ = 1;
  std::string name_;
  void* stream_ = nullptr;
  int device_ = 0;
};

}  // namespace dt
