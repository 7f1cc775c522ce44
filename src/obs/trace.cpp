#include "dt/trace.hpp"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "dt/config.hpp"
#include "dt/error.hpp"
#include "dt/metrics.hpp"
#include "open_scopes.hpp"

namespace dt::trace {

namespace detail {
std::atomic<bool> g_enabled{false};

std::int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace detail

namespace {

struct Event {
  const char* name;
  const char* category;
  const char* arg_name;
  std::int64_t arg;
  std::int64_t t0, t1;  // steady clock, ns
  // A communication operation's (record_comm; comm null otherwise).
  const char* comm = nullptr;
  const char* backend = nullptr;
  std::int64_t bytes = 0;
};

// One thread's events: written by that thread only, without a lock, in chunks that never move;
// `count` is published with release order after the event is written, so a reader that loads it
// with acquire order may read that many events while the thread goes on appending.
// The first chunks are small and double (64, 128, ... 2048 events), then each holds kChunk: a
// thread that records a few events (a checkpoint save's, one a save) takes a few KiB, not a whole
// chunk's 288 KiB, which a run of thousands of saves would keep.
constexpr std::size_t kFirstChunk = 64, kGrowing = 6, kChunk = kFirstChunk << kGrowing;
constexpr std::size_t kInGrowing = kChunk - kFirstChunk;  // events in the growing chunks
constexpr std::size_t kChunks =
    kGrowing +
    (kMaxEventsPerThread - std::min(kMaxEventsPerThread, kInGrowing) + kChunk - 1) / kChunk;
struct Slot {
  std::size_t chunk, offset, size;  // event i: chunks[chunk][offset], a chunk of `size` events
};
constexpr Slot slot_of(std::size_t i) {
  if (i >= kInGrowing)
    return {kGrowing + (i - kInGrowing) / kChunk, (i - kInGrowing) % kChunk, kChunk};
  std::size_t k = 0, start = 0;
  while (i >= start + (kFirstChunk << k)) start += kFirstChunk << k++;
  return {k, i - start, kFirstChunk << k};
}
static_assert(slot_of(0).chunk == 0 && slot_of(63).chunk == 0 && slot_of(64).chunk == 1 &&
              slot_of(kInGrowing - 1).chunk == kGrowing - 1 &&
              slot_of(kInGrowing).chunk == kGrowing && slot_of(kInGrowing).offset == 0 &&
              slot_of(kMaxEventsPerThread - 1).chunk < kChunks);

struct ThreadBuf {
  OpenScopes open;
  std::atomic<std::size_t> count{0};
  std::atomic<std::size_t> dropped{0};
  std::atomic<Event*> chunks[kChunks] = {};
  long tid = 0;
  std::mutex name_mu;
  std::string name;
  ThreadBuf() = default;
  ThreadBuf(const ThreadBuf&) = delete;
  ThreadBuf& operator=(const ThreadBuf&) = delete;
  ~ThreadBuf() {
    for (auto& c : chunks) delete[] c.load(std::memory_order_relaxed);
  }
  void append(const Event& e) {
    const std::size_t i = count.load(std::memory_order_relaxed);
    if (i >= kMaxEventsPerThread) {
      dropped.store(dropped.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      return;
    }
    const Slot at = slot_of(i);
    Event* chunk = chunks[at.chunk].load(std::memory_order_relaxed);
    if (!chunk) {
      chunk = new Event[at.size];
      chunks[at.chunk].store(chunk, std::memory_order_release);
    }
    chunk[at.offset] = e;
    count.store(i + 1, std::memory_order_release);
  }
  /// The events published so far (safe while the owner appends).
  void copy_to(std::vector<Event>& out) const {
    const std::size_t n = count.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < n; ++i) {
      const Slot at = slot_of(i);
      out.push_back(chunks[at.chunk].load(std::memory_order_acquire)[at.offset]);
    }
  }
  std::string get_name() {
    std::lock_guard<std::mutex> lock(name_mu);
    return name;
  }
};

struct State {
  std::mutex mu;
  std::vector<std::shared_ptr<ThreadBuf>> bufs;
  bool started = false;
  int rank = 0, world = 0;
  std::string dir, run;
  std::int64_t wall_minus_steady_ns = 0;
  std::atomic<std::uint64_t> generation{0};
};

State& state() {
  static State* s = new State();  // never destroyed: threads may record during exit
  return *s;
}

// The fast path reads only trivially constructed thread-locals (no TLS init guard); tl_hold keeps
// the buffer alive for this thread even after a new start() dropped it from State::bufs.
thread_local ThreadBuf* tl_buf = nullptr;
thread_local std::uint64_t tl_generation = 0;
thread_local std::shared_ptr<ThreadBuf> tl_hold;
thread_local std::string tl_name;

long os_tid() noexcept { return static_cast<long>(::syscall(SYS_gettid)); }

ThreadBuf* my_buffer() {
  State& s = state();
  const std::uint64_t gen = s.generation.load(std::memory_order_acquire);
  if (tl_buf && tl_generation == gen) return tl_buf;
  auto b = std::make_shared<ThreadBuf>();
  b->tid = os_tid();
  b->name = tl_name.empty() ? "thread " + std::to_string(b->tid) : tl_name;
  std::lock_guard<std::mutex> lock(s.mu);
  tl_generation = s.generation.load(std::memory_order_relaxed);
  s.bufs.push_back(b);
  tl_hold = std::move(b);
  tl_buf = tl_hold.get();
  return tl_buf;
}

void json_string(std::string& out, const char* s) {
  out += '"';
  for (const char* p = s ? s : ""; *p; ++p) {
    const unsigned char c = static_cast<unsigned char>(*p);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      out += b;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
}

// ns as microseconds with three decimals, exactly (no double rounding).
void micros(std::string& out, std::int64_t ns) {
  if (ns < 0) {
    out += '-';
    ns = -ns;
  }
  char b[32];
  std::snprintf(b, sizeof b, "%lld.%03lld", static_cast<long long>(ns / 1000),
                static_cast<long long>(ns % 1000));
  out += b;
}

}  // namespace

namespace detail {
void record(const char* name, const char* category, const char* arg_name, std::int64_t arg,
            std::int64_t t0_ns, std::int64_t t1_ns) noexcept {
  if (!enabled()) return;
  try {
    my_buffer()->append(Event{name, category, arg_name, arg, t0_ns, t1_ns});
  } catch (...) {
    // Out of memory: the event is lost, the job goes on.
  }
}
void record_comm(const char* op, const char* comm, const char* backend, std::int64_t seq,
                 std::int64_t bytes, std::int64_t t0_ns, std::int64_t t1_ns,
                 const char* category) noexcept {
  if (!enabled()) return;
  try {
    my_buffer()->append(Event{op, category, "seq", seq, t0_ns, t1_ns, comm, backend, bytes});
  } catch (...) {
    // Out of memory: the event is lost, the job goes on.
  }
}

std::int64_t open_scope(const char* name, const char* category, const char* arg_name,
                        std::int64_t arg) noexcept {
  if (!enabled()) return -1;
  const std::int64_t t0 = now_ns();
  try {
    my_buffer()->open.push(name, category, arg_name, arg, t0);
  } catch (...) {
    // Out of memory (a first event of this thread): recorded when it closes, if memory allows.
  }
  return t0;
}
void close_scope(const char* name, const char* category, const char* arg_name, std::int64_t arg,
                 std::int64_t t0_ns) noexcept {
  const std::int64_t t1 = now_ns();
  // The buffer the Scope opened in (a start() since then made a new one, whose stack it is not on).
  if (tl_buf && tl_generation == state().generation.load(std::memory_order_acquire))
    tl_buf->open.pop();
  record(name, category, arg_name, arg, t0_ns, t1);
}

const char* intern(const std::string& s) {
  static std::mutex mu;
  static auto* names = new std::set<std::string>();  // never destroyed: events point into it
  std::lock_guard<std::mutex> lock(mu);
  return names->insert(s).first->c_str();
}
}  // namespace detail

void start(int rank, const std::string& dir, int world, const std::string& run) {
  State& s = state();
  DT_CHECK(Error, !enabled(), "tracing is already on (rank ", s.rank, ", ", s.dir, ")");
  DT_CHECK(ConfigError, !dir.empty(), "option --trace.dir: an empty directory turns tracing off");
  ensure_writable_dir("--trace.dir", dir);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.bufs.clear();
    s.started = true;
    s.rank = rank;
    s.world = world;
    s.dir = dir;
    s.run = run;
    const auto wall = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
    s.wall_minus_steady_ns = wall - detail::now_ns();
    s.generation.fetch_add(1, std::memory_order_release);
  }
  if (tl_name.empty()) set_thread_name("main");
  detail::g_enabled.store(true, std::memory_order_release);
}

void stop() noexcept { detail::g_enabled.store(false, std::memory_order_release); }

void set_thread_name(const char* name) noexcept {
  try {
    tl_name = name ? name : "";
    if (tl_buf && tl_generation == state().generation.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> lock(tl_buf->name_mu);
      tl_buf->name = tl_name;
    }
  } catch (...) {
  }
}

std::size_t event_count() noexcept {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  std::size_t n = 0;
  for (const auto& b : s.bufs) n += b->count.load(std::memory_order_acquire);
  return n;
}

std::size_t dropped_count() noexcept {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  std::size_t n = 0;
  for (const auto& b : s.bufs) n += b->dropped.load(std::memory_order_relaxed);
  return n;
}

std::string write(bool open_scopes) {
  State& s = state();
  struct Thread {
    long tid;
    std::string name;
  };
  std::vector<Event> events;
  std::vector<std::size_t> owner;  // index into threads, per event
  std::vector<Thread> threads;
  std::size_t dropped = 0;
  int rank, world;
  std::string dir, run;
  std::int64_t offset;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.started) return "";
    rank = s.rank;
    world = s.world;
    dir = s.dir;
    run = s.run;
    offset = s.wall_minus_steady_ns;
    for (const auto& b : s.bufs) {
      threads.push_back(Thread{b->tid, b->get_name()});
      b->copy_to(events);
      if (open_scopes) {
        const std::vector<OpenScopes::Open> open = b->open.snapshot();
        const std::int64_t end = detail::now_ns();  // after the snapshot: no Scope opened later
        for (const OpenScopes::Open& o : open)
          events.push_back(
              Event{o.name, detail::intern(std::string(o.category ? o.category : "") + " (open)"),
                    o.arg_name, o.arg, o.t0, end});
      }
      owner.resize(events.size(), threads.size() - 1);
      dropped += b->dropped.load(std::memory_order_relaxed);
    }
  }
  // Start order, parents before their children (longer first at equal starts).
  std::vector<std::size_t> order(events.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    if (events[a].t0 != events[b].t0) return events[a].t0 < events[b].t0;
    return events[a].t1 > events[b].t1;
  });

  std::string out;
  out.reserve(160 * (events.size() + threads.size()) + 512);
  const std::string pid = std::to_string(rank);
  out += "{\"traceEvents\":[\n";
  out += "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + pid +
         ",\"tid\":0,\"args\":{\"name\":\"rank " + pid + "\"}},\n";
  out += "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" + pid +
         ",\"tid\":0,\"args\":{\"sort_index\":" + pid + "}}";
  std::set<long> named;
  for (const auto& t : threads) {
    if (!named.insert(t.tid).second) continue;
    out += ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + pid +
           ",\"tid\":" + std::to_string(t.tid) + ",\"args\":{\"name\":";
    json_string(out, t.name.c_str());
    out += "}}";
  }
  for (std::size_t i : order) {
    const Event& e = events[i];
    out += ",\n{\"name\":";
    json_string(out, e.name);
    out += ",\"cat\":";
    json_string(out, e.category);
    out += ",\"ph\":\"X\",\"ts\":";
    micros(out, e.t0 + offset);
    out += ",\"dur\":";
    micros(out, e.t1 - e.t0);
    out += ",\"pid\":" + pid + ",\"tid\":" + std::to_string(threads[owner[i]].tid);
    if (e.arg_name) {
      out += ",\"args\":{";
      json_string(out, e.arg_name);
      out += ":" + std::to_string(e.arg);
      if (e.comm) {
        out += ",\"comm\":";
        json_string(out, e.comm);
        out += ",\"backend\":";
        json_string(out, e.backend ? e.backend : "");
        out += ",\"bytes\":" + std::to_string(e.bytes);
      }
      out += "}";
    }
    out += '}';
  }
  out += "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"rank\":" + pid +
         ",\"events\":" + std::to_string(events.size()) +
         ",\"dropped\":" + std::to_string(dropped) + ",\"clock\":\"wall\"";
  if (world > 0) out += ",\"world\":" + std::to_string(world);
  if (!run.empty()) {
    out += ",\"run\":";
    json_string(out, run.c_str());
  }
  out += "}}\n";
  const std::string path = dir + "/trace-rank" + pid + ".json";
  metrics::write_file_atomically(path, out);
  return path;
}

void write_noexcept(bool open_scopes) noexcept {
  try {
    write(open_scopes);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dt: warning: trace not written: %s\n", e.what());
  }
}

}  // namespace dt::trace
