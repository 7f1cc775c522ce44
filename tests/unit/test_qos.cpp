// dt::qos: prolog records, the record a rank finds, cgroup joining and per-thread policies (read
// back from /proc, as an operator would).
#include <doctest/doctest.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "cpus.hpp"
#include "dt/error.hpp"
#include "dt/qos.hpp"
#include "qos/placement.hpp"
#include "temp_dir.hpp"

namespace {

using dt::test::allow_cpus;
using dt::test::allowed_cpus;
using dt::test::TempDir;

struct ThreadSched {
  int policy = -1;
  int rt_priority = -1;
  int nice = 99;
};

// Policy, real-time priority and nice value of thread `tid` of this process, from its stat file.
ThreadSched read_sched(long tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::istringstream rest(all.substr(all.rfind(')') + 2));  // fields from 3 (state) on
  std::string f;
  ThreadSched s;
  for (int field = 3; rest >> f; ++field) {
    if (field == 19) s.nice = std::stoi(f);
    if (field == 40) s.rt_priority = std::stoi(f);
    if (field == 41) s.policy = std::stoi(f);
  }
  return s;
}

// Runs apply_to_current_thread(role) on a new thread and returns that thread's scheduling.
ThreadSched applied(dt::qos::Role role) {
  ThreadSched s;
  std::thread t([&] {
    dt::qos::apply_to_current_thread(role);
    s = read_sched(::syscall(SYS_gettid));
  });
  t.join();
  return s;
}

struct Unconfigure {
  ~Unconfigure() { dt::qos::configure(dt::qos::Tier{}); }
};

}  // namespace

TEST_CASE("qos: a prolog record is read with every field") {
  TempDir dir;
  const auto p = dir.write("job-7.conf",
                           "# dt QoS record\njob=7\ntier=best_effort\nrequested=platinum\n"
                           "source=fallback from 'platinum'\nweight=25\nfifo=1\ncpus=0-1\nmems=0\n"
                           "mode=v1\ncgroup=/sys/fs/cgroup/cpu/dt/job_7\n"
                           "cgroup=/sys/fs/cgroup/cpuset/dt/job_7\n");
  const dt::qos::Tier t = dt::qos::read_record(p);
  CHECK(t.name == "best_effort");
  CHECK(t.requested == "platinum");
  CHECK(t.weight == 25);
  CHECK(t.fifo == 1);
  CHECK(t.mode == "v1");
  REQUIRE(t.cgroups.size() == 2);
  CHECK(t.cgroups[1] == "/sys/fs/cgroup/cpuset/dt/job_7");
  const std::string d = dt::qos::describe(t);
  CHECK(d.find("tier best_effort") != std::string::npos);
  CHECK(d.find("asked for tier 'platinum'") != std::string::npos);
  CHECK(d.find("SCHED_FIFO 1") != std::string::npos);
}

TEST_CASE("qos: a bad record is refused naming the file and line") {
  TempDir dir;
  auto msg = [](const std::string& path) {
    try {
      dt::qos::read_record(path);
    } catch (const dt::ConfigError& e) {
      return e.message();
    }
    return std::string("(no error)");
  };
  const auto bad_fifo = dir.write("a.conf", "tier=high\nfifo=120\n");
  CHECK(msg(bad_fifo).find(bad_fifo + ":2: fifo '120'") != std::string::npos);
  const auto no_eq = dir.write("b.conf", "tier=high\nnonsense\n");
  CHECK(msg(no_eq).find(no_eq + ":2: expected key=value") != std::string::npos);
  const auto no_tier = dir.write("c.conf", "fifo=3\n");
  CHECK(msg(no_tier).find("no tier= line") != std::string::npos);
  CHECK(msg(dir.path.string() + "/missing.conf").find("cannot open") != std::string::npos);
}

