#include "sealed_p2p.hpp"

#include <chrono>
#include <cstring>
#include <thread>

#include "dt/error.hpp"
#include "dt/metrics.hpp"

namespace dt::security {

// ---- buffers ------------------------------------------------------------------------------------

namespace {
constexpr std::size_t kPoolMaxBytes = std::size_t{256} << 20;
constexpr std::size_t kPoolMaxBuffers = 64;
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

BufferPool::Handle BufferPool::get(std::size_t bytes) {
  std::unique_ptr<Buf> b;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // Smallest free buffer that fits.
    std::size_t best = free_.size();
    for (std::size_t i = 0; i < free_.size(); ++i)
      if (free_[i]->cap >= bytes && (best == free_.size() || free_[i]->cap < free_[best]->cap))
        best = i;
    if (best != free_.size()) {
      b = std::move(free_[best]);
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
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
  free_bytes_ += b->cap;
  try {
    free_.push_back(std::move(b));
  } catch (...) {  // no room to keep it: freed instead
    free_bytes_ -= b ? b->cap : 0;
  }
}

// ---- metrics ------------------------------------------------------------------------------------

void count_failure(Reject r) noexcept {
  try {
    metrics::default_registry()
        .counter("dt_security_auth_failures_total",
                 "Sealed messages rejected (bad tag, replay, reorder, redirect, malformed)",
                 {{"reason", reject_name(r)}})
        .inc();
  } catch (...) {
  }
}

// ---- state --------------------------------------------------------------------------------------

struct SealedP2p::Peer {
  std::mutex mu;
  std::optional<Aead> enc, dec;
  std::uint64_t counter = 0;                 // sent messages to this peer (the nonce counter)
  std::map<int, std::uint64_t> send_seq;     // per tag
  std::map<int, std::uint64_t> recv_seq;     // per tag, assigned when a receive is posted
  std::mutex dec_mu;                         // decryption happens outside `mu`
};

struct SealedP2p::TamperState {
  std::mutex mu;
  Tamper plan;
  std::uint64_t sent = 0;  // sealed messages sent so far
  // replay: the copy of message `at`, waiting for the next message to the same (peer, tag)
  // reorder: message `at`, held back until then
  bool armed = false;
  int peer = -1, tag = 0;
  BufferPool::Handle saved;
};

namespace {

std::string rank_list_name(const std::string& inner) { return inner + "/sealed"; }

class SendWork final : public WorkImpl {
 public:
  SendWork(std::string what, int rank) : what_(std::move(what)), rank_(rank) {}
  /// The transport may still read an unfinished send's buffers: they are then given up.
  ~SendWork() override {
    if (!done_)
      for (BufferPool::Handle& b : bufs) b.leak();
  }
  std::vector<Work> inner;
  std::vector<BufferPool::Handle> bufs;
  bool test() override {
    if (done_) return true;
    bool all = true;
    try {
      for (Work& w : inner) all = w.test() && all;
    } catch (...) {
      done_ = true;  // a failed operation is finished
      throw;
    }
    done_ = all;
    return all;
  }
  bool wait_for(Millis timeout) override {
    if (done_) return true;
    if (timeout == kNoTimeout) {
      try {
        for (Work& w : inner) w.wait();
      } catch (...) {
        done_ = true;
        throw;
      }
      done_ = true;
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

 private:
  std::string what_;
  int rank_;
  bool done_ = false;
};

}  // namespace

// A receive: the inner receive into a wire buffer, then (once) open into the caller's buffer.
class SealedRecvWork final : public WorkImpl {
 public:
  SealedRecvWork(std::string what, int rank, Work inner, BufferPool::Handle wire, Expect e,
                 TensorView out, std::shared_ptr<SealedP2p::Peer> peer)
      : what_(std::move(what)),
        rank_(rank),
        inner_(std::move(inner)),
        wire_(std::move(wire)),
        e_(std::move(e)),
        out_(out),
        peer_(std::move(peer)) {}
  /// The transport may still write into an unfinished receive's wire buffer: it is then given up.
  ~SealedRecvWork() override {
    if (!inner_done_ && wire_) wire_.leak();
  }
  bool test() override {
    if (error_) std::rethrow_exception(error_);
    if (done_) return true;
    if (!inner_test()) return false;
    finish();
    return true;
  }
  bool wait_for(Millis timeout) override {
    if (error_) std::rethrow_exception(error_);
    if (done_) return true;
    if (timeout == kNoTimeout) {
      try {
        inner_.wait();
      } catch (...) {
        inner_done_ = true;
        error_ = std::current_exception();
        throw;
      }
      inner_done_ = true;
    } else {
      const auto end = std::chrono::steady_clock::now() + timeout;
      while (!inner_test()) {
        if (std::chrono::steady_clock::now() >= end) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    finish();
    return true;
  }
  std::string describe() const override { return what_; }
  int rank() const override { return rank_; }

 private:
  bool inner_test() {
    try {
      inner_done_ = inner_.test();
    } catch (...) {
      inner_done_ = true;
      error_ = std::current_exception();
      throw;
    }
    return inner_done_;
  }
  void finish();
  std::string what_;
  int rank_;
  Work inner_;
  BufferPool::Handle wire_;
  Expect e_;
  TensorView out_;
  std::shared_ptr<SealedP2p::Peer> peer_;
  bool done_ = false;
  bool inner_done_ = false;
  std::exception_ptr error_;
};

void SealedRecvWork::finish() {
  try {
    Reject why = Reject::malformed;
    try {
      std::lock_guard<std::mutex> lk(peer_->dec_mu);
      open_message(*peer_->dec, wire_->data(), wire_->size, e_, out_.data, &why);
    } catch (const SecurityError&) {
      count_failure(why);
      throw;
    }
    done_ = true;
    wire_ = BufferPool::Handle();
  } catch (...) {
    error_ = std::current_exception();
    throw;
  }
}

// ---- SealedP2p ----------------------------------------------------------------------------------

SealedP2p::~SealedP2p() = default;

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
  s->pool_ = std::make_shared<BufferPool>();
  s->tamper_ = std::make_unique<TamperState>();
  s->tamper_->plan = opts.tamper;
  // Session salt: drawn by rank 0, sent to every rank (a fresh key set per channel instance).
  Salt session{};
  if (me == 0) {
    session = random_salt();
    std::vector<Work> ws;
    for (int r = 1; r < n; ++r)
      ws.push_back(inner->isend(ConstTensorView{session.data(), session.size(), DType::u8}, r,
                                kReservedTagBase));
    for (Work& w : ws) w.wait();
  } else {
    inner->recv(TensorView{session.data(), session.size(), DType::u8}, 0, kReservedTagBase);
  }
  s->peers_.resize(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) {
    auto st = std::make_shared<Peer>();
    if (!s->plain_[static_cast<std::size_t>(p)]) {
      st->enc.emplace(keys.traffic_key(opts.channel, session, me, p), true);
      st->dec.emplace(keys.traffic_key(opts.channel, session, p, me), false);
    }
    s->peers_[static_cast<std::size_t>(p)] = std::move(st);
  }
  s->inner_ = std::move(inner);
  return s;
}

bool SealedP2p::sealed_with(int peer) const noexcept {
  return peer >= 0 && peer < size() && !plain_[static_cast<std::size_t>(peer)];
}

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

Work SealedP2p::isend_internal(ConstTensorView buf, int dst, int tag) {
  check_peer(dst, "send");
  if (plain_[static_cast<std::size_t>(dst)]) return inner_->isend(buf, dst, tag);
  const std::size_t n = buf.nbytes();
  auto w = std::make_unique<SendWork>("sealed send(" + std::to_string(n) + " bytes to " +
                                          std::to_string(dst) + ", tag " + std::to_string(tag) +
                                          ") on " + name_,
                                      rank());
  BufferPool::Handle wire = pool_->get(n + kSealOverhead);
  Peer& p = *peer(dst);
  std::lock_guard<std::mutex> lk(p.mu);
  Header h;
  h.sender = static_cast<std::uint32_t>(rank());
  h.receiver = static_cast<std::uint32_t>(dst);
  h.tag = tag;
  h.sequence = p.send_seq[tag];
  h.counter = p.counter;
  h.length = n;
  seal_message(*p.enc, h, buf.data, wire->data());
  ++p.counter;
  ++p.send_seq[tag];
  auto post = [&](BufferPool::Handle b) {
    w->inner.push_back(
        inner_->isend(ConstTensorView{b->data(), b->size, DType::u8}, dst, tag));
    w->bufs.push_back(std::move(b));
  };
  if (tamper_->plan.kind == Tamper::Kind::none) {
    post(std::move(wire));
    return Work(std::move(w));
  }
  // Test-only faults.
  TamperState& t = *tamper_;
  std::lock_guard<std::mutex> tl(t.mu);
  const std::uint64_t index = t.sent++;
  using K = Tamper::Kind;
  if (t.plan.kind == K::flip && index == t.plan.at) {
    wire->data()[kHeaderBytes + n / 2] ^= 0x10;  // payload, or the GCM tag when empty
  } else if (t.armed && t.peer == dst && t.tag == tag) {
    if (t.plan.kind == K::replay && t.saved->size == wire->size) {
      std::memcpy(wire->data(), t.saved->data(), wire->size);  // the receiver sees `at` again
      t.armed = false;
      t.saved = BufferPool::Handle();
    } else if (t.plan.kind == K::reorder) {
      post(std::move(wire));
      post(std::move(t.saved));
      t.armed = false;
      return Work(std::move(w));
    }
  } else if (index == t.plan.at && (t.plan.kind == K::replay || t.plan.kind == K::reorder)) {
    t.armed = true;
    t.peer = dst;
    t.tag = tag;
    if (t.plan.kind == K::reorder) {
      t.saved = std::move(wire);  // held back; this send counts as done
      return Work(std::move(w));
    }
    t.saved = pool_->get(wire->size);
    std::memcpy(t.saved->data(), wire->data(), wire->size);
  }
  post(std::move(wire));
  return Work(std::move(w));
}

Work SealedP2p::irecv_internal(TensorView buf, int src, int tag) {
  check_peer(src, "recv");
  if (plain_[static_cast<std::size_t>(src)]) return inner_->irecv(buf, src, tag);
  const std::size_t n = buf.nbytes();
  BufferPool::Handle wire = pool_->get(n + kSealOverhead);
  const std::shared_ptr<Peer>& pp = peer(src);
  Peer& p = *pp;
  Expect e;
  e.sender = src;
  e.receiver = rank();
  e.tag = tag;
  e.length = n;
  e.channel = name_;
  Work inner;
  {
    std::lock_guard<std::mutex> lk(p.mu);
    e.sequence = p.recv_seq[tag]++;
    inner = inner_->irecv(TensorView{wire->data(), wire->size, DType::u8}, src, tag);
  }
  std::string what = "sealed recv(" + std::to_string(n) + " bytes from " + std::to_string(src) +
                     ", tag " + std::to_string(tag) + ") on " + name_;
  return Work(std::make_unique<SealedRecvWork>(std::move(what), rank(), std::move(inner),
                                               std::move(wire), std::move(e), buf, pp));
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
  const bool numeric = !num.empty() && num.size() <= 18 &&
                       num.find_first_not_of("0123456789") == std::string::npos;
  if (t.kind == Tamper::Kind::none || !numeric)
    DT_THROW(ConfigError, option, ": '", text,
             "' is not one of none, flip:N, replay:N, reorder:N (N: message index)");
  t.at = std::stoull(num);
  return t;
}

}  // namespace dt::security
