#include "comm/nccl_comm.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

namespace dt {

namespace {

[[noreturn]] void throw_nccl(ncclResult_t r, ncclComm_t comm, const char* call, int rank,
                             const std::string& name, const char* file, int line) {
  const char* last = ncclGetLastError(comm);
  throw CommError(std::string(call) + " failed on rank " + std::to_string(rank) + " of " + name +
                      ": " + ncclGetErrorString(r) +
                      (last && *last ? std::string(" (") + last + ")" : ""),
                  file, line);
}
#define DT_NCCL(call, comm, rank, name)                                                       \
  do {                                                                                        \
    const ncclResult_t r_ = (call);                                                           \
    if (r_ != ncclSuccess) throw_nccl(r_, (comm), #call, (rank), (name), __FILE__, __LINE__); \
  } while (0)

#define DT_CUDA(call, rank, name)                                                               \
  do {                                                                                          \
    const cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess)                                                                      \
      throw CommError(std::string(#call) + " failed on rank " + std::to_string(rank) + " of " + \
                          (name) + ": " + cudaGetErrorString(e_),                               \
                      __FILE__, __LINE__);                                                      \
  } while (0)

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      return ncclUint8;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ncclAvg;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
  }
  return ncclSum;
}

}  // namespace

// Shared by the communicator and its unfinished Works, so a Work may outlive the NcclComm.
struct NcclComm::State {
  ncclComm_t comm = nullptr;
  int device = 0;
  int rank = 0;
  std::string name;
  cudaStream_t caller = nullptr;  // the stream given at creation (the device's compute stream)
  cudaStream_t stream = nullptr;  // this communicator's own stream (non-blocking)
  cudaEvent_t ready = nullptr;    // recorded on the caller's stream before each operation
  int* barrier_buf = nullptr;     // one device int for ibarrier
  std::mutex mu;                  // enqueueing, the pending sends and receives, aborting
  // Sends and receives not yet handed to NCCL: they go in one ncclGroupStart/End when a Work of
  // theirs is first tested or waited for, or before the next collective (see flush_p2p).
  struct PendingP2p {
    std::function<int(void*)> call;  // an ncclResult_t
    cudaEvent_t done;
  };
  std::vector<PendingP2p> pending;
  std::atomic<bool> aborted{false};       // an operation failed: every later call throws
  std::atomic<bool> timed_out{false};     // a Work timed out: its kernel may never finish
  std::atomic<bool> comm_aborted{false};  // ncclCommAbort ran: `comm` is gone

  // Under mu: this communicator's stream waits for what the caller's stream holds now.
  void order_after_caller() {
    DT_CHECK(CommError, !aborted, "rank ", rank, " of ", name,
             ": the communicator was aborted after an earlier NCCL failure");
    DT_CUDA(cudaSetDevice(device), rank, name);
    DT_CUDA(cudaEventRecord(ready, caller), rank, name);
    DT_CUDA(cudaStreamWaitEvent(stream, ready, 0), rank, name);
  }
  // Under mu: hands the pending sends and receives to NCCL in one group.
  void flush_p2p_locked() {
    if (pending.empty()) return;
    std::vector<PendingP2p> batch;
    batch.swap(pending);
    try {
      order_after_caller();
      DT_NCCL(ncclGroupStart(), comm, rank, name);
      ncclResult_t r = ncclSuccess;
      for (PendingP2p& p : batch)
        if (r == ncclSuccess) r = static_cast<ncclResult_t>(p.call(stream));
      const ncclResult_t end = ncclGroupEnd();
      if (r == ncclSuccess) r = end;
      if (r != ncclSuccess) throw_nccl(r, comm, "send/recv group", rank, name, __FILE__, __LINE__);
      for (PendingP2p& p : batch) DT_CUDA(cudaEventRecord(p.done, stream), rank, name);
    } catch (...) {
      aborted = true;  // the peers' halves of the group may be waiting: nothing can follow
      throw;
    }
    // The events belong to the Works that hold them.
  }
  void flush_p2p() {
    std::lock_guard<std::mutex> lock(mu);
    flush_p2p_locked();
  }

  // Ends the communicator after a failure, so no NCCL kernel stays stuck on a stream. Not under
  // mu: an enqueue holding it may itself be stuck waiting for the dead peer, which this ends.
  // Every use of `comm` checks `aborted` first (set before the abort).
  void abort() {
    aborted = true;
    if (comm && !comm_aborted.exchange(true)) {
      cudaSetDevice(device);
      ncclCommAbort(comm);
    }
  }
  ~State() {
    cudaSetDevice(device);
    // ncclCommDestroy waits for the communicator's kernels: after a failure or a timeout one may
    // never finish, so abort instead.
    if (comm && !comm_aborted) {
      if (aborted || timed_out)
        ncclCommAbort(comm);
      else
        ncclCommDestroy(comm);
    }
    if (barrier_buf) cudaFree(barrier_buf);
    if (ready) cudaEventDestroy(ready);
    if (stream) cudaStreamDestroy(stream);
    (void)cudaGetLastError();
  }
};

