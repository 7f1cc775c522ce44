#include "ucx_p2p.hpp"

#include <ucp/api/ucp.h>

#include <chrono>
#include <exception>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "comm/mpi_comm.hpp"

namespace dt {

namespace {

using Clock = std::chrono::steady_clock;

/// How long a UcxP2p's end waits for its endpoints' flushes and for the peers to end theirs:
/// normally, and while an exception unwinds through it.
constexpr std::chrono::milliseconds kCloseBound{10000};
constexpr std::chrono::milliseconds kUnwindingBound{1000};

bool mpi_alive() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

/// Throws dt::CommError "CALL failed on rank R of NAME: <ucs_status_string>" unless s is UCS_OK.
void ucs_check(ucs_status_t s, const char* call, int rank, const std::string& name,
               const char* file, int line) {
  if (s == UCS_OK) return;
  std::string c = call;
  c = c.substr(0, c.find('('));
  throw CommError(
      c + " failed on rank " + std::to_string(rank) + " of " + name + ": " + ucs_status_string(s),
      file, line);
}
#define DT_UCS(call, rank, name) ucs_check((call), #call, (rank), (name), __FILE__, __LINE__)

void mpi_boot_check(int rc, const char* call, int rank, const std::string& name) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS)
    std::snprintf(text, sizeof text, "code %d", rc);
  DT_THROW(CommError, call, " failed on rank ", rank, " while bootstrapping ", name, ": ", text);
}

struct ConfigFree {
  void operator()(ucp_config_t* c) const noexcept { ucp_config_release(c); }
};
struct ContextFree {
  void operator()(ucp_context* c) const noexcept { ucp_cleanup(c); }
};
struct WorkerFree {
  void operator()(ucp_worker* w) const noexcept { ucp_worker_destroy(w); }
};

/// Owns one UCX request handle: released with ucp_request_free (the operation itself goes on
/// and completes on its own; UCX frees the request then).
class Request {
 public:
  Request() = default;
  explicit Request(void* r) : r_(r) {}
  Request(Request&& o) noexcept : r_(o.r_) { o.r_ = nullptr; }
  Request& operator=(Request&& o) noexcept {
    if (this != &o) {
      reset();
      r_ = o.r_;
      o.r_ = nullptr;
    }
    return *this;
  }
  ~Request() { reset(); }
  void reset() noexcept {
    if (r_) ucp_request_free(r_);
    r_ = nullptr;
  }
  void* get() const noexcept { return r_; }
  explicit operator bool() const noexcept { return r_ != nullptr; }

 private:
  void* r_ = nullptr;
};

}  // namespace

