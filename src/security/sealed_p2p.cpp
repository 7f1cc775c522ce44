#include "sealed_p2p.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <exception>
#include <iterator>
#include <thread>

#include "comm/abandon.hpp"
#include "comm/mpi_comm.hpp"
#include "comm/ucx_p2p.hpp"
#include "dt/error.hpp"
#include "dt/metrics.hpp"
#include "sealed_shm.hpp"

namespace dt::security {

// ---- buffers ------------------------------------------------------------------------------------

namespace {
constexpr std::size_t kPoolMaxBytes = std::size_t{256} << 20;
constexpr std::size_t kPoolMaxBuffers = 1024;
}  // namespace

BufferPool::Handle& BufferPool::Handle::operator=(Handle&& o) noexcept {
  if (this != &o) {
    if (pool_ && b_) pool_->put(std::move(b_));
    pool_ = std::move(o.pool_);
    b_ = std::move(o.b_);
  }
  return *this;
}

BufferPool::Handle::~Handle() {
  if (pool_ && b_) pool_->put(std::move(b_));
}

void BufferPool::Handle::leak() noexcept {
  abandon(std::move(b_));
  pool_.reset();
}

void abandon(std::unique_ptr<BufferPool::Buf> b) noexcept {
  if (b) dt::abandon(std::move(b->p));
}

BufferPool::Handle BufferPool::get(std::size_t bytes) {
  std::unique_ptr<Buf> b;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = free_.lower_bound(bytes);  // the smallest capacity that fits
    if (it != free_.end()) {
      it = std::prev(free_.upper_bound(it->first));  // of those, the last returned
      b = std::move(it->second);
      free_.erase(it);
      free_bytes_ -= b->cap;
    }
  }
  if (!b) {
    b = std::make_unique<Buf>();
    b->cap = std::max<std::size_t>(bytes, 64);
    b->p.reset(new std::uint8_t[b->cap]);
  }
  b->size = bytes;
  return Handle(shared_from_this(), std::move(b));
}

void BufferPool::put(std::unique_ptr<Buf> b) noexcept {
  std::lock_guard<std::mutex> lk(mu_);
  if (free_.size() >= kPoolMaxBuffers || free_bytes_ + b->cap > kPoolMaxBytes) return;
  const std::size_t cap = b->cap;
  try {
    free_.emplace(cap, std::move(b));  // after the equal keys already there
    free_bytes_ += cap;
  } catch (...) {  // no room to keep it: freed instead
  }
}

// ---- metrics ------------------------------------------------------------------------------------

namespace {
metrics::Counter& failure_counter(Reject r) {
  return metrics::default_registry().counter(
      "dt_security_auth_failures_total",
      "Sealed messages rejected (bad tag, replay, reorder, redirect, malformed)",
      {{"reason", reject_name(r)}});
}
}  // namespace

void count_failure(Reject r) noexcept {
  try {
    failure_counter(r).inc();
  } catch (...) {
  }
}

void register_failure_counters() noexcept {
  try {
    for (Reject r :
         {Reject::malformed, Reject::authentication, Reject::sequence, Reject::redirected})
      failure_counter(r);
  } catch (...) {
  }
}

// ---- state --------------------------------------------------------------------------------------

struct SealedP2p::TamperState {
  std::mutex mu;
  Tamper plan;
  std::uint64_t sent = 0;  // sealed messages sent so far
  // replay: the copy of message `at`, waiting for the next message to the same (peer, tag)
  // reorder: message `at`, held back until then
  bool armed = false;
  int peer = -1, tag = 0;
  std::vector<BufferPool::Handle> saved;  // its records (ciphertext, trailer)
};