namespace {

class NcclWork final : public WorkImpl {
 public:
  // p2p: the operation may still be pending in the communicator's group (flush_p2p hands it over).
  NcclWork(std::shared_ptr<NcclComm::State> s, cudaEvent_t ev, std::string desc, int rank,
           std::string comm, std::function<void()> flush = {})
      : state_(std::move(s)),
        ev_(ev),
        desc_(std::move(desc)),
        comm_(std::move(comm)),
        rank_(rank),
        flush_(std::move(flush)) {}
  ~NcclWork() override {
    // A send or receive still held back goes out now: its event must be recorded before it dies.
    if (flush_) {
      try {
        flush_();
      } catch (const std::exception&) {  // the communicator is aborted; nothing more to do
      }
    }
    if (ev_) cudaEventDestroy(ev_);
  }

  bool test() override {
    if (error_) std::rethrow_exception(error_);
    if (done_) return true;
    if (flush_) {
      try {
        flush_();
      } catch (const std::exception& e) {
        fail(e.what());
      }
      flush_ = nullptr;
    }
    // After a failure anywhere on the communicator (a group this operation was part of may never
    // have been handed to NCCL, and an unrecorded event reads as complete) nothing completes.
    if (state_->aborted) {
      state_->abort();
      fail("the communicator was aborted after a failure of another operation");
    }
    cudaSetDevice(state_->device);
    const cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaSuccess) {
      done_ = true;
      return true;
    }
    if (e != cudaErrorNotReady) {
      fail(std::string("the CUDA stream failed: ") + cudaGetErrorString(e));
    }
    ncclResult_t async = ncclSuccess;
    if (!state_->aborted && ncclCommGetAsyncError(state_->comm, &async) == ncclSuccess &&
        async != ncclSuccess && async != ncclInProgress) {
      state_->abort();
      fail(std::string("NCCL reported ") + ncclGetErrorString(async));
    }
    return false;
  }

  bool wait_for(Millis timeout) override {
    const auto until = std::chrono::steady_clock::now() + timeout;
    auto nap = std::chrono::microseconds(20);
    while (!test()) {
      if (timeout.count() >= 0 && std::chrono::steady_clock::now() >= until) {
        state_->timed_out = true;
        return false;
      }
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(2000));
    }
    return true;
  }

  std::string describe() const override { return desc_ + " on " + comm_; }
  int rank() const override { return rank_; }

 private:
  [[noreturn]] void fail(const std::string& why) {
    try {
      throw CommError(
          desc_ + " failed on rank " + std::to_string(rank_) + " of " + comm_ + ": " + why,
          __FILE__, __LINE__);
    } catch (...) {
      error_ = std::current_exception();
      throw;
    }
  }

  std::shared_ptr<NcclComm::State> state_;
  cudaEvent_t ev_ = nullptr;
  std::string desc_, comm_;
  int rank_ = 0;
  std::function<void()> flush_;
  bool done_ = false;
  std::exception_ptr error_;
};

std::string what(const char* op, ConstTensorView v) {
  return std::string(op) + "(" + dtype_name(v.dtype) + " x " + std::to_string(v.numel) + ")";
}

}  // namespace

void NcclComm::init_state(State& st, int rank, const std::string& name, void* caller) {
  st.rank = rank;
  st.name = name;
  st.caller = static_cast<cudaStream_t>(caller);
  DT_CUDA(cudaStreamCreateWithFlags(&st.stream, cudaStreamNonBlocking), rank, name);
  DT_CUDA(cudaEventCreateWithFlags(&st.ready, cudaEventDisableTiming), rank, name);
  DT_CUDA(cudaMalloc(&st.barrier_buf, sizeof(int)), rank, name);
  DT_CUDA(cudaMemset(st.barrier_buf, 0, sizeof(int)), rank, name);
}

