#include "dt/watchdog.hpp"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <vector>

#include "dt/error.hpp"
#include "dt/metrics.hpp"
#include "dt/trace.hpp"

namespace dt::watchdog {

namespace {

using nlohmann::json;

constexpr std::size_t kRecords = 256;
constexpr int kTagQuery = 1, kTagReply = 2, kTagWritten = 3;
// A query that starts so comes from a rank that failed (collect_timelines): the asked rank
// writes its timeline, then answers with one byte on kTagWritten (not its state), as the failed
// rank aborts the job once all have.
constexpr char kFailedQuery[] = "failed: ";
constexpr int kMaxMessage = 1 << 16;

// A limit in seconds as whole nanoseconds, 0 meaning none: a positive limit below a nanosecond is
// one nanosecond, not 0 (which would turn the limit off).
std::int64_t limit_ns_of(double seconds) {
  if (!(seconds > 0)) return 0;
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(seconds * 1e9)));
}

// CLOCK_MONOTONIC in ns (also read in the SIGCONT handler, where only clock_gettime may be used).
std::int64_t now_ns() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return std::int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

struct Entry {
  std::string comm;
  std::uint64_t seq = 0;
  const char* op = "";
  const char* backend = "";
  DType dtype = DType::f32;
  std::size_t count = 0;
  std::int64_t t0 = 0, t1 = 0;  // t1 == 0: in flight
  std::int64_t stopped = 0;     // of which the process was stopped (SIGSTOP to SIGCONT)
  std::int64_t limit_ns = -1;   // how long it may take (-1: the watchdog's timeout; 0: any time)
  int peer = -1;                // point-to-point: the world rank it waits for
  bool communication = true;    // counted in dt_comm_* and shown as a comm event
  bool background = false;      // BackgroundScope: left running, no limit, not a wait
  std::uint64_t gen = 0;        // 0: slot unused
};

struct Progress {
  std::uint64_t started = 0, completed = 0;
  const char* op = "";
};

struct Recorder {
  std::mutex mu;
  std::vector<Entry> ring = std::vector<Entry>(kRecords);
  std::uint64_t next = 0;  // records made (the generation of the newest)
  std::size_t cursor = 0;  // the slot after the newest record's
  std::map<std::string, Progress> comms;
  std::map<std::string, std::vector<int>> members;  // world ranks of each registered communicator
};

Recorder& recorder() {
  static Recorder* r = new Recorder;  // never destroyed: records may complete at exit
  return *r;
}

std::atomic<const char*> g_activity{"starting"};
thread_local double t_limit_s = -1;      // LimitScope's limit on this thread (negative: none)
thread_local bool t_background = false;  // inside a BackgroundScope on this thread
std::atomic<std::int64_t> g_step{-1};

// SIGCONT: when the last one came (now_ns()), so that the watchdog can tell a stop of the
// process (Slurm's `scontrol suspend`, a shell's ^Z) from its own thread running late. The
// handler a library had is chained.
std::atomic<std::int64_t> g_last_continue{0};
static_assert(std::atomic<std::int64_t>::is_always_lock_free);
struct sigaction g_prev_cont;

extern "C" void on_sigcont(int sig, siginfo_t* info, void* ctx) {
  const int saved = errno;
  g_last_continue.store(now_ns());
  errno = saved;
  if (g_prev_cont.sa_flags & SA_SIGINFO) {
    if (g_prev_cont.sa_sigaction) g_prev_cont.sa_sigaction(sig, info, ctx);
  } else if (g_prev_cont.sa_handler != SIG_DFL && g_prev_cont.sa_handler != SIG_IGN) {
    g_prev_cont.sa_handler(sig);
  }
}

void note_continues() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_sigcont;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    // The previous action is read first, so that a SIGCONT never finds it half written.
    sigaction(SIGCONT, nullptr, &g_prev_cont);
    sigaction(SIGCONT, &sa, nullptr);
  });
}

json entry_json(const Entry& e, std::int64_t now) {
  json j = {{"comm", e.comm},
            {"seq", e.seq},
            {"op", e.op},
            {"backend", e.backend},
            {"dtype", dtype_name(e.dtype)},
            {"count", e.count},
            {"bytes", e.count * dtype_size(e.dtype)},
            {"started_s_ago", static_cast<double>(now - e.t0) * 1e-9}};
  if (e.peer >= 0) j["peer"] = e.peer;
  if (e.background) j["background"] = true;
  if (e.stopped > 0) j["stopped_s"] = static_cast<double>(e.stopped) * 1e-9;
  if (e.t1 != 0)
    j["seconds"] = static_cast<double>(e.t1 - e.t0) * 1e-9;
  else
    j["in_flight"] = true;
  return j;
}

