#include "dt/qos.hpp"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

#include "dt/config.hpp"
#include "dt/error.hpp"
#include "placement.hpp"

namespace dt::qos {

using placement::CgroupMount;
using placement::CgroupPlace;
using placement::own_group;

namespace {

// The process's tier. Written by configure() (main thread, before other threads use it), read by
// apply_to_current_thread() from any thread.
struct State {
  std::mutex mu;
  Tier tier;
  std::atomic<bool> active{false};
  std::atomic<int> fifo{0};
  std::atomic<int> base_nice{0};
  std::atomic<bool> warned[3] = {false, false, false};
};
State& state() {
  static State s;
  return s;
}

}  // namespace

namespace {

// The first number in the file `path` (memory.max's "max" and unreadable files: not a number).
bool read_number(const std::string& path, std::uint64_t* out) {
  std::ifstream in(path);
  unsigned long long v = 0;
  if (!(in >> v)) return false;
  *out = v;
  return true;
}

// The folder of this process's group of the memory controller (v1 or v2), "" where there is none.
std::string own_memory_group(bool* v2) {
  for (const CgroupMount& m : placement::cgroup_mounts()) {
    CgroupPlace h;
    h.v2 = m.v2;
    h.controllers = m.controllers;
    if (h.v2) {
      // The v2 hierarchy serves memory where its root lists the controller.
      std::ifstream ctl(m.point + "/cgroup.controllers");
      std::string c;
      bool memory = false;
      while (ctl >> c) memory = memory || c == "memory";
      if (!memory) continue;
    } else if (std::find(h.controllers.begin(), h.controllers.end(), "memory") ==
               h.controllers.end()) {
      continue;
    }
    const std::string group = own_group(h);
    if (group.empty()) continue;
    // The mount shows the hierarchy from `root` down (a container's view): the group below it.
    std::string rel = group;
    if (m.root != "/") {
      const bool below = group.compare(0, m.root.size(), m.root) == 0 &&
                         (group.size() == m.root.size() || group[m.root.size()] == '/');
      if (!below) continue;
      rel = group.substr(m.root.size());
    }
    *v2 = h.v2;
    return m.point + (rel == "/" ? "" : rel);
  }
  return "";
}

}  // namespace

std::uint64_t memory_available(std::string* where) noexcept {
  try {
    std::uint64_t best = 0, swap_free = 0;
    std::string from;
    {
      std::ifstream in("/proc/meminfo");
      std::string key;
      std::uint64_t kb = 0, avail = 0, swap = 0;
      bool have = false;
      while (in >> key >> kb) {
        if (key == "MemAvailable:") avail = kb, have = true;
        if (key == "SwapFree:") swap = kb;
        in.ignore(64, '\n');
      }
      swap_free = swap * 1024;
      if (have) best = (avail + swap) * 1024, from = "/proc/meminfo";
    }
    bool v2 = false;
    std::string dir = own_memory_group(&v2);
    // This group and each above it, up to the hierarchy's root (whose files v2 lacks). A group's
    // use counts its page cache, of which the inactive part the kernel drops for a new need; the
    // node's free swap may hold more (an upper bound: a refusal on it is certain).
    for (int depth = 0; !dir.empty() && depth < 64; ++depth) {
      std::uint64_t limit = 0, used = 0;
      const std::string limit_file = dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes");
      if (read_number(limit_file, &limit) &&
          read_number(dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes"), &used) &&
          limit < (std::uint64_t{1} << 62)) {  // v1's "no limit" is about 2^63
        std::ifstream stat(dir + "/memory.stat");
        std::string key;
        std::uint64_t value = 0, cache = 0;
        while (stat >> key >> value)
          if (key == (v2 ? "inactive_file" : "total_inactive_file")) cache = value;
        used = used > cache ? used - cache : 0;
        const std::uint64_t room = (limit > used ? limit - used : 0) + swap_free;
        if (from.empty() || room < best) best = room, from = limit_file;
      }
      const std::size_t slash = dir.rfind('/');
      if (slash == std::string::npos || slash == 0) break;
      const std::string up = dir.substr(0, slash);
      struct stat st {};
      if (::stat((up + (v2 ? "/cgroup.controllers" : "/memory.limit_in_bytes")).c_str(), &st) != 0)
        break;  // past the hierarchy's mount point
      dir = up;
    }
    if (where) *where = from;
    return best;
  } catch (...) {
    if (where) where->clear();
    return 0;
  }
}

std::string detail::leaves_slurm_job(const std::string& dir) {
  const char* job = std::getenv("SLURM_JOB_ID");
  return placement::leaves_slurm_job(placement::cgroup_place(dir), dir, job != nullptr ? job : "",
                                     "this rank");
}

namespace {

constexpr int kIoNiceOffset = 10;

pid_t thread_id() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

void warn_once(Role r, const std::string& msg) {
  if (!state().warned[static_cast<int>(r)].exchange(true))
    std::fprintf(stderr, "dt: qos: warning: %s\n", msg.c_str());
}

const char* role_name(Role r) {
  switch (r) {
    case Role::comm:
      return "communication";
    case Role::compute:
      return "compute";
    case Role::io:
      return "checkpoint I/O";
  }
  return "?";
}

// Sets policy and nice value of the calling thread; returns "" or the reason it was refused.
std::string set_thread(int policy, int priority, int nice) {
  sched_param sp{};
  sp.sched_priority = priority;
  // A real-time policy is not handed down: threads this one starts (an MPI or UCX helper, say)
  // begin as SCHED_OTHER instead of preempting the compute threads of their core.
  const bool rt = policy == SCHED_FIFO || policy == SCHED_RR;
  if (::sched_setscheduler(static_cast<pid_t>(thread_id()),
                           rt ? policy | SCHED_RESET_ON_FORK : policy, &sp) != 0)
    return std::strerror(errno);
  if (policy != SCHED_FIFO && policy != SCHED_RR) {
    if (::setpriority(PRIO_PROCESS, static_cast<id_t>(thread_id()), nice) != 0)
      return std::string("nice ") + std::to_string(nice) + ": " + std::strerror(errno);
  }
  return "";
}

}  // namespace

void add_options(Options& o, Settings& s) {
  o.add("qos.file", &s.file, "auto",
        "QoS tier record of the job (written by slurm/prolog): auto (the record of "
        "$SLURM_JOB_ID in qos.state-dir/$SLURM_CLUSTER_NAME or qos.state-dir, if any), none, "
        "or a file")
      .node_local()
      .add("qos.state-dir", &s.state_dir, "/run/dt-qos",
           "where slurm/prolog writes its records (its DT_QOS_STATE_DIR)")
      .node_local();
}

std::string record_path(const Settings& s) {
  if (s.file == "none") return "";
  if (s.file != "auto") {
    struct stat st;
    errno = 0;
    DT_CHECK(ConfigError, ::stat(s.file.c_str(), &st) == 0 && S_ISREG(st.st_mode),
             "option --qos.file: '", s.file, "' is not a file (",
             errno ? std::strerror(errno) : "not a regular file", ")");
    return s.file;
  }
  const char* job = std::getenv("SLURM_JOB_ID");
  if (!job || !*job) return "";
  const char* cluster = std::getenv("SLURM_CLUSTER_NAME");
  return placement::find_record(s.state_dir, job, cluster != nullptr ? cluster : "");
}

void (*detail::after_move_for_test)() = nullptr;

std::vector<std::string> configure(const Tier& t) noexcept {
  std::vector<std::string> warnings;
  State& s = state();
  // The ranks of a node find the same: the node's first rank says it (all return it).
  const bool speaks = launcher_local_rank() <= 0;
  auto say = [speaks](const std::string& w) {
    if (speaks) std::fprintf(stderr, "dt: qos: warning: %s\n", w.c_str());
  };
  try {
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.tier = t;
      s.tier.not_entered.clear();
      s.tier.fifo_refused.clear();
    }
    errno = 0;
    const int nice = ::getpriority(PRIO_PROCESS, 0);
    s.base_nice = errno == 0 ? nice : 0;
    s.fifo = t.fifo;
    for (auto& w : s.warned) w = false;
    s.active = !t.name.empty();
    if (!s.active) return warnings;
    const std::string pid = std::to_string(::getpid());
    const std::vector<unsigned char> binding = placement::affinity();
    for (const auto& g : t.cgroups) {
      auto stayed_out = [&s, &g] {
        std::lock_guard<std::mutex> lock(s.mu);
        s.tier.not_entered.push_back(g);
      };
      const placement::CgroupPlace to = placement::cgroup_place(g);
      const char* job = std::getenv("SLURM_JOB_ID");
      if (const std::string why =
              placement::leaves_slurm_job(to, g, job != nullptr ? job : "", "this rank");
          !why.empty()) {
        warnings.push_back(why +
                           ": it stays where it is (the tier's settings of that group do "
                           "not apply to it)");
        say(warnings.back());
        stayed_out();
        continue;
      }
      if (const std::string why = placement::enter(to, g, ::getpid()); !why.empty()) {
        warnings.push_back("cannot move this rank (pid " + pid + ") into " + g + " (" + why +
                           "); it runs in its current group");
        say(warnings.back());
        stayed_out();
      }
    }
    if (detail::after_move_for_test) detail::after_move_for_test();
    if (t.fifo > 0) {
      // Whether the communication thread will get its policy, tried where it will run (these
      // groups, this user): so that the tier line says what applies, not what was asked.
      std::string why;
      std::thread probe([&why, &t] {
        sched_param sp{};
        sp.sched_priority = t.fifo;
        if (::sched_setscheduler(static_cast<pid_t>(thread_id()), SCHED_FIFO, &sp) != 0)
          why = std::strerror(errno);
      });
      probe.join();
      std::lock_guard<std::mutex> lock(s.mu);
      s.tier.fifo_refused = why;
    }
    // This rank's own (its binding, its failure): said by every rank.
    if (const std::string why = placement::keep_affinity(binding); !why.empty()) {
      warnings.push_back(why);
      std::fprintf(stderr, "dt: qos: warning: %s\n", why.c_str());
    }
  } catch (const std::exception& e) {
    warnings.push_back(std::string("QoS set-up failed: ") + e.what());
    std::fprintf(stderr, "dt: qos: warning: %s\n", warnings.back().c_str());
  }
  apply_to_current_thread(Role::compute);
  return warnings;
}

Tier current() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().tier;
}

