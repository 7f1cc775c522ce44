// dt::trace: a Chrome trace-event timeline of one rank (viewable in Perfetto or chrome://tracing).
//
// Code marks a region with an RAII Scope:
//
//   { const dt::trace::Scope s("all_reduce", "comm", "bytes", n); ... }
//
// While tracing is off a Scope costs one relaxed atomic load in its constructor and a branch in
// its destructor. While it is on, a Scope reads the clock twice, is kept on its thread's stack
// of open Scopes while it lasts (a few relaxed stores; a timeline written at a hang shows them),
// and appends one event (72 bytes) to a buffer owned by the calling thread (no lock; no
// allocation except when the buffer grows). Each thread keeps at most kMaxEventsPerThread events;
// later ones are counted as dropped (the count is written into the file).
//
// write() produces <dir>/trace-rank<R>.json: "X" (complete) events with ts and dur in
// microseconds (ts on the wall clock, so the files of several ranks and nodes line up), pid = the
// rank, tid = the OS thread id, plus process_name / thread_name metadata. It can be called at
// any time (on a drain, at the end) and rewrites the file atomically with everything recorded
// so far. `dt_trace merge` joins the files of all ranks into one.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace dt::trace {

inline constexpr std::size_t kMaxEventsPerThread = std::size_t{1} << 20;

namespace detail {
extern std::atomic<bool> g_enabled;
std::int64_t now_ns() noexcept;
void record(const char* name, const char* category, const char* arg_name, std::int64_t arg,
            std::int64_t t0_ns, std::int64_t t1_ns) noexcept;
/// A communication operation `op` (category "comm"): its communicator (the name the flight
/// recorder and the watchdog's dump give it), its sequence number there, its backend and bytes.
/// `comm` and `backend` must outlive the trace (intern() makes a name that does). The watchdog
/// records the operations still in flight at a hang as category "comm (unfinished)", ending when
/// it wrote the timeline.
void record_comm(const char* op, const char* comm, const char* backend, std::int64_t seq,
                 std::int64_t bytes, std::int64_t t0_ns, std::int64_t t1_ns,
                 const char* category = "comm") noexcept;
/// A Scope's start (-1 while tracing is off), on the calling thread's stack of open Scopes, and
/// its end: taken off that stack and recorded.
std::int64_t open_scope(const char* name, const char* category, const char* arg_name,
                        std::int64_t arg) noexcept;
void close_scope(const char* name, const char* category, const char* arg_name, std::int64_t arg,
                 std::int64_t t0_ns) noexcept;
/// A copy of `s` that lives until the process ends, one per distinct text.
const char* intern(const std::string& s);
}  // namespace detail

/// Whether events are being recorded (one relaxed load).
inline bool enabled() noexcept { return detail::g_enabled.load(std::memory_order_relaxed); }

/// Starts recording for rank `rank` into directory `dir` (created if missing). Throws
/// dt::ConfigError naming the directory when it cannot be created or written, and dt::Error when
/// tracing is already on. Events recorded earlier (by an earlier start) are discarded.
/// `world` and `run` (a job's ranks share one run id, and no other job has it), when given, go
/// into the file, so that `dt_trace merge` refuses to join the files of different runs (a folder
/// holding files of an earlier, larger job).
void start(int rank, const std::string& dir, int world = 0, const std::string& run = "");
/// Writes <dir>/trace-rank<R>.json with every event so far (atomically: temporary file, then
/// rename); recording goes on. Returns the path. Throws dt::Error naming the file on failure;
/// does nothing (returns "") when start() was never called. With `open_scopes` (at a hang), each
/// thread's Scopes still open are in it too, ending now, in category "<category> (open)" (the
/// operations in flight are "comm (unfinished)"): the timeline shows what each thread was inside
/// when it stopped.
std::string write(bool open_scopes = false);
/// write() that reports a failure on stderr instead of throwing (for drain and error paths).
void write_noexcept(bool open_scopes = false) noexcept;
/// Stops recording. The events stay (write() after stop() still writes them) until the next
/// start(). Safe to call when tracing is off.
void stop() noexcept;
/// Names the calling thread in the timeline ("main", "ckpt-writer"); call before or while tracing.
/// `name` is copied.
void set_thread_name(const char* name) noexcept;
/// Events recorded and dropped (over the per-thread limit) since start(), over all threads.
std::size_t event_count() noexcept;
std::size_t dropped_count() noexcept;

/// One region of the timeline. `name`, `category` and `arg_name` must outlive the trace
/// (string literals); `arg_name` may be nullptr for no argument.
class Scope {
 public:
  Scope(const char* name, const char* category) noexcept : Scope(name, category, nullptr, 0) {}
  Scope(const char* name, const char* category, const char* arg_name, std::int64_t arg) noexcept
      : name_(name),
        category_(category),
        arg_name_(arg_name),
        arg_(arg),
        t0_(enabled() ? detail::open_scope(name, category, arg_name, arg) : -1) {}
  ~Scope() {
    if (t0_ >= 0) detail::close_scope(name_, category_, arg_name_, arg_, t0_);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  const char* name_;
  const char* category_;
  const char* arg_name_;
  std::int64_t arg_;
  std::int64_t t0_;
};

}  // namespace dt::trace