// " from rank P" for a point-to-point receive, " to rank P" for a send (one it waits to finish).
std::string peer_text(const std::string& op, int peer) {
  return (op == "send" ? " to rank " : " from rank ") + std::to_string(peer);
}

// The operation a rank waits in, from its answer: the oldest of its records still in flight,
// but those left running in the background (BackgroundScope).
struct Waiting {
  bool found = false;
  json group;  // of its communicator, where the rank's answer gives it
  std::string comm, op;
  std::uint64_t seq = 0;
  int peer = -1;  // point-to-point: the rank it waits for
  std::string text() const {
    return op + (peer >= 0 ? peer_text(op, peer) : " #" + std::to_string(seq)) + " on " + comm;
  }
};
Waiting waiting_in(const json& state) {
  Waiting w;
  if (!state.is_object() || !state.contains("records") || !state["records"].is_array()) return w;
  double oldest = -1;
  for (const json& r : state["records"]) {
    if (!r.is_object() || !r.value("in_flight", false) || r.value("background", false)) continue;
    const double age = r.value("started_s_ago", 0.0);
    if (age <= oldest) continue;
    oldest = age;
    w.found = true;
    w.comm = r.value("comm", std::string());
    w.op = r.value("op", std::string());
    w.seq = r.value("seq", std::uint64_t{0});
    w.peer = r.value("peer", -1);
  }
  if (w.found && state.contains("comms") && state["comms"].contains(w.comm))
    w.group = state["comms"][w.comm].value("group", json());
  return w;
}

// Whether a rank's answer shows collective e still in flight there in the background
// (BackgroundScope) and no operation it waits in.
bool left_running(const json& state, const Entry& e) {
  if (!state.is_object() || !state.contains("records") || !state["records"].is_array())
    return false;
  bool left = false;
  for (const json& r : state["records"]) {
    if (!r.is_object() || !r.value("in_flight", false)) continue;
    if (!r.value("background", false)) return false;
    left = left || (r.value("comm", std::string()) == e.comm &&
                    r.value("seq", std::uint64_t{0}) == e.seq && r.value("peer", -1) < 0);
  }
  return left;
}

std::string describe(const Entry& e) {
  std::ostringstream s;
  s << e.op;
  if (e.peer >= 0)
    s << peer_text(e.op, e.peer);
  else
    s << " #" << e.seq;
  s << " on " << e.comm << " (" << dtype_name(e.dtype) << " x " << e.count << ", " << e.backend
    << ")";
  return s.str();
}

std::string state_with(int rank, std::size_t max_records) {
  Recorder& r = recorder();
  const std::int64_t now = now_ns();
  json j;
  j["rank"] = rank;
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  j["host"] = host;
  j["activity"] = g_activity.load();
  j["step"] = g_step.load();
  std::lock_guard<std::mutex> lk(r.mu);
  json comms = json::object();
  for (const auto& [name, p] : r.comms)
    comms[name] = {{"started", p.started}, {"completed", p.completed}, {"last_op", p.op}};
  // A communicator this rank is a member of but never used: none started (a rank that others
  // wait for there may never have come to it).
  for (const auto& [name, world_ranks] : r.members)
    if (!comms.contains(name)) comms[name] = {{"started", 0}, {"completed", 0}, {"last_op", ""}};
  // Which group a name stands for: communicators split alike on different ranks may share a
  // name (each node's "world/node"); the lowest world rank and the size tell them apart.
  for (const auto& [name, world_ranks] : r.members)
    if (!world_ranks.empty())
      comms[name]["group"] = {*std::min_element(world_ranks.begin(), world_ranks.end()),
                              world_ranks.size()};
  j["comms"] = comms;
  // The operations in flight (the oldest first, where more than max_records are), then the
  // newest completed ones, up to max_records in all, in the order they started.
  std::vector<const Entry*> open, done;
  for (const Entry& e : r.ring)
    if (e.gen != 0) (e.t1 == 0 ? open : done).push_back(&e);
  const auto by_gen = [](const Entry* a, const Entry* b) { return a->gen < b->gen; };
  std::sort(open.begin(), open.end(), by_gen);
  std::sort(done.begin(), done.end(), by_gen);
  if (open.size() > max_records) open.resize(max_records);
  const std::size_t room = max_records - open.size();
  if (done.size() > room) done.erase(done.begin(), done.end() - static_cast<std::ptrdiff_t>(room));
  std::vector<const Entry*> shown(open);
  shown.insert(shown.end(), done.begin(), done.end());
  std::sort(shown.begin(), shown.end(), by_gen);
  json recs = json::array();
  for (const Entry* e : shown) recs.push_back(entry_json(*e, now));
  j["records"] = recs;
  return j.dump();
}

