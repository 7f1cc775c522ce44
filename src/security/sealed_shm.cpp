#include "sealed_shm.hpp"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>

#include "comm/mpi_comm.hpp"
#include "dt/error.hpp"

namespace dt::security {

struct ShmMailboxes::RingCtl {
  alignas(64) std::atomic<std::uint64_t> head{0};  // records published by the sender
  alignas(64) std::atomic<std::uint64_t> tail{0};  // records released by the receiver
};

struct ShmMailboxes::RankCtl {
  alignas(64) std::atomic<std::uint64_t> state{0};  // kOpen, then kClosed
  std::atomic<std::uint64_t> pid{0};
  std::atomic<std::uint64_t> pid_ns{0};  // inode of /proc/self/ns/pid, 0 if unknown
};

struct ShmMailboxes::Op {
  int peer = 0;
  bool send = false;
  bool done = false;
  bool counted = false;  // in open_ops_
  std::exception_ptr error;
  std::uint64_t sequence = 0;
  int tag = 0;
};

struct ShmMailboxes::SendOp : Op {
  int messages = 0;  // in the queue, not yet wholly in the ring
};

struct ShmMailboxes::RecvOp : Op {
  Expect e;
  std::uint8_t* out = nullptr;
  std::uint32_t count = 1, opened = 0;
};

namespace {

constexpr std::uint64_t kOpen = 1, kClosed = 2;
constexpr std::size_t kRankCtlBytes = 4096;
constexpr std::size_t kRingCtlBytes = 128;
constexpr std::size_t kSlotHead = 128;  // the trailer, then the ciphertext at this offset
/// Mailboxes of one node take at most this much shared memory (rings shrink to two slots).
constexpr std::size_t kNodeBudget = std::size_t{1} << 30;
constexpr std::size_t kMaxSlots = 256;
constexpr std::size_t kInSlot = ~std::size_t{0};

std::size_t round_up(std::size_t v, std::size_t a) { return (v + a - 1) / a * a; }

std::uint64_t get_le(const std::uint8_t* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::uint64_t pid_namespace() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<std::uint64_t>(st.st_ino) : 0;
}

class ShmWork final : public WorkImpl {
 public:
  ShmWork(std::shared_ptr<ShmMailboxes> mb, std::shared_ptr<ShmMailboxes::Op> op, std::string what,
          int rank)
      : mb_(std::move(mb)), op_(std::move(op)), what_(std::move(what)), rank_(rank) {}
  bool test() override {
    if (mb_->finished(*op_)) return true;
    using Clock = std::chrono::steady_clock;
    const auto now = Clock::now();
    const bool stuck =
        still_ != Clock::time_point::max() && now - still_ >= std::chrono::milliseconds(1);
    if (mb_->advance(*op_, stuck))
      still_ = Clock::time_point::max();
    else if (still_ == Clock::time_point::max())
      still_ = now;
    return mb_->finished(*op_);
  }
  // Spins, then yields the core, and after a millisecond without progress (the peer is not
  // running: on a shared node it waits for a core) sleeps 50 us at a time, so that the waiting
  // leaves the core to others (the peer among them) instead of spending the job's share.
  bool wait_for(Millis timeout) override {
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    auto checked = start, moved = start;  // moved: when this wait last became idle
    Backoff wait;
    while (!mb_->finished(*op_)) {
      if (mb_->advance(*op_, wait.idle() && Clock::now() - moved >= std::chrono::milliseconds(1))) {
        wait.reset();
        continue;
      }
      if (!wait.idle()) {
        wait();
        if (wait.idle()) moved = Clock::now();  // idle from here
        continue;
      }
      const auto now = Clock::now();
      if (now - moved >= std::chrono::milliseconds(1)) {
        const timespec ts{0, 50000};
        nanosleep(&ts, nullptr);
      } else {
        wait();
      }
      if (now - checked >= std::chrono::milliseconds(100)) {
        mb_->check_peer(*op_);
        checked = now;
      }
      if (timeout != kNoTimeout && now - start >= timeout) return false;
    }
    return true;
  }
  std::string describe() const override { return what_; }
  int rank() const override { return rank_; }
  bool cancel(Millis) override { return mb_->cancel(*op_, what_); }

