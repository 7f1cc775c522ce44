#include "mpi_comm.hpp"

#include <sched.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstring>
#include <exception>
#include <functional>
#include <sstream>
#include <thread>
#include <type_traits>
#include <vector>

#include "shm_segment.hpp"

namespace dt {

namespace {

// reduce_scatter runs its own ring from this many bytes of input (below, MPI's algorithm).
constexpr std::size_t kRingReduceScatterBytes = std::size_t{1} << 20;
// The ring's pieces: its temporary memory.
constexpr std::size_t kRingChunkBytes = std::size_t{1} << 20;
// The ring's messages: a tag point-to-point users of the communicator do not use.
constexpr int kRingTag = 32767;

bool mpi_alive() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::bf16:
      return MPI_UINT16_T;
    case DType::f16:
      return MPI_UINT16_T;
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
    case DType::u8:
      return MPI_UINT8_T;
  }
  return MPI_DATATYPE_NULL;
}

// Branch-free bf16 <-> float (same rounding as dt::bf16) so the loops below vectorise.
inline float bf16_load(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline std::uint16_t bf16_store(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

void sum_bf16(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  const int n = *len;
  for (int i = 0; i < n; ++i) b[i] = bf16_store(bf16_load(a[i]) + bf16_load(b[i]));
}

template <class H, ReduceOp Op>
void reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = H::to_float(a[i]);
    const float y = H::to_float(b[i]);
    float r;
    if constexpr (Op == ReduceOp::sum) {
      r = x + y;
    } else if constexpr (Op == ReduceOp::max) {
      r = (y >= x || y != y) ? y : x;  // NaN in either input stays NaN
      if (x != x) r = x;
    } else {
      r = (y <= x || y != y) ? y : x;
      if (x != x) r = x;
    }
    b[i] = H::from_float(r);
  }
}

// max and min of f32 / f64 where a NaN in either input gives NaN, as the shared-memory path and
// the 16-bit ops above do (MPI_MAX and MPI_MIN keep whichever operand their comparison picks, so
// a NaN could vanish on some ranks and not on others).
template <class T, ReduceOp Op>
void reduce_nan(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const T x = a[i], y = b[i];
    if (x != x || y != y)
      b[i] = x != x ? x : y;
    else if constexpr (Op == ReduceOp::max)
      b[i] = x > y ? x : y;
    else
      b[i] = x < y ? x : y;
  }
}

// Divides in place by n: the second half of ReduceOp::avg.
void divide(TensorView v, int n) {
  visit_dtype(v.dtype, [&](auto z) {
    using T = decltype(z);
    T* p = static_cast<T*>(v.data);
    for (std::size_t i = 0; i < v.numel; ++i) {
      if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>)
        p[i] = T(static_cast<float>(p[i]) / static_cast<float>(n));
      else if constexpr (std::is_integral_v<T>)
        p[i] = static_cast<T>(static_cast<std::int64_t>(p[i]) / n);  // n may not fit in T
      else
        p[i] = static_cast<T>(p[i] / static_cast<T>(n));
    }
  });
}

int as_int_count(std::size_t n, const char* op) {
  DT_CHECK_LE(InvalidArgument, n, static_cast<std::size_t>(INT_MAX), op,
              ": element count exceeds MPI's int range for this operation");
  return static_cast<int>(n);
}

}  // namespace

void mpi_check(int rc, const char* call, int rank, const std::string& comm_name, const char* file,
               int line) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS)
    std::snprintf(text, sizeof text, "code %d", rc);
  std::string c = call;
  c = c.substr(0, c.find('('));
  throw CommError(c + " failed on rank " + std::to_string(rank) + " of " + comm_name + ": " + text,
                  file, line);
}

/// The user ops for bf16/f16 reductions, shared by a communicator and all its splits.
class MpiOps {
 public:
  MpiOps() {
    create<bf16>(0);
    create<f16>(3);
    MPI_Op_create(&reduce_nan<float, ReduceOp::max>, 1, &ops_[6]);
    MPI_Op_create(&reduce_nan<float, ReduceOp::min>, 1, &ops_[7]);
    MPI_Op_create(&reduce_nan<double, ReduceOp::max>, 1, &ops_[8]);
    MPI_Op_create(&reduce_nan<double, ReduceOp::min>, 1, &ops_[9]);
  }
  ~MpiOps() {
    if (!mpi_alive()) return;
    for (MPI_Op& o : ops_)
      if (o != MPI_OP_NULL) MPI_Op_free(&o);
  }
  MpiOps(const MpiOps&) = delete;
  MpiOps& operator=(const MpiOps&) = delete;