// "now ACTIVITY at step N": what a rank's answer says it does (its step, where it has one).
std::string now_text(const json& state) {
  std::string s = "now " + state.value("activity", std::string("?"));
  const std::int64_t step = state.value("step", std::int64_t{-1});
  if (step >= 0) s += " at step " + std::to_string(step);
  return s;
}

}  // namespace

// --- recorder ----------------------------------------------------------------------------------

LimitScope::LimitScope(double timeout_s) noexcept : prev_(t_limit_s) { t_limit_s = timeout_s; }
LimitScope::~LimitScope() { t_limit_s = prev_; }

BackgroundScope::BackgroundScope() noexcept : prev_(t_background) { t_background = true; }
BackgroundScope::~BackgroundScope() { t_background = prev_; }

OpRecord::OpRecord(const std::string& comm, std::uint64_t seq, const char* op, const char* backend,
                   DType t, std::size_t count, double timeout_s, int peer,
                   bool communication) noexcept {
  Recorder& r = recorder();
  try {
    std::lock_guard<std::mutex> lk(r.mu);
    const std::uint64_t g = ++r.next;
    // The oldest slot whose operation has completed (or never held one): an operation still in
    // flight keeps its record however many newer ones come (a stuck background save's collective
    // among thousands of steps' records), as long as fewer than kRecords are in flight at once.
    std::size_t at = r.cursor;
    for (std::size_t i = 0; i < kRecords; ++i) {
      const std::size_t k = (r.cursor + i) % kRecords;
      if (r.ring[k].gen == 0 || r.ring[k].t1 != 0) {
        at = k;
        break;
      }
    }
    r.cursor = (at + 1) % kRecords;
    Entry& e = r.ring[at];
    e.comm = comm;
    e.seq = seq;
    e.op = op;
    e.backend = backend;
    e.dtype = t;
    e.count = count;
    e.t0 = now_ns();
    e.t1 = 0;
    e.stopped = 0;
    if (timeout_s < 0) timeout_s = t_background ? 0 : t_limit_s;
    e.limit_ns = timeout_s < 0 ? -1 : limit_ns_of(timeout_s);
    e.background = t_background;
    e.gen = g;
    e.peer = peer;
    e.communication = communication && !t_background;
    if (peer < 0) {
      Progress& p = r.comms[comm];
      p.started = std::max(p.started, seq);
      p.op = op;
    }
    slot_ = static_cast<long>(at);
    gen_ = g;
  } catch (...) {
    slot_ = -1;  // out of memory: this operation goes unrecorded
  }
}

OpRecord& OpRecord::operator=(OpRecord&& o) noexcept {
  if (this != &o) {
    complete();
    slot_ = o.slot_;
    gen_ = o.gen_;
    o.slot_ = -1;
  }
  return *this;
}

void OpRecord::complete() noexcept {
  if (slot_ < 0) return;
  Recorder& r = recorder();
  Entry done;
  {
    std::lock_guard<std::mutex> lk(r.mu);
    Entry& e = r.ring[static_cast<std::size_t>(slot_)];
    slot_ = -1;
    if (e.gen != gen_) return;  // overwritten by newer records
    e.t1 = std::max(now_ns(), e.t0 + 1);
    auto it = r.comms.find(e.comm);
    if (it != r.comms.end()) it->second.completed = std::max(it->second.completed, e.seq);
    done.op = e.op;
    done.backend = e.backend;
    done.seq = e.seq;
    done.count = e.count * dtype_size(e.dtype);
    done.t0 = e.t0;
    done.t1 = e.t1;
    done.stopped = std::min(e.stopped, e.t1 - e.t0);
    done.communication = e.communication;
    if (done.communication && trace::enabled()) done.comm = e.comm;
  }
  if (!done.communication) return;
  // The metrics count the time the operation ran; the timeline shows when it started and ended.
  metrics::record_comm(done.op, done.backend, done.count,
                       static_cast<double>(done.t1 - done.t0 - done.stopped) * 1e-9);
  if (trace::enabled()) {
    const std::int64_t shift = trace::detail::now_ns() - now_ns();  // to the timeline's clock
    try {
      trace::detail::record_comm(done.op, trace::detail::intern(done.comm), done.backend,
                                 static_cast<std::int64_t>(done.seq),
                                 static_cast<std::int64_t>(done.count), done.t0 + shift,
                                 done.t1 + shift);
    } catch (...) {  // out of memory: the event is lost
    }
  }
}

void note_members(const std::string& comm, std::vector<int> world_ranks) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lk(r.mu);
  r.members[comm] = std::move(world_ranks);
}

void set_activity(const char* what, std::int64_t step) noexcept {
  g_activity.store(what);
  g_step.store(step);
}

std::string state_json(int rank) { return state_with(rank, 64); }

// --- watchdog ----------------------------------------------------------------------------------