 private:
  std::shared_ptr<ShmMailboxes> mb_;
  std::shared_ptr<ShmMailboxes::Op> op_;
  std::string what_;
  int rank_;
  // test(): since when calls have moved nothing (max: they have)
  std::chrono::steady_clock::time_point still_ = std::chrono::steady_clock::time_point::max();
};

}  // namespace

// ---- creation -----------------------------------------------------------------------------------

std::shared_ptr<ShmMailboxes> ShmMailboxes::create(
    MPI_Comm comm, const Config& cfg, std::vector<std::shared_ptr<SealedP2p::Peer>> peers,
    std::shared_ptr<BufferPool> pool) {
  std::shared_ptr<ShmMailboxes> m(new ShmMailboxes());
  m->name_ = cfg.name;
  std::unique_ptr<MpiComm> all = MpiComm::dup(comm, cfg.name + "/shm");
  const int n = all->size(), me = all->rank();
  m->rank_ = me;
  std::unique_ptr<MpiComm> local = all->split_shared();
  if (cfg.simulated_nodes > 0) {
    const int k = std::min(cfg.simulated_nodes, n);
    local = local->split_mpi(static_cast<int>(static_cast<long>(me) * k / n), me);
  }
  const int L = local->size();
  // Every rank of the node learns the others' ranks and whether they all want mailboxes, and
  // agrees on one layout: the largest record size, the smallest mailbox size.
  std::vector<std::int64_t> ranks(static_cast<std::size_t>(L));
  const std::int64_t mine = me;
  local->all_gather(view_of(&mine, 1), view_of(ranks));
  bool sealed_local = false;  // some peer of this node is sealed
  for (std::int64_t r : ranks)
    if (r != me && !(r < static_cast<std::int64_t>(cfg.plain.size()) &&
                     cfg.plain[static_cast<std::size_t>(r)]))
      sealed_local = true;
  const bool fits = cfg.record_bytes > 0 && cfg.record_bytes <= kMaxShmRecordBytes;
  std::int64_t agreed[4] = {cfg.enabled && fits ? 1 : 0,
                            -static_cast<std::int64_t>(cfg.record_bytes),
                            static_cast<std::int64_t>(cfg.ring_bytes), sealed_local ? -1 : 0};
  local->all_reduce(view_of(agreed, 4), ReduceOp::min);
  if (L < 2 || agreed[0] == 0 || agreed[3] == 0) return nullptr;
  m->record_bytes_ = static_cast<std::size_t>(-agreed[1]);
  m->slot_bytes_ = round_up(kSlotHead + m->record_bytes_, 64);
  const std::size_t pairs = static_cast<std::size_t>(L) * static_cast<std::size_t>(L - 1);
  std::size_t slots =
      std::max<std::size_t>(2, static_cast<std::size_t>(agreed[2]) / m->slot_bytes_);
  slots = std::min(
      {slots, kMaxSlots, std::max<std::size_t>(2, kNodeBudget / (pairs * m->slot_bytes_))});
  m->slots_ = slots;
  m->ring_total_ = kRingCtlBytes + slots * m->slot_bytes_;
  m->region_bytes_ = kRankCtlBytes + static_cast<std::size_t>(L - 1) * m->ring_total_;
  std::string err;
  m->seg_ =
      ShmSegment::create(*local, m->region_bytes_ * static_cast<std::size_t>(L), "dt-seal", &err);
  int ok = m->seg_ ? 1 : 0;
  local->all_reduce(view_of(&ok, 1), ReduceOp::min);
  if (!ok) return nullptr;  // the transport serves the node

  m->me_local_ = local->rank();
  m->local_of_.assign(static_cast<std::size_t>(n), -1);
  for (int q = 0; q < L; ++q)
    m->local_of_[static_cast<std::size_t>(ranks[static_cast<std::size_t>(q)])] = q;
  m->peers_ = std::move(peers);
  m->pool_ = std::move(pool);
  m->out_.resize(static_cast<std::size_t>(n));
  m->in_.resize(static_cast<std::size_t>(n));
  // Each rank places the control blocks of its own region (its end, its inbound mailboxes).
  new (m->seg_.data() + m->region_bytes_ * static_cast<std::size_t>(m->me_local_)) RankCtl();
  for (int q = 0; q < L; ++q)
    if (q != m->me_local_) new (m->ring_at(q, m->me_local_)) RingCtl();
  local->barrier();
  for (int q = 0; q < L; ++q) {
    if (q == m->me_local_) continue;
    const int peer = static_cast<int>(ranks[static_cast<std::size_t>(q)]);
    if (peer < static_cast<int>(cfg.plain.size()) && cfg.plain[static_cast<std::size_t>(peer)])
      continue;
    m->served_.push_back(peer);
    char* out = m->ring_at(m->me_local_, q);
    char* in = m->ring_at(q, m->me_local_);
    m->out_[static_cast<std::size_t>(peer)].ctl = std::launder(reinterpret_cast<RingCtl*>(out));
    m->out_[static_cast<std::size_t>(peer)].slots = out + kRingCtlBytes;
    m->in_[static_cast<std::size_t>(peer)].ctl = std::launder(reinterpret_cast<RingCtl*>(in));
    m->in_[static_cast<std::size_t>(peer)].slots = in + kRingCtlBytes;
  }
  std::sort(m->served_.begin(), m->served_.end());
  RankCtl& self = m->rank_ctl(m->me_local_);
  self.pid.store(static_cast<std::uint64_t>(getpid()), std::memory_order_relaxed);
  self.pid_ns.store(pid_namespace(), std::memory_order_relaxed);
  self.state.store(kOpen, std::memory_order_release);
  local->barrier();  // every rank's end is open before any record moves
  if (m->served_.empty()) return nullptr;
  return m;
}

ShmMailboxes::~ShmMailboxes() { close(); }

void ShmMailboxes::close() noexcept {
  {
    std::lock_guard<std::mutex> lk(helper_mu_);
    stop_ = true;
  }
  helper_cv_.notify_all();
  if (helper_.joinable() && helper_.get_id() != std::this_thread::get_id()) helper_.join();
  if (seg_) rank_ctl(me_local_).state.store(kClosed, std::memory_order_release);
}

bool ShmMailboxes::serves(int peer) const noexcept {
  return peer >= 0 && peer < static_cast<int>(out_.size()) &&
         out_[static_cast<std::size_t>(peer)].ctl != nullptr;
}

ShmMailboxes::RankCtl& ShmMailboxes::rank_ctl(int local) const noexcept {
  return *std::launder(
      reinterpret_cast<RankCtl*>(seg_.data() + region_bytes_ * static_cast<std::size_t>(local)));
}

// The mailbox from local rank `from` to local rank `to`, in `to`'s region.
char* ShmMailboxes::ring_at(int from, int to) const noexcept {
  const int idx = from < to ? from : from - 1;
  return seg_.data() + region_bytes_ * static_cast<std::size_t>(to) + kRankCtlBytes +
         ring_total_ * static_cast<std::size_t>(idx);
}

// ---- operations ---------------------------------------------------------------------------------

void ShmMailboxes::started(Op& op) {
  if (!op.send) return;  // the helper thread serves sends only
  op.counted = true;
  if (open_ops_++ == 0) {
    open_ops_seen_.store(open_ops_, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lk(helper_mu_);
      if (!helper_.joinable() && !stop_) helper_ = std::thread([this] { helper(); });
    }
    helper_cv_.notify_one();
  } else {
    open_ops_seen_.store(open_ops_, std::memory_order_release);
  }
}

void ShmMailboxes::finish(Op& op) {
  op.done = true;
  if (op.counted) {
    op.counted = false;
    open_ops_seen_.store(--open_ops_, std::memory_order_release);
  }
}

Work ShmMailboxes::send(std::string what, int dst, const void* src, const Header& first) {
  auto op = std::make_shared<SendOp>();
  op->peer = dst;
  op->send = true;
  op->sequence = first.sequence;
  op->tag = first.tag;
  op->messages = 1;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failed_) {
      op->error = failed_;
      op->done = true;
      return Work(std::make_unique<ShmWork>(shared_from_this(), op, std::move(what), rank_));
    }
    Outbound& o = out_[static_cast<std::size_t>(dst)];
    OutMsg m;
    m.op = op;
    m.src = static_cast<const std::uint8_t*>(src);
    m.h = first;
    m.count = first.records;
    o.queue.push_back(std::move(m));
    while (step_out(dst)) {
    }
    if (!op->done) started(*op);
  }
  return Work(std::make_unique<ShmWork>(shared_from_this(), op, std::move(what), rank_));
}