std::unique_ptr<NcclComm> NcclComm::create(MpiComm& bootstrap, int cuda_device, void* stream,
                                           std::string name) {
  const int rank = bootstrap.rank(), size = bootstrap.size();
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  // A rank that cannot take its GPU, or rank 0 without an id, must not leave the others waiting in
  // the broadcast: every rank learns the first rank that failed, and all throw.
  on_every_rank(bootstrap.handle(), rank, name, "set up NCCL", [&] {
    const cudaError_t e = cudaSetDevice(cuda_device);
    DT_CHECK(CommError, e == cudaSuccess, name, " on rank ", rank, ": cudaSetDevice(", cuda_device,
             ") failed: ", cudaGetErrorString(e));
    if (rank != 0) return;
    const ncclResult_t r = ncclGetUniqueId(&id);
    DT_CHECK(CommError, r == ncclSuccess, name, " on rank ", rank,
             ": ncclGetUniqueId failed: ", ncclGetErrorString(r));
  });
  DT_MPI(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, bootstrap.handle()), rank, bootstrap.name());
  auto state = std::make_shared<State>();
  state->device = cuda_device;
  DT_NCCL(ncclCommInitRank(&state->comm, size, id, rank), nullptr, rank, name);
  init_state(*state, rank, name, stream);
  return std::unique_ptr<NcclComm>(
      new NcclComm(std::move(state), rank, size, std::move(name), stream, cuda_device));
}

NcclComm::NcclComm(std::shared_ptr<State> s, int rank, int size, std::string name, void* stream,
                   int device)
    : state_(std::move(s)),
      rank_(rank),
      size_(size),
      name_(std::move(name)),
      stream_(stream),
      device_(device) {}

NcclComm::~NcclComm() {
  // Sends and receives nobody waited for still go out, as an MPI isend would.
  try {
    state_->flush_p2p();
  } catch (const std::exception&) {  // the communicator failed; ~State aborts it
  }
}

Work NcclComm::enqueue(const char* op, ConstTensorView v, const std::function<int(void*)>& call) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->flush_p2p_locked();  // sends and receives issued before this collective go first
  state_->order_after_caller();
  const auto r = static_cast<ncclResult_t>(call(state_->stream));
  if (r != ncclSuccess) {
    state_->aborted = true;  // the peers may be inside this collective: nothing can follow
    throw_nccl(r, state_->comm, op, rank_, name_, __FILE__, __LINE__);
  }
  cudaEvent_t ev = nullptr;
  DT_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), rank_, name_);
  const cudaError_t e = cudaEventRecord(ev, state_->stream);
  if (e != cudaSuccess) {
    cudaEventDestroy(ev);
    DT_CUDA(e, rank_, name_);
  }
  return Work(std::make_unique<NcclWork>(state_, ev, what(op, v), rank_, name_));
}

Work NcclComm::enqueue_p2p(const char* op, ConstTensorView v, std::function<int(void*)> call) {
  std::lock_guard<std::mutex> lock(state_->mu);
  DT_CHECK(CommError, !state_->aborted, op, " on rank ", rank_, " of ", name_,
           ": the communicator was aborted after an earlier NCCL failure");
  DT_CUDA(cudaSetDevice(device_), rank_, name_);
  cudaEvent_t ev = nullptr;
  DT_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), rank_, name_);
  state_->pending.push_back({std::move(call), ev});
  // The Work owns the event; until the group is flushed the event is unrecorded, and the Work
  // flushes before its first query (the state, not this communicator: a Work may outlive it).
  State* st = state_.get();
  return Work(
      std::make_unique<NcclWork>(state_, ev, what(op, v), rank_, name_, [st] { st->flush_p2p(); }));
}

Work NcclComm::iall_reduce(TensorView buf, ReduceOp op) {
  return enqueue("all_reduce", buf, [&](void* sv) {
    auto s = static_cast<cudaStream_t>(sv);
    return ncclAllReduce(buf.data, buf.data, buf.numel, nccl_type(buf.dtype), nccl_op(op),
                         state_->comm, s);
  });
}

Work NcclComm::ibroadcast(TensorView buf, int root) {
  DT_CHECK(InvalidArgument, root >= 0 && root < size_, "broadcast on ", name_, ": root ", root,
           " is outside [0, ", size_, ")");
  return enqueue("broadcast", buf, [&](void* sv) {
    auto s = static_cast<cudaStream_t>(sv);
    return ncclBroadcast(buf.data, buf.data, buf.numel, nccl_type(buf.dtype), root, state_->comm,
                         s);
  });
}

Work NcclComm::iall_gather(ConstTensorView in, TensorView out) {
  DT_CHECK(InvalidArgument, in.dtype == out.dtype, "all_gather on ", name_, ": input is ",
           dtype_name(in.dtype), ", output is ", dtype_name(out.dtype));
  DT_CHECK(InvalidArgument, out.numel == in.numel * static_cast<std::size_t>(size_),
           "all_gather on ", name_, ": output has ", out.numel, " elements, needs ", size_, " x ",
           in.numel);
  return enqueue("all_gather", in, [&](void* sv) {
    auto s = static_cast<cudaStream_t>(sv);
    return ncclAllGather(in.data, out.data, in.numel, nccl_type(in.dtype), state_->comm, s);
  });
}