  MPI_Op get(DType t, ReduceOp op) const {
    const int k = op == ReduceOp::max ? 1 : op == ReduceOp::min ? 2 : 0;  // avg: sum, then divide
    if (t == DType::bf16) return ops_[k];
    if (t == DType::f16) return ops_[3 + k];
    if (k && t == DType::f32) return ops_[5 + k];
    if (k && t == DType::f64) return ops_[7 + k];
    return k == 1 ? MPI_MAX : k == 2 ? MPI_MIN : MPI_SUM;
  }

 private:
  template <class H>
  void create(int base) {
    if constexpr (std::is_same_v<H, bf16>)
      MPI_Op_create(&sum_bf16, 1, &ops_[base]);
    else
      MPI_Op_create(&reduce16<H, ReduceOp::sum>, 1, &ops_[base]);
    MPI_Op_create(&reduce16<H, ReduceOp::max>, 1, &ops_[base + 1]);
    MPI_Op_create(&reduce16<H, ReduceOp::min>, 1, &ops_[base + 2]);
  }
  // bf16 sum, max, min; f16 sum, max, min; f32 max, min; f64 max, min.
  MPI_Op ops_[10] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL,
                     MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
};

namespace {

// Between two polls of an operation a wait lets the core go after a short spin: it sleeps, 20 us
// and then 200 us at a time, except a polled wait (kPolledWait) on an ordinary thread, which
// yields the core and stays runnable. A progress thread that slept there was kept off an
// oversubscribed core by ranks spinning inside blocking MPI calls, for seconds at a time (a
// two-node Slurm job of 4 ranks on 2 cores never finished its first step; perf/RESULTS.md, "QoS
// tiers"), while waits with a limit, on the training thread, yield the core to the compute of
// the other ranks by sleeping. A real-time thread always sleeps: sched_yield() never hands its
// core to an ordinary thread, and it gets the core back as soon as it wakes.
void pause_between_polls(std::int64_t spins, bool polled) {
  if (spins <= 64) return;
  if (polled && !realtime_thread())
    sched_yield();
  else
    std::this_thread::sleep_for(std::chrono::microseconds(spins > 1024 ? 200 : 20));
}

class MpiWork final : public WorkImpl {
 public:
  /// A point-to-point operation (`p2p`), or a collective of the communicator whose flag
  /// `left_pending` is set if its Work ends unfinished.
  MpiWork(std::string desc, int rank, std::string comm, bool p2p,
          std::shared_ptr<std::atomic<bool>> left_pending = nullptr)
      : desc_(std::move(desc)),
        comm_(std::move(comm)),
        rank_(rank),
        p2p_(p2p),
        left_pending_(std::move(left_pending)) {}
  ~MpiWork() override {
    if (done_ || !mpi_alive()) return;
    // Point-to-point requests can be released and finish on their own, also those after a
    // failed one (a chunk of a receive that delivered the wrong count); an unfinished
    // collective request cannot be freed in MPI and is left to MPI_Finalize, and its
    // communicator with it.
    if (p2p_) {
      for (std::size_t i = next_; i < reqs_.size(); ++i)
        if (reqs_[i] != MPI_REQUEST_NULL) MPI_Request_free(&reqs_[i]);
      return;
    }
    if (next_ >= reqs_.size() || !left_pending_) return;
    int finished = 0;
    if (MPI_Testall(static_cast<int>(reqs_.size() - next_), reqs_.data() + next_, &finished,
                    MPI_STATUSES_IGNORE) != MPI_SUCCESS ||
        !finished)
      left_pending_->store(true);
  }

  std::vector<MPI_Request> reqs_;
  /// For receives: the element count each request must deliver (-1: not a receive).
  std::vector<int> expect_;
  MPI_Datatype recv_type_ = MPI_DATATYPE_NULL;
  std::function<void()> on_done_;
  watchdog::OpRecord record_;