Work ShmMailboxes::send_raw(std::string what, int dst, std::vector<BufferPool::Handle> records) {
  auto op = std::make_shared<SendOp>();
  op->peer = dst;
  op->send = true;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failed_) {
      op->error = failed_;
      op->done = true;
    } else if (records.empty()) {
      op->done = true;
    } else {
      Outbound& o = out_[static_cast<std::size_t>(dst)];
      OutMsg m;
      m.op = op;
      m.count = static_cast<std::uint32_t>(records.size());
      m.raw = std::move(records);
      op->messages = 1;
      o.queue.push_back(std::move(m));
      while (step_out(dst)) {
      }
      if (!op->done) started(*op);
    }
  }
  return Work(std::make_unique<ShmWork>(shared_from_this(), op, std::move(what), rank_));
}

Work ShmMailboxes::recv(std::string what, int src, void* out, const Expect& e) {
  auto op = std::make_shared<RecvOp>();
  op->peer = src;
  op->e = e;
  op->sequence = e.sequence;
  op->tag = e.tag;
  op->out = static_cast<std::uint8_t*>(out);
  op->count = e.records;
  {
    std::lock_guard<std::mutex> lk(mu_);
    Inbound& in = in_[static_cast<std::size_t>(src)];
    if (failed_) {
      op->error = failed_;
      op->done = true;
    } else {
      // The oldest message of this tag kept aside, if any (then no receive of the tag is posted).
      auto it = std::find_if(in.msgs.begin(), in.msgs.end(),
                             [&](const InMsg& m) { return !m.recv && m.tag == e.tag; });
      if (it == in.msgs.end()) {
        in.posted[e.tag].push_back(op);
        started(*op);
      } else {
        it->recv = op;
        started(*op);
        try {
          for (Stashed& s : it->raw) {
            open_one(*op, s.buf->data(), s.len, s.buf->data() + s.len);
            s.buf = BufferPool::Handle();
          }
          it->raw.clear();
          if (&*it != in.cur) {  // every record of the message arrived
            if (!op->done) count_failure(Reject::malformed);
            if (!op->done)
              DT_THROW(SecurityError, "rejected message ", e.sequence, " ", route_of(e), " (tag ",
                       e.tag, ") on ", e.channel, ": ", it->total, " records arrived where ",
                       e.records, " were expected (truncated or altered)");
            in.msgs.erase(it);
          }
        } catch (const SecurityError&) {
          fail_all(std::current_exception());
        }
      }
      while (step_in(src, false)) {
      }
    }
  }
  return Work(std::make_unique<ShmWork>(shared_from_this(), op, std::move(what), rank_));
}

