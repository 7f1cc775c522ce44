// dt::security::make_sealed_comm: dt's own collectives over sealed point-to-point messages.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>

#include "comm/abandon.hpp"
#include "comm/mpi_comm.hpp"
#include "comm/progress.hpp"
#include "comm/reduce.hpp"
#include "comm/shm_segment.hpp"
#include "dt/error.hpp"
#include "dt/p2p.hpp"
#include "dt/watchdog.hpp"
#include "sealed_p2p.hpp"

namespace dt::security {

namespace {

constexpr int kCollTag = kReservedTagBase + 1;

// Waits for one transfer of a collective. A real-time thread (a QoS tier's communication thread,
// which runs the queued collectives) polls, sleeping between polls, rather than spinning inside a
// blocking MPI call: that would keep every normal thread of its core from running.
void finish(Work& w) { w.wait(realtime_thread() ? kPolledWait : kNoTimeout); }

std::size_t block_lo(std::size_t n, int b, int size) {
  return n * static_cast<std::size_t>(b) / static_cast<std::size_t>(size);
}

char* at(void* p, std::size_t elems, DType t) {
  return static_cast<char*>(p) + elems * dtype_size(t);
}
const char* at(const void* p, std::size_t elems, DType t) {
  return static_cast<const char*>(p) + elems * dtype_size(t);
}

class SealedComm final : public Comm {
 public:
  static std::unique_ptr<SealedComm> create(const MpiComm& world, const Keys& keys,
                                            const SealedCommOptions& opts, std::string name);
  ~SealedComm() override { queue_.reset(); }  // finishes queued operations first

  int rank() const noexcept override { return mpi_->rank(); }
  int size() const noexcept override { return mpi_->size(); }
  const std::string& name() const noexcept override { return name_; }

  Work iall_reduce(TensorView buf, ReduceOp op) override {
    check_usable("all_reduce");
    return queued(what("all_reduce", buf, reduce_op_name(op)), "all_reduce", buf,
                  [=] { do_all_reduce(buf, op); });
  }
  Work ibroadcast(TensorView buf, int root) override {
    check_usable("broadcast");
    DT_CHECK(InvalidArgument, root >= 0 && root < size(), "broadcast on ", name_, ": root ", root,
             " is not a rank of this communicator (size ", size(), ")");
    return queued(what("broadcast", buf), "broadcast", buf, [=] { do_broadcast(buf, root); });
  }
  Work iall_gather(ConstTensorView in, TensorView out) override {
    check_usable("all_gather");
    DT_CHECK(InvalidArgument, in.dtype == out.dtype, "all_gather on ", name_, ": input ",
             dtype_name(in.dtype), ", output ", dtype_name(out.dtype));
    DT_CHECK_EQ(InvalidArgument, out.numel, in.numel * static_cast<std::size_t>(size()),
                "all_gather on ", name_, ": output must hold size() * input elements");
    return queued(what("all_gather", in), "all_gather", in, [=] { do_all_gather(in, out); });
  }
  Work ireduce_scatter(ConstTensorView in, TensorView out, ReduceOp op) override {
    check_usable("reduce_scatter");
    DT_CHECK(InvalidArgument, in.dtype == out.dtype, "reduce_scatter on ", name_, ": input ",
             dtype_name(in.dtype), ", output ", dtype_name(out.dtype));
    DT_CHECK_EQ(InvalidArgument, in.numel, out.numel * static_cast<std::size_t>(size()),
                "reduce_scatter on ", name_, ": input must hold size() * output elements");
    return queued(what("reduce_scatter", in, reduce_op_name(op)), "reduce_scatter", in,
                  [=] { do_reduce_scatter(in, out, op); });
  }
  Work ibarrier() override {
    check_usable("barrier");
    return queued("barrier on " + name_, "barrier", ConstTensorView{nullptr, 0, DType::u8},
                  [=] { do_barrier(); });
  }
  Work isend(ConstTensorView buf, int dst, int tag) override { return p2p_->isend(buf, dst, tag); }
  Work irecv(TensorView buf, int src, int tag) override { return p2p_->irecv(buf, src, tag); }

  std::unique_ptr<Comm> split(int color, int key) override {
    std::unique_ptr<MpiComm> sub = mpi_->split_mpi(color, key);
    if (!sub) return nullptr;
    return create(*sub, keys_, opts_, sub->name());  // split_name: unique among this one's
  }