  bool test() override {
    if (error_) std::rethrow_exception(error_);
    if (done_) return true;
    try {
      while (next_ < reqs_.size()) {
        if (reqs_[next_] == MPI_REQUEST_NULL) {  // a chunk that arrived during a cancel()
          ++next_;
          continue;
        }
        int flag = 0;
        MPI_Status st;
        check(MPI_Test(&reqs_[next_], &flag, &st), "MPI_Test");
        if (!flag) return false;
        check_count(st);
        ++next_;
      }
      finish();
    } catch (...) {
      error_ = std::current_exception();
      throw;
    }
    return true;
  }

  bool wait_for(Millis timeout) override {
    if (timeout.count() < 0) {
      if (error_) std::rethrow_exception(error_);
      if (done_) return true;
      try {
        for (; next_ < reqs_.size(); ++next_) {
          if (reqs_[next_] == MPI_REQUEST_NULL) continue;  // arrived during a cancel()
          MPI_Status st;
          check(MPI_Wait(&reqs_[next_], &st), "MPI_Wait");
          check_count(st);
        }
        finish();
      } catch (...) {
        error_ = std::current_exception();
        throw;
      }
      return true;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (std::int64_t spins = 0; !test(); ++spins) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      pause_between_polls(spins, timeout == kPolledWait);
    }
    return true;
  }

  std::string describe() const override { return desc_; }
  int rank() const override { return rank_; }

  // MPI_Cancel on every pending request (receives only: cancelling sends is deprecated), then
  // MPI_Test until each has ended, cancelled or received, within `grace`.
  bool cancel(Millis grace) override {
    if (done_) return true;
    if (!p2p_ || expect_.empty() || !mpi_alive()) return false;
    for (std::size_t i = next_; i < reqs_.size(); ++i)
      if (reqs_[i] != MPI_REQUEST_NULL) MPI_Cancel(&reqs_[i]);
    const auto deadline = std::chrono::steady_clock::now() + grace;
    bool cancelled = false;
    for (std::int64_t spins = 0;; ++spins) {
      bool pending = false;
      for (std::size_t i = next_; i < reqs_.size(); ++i) {
        if (reqs_[i] == MPI_REQUEST_NULL) continue;
        int flag = 0, was = 0;
        MPI_Status st;
        if (MPI_Test(&reqs_[i], &flag, &st) != MPI_SUCCESS) return false;
        if (!flag) {
          pending = true;
          continue;
        }
        MPI_Test_cancelled(&st, &was);
        cancelled = cancelled || was != 0;
        // A chunk that arrived is checked here: a later test() or wait() (after this cancel
        // ran out of grace) passes over its request, now MPI_REQUEST_NULL.
        if (!was && !error_) {
          const std::size_t at = next_;
          next_ = i;
          try {
            check_count(st);
          } catch (...) {
            error_ = std::current_exception();
          }
          next_ = at;
        }
      }
      if (!pending) break;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      pause_between_polls(spins, false);
    }
    next_ = reqs_.size();
    record_.complete();
    if (!error_)
      error_ = std::make_exception_ptr(
          CommError(desc_ + (cancelled ? ": cancelled" : ": cancelled after it arrived"), __FILE__,
                    __LINE__));
    return true;
  }

 private:
  void check(int rc, const char* call) {
    if (rc != MPI_SUCCESS) {
      try {
        mpi_check(rc, call, rank_, comm_, __FILE__, __LINE__);
      } catch (const CommError& e) {
        throw CommError(desc_ + ": " + e.message(), __FILE__, __LINE__);
      }
    }
  }
  void check_count(const MPI_Status& st) {
    if (next_ >= expect_.size() || expect_[next_] < 0) return;
    int got = 0;
    MPI_Get_count(&st, recv_type_, &got);
    if (got != expect_[next_])
      throw CommError(desc_ + ": the message holds " + std::to_string(got) + " elements, " +
                          std::to_string(expect_[next_]) + " expected (from rank " +
                          std::to_string(st.MPI_SOURCE) + ")",
                      __FILE__, __LINE__);
  }
  void finish() {
    done_ = true;
    if (on_done_) on_done_();
    record_.complete();
  }