// Opens the next record of `r` from `ct` (ct_bytes of ciphertext; kInSlot: a mailbox slot, which
// holds the record's expected length) and `trailer` into its buffer. Throws dt::SecurityError
// (counted) when it is rejected.
void ShmMailboxes::open_one(RecvOp& r, const std::uint8_t* ct, std::size_t ct_bytes,
                            const std::uint8_t* trailer) {
  const std::uint32_t i = r.opened;
  Expect& e = r.e;
  const std::size_t rb = record_bytes_;
  if (i >= r.count) {
    count_failure(Reject::malformed);
    DT_THROW(SecurityError, "rejected message ", e.sequence, " ", route_of(e), " (tag ", e.tag,
             ") on ", e.channel, ": more than the ", r.count, " records expected (altered)");
  }
  e.record = i;
  const std::size_t off = static_cast<std::size_t>(i) * rb;
  e.length = std::min<std::size_t>(rb, static_cast<std::size_t>(e.message_length) - off);
  Reject why = Reject::malformed;
  try {
    open_record(*peers_[static_cast<std::size_t>(r.peer)]->dec, ct,
                ct_bytes == kInSlot ? e.length : ct_bytes, trailer, kTrailerBytes, e, r.out + off,
                &why);
  } catch (const SecurityError&) {
    count_failure(why);
    throw;
  }
  if (++r.opened == r.count) finish(r);
}

// A rejected record, or a peer that is gone: the channel's mailboxes are finished. Every pending
// operation fails with `e` (so is every later one), a failed receive's buffer keeps nothing of
// the records it opened, and nothing more is read from or written to any caller's buffer.
void ShmMailboxes::fail_all(std::exception_ptr e) {
  if (!failed_) failed_ = e;
  auto fail = [&](Op* op) {
    if (op && !op->done) {
      if (!op->send) {
        auto& r = static_cast<RecvOp&>(*op);
        const std::size_t opened = std::min<std::size_t>(
            static_cast<std::size_t>(r.opened) * record_bytes_, r.e.message_length);
        if (opened > 0) std::memset(r.out, 0, opened);
      }
      op->error = failed_;
      finish(*op);
    }
  };
  for (int p : served_) {
    Inbound& in = in_[static_cast<std::size_t>(p)];
    for (InMsg& m : in.msgs) fail(m.recv.get());
    for (auto& [tag, rs] : in.posted)
      for (auto& r : rs) fail(r.get());
    in.posted.clear();
    in.msgs.clear();
    in.cur = nullptr;
    Outbound& o = out_[static_cast<std::size_t>(p)];
    for (OutMsg& m : o.queue) fail(m.op.get());
    o.queue.clear();
  }
}