struct UcxP2p::State {
  int rank = 0;
  int size = 1;
  std::string name;
  MPI_Comm comm = MPI_COMM_NULL;  // duplicate of the bootstrap communicator
  std::mutex mu;                  // guards every UCX call on ctx/worker/eps and their requests
  // Declaration order is destruction order in reverse: endpoints are closed explicitly in
  // ~State, then the worker goes, then the context.
  std::unique_ptr<ucp_context, ContextFree> ctx;
  std::unique_ptr<ucp_worker, WorkerFree> worker;
  std::vector<ucp_ep_h> eps;

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    // Ranks that end together meet within the bound. One that goes while an error unwinds
    // through it waits only briefly: its peers, which may not share the error, may be waiting on
    // this rank and would never arrive, and the error's handler (which may end the job) is
    // reached at once instead of after the whole bound.
    const auto bound = std::uncaught_exceptions() > 0 ? kUnwindingBound : kCloseBound;
    const auto deadline = Clock::now() + bound;
    close_endpoints(deadline);
    // A fence some rank never came to keeps its communicator: freeing it with the barrier still
    // pending lets Open MPI progress that barrier on a freed communicator once the others come.
    if (comm != MPI_COMM_NULL && mpi_alive() && fence(deadline)) MPI_Comm_free(&comm);
    worker.reset();
    ctx.reset();
  }

  // Flush-closes every endpoint, progressing the worker until all closes finished or `deadline`.
  void close_endpoints(Clock::time_point deadline) noexcept {
    if (!worker) return;
    std::vector<Request> pending;
    for (ucp_ep_h& ep : eps) {
      if (!ep) continue;
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = 0;  // UCP_EP_CLOSE_MODE_FLUSH: what was sent is delivered first
      ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
      if (UCS_PTR_IS_PTR(r)) pending.emplace_back(r);
      ep = nullptr;
    }
    for (Request& r : pending) {
      for (int idle = 0;
           ucp_request_check_status(r.get()) == UCS_INPROGRESS && Clock::now() < deadline;)
        progress_or_pause(idle);
      r.reset();
    }
  }

  // One round of a wait at the end: progresses the worker, and sleeps 50 us once 64 rounds in a
  // row found nothing to do (ranks share cores).
  void progress_or_pause(int& idle) noexcept {
    if (worker && ucp_worker_progress(worker.get()) != 0) {
      idle = 0;
    } else if (++idle > 64) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // Waits until every rank has closed its endpoints, progressing UCX meanwhile (a peer's flush
  // may need this rank's progress), so no rank tears down a worker a peer still talks to. False
  // where the barrier did not complete by `deadline` (a rank that never came: the request is
  // left to MPI, which completes it when the others come, or to the job's end).
  bool fence(Clock::time_point deadline) noexcept {
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Ibarrier(comm, &req) != MPI_SUCCESS) return false;
    int done = 0;
    for (int idle = 0; Clock::now() < deadline; progress_or_pause(idle)) {
      if (MPI_Test(&req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
      if (done) return true;
    }
    return false;
  }
};

namespace {

class UcxWork final : public WorkImpl {
 public:
  UcxWork(std::shared_ptr<UcxP2p::State> st, std::string desc, bool recv, int peer,
          std::size_t nbytes)
      : st_(std::move(st)), desc_(std::move(desc)), recv_(recv), peer_(peer), nbytes_(nbytes) {}
  ~UcxWork() override {
    std::lock_guard<std::mutex> lock(st_->mu);
    req_.reset();
  }

  /// Called once after posting (mutex held): `r` is the posting call's result.
  void posted(ucs_status_ptr_t r) {
    if (UCS_PTR_IS_PTR(r)) {
      req_ = Request(r);
      return;
    }
    complete(UCS_PTR_STATUS(r));
  }

  bool test() override {
    if (error_) std::rethrow_exception(error_);
    if (done_) return true;
    std::lock_guard<std::mutex> lock(st_->mu);
    ucp_worker_progress(st_->worker.get());
    return poll();
  }

  bool wait_for(Millis timeout) override {
    const bool forever = timeout.count() < 0;
    const auto deadline = Clock::now() + (forever ? Millis(0) : timeout);
    for (std::int64_t spins = 0;; ++spins) {
      if (error_) std::rethrow_exception(error_);
      if (done_) return true;
      unsigned progressed = 0;
      {
        std::lock_guard<std::mutex> lock(st_->mu);
        progressed = ucp_worker_progress(st_->worker.get());
        if (poll()) return true;
      }
      if (!forever && Clock::now() >= deadline) return false;
      if (progressed) {
        spins = 0;
      } else if (spins > 1024) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      } else if (spins > 64) {
        std::this_thread::yield();  // ranks share cores: let the peer run
      }
    }
  }

  std::string describe() const override { return desc_; }
  int rank() const override { return st_->rank; }

  // ucp_request_cancel (receives: a send cannot be withdrawn), then progress until the request
  // has ended, cancelled or received, within `grace`.
  bool cancel(Millis grace) override {
    std::lock_guard<std::mutex> lock(st_->mu);
    if (done_ || (error_ && !req_)) return true;
    if (!recv_ || !req_) return false;
    ucp_request_cancel(st_->worker.get(), req_.get());
    const auto deadline = Clock::now() + grace;
    for (std::int64_t spins = 0;; ++spins) {
      ucp_worker_progress(st_->worker.get());
      const ucs_status_t s = ucp_tag_recv_request_test(req_.get(), &info_);
      if (s != UCS_INPROGRESS) {
        req_.reset();
        error_ = std::make_exception_ptr(CommError(
            desc_ + (s == UCS_ERR_CANCELED ? ": cancelled" : ": cancelled after it arrived"),
            __FILE__, __LINE__));
        return true;
      }
      if (Clock::now() >= deadline) return false;
      if (spins > 64) std::this_thread::yield();
    }
  }

 private:
  // Mutex held. Checks the request; true when complete (throws the stored error on failure).
  bool poll() {
    if (error_) std::rethrow_exception(error_);
    if (done_) return true;
    const ucs_status_t s = recv_ ? ucp_tag_recv_request_test(req_.get(), &info_)
                                 : ucp_request_check_status(req_.get());
    if (s == UCS_INPROGRESS) return false;
    req_.reset();
    complete(s);
    if (error_) std::rethrow_exception(error_);
    return true;
  }

  // Records the final status; errors are stored and rethrown by test()/wait().
  void complete(ucs_status_t s) {
    try {
      if (s == UCS_ERR_MESSAGE_TRUNCATED)
        DT_THROW(CommError, desc_, " on rank ", st_->rank, ": the message from rank ", peer_,
                 " is longer than the ", nbytes_, " bytes expected (", ucs_status_string(s), ")");
      if (s != UCS_OK)
        DT_THROW(CommError, desc_, " on rank ", st_->rank, " failed: ", ucs_status_string(s));
      if (recv_ && info_.length != nbytes_)
        DT_THROW(CommError, desc_, " on rank ", st_->rank, ": the message from rank ", peer_,
                 " holds ", info_.length, " bytes, ", nbytes_, " expected");
      done_ = true;
    } catch (...) {
      error_ = std::current_exception();
    }
  }

  std::shared_ptr<UcxP2p::State> st_;
  std::string desc_;
  bool recv_;
  int peer_;
  std::size_t nbytes_;
  Request req_;
  ucp_tag_recv_info_t info_{};
  bool done_ = false;
  std::exception_ptr error_;
};

std::string what(const char* op, ConstTensorView v, const char* dir, int peer, int tag,
                 const std::string& name) {
  std::ostringstream os;
  os << op << '(' << dtype_name(v.dtype) << " x " << v.numel << ", " << dir << ' ' << peer
     << ", tag " << tag << ") on " << name;
  return os.str();
}

}  // namespace

