// The hang watchdog and time the process did not run (one rank).
//   test_watchdog stop   the process is stopped (SIGSTOP) for 4 s and continued (SIGCONT) while an
//                        operation with a 3.5 s limit is in flight: no hang. The record keeps its
//                        real duration (6.5 s) and says how long the process was stopped. (Were
//                        the stop counted, the watchdog would abort the job near 5.4 s.)
//   test_watchdog stop_early   the same, with the watchdog thread starting 0.6 s late (as on a
//                        loaded node): the stop begins before its first check and still does
//                        not count (the time before it, up to 0.6 s, counts as stopped too).
//   test_watchdog late   the watchdog thread itself runs 5 s late (kept off its CPU: no SIGCONT)
//                        while an operation with a 3 s limit is in flight: that time counts, and
//                        the watchdog aborts the job (exit 4) near 6 s, after the line "waiting"
//                        at 4.5 s (so not at 3 s, as without the late thread) and before the
//                        operation ends at 7.5 s.
//   test_watchdog groups 4 ranks in two groups of each of two splits, as a mesh of tp=2 and dp=2
//                        makes (dp first: {0,2} and {1,3}; then tp: {0,1} and {2,3}). Every rank
//                        runs a dp all_reduce; then rank 0 waits in a tp all_reduce that rank 1
//                        never joins, while ranks 2 and 3 run two of their own. The watchdog
//                        (2 s) must name rank 1 alone, judging the members of rank 0's tp group
//                        only: ranks 2 and 3 have no part in it, and rank 3 has run nothing on a
//                        communicator named like it.
//   test_watchdog chain  4 ranks, waits that lead to one rank: rank 3 receives from rank 2, which
//                        receives from rank 0 (as pipeline stages do), which waits in a tp
//                        all_reduce ({0,1}) that rank 1 never joins; rank 1 computes. Rank 3's
//                        receive is the oldest, so rank 3's watchdog reports first: its peer is
//                        rank 2, but the line must follow the waits and name rank 1.
//   test_watchdog silent 4 ranks: rank 3 stops its whole process (SIGSTOP) while the others wait
//                        for it in an all_reduce on world. Its watchdog cannot answer: the line
//                        says rank 3 did not answer, with its host (from the start of the job).
//   test_watchdog cycle  2 ranks receive from each other (as stages that wait in the wrong order
//                        would): neither waits for a third, and the line says the waits form a
//                        cycle among ranks 0 and 1.
//   test_watchdog samename  4 ranks in two groups {0,1} and {2,3} whose communicators have one
//                        name ("group", as each node's "world/node"): rank 3 receives from rank 0,
//                        which waits in an all_reduce of its group for rank 1. Rank 2 has run
//                        nothing on its own "group": it is not of rank 0's, and is not named.
#include <mpi.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "comm/mpi_comm.hpp"
#include "dt/watchdog.hpp"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

// The folder of the watchdog's dumps: watchdog-MODE in the working folder (the test's build
// folder under ctest), so that cases running at once do not write the same files, and a run
// leaves nothing outside the build.
std::string g_mode;
std::string dump_dir() {
  const std::string dir = "watchdog-" + g_mode;
  std::error_code ec;  // every rank makes it; one of them first
  std::filesystem::create_directories(dir, ec);
  return dir;
}

void sleep_until_after(Clock::time_point t0, double seconds) {
  const auto until =
      t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  while (Clock::now() < until) std::this_thread::sleep_until(until);
}