  std::string desc_;
  std::string comm_;
  int rank_;
  bool p2p_;
  std::shared_ptr<std::atomic<bool>> left_pending_;
  std::size_t next_ = 0;
  bool done_ = false;
  std::exception_ptr error_;
};

// Runs f(offset, count) over [0, n) in pieces of at most `chunk` elements.
template <class F>
void for_chunks(std::size_t n, std::size_t chunk, F&& f) {
  for (std::size_t off = 0; off < n; off += chunk) f(off, std::min(chunk, n - off));
}

char* at(const void* p, std::size_t elems, DType t) {
  return static_cast<char*>(const_cast<void*>(p)) + elems * dtype_size(t);
}

}  // namespace

// The rank in `to` of every rank of `from` (MPI_UNDEFINED where it is not in `to`); an MPI error
// code in *rc (MPI_SUCCESS: the list is complete).
std::vector<int> ranks_in(MPI_Comm from, MPI_Comm to, int* rc) {
  MPI_Group fg = MPI_GROUP_NULL, tg = MPI_GROUP_NULL;
  int n = 0;
  MPI_Comm_size(from, &n);
  std::vector<int> in(static_cast<std::size_t>(n)), out(in.size(), MPI_UNDEFINED);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<int>(i);
  *rc = MPI_Comm_group(from, &fg);
  if (*rc == MPI_SUCCESS) *rc = MPI_Comm_group(to, &tg);
  if (*rc == MPI_SUCCESS) *rc = MPI_Group_translate_ranks(fg, n, in.data(), tg, out.data());
  if (fg != MPI_GROUP_NULL) MPI_Group_free(&fg);
  if (tg != MPI_GROUP_NULL) MPI_Group_free(&tg);
  return out;
}

std::string split_name(const std::string& parent, int nth, int color) {
  return parent + "/split" + (nth > 1 ? std::to_string(nth) : std::string()) + "(" +
         std::to_string(color) + ")";
}

std::unique_ptr<MpiComm> MpiComm::dup(MPI_Comm parent, std::string name) {
  MPI_Comm c = MPI_COMM_NULL;
  int rank = 0;
  MPI_Comm_rank(parent, &rank);
  DT_MPI(MPI_Comm_dup(parent, &c), rank, name);
  return std::unique_ptr<MpiComm>(new MpiComm(c, std::move(name), std::make_shared<MpiOps>()));
}

MpiComm::MpiComm(MPI_Comm c, std::string name, std::shared_ptr<MpiOps> ops)
    : comm_(c), name_(std::move(name)), ops_(std::move(ops)) {
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  int* ub = nullptr;
  int flag = 0;
  if (MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag) == MPI_SUCCESS && flag && ub)
    tag_ub_ = std::max(*ub, 32767);
  // The world ranks of the members, so that the hang watchdog judges a collective on this
  // communicator among them alone.
  int rc = MPI_SUCCESS;
  world_ranks_ = ranks_in(comm_, MPI_COMM_WORLD, &rc);
  if (rc != MPI_SUCCESS) world_ranks_.clear();
  if (!world_ranks_.empty()) watchdog::note_members(name_, world_ranks_);
}

MpiComm::~MpiComm() {
  if (comm_ != MPI_COMM_NULL && mpi_alive() && !left_pending_->load()) MPI_Comm_free(&comm_);
}

void MpiComm::set_max_chunk(std::size_t elements) {
  DT_CHECK_GT(InvalidArgument, elements, std::size_t{0}, "max chunk");
  max_chunk_ = std::min<std::size_t>(elements, INT_MAX);
}

watchdog::OpRecord MpiComm::record(const char* op, ConstTensorView v) {
  return watchdog::OpRecord(name_, ++calls_, op, "mpi", v.dtype, v.numel);
}

std::string MpiComm::what(const char* op, ConstTensorView v, const char* extra) const {
  std::ostringstream os;
  os << op << '(' << dtype_name(v.dtype) << " x " << v.numel;
  if (extra) os << ", " << extra;
  os << ") on " << name_;
  return os.str();
}

void MpiComm::check_root(int root, const char* op) const {
  DT_CHECK(InvalidArgument, root >= 0 && root < size_, op, " on ", name_, ": root ", root,
           " is not a rank of a communicator of size ", size_);
}