// Puts the next record of `peer`'s send queue into its mailbox if there is room.
bool ShmMailboxes::step_out(int peer) {
  Outbound& o = out_[static_cast<std::size_t>(peer)];
  if (o.queue.empty() || failed_) return false;
  if (o.head - o.tail_seen >= slots_) {
    o.tail_seen = o.ctl->tail.load(std::memory_order_acquire);
    if (o.head - o.tail_seen >= slots_) return false;
  }
  OutMsg& m = o.queue.front();
  std::uint8_t* s = reinterpret_cast<std::uint8_t*>(slot(o.slots, o.head));
  if (m.raw.empty()) {
    Header h = m.h;
    h.record = m.next;
    const std::size_t off = static_cast<std::size_t>(m.next) * record_bytes_;
    h.length =
        std::min<std::size_t>(record_bytes_, static_cast<std::size_t>(h.message_length) - off);
    h.counter = m.h.counter + m.next;
    try {
      seal_record(*peers_[static_cast<std::size_t>(peer)]->enc, h, m.src + off, s + kSlotHead, s);
    } catch (...) {
      m.op->error = std::current_exception();
      finish(*m.op);
      o.queue.pop_front();
      return true;
    }
  } else {
    const BufferPool::Handle& b = m.raw[m.next];
    const std::size_t len = b->size - kTrailerBytes;
    std::memcpy(s, b->data() + len, kTrailerBytes);
    if (len > 0) std::memcpy(s + kSlotHead, b->data(), std::min(len, record_bytes_));
  }
  o.ctl->head.store(++o.head, std::memory_order_release);
  if (++m.next == m.count) {
    if (--m.op->messages == 0) finish(*m.op);
    o.queue.pop_front();
  }
  return true;
}

// Takes the next record from `peer`'s mailbox if one has arrived: opens it into its receive, or
// keeps it aside for a receive not yet posted. A message without a posted receive is kept aside
// only when a receive from that peer waits behind it, or with `stuck` (a wait that has not moved
// for a while: the peer may be blocked on a full mailbox the other way); otherwise it stays in the
// mailbox, as its receive is usually about to be posted.
bool ShmMailboxes::step_in(int peer, bool stuck) {
  Inbound& in = in_[static_cast<std::size_t>(peer)];
  if (failed_) return false;
  if (in.ctl->head.load(std::memory_order_acquire) == in.tail) return false;
  const std::uint8_t* s = reinterpret_cast<const std::uint8_t*>(slot(in.slots, in.tail));
  std::uint8_t trailer[kTrailerBytes];  // read once: what is checked is what is authenticated
  std::memcpy(trailer, s, kTrailerBytes);
  if (!in.cur) {
    InMsg m;
    m.tag = static_cast<std::int32_t>(static_cast<std::uint32_t>(get_le(trailer + 12, 4)));
    auto it = in.posted.find(m.tag);
    if (it == in.posted.end() && in.posted.empty() && !stuck) return false;
    if (it != in.posted.end()) {
      m.recv = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) in.posted.erase(it);
      m.total = m.recv->count;
    } else {
      m.total = std::max<std::uint32_t>(1, static_cast<std::uint32_t>(get_le(trailer + 44, 4)));
    }
    in.msgs.push_back(std::move(m));
    in.cur = &in.msgs.back();
  }
  InMsg& m = *in.cur;
  if (m.recv) {
    try {
      open_one(*m.recv, s + kSlotHead, kInSlot, trailer);
    } catch (const SecurityError&) {
      fail_all(std::current_exception());
      return true;
    }
  } else {
    const std::size_t len = std::min<std::size_t>(get_le(trailer + 48, 8), record_bytes_);
    Stashed st;
    st.buf = pool_->get(len + kTrailerBytes);
    st.len = len;
    if (len > 0) std::memcpy(st.buf->data(), s + kSlotHead, len);
    std::memcpy(st.buf->data() + len, trailer, kTrailerBytes);
    m.raw.push_back(std::move(st));
  }
  in.ctl->tail.store(++in.tail, std::memory_order_release);
  if (++m.taken == m.total) {
    in.cur = nullptr;
    if (m.recv) in.msgs.pop_back();
  }
  return true;
}

