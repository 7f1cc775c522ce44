// NCCL implementation of dt::Comm for device tensors (CUDA device pointers in every view).
//
// Bootstrap: create() is collective over an MPI communicator: rank 0 makes the ncclUniqueId,
// MPI_Bcast hands it to the others, every rank calls ncclCommInitRank on its CUDA device. One
// NcclComm per mesh dimension: build each from that dimension's MpiComm (or split() one).
//
// Streams: each communicator (each split too) runs its operations on a stream of its own, after
// the work the caller's stream (the one given at creation: the CUDA device's compute stream,
// Device::native_stream) held when the operation was issued. So an operation reads its inputs only
// once the kernels enqueued before it have written them, and communicators used from different
// threads (tensor-parallel collectives from the training thread, gradient buckets from a progress
// thread) never interleave on one stream, where their order could differ between ranks and hang
// them. The i* forms return at once with a Work that completes when the operation has (an event);
// the blocking forms wait for that, so on return the host, and any stream, may use the buffers.
// Consumers of an i* result wait for its Work before enqueueing work that reads it.
//
// Contracts of dt::Comm hold, with NCCL's own limits stated here:
//  - ReduceOp::avg is ncclAvg: integers are summed and then divided as the contract says, but
//    floating types are multiplied by 1/size() before the sum (NCCL's algorithm), so f32 results
//    may differ in the last bits from sum-then-divide at sizes that are not powers of two; bf16
//    and f16 reductions happen inside NCCL (fp32 accumulation is NCCL's choice per algorithm).
//  - ReduceOp::max and min are ncclMax and ncclMin, which take the number where one operand is
//    NaN (fmaxf, fminf): unlike the host paths (MPI, shared memory), where NaN wins, a NaN on one
//    rank does not reach the others through them. (No training path reduces device tensors by
//    max or min: the overflow check reduces a host flag.)
//  - Point-to-point: NCCL has no tags and no message sizes; messages between one pair arrive in
//    the order they were sent, tags are checked to be >= 0 and otherwise ignored, and a receive
//    whose size differs from the send is not detected (both sides must agree, as in every dt
//    pipeline schedule). isend and irecv are held back and handed to NCCL together, in one
//    ncclGroupStart/ncclGroupEnd, when one of their Works is first tested or waited for, or
//    before the next collective, split or destruction: a rank that sends and then receives (a
//    ring) would otherwise wait in the send for a peer waiting in its own send.
//  - Failures (a dead peer, a network error) are found by polling ncclCommGetAsyncError while a
//    Work waits; they throw dt::CommError naming the operation, and the communicator is aborted
//    there and then (ncclCommAbort, so no kernel stays stuck on a stream). A failed enqueue or
//    send/receive group marks it aborted, and the next Work that is tested aborts it. Every later
//    call, and every Work not complete before, throws. A Work that times out throws
//    dt::CommError and stays pending; the communicator is then aborted, not destroyed, when it
//    goes away (ncclCommDestroy would wait for the stuck kernel).
//  - The communicators are blocking (NCCL's default): dt orders and checks NCCL's work itself,
//    through CUDA events and ncclCommGetAsyncError. NCCL_COMM_BLOCKING=0 in the environment would
//    make NCCL create non-blocking ones whatever dt asks for (the variable overrides the config),
//    so NcclModule::load refuses it.
// Costs: one cudaEvent per operation and an event record and stream wait to order it after the
// caller's stream; a blocking one adds a host wait.
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
  /// The caller's stream given at creation (a cudaStream_t): operations run after its work.
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
  static void init_state(State& st, int rank, const std::string& name, void* caller);
  // A collective on the communicator's stream, after the caller's stream's work.
  Work enqueue(const char* op, ConstTensorView v, const std::function<int(void*)>& call);
  // A send or receive, held until the next flush (see the header comment).
  Work enqueue_p2p(const char* op, ConstTensorView v, std::function<int(void*)> call);

  std::shared_ptr<State> state_;
  int rank_ = 0;
  int size_ = 1;
  std::string name_;
  void* stream_ = nullptr;
  int device_ = 0;
};

}  // namespace dt
