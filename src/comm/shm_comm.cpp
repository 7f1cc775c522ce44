#include "shm_comm.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <new>
#include <sstream>
#include <thread>
#include <utility>

#include "reduce.hpp"

namespace dt {

struct ShmComm::Control {
  alignas(64) std::atomic<std::uint64_t> arrive{0};  // sequence number of the last op joined
  alignas(64) std::atomic<std::uint64_t> off{0};     // that op's region offset, element count
  std::atomic<std::uint64_t> n{0};                   // and kind (small_kind), written before
  std::atomic<std::uint64_t> kind{0};                // `arrive`, and the elements of the call
  std::atomic<std::uint64_t> total{0};               // it is a piece of
  alignas(64) std::atomic<std::uint64_t> prog{0};    // (seq << 32) | chunks of own slice published
  alignas(64) std::atomic<std::uint64_t> done{0};    // sequence number of the last op finished
  alignas(64) std::atomic<std::uint64_t> failed{0};  // != 0: this rank gave up (at that seq)
};

namespace {

constexpr std::size_t kCtlBytes = 4096;
constexpr std::size_t kAlign = 4096;

constexpr std::size_t round_up(std::size_t v, std::size_t a) { return (v + a - 1) / a * a; }

// A rank's segment: [control | two small slots | staging | arena]; a small slot is a header
// (SlotHead, in its own cache line) and kSmallBytes of data.
constexpr std::size_t kSlotHead = 64;
constexpr std::size_t kSlotStride = kSlotHead + ShmComm::kSmallBytes;
constexpr std::size_t kStagingOff = round_up(kCtlBytes + 2 * kSlotStride, kAlign);
// ctl.off of a rank on the small path (no region offset is this large), so that a peer on the
// other path sees the disagreement.
constexpr std::uint64_t kSmallMark = ~std::uint64_t{0};

// Which call a rank made on the small path, written before its `arrive` (release) and read by the
// peers after theirs (acquire). A slot is rewritten two collectives later, which no rank reaches
// before every peer has arrived at the next one.
struct SlotHead {
  std::uint64_t seq, kind, n;
};

enum SmallOp : std::uint64_t { kAllReduce, kBroadcast, kAllGather, kReduceScatter };

// kind: the collective, its dtype, and its reduce op or root.
std::uint64_t small_kind(SmallOp c, DType t, std::uint64_t arg) {
  return (static_cast<std::uint64_t>(c) << 48) | (static_cast<std::uint64_t>(t) << 40) | arg;
}

std::string small_call(std::uint64_t kind, std::uint64_t n) {
  static const char* const names[] = {"all_reduce", "broadcast", "all_gather", "reduce_scatter"};
  const std::uint64_t c = kind >> 48, t = (kind >> 40) & 0xFF, arg = kind & 0xFFFFFFFFFFu;
  std::ostringstream s;
  s << (c < 4 ? names[c] : "?") << "("
    << (t < std::size(kAllDTypes) ? dtype_name(static_cast<DType>(t)) : "?") << " x " << n;
  if (c == kBroadcast)
    s << ", root " << arg;
  else if (c != kAllGather && arg < 4)
    s << ", " << reduce_op_name(static_cast<ReduceOp>(arg));
  s << ")";
  return s.str();
}

// The progress word: the collective's sequence number (its low 32 bits) and the chunks published.
// It wraps after 2^32 collectives, so it is compared by `progress_reached`, not by `>=`.
std::uint64_t pack(std::uint64_t seq, std::uint64_t chunks) { return (seq << 32) | chunks; }

// v has reached `target` in serial-number order (RFC 1982): right across a wrap of the 64-bit
// word, since a peer's word is never 2^63 or more behind or ahead of what is waited for.
inline bool reached(std::uint64_t v, std::uint64_t target) noexcept {
  return static_cast<std::int64_t>(v - target) >= 0;
}

// A progress word has reached pack(seq, chunks): the same round (a peer's word is never ahead of
// the round waited for, and may be any number of rounds behind) and as many chunks or more.
inline bool progress_reached(std::uint64_t v, std::uint64_t want) noexcept {
  return (v >> 32) == (want >> 32) && (v & 0xFFFFFFFFu) >= (want & 0xFFFFFFFFu);
}

// memcpy that accepts the null pointer of an empty buffer (memcpy itself may not be given one).
inline void copy_bytes(void* dst, const void* src, std::size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}

}  // namespace

// Which MPI call family this call's fallbacks use: every rank uses the same one for a given call
// (comm.hpp), so it follows the options alone. Timeouts are kept by Work::wait on the progress
// thread, never inside the algorithm. How the non-blocking form is waited for may differ between
// ranks: polled, sleeping between polls, for kPolledWait and on a real-time thread (a blocking
// wait spins inside MPI and keeps every ordinary thread of the core from running).
struct ShmComm::Form {
  bool nonblocking = false;
  bool polled = false;
  static Form from(const CommOptions& o) {
    return Form{o.timeout != kNoTimeout, o.timeout == kPolledWait || realtime_thread()};
  }
  /// The form of the i* calls (polled on a real-time progress thread).
  static Form queued() { return Form{true, realtime_thread()}; }
  void wait(Work w) const { w.wait(polled ? kPolledWait : kNoTimeout); }
};

// --- creation ----------------------------------------------------------------------------------

namespace {

// Every rank must pass the same settings: the segment layout (staging, arena), the pipelining
// chunks and the paths collectives take (min_bytes, simulated nodes) are computed by each rank
// from its own, and a rank that differed would read the wrong place or wait on a path the others
// do not take. Checked before anything else: every rank throws the same error.
void agree_on_config(MpiComm& comm, const std::string& name, const ShmConfig& cfg) {
  const std::pair<const char*, std::int64_t> fields[] = {
      {"arena_bytes", static_cast<std::int64_t>(cfg.arena_bytes)},
      {"staging_bytes", static_cast<std::int64_t>(cfg.staging_bytes)},
      {"chunk_bytes", static_cast<std::int64_t>(cfg.chunk_bytes)},
      {"min_bytes", static_cast<std::int64_t>(cfg.min_bytes)},
      {"simulated_nodes", cfg.simulated_nodes}};
  constexpr std::size_t kFields = sizeof fields / sizeof fields[0];
  std::int64_t v[2 * kFields];  // the largest of each, then the largest of each negated
  for (std::size_t i = 0; i < kFields; ++i) {
    v[i] = fields[i].second;
    v[kFields + i] = -fields[i].second;
  }
  comm.all_reduce(view_of(v, 2 * kFields), ReduceOp::max);
  for (std::size_t i = 0; i < kFields; ++i)
    DT_CHECK(InvalidArgument, v[i] == -v[kFields + i], "shared-memory communicator ", name,
             ": the ranks passed different ", fields[i].first, " (from ", -v[kFields + i], " to ",
             v[i], "); every rank must pass the same ShmConfig");
}

}  // namespace

std::unique_ptr<ShmComm> ShmComm::create(const MpiComm& parent, std::string name,
                                         const ShmConfig& cfg) {
  DT_CHECK_GT(InvalidArgument, cfg.chunk_bytes, std::size_t{0}, "shm chunk bytes");
  DT_CHECK_GE(InvalidArgument, cfg.simulated_nodes, 0, "simulated nodes");
  std::unique_ptr<ShmComm> c(new ShmComm);
  c->name_ = std::move(name);
  c->cfg_ = cfg;
  c->mpi_ = MpiComm::dup(parent.handle(), c->name_ + "/mpi");
  if (!c->mpi_->world_ranks().empty()) watchdog::note_members(c->name_, c->mpi_->world_ranks());
  agree_on_config(*c->mpi_, c->name_, cfg);
  const int rank = c->mpi_->rank(), size = c->mpi_->size();
  c->local_ = c->mpi_->split_shared();
  if (cfg.simulated_nodes > 0) {
    const int k = std::min(cfg.simulated_nodes, size);
    const int sim = static_cast<int>(static_cast<long>(rank) * k / size);
    c->local_ = c->local_->split_mpi(sim, rank);
  }
  const int L = c->local_->size(), me = c->local_->rank();
  c->ins_.resize(static_cast<std::size_t>(L));
  // (Agreed: nodes of other sizes may pass where this one fails, and must not wait for it below.)
  std::string small;
  if (cfg.staging_bytes < 8 * static_cast<std::size_t>(L))
    small = detail::concat("a staging area of ", cfg.staging_bytes,
                           " bytes cannot hold one 8-byte element per local rank (", L, ")");
  const auto [small_rank, first_small] = first_problem(*c->mpi_, small);
  DT_CHECK(InvalidArgument, small_rank == size, "shared-memory communicator ", c->name_, ": ",
           first_small, size > 1 ? detail::concat(" (on rank ", small_rank, ")") : std::string());
  auto leaders = c->mpi_->split_mpi(me == 0 ? 0 : -1, rank);
  int ids[2] = {leaders ? leaders->rank() : 0, leaders ? leaders->size() : 0};
  c->local_->broadcast(view_of(ids, 2), 0);
  c->nodes_ = ids[1];
  int ls[2] = {L, -L};
  c->mpi_->all_reduce(view_of(ls, 2), ReduceOp::max);
  c->max_local_ = ls[0];
  c->min_local_ = -ls[1];
  const bool uniform = ls[0] == -ls[1];
  if (c->nodes_ > 1 && uniform) c->cross_ = c->mpi_->split_mpi(me, ids[0]);

  // One POSIX shared-memory object per node: L segments of [control | small slots | staging |
  // arena].
  c->seg_bytes_ =
      kStagingOff + round_up(cfg.staging_bytes, kAlign) + round_up(cfg.arena_bytes, kAlign);
  std::string err;
  c->shm_ =
      ShmSegment::create(*c->local_, c->seg_bytes_ * static_cast<std::size_t>(L), "dt-shm", &err);
  if (c->shm_) {
    for (int q = 0; q < L; ++q)
      c->bases_.push_back(c->shm_.data() + c->seg_bytes_ * static_cast<std::size_t>(q));
    new (c->seg(me)) Control();
    c->arena_ = c->seg(me) + kStagingOff + round_up(cfg.staging_bytes, kAlign);
  }
  // Every rank learns whether every rank of the job has its segment before anyone uses it.
  int ok = err.empty() ? 1 : 0;
  c->mpi_->all_reduce(view_of(&ok, 1), ReduceOp::min);
  if (!err.empty())
    DT_THROW(CommError, "shared-memory communicator ", c->name_, " on rank ", rank, ": ", err);
  DT_CHECK(CommError, ok, "shared-memory communicator ", c->name_, ": another rank could not map ",
           "its segment (see its message)");
  return c;
}

ShmComm::~ShmComm() {
  // Queued operations are finished first: they complete when the peers arrive. After a timeout
  // or an error they may never finish (a peer that died, or one that gave up), and they give up
  // at once; otherwise they get kDrainWait to finish before they give up. Then this rank marks
  // its segment as left, so that a peer still calling a collective fails instead of waiting for
  // it (everything this rank owed to a finished collective is published by then).
  bool busy = false, stuck = false;  // stuck: an operation that timed out has not run yet
  {
    std::lock_guard<std::mutex> lk(queue_mu_);
    busy = queue_ && queue_->busy();
    for (const auto& finished : timed_out_) stuck = stuck || !finished->load();
  }
  if (busy && !stuck && !broken_.load()) {
    const auto until = std::chrono::steady_clock::now() + kDrainWait;
    while (busy && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      std::lock_guard<std::mutex> lk(queue_mu_);
      busy = queue_->busy();
    }
  }
  if (busy) {
    stop_.store(true);
    mark(kGaveUp);
  }
  queue_.reset();
  mark(kLeft);
}

void ShmComm::set_rounds_for_test(std::uint64_t rounds) {
  DT_CHECK(InvalidArgument, rounds >= seq_, "set_rounds_for_test: ", rounds,
           " is below the rounds already run (", seq_, ")");
  seq_ = rounds;
  if (shm_ && !bases_.empty()) ctl(local_->rank()).prog.store(pack(rounds, 0));
}

void ShmComm::mark(std::uint64_t why) noexcept {
  if (why == kGaveUp) broken_.store(true);
  if (!shm_ || bases_.empty()) return;
  std::uint64_t none = 0;  // the first reason stays
  ctl(local_->rank()).failed.compare_exchange_strong(none, why, std::memory_order_release);
}

void ShmComm::wait_for(const std::atomic<std::uint64_t>& a, std::uint64_t target, std::uint64_t seq,
                       int peer, bool progress) {
  const auto ok = [&](std::uint64_t v) {
    return progress ? progress_reached(v, target) : reached(v, target);
  };
  Backoff wait;
  while (!ok(a.load(std::memory_order_acquire))) {
    wait();
    if (!wait.idle()) continue;  // (spinning: the peer is about to arrive)
    try {
      check_failures(seq, peer);
    } catch (const CommError&) {
      // What a peer published before it gave up is visible now: take it.
      if (ok(a.load(std::memory_order_acquire))) return;
      broken_ = true;
      throw;
    }
  }
}

void ShmComm::check_failures(std::uint64_t seq, int peer) {
  if (stop_.load(std::memory_order_relaxed)) {
    DT_THROW(CommError, "collective #", seq, " on ", name_, " on local rank ", local_->rank(),
             ": given up, the communicator is destroyed after a timeout or an error");
  }
  for (int q = 0; q < local_->size(); ++q) {
    const std::uint64_t f = ctl(q).failed.load(std::memory_order_acquire);
    if (f == 0 || q == local_->rank()) continue;
    // A rank that left after its last collective matters only to a wait for that rank itself
    // (peer; -1: for the ranks not arrived yet); one that gave up ends every wait.
    if (f == kLeft && (peer >= 0 ? q != peer : arrived_[static_cast<std::size_t>(q)] != 0))
      continue;
    DT_THROW(CommError, "collective #", seq, " on ", name_, " on local rank ", local_->rank(),
             ": local rank ", q,
             f == kLeft ? " has destroyed the communicator"
                        : " gave up (after an error or a timeout there)",
             "; this collective cannot complete");
  }
}

// --- helpers -----------------------------------------------------------------------------------

ShmComm::Control& ShmComm::ctl(int q) const noexcept {
  return *std::launder(reinterpret_cast<Control*>(seg(q)));
}

std::size_t ShmComm::staging_off() const noexcept { return kStagingOff; }

std::size_t ShmComm::region_off(const void* p, std::size_t bytes) const noexcept {
  const char* c = static_cast<const char*>(p);
  if (!arena_ || c < arena_ || c + bytes > arena_ + cfg_.arena_bytes) return SIZE_MAX;
  return static_cast<std::size_t>(c - seg(local_->rank()));
}

bool ShmComm::use_shm(std::size_t bytes) const noexcept { return bytes >= cfg_.min_bytes; }

bool ShmComm::small(std::size_t contribution) const noexcept {
  return nodes_ == 1 && contribution <= kSmallBytes &&
         contribution * static_cast<std::size_t>(local_->size()) <= kSmallTotal;
}

const char* ShmComm::path(const char* op, std::size_t bytes) const noexcept {
  if (!use_shm(bytes)) return "mpi";
  if (nodes_ == 1) {
    const bool scatter = std::strcmp(op, "reduce_scatter") == 0;
    const std::size_t L = static_cast<std::size_t>(local_->size());
    if (scatter && bytes > kSmallBytes) return "shm";  // (the product below could overflow)
    return small(scatter ? bytes * L : bytes) ? "shm-small" : "shm";
  }
  return std::strcmp(op, "all_reduce") == 0 && cross_ ? "hier" : "mpi";
}

void ShmComm::check_usable(const char* op) const {
  DT_CHECK(
      CommError, !broken_.load(), op, " on rank ", rank(), " of ", name_,
      ": the shared-memory communicator failed earlier (its ranks disagreed about a collective)");
}

std::string ShmComm::what(const char* op, ConstTensorView v, const char* extra) const {
  std::ostringstream s;
  s << op << "(" << dtype_name(v.dtype) << " x " << v.numel;
  if (extra) s << ", " << extra;
  s << ") on " << name_;
  return s.str();
}

void ShmComm::arrive(std::uint64_t seq, std::uint64_t off, std::uint64_t n, std::uint64_t kind,
                     std::uint64_t total) {
  Control& mine = ctl(local_->rank());
  mine.off.store(off, std::memory_order_relaxed);
  mine.n.store(n, std::memory_order_relaxed);
  mine.kind.store(kind, std::memory_order_relaxed);
  mine.total.store(total, std::memory_order_relaxed);
  mine.arrive.store(seq, std::memory_order_release);
  arrive_all(seq, [&](int q) {
    Control& c = ctl(q);
    const std::uint64_t qo = c.off.load(std::memory_order_relaxed);
    const std::uint64_t qn = c.n.load(std::memory_order_relaxed);
    const std::uint64_t qk = c.kind.load(std::memory_order_relaxed);
    const std::uint64_t qt = c.total.load(std::memory_order_relaxed);
    if (qo != kSmallMark && qk != kind) {  // another collective, dtype or op
      broken_ = true;
      DT_THROW(CommError, "collective #", seq, " on ", name_, ": local rank ", local_->rank(),
               " called ", small_call(kind, n), ", local rank ", q, " called ", small_call(qk, qn),
               " (all ranks must call the same collectives with the same ",
               "dtype, operation and sizes)");
    }
    if (qo != kSmallMark && qt != total) {  // calls of other sizes, cut into pieces
      broken_ = true;
      DT_THROW(CommError, "collective #", seq, " on ", name_, ": local rank ", local_->rank(),
               " called ", small_call(kind, total), ", local rank ", q, " called ",
               small_call(qk, qt), " (all ranks must call the same collectives with the same ",
               "sizes)");
    }
    if (qo != off || qn != n) {
      broken_ = true;
      DT_THROW(CommError, "collective #", seq, " on ", name_, ": local rank ", local_->rank(),
               " passed ", n, " elements at segment offset ", off, ", local rank ", q, " passed ",
               qn, qo == kSmallMark ? " on the small-message path" : " at " + std::to_string(qo),
               " (all ranks must call the same collectives with the same sizes, ",
               "with buffers either all in the arena at the same offset or all outside it)");
    }
  });
}

template <class Check>
void ShmComm::arrive_all(std::uint64_t seq, Check&& check) {
  // Peers are checked as they arrive, in any order: a mismatch with one that is there is reported
  // even while another is late (or has given up on it already).
  const int L = local_->size();
  arrived_.assign(static_cast<std::size_t>(L), 0);
  int left = L;
  auto scan = [&] {
    bool seen = false;
    for (int q = 0; q < L; ++q) {
      if (arrived_[static_cast<std::size_t>(q)] ||
          !reached(ctl(q).arrive.load(std::memory_order_acquire), seq))
        continue;
      check(q);
      arrived_[static_cast<std::size_t>(q)] = 1;
      --left;
      seen = true;
    }
    return seen;
  };
  Backoff wait;
  while (true) {
    const bool seen = scan();
    if (left == 0) return;
    if (seen) {
      wait.reset();
      continue;
    }
    wait();
    if (!wait.idle()) continue;
    try {
      check_failures(seq, -1);
    } catch (const CommError&) {
      // Whatever the peers published before one gave up is visible now: a peer still missing
      // (or a mismatch, which check reports) decides.
      scan();
      if (left == 0) return;
      broken_ = true;
      throw;
    }
  }
}

void ShmComm::depart(std::uint64_t seq) {
  ctl(local_->rank()).done.store(seq, std::memory_order_release);
  for (int q = 0; q < local_->size(); ++q) wait_for(ctl(q).done, seq, seq, q);
}

char* ShmComm::small_slot(int q, std::uint64_t seq) const noexcept {
  return seg(q) + kCtlBytes + (seq & 1) * kSlotStride + kSlotHead;
}

void ShmComm::arrive_small(std::uint64_t seq, std::uint64_t kind, std::uint64_t n) {
  const int me = local_->rank();
  auto* head = reinterpret_cast<SlotHead*>(small_slot(me, seq) - kSlotHead);
  *head = SlotHead{seq, kind, n};
  Control& mine = ctl(me);
  mine.off.store(kSmallMark, std::memory_order_relaxed);
  mine.n.store(n, std::memory_order_relaxed);
  mine.arrive.store(seq, std::memory_order_release);
  arrive_all(seq, [&](int q) {
    const auto* h = reinterpret_cast<const SlotHead*>(small_slot(q, seq) - kSlotHead);
    if (h->seq == seq && h->kind == kind && h->n == n) return;
    broken_ = true;
    DT_THROW(CommError, "collective #", seq, " on ", name_, ": local rank ", me, " called ",
             small_call(kind, n), ", local rank ", q, " ",
             h->seq == seq ? "called " + small_call(h->kind, h->n)
                           : std::string("called a collective of another size or kind"),
             " (all ranks must call the same collectives with the same sizes)");
  });
}

// --- all_reduce ----------------------------------------------------------------------------------

void ShmComm::reduce_region(std::size_t off, std::size_t n, DType t, ReduceOp op, void* dest,
                            const Form& dl, std::size_t total) {
  const std::uint64_t seq = ++seq_;
  arrive(seq, off, n, small_kind(kAllReduce, t, static_cast<std::uint64_t>(op)), total);
  const int L = local_->size(), me = local_->rank();
  const std::size_t es = dtype_size(t);
  const std::size_t K = std::max<std::size_t>(1, cfg_.chunk_bytes / es);
  auto lo = [&](int q) { return n * static_cast<std::size_t>(q) / static_cast<std::size_t>(L); };
  const bool hier = cross_ != nullptr;
  const ReduceOp local_op = op == ReduceOp::avg ? ReduceOp::sum : op;
  const int divisor = op == ReduceOp::avg && !hier ? L : 1;
  std::vector<const void*>& ins = ins_;

  // All-gather state: per local rank, the next element of its slice to copy out to `dest`.
  char* d = static_cast<char*>(dest);
  const bool own_in_place = d == seg(me) + off;
  std::vector<std::size_t> next(static_cast<std::size_t>(L));
  std::size_t mine_final = lo(me);  // this rank's slice is final below this element
  for (int q = 0; q < L; ++q) next[static_cast<std::size_t>(q)] = lo(q);
  // Copies rank q's published chunks; with `block`, waits for all of them.
  auto copy_out = [&](int q, bool block) {
    if (q == me && own_in_place) return;
    const std::size_t qlo = lo(q), qhi = lo(q + 1);
    std::size_t& b = next[static_cast<std::size_t>(q)];
    while (b < qhi) {
      const std::uint64_t want = pack(seq, (b - qlo) / K + 1);
      if (q == me) {
        if (b >= mine_final) return;  // not reduced (or, across nodes, not final) yet
      } else {
        if (!block && !progress_reached(ctl(q).prog.load(std::memory_order_acquire), want)) return;
        wait_for(ctl(q).prog, want, seq, q, true);
      }
      const std::size_t cnt = std::min(K, qhi - b);
      copy_bytes(d + b * es, seg(q) + off + b * es, cnt * es);
      b += cnt;
    }
  };

  // Reduce-scatter: this rank's slice from every peer, in rank order, in place. On one node the
  // all-gather is interleaved with it: after each chunk, whatever the peers have published is
  // copied out while it is still in cache.
  const std::size_t mlo = lo(me), mhi = lo(me + 1);
  std::uint64_t chunks = 0;
  for (std::size_t b = mlo; b < mhi; b += K, ++chunks) {
    const std::size_t cnt = std::min(K, mhi - b);
    for (int q = 0; q < L; ++q) ins[static_cast<std::size_t>(q)] = seg(q) + off + b * es;
    reduce_elements(t, local_op, seg(me) + off + b * es, ins.data(), L, cnt, divisor);
    if (!hier) {
      ctl(me).prog.store(pack(seq, chunks + 1), std::memory_order_release);
      mine_final = b + cnt;
      for (int k = 0; k < L; ++k) copy_out((me + k) % L, false);
    }
  }
  if (hier) {
    TensorView slice{seg(me) + off + mlo * es, mhi - mlo, t};
    const ReduceOp xop = op == ReduceOp::avg ? ReduceOp::sum : op;
    if (!dl.nonblocking)
      cross_->all_reduce(slice, xop);
    else
      dl.wait(cross_->iall_reduce(slice, xop));
    if (op == ReduceOp::avg) {
      const void* self = slice.data;
      reduce_elements(t, ReduceOp::sum, slice.data, &self, 1, slice.numel, size());
    }
    ctl(me).prog.store(pack(seq, chunks), std::memory_order_release);
    mine_final = mhi;
  }
  // The rest of the all-gather: every chunk, as soon as its owner publishes it.
  for (int k = 0; k < L; ++k) copy_out((me + k) % L, true);
  depart(seq);
}

void ShmComm::do_all_reduce(TensorView buf, ReduceOp op, const Form& dl) {
  check_usable("all_reduce");
  const std::size_t bytes = buf.nbytes();
  const char* how = path("all_reduce", bytes);
  const watchdog::OpRecord rec(name_, ++calls_, "all_reduce", how, buf.dtype, buf.numel);
  if (std::strcmp(how, "mpi") == 0) {
    if (!dl.nonblocking)
      mpi_->all_reduce(buf, op);
    else
      dl.wait(mpi_->iall_reduce(buf, op));
    return;
  }
  if (std::strcmp(how, "shm-small") == 0) {
    const std::uint64_t seq = ++seq_;
    const int L = local_->size();
    copy_bytes(small_slot(local_->rank(), seq), buf.data, bytes);
    arrive_small(seq, small_kind(kAllReduce, buf.dtype, static_cast<std::uint64_t>(op)), buf.numel);
    for (int q = 0; q < L; ++q) ins_[static_cast<std::size_t>(q)] = small_slot(q, seq);
    reduce_elements(buf.dtype, op, buf.data, ins_.data(), L, buf.numel,
                    op == ReduceOp::avg ? L : 1);
    return;
  }
  const std::size_t off = region_off(buf.data, bytes);
  if (off != SIZE_MAX) return reduce_region(off, buf.numel, buf.dtype, op, buf.data, dl, buf.numel);
  const std::size_t es = dtype_size(buf.dtype);
  const std::size_t piece = std::max<std::size_t>(1, cfg_.staging_bytes / es);
  DT_ASSERT(cfg_.staging_bytes >= es, "staging area smaller than one element");
  char* p = static_cast<char*>(buf.data);
  std::size_t b = 0;
  do {  // at least once, so zero-element calls still meet their peers
    const std::size_t cnt = std::min(piece, buf.numel - b);
    copy_bytes(seg(local_->rank()) + staging_off(), p + b * es, cnt * es);
    reduce_region(staging_off(), cnt, buf.dtype, op, p + b * es, dl, buf.numel);
    b += cnt;
  } while (b < buf.numel);
}

// --- argument checks (before any traffic, also for the queued forms) ---------------------------

void ShmComm::check_root(int root) const {
  DT_CHECK(InvalidArgument, root >= 0 && root < size(), "broadcast on ", name_, ": root ", root,
           " is not a rank of a communicator of ", size());
}

void ShmComm::check_gather(ConstTensorView in, ConstTensorView out) const {
  DT_CHECK(InvalidArgument, in.dtype == out.dtype, "all_gather on ", name_, ": input ",
           dtype_name(in.dtype), " and output ", dtype_name(out.dtype), " differ");
  DT_CHECK(InvalidArgument, out.numel == in.numel * static_cast<std::size_t>(size()),
           "all_gather on ", name_, ": output has ", out.numel, " elements, needs ", size(), " x ",
           in.numel);
}

void ShmComm::check_scatter(ConstTensorView in, ConstTensorView out) const {
  DT_CHECK(InvalidArgument, in.dtype == out.dtype, "reduce_scatter on ", name_, ": input ",
           dtype_name(in.dtype), " and output ", dtype_name(out.dtype), " differ");
  DT_CHECK(InvalidArgument, in.numel == out.numel * static_cast<std::size_t>(size()),
           "reduce_scatter on ", name_, ": input has ", in.numel, " elements, needs ", size(),
           " x ", out.numel);
}

// --- broadcast, all_gather, reduce_scatter (one node)
// ----------------------------------------------

void ShmComm::do_broadcast(TensorView buf, int root, const Form& dl) {
  check_usable("broadcast");
  check_root(root);
  const char* how = path("broadcast", buf.nbytes());
  const watchdog::OpRecord rec(name_, ++calls_, "broadcast", how, buf.dtype, buf.numel);
  if (std::strcmp(how, "mpi") == 0) {
    if (!dl.nonblocking)
      mpi_->broadcast(buf, root);
    else
      dl.wait(mpi_->ibroadcast(buf, root));
    return;
  }
  // One node: local rank == rank.
  const int me = local_->rank();
  if (std::strcmp(how, "shm-small") == 0) {
    const std::uint64_t seq = ++seq_;
    if (me == root) copy_bytes(small_slot(me, seq), buf.data, buf.nbytes());
    arrive_small(seq, small_kind(kBroadcast, buf.dtype, static_cast<std::uint64_t>(root)),
                 buf.numel);
    if (me != root) copy_bytes(buf.data, small_slot(root, seq), buf.nbytes());
    return;
  }
  const std::size_t es = dtype_size(buf.dtype);
  const std::size_t piece = std::max<std::size_t>(1, cfg_.staging_bytes / es);
  char* p = static_cast<char*>(buf.data);
  std::size_t b = 0;
  do {
    const std::size_t cnt = std::min(piece, buf.numel - b);
    const std::uint64_t seq = ++seq_;
    if (me == root) copy_bytes(seg(me) + staging_off(), p + b * es, cnt * es);
    arrive(seq, staging_off(), cnt,
           small_kind(kBroadcast, buf.dtype, static_cast<std::uint64_t>(root)), buf.numel);
    if (me != root) copy_bytes(p + b * es, seg(root) + staging_off(), cnt * es);
    depart(seq);
    b += cnt;
  } while (b < buf.numel);
}

void ShmComm::do_all_gather(ConstTensorView in, TensorView out, const Form& dl) {
  check_usable("all_gather");
  check_gather(in, out);
  const char* how = path("all_gather", in.nbytes());
  const watchdog::OpRecord rec(name_, ++calls_, "all_gather", how, in.dtype, in.numel);
  if (std::strcmp(how, "mpi") == 0) {
    if (!dl.nonblocking)
      mpi_->all_gather(in, out);
    else
      dl.wait(mpi_->iall_gather(in, out));
    return;
  }
  const std::size_t es = dtype_size(in.dtype), m = in.numel;
  const char* src = static_cast<const char*>(in.data);
  char* o = static_cast<char*>(out.data);
  const int L = local_->size(), me = local_->rank();
  if (std::strcmp(how, "shm-small") == 0) {
    const std::uint64_t seq = ++seq_;
    copy_bytes(small_slot(me, seq), src, m * es);
    arrive_small(seq, small_kind(kAllGather, in.dtype, 0), m);
    for (int q = 0; q < L; ++q)
      copy_bytes(o + static_cast<std::size_t>(q) * m * es, small_slot(q, seq), m * es);
    return;
  }
  const std::size_t piece = std::max<std::size_t>(1, cfg_.staging_bytes / es);
  std::size_t b = 0;
  do {
    const std::size_t cnt = std::min(piece, m - b);
    const std::uint64_t seq = ++seq_;
    copy_bytes(seg(me) + staging_off(), src + b * es, cnt * es);
    arrive(seq, staging_off(), cnt, small_kind(kAllGather, in.dtype, 0), m);
    for (int q = 0; q < L; ++q)
      copy_bytes(o + (static_cast<std::size_t>(q) * m + b) * es, seg(q) + staging_off(), cnt * es);
    depart(seq);
    b += cnt;
  } while (b < m);
}

void ShmComm::do_reduce_scatter(ConstTensorView in, TensorView out, ReduceOp op, const Form& dl) {
  check_usable("reduce_scatter");
  check_scatter(in, out);
  const char* how = path("reduce_scatter", out.nbytes());
  const watchdog::OpRecord rec(name_, ++calls_, "reduce_scatter", how, in.dtype, in.numel);
  const std::size_t es = dtype_size(in.dtype), m = out.numel;
  const int L = local_->size(), me = local_->rank();
  const std::size_t piece = cfg_.staging_bytes / (es * static_cast<std::size_t>(L));  // >= 1
  if (std::strcmp(how, "mpi") == 0) {
    if (!dl.nonblocking)
      mpi_->reduce_scatter(in, out, op);
    else
      dl.wait(mpi_->ireduce_scatter(in, out, op));
    return;
  }
  const char* src = static_cast<const char*>(in.data);
  char* o = static_cast<char*>(out.data);
  std::vector<const void*>& ins = ins_;
  if (std::strcmp(how, "shm-small") == 0) {
    const std::uint64_t seq = ++seq_;
    copy_bytes(small_slot(me, seq), src, in.nbytes());
    arrive_small(seq, small_kind(kReduceScatter, in.dtype, static_cast<std::uint64_t>(op)), m);
    for (int q = 0; q < L; ++q)
      ins[static_cast<std::size_t>(q)] = small_slot(q, seq) + static_cast<std::size_t>(me) * m * es;
    reduce_elements(in.dtype, op, o, ins.data(), L, m, op == ReduceOp::avg ? L : 1);
    return;
  }
  char* stage = seg(me) + staging_off();
  std::size_t b = 0;
  do {
    const std::size_t cnt = std::min(piece, m - b);
    const std::uint64_t seq = ++seq_;
    for (int q = 0; q < L; ++q)  // block q's piece at q * cnt
      copy_bytes(stage + static_cast<std::size_t>(q) * cnt * es,
                 src + (static_cast<std::size_t>(q) * m + b) * es, cnt * es);
    arrive(seq, staging_off(), cnt,
           small_kind(kReduceScatter, in.dtype, static_cast<std::uint64_t>(op)), m);
    for (int q = 0; q < L; ++q)
      ins[static_cast<std::size_t>(q)] =
          seg(q) + staging_off() + static_cast<std::size_t>(me) * cnt * es;
    reduce_elements(in.dtype, op, o + b * es, ins.data(), L, cnt, op == ReduceOp::avg ? L : 1);
    depart(seq);
    b += cnt;
  } while (b < m);
}

// --- call forms --------------------------------------------------------------------------------

ProgressQueue& ShmComm::queue() {
  std::lock_guard<std::mutex> lk(queue_mu_);
  if (!queue_) queue_ = std::make_unique<ProgressQueue>(rank(), name_);
  return *queue_;
}

template <class F>
void ShmComm::run_round(F&& f) {
  const std::uint64_t before = seq_;
  try {
    f();
  } catch (...) {
    // Left in the middle of a round (a bad argument is refused before one starts): the peers
    // waiting for this rank's part fail instead of waiting forever.
    if (seq_ != before) mark(kGaveUp);
    throw;
  }
}

Work ShmComm::queued(std::string what, std::function<void()> f) {
  return queue().submit(std::move(what), [this, f = std::move(f)] {
    std::lock_guard<std::mutex> lk(run_mu_);
    run_round(f);
  });
}

template <class F>
void ShmComm::run_blocking(std::string what_op, const CommOptions& opts, F&& f) {
  bool pending = false;
  {
    std::lock_guard<std::mutex> lk(queue_mu_);
    pending = queue_ && queue_->busy();
  }
  // Behind queued operations (to keep call order), or with a timeout: run on the progress thread
  // and wait for it here, so that after a timeout the operation stays pending and completes when
  // the peers arrive, as MPI's do (comm.hpp). The MPI call family follows the options (a timeout:
  // the non-blocking one). kPolledWait sets no limit to keep: it runs here, waiting by polling.
  if (pending || (opts.timeout != kNoTimeout && opts.timeout != kPolledWait)) {
    // Set when the operation has run (or failed): one that timed out and has not may never.
    auto finished = std::make_shared<std::atomic<bool>>(false);
    Work w = queued(std::move(what_op), [opts, f, finished] {
      struct Done {
        std::atomic<bool>& flag;
        ~Done() { flag.store(true); }
      } done{*finished};
      f(Form::from(opts));
    });
    try {
      w.wait(opts.timeout);
    } catch (const CommError&) {
      bool over = true;  // finished (with the error just thrown), or still pending
      try {
        over = w.test();
      } catch (...) {
      }
      if (!over) {
        std::lock_guard<std::mutex> lk(queue_mu_);
        // (Those that have run since are let go: the list holds at most the ones pending.)
        timed_out_.erase(std::remove_if(timed_out_.begin(), timed_out_.end(),
                                        [](const auto& ran) { return ran->load(); }),
                         timed_out_.end());
        timed_out_.push_back(std::move(finished));
      }
      throw;
    }
    return;
  }
  std::lock_guard<std::mutex> lk(run_mu_);
  run_round([&] { f(Form::from(opts)); });
}

Work ShmComm::iall_reduce(TensorView buf, ReduceOp op) {
  return queued(what("all_reduce", buf, reduce_op_name(op)),
                [=] { do_all_reduce(buf, op, Form::queued()); });
}
Work ShmComm::ibroadcast(TensorView buf, int root) {
  check_root(root);
  return queued(what("broadcast", buf), [=] { do_broadcast(buf, root, Form::queued()); });
}
Work ShmComm::iall_gather(ConstTensorView in, TensorView out) {
  check_gather(in, out);
  return queued(what("all_gather", in), [=] { do_all_gather(in, out, Form::queued()); });
}
Work ShmComm::ireduce_scatter(ConstTensorView in, TensorView out, ReduceOp op) {
  check_scatter(in, out);
  return queued(what("reduce_scatter", in, reduce_op_name(op)),
                [=] { do_reduce_scatter(in, out, op, Form::queued()); });
}
Work ShmComm::isend(ConstTensorView buf, int dst, int tag) { return mpi_->isend(buf, dst, tag); }
Work ShmComm::irecv(TensorView buf, int src, int tag) { return mpi_->irecv(buf, src, tag); }
Work ShmComm::ibarrier() {
  return queued("barrier on " + name_, [this] {
    check_usable("barrier");  // (queued before a failure, or before destruction gave up)
    Form::queued().wait(mpi_->ibarrier());
  });
}

void ShmComm::all_reduce(TensorView buf, ReduceOp op, const CommOptions& opts) {
  run_blocking(what("all_reduce", buf, reduce_op_name(op)), opts,
               [=](const Form& d) { do_all_reduce(buf, op, d); });
}
void ShmComm::broadcast(TensorView buf, int root, const CommOptions& opts) {
  run_blocking(what("broadcast", buf), opts, [=](const Form& d) { do_broadcast(buf, root, d); });
}
void ShmComm::all_gather(ConstTensorView in, TensorView out, const CommOptions& opts) {
  run_blocking(what("all_gather", in), opts, [=](const Form& d) { do_all_gather(in, out, d); });
}
void ShmComm::reduce_scatter(ConstTensorView in, TensorView out, ReduceOp op,
                             const CommOptions& opts) {
  run_blocking(what("reduce_scatter", in, reduce_op_name(op)), opts,
               [=](const Form& d) { do_reduce_scatter(in, out, op, d); });
}
void ShmComm::send(ConstTensorView buf, int dst, int tag, const CommOptions& opts) {
  mpi_->send(buf, dst, tag, opts);
}
void ShmComm::recv(TensorView buf, int src, int tag, const CommOptions& opts) {
  mpi_->recv(buf, src, tag, opts);
}
void ShmComm::barrier(const CommOptions& opts) {
  run_blocking("barrier on " + name_, opts, [=](const Form& d) {
    check_usable("barrier");  // the ranks that failed may never come to it
    if (!d.nonblocking)
      mpi_->barrier();
    else
      d.wait(mpi_->ibarrier());
  });
}

std::unique_ptr<Comm> ShmComm::split(int color, int key) { return mpi_->split(color, key); }

}  // namespace dt