void MpiComm::check_peer(int peer, int tag, const char* op) const {
  DT_CHECK(InvalidArgument, peer >= 0 && peer < size_, op, " on ", name_, ": peer ", peer,
           " is not a rank of a communicator of size ", size_);
  DT_CHECK(InvalidArgument, tag >= 0 && tag != kRingTag, op, " on ", name_, ": tag ", tag,
           " is negative or reserved (", kRingTag, ": reduce_scatter's ring)");
  DT_CHECK(InvalidArgument, tag <= tag_ub_, op, " on ", name_, ": tag ", tag,
           " is above the largest this MPI takes (MPI_TAG_UB = ", tag_ub_, ")");
}

// ---- all_reduce ---------------------------------------------------------------------------------

Work MpiComm::iall_reduce(TensorView buf, ReduceOp op) {
  auto w = std::make_unique<MpiWork>(what("all_reduce", buf, reduce_op_name(op)), rank_, name_,
                                     false, left_pending_);
  w->record_ = record("all_reduce", buf);
  const MPI_Datatype t = mpi_type(buf.dtype);
  const MPI_Op o = ops_->get(buf.dtype, op);
  for_chunks(buf.numel, max_chunk_, [&](std::size_t off, std::size_t n) {
    MPI_Request r;
    DT_MPI(MPI_Iallreduce(MPI_IN_PLACE, at(buf.data, off, buf.dtype), static_cast<int>(n), t, o,
                          comm_, &r),
           rank_, name_);
    w->reqs_.push_back(r);
  });
  if (op == ReduceOp::avg) w->on_done_ = [buf, n = size_] { divide(buf, n); };
  return Work(std::move(w));
}

void MpiComm::all_reduce(TensorView buf, ReduceOp op, const CommOptions& opts) {
  if (opts.timeout != kNoTimeout) return Comm::all_reduce(buf, op, opts);
  const auto rec = record("all_reduce", buf);
  const MPI_Datatype t = mpi_type(buf.dtype);
  const MPI_Op o = ops_->get(buf.dtype, op);
  for_chunks(buf.numel, max_chunk_, [&](std::size_t off, std::size_t n) {
    DT_MPI(
        MPI_Allreduce(MPI_IN_PLACE, at(buf.data, off, buf.dtype), static_cast<int>(n), t, o, comm_),
        rank_, name_);
  });
  if (op == ReduceOp::avg) divide(buf, size_);
}

// ---- broadcast ----------------------------------------------------------------------------------

Work MpiComm::ibroadcast(TensorView buf, int root) {
  check_root(root, "broadcast");
  auto w = std::make_unique<MpiWork>(what("broadcast", buf), rank_, name_, false, left_pending_);
  w->record_ = record("broadcast", buf);
  for_chunks(buf.numel, max_chunk_, [&](std::size_t off, std::size_t n) {
    MPI_Request r;
    DT_MPI(MPI_Ibcast(at(buf.data, off, buf.dtype), static_cast<int>(n), mpi_type(buf.dtype), root,
                      comm_, &r),
           rank_, name_);
    w->reqs_.push_back(r);
  });
  return Work(std::move(w));
}

void MpiComm::broadcast(TensorView buf, int root, const CommOptions& opts) {
  if (opts.timeout != kNoTimeout) return Comm::broadcast(buf, root, opts);
  check_root(root, "broadcast");
  const auto rec = record("broadcast", buf);
  for_chunks(buf.numel, max_chunk_, [&](std::size_t off, std::size_t n) {
    DT_MPI(MPI_Bcast(at(buf.data, off, buf.dtype), static_cast<int>(n), mpi_type(buf.dtype), root,
                     comm_),
           rank_, name_);
  });
}

// ---- all_gather ---------------------------------------------------------------------------------

namespace {
void check_gather(ConstTensorView in, TensorView out, int size, const std::string& name) {
  DT_CHECK(InvalidArgument, in.dtype == out.dtype, "all_gather on ", name, ": input is ",
           dtype_name(in.dtype), ", output is ", dtype_name(out.dtype));
  DT_CHECK_EQ(InvalidArgument, out.numel, in.numel * static_cast<std::size_t>(size),
              "all_gather on ", name, ": output must hold size() x input elements");
}
void check_scatter(ConstTensorView in, TensorView out, int size, const std::string& name) {
  DT_CHECK(InvalidArgument, in.dtype == out.dtype, "reduce_scatter on ", name, ": input is ",
           dtype_name(in.dtype), ", output is ", dtype_name(out.dtype));
  DT_CHECK_EQ(InvalidArgument, in.numel, out.numel * static_cast<std::size_t>(size),
              "reduce_scatter on ", name, ": input must hold size() x output elements");
}
}  // namespace