TEST_CASE("qos: the record a rank uses") {
  TempDir dir;
  dt::qos::Settings s;
  s.state_dir = dir.path.string();
  const char* old = std::getenv("SLURM_JOB_ID");
  const std::string saved = old ? old : "";
  ::setenv("SLURM_JOB_ID", "4242", 1);
  CHECK(dt::qos::record_path(s).empty());  // no record for this job: no tier
  const auto rec = dir.write("job-4242.conf", "tier=high\n");
  CHECK(dt::qos::record_path(s) == rec);
  // A record of the job's own cluster comes first (several local clusters on one machine).
  const char* old_cluster = std::getenv("SLURM_CLUSTER_NAME");
  const std::string saved_cluster = old_cluster ? old_cluster : "";
  ::setenv("SLURM_CLUSTER_NAME", "dt-c1", 1);
  CHECK(dt::qos::record_path(s) == rec);
  std::filesystem::create_directories(dir.path / "dt-c1");
  const auto own = dir.write("dt-c1/job-4242.conf", "tier=realtime\n");
  CHECK(dt::qos::record_path(s) == own);
  if (old_cluster)
    ::setenv("SLURM_CLUSTER_NAME", saved_cluster.c_str(), 1);
  else
    ::unsetenv("SLURM_CLUSTER_NAME");
  s.file = "none";
  CHECK(dt::qos::record_path(s).empty());
  s.file = dir.path.string() + "/nope.conf";
  CHECK_THROWS_AS(dt::qos::record_path(s), dt::ConfigError);
  s.file = rec;
  CHECK(dt::qos::record_path(s) == rec);
  ::unsetenv("SLURM_JOB_ID");
  s.file = "auto";
  CHECK(dt::qos::record_path(s).empty());
  if (old) ::setenv("SLURM_JOB_ID", saved.c_str(), 1);
}

TEST_CASE("qos: without a tier nothing changes") {
  Unconfigure reset;
  dt::qos::configure(dt::qos::Tier{});
  for (auto role : {dt::qos::Role::comm, dt::qos::Role::compute, dt::qos::Role::io}) {
    const ThreadSched s = applied(role);
    CHECK(s.policy == SCHED_OTHER);
    CHECK(s.rt_priority == 0);
  }
}

TEST_CASE("qos: each role gets its tier's policy") {
  Unconfigure reset;
  TempDir dir;
  // Stand-ins for the job's groups: configure() writes the process id into their cgroup.procs,
  // which a cgroup file system has in every group (configure() makes none).
  for (const char* g : {"cpu", "cpuset"}) {
    std::filesystem::create_directories(dir.path / g);
    std::ofstream(dir.path / g / "cgroup.procs");
  }
  dt::qos::Tier t;
  t.name = "high";
  t.fifo = 61;
  t.mode = "v1";
  t.cgroups = {(dir.path / "cpu").string(), (dir.path / "cpuset").string()};
  errno = 0;
  const int base = ::getpriority(PRIO_PROCESS, 0);
  const auto warnings = dt::qos::configure(t);
  CHECK(warnings.empty());
  for (const char* g : {"cpu", "cpuset"}) {
    std::ifstream in(dir.path / g / "cgroup.procs");
    long pid = 0;
    in >> pid;
    CHECK(pid == ::getpid());
  }
  CHECK(dt::qos::current().name == "high");

  const ThreadSched comm = applied(dt::qos::Role::comm);
  // The tier line says what the communication thread got.
  const std::string line = dt::qos::describe(dt::qos::current());
  if (comm.policy == SCHED_FIFO)
    CHECK(line.find("communication thread SCHED_FIFO 61") != std::string::npos);
  else
    CHECK(line.find("communication thread normal priority (SCHED_FIFO 61 refused: ") !=
          std::string::npos);
  sched_param sp{};
  sp.sched_priority = 1;
  // Whether this process may use SCHED_FIFO at all (root, CAP_SYS_NICE or RLIMIT_RTPRIO).
  std::thread probe([&] {
    if (pthread_setschedparam(pthread_self(), SCHED_FIFO, &sp) != 0) sp.sched_priority = 0;
  });
  probe.join();
  if (sp.sched_priority != 0) {
    CHECK(comm.policy == SCHED_FIFO);
    CHECK(comm.rt_priority == 61);
    // A thread the communication thread starts does not inherit its real-time policy.
    ThreadSched child;
    std::thread parent([&] {
      dt::qos::apply_to_current_thread(dt::qos::Role::comm);
      std::thread c([&] { child = read_sched(::syscall(SYS_gettid)); });
      c.join();
    });
    parent.join();
    CHECK(child.policy == SCHED_OTHER);
    CHECK(child.rt_priority == 0);
  } else {
    MESSAGE("SCHED_FIFO is not permitted here: the refusal path is checked instead");
    CHECK(comm.policy == SCHED_OTHER);
  }
  const ThreadSched compute = applied(dt::qos::Role::compute);
  CHECK(compute.policy == SCHED_OTHER);
  CHECK(compute.nice == base);
  const ThreadSched io = applied(dt::qos::Role::io);
  CHECK(io.policy == SCHED_BATCH);
  CHECK(io.nice == std::min(19, base + 10));
  // The main thread itself was given the compute policy by configure().
  CHECK(read_sched(::syscall(SYS_gettid)).policy == SCHED_OTHER);
}