// The operations in flight, into this thread's timeline before it is written at a hang
// (category "comm (unfinished)", ending now): the timeline shows where each thread waits. Once.
void trace_unfinished() noexcept {
  static std::atomic<bool> once{false};  // a rank may both answer and abort: recorded once
  if (!trace::enabled() || once.exchange(true)) return;
  try {
    std::vector<Entry> open;
    {
      Recorder& r = recorder();
      std::lock_guard<std::mutex> lk(r.mu);
      for (const Entry& e : r.ring)
        if (e.gen != 0 && e.t1 == 0 && e.communication) open.push_back(e);
    }
    const std::int64_t now = now_ns(), shift = trace::detail::now_ns() - now;
    for (const Entry& e : open)
      trace::detail::record_comm(e.op, trace::detail::intern(e.comm), e.backend,
                                 static_cast<std::int64_t>(e.seq),
                                 static_cast<std::int64_t>(e.count * dtype_size(e.dtype)),
                                 e.t0 + shift, now + shift, "comm (unfinished)");
  } catch (...) {  // out of memory: the timeline goes without them
  }
}

// The watchdog whose thread runs (collect_timelines asks through it), or null.
std::atomic<Watchdog::Impl*> g_running{nullptr};

struct Watchdog::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  Settings s;
  std::atomic<bool> stop{false};
  std::thread thread;
  std::int64_t born = 0;  // now_ns() at construction
  // incoming queries
  MPI_Request qreq = MPI_REQUEST_NULL;
  std::vector<char> qbuf = std::vector<char>(kMaxMessage);
  struct Sent {
    MPI_Request req;
    std::string text;
  };
  std::vector<std::unique_ptr<Sent>> sent;
  bool traced = false;             // the timeline was written on a query
  std::vector<std::string> hosts;  // every rank's host, gathered at construction

  // "rank 1 (on n2)", "ranks 2,3 (on n2)", "ranks 1,5 (on n1, n3)": the ranks a line names, with
  // their hosts (known for ranks that do not answer too).
  std::string ranks_on(const std::vector<int>& v) const {
    if (v.empty()) return "no rank";
    std::ostringstream o;
    std::vector<std::string> on;
    o << (v.size() == 1 ? "rank " : "ranks ");
    for (std::size_t i = 0; i < v.size(); ++i) {
      o << (i ? "," : "") << v[i];
      const std::string h = v[i] >= 0 && static_cast<std::size_t>(v[i]) < hosts.size()
                                ? hosts[static_cast<std::size_t>(v[i])]
                                : "?";
      if (std::find(on.begin(), on.end(), h) == on.end()) on.push_back(h);
    }
    o << " (on ";
    for (std::size_t i = 0; i < on.size(); ++i) o << (i ? ", " : "") << on[i];
    o << ")";
    return o.str();
  }

  void post_query_recv() {
    MPI_Irecv(qbuf.data(), kMaxMessage, MPI_CHAR, MPI_ANY_SOURCE, kTagQuery, comm, &qreq);
  }

  // Answers a query that arrived (if any) with this rank's state.
  void serve() {
    // Every query that has arrived (all ranks of a job that failed everywhere at once ask).
    for (int flag = 1; flag && qreq != MPI_REQUEST_NULL;) {
      MPI_Status st;
      MPI_Test(&qreq, &flag, &st);
      if (flag) answer(st);
    }
    for (auto it = sent.begin(); it != sent.end();) {
      int done = 0;
      MPI_Test(&(*it)->req, &done, MPI_STATUS_IGNORE);
      it = done ? sent.erase(it) : it + 1;
    }
  }

  // Answers the query that arrived (status `st`, text in qbuf) and waits for the next one. A rank
  // investigating a hang gets this rank's state; a rank that failed (kFailedQuery) one byte, once
  // this rank's timeline is written. Either way the job is about to be aborted: the timeline is
  // written once, after a hang's answer is on its way (MPI_Abort may end the writing, which then
  // leaves the previous file, or none).
  void answer(const MPI_Status& st) {
    int n = 0;
    MPI_Get_count(&st, MPI_CHAR, &n);
    const bool failed = n >= static_cast<int>(sizeof kFailedQuery - 1) &&
                        std::memcmp(qbuf.data(), kFailedQuery, sizeof kFailedQuery - 1) == 0;
    auto write_timeline = [this] {
      if (traced) return;
      traced = true;
      trace_unfinished();
      trace::write_noexcept(true);
    };
    auto m = std::make_unique<Sent>();
    if (failed) {
      write_timeline();
      m->text = "w";
    } else {
      m->text = state_with(rank, 64);
      if (m->text.size() >= static_cast<std::size_t>(kMaxMessage)) m->text = state_with(rank, 8);
      if (m->text.size() >= static_cast<std::size_t>(kMaxMessage)) m->text = state_with(rank, 0);
      m->text.resize(std::min<std::size_t>(m->text.size(), kMaxMessage - 1));
    }
    MPI_Isend(m->text.data(), static_cast<int>(m->text.size()), MPI_CHAR, st.MPI_SOURCE,
              failed ? kTagWritten : kTagReply, comm, &m->req);
    sent.push_back(std::move(m));
    post_query_recv();
    write_timeline();
  }

  // A stretch of time in which the watchdog did not run (its check came late): a stop of the
  // process, or this thread kept off its CPU.
  struct Gap {
    std::int64_t start, end;
  };
  // How much of `g` falls after the start of `e`.
  static std::int64_t overlap(const Entry& e, const Gap& g) {
    return std::max<std::int64_t>(0, g.end - std::max(e.t0, g.start));
  }

  // The oldest operation in flight longer than its limit (the timeout unless it has its own),
  // if any. Time the process was stopped does not count, nor do the `pending` gaps (not yet
  // known to be stops or not).
  bool overdue(Entry& out, const std::vector<Gap>& pending) {
    Recorder& r = recorder();
    const std::int64_t now = now_ns();
    const std::int64_t timeout = limit_ns_of(s.timeout_s);
    std::lock_guard<std::mutex> lk(r.mu);
    bool found = false;
    for (const Entry& e : r.ring) {
      if (e.gen == 0 || e.t1 != 0) continue;
      const std::int64_t limit = e.limit_ns < 0 ? timeout : e.limit_ns;
      std::int64_t held = 0;
      for (const Gap& g : pending) held += overlap(e, g);
      if (limit > 0 && now - e.t0 - e.stopped - held > limit && (!found || e.t0 < out.t0)) {
        out = e;
        found = true;
      }
    }
    return found;
  }

  // Time this process did not run (the job was suspended: Slurm's `scontrol suspend` stops every
  // process with SIGSTOP, then continues it with SIGCONT) does not count towards the limits: the
  // operations in flight were stopped with it. Each adds the part of `g` after its start.
  void forgive(const Gap& g) {
    Recorder& r = recorder();
    std::lock_guard<std::mutex> lk(r.mu);
    for (Entry& e : r.ring)
      if (e.gen != 0 && e.t1 == 0) e.stopped += overlap(e, g);
  }

  void loop() {
    pthread_setname_np(pthread_self(), "dt-watchdog");
    if (s.test_start_late_s > 0)  // testing only: a thread slow to start (a loaded node)
      std::this_thread::sleep_for(std::chrono::duration<double>(s.test_start_late_s));
    post_query_recv();
    // A check later than kLate leaves a gap. It was a stop of the process if a SIGCONT came
    // during it or within kGrace after it: then it is forgiven. Until then it is pending, and no
    // operation is called overdue for it; a gap kGrace old without a SIGCONT was this thread
    // running late (kept off its CPU), and its time counts.
    constexpr std::int64_t kTick = 50'000'000, kLate = 250'000'000, kGrace = 1'000'000'000;  // ns
    // The first check was due at construction: a stop before this thread first ran (it may start
    // late on a loaded node) is a gap like any other.
    std::int64_t last = born - kTick;
    std::vector<Gap> pending;
    bool late_once = s.test_late_once_s > 0;
    while (!stop.load()) {
      serve();
      const std::int64_t now = now_ns();
      if (now - last - kTick > kLate) pending.push_back({last + kTick, now});
      last = now;
      const std::int64_t cont = g_last_continue.load();
      for (auto it = pending.begin(); it != pending.end();) {
        if (cont >= it->start && cont <= it->end + kGrace) {
          forgive(*it);
        } else if (now - it->end <= kGrace) {
          ++it;
          continue;
        }
        it = pending.erase(it);
      }
      Entry e;
      if (overdue(e, pending)) investigate(e);
      if (late_once) {  // testing only: this thread kept off the CPU once
        late_once = false;
        std::this_thread::sleep_for(std::chrono::duration<double>(s.test_late_once_s));
      }
      std::this_thread::sleep_for(std::chrono::nanoseconds(kTick));
    }
  }

  [[noreturn]] void investigate(const Entry& e) {
    const std::string what = describe(e);
    // Ask every other rank for its state; keep answering queries meanwhile (other ranks may be
    // investigating the same hang).
    std::vector<std::string> replies(static_cast<std::size_t>(size));
    std::vector<std::vector<char>> bufs(static_cast<std::size_t>(size));
    std::vector<MPI_Request> rreq(static_cast<std::size_t>(size), MPI_REQUEST_NULL);
    std::vector<MPI_Request> sreq(static_cast<std::size_t>(size), MPI_REQUEST_NULL);
    std::vector<char> answered(static_cast<std::size_t>(size), 0);
    for (int q = 0; q < size; ++q) {
      if (q == rank) continue;
      const auto k = static_cast<std::size_t>(q);
      bufs[k].resize(kMaxMessage);
      MPI_Irecv(bufs[k].data(), kMaxMessage, MPI_CHAR, q, kTagReply, comm, &rreq[k]);
      MPI_Isend(what.data(), static_cast<int>(what.size()), MPI_CHAR, q, kTagQuery, comm, &sreq[k]);
    }
    replies[static_cast<std::size_t>(rank)] = state_with(rank, 64);
    answered[static_cast<std::size_t>(rank)] = 1;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    int pending = size - 1;
    while (pending > 0 && std::chrono::steady_clock::now() < deadline) {
      serve();
      for (int q = 0; q < size; ++q) {
        const auto k = static_cast<std::size_t>(q);
        if (answered[k] || rreq[k] == MPI_REQUEST_NULL) continue;
        int flag = 0;
        MPI_Status st;
        MPI_Test(&rreq[k], &flag, &st);
        if (!flag) continue;
        int n = 0;
        MPI_Get_count(&st, MPI_CHAR, &n);
        replies[k].assign(bufs[k].data(), static_cast<std::size_t>(std::max(n, 0)));
        answered[k] = 1;
        --pending;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }

    // Which ranks have not reached the collective: they started fewer collectives on that
    // communicator, or did not answer. For a point-to-point operation: its peer, and what it does.
    json dump;
    dump["detected_by"] = rank;
    dump["collective"] = {{"comm", e.comm},
                          {"seq", e.seq},
                          {"op", e.op},
                          {"backend", e.backend},
                          {"dtype", dtype_name(e.dtype)},
                          {"count", e.count}};
    if (e.peer >= 0) dump["collective"]["peer"] = e.peer;
    const double limit_s = e.limit_ns < 0 ? s.timeout_s : static_cast<double>(e.limit_ns) * 1e-9;
    dump["timeout_s"] = limit_s;
    // A collective is judged among its communicator's members (every rank when they are not
    // known); a point-to-point operation by its peer.
    std::vector<char> member(static_cast<std::size_t>(size), 1);
    std::string members_text;
    if (e.peer < 0) {
      Recorder& r = recorder();
      std::lock_guard<std::mutex> lk(r.mu);
      const auto it = r.members.find(e.comm);
      if (it != r.members.end() && static_cast<int>(it->second.size()) < size) {
        std::fill(member.begin(), member.end(), 0);
        std::ostringstream m;
        for (std::size_t i = 0; i < it->second.size(); ++i) {
          const int q = it->second[i];
          if (q >= 0 && q < size) member[static_cast<std::size_t>(q)] = 1;
          if (i < 16) m << (i ? "," : "") << q;
        }
        if (it->second.size() > 16) m << ",... (" << it->second.size() << " ranks)";
        members_text = m.str();
        dump["collective"]["members"] = it->second;
      }
    }
    json ranks = json::array();
    std::vector<json> state(static_cast<std::size_t>(size));
    std::vector<int> missing;  // the ranks the operation waits for: not reached it, or silent
    std::vector<int> lagging, silent;
    std::ostringstream detail;
    for (int q = 0; q < size; ++q) {
      const auto k = static_cast<std::size_t>(q);
      json st = json::parse(replies[k], nullptr, false);
      if (answered[k] && !st.is_discarded()) state[k] = st;
      if (!member[k]) {  // not in the communicator: its state is in the dump, no verdict on it
        ranks.push_back(st.is_discarded() ? json{{"rank", q}, {"answer", nullptr}} : st);
        continue;
      }
      if (!answered[k] || st.is_discarded()) {
        // No answer says nothing about where it is: stopped, or stuck where its watchdog cannot
        // reply (inside MPI, say). A point-to-point operation waits for its peer only.
        if (e.peer < 0 || q == e.peer) {
          missing.push_back(q);
          silent.push_back(q);
        }
        ranks.push_back({{"rank", q}, {"answer", nullptr}});
        continue;
      }
      std::uint64_t started = 0;
      if (st.contains("comms") && st["comms"].contains(e.comm))
        started = st["comms"][e.comm].value("started", std::uint64_t{0});
      if (e.peer >= 0 ? q == e.peer : started < e.seq) {
        missing.push_back(q);
        lagging.push_back(q);
        detail << "; rank " << q << ": ";
        if (e.peer < 0) detail << "last " << e.comm << " collective #" << started << ", ";
        detail << now_text(st);
      }
      ranks.push_back(st);
    }
    // A rank waited for may itself wait, in an operation of its own, for others (a pipeline
    // stage for the stage before it, which waits in a tensor-parallel collective for a member
    // that stopped): the waits are followed to the ranks that wait for nobody (busy elsewhere,
    // silent, or stuck inside an operation the others have passed). Those are named.
    std::vector<char> seen(static_cast<std::size_t>(size), 0);
    seen[static_cast<std::size_t>(rank)] = 1;
    for (int q : missing) seen[static_cast<std::size_t>(q)] = 1;
    std::vector<int> todo = lagging, roots = silent;
    std::ostringstream chain;
    json waits = json::array();
    for (std::size_t i = 0; i < todo.size(); ++i) {
      const int q = todo[i];
      const Waiting w = waiting_in(state[static_cast<std::size_t>(q)]);
      std::vector<int> on;  // the ranks w waits for
      if (w.found && w.peer >= 0 && w.peer < size && w.peer != q) {
        on.push_back(w.peer);
      } else if (w.found) {
        for (int p = 0; p < size; ++p) {
          const json& ps = state[static_cast<std::size_t>(p)];
          if (p == q || !ps.is_object() || !ps.contains("comms") || !ps["comms"].contains(w.comm))
            continue;
          const json& pc = ps["comms"][w.comm];
          if (!w.group.is_null() && pc.value("group", json()) != w.group) continue;  // another
          if (pc.value("started", std::uint64_t{0}) < w.seq) on.push_back(p);
        }
      }
      if (on.empty()) {
        roots.push_back(q);
        continue;
      }
      chain << "; rank " << q << " waits in " << w.text() << " for rank";
      if (on.size() > 1) chain << "s";
      for (std::size_t j = 0; j < on.size(); ++j) chain << (j ? "," : " ") << on[j];
      waits.push_back({{"rank", q}, {"waits_in", w.text()}, {"for", on}});
      for (int p : on) {
        const auto k = static_cast<std::size_t>(p);
        if (seen[k]) continue;
        seen[k] = 1;
        if (state[k].is_object()) {
          todo.push_back(p);
        } else {
          roots.push_back(p);
          chain << "; rank " << p << ": no answer";
        }
      }
    }
    std::sort(roots.begin(), roots.end());
    roots.erase(std::unique(roots.begin(), roots.end()), roots.end());
    const bool followed = waits.size() > 0;
    if (followed && roots.empty()) {
      // Every rank waited for waits for another one of them: a cycle (two ranks calling
      // collectives in different orders, or receiving from each other).
      std::vector<int> in_cycle;
      for (const json& w : waits) in_cycle.push_back(w.value("rank", -1));
      if (std::find(in_cycle.begin(), in_cycle.end(), rank) == in_cycle.end())
        in_cycle.push_back(rank);
      std::sort(in_cycle.begin(), in_cycle.end());
      chain << "; the waits form a cycle among " << ranks_on(in_cycle);
      dump["waits"] = waits;
      dump["cycle_ranks"] = in_cycle;
    } else if (followed) {
      chain << "; the waits lead to " << ranks_on(roots);
      for (int q : roots) {
        const json& st = state[static_cast<std::size_t>(q)];
        if (!st.is_object() || std::find(lagging.begin(), lagging.end(), q) != lagging.end())
          continue;  // silent, or described above already
        chain << "; rank " << q << ": " << now_text(st);
        const Waiting w = waiting_in(st);
        if (w.found) chain << ", inside " << w.text();
      }
      dump["waits"] = waits;
      dump["root_ranks"] = roots;
    }
    // Every member reached the collective: one that left it running in the background
    // (BackgroundScope) and waits in no other operation is busy elsewhere, and the others may
    // wait for its progress in it.
    std::vector<int> busy;
    std::ostringstream what_busy;
    for (int q = 0; q < size && missing.empty() && e.peer < 0; ++q) {
      const json& st = state[static_cast<std::size_t>(q)];
      if (q == rank || !member[static_cast<std::size_t>(q)] || !left_running(st, e)) continue;
      busy.push_back(q);
      what_busy << "; rank " << q << ": " << now_text(st);
    }
    if (!busy.empty()) dump["busy_ranks"] = busy;
    dump["missing_ranks"] = missing;
    dump["ranks"] = ranks;
    const std::string path = s.dump_dir + "/dt-watchdog-rank" + std::to_string(rank) + ".json";
    std::string written = path;
    try {
      metrics::write_file_atomically(path, dump.dump(1) + "\n");
    } catch (const std::exception& ex) {
      written = std::string("not written (") + ex.what() + ")";
    }
    std::ostringstream line;
    line << "dt watchdog: rank " << rank << ": " << what;
    if (!members_text.empty()) line << " of world ranks " << members_text;
    line << " has not completed after " << limit_s << " s; ";
    if (missing.empty()) {
      line << (members_text.empty() ? "every rank" : "every member")
           << " has reached it (stuck inside the collective)";
      if (!busy.empty())
        line << "; " << ranks_on(busy) << (busy.size() == 1 ? " is" : " are")
             << " in no other operation, busy elsewhere" << what_busy.str();
    } else if (e.peer >= 0) {
      line << ranks_on({e.peer})
           << (std::strcmp(e.op, "send") == 0 ? " has not received it" : " has not sent it")
           << (silent.empty() ? ""
                              : " and did not answer (stopped, or stuck where its watchdog "
                                "cannot reply)");
    } else {
      if (!lagging.empty())
        line << ranks_on(lagging) << (lagging.size() == 1 ? " has" : " have") << " not reached it";
      if (!silent.empty())
        line << (lagging.empty() ? "" : "; ") << ranks_on(silent)
             << " did not answer (stopped, or stuck where "
             << (silent.size() == 1 ? "its watchdog" : "their watchdogs") << " cannot reply)";
    }
    line << detail.str() << chain.str();
    line << "; dump: " << written << "; aborting the job";
    std::fprintf(stderr, "%s\n", line.str().c_str());
    std::fflush(stderr);
    std::fflush(stdout);
    trace_unfinished();
    trace::write_noexcept(true);
    MPI_Abort(MPI_COMM_WORLD, s.exit_code);
    std::_Exit(s.exit_code);
  }
};