Work MpiComm::iall_gather(ConstTensorView in, TensorView out) {
  check_gather(in, out, size_, name_);
  // Open MPI's non-blocking collectives (libnbc) compute a rank's offset as rank x count in an
  // int: the whole output's element count must fit in one too, or it would write at wrapped
  // offsets.
  as_int_count(out.numel, "all_gather (non-blocking: the whole output)");
  const int n = as_int_count(in.numel, "all_gather");
  auto w = std::make_unique<MpiWork>(what("all_gather", in), rank_, name_, false, left_pending_);
  w->record_ = record("all_gather", in);
  const bool in_place = in.numel > 0 && in.data == at(out.data, in.numel * rank_, in.dtype);
  MPI_Request r;
  DT_MPI(MPI_Iallgather(in_place ? MPI_IN_PLACE : in.data, n, mpi_type(in.dtype), out.data, n,
                        mpi_type(in.dtype), comm_, &r),
         rank_, name_);
  w->reqs_.push_back(r);
  return Work(std::move(w));
}

void MpiComm::all_gather(ConstTensorView in, TensorView out, const CommOptions& opts) {
  if (opts.timeout != kNoTimeout) return Comm::all_gather(in, out, opts);
  check_gather(in, out, size_, name_);
  const auto rec = record("all_gather", in);
  const int n = as_int_count(in.numel, "all_gather");
  const bool in_place = in.numel > 0 && in.data == at(out.data, in.numel * rank_, in.dtype);
  DT_MPI(MPI_Allgather(in_place ? MPI_IN_PLACE : in.data, n, mpi_type(in.dtype), out.data, n,
                       mpi_type(in.dtype), comm_),
         rank_, name_);
}

// ---- reduce_scatter -----------------------------------------------------------------------------

Work MpiComm::ireduce_scatter(ConstTensorView in, TensorView out, ReduceOp op) {
  check_scatter(in, out, size_, name_);
  // Open MPI's non-blocking reduce_scatter (libnbc) counts the whole input (size x count) in an
  // int: beyond it, it skips the operation or reads at wrapped offsets.
  as_int_count(in.numel, "reduce_scatter (non-blocking: the whole input)");
  const int n = as_int_count(out.numel, "reduce_scatter");
  auto w = std::make_unique<MpiWork>(what("reduce_scatter", in, reduce_op_name(op)), rank_, name_,
                                     false, left_pending_);
  w->record_ = record("reduce_scatter", in);
  MPI_Request r;
  DT_MPI(MPI_Ireduce_scatter_block(in.data, out.data, n, mpi_type(in.dtype),
                                   ops_->get(in.dtype, op), comm_, &r),
         rank_, name_);
  w->reqs_.push_back(r);
  if (op == ReduceOp::avg) w->on_done_ = [out, s = size_] { divide(out, s); };
  return Work(std::move(w));
}