std::vector<int> g_reset_to;  // what the move resets the affinity to (as kernels before 6.2 do)

TEST_CASE("qos: the rank keeps its CPU binding when the move into a cpuset resets it") {
  const std::vector<int> all = allowed_cpus();
  if (all.size() < 2) {
    MESSAGE("one CPU: no binding narrower than the cpuset to keep");
    return;
  }
  Unconfigure reset;
  TempDir dir;
  std::filesystem::create_directories(dir.path / "cpuset");
  std::ofstream(dir.path / "cpuset" / "cgroup.procs");
  dt::qos::Tier t;
  t.name = "high";
  t.mode = "v1";
  t.cgroups = {(dir.path / "cpuset").string()};
  // The launcher bound this rank to the last CPU; the move resets it to every CPU.
  allow_cpus({all.back()});
  g_reset_to = all;
  dt::qos::detail::after_move_for_test = [] { allow_cpus(g_reset_to); };
  const auto warnings = dt::qos::configure(t);
  dt::qos::detail::after_move_for_test = nullptr;
  const std::vector<int> after = allowed_cpus();
  allow_cpus(all);
  CHECK(warnings.empty());
  CHECK(after == std::vector<int>{all.back()});
}

TEST_CASE("qos: a group that refuses the rank is a warning, not an error") {
  Unconfigure reset;
  TempDir dir;
  dt::qos::Tier t;
  t.name = "best_effort";
  t.cgroups = {(dir.path / "missing").string()};
  const auto warnings = dt::qos::configure(t);
  REQUIRE(warnings.size() == 1);
  CHECK(warnings[0].find("cannot move this rank") != std::string::npos);
  CHECK(warnings[0].find(dir.path.string() + "/missing") != std::string::npos);
  // A folder that is no group (no cgroup.procs) gets no file made in it.
  std::filesystem::create_directories(dir.path / "plain");
  t.cgroups = {(dir.path / "plain").string()};
  CHECK(dt::qos::configure(t).size() == 1);
  CHECK_FALSE(std::filesystem::exists(dir.path / "plain" / "cgroup.procs"));
  t.cgroups = {(dir.path / "missing").string()};
  dt::qos::configure(t);
  // The tier as it applies says so: the group is listed as not entered, not as the rank's.
  const dt::qos::Tier now = dt::qos::current();
  CHECK(now.not_entered == t.cgroups);
  const std::string d = dt::qos::describe(now);
  CHECK(d.find("cgroup none (not entered: " + dir.path.string() + "/missing)") !=
        std::string::npos);
}

namespace {

// The mount point of a cgroup v2 hierarchy ("" when none).
std::string cgroup2_mount() {
  std::ifstream in("/proc/self/mounts");
  std::string dev, point, type, rest;
  while (in >> dev >> point >> type && std::getline(in, rest))
    if (type == "cgroup2") return point;
  return "";
}

// A group for a test under the cgroup v2 hierarchy: MOUNT/dt-unit-NAME-PID, not made yet; "" (the
// test says it is skipped) where there is no hierarchy this process may change.
std::string cgroup2_test_group(const std::string& name) {
  const std::string mount = cgroup2_mount();
  if (mount.empty() || ::geteuid() != 0) {
    MESSAGE("no cgroup v2 hierarchy this process may change: not tested here");
    return "";
  }
  return mount + "/dt-unit-" + name + std::to_string(::getpid());
}

}  // namespace