Watchdog::Watchdog(MPI_Comm world, const Settings& s) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.s = s;
  if (s.timeout_s <= 0 && !s.scoped_limits) return;
  note_continues();
  DT_CHECK(Error, MPI_Comm_dup(world, &m.comm) == MPI_SUCCESS, "watchdog: MPI_Comm_dup failed");
  MPI_Comm_rank(m.comm, &m.rank);
  MPI_Comm_size(m.comm, &m.size);
  // Every rank's host, for the line that names the ranks a hang waits for: also those that will
  // not answer then (a node that stopped).
  constexpr int kHost = HOST_NAME_MAX + 1;  // Linux's longest host name and its terminator
  char host[kHost] = {0};
  gethostname(host, kHost - 1);
  std::vector<char> all(static_cast<std::size_t>(kHost) * static_cast<std::size_t>(m.size));
  DT_CHECK(Error,
           MPI_Allgather(host, kHost, MPI_CHAR, all.data(), kHost, MPI_CHAR, m.comm) == MPI_SUCCESS,
           "watchdog: MPI_Allgather of the host names failed");
  for (int q = 0; q < m.size; ++q) {
    const char* h = all.data() + static_cast<std::size_t>(q) * kHost;
    m.hosts.emplace_back(h, strnlen(h, kHost));
  }
  m.born = now_ns();
  m.thread = std::thread([&m] { m.loop(); });
  g_running.store(&m);
}