 private:
  SealedComm(const Keys& keys, SealedCommOptions opts) : keys_(keys), opts_(std::move(opts)) {}

  std::string what(const char* op, ConstTensorView v, const char* extra = nullptr) const {
    std::string s = std::string(op) + "(" + dtype_name(v.dtype) + " x " + std::to_string(v.numel);
    if (extra) s += std::string(", ") + extra;
    return s + ") on " + name_;
  }
  void check_usable(const char* op) const {
    DT_CHECK(CommError, !broken_.load(), op, " on ", name_, " (rank ", rank(),
             "): the communicator is broken by an earlier failure");
  }
  // Queues collective `op` on `v` (the view MpiComm records it by) to run on the queue's thread.
  // Its watchdog record starts here, on the caller's thread (in the caller's LimitScope and
  // BackgroundScope, numbered in the order every rank submits), and ends when it has run; the
  // record counts it in the dt_comm_* metrics and the timeline.
  template <class F>
  Work queued(std::string w, const char* op, ConstTensorView v, F&& f) {
    auto rec =
        std::make_shared<watchdog::OpRecord>(name_, ++calls_, op, "sealed", v.dtype, v.numel);
    return queue_->submit(std::move(w), [this, rec, f] {
      try {
        f();
      } catch (...) {
        broken_ = true;
        rec->complete();
        throw;
      }
      rec->complete();
    });
  }

  // Elements per message segment for dtype t.
  std::size_t seg_elems(DType t) const {
    return std::max<std::size_t>(1, opts_.segment_bytes / dtype_size(t));
  }
  // Posts receives of [lo, lo + n) elements of `dst` (segmented) from `src`.
  void post_recvs(std::vector<Work>& ws, void* dst, std::size_t n, DType t, int src,
                  int tag = kCollTag) {
    const std::size_t seg = seg_elems(t);
    for (std::size_t off = 0; off < n; off += seg)
      ws.push_back(
          p2p_->irecv_internal(TensorView{at(dst, off, t), std::min(seg, n - off), t}, src, tag));
  }
  // Receives in the order they will be needed; poke() advances the transport and opens the next
  // one if it arrived, so that opening alternates with sealing the outgoing segments (a run of
  // openings would keep the peers waiting for this rank's segments).
  struct Progress {
    std::vector<Work*> works;
    std::size_t next = 0;
    void add(std::vector<Work>& ws) {
      for (Work& w : ws) works.push_back(&w);
    }
    void poke() {
      if (next < works.size() && works[next]->test()) ++next;
    }
    void wait() {
      for (; next < works.size(); ++next) finish(*works[next]);
    }
  };
  void post_sends(std::vector<Work>& ws, const void* src, std::size_t n, DType t, int dst,
                  Progress* progress = nullptr) {
    const std::size_t seg = seg_elems(t);
    for (std::size_t off = 0; off < n; off += seg) {
      ws.push_back(p2p_->isend_internal(ConstTensorView{at(src, off, t), std::min(seg, n - off), t},
                                        dst, kCollTag));
      if (progress) progress->poke();
    }
  }
  static void wait_all(std::vector<Work>& ws) {
    for (Work& w : ws) finish(w);
  }
  // When a collective fails (an exception leaves the scope of this guard), the receives it still
  // has posted are withdrawn (Work::cancel, within a second in all), so that nothing writes into
  // the scratch or the caller's buffers after it failed, and so are its sends still reading the
  // caller's buffer (through a mailbox; a send through the transport reads it only when posted).
  // Where a receive cannot be withdrawn (a transfer under way), the scratch is given up
  // (dt::abandon) and the caller's buffers must stay valid as for an unfinished collective.
  class Posted {
   public:
    Posted(SealedComm& c, std::vector<std::vector<Work>*> recvs, std::vector<Work>* sends)
        : c_(c), recvs_(std::move(recvs)), sends_(sends), exceptions_(std::uncaught_exceptions()) {}
    Posted(const Posted&) = delete;
    Posted& operator=(const Posted&) = delete;
    ~Posted() {
      if (std::uncaught_exceptions() <= exceptions_) return;
      const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      auto withdrawn = [&end](Work& w) {
        try {
          return w.cancel(millis_until(end));
        } catch (...) {
          return false;
        }
      };
      bool all = true;
      for (std::vector<Work>* l : recvs_)
        for (Work& w : *l) all = withdrawn(w) && all;
      for (Work& w : *sends_) withdrawn(w);
      if (!all) {
        abandon(std::move(c_.scratch_));
        c_.scratch_bytes_ = 0;
      }
    }