bool ShmMailboxes::round(bool sends_only, bool stuck) {
  bool moved = false;
  for (int p : served_) {
    moved |= step_out(p);
    if (!sends_only) moved |= step_in(p, stuck);
  }
  return moved;
}

bool ShmMailboxes::advance(Op& op, bool stuck) {
  caller_advanced_ns_.store(now_ns(), std::memory_order_relaxed);
  bool moved = false;
  std::lock_guard<std::mutex> lk(mu_);
  while (!op.done && round(false, stuck)) moved = true;
  return moved;
}

bool ShmMailboxes::finished(Op& op) {
  std::lock_guard<std::mutex> lk(mu_);
  if (op.error) std::rethrow_exception(op.error);
  return op.done;
}

bool ShmMailboxes::cancel(Op& op, const std::string& what) {
  std::lock_guard<std::mutex> lk(mu_);
  if (op.done) return true;
  fail_all(std::make_exception_ptr(
      CommError(what + ": cancelled; the mailboxes of " + name_ + " take no more messages",
                __FILE__, __LINE__)));
  return true;
}

void ShmMailboxes::check_peer(Op& op) {
  std::lock_guard<std::mutex> lk(mu_);
  if (op.done) return;
  const int q = local_of_[static_cast<std::size_t>(op.peer)];
  RankCtl& rc = rank_ctl(q);
  std::string why;
  if (rc.state.load(std::memory_order_acquire) == kClosed) {
    // A receive may still find its records in the mailbox: only an empty one is final.
    const Inbound& in = in_[static_cast<std::size_t>(op.peer)];
    if (op.send || in.ctl->head.load(std::memory_order_acquire) == in.tail)
      why = "rank " + std::to_string(op.peer) + " closed its end of the channel";
  } else {
    const std::uint64_t pid = rc.pid.load(std::memory_order_relaxed);
    const std::uint64_t ns = rc.pid_ns.load(std::memory_order_relaxed);
    static const std::uint64_t my_ns = pid_namespace();
    if (pid != 0 && ns != 0 && ns == my_ns && kill(static_cast<pid_t>(pid), 0) != 0 &&
        errno == ESRCH)
      why = "rank " + std::to_string(op.peer) + " (process " + std::to_string(pid) + ") is gone";
  }
  if (why.empty()) return;
  try {
    DT_THROW(CommError, "sealed ", op.send ? "send of message " : "receive of message ",
             op.sequence, op.send ? " to rank " : " from rank ", op.peer, " (tag ", op.tag, ") on ",
             name_, " (rank ", rank_, ", shared memory): ", why,
             op.send ? " before reading it" : " before sending it");
  } catch (const CommError&) {
    fail_all(std::current_exception());
  }
}

// Seals pending sends into the mailboxes while no caller has advanced them for a millisecond (the
// sender computes, or waits on another communicator), so that a send completes without its
// sender's help, as MPI's do. Receives advance in their callers' test() and wait() only (as with
// MPI, buffers are written only while the caller is inside the channel's calls).
void ShmMailboxes::helper() {
  constexpr std::int64_t kQuiet = 1000000;  // ns
  std::unique_lock<std::mutex> lk(helper_mu_);
  long sleep_us = 20;
  while (!stop_) {
    if (open_ops_seen_.load(std::memory_order_acquire) == 0) {
      helper_cv_.wait(lk, [&] { return stop_ || open_ops_seen_.load() > 0; });
      continue;
    }
    lk.unlock();
    const std::int64_t quiet = now_ns() - caller_advanced_ns_.load(std::memory_order_relaxed);
    bool moved = false;
    if (quiet >= kQuiet) {  // one round at a time: a caller may want the lock
      std::lock_guard<std::mutex> g(mu_);
      moved = round(true, false);
    }
    if (moved) {
      sleep_us = 20;
    } else {
      const long us = quiet < kQuiet ? (kQuiet - quiet) / 1000 + 1 : sleep_us;
      sleep_us = std::min<long>(sleep_us * 2, 1000);
      lk.lock();
      helper_cv_.wait_for(lk, std::chrono::microseconds(us), [&] { return stop_; });
      continue;
    }
    lk.lock();
  }
}

}  // namespace dt::security