void MpiComm::reduce_scatter(ConstTensorView in, TensorView out, ReduceOp op,
                             const CommOptions& opts) {
  // kPolledWait (a real-time thread's wait): the small case goes non-blocking and polled; the
  // ring below polls its point-to-point steps (which match blocking ones on other ranks).
  const bool polled = opts.timeout == kPolledWait;
  const std::size_t bytes = out.numel * dtype_size(out.dtype);
  const bool ring = size_ > 1 && bytes * static_cast<std::size_t>(size_) >= kRingReduceScatterBytes;
  if (opts.timeout != kNoTimeout && !(polled && ring))
    return Comm::reduce_scatter(in, out, op, opts);
  check_scatter(in, out, size_, name_);
  const auto rec = record("reduce_scatter", in);
  const int n = as_int_count(out.numel, "reduce_scatter");
  if (!ring) {
    DT_MPI(MPI_Reduce_scatter_block(in.data, out.data, n, mpi_type(in.dtype),
                                    ops_->get(in.dtype, op), comm_),
           rank_, name_);
  } else {
    // A ring: Open MPI runs MPI_Reduce_scatter_block as a reduce to rank 0 and a scatter (rank
    // 0 then holds the whole input twice more) and MPI_Reduce_scatter by recursive halving (a
    // whole-input temporary on every rank). Piece by piece of at most kRingChunkBytes: step k
    // passes the partial sum of slice r-1-k to the right (accumulated in `out`) and adds this
    // rank's part of slice r-2-k to what arrives from the left; after size-1 steps `out` holds
    // slice r. One piece of temporary memory.
    const int right = (rank_ + 1) % size_, left = (rank_ + size_ - 1) % size_;
    const std::size_t es = dtype_size(in.dtype);
    const std::size_t per = std::max<std::size_t>(1, kRingChunkBytes / es);
    std::vector<char> recv(std::min(per, out.numel) * es);
    for (std::size_t off = 0; off < out.numel; off += per) {
      const std::size_t m = std::min(per, out.numel - off);
      auto part = [&](int k) {  // elements [off, off + m) of slice k
        const int i = ((k % size_) + size_) % size_;
        return at(in.data, out.numel * static_cast<std::size_t>(i) + off, in.dtype);
      };
      void* acc = at(out.data, off, out.dtype);
      std::memcpy(acc, part(rank_ - 1), m * es);
      for (int k = 0; k < size_ - 1; ++k) {
        if (!polled) {
          DT_MPI(MPI_Sendrecv(acc, static_cast<int>(m), mpi_type(in.dtype), right, kRingTag,
                              recv.data(), static_cast<int>(m), mpi_type(in.dtype), left, kRingTag,
                              comm_, MPI_STATUS_IGNORE),
                 rank_, name_);
        } else {
          MPI_Request rq[2];
          DT_MPI(MPI_Irecv(recv.data(), static_cast<int>(m), mpi_type(in.dtype), left, kRingTag,
                           comm_, &rq[0]),
                 rank_, name_);
          DT_MPI(MPI_Isend(acc, static_cast<int>(m), mpi_type(in.dtype), right, kRingTag, comm_,
                           &rq[1]),
                 rank_, name_);
          int done = 0;
          for (std::int64_t spins = 0; !done; ++spins) {
            DT_MPI(MPI_Testall(2, rq, &done, MPI_STATUSES_IGNORE), rank_, name_);
            if (!done) pause_between_polls(spins, true);
          }
        }
        std::memcpy(acc, part(rank_ - 2 - k), m * es);
        DT_MPI(MPI_Reduce_local(recv.data(), acc, static_cast<int>(m), mpi_type(in.dtype),
                                ops_->get(in.dtype, op)),
               rank_, name_);
      }
    }
  }
  if (op == ReduceOp::avg) divide(out, size_);
}

// ---- point to point -----------------------------------------------------------------------------

Work MpiComm::isend(ConstTensorView buf, int dst, int tag) {
  check_peer(dst, tag, "send");
  std::string extra = "to " + std::to_string(dst) + ", tag " + std::to_string(tag);
  auto w = std::make_unique<MpiWork>(what("send", buf, extra.c_str()), rank_, name_, true);
  for_chunks(buf.numel, max_chunk_, [&](std::size_t off, std::size_t n) {
    MPI_Request r;
    DT_MPI(MPI_Isend(at(buf.data, off, buf.dtype), static_cast<int>(n), mpi_type(buf.dtype), dst,
                     tag, comm_, &r),
           rank_, name_);
    w->reqs_.push_back(r);
  });
  if (buf.numel == 0) {  // a zero-length message still has to match the peer's receive
    MPI_Request r;
    DT_MPI(MPI_Isend(buf.data, 0, mpi_type(buf.dtype), dst, tag, comm_, &r), rank_, name_);
    w->reqs_.push_back(r);
  }
  return Work(std::move(w));
}

Work MpiComm::irecv(TensorView buf, int src, int tag) {
  check_peer(src, tag, "recv");
  std::string extra = "from " + std::to_string(src) + ", tag " + std::to_string(tag);
  auto w = std::make_unique<MpiWork>(what("recv", buf, extra.c_str()), rank_, name_, true);
  w->recv_type_ = mpi_type(buf.dtype);
  for_chunks(buf.numel, max_chunk_, [&](std::size_t off, std::size_t n) {
    MPI_Request r;
    DT_MPI(MPI_Irecv(at(buf.data, off, buf.dtype), static_cast<int>(n), mpi_type(buf.dtype), src,
                     tag, comm_, &r),
           rank_, name_);
    w->reqs_.push_back(r);
    w->expect_.push_back(static_cast<int>(n));
  });
  if (buf.numel == 0) {
    MPI_Request r;
    DT_MPI(MPI_Irecv(buf.data, 0, mpi_type(buf.dtype), src, tag, comm_, &r), rank_, name_);
    w->reqs_.push_back(r);
    w->expect_.push_back(0);
  }
  return Work(std::move(w));
}