std::string describe(const Tier& t) {
  if (t.name.empty()) return "no QoS tier";
  std::string s = "tier " + t.name;
  if (t.requested != t.name)
    s += " (the job asked for tier '" + t.requested + "', which the QoS config does not define)";
  else if (!t.source.empty())
    s += " (" + t.source + ")";
  s += ": cgroup " + (t.mode.empty() ? std::string("none") : t.mode);
  auto entered = [&t](const std::string& g) {
    return std::find(t.not_entered.begin(), t.not_entered.end(), g) == t.not_entered.end();
  };
  for (const auto& g : t.cgroups)
    if (entered(g)) s += " " + g;
  if (!t.not_entered.empty()) {
    s += " (not entered:";
    for (const auto& g : t.not_entered) s += " " + g;
    s += ")";
  }
  if (t.weight > 0) s += ", weight " + std::to_string(t.weight);
  s += ", communication thread ";
  if (t.fifo <= 0)
    s += "normal priority";
  else if (t.fifo_refused.empty())
    s += "SCHED_FIFO " + std::to_string(t.fifo);
  else
    s += "normal priority (SCHED_FIFO " + std::to_string(t.fifo) + " refused: " + t.fifo_refused +
         ")";
  return s;
}

void apply_to_current_thread(Role role) noexcept {
  State& s = state();
  if (!s.active) return;
  try {
    std::string why;
    std::string what;
    switch (role) {
      case Role::comm:
        if (s.fifo <= 0) return;
        what = "SCHED_FIFO priority " + std::to_string(s.fifo.load());
        why = set_thread(SCHED_FIFO, s.fifo, 0);
        break;
      case Role::compute:
        what = "SCHED_OTHER nice " + std::to_string(s.base_nice.load());
        why = set_thread(SCHED_OTHER, 0, s.base_nice);
        break;
      case Role::io: {
        const int nice = std::min(19, s.base_nice + kIoNiceOffset);
        what = "SCHED_BATCH nice " + std::to_string(nice);
        why = set_thread(SCHED_BATCH, 0, nice);
        break;
      }
    }
    if (!why.empty())
      warn_once(role, what + " refused for the " + role_name(role) + " thread (" + why +
                          "); it keeps its current policy");
  } catch (...) {
    // Allocation failure while building a message: the thread keeps its policy.
  }
}

}  // namespace dt::qos
