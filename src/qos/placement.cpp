#include "placement.hpp"

#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "dt/error.hpp"
#include "dt/qos.hpp"

namespace dt::qos::placement {

std::vector<unsigned char> affinity() {
  for (std::size_t cpus = 1024; cpus <= (1u << 16); cpus *= 2) {
    std::vector<unsigned char> set(CPU_ALLOC_SIZE(cpus));
    if (sched_getaffinity(0, set.size(), reinterpret_cast<cpu_set_t*>(set.data())) == 0) return set;
    if (errno != EINVAL) break;
  }
  return {};
}

std::string keep_affinity(const std::vector<unsigned char>& before) {
  std::vector<unsigned char> now = affinity();
  if (before.empty() || now.size() != before.size() || now == before) return {};
  std::vector<unsigned char> both(now.size());
  bool any = false;
  for (std::size_t i = 0; i < both.size(); ++i) {
    both[i] = static_cast<unsigned char>(now[i] & before[i]);
    any = any || both[i] != 0;
  }
  if (!any || both == now) return {};  // the binding lies outside the cpuset: the cpuset wins
  if (sched_setaffinity(0, both.size(), reinterpret_cast<const cpu_set_t*>(both.data())) != 0)
    return std::string("cannot restore the CPU binding after the move into its cpuset: ") +
           std::strerror(errno);
  return {};
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at <= s.size()) {
    const std::size_t end = std::min(s.find(sep, at), s.size());
    if (end > at) out.push_back(s.substr(at, end - at));
    at = end + 1;
  }
  return out;
}

std::string unescape(const std::string& s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const bool octal =
        s[i] == '\\' && i + 3 < s.size() && s.find_first_not_of("01234567", i + 1) > i + 3;
    if (octal) {
      out += static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0'));
      i += 3;
    } else {
      out += s[i];
    }
  }
  return out;
}

std::vector<CgroupMount> cgroup_mounts() {
  std::vector<CgroupMount> out;
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  while (std::getline(in, line)) {
    // ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER-OPTIONS
    const std::vector<std::string> f = split(line, ' ');
    if (f.size() < 6) continue;
    const auto dash = std::find(f.begin() + 6, f.end(), "-");  // after the optional fields
    if (dash == f.end() || f.end() - dash < 4) continue;
    const std::string& fstype = *(dash + 1);
    if (fstype != "cgroup" && fstype != "cgroup2") continue;
    CgroupMount m;
    m.root = unescape(f[3]);
    m.point = unescape(f[4]);
    m.v2 = fstype == "cgroup2";
    if (!m.v2) m.controllers = split(*(dash + 3), ',');
    out.push_back(std::move(m));
  }
  return out;
}

CgroupPlace cgroup_place(const std::string& name) {
  // As mounted: /sys/fs/cgroup/cpu is often a link to the hierarchy cpu,cpuacct. (A directory
  // that does not exist is taken as named.)
  char* real = ::realpath(name.c_str(), nullptr);
  const std::string dir = real != nullptr ? real : name;
  std::free(real);
  CgroupPlace best;
  std::size_t best_len = 0;
  for (const CgroupMount& m : cgroup_mounts()) {
    const std::string& point = m.point;
    const bool under = dir == point || point == "/" ||
                       (dir.compare(0, point.size(), point) == 0 && dir[point.size()] == '/');
    if (!under || point.size() < best_len) continue;
    best_len = point.size();
    best.found = true;
    best.v2 = m.v2;
    std::string rel = dir.size() > point.size() ? dir.substr(point == "/" ? 0 : point.size()) : "";
    best.path = (m.root == "/" ? std::string() : m.root) + rel;
    if (best.path.empty()) best.path = "/";
    best.controllers = m.controllers;
  }
  return best;
}

std::string own_group(const CgroupPlace& h, const std::string& proc) {
  std::ifstream in(proc + "/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    // ID:CONTROLLERS:PATH (v2: 0::PATH)
    const auto a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string ctrl = line.substr(a + 1, b - a - 1);
    if (h.v2 ? ctrl.empty() && line.compare(0, a, "0") == 0 : !ctrl.empty()) {
      if (!h.v2) {
        bool same = false;
        for (const std::string& c : split(ctrl, ','))
          same = same ||
                 std::find(h.controllers.begin(), h.controllers.end(), c) != h.controllers.end();
        if (!same) continue;
      }
      return line.substr(b + 1);
    }
  }
  return "";
}

namespace {

// The group Slurm made for job `id` in `path` (a group path of a process): `path` up to its
// component job_<id> (any job_<digits> when id is empty), "" when none. Slurm's cgroup plugins
// put a job's tasks below such a group (v1: /slurm/uid_U/job_J/step_S, v2:
// /system.slice/slurmstepd.scope/job_J/step_S/user/task_T).
std::string slurm_job_group(const std::string& path, const std::string& id) {
  std::string prefix;
  for (const std::string& c : split(path, '/')) {
    prefix += "/" + c;
    if (c.compare(0, 4, "job_") != 0 || c.size() == 4) continue;
    const std::string n = c.substr(4);
    if (!id.empty() ? n == id : n.find_first_not_of("0123456789") == std::string::npos)
      return prefix;
  }
  return "";
}

}  // namespace