TEST_CASE("qos: a rank in Slurm's job group is not moved out of it (cgroup v2)") {
  // Slurm's cgroup/v2 layout of a job's task, and a group outside the job like the prolog's.
  const std::string top = cgroup2_test_group("");
  if (top.empty()) return;
  const std::string mount = cgroup2_mount();
  const std::string job = top + "/slurmstepd.scope/job_4242", task = job + "/step_0/user/task_0";
  const std::string outside = top + "/dt/job_4242", inside = job + "/step_0/user/task_1";
  std::error_code ec;
  std::filesystem::create_directories(task, ec);
  std::filesystem::create_directories(inside, ec);
  std::filesystem::create_directories(outside, ec);
  if (ec) {
    MESSAGE("cannot make groups under " << mount << " (" << ec.message() << "): not tested here");
    std::filesystem::remove(top, ec);
    return;
  }
  // A child joins the task's group (this process stays where it is) and reports each answer as
  // a bit of its exit code.
  const pid_t child = ::fork();
  if (child == 0) {
    std::ofstream(task + "/cgroup.procs") << ::getpid() << '\n';
    int bits = 0;
    ::setenv("SLURM_JOB_ID", "4242", 1);
    const std::string why = dt::qos::detail::leaves_slurm_job(outside);
    if (why.find("/dt-unit-" + std::to_string(::getppid()) + "/slurmstepd.scope/job_4242,") !=
            std::string::npos &&
        why.find(outside) != std::string::npos)
      bits |= 1;
    if (dt::qos::detail::leaves_slurm_job(inside).empty()) bits |= 2;
    if (dt::qos::detail::leaves_slurm_job(job).empty()) bits |= 4;
    // Named through a link (as /sys/fs/cgroup/cpu often is, to cpu,cpuacct): the same group.
    const std::string link = "/tmp/dt-unit-cglink-" + std::to_string(::getpid());
    if (::symlink(top.c_str(), link.c_str()) == 0 &&
        !dt::qos::detail::leaves_slurm_job(link + "/dt/job_4242").empty())
      bits |= 64;
    ::unlink(link.c_str());
    ::setenv("SLURM_JOB_ID", "4243", 1);  // another job's group: not this job's to keep
    if (dt::qos::detail::leaves_slurm_job(outside).empty()) bits |= 8;
    ::unsetenv("SLURM_JOB_ID");  // outside Slurm's environment: any job_<number> counts
    if (!dt::qos::detail::leaves_slurm_job(outside).empty()) bits |= 16;
    if (dt::qos::detail::leaves_slurm_job("/tmp").empty()) bits |= 32;  // no cgroup fs
    ::_exit(bits);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  for (const std::string& g : {task, inside, job + "/step_0/user", job + "/step_0", job, outside,
                               top + "/dt", top + "/slurmstepd.scope", top})
    ::rmdir(g.c_str());
  CHECK_FALSE(std::filesystem::exists(top));
  REQUIRE(WIFEXITED(status));
  const int bits = WEXITSTATUS(status);
  CHECK_MESSAGE((bits & 1) != 0, "a group outside the job's is refused, naming both");
  CHECK_MESSAGE((bits & 2) != 0, "a group inside the job's is allowed");
  CHECK_MESSAGE((bits & 4) != 0, "the job's group itself is allowed");
  CHECK_MESSAGE((bits & 8) != 0, "another job's number is no reason to stay");
  CHECK_MESSAGE((bits & 16) != 0, "without SLURM_JOB_ID any job_<number> group is kept");
  CHECK_MESSAGE((bits & 32) != 0, "a directory on no cgroup file system is allowed");
  CHECK_MESSAGE((bits & 64) != 0, "a group named through a link is found as mounted");
}

TEST_CASE("qos: on cgroup v2 a rank already in its group stays; root moves what a user may not") {
  // Two groups like the prolog's ROOT/dt/job_J, with cgroup.procs given to the job's user
  // (65534) in one of them, as slurm/prolog does.
  const std::string top = cgroup2_test_group("enter-");
  if (top.empty()) return;
  const std::string mount = cgroup2_mount();
  const std::string here = top + "/here", there = top + "/there";
  std::error_code ec, ec2;
  std::filesystem::create_directories(here, ec);
  std::filesystem::create_directories(there, ec2);
  if (ec || ec2 || ::chown((there + "/cgroup.procs").c_str(), 65534, 65534) != 0) {
    MESSAGE("cannot make groups under " << mount << ": not tested here");
    std::filesystem::remove(here, ec);
    std::filesystem::remove(there, ec);
    std::filesystem::remove(top, ec);
    return;
  }
  int result[2], release[2];
  REQUIRE(::pipe(result) == 0);
  REQUIRE(::pipe(release) == 0);
  const pid_t child = ::fork();
  if (child == 0) {
    // Put in `here` by root (as the SPANK plugin does), then an ordinary user.
    std::ofstream(here + "/cgroup.procs") << ::getpid() << '\n';
    char bits = 0;
    if (::setgid(65534) == 0 && ::setuid(65534) == 0) {
      Unconfigure reset;
      dt::qos::Tier t;
      t.name = "high";
      t.cgroups = {here};
      if (dt::qos::configure(t).empty() && dt::qos::current().not_entered.empty()) bits |= 1;
      // Into a sibling group: the move needs the cgroup.procs of the common ancestor (`top`,
      // root's), which the user may not write, even with the target's own file given to it.
      t.cgroups = {there};
      const auto w = dt::qos::configure(t);
      if (w.size() == 1 && w[0].find("cannot move this rank") != std::string::npos &&
          w[0].find(there) != std::string::npos)
        bits |= 2;
    }
    (void)!::write(result[1], &bits, 1);
    char c;
    (void)!::read(release[0], &c, 1);
    ::_exit(0);
  }
  char bits = 0;
  REQUIRE(::read(result[0], &bits, 1) == 1);
  // Root moves it (what slurmstepd's plugin does for every task of the job).
  const std::string moved =
      dt::qos::placement::enter(dt::qos::placement::cgroup_place(there), there, child);
  std::ifstream cg("/proc/" + std::to_string(child) + "/cgroup");
  const std::string where((std::istreambuf_iterator<char>(cg)), std::istreambuf_iterator<char>());
  (void)!::write(release[1], "x", 1);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  for (int fd : {result[0], result[1], release[0], release[1]}) ::close(fd);
  ::rmdir(here.c_str());
  ::rmdir(there.c_str());
  ::rmdir(top.c_str());
  CHECK_FALSE(std::filesystem::exists(top));
  CHECK_MESSAGE((bits & 1) != 0, "a rank already in its group is not written again, nor warned");
  CHECK_MESSAGE((bits & 2) != 0, "an ordinary user's move under the root group is refused");
  CHECK(moved.empty());
  CHECK(where.find("0::" + top.substr(mount.size()) + "/there\n") != std::string::npos);
}

TEST_CASE("qos: the record slurmstepd's plugin trusts is root's alone") {
  TempDir dir;
  const std::string rec = (dir.path / "job-7.conf").string();
  std::ofstream(rec) << "tier=high\n";
  ::chmod(dir.path.c_str(), 0755);
  ::chmod(rec.c_str(), 0644);
  if (::geteuid() != 0) {
    CHECK(dt::qos::placement::trusted_record_problem(rec).find("is not owned by root") !=
          std::string::npos);
    return;
  }
  CHECK(dt::qos::placement::trusted_record_problem(rec).empty());
  ::chmod(rec.c_str(), 0664);
  CHECK(dt::qos::placement::trusted_record_problem(rec) ==
        rec + " is writable by others than root");
  ::chmod(rec.c_str(), 0644);
  ::chmod(dir.path.c_str(), 0777);
  CHECK(dt::qos::placement::trusted_record_problem(rec) ==
        dir.path.string() + " is writable by others than root");
  ::chmod(dir.path.c_str(), 0755);
  REQUIRE(::chown(rec.c_str(), 65534, 65534) == 0);
  CHECK(dt::qos::placement::trusted_record_problem(rec) ==
        rec + " is not owned by root (uid 65534)");
  REQUIRE(::chown(rec.c_str(), 0, 0) == 0);
  const std::string link = (dir.path / "job-8.conf").string();
  REQUIRE(::symlink(rec.c_str(), link.c_str()) == 0);
  CHECK(dt::qos::placement::trusted_record_problem(link) == link + " is not a regular file");
  CHECK(dt::qos::placement::trusted_record_problem((dir.path / "none").string())
            .find("No such file") != std::string::npos);
}

TEST_CASE("qos: a FIFO priority the process may not take is said in the tier line") {
  if (::geteuid() != 0) {
    MESSAGE("not root: cannot become an ordinary user to test this");
    return;
  }
  // An ordinary user without RLIMIT_RTPRIO, as a job's rank is on most clusters.
  const pid_t child = ::fork();
  if (child == 0) {
    rlimit none{0, 0};
    int bits = 0;
    if (::setrlimit(RLIMIT_RTPRIO, &none) == 0 && ::setgid(65534) == 0 && ::setuid(65534) == 0) {
      Unconfigure reset;
      dt::qos::Tier t;
      t.name = "high";
      t.fifo = 60;
      dt::qos::configure(t);
      const dt::qos::Tier now = dt::qos::current();
      if (now.fifo_refused == std::strerror(EPERM)) bits |= 1;
      const std::string d = dt::qos::describe(now);
      if (d.find("communication thread normal priority (SCHED_FIFO 60 refused: " +
                 std::string(std::strerror(EPERM)) + ")") != std::string::npos)
        bits |= 2;
      t.fifo = 0;  // no FIFO asked: nothing refused
      dt::qos::configure(t);
      if (dt::qos::current().fifo_refused.empty()) bits |= 4;
    }
    ::_exit(bits);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  CHECK_MESSAGE((WEXITSTATUS(status) & 1) != 0, "the refusal is found");
  CHECK_MESSAGE((WEXITSTATUS(status) & 2) != 0, "the tier line says it");
  CHECK_MESSAGE((WEXITSTATUS(status) & 4) != 0, "no FIFO asked, none refused");
}