void MpiComm::send(ConstTensorView buf, int dst, int tag, const CommOptions& opts) {
  if (opts.timeout != kNoTimeout) return Comm::send(buf, dst, tag, opts);
  check_peer(dst, tag, "send");
  if (buf.numel == 0) {
    DT_MPI(MPI_Send(buf.data, 0, mpi_type(buf.dtype), dst, tag, comm_), rank_, name_);
    return;
  }
  for_chunks(buf.numel, max_chunk_, [&](std::size_t off, std::size_t n) {
    DT_MPI(MPI_Send(at(buf.data, off, buf.dtype), static_cast<int>(n), mpi_type(buf.dtype), dst,
                    tag, comm_),
           rank_, name_);
  });
}

void MpiComm::recv(TensorView buf, int src, int tag, const CommOptions& opts) {
  if (opts.timeout != kNoTimeout) return Comm::recv(buf, src, tag, opts);
  check_peer(src, tag, "recv");
  auto recv_exact = [&](void* p, std::size_t n) {
    MPI_Status st;
    DT_MPI(MPI_Recv(p, static_cast<int>(n), mpi_type(buf.dtype), src, tag, comm_, &st), rank_,
           name_);
    int got = 0;
    MPI_Get_count(&st, mpi_type(buf.dtype), &got);
    DT_CHECK(CommError, got == static_cast<int>(n), what("recv", buf), " on rank ", rank_,
             ": the message from rank ", src, " holds ", got, " elements, ", n, " expected");
  };
  if (buf.numel == 0) return recv_exact(buf.data, 0);
  for_chunks(buf.numel, max_chunk_,
             [&](std::size_t off, std::size_t n) { recv_exact(at(buf.data, off, buf.dtype), n); });
}

// ---- barrier and split --------------------------------------------------------------------------

Work MpiComm::ibarrier() {
  auto w = std::make_unique<MpiWork>("barrier on " + name_, rank_, name_, false, left_pending_);
  w->record_ = record("barrier", ConstTensorView{nullptr, 0, DType::u8});
  MPI_Request r;
  DT_MPI(MPI_Ibarrier(comm_, &r), rank_, name_);
  w->reqs_.push_back(r);
  return Work(std::move(w));
}

void MpiComm::barrier(const CommOptions& opts) {
  if (opts.timeout != kNoTimeout) return Comm::barrier(opts);
  const auto rec = record("barrier", ConstTensorView{nullptr, 0, DType::u8});
  DT_MPI(MPI_Barrier(comm_), rank_, name_);
}

std::unique_ptr<Comm> MpiComm::split(int color, int key) { return split_mpi(color, key); }

std::unique_ptr<MpiComm> MpiComm::split_mpi(int color, int key) {
  MPI_Comm c = MPI_COMM_NULL;
  DT_MPI(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &c), rank_, name_);
  // Every member calls split in the same order, so the count names a split alike on every rank:
  // the first split of "world" gives "world/split(C)", its second "world/split2(C)", ...
  ++splits_;
  if (c == MPI_COMM_NULL) return nullptr;
  return std::unique_ptr<MpiComm>(new MpiComm(c, split_name(name_, splits_, color), ops_));
}

std::vector<int> MpiComm::node_peers() {
  const std::unique_ptr<MpiComm> local = split_shared();
  int rc = MPI_SUCCESS;
  const std::vector<int> out = ranks_in(local->handle(), comm_, &rc);
  DT_MPI(rc, rank_, name_);
  std::vector<int> peers;
  for (int r : out)
    if (r != rank_ && r != MPI_UNDEFINED) peers.push_back(r);
  return peers;
}

std::unique_ptr<MpiComm> MpiComm::split_shared() {
  MPI_Comm c = MPI_COMM_NULL;
  DT_MPI(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &c), rank_, name_);
  return std::unique_ptr<MpiComm>(new MpiComm(c, name_ + "/node", ops_));
}

}  // namespace dt