std::unique_ptr<UcxP2p> UcxP2p::create(MPI_Comm bootstrap, std::string name) {
  auto st = std::make_shared<State>();
  st->name = std::move(name);
  MPI_Comm_rank(bootstrap, &st->rank);
  MPI_Comm_size(bootstrap, &st->size);
  const int rank = st->rank;
  const std::string& nm = st->name;
  mpi_boot_check(MPI_Comm_dup(bootstrap, &st->comm), "MPI_Comm_dup", rank, nm);
  MPI_Comm_set_errhandler(st->comm, MPI_ERRORS_RETURN);

  // UCX_* environment variables apply as usual; nothing is overridden (see the header).
  std::vector<char> mine;  // this rank's worker address
  on_every_rank(st->comm, rank, nm, "start UCX", [&] {
    ucp_config_t* raw_cfg = nullptr;
    DT_UCS(ucp_config_read(nullptr, nullptr, &raw_cfg), rank, nm);
    std::unique_ptr<ucp_config_t, ConfigFree> cfg(raw_cfg);

    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS |
                        UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_TAG;
    params.estimated_num_eps = static_cast<std::size_t>(st->size);
    params.mt_workers_shared = 0;
    params.name = "dt";
    ucp_context_h ctx = nullptr;
    DT_UCS(ucp_init(&params, cfg.get(), &ctx), rank, nm);
    st->ctx.reset(ctx);

    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    ucp_worker_h worker = nullptr;
    DT_UCS(ucp_worker_create(st->ctx.get(), &wp, &worker), rank, nm);
    st->worker.reset(worker);

    ucp_address_t* addr = nullptr;
    std::size_t len = 0;
    DT_UCS(ucp_worker_get_address(worker, &addr, &len), rank, nm);
    const char* p = reinterpret_cast<const char*>(addr);
    mine.assign(p, p + len);
    ucp_worker_release_address(worker, addr);
    DT_CHECK(CommError, mine.size() <= static_cast<std::size_t>(INT32_MAX),
             "UCX worker address too long: ", mine.size(), " bytes");
  });
  ucp_worker_h worker = st->worker.get();

  // Worker addresses of all ranks.
  const int my_len = static_cast<int>(mine.size());
  std::vector<int> lens(static_cast<std::size_t>(st->size)), offs(lens.size());
  mpi_boot_check(MPI_Allgather(&my_len, 1, MPI_INT, lens.data(), 1, MPI_INT, st->comm),
                 "MPI_Allgather", rank, nm);
  std::size_t total = 0;
  for (std::size_t r = 0; r < lens.size(); ++r) {
    offs[r] = static_cast<int>(total);
    total += static_cast<std::size_t>(lens[r]);
  }
  DT_CHECK(CommError, total <= static_cast<std::size_t>(INT32_MAX),
           "UCX worker addresses too long: ", total, " bytes");
  std::vector<char> all(total);
  mpi_boot_check(MPI_Allgatherv(mine.data(), my_len, MPI_BYTE, all.data(), lens.data(), offs.data(),
                                MPI_BYTE, st->comm),
                 "MPI_Allgatherv", rank, nm);

  st->eps.assign(lens.size(), nullptr);
  on_every_rank(st->comm, rank, nm, "connect to its peers over UCX", [&] {
    for (std::size_t r = 0; r < lens.size(); ++r) {
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
      ep.address = reinterpret_cast<const ucp_address_t*>(all.data() + offs[r]);
      DT_UCS(ucp_ep_create(worker, &ep, &st->eps[r]), rank, nm);
    }
  });
  return std::unique_ptr<UcxP2p>(new UcxP2p(std::move(st)));
}