Work NcclComm::ireduce_scatter(ConstTensorView in, TensorView out, ReduceOp op) {
  DT_CHECK(InvalidArgument, in.dtype == out.dtype, "reduce_scatter on ", name_, ": input is ",
           dtype_name(in.dtype), ", output is ", dtype_name(out.dtype));
  DT_CHECK(InvalidArgument, in.numel == out.numel * static_cast<std::size_t>(size_),
           "reduce_scatter on ", name_, ": input has ", in.numel, " elements, needs ", size_, " x ",
           out.numel);
  return enqueue("reduce_scatter", in, [&](void* sv) {
    auto s = static_cast<cudaStream_t>(sv);
    return ncclReduceScatter(in.data, out.data, out.numel, nccl_type(in.dtype), nccl_op(op),
                             state_->comm, s);
  });
}

Work NcclComm::isend(ConstTensorView buf, int dst, int tag) {
  DT_CHECK(InvalidArgument, dst >= 0 && dst < size_ && dst != rank_, "send on ", name_, ": peer ",
           dst, " is not another rank of [0, ", size_, ")");
  DT_CHECK(InvalidArgument, tag >= 0, "send on ", name_, ": tag ", tag, " is negative");
  ncclComm_t comm = state_->comm;
  return enqueue_p2p("send", buf, [buf, dst, comm](void* sv) {
    return ncclSend(buf.data, buf.numel, nccl_type(buf.dtype), dst, comm,
                    static_cast<cudaStream_t>(sv));
  });
}

Work NcclComm::irecv(TensorView buf, int src, int tag) {
  DT_CHECK(InvalidArgument, src >= 0 && src < size_ && src != rank_, "recv on ", name_, ": peer ",
           src, " is not another rank of [0, ", size_, ")");
  DT_CHECK(InvalidArgument, tag >= 0, "recv on ", name_, ": tag ", tag, " is negative");
  ncclComm_t comm = state_->comm;
  return enqueue_p2p("recv", buf, [buf, src, comm](void* sv) {
    return ncclRecv(buf.data, buf.numel, nccl_type(buf.dtype), src, comm,
                    static_cast<cudaStream_t>(sv));
  });
}

Work NcclComm::ibarrier() {
  TensorView one{state_->barrier_buf, 1, DType::i32};
  return enqueue("barrier", one, [&](void* sv) {
    auto s = static_cast<cudaStream_t>(sv);
    return ncclAllReduce(state_->barrier_buf, state_->barrier_buf, 1, ncclInt32, ncclSum,
                         state_->comm, s);
  });
}

std::unique_ptr<Comm> NcclComm::split(int color, int key) {
  state_->flush_p2p();
  DT_CHECK(CommError, !state_->aborted, "split on rank ", rank_, " of ", name_,
           ": the communicator was aborted after an earlier NCCL failure");
  DT_CUDA(cudaSetDevice(device_), rank_, name_);
  ncclComm_t sub = nullptr;
  DT_NCCL(ncclCommSplit(state_->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, nullptr),
          state_->comm, rank_, name_);
  if (color < 0 || sub == nullptr) return nullptr;
  auto state = std::make_shared<State>();
  state->comm = sub;
  state->device = device_;
  int r = 0, n = 1;
  DT_NCCL(ncclCommUserRank(sub, &r), sub, rank_, name_);
  DT_NCCL(ncclCommCount(sub, &n), sub, rank_, name_);
  init_state(*state, r, name_ + "/split(" + std::to_string(color) + ")", stream_);
  return std::unique_ptr<Comm>(new NcclComm(
      std::move(state), r, n, name_ + "/split(" + std::to_string(color) + ")", stream_, device_));
}

}  // namespace dt

// The entry points of libdt_nccl.so, which libdt loads only for a run on CUDA devices
// (comm/nccl_module.cpp): its version, which must be libdt's, and NcclComm::create. Errors leave
// as the C++ exceptions NcclComm::create throws (libdt and this library share one C++ runtime).
extern "C" __attribute__((visibility("default"))) const char* dt_nccl_module_version() {
  return DT_VERSION;
}

extern "C" __attribute__((visibility("default"))) dt::Comm* dt_nccl_module_create(
    dt::MpiComm* bootstrap, int cuda_device, void* stream, const char* name) {
  return dt::NcclComm::create(*bootstrap, cuda_device, stream, name).release();
}