   private:
    SealedComm& c_;
    std::vector<std::vector<Work>*> recvs_;
    std::vector<Work>* sends_;
    int exceptions_;
  };

  void do_all_reduce(TensorView buf, ReduceOp op);
  void do_broadcast(TensorView buf, int root);
  void do_all_gather(ConstTensorView in, TensorView out);
  void do_reduce_scatter(ConstTensorView in, TensorView out, ReduceOp op);
  void do_barrier();
  // Reduces `n` elements: every peer q sends `send_of(q)` (n_q elements) to q; this rank's own
  // contribution is `own`; the result goes to `out` (may alias `own`). With `gather_of`
  // (all_reduce), the result is also sent to every peer, and peer q's result is received into
  // (*gather_of)(q) (pointer, elements).
  template <class SendOf, class GatherOf>
  void scatter_reduce(const void* own, std::size_t n, DType t, ReduceOp op, void* out,
                      SendOf&& send_of, GatherOf* gather_of);

  Keys keys_;
  SealedCommOptions opts_;
  std::string name_;
  std::unique_ptr<MpiComm> mpi_;
  std::unique_ptr<SealedP2p> p2p_;
  std::unique_ptr<ProgressQueue> queue_;
  std::atomic<bool> broken_{false};
  std::uint64_t calls_ = 0;  // collectives submitted (the watchdog's sequence numbers)
  std::unique_ptr<std::uint8_t[]> scratch_;  // scatter_reduce's receives from the peers
  std::size_t scratch_bytes_ = 0;
};

std::unique_ptr<SealedComm> SealedComm::create(const MpiComm& world, const Keys& keys,
                                               const SealedCommOptions& opts, std::string name) {
  DT_CHECK(InvalidArgument, opts.segment_bytes > 0, "sealed communicator ", name,
           ": segment_bytes must be positive");
  std::unique_ptr<SealedComm> c(new SealedComm(keys, opts));
  c->name_ = std::move(name);
  c->mpi_ = MpiComm::dup(world.handle(), c->name_);
  const int n = c->mpi_->size(), me = c->mpi_->rank();
  SealOptions so;
  so.channel = "collectives";
  so.tamper = opts.tamper;
  so.shm = opts.shm;
  so.simulated_nodes = opts.simulated_nodes;
  // Which peers share this node is MPI's own knowledge, never node ids gathered over the network
  // (altered, they could make a rank send a remote peer plaintext). Simulated nodes: testing.
  if (opts.exempt_node_local && opts.simulated_nodes > 0) {
    const auto node_of = [&](int r) { return static_cast<long>(r) * opts.simulated_nodes / n; };
    for (int r = 0; r < n; ++r)
      if (node_of(r) == node_of(me) && r != me) so.plain_peers.push_back(r);
  } else if (opts.exempt_node_local) {
    so.plain_peers = c->mpi_->node_peers();
  }
  std::unique_ptr<P2p> inner = make_p2p(opts.p2p, *c->mpi_);
  c->p2p_ = SealedP2p::create(std::move(inner), keys, so);
  c->queue_ = std::make_unique<ProgressQueue>(me, c->name_);
  return c;
}

// Reduce-scatter, and with `gather_of` all_reduce's all-gather, on one tag. Between two ranks the
// messages run in an order both know: every reduce-scatter segment, then every all-gather
// segment, so every receive is posted before the first send, and a segment held back or replayed
// shows up as out of sequence. This rank first seals and sends its reduce-scatter segments, and
// between two of them reduces the next segment of its own block if every peer's has arrived
// (opened in place as it arrives); then it sends the segments reduced so far, and reduces and
// sends the rest as they arrive, each right after its reduction while in cache, opening one
// arrived all-gather segment per peer in between. Nothing waits for a peer before this rank's
// own segments are all on their way.
template <class SendOf, class GatherOf>
void SealedComm::scatter_reduce(const void* own, std::size_t n, DType t, ReduceOp op, void* out,
                                SendOf&& send_of, GatherOf* gather_of) {
  const int s = size(), me = rank();
  const std::size_t bytes = n * dtype_size(t);
  const std::size_t need = bytes * static_cast<std::size_t>(s - 1);
  if (scratch_bytes_ < need) {
    scratch_.reset();  // the smaller one goes before the larger one is taken
    scratch_bytes_ = 0;
    scratch_.reset(new std::uint8_t[need]);
    scratch_bytes_ = need;
  }
  auto slot = [&](int q) {  // scratch of peer q
    return scratch_.get() + bytes * static_cast<std::size_t>(q < me ? q : q - 1);
  };
  const std::size_t seg = seg_elems(t);
  // recvs[q] = the reduce-scatter segments from peer q, in order; then its all-gather segments.
  std::vector<std::vector<Work>> recvs(static_cast<std::size_t>(s));
  std::vector<Work> gathers, sends;
  std::vector<std::vector<Work>*> posted{&gathers};
  for (std::vector<Work>& r : recvs) posted.push_back(&r);
  const Posted guard(*this, std::move(posted), &sends);
  for (int k = 1; k < s; ++k) {
    const int q = (me - k + s) % s;
    post_recvs(recvs[static_cast<std::size_t>(q)], slot(q), n, t, q);
    if (gather_of) {
      const auto [p, nq] = (*gather_of)(q);
      post_recvs(gathers, p, nq, t, q);
    }
  }
  Progress gathered;
  gathered.add(gathers);
  // The outgoing segments, segment by segment over the peers (each peer gets its first early).
  struct Out {
    const void* p;
    std::size_t cnt;
    int q;
  };
  std::vector<Out> outs;
  {
    std::vector<std::pair<const void*, std::size_t>> blocks(static_cast<std::size_t>(s));
    std::size_t most = 0;
    for (int k = 1; k < s; ++k) {
      const int q = (me + k) % s;
      blocks[static_cast<std::size_t>(q)] = send_of(q);
      most = std::max(most, blocks[static_cast<std::size_t>(q)].second);
    }
    for (std::size_t off = 0; off < most; off += seg)
      for (int k = 1; k < s; ++k) {
        const int q = (me + k) % s;
        const auto [p, nq] = blocks[static_cast<std::size_t>(q)];
        if (off < nq) outs.push_back({at(p, off, t), std::min(seg, nq - off), q});
      }
  }
  std::vector<const void*> in(static_cast<std::size_t>(s));
  const std::size_t nseg = (n + seg - 1) / seg;
  std::size_t reduced = 0, gathered_out = 0;
  auto arrived = [&](bool block) {
    for (int q = 0; q < s; ++q) {
      if (q == me) continue;
      Work& w = recvs[static_cast<std::size_t>(q)][reduced];
      if (block)
        finish(w);
      else if (!w.test())
        return false;
    }
    return true;
  };
  auto reduce_next = [&] {
    const std::size_t off = reduced * seg, cnt = std::min(seg, n - off);
    for (int q = 0; q < s; ++q)
      in[static_cast<std::size_t>(q)] = q == me ? at(own, off, t) : at(slot(q), off, t);
    reduce_elements(t, op, at(out, off, t), in.data(), s, cnt, op == ReduceOp::avg ? s : 1);
    ++reduced;
  };
  auto send_reduced = [&] {  // all-gather: the reduced segments not sent yet, to every peer
    for (; gather_of && gathered_out < reduced; ++gathered_out) {
      const std::size_t off = gathered_out * seg;
      for (int k = 1; k < s; ++k)
        sends.push_back(p2p_->isend_internal(
            ConstTensorView{at(out, off, t), std::min(seg, n - off), t}, (me + k) % s, kCollTag));
      for (int k = 1; k < s; ++k) gathered.poke();
    }
  };
  for (const Out& o : outs) {
    sends.push_back(p2p_->isend_internal(ConstTensorView{o.p, o.cnt, t}, o.q, kCollTag));
    if (reduced < nseg && arrived(false)) reduce_next();
  }
  send_reduced();
  while (reduced < nseg) {
    arrived(true);
    reduce_next();
    send_reduced();
  }
  gathered.wait();
  wait_all(sends);
}

void SealedComm::do_all_reduce(TensorView buf, ReduceOp op) {
  const int s = size(), me = rank();
  const std::size_t n = buf.numel;
  if (s == 1) {
    if (op == ReduceOp::avg) {
      const void* in[1] = {buf.data};
      reduce_elements(buf.dtype, op, buf.data, in, 1, n, 1);
    }
    return;
  }
  const std::size_t lo = block_lo(n, me, s), hi = block_lo(n, me + 1, s);
  char* mine = at(buf.data, lo, buf.dtype);
  auto block = [&](int q) {
    const std::size_t a = block_lo(n, q, s), b = block_lo(n, q + 1, s);
    return std::pair<void*, std::size_t>(at(buf.data, a, buf.dtype), b - a);
  };
  auto send_of = [&](int q) {
    const auto [p, c] = block(q);
    return std::pair<const void*, std::size_t>(p, c);
  };
  scatter_reduce(mine, hi - lo, buf.dtype, op, mine, send_of, &block);
}

void SealedComm::do_reduce_scatter(ConstTensorView in, TensorView out, ReduceOp op) {
  const int s = size(), me = rank();
  const std::size_t n = out.numel;
  const void* own = at(in.data, static_cast<std::size_t>(me) * n, in.dtype);
  if (s == 1) {
    const void* ins[1] = {own};
    reduce_elements(in.dtype, op, out.data, ins, 1, n, 1);
    return;
  }
  auto send_of = [&](int q) {
    return std::pair<const void*, std::size_t>(
        at(in.data, static_cast<std::size_t>(q) * n, in.dtype), n);
  };
  using NoGather = std::pair<void*, std::size_t> (*)(int);
  scatter_reduce(own, n, in.dtype, op, out.data, send_of, static_cast<NoGather*>(nullptr));
}

void SealedComm::do_all_gather(ConstTensorView in, TensorView out) {
  const int s = size(), me = rank();
  const std::size_t n = in.numel;
  char* mine = at(out.data, static_cast<std::size_t>(me) * n, in.dtype);
  if (mine != in.data && n > 0) std::memmove(mine, in.data, in.nbytes());
  std::vector<Work> rs, ws;
  const Posted guard(*this, {&rs}, &ws);
  for (int k = 1; k < s; ++k) {
    const int q = (me - k + s) % s;
    post_recvs(rs, at(out.data, static_cast<std::size_t>(q) * n, in.dtype), n, in.dtype, q);
  }
  Progress progress;
  progress.add(rs);
  for (int k = 1; k < s; ++k) post_sends(ws, mine, n, in.dtype, (me + k) % s, &progress);
  wait_all(rs);
  wait_all(ws);
}

void SealedComm::do_broadcast(TensorView buf, int root) {
  const int s = size(), me = rank();
  if (s == 1) return;
  const int pos = (me - root + s) % s;
  const int prev = (me - 1 + s) % s, next = (me + 1) % s;
  std::vector<Work> recvs, sends;
  const Posted guard(*this, {&recvs}, &sends);
  if (pos > 0) post_recvs(recvs, buf.data, buf.numel, buf.dtype, prev);
  const std::size_t seg = seg_elems(buf.dtype);
  std::size_t k = 0;
  for (std::size_t off = 0; off < buf.numel; off += seg, ++k) {
    if (pos > 0) finish(recvs[k]);  // opened in place
    if (pos < s - 1)
      sends.push_back(p2p_->isend_internal(
          ConstTensorView{at(buf.data, off, buf.dtype), std::min(seg, buf.numel - off), buf.dtype},
          next, kCollTag));
  }
  wait_all(sends);
}

void SealedComm::do_barrier() {
  const int s = size(), me = rank();
  std::uint8_t dummy = 0;
  for (int k = 1; k < s; k *= 2) {
    Work r = p2p_->irecv_internal(TensorView{&dummy, 0, DType::u8}, (me - k + s) % s, kCollTag);
    Work w = p2p_->isend_internal(ConstTensorView{&dummy, 0, DType::u8}, (me + k) % s, kCollTag);
    finish(r);
    finish(w);
  }
}

}  // namespace

std::unique_ptr<Comm> make_sealed_comm(Comm& world, const Keys& keys,
                                       const SealedCommOptions& opts) {
  auto* mpi = dynamic_cast<MpiComm*>(&world);
  DT_CHECK(InvalidArgument, mpi != nullptr, "make_sealed_comm: communicator ", world.name(),
           " is not an MPI communicator");
  DT_CHECK(ConfigError, opts.p2p == "mpi" || opts.p2p == "ucx", "comm.p2p: '", opts.p2p,
           "' is not one of ", kP2pKinds);
  return SealedComm::create(*mpi, keys, opts, world.name() + "/sealed");
}

void abort_job(const std::exception& e) {
  int rank = -1, init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "dt: rank %d: security: %s; aborting the job\n", rank, e.what());
  std::fflush(stderr);
  if (init && !fin) MPI_Abort(MPI_COMM_WORLD, 5);
  std::_Exit(5);
}

}  // namespace dt::security