void collect_timelines(const std::string& why, double wait_s) noexcept {
  Watchdog::Impl* m = g_running.load();
  if (m == nullptr || m->size < 2) return;
  // What the requests use lives on the heap and is let go only once they are all done: after
  // the wait a late answer may still arrive (the job is aborted right after).
  struct Asked {
    std::string what;
    std::vector<char> acks;
    std::vector<MPI_Request> reqs;
  };
  Asked* a = nullptr;
  try {
    a = new Asked;
    a->what = kFailedQuery + why;
    a->acks.resize(static_cast<std::size_t>(m->size));
    a->reqs.reserve(2 * static_cast<std::size_t>(m->size));
  } catch (...) {  // out of memory: the job is aborted without the others' timelines
    delete a;
    return;
  }
  for (int q = 0; q < m->size; ++q) {
    if (q == m->rank) continue;
    a->reqs.push_back(MPI_REQUEST_NULL);
    MPI_Irecv(&a->acks[static_cast<std::size_t>(q)], 1, MPI_CHAR, q, kTagWritten, m->comm,
              &a->reqs.back());
    a->reqs.push_back(MPI_REQUEST_NULL);
    MPI_Isend(a->what.data(), static_cast<int>(a->what.size()), MPI_CHAR, q, kTagQuery, m->comm,
              &a->reqs.back());
  }
  // Until every rank has written its timeline and said so, or the wait is over.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
  int done = 0;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    MPI_Testall(static_cast<int>(a->reqs.size()), a->reqs.data(), &done, MPI_STATUSES_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (done) delete a;
}

Watchdog::~Watchdog() {
  Impl& m = *impl_;
  if (!m.thread.joinable()) return;
  Impl* running = &m;
  g_running.compare_exchange_strong(running, nullptr);
  m.stop = true;
  m.thread.join();
  int fin = 0;
  MPI_Finalized(&fin);
  if (fin) return;
  if (m.qreq != MPI_REQUEST_NULL) {
    MPI_Cancel(&m.qreq);
    MPI_Wait(&m.qreq, MPI_STATUS_IGNORE);
  }
  for (auto& p : m.sent) MPI_Wait(&p->req, MPI_STATUS_IGNORE);
  MPI_Comm_free(&m.comm);
}

}  // namespace dt::watchdog