std::string leaves_slurm_job(const CgroupPlace& to, const std::string& dir,
                             const std::string& job_id, const std::string& who) {
  if (!to.found) return "";
  const std::string job = slurm_job_group(own_group(to), job_id);
  if (job.empty()) return "";
  if (to.path == job || to.path.compare(0, job.size() + 1, job + "/") == 0) return "";
  std::string where = job;
  if (!to.v2) {  // which v1 hierarchy: its controllers, as /proc/PID/cgroup lists them
    where += " of the cgroup v1 hierarchy ";
    for (const std::string& c : to.controllers)
      if (c != "rw" && c != "ro") where += (where.back() == ' ' ? "" : ",") + c;
  }
  return who + " is in " + where + ", the group Slurm made for the job; " + dir +
         " lies outside it, and moving there would take it out of Slurm's limits "
         "(cores, memory) and accounting";
}

std::string enter(const CgroupPlace& to, const std::string& dir, pid_t pid) {
  if (to.found && own_group(to, "/proc/" + std::to_string(pid)) == to.path) return "";
  // The group's file as it is: never made where it is missing (a wrong path must not leave a
  // file behind, least of all one made by root).
  const int fd = ::open((dir + "/cgroup.procs").c_str(), O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return std::strerror(errno);
  const std::string line = std::to_string(pid) + "\n";
  const ssize_t n = ::write(fd, line.data(), line.size());
  const int err = n < 0 ? errno : n != static_cast<ssize_t>(line.size()) ? EIO : 0;
  ::close(fd);
  return err != 0 ? std::strerror(err) : "";
}

std::string trusted_record_problem(const std::string& path) {
  // The file (not through a link) and the folder it is in: owned by root, writable by no one else.
  const std::size_t slash = path.rfind('/');
  const std::string folder = slash == std::string::npos ? "."
                             : slash == 0               ? "/"
                                                        : path.substr(0, slash);
  struct stat file {
  }, dir{};
  if (::lstat(path.c_str(), &file) != 0) return path + ": " + std::strerror(errno);
  if (!S_ISREG(file.st_mode)) return path + " is not a regular file";
  if (::stat(folder.c_str(), &dir) != 0) return folder + ": " + std::strerror(errno);
  for (const auto& [p, st] :
       {std::pair<const std::string&, const struct stat&>{path, file}, {folder, dir}}) {
    if (st.st_uid != 0) return p + " is not owned by root (uid " + std::to_string(st.st_uid) + ")";
    if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) return p + " is writable by others than root";
  }
  return "";
}

std::string find_record(const std::string& state_dir, const std::string& job_id,
                        const std::string& cluster) {
  std::vector<std::string> candidates;
  if (!cluster.empty())
    candidates.push_back(state_dir + "/" + cluster + "/job-" + job_id + ".conf");
  candidates.push_back(state_dir + "/job-" + job_id + ".conf");
  for (const auto& p : candidates) {
    struct stat st;
    if (::stat(p.c_str(), &st) == 0) return p;
  }
  return "";
}

}  // namespace dt::qos::placement

namespace dt::qos {

namespace {

bool parse_int(const std::string& v, int lo, int hi, int* out) {
  if (v.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || x < lo || x > hi) return false;
  *out = static_cast<int>(x);
  return true;
}

}  // namespace

Tier read_record(const std::string& path) {
  std::ifstream in(path);
  DT_CHECK(ConfigError, in.good(), "QoS record '", path, "': cannot open (", std::strerror(errno),
           ")");
  Tier t;
  t.file = path;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty() || line[0] == '#') continue;
    const auto eq = line.find('=');
    DT_CHECK(ConfigError, eq != std::string::npos && eq > 0, "QoS record ", path, ":", n,
             ": expected key=value, got '", line, "'");
    const std::string k = line.substr(0, eq), v = line.substr(eq + 1);
    if (k == "tier") {
      t.name = v;
    } else if (k == "requested") {
      t.requested = v;
    } else if (k == "source") {
      t.source = v;
    } else if (k == "mode") {
      t.mode = v;
    } else if (k == "cgroup") {
      if (!v.empty()) t.cgroups.push_back(v);
    } else if (k == "weight") {
      DT_CHECK(ConfigError, parse_int(v, 0, 10000, &t.weight), "QoS record ", path, ":", n,
               ": weight '", v, "' is not a number in 0..10000");
    } else if (k == "fifo") {
      DT_CHECK(ConfigError, parse_int(v, 0, 99, &t.fifo), "QoS record ", path, ":", n, ": fifo '",
               v, "' is not a SCHED_FIFO priority in 0..99");
    }
    // Other keys (job, cpus, mems) are for people and the epilog.
  }
  DT_CHECK(ConfigError, !t.name.empty(), "QoS record ", path, ": no tier= line");
  if (t.requested.empty()) t.requested = t.name;
  return t;
}

}  // namespace dt::qos