namespace {

std::string rank_list_name(const std::string& inner) { return inner + "/sealed"; }

// A sealed send: the inner sends of every record (ciphertext and trailer) and the pooled buffers
// they read. A record's buffer goes back to the pool as soon as its sends complete.
class SendWork final : public WorkImpl {
 public:
  SendWork(std::string what, int rank) : what_(std::move(what)), rank_(rank) {}
  /// The transport may still read an unfinished send's buffers: they are then given up.
  ~SendWork() override {
    for (Part& p : parts_)
      if (!p.done && p.buf) p.buf.leak();
  }
  /// Posts one record: its ciphertext (omitted when empty), then its trailer, from `buf`
  /// (ciphertext of `len` bytes followed by the trailer).
  void post(P2p& inner, BufferPool::Handle buf, std::size_t len, int dst, int tag) {
    Part p;
    if (len > 0) p.body = inner.isend(ConstTensorView{buf->data(), len, DType::u8}, dst, tag);
    p.trailer = inner.isend(ConstTensorView{buf->data() + len, kTrailerBytes, DType::u8}, dst, tag);
    p.has_body = len > 0;
    p.buf = std::move(buf);
    parts_.push_back(std::move(p));
  }
  /// Completes the records whose sends are done, in order, returning their buffers; true when
  /// every record is done. Drives the transport's progress.
  bool reap() {
    try {
      while (first_ < parts_.size()) {
        Part& p = parts_[first_];
        if (p.has_body && !p.body_done) p.body_done = p.body.test();
        if (!p.body_done && p.has_body) return false;
        if (!p.trailer.test()) return false;
        p.done = true;
        p.buf = BufferPool::Handle();
        ++first_;
      }
    } catch (...) {
      failed();
      throw;
    }
    return true;
  }
  bool test() override {
    if (error_) std::rethrow_exception(error_);
    return done_ || (done_ = reap());
  }
  bool wait_for(Millis timeout) override {
    if (error_) std::rethrow_exception(error_);
    if (done_) return true;
    if (timeout == kNoTimeout) {
      try {
        for (; first_ < parts_.size(); ++first_) {
          Part& p = parts_[first_];
          if (p.has_body && !p.body_done) p.body.wait();
          p.body_done = true;
          p.trailer.wait();
          p.done = true;
          p.buf = BufferPool::Handle();
        }
      } catch (...) {
        failed();
        throw;
      }
      return done_ = true;
    }
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (!test()) {
      if (std::chrono::steady_clock::now() >= end) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return true;
  }
  std::string describe() const override { return what_; }
  int rank() const override { return rank_; }

 private:
  struct Part {
    Work body, trailer;
    BufferPool::Handle buf;
    bool has_body = false, body_done = false, done = false;
  };
  // A failed operation is finished, its error stored (and rethrown by every later call); buffers
  // of records the transport may still read are given up. Called in a catch block.
  void failed() noexcept {
    for (Part& p : parts_)
      if (!p.done && p.buf) p.buf.leak();
    done_ = true;
    error_ = std::current_exception();
  }
  std::string what_;
  int rank_;
  std::vector<Part> parts_;
  std::size_t first_ = 0;  // the first record not known to be done
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace

// A receive: every record's ciphertext lands in the caller's buffer and its trailer in trailers_;
// the records are opened in place, in order, as they arrive.
class SealedRecvWork final : public WorkImpl {
 public:
  struct Rec {
    Work body, trailer;
    std::size_t off = 0, len = 0;
    bool body_done = false;
  };
  SealedRecvWork(std::string what, int rank, Expect e, TensorView out,
                 std::shared_ptr<SealedP2p::Peer> peer, std::size_t records)
      : what_(std::move(what)),
        rank_(rank),
        e_(std::move(e)),
        out_(static_cast<std::uint8_t*>(out.data)),
        peer_(std::move(peer)),
        trailers_(new std::uint8_t[records * kTrailerBytes]) {
    recs_.reserve(records);
  }
  /// The transport may still write into the trailers of an unfinished receive, or of a failed
  /// one whose records it could not give up: they are then abandoned.
  ~SealedRecvWork() override {
    if (!withdrawn_ && (next_ < recs_.size() || error_)) abandon(std::move(trailers_));
  }
  std::uint8_t* trailer(std::size_t i) const noexcept {
    return trailers_.get() + i * kTrailerBytes;
  }
  std::uint8_t* out() const noexcept { return out_; }
  std::vector<Rec>& recs() noexcept { return recs_; }
  void set_sequence(std::uint64_t s) noexcept { e_.sequence = s; }

  bool test() override {
    if (error_) std::rethrow_exception(error_);
    while (next_ < recs_.size()) {
      check_channel();
      Rec& r = recs_[next_];
      if (!r.body_done) {
        if (!guard([&] { return r.body.test(); })) return false;
        r.body_done = true;
      }
      if (!guard([&] { return r.trailer.test(); })) return false;
      open_next();
    }
    return true;
  }
  bool wait_for(Millis timeout) override {
    if (error_) std::rethrow_exception(error_);
    if (timeout == kNoTimeout) {
      while (next_ < recs_.size()) {
        check_channel();
        Rec& r = recs_[next_];
        if (!r.body_done) guard([&] { return r.body.wait(), true; });
        r.body_done = true;
        guard([&] { return r.trailer.wait(), true; });
        open_next();
      }
      return true;
    }
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (!test()) {
      if (std::chrono::steady_clock::now() >= end) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return true;
  }
  std::string describe() const override { return what_; }
  int rank() const override { return rank_; }
  // Withdraws the records not yet opened, retrying those an earlier failure could not give up
  // within its grace. An unfinished receive ends with "cancelled", which breaks the channel from
  // its peer (the message it was to get, or the rest of it, would reach the next receive under
  // the wrong sequence number). Once every record is withdrawn the buffer holds none of the
  // message.
  bool cancel(Millis grace) override {
    if (withdrawn_ || (!error_ && next_ == recs_.size())) return true;
    if (!error_) {
      fail(std::make_exception_ptr(CommError(what_ + ": cancelled; later messages from rank " +
                                                 std::to_string(e_.sender) + " on " + e_.channel +
                                                 " cannot be matched to their sequence numbers",
                                             __FILE__, __LINE__)),
           grace);
      peer_->fail(error_);
    } else {
      withdraw(grace);
      if (withdrawn_) std::memset(out_, 0, e_.message_length);
    }
    return withdrawn_;
  }

 private:
  // Runs an inner test/wait; a failure of the transport ends the receive.
  template <class F>
  bool guard(F&& f) {
    try {
      return f();
    } catch (...) {
      fail(std::current_exception());
      throw;
    }
  }
  void open_next() {
    const Rec& r = recs_[next_];
    e_.record = static_cast<std::uint32_t>(next_);
    e_.length = r.len;
    Reject why = Reject::malformed;
    try {
      std::lock_guard<std::mutex> lk(peer_->dec_mu);
      open_record(*peer_->dec, out_ + r.off, r.len, trailer(next_), kTrailerBytes, e_, out_ + r.off,
                  &why);
    } catch (const SecurityError&) {
      count_failure(why);
      fail(std::current_exception());
      peer_->fail(error_);
      throw;
    }
    ++next_;
  }
  // A message rejected through another receive broke the channel: this one fails with its error.
  void check_channel() {
    if (!peer_->broken.load(std::memory_order_acquire)) return;
    fail(peer_->failure());
    std::rethrow_exception(error_);
  }
  // Ends the receive with `e`: the records not yet opened are given up, and the buffer keeps
  // nothing of the message (its records opened so far, and all of it once every record is given
  // up, are zeroed).
  void fail(std::exception_ptr e, Millis grace = kGrace) {
    error_ = std::move(e);
    const std::size_t opened = next_ < recs_.size() ? recs_[next_].off : e_.message_length;
    withdraw(grace);
    const std::size_t wipe = withdrawn_ ? e_.message_length : opened;
    if (wipe > 0) std::memset(out_, 0, wipe);
  }
  // Cancels every inner receive of the records not yet opened, within `grace` for them all.
  void withdraw(Millis grace) {
    const auto end = std::chrono::steady_clock::now() + grace;
    bool all = true;
    for (std::size_t i = next_; i < recs_.size(); ++i) {
      Rec& r = recs_[i];
      if (!r.body_done && r.body.valid()) all = r.body.cancel(millis_until(end)) && all;
      all = r.trailer.cancel(millis_until(end)) && all;
    }
    withdrawn_ = all;
  }
  static constexpr Millis kGrace{1000};
  std::string what_;
  int rank_;
  Expect e_;
  std::uint8_t* out_;
  std::shared_ptr<SealedP2p::Peer> peer_;
  std::unique_ptr<std::uint8_t[]> trailers_;
  std::vector<Rec> recs_;
  std::size_t next_ = 0;    // the first record not yet opened
  bool withdrawn_ = false;  // every record not opened was given up: nothing writes any more
  std::exception_ptr error_;
};

// ---- SealedP2p ----------------------------------------------------------------------------------

SealedP2p::~SealedP2p() {
  if (shm_) shm_->close();
}

namespace {

// The MPI communicator behind a transport (its ranks are the transport's), or MPI_COMM_NULL.
MPI_Comm mpi_of(const P2p& p) {
  if (const auto* m = dynamic_cast<const MpiComm*>(&p)) return m->handle();
  if (const auto* u = dynamic_cast<const UcxP2p*>(&p)) return u->bootstrap();
  return MPI_COMM_NULL;
}

}  // namespace

std::unique_ptr<SealedP2p> SealedP2p::create(std::unique_ptr<P2p> inner, const Keys& keys,
                                             const SealOptions& opts) {
  DT_CHECK(InvalidArgument, inner != nullptr, "seal_p2p: no transport given");
  const int n = inner->size(), me = inner->rank();
  DT_CHECK(InvalidArgument, n - 1 <= kMaxRank, "seal_p2p: ", n,
           " ranks; sealed transports serve at most ", kMaxRank + 1);
  std::unique_ptr<SealedP2p> s(new SealedP2p());
  s->name_ = rank_list_name(inner->name());
  s->channel_ = opts.channel;
  s->plain_.assign(static_cast<std::size_t>(n), false);
  for (int p : opts.plain_peers) {
    DT_CHECK(InvalidArgument, p >= 0 && p < n, "seal_p2p: plain peer ", p, " is not a rank of ",
             inner->name(), " (size ", n, ")");
    if (p != me) s->plain_[static_cast<std::size_t>(p)] = true;
  }
  DT_CHECK(InvalidArgument, opts.record_bytes >= 4096 && opts.record_bytes <= kMaxRecordBytes,
           "seal_p2p on ", inner->name(), ": record_bytes ", opts.record_bytes,
           " is outside [4096, ", kMaxRecordBytes, "]");
  s->record_bytes_ = opts.record_bytes;
  s->pool_ = std::make_shared<BufferPool>();
  s->tamper_ = std::make_unique<TamperState>();
  s->tamper_->plan = opts.tamper;
  // Salts and record sizes: every rank draws a salt of its own and learns every rank's, with its
  // record size. The key of messages from s to r derives from both salts, so a sender's keys
  // always depend on randomness it drew itself: a salt altered or replayed on the way (one of an
  // earlier run of a requeued job, which keeps its job id, say) can only make messages fail
  // authentication, never make a sender reuse a key and nonce.
  constexpr std::size_t kSetup = kSaltBytes + 8;
  std::vector<std::uint8_t> setup(kSetup * static_cast<std::size_t>(n));
  std::uint8_t* mine = setup.data() + kSetup * static_cast<std::size_t>(me);
  const Salt own = random_salt();
  std::memcpy(mine, own.data(), kSaltBytes);
  for (int i = 0; i < 8; ++i)
    mine[kSaltBytes + static_cast<std::size_t>(i)] =
        static_cast<std::uint8_t>(static_cast<std::uint64_t>(opts.record_bytes) >> (8 * i));
  const MPI_Comm comm = mpi_of(*inner);
  s->world_.assign(static_cast<std::size_t>(n), -1);
  if (comm != MPI_COMM_NULL) {
    MPI_Group mine_g = MPI_GROUP_NULL, world_g = MPI_GROUP_NULL;
    std::vector<int> local(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) local[static_cast<std::size_t>(r)] = r;
    if (MPI_Comm_group(comm, &mine_g) == MPI_SUCCESS &&
        MPI_Comm_group(MPI_COMM_WORLD, &world_g) == MPI_SUCCESS)
      MPI_Group_translate_ranks(mine_g, n, local.data(), world_g, s->world_.data());
    if (mine_g != MPI_GROUP_NULL) MPI_Group_free(&mine_g);
    if (world_g != MPI_GROUP_NULL) MPI_Group_free(&world_g);
    for (int& w : s->world_)
      if (w == MPI_UNDEFINED) w = -1;
  }
  if (comm != MPI_COMM_NULL) {
    DT_CHECK(CommError,
             MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, setup.data(),
                           static_cast<int>(kSetup), MPI_BYTE, comm) == MPI_SUCCESS,
             "seal_p2p on ", inner->name(), ": MPI_Allgather of the salts failed");
  } else {  // a transport without MPI: one message to and from every peer
    std::vector<Work> ws;
    for (int r = 0; r < n; ++r)
      if (r != me)
        ws.push_back(inner->isend(ConstTensorView{mine, kSetup, DType::u8}, r, kReservedTagBase));
    for (int r = 0; r < n; ++r)
      if (r != me)
        inner->recv(
            TensorView{setup.data() + kSetup * static_cast<std::size_t>(r), kSetup, DType::u8}, r,
            kReservedTagBase);
    for (Work& w : ws) w.wait();
  }
  auto salt_of = [&](int r) {
    Salt x{};
    std::memcpy(x.data(), setup.data() + kSetup * static_cast<std::size_t>(r), kSaltBytes);
    return x;
  };
  auto record_of = [&](int r) {
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i)
      v |= static_cast<std::uint64_t>(setup[kSetup * static_cast<std::size_t>(r) + kSaltBytes +
                                            static_cast<std::size_t>(i)])
           << (8 * i);
    return v;
  };
  const std::uint64_t rb0 = record_of(0);
  s->peers_.resize(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) {
    auto st = std::make_shared<Peer>();
    if (!s->plain_[static_cast<std::size_t>(p)]) {
      const Salt theirs = salt_of(p);
      st->enc.emplace(keys.traffic_key(opts.channel, own, theirs, me, p), true, keys.aes());
      st->dec.emplace(keys.traffic_key(opts.channel, theirs, own, p, me), false, keys.aes());
    }
    s->peers_[static_cast<std::size_t>(p)] = std::move(st);
  }
  // Same-node peers: shared-memory mailboxes (collective over the transport's communicator, so
  // before a rank may refuse the record size below; the layout follows rank 0's record size).
  if (comm != MPI_COMM_NULL) {
    ShmMailboxes::Config mc;
    mc.name = s->name_;
    mc.record_bytes = static_cast<std::size_t>(rb0);
    mc.ring_bytes = opts.shm_ring_bytes;
    mc.enabled = opts.shm;
    mc.simulated_nodes = opts.simulated_nodes;
    mc.plain = s->plain_;
    s->shm_ = ShmMailboxes::create(comm, mc, s->peers_, s->pool_);
  }
  // Every rank knows every rank's record size: all refuse alike, naming the first that differs
  // (a rank that matched rank 0 and went on would wait for the one that refused).
  for (int r = 1; r < n; ++r)
    DT_CHECK(InvalidArgument, record_of(r) == rb0, "seal_p2p on ", inner->name(), ": rank ", r,
             " cuts messages into records of ", record_of(r), " bytes, rank 0 into ", rb0,
             " (record_bytes must be the same on every rank)");
  s->inner_ = std::move(inner);
  return s;
}

bool SealedP2p::sealed_with(int peer) const noexcept {
  return peer >= 0 && peer < size() && !plain_[static_cast<std::size_t>(peer)];
}

bool SealedP2p::shm_with(int peer) const noexcept { return shm_ && shm_->serves(peer); }

const std::shared_ptr<SealedP2p::Peer>& SealedP2p::peer(int p) const {
  return peers_[static_cast<std::size_t>(p)];
}

void SealedP2p::check_tag(int tag, const char* op) const {
  DT_CHECK(InvalidArgument, tag >= 0 && tag < kReservedTagBase, op, " on ", name_, ": tag ", tag,
           " is outside [0, ", kReservedTagBase, ") (tags above are reserved for sealed traffic)");
}
void SealedP2p::check_peer(int p, const char* op) const {
  DT_CHECK(InvalidArgument, p >= 0 && p < size(), op, " on ", name_, ": peer ", p,
           " is not a rank of this communicator (size ", size(), ")");
}

Work SealedP2p::isend(ConstTensorView buf, int dst, int tag) {
  check_tag(tag, "send");
  return isend_internal(buf, dst, tag);
}
Work SealedP2p::irecv(TensorView buf, int src, int tag) {
  check_tag(tag, "recv");
  return irecv_internal(buf, src, tag);
}

namespace {

// The records of one message of `n` bytes: their count, and record i's offset and length.
struct Records {
  std::size_t n, rb, count;
  Records(std::size_t bytes, std::size_t record_bytes, const std::string& what)
      : n(bytes),
        rb(record_bytes),
        count(static_cast<std::size_t>(record_count(bytes, record_bytes))) {
    DT_CHECK(InvalidArgument, count <= 0xFFFFFFFFu, what, ": ", bytes, " bytes make ", count,
             " records of ", record_bytes, " bytes; at most 2^32 - 1 per message");
  }
  std::size_t off(std::size_t i) const noexcept { return i * rb; }
  std::size_t len(std::size_t i) const noexcept { return std::min(rb, n - off(i)); }
};

}  // namespace

Work SealedP2p::isend_internal(ConstTensorView buf, int dst, int tag) {
  check_peer(dst, "send");
  if (plain_[static_cast<std::size_t>(dst)]) return inner_->isend(buf, dst, tag);
  if (tamper_->plan.kind != Tamper::Kind::none) return isend_tampered(buf, dst, tag);
  const std::size_t n = buf.nbytes();
  std::string what = "sealed send(" + std::to_string(n) + " bytes to " + std::to_string(dst) +
                     ", tag " + std::to_string(tag) + ") on " + name_;
  const Records rec(n, record_bytes_, what);
  const auto* src = static_cast<const std::uint8_t*>(buf.data);
  Peer& p = *peer(dst);
  std::lock_guard<std::mutex> lk(p.send_mu);
  Header h;
  h.sender = static_cast<std::uint32_t>(rank());
  h.receiver = static_cast<std::uint32_t>(dst);
  h.tag = tag;
  h.sequence = p.send_seq[tag];
  h.message_length = n;
  h.records = static_cast<std::uint32_t>(rec.count);
  // Every record takes one counter value; refused as a whole before anything is sent.
  DT_CHECK(SecurityError, p.counter + (rec.count - 1) <= kMaxCounter, "sealed traffic from rank ",
           rank(), " to rank ", dst, ": message counter exhausted (", p.counter, " + ", rec.count,
           " records); re-create the channel for a fresh key");
  if (shm_with(dst)) {  // sealed straight into the peer's mailbox
    h.counter = p.counter;
    p.counter += rec.count;
    ++p.send_seq[tag];
    return shm_->send(std::move(what), dst, src, h);
  }
  auto w = std::make_unique<SendWork>(std::move(what), rank());
  // Seal record k and hand it to the transport, then seal k+1 while k travels; reap() returns
  // the buffers of records already delivered, so the next records reuse them while in cache.
  for (std::size_t i = 0; i < rec.count; ++i) {
    h.record = static_cast<std::uint32_t>(i);
    h.length = rec.len(i);
    h.counter = p.counter++;
    BufferPool::Handle wire = pool_->get(h.length + kTrailerBytes);
    seal_record(*p.enc, h, src + rec.off(i), wire->data(), wire->data() + h.length);
    w->post(*inner_, std::move(wire), h.length, dst, tag);
    // The sequence number is used once record 0 is on its way (every message has one): a send
    // that fails later never gives it to another message, whose records could otherwise be
    // taken for the rest of this one.
    if (i == 0) ++p.send_seq[tag];
    w->reap();
  }
  return Work(std::move(w));
}

// The test-only faults of Tamper: the message is sealed whole, then sent damaged, held back,
// replaced, cut or with records swapped, through the transport or the peer's mailbox.
Work SealedP2p::isend_tampered(ConstTensorView buf, int dst, int tag) {
  const std::size_t n = buf.nbytes();
  std::string what = "sealed send(" + std::to_string(n) + " bytes to " + std::to_string(dst) +
                     ", tag " + std::to_string(tag) + ") on " + name_;
  const Records rec(n, record_bytes_, what);
  const auto* src = static_cast<const std::uint8_t*>(buf.data);
  Peer& p = *peer(dst);
  std::lock_guard<std::mutex> lk(p.send_mu);
  Header h;
  h.sender = static_cast<std::uint32_t>(rank());
  h.receiver = static_cast<std::uint32_t>(dst);
  h.tag = tag;
  h.sequence = p.send_seq[tag]++;
  h.message_length = n;
  h.records = static_cast<std::uint32_t>(rec.count);
  std::vector<BufferPool::Handle> recs;
  for (std::size_t i = 0; i < rec.count; ++i) {
    h.record = static_cast<std::uint32_t>(i);
    h.length = rec.len(i);
    h.counter = p.counter++;
    recs.push_back(pool_->get(h.length + kTrailerBytes));
    seal_record(*p.enc, h, src + rec.off(i), recs.back()->data(), recs.back()->data() + h.length);
  }
  std::vector<BufferPool::Handle> out;  // what leaves, in this order
  auto post = [&](std::vector<BufferPool::Handle>& rs) {
    for (BufferPool::Handle& b : rs) out.push_back(std::move(b));
    rs.clear();
  };
  auto send = [&] {
    if (shm_with(dst)) return shm_->send_raw(std::move(what), dst, std::move(out));
    auto w = std::make_unique<SendWork>(std::move(what), rank());
    for (BufferPool::Handle& b : out) {
      const std::size_t len = b->size - kTrailerBytes;
      w->post(*inner_, std::move(b), len, dst, tag);
    }
    return Work(std::move(w));
  };
  TamperState& t = *tamper_;
  std::lock_guard<std::mutex> tl(t.mu);
  const std::uint64_t index = t.sent++;
  using K = Tamper::Kind;
  const bool at = index == t.plan.at;
  if (t.plan.kind == K::flip && at) {
    // A bit of the payload's middle byte, or of the GCM tag of an empty message.
    const std::size_t r = n == 0 ? 0 : (n / 2) / rec.rb;
    const std::size_t pos = n == 0 ? kHeaderBytes : n / 2 - rec.off(r);
    recs[r]->data()[pos] ^= 0x10;
  } else if (t.plan.kind == K::drop_record && at) {
    recs.pop_back();  // the last record never leaves
  } else if (t.plan.kind == K::swap_records && at && recs.size() >= 2) {
    std::swap(recs[0], recs[1]);
  } else if (t.armed && t.peer == dst && t.tag == tag) {
    auto same_shape = [&] {
      if (t.saved.size() != recs.size()) return false;
      for (std::size_t i = 0; i < recs.size(); ++i)
        if (t.saved[i]->size != recs[i]->size) return false;
      return true;
    };
    if (t.plan.kind == K::replay && same_shape()) {
      for (std::size_t i = 0; i < recs.size(); ++i)  // the receiver sees `at` again
        std::memcpy(recs[i]->data(), t.saved[i]->data(), recs[i]->size);
      t.armed = false;
      t.saved.clear();
    } else if (t.plan.kind == K::reorder) {
      post(recs);
      post(t.saved);
      t.armed = false;
      return send();
    }
  } else if (at && (t.plan.kind == K::replay || t.plan.kind == K::reorder)) {
    t.armed = true;
    t.peer = dst;
    t.tag = tag;
    if (t.plan.kind == K::reorder) {
      t.saved = std::move(recs);  // held back; this send counts as done
      return send();
    }
    for (const BufferPool::Handle& b : recs) {
      t.saved.push_back(pool_->get(b->size));
      std::memcpy(t.saved.back()->data(), b->data(), b->size);
    }
  }
  post(recs);
  return send();
}

Work SealedP2p::irecv_internal(TensorView buf, int src, int tag) {
  check_peer(src, "recv");
  if (plain_[static_cast<std::size_t>(src)]) return inner_->irecv(buf, src, tag);
  const std::size_t n = buf.nbytes();
  std::string what = "sealed recv(" + std::to_string(n) + " bytes from " + std::to_string(src) +
                     ", tag " + std::to_string(tag) + ") on " + name_;
  const Records rec(n, record_bytes_, what);
  const std::shared_ptr<Peer>& pp = peer(src);
  Peer& p = *pp;
  Expect e;
  e.sender = src;
  e.receiver = rank();
  e.sender_world = world_[static_cast<std::size_t>(src)];
  e.receiver_world = world_[static_cast<std::size_t>(rank())];
  e.tag = tag;
  e.message_length = n;
  e.records = static_cast<std::uint32_t>(rec.count);
  e.channel = name_;
  if (shm_with(src)) {  // opened straight from the mailbox into `buf`
    std::lock_guard<std::mutex> lk(p.recv_mu);
    e.sequence = p.recv_seq[tag]++;
    return shm_->recv(std::move(what), src, buf.data, e);
  }
  // A channel broken by a rejected message receives nothing more.
  if (p.broken.load(std::memory_order_acquire)) std::rethrow_exception(p.failure());
  auto w = std::make_unique<SealedRecvWork>(what, rank(), e, buf, pp, rec.count);
  auto* out = w->out();
  std::lock_guard<std::mutex> lk(p.recv_mu);
  w->set_sequence(p.recv_seq[tag]++);
  // Every record is posted now, in order (the transport matches messages of one tag in order):
  // its ciphertext straight into the caller's buffer, where it is opened in place.
  for (std::size_t i = 0; i < rec.count; ++i) {
    SealedRecvWork::Rec r;
    r.off = rec.off(i);
    r.len = rec.len(i);
    if (r.len > 0)
      r.body = inner_->irecv(TensorView{out + r.off, r.len, DType::u8}, src, tag);
    else
      r.body_done = true;
    r.trailer = inner_->irecv(TensorView{w->trailer(i), kTrailerBytes, DType::u8}, src, tag);
    w->recs().push_back(std::move(r));
  }
  return Work(std::move(w));
}

std::unique_ptr<P2p> seal_p2p(std::unique_ptr<P2p> inner, const Keys& keys,
                              const SealOptions& opts) {
  return SealedP2p::create(std::move(inner), keys, opts);
}

Tamper parse_tamper(const std::string& text, const std::string& option) {
  Tamper t;
  if (text.empty() || text == "none") return t;
  const auto colon = text.find(':');
  const std::string kind = text.substr(0, colon);
  const std::string num = colon == std::string::npos ? "" : text.substr(colon + 1);
  if (kind == "flip")
    t.kind = Tamper::Kind::flip;
  else if (kind == "replay")
    t.kind = Tamper::Kind::replay;
  else if (kind == "reorder")
    t.kind = Tamper::Kind::reorder;
  else if (kind == "drop-record")
    t.kind = Tamper::Kind::drop_record;
  else if (kind == "swap-records")
    t.kind = Tamper::Kind::swap_records;
  const bool numeric =
      !num.empty() && num.size() <= 18 && num.find_first_not_of("0123456789") == std::string::npos;
  if (t.kind == Tamper::Kind::none || !numeric)
    DT_THROW(ConfigError, option, ": '", text,
             "' is not one of none, flip:N, replay:N, reorder:N, drop-record:N, swap-records:N (N: "
             "message index)");
  t.at = std::stoull(num);
  return t;
}

}  // namespace dt::security