int stop_case(double start_late_s) {
  dt::watchdog::Settings s;
  s.timeout_s = 3.5;
  s.test_start_late_s = start_late_s;
  s.dump_dir = dump_dir();
  dt::watchdog::Watchdog wd(MPI_COMM_WORLD, s);
  dt::watchdog::OpRecord rec("test", 1, "all_reduce", "mpi", dt::DType::f32, 4);
  // A shell stops this process and continues it 4 s later, as `scontrol suspend` and `resume` do.
  const std::string script = "sleep 0.3; kill -STOP " + std::to_string(getpid()) +
                             "; sleep 4; kill -CONT " + std::to_string(getpid());
  const char* argv[] = {"sh", "-c", script.c_str(), nullptr};
  pid_t child = 0;
  if (posix_spawnp(&child, "sh", nullptr, nullptr, const_cast<char**>(argv), environ) != 0) {
    std::printf("FAIL: cannot start sh: %s\n", std::strerror(errno));
    return 1;
  }
  // The operation ends once the shell has continued the process and the watchdog has counted
  // the stop: it then lasted about 4.3 s, past the 3.5 s limit, all but about 0.3 s of them
  // stopped. (Ending it at a fixed time later instead left the running time near the limit,
  // which a loaded machine could pass.) Were the stop not counted, the watchdog would abort the
  // job within the 3 s of the wait below.
  int status = 0;
  while (waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  const auto waited = Clock::now();
  while (Clock::now() - waited < std::chrono::seconds(3)) {
    const auto now = nlohmann::json::parse(dt::watchdog::state_json(0));
    if (now["records"].back().value("stopped_s", 0.0) > 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  rec.complete();
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::printf("FAIL: the stopping shell did not succeed (status %d)\n", status);
    return 1;
  }
  const auto state = nlohmann::json::parse(dt::watchdog::state_json(0));
  const auto& r = state["records"].back();
  const double seconds = r.value("seconds", -1.0), stopped = r.value("stopped_s", 0.0);
  std::printf("record: %s\n", r.dump().c_str());
  // Stopped for 4 s (less what the scheduler took to stop it and the watchdog's 50 ms tick).
  // The watchdog knows a stop began only as "after its last check": before its thread's first
  // one, that is the construction, so up to start_late_s of running time counts as stopped.
  const double most = 4.5 + start_late_s;
  if (seconds < 4.0 || stopped < 3.5 || stopped > most) {
    std::printf("FAIL: expected a record of 4 s or more of which 3.5 to %.1f s stopped\n", most);
    return 1;
  }
  std::printf("PASS: stopped %.2f s of %.2f s with a 3.5 s limit, no hang reported\n", stopped,
              seconds);
  return 0;
}

int late_case() {
  dt::watchdog::Settings s;
  s.timeout_s = 3;
  s.dump_dir = dump_dir();
  s.test_late_once_s = 5;
  dt::watchdog::Watchdog wd(MPI_COMM_WORLD, s);
  const auto t0 = Clock::now();
  dt::watchdog::OpRecord rec("test", 1, "all_reduce", "mpi", dt::DType::f32, 4);
  sleep_until_after(t0, 4.5);
  std::printf("waiting at 4.5 s\n");
  std::fflush(stdout);
  sleep_until_after(t0, 7.5);
  rec.complete();
  std::printf("FAIL: an operation of 7.5 s with a 3 s limit was not reported\n");
  return 1;
}

// An operation in flight keeps its record while a thousand newer ones come and go (the flight
// recorder holds 256): the watchdog still reports it.
int buried_case() {
  dt::watchdog::Settings s;
  s.timeout_s = 2;
  s.dump_dir = dump_dir();
  dt::watchdog::Watchdog wd(MPI_COMM_WORLD, s);
  const auto t0 = Clock::now();
  dt::watchdog::OpRecord rec("test", 1, "all_reduce", "mpi", dt::DType::f32, 4);
  for (std::uint64_t i = 1; i <= 1000; ++i)
    dt::watchdog::OpRecord("busy", i, "all_reduce", "mpi", dt::DType::f32, 4).complete();
  sleep_until_after(t0, 6);
  rec.complete();
  std::printf(
      "FAIL: an operation of 6 s with a 2 s limit, under 1000 newer records, was not "
      "reported\n");
  return 1;
}

// The cases of several ranks: a watchdog of 2 s and the world communicator ("world").
struct Ranks {
  dt::watchdog::Watchdog wd;
  std::unique_ptr<dt::MpiComm> world = dt::MpiComm::dup(MPI_COMM_WORLD, "world");
  int me = world->rank();
  static dt::watchdog::Settings settings() {
    dt::watchdog::Settings s;
    s.timeout_s = 2;
    s.dump_dir = dump_dir();
    return s;
  }
  MPI_Comm p2p = MPI_COMM_NULL;  // for receives that never end
  Ranks() : wd(MPI_COMM_WORLD, settings()) { MPI_Comm_dup(MPI_COMM_WORLD, &p2p); }
  // A receive from world rank `from` that never ends, recorded as the pipeline records its own
  // (with the peer it waits for).
  void receive_forever(int from) const {
    const dt::watchdog::OpRecord rec("pipeline", 0, "recv", "p2p", dt::DType::f32, 1, -1, from);
    float x = 0;
    MPI_Recv(&x, 1, MPI_FLOAT, from, 7, p2p, MPI_STATUS_IGNORE);
  }
  // False (with a usage line) unless the job has n ranks.
  bool ok(int n, const char* mode) const {
    if (world->size() == n) return true;
    std::printf("usage: mpiexec -n %d test_watchdog %s\n", n, mode);
    return false;
  }
};

int groups_case() {
  Ranks f;
  if (!f.ok(4, "groups")) return 2;
  auto& world = f.world;
  const int me = f.me;
  auto dp = world->split_mpi(me % 2, me);
  auto tp = world->split_mpi(me / 2, me);
  float x = 1;
  dt::watchdog::set_activity("dp all_reduce");
  dp->all_reduce(dt::view_of(&x, 1), dt::ReduceOp::sum);
  if (me == 0) {
    dt::watchdog::set_activity("tp all_reduce");
    tp->all_reduce(dt::view_of(&x, 1), dt::ReduceOp::sum);  // rank 1 never comes
  } else if (me >= 2) {
    for (int i = 0; i < 2; ++i) tp->all_reduce(dt::view_of(&x, 1), dt::ReduceOp::sum);
  }
  dt::watchdog::set_activity(me == 1 ? "test: not joining the tp all_reduce" : "test: waiting");
  std::this_thread::sleep_for(std::chrono::seconds(20));
  std::printf("FAIL: rank %d: the watchdog did not end the job\n", me);
  return 1;
}

int chain_case() {
  Ranks f;
  if (!f.ok(4, "chain")) return 2;
  const int me = f.me;
  auto tp = f.world->split_mpi(me / 2, me);
  f.world->barrier();
  const auto t0 = Clock::now();
  float x = 1;
  if (me == 3) {
    dt::watchdog::set_activity("test: receiving from rank 2");
    f.receive_forever(2);
  } else if (me == 2) {
    sleep_until_after(t0, 0.4);
    dt::watchdog::set_activity("test: receiving from rank 0");
    f.receive_forever(0);
  } else if (me == 0) {
    sleep_until_after(t0, 0.8);
    dt::watchdog::set_activity("test: tp all_reduce");
    tp->all_reduce(dt::view_of(&x, 1), dt::ReduceOp::sum);  // rank 1 never comes
  } else {
    dt::watchdog::set_activity("test: computing", 3);
    sleep_until_after(t0, 20);
  }
  std::printf("FAIL: rank %d: the watchdog did not end the job\n", me);
  return 1;
}

int cycle_case() {
  Ranks f;
  if (!f.ok(2, "cycle")) return 2;
  f.world->barrier();
  dt::watchdog::set_activity("test: receiving");
  f.receive_forever(1 - f.me);
  std::printf("FAIL: rank %d: the watchdog did not end the job\n", f.me);
  return 1;
}

int samename_case() {
  Ranks f;
  if (!f.ok(4, "samename")) return 2;
  MPI_Comm half;
  MPI_Comm_split(MPI_COMM_WORLD, f.me / 2, f.me, &half);
  auto group = dt::MpiComm::dup(half, "group");
  f.world->barrier();
  float x = 1;
  if (f.me == 3) {
    dt::watchdog::set_activity("test: receiving from rank 0");
    f.receive_forever(0);
  } else if (f.me == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    dt::watchdog::set_activity("test: group all_reduce");
    group->all_reduce(dt::view_of(&x, 1), dt::ReduceOp::sum);  // rank 1 never comes
  } else {
    dt::watchdog::set_activity("test: computing", 3);
    std::this_thread::sleep_for(std::chrono::seconds(20));
  }
  std::printf("FAIL: rank %d: the watchdog did not end the job\n", f.me);
  return 1;
}

int silent_case() {
  Ranks f;
  if (!f.ok(4, "silent")) return 2;
  f.world->barrier();
  if (f.me == 3) {
    raise(SIGSTOP);  // the job's abort kills it (continuing it first, maybe: then it just ends)
    std::_Exit(0);
  }
  float x = 1;
  dt::watchdog::set_activity("test: all_reduce");
  f.world->all_reduce(dt::view_of(&x, 1), dt::ReduceOp::sum);
  std::printf("FAIL: rank %d: the watchdog did not end the job\n", f.me);
  return 1;
}

// Every rank has reached a collective (a pipeline's drain vote), but rank 1 left it running in
// the background (BackgroundScope, as a non-blocking collective read later is taken) and went on
// to compute, while ranks 0 and 2 wait for it with a limit: rank 1 is named as busy elsewhere. Only
// the records are made: the collective itself would need rank 1's progress in MPI.
int background_case() {
  Ranks f;
  if (!f.ok(3, "background")) return 2;
  f.world->barrier();
  if (f.me == 1) {
    dt::watchdog::OpRecord taken;
    {
      const dt::watchdog::BackgroundScope background;
      taken = dt::watchdog::OpRecord("vote", 1, "all_reduce", "mpi", dt::DType::i32, 1);
    }
    dt::watchdog::set_activity("test: computing", 3);
    std::this_thread::sleep_for(std::chrono::seconds(20));
  } else {
    const dt::watchdog::OpRecord waited("vote", 1, "all_reduce", "mpi", dt::DType::i32, 1);
    dt::watchdog::set_activity("test: waiting for the vote", 3);
    std::this_thread::sleep_for(std::chrono::seconds(20));
  }
  std::printf("FAIL: rank %d: the watchdog did not end the job\n", f.me);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  const std::string mode = argc > 1 ? argv[1] : "";
  g_mode = mode;
  const std::map<std::string, std::function<int()>> cases = {
      {"stop", [] { return stop_case(0); }},
      {"stop_early", [] { return stop_case(0.6); }},
      {"late", late_case},
      {"buried", buried_case},
      {"groups", groups_case},
      {"chain", chain_case},
      {"silent", silent_case},
      {"cycle", cycle_case},
      {"samename", samename_case},
      {"background", background_case}};
  int rc = 2;
  if (const auto it = cases.find(mode); it != cases.end()) {
    rc = it->second();
  } else {
    std::printf("usage: test_watchdog");
    for (const auto& [name, run] : cases) std::printf(" %s", name.c_str());
    std::printf("\n");
  }
  MPI_Finalize();
  return rc;
}