UcxP2p::UcxP2p(std::shared_ptr<State> st) : st_(std::move(st)) {}
UcxP2p::~UcxP2p() = default;

int UcxP2p::rank() const noexcept { return st_->rank; }
int UcxP2p::size() const noexcept { return st_->size; }
MPI_Comm UcxP2p::bootstrap() const noexcept { return st_->comm; }
const std::string& UcxP2p::name() const noexcept { return st_->name; }

Work UcxP2p::isend(ConstTensorView buf, int dst, int tag) {
  DT_CHECK(InvalidArgument, dst >= 0 && dst < st_->size, "send on ", st_->name, ": peer ", dst,
           " is not a rank of a communicator of size ", st_->size);
  auto w = std::make_unique<UcxWork>(st_, what("send", buf, "to", dst, tag, st_->name), false, dst,
                                     buf.nbytes());
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
  p.datatype = ucp_dt_make_contig(1);
  std::lock_guard<std::mutex> lock(st_->mu);
  ucs_status_ptr_t r = ucp_tag_send_nbx(st_->eps[static_cast<std::size_t>(dst)], buf.data,
                                        buf.nbytes(), wire_tag(st_->rank, tag), &p);
  if (UCS_PTR_IS_ERR(r))
    ucs_check(UCS_PTR_STATUS(r), "ucp_tag_send_nbx", st_->rank, st_->name, __FILE__, __LINE__);
  w->posted(r);
  return Work(std::move(w));
}

Work UcxP2p::irecv(TensorView buf, int src, int tag) {
  DT_CHECK(InvalidArgument, src >= 0 && src < st_->size, "recv on ", st_->name, ": peer ", src,
           " is not a rank of a communicator of size ", st_->size);
  auto w = std::make_unique<UcxWork>(st_, what("recv", buf, "from", src, tag, st_->name), true, src,
                                     buf.nbytes());
  ucp_request_param_t p{};
  // Always a request (UCX 1.13 leaves recv_info unset when a receive of an already arrived
  // message completes at once), so the length comes from ucp_tag_recv_request_test.
  p.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  p.datatype = ucp_dt_make_contig(1);
  std::lock_guard<std::mutex> lock(st_->mu);
  ucs_status_ptr_t r = ucp_tag_recv_nbx(st_->worker.get(), buf.data, buf.nbytes(),
                                        wire_tag(src, tag), ~ucp_tag_t{0}, &p);
  // A truncated message that completed at once fails the Work (at test/wait), as with MPI.
  if (UCS_PTR_IS_ERR(r) && UCS_PTR_STATUS(r) != UCS_ERR_MESSAGE_TRUNCATED)
    ucs_check(UCS_PTR_STATUS(r), "ucp_tag_recv_nbx", st_->rank, st_->name, __FILE__, __LINE__);
  w->posted(r);
  return Work(std::move(w));
}

}  // namespace dt
