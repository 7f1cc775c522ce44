// Pass/fail harness of the MPI tests: every rank runs every case, failures are printed as
// "rank R: FAIL <what>: <details>" and counted instead of ending the run (so one failing rank
// never leaves the others waiting in a collective), and finish() adds up all ranks' counts with
// MPI directly, independent of the communicators under test.
#pragma once

#include <mpi.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <initializer_list>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dt/comm.hpp"
#include "dt/tensor.hpp"

namespace dt_test {

struct Harness {
  int rank = 0;
  std::string prefix;  ///< printed before each failure's `what` (e.g. the transport under test)
  long fails = 0;
  long checks = 0;
  static constexpr long kMaxPrinted = 200;

  void fail(const std::string& what, const std::string& details) {
    ++fails;
    if (fails <= kMaxPrinted) {
      std::printf("rank %d: FAIL %s%s%s: %s\n", rank, prefix.c_str(), prefix.empty() ? "" : " ",
                  what.c_str(), details.c_str());
      std::fflush(stdout);
    } else if (fails == kMaxPrinted + 1) {
      std::printf("rank %d: further failures not printed\n", rank);
      std::fflush(stdout);
    }
  }
  bool expect(bool ok, const std::string& what, const std::string& details) {
    ++checks;
    if (!ok) fail(what, details);
    return ok;
  }
  /// Collective over MPI_COMM_WORLD: rank 0 prints "NAME: all N checks passed on R ranks (S s)"
  /// or "NAME: F of N checks FAILED on R ranks (failing ranks: ...; S s)" (or that no checks ran,
  /// which fails too). Returns the exit code.
  int finish(const char* name, double seconds) const {
    long local[2] = {fails, checks}, total[2] = {0, 0};
    MPI_Allreduce(local, total, 2, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    std::string failing;
    long mine = fails;
    for (int r = 0; r < size; ++r) {
      long f = mine;
      MPI_Bcast(&f, 1, MPI_LONG, r, MPI_COMM_WORLD);
      if (f) failing += (failing.empty() ? "" : ",") + std::to_string(r);
    }
    if (rank == 0) {
      if (total[1] == 0)
        std::printf("%s: FAILED: no checks ran on %d ranks\n", name, size);
      else if (total[0] == 0)
        std::printf("%s: all %ld checks passed on %d ranks (%.1f s)\n", name, total[1], size,
                    seconds);
      else
        std::printf("%s: %ld of %ld checks FAILED on %d ranks (failing ranks: %s; %.1f s)\n", name,
                    total[0], total[1], size, failing.c_str(), seconds);
      std::fflush(stdout);
    }
    return total[0] == 0 && total[1] > 0 ? 0 : 1;
  }
};

inline Harness H;

template <class... P>
std::string str(P&&... parts) {
  std::ostringstream os;
  ((os << std::forward<P>(parts)), ...);
  return os.str();
}

inline bool contains(const std::string& s, const std::string& sub) {
  return s.find(sub) != std::string::npos;
}

/// Runs f; any exception is a failure of `what` (so one broken case does not end the run).
template <class F>
void guarded(const std::string& what, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    H.fail(what, str("unexpected exception: ", e.what()));
  }
}

/// f must throw exactly E; every needle must appear in the message. Returns the message.
template <class E, class F>
std::string expect_throw(const std::string& what, F&& f,
                         std::initializer_list<std::string> needles = {}) {
  ++H.checks;
  try {
    f();
    H.fail(what, "no exception thrown");
  } catch (const E& e) {
    for (const std::string& needle : needles)
      if (!contains(e.what(), needle))
        H.fail(what, str("message lacks '", needle, "': ", e.what()));
    return e.what();
  } catch (const std::exception& e) {
    H.fail(what, str("wrong exception type: ", e.what()));
  }
  return {};
}

/// Now on the machine's monotonic clock, in nanoseconds. Every rank of these test runs is on one
/// machine (the multi-node runs too: network namespaces on one host), so ranks compare these.
inline std::int64_t monotonic_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// CPU seconds the calling thread has run.
inline double thread_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

/// One CPU shared with a thread that wants all of it: pins the calling thread to the first CPU it
/// may run on and starts a thread that spins there until destruction, when the caller's CPU set
/// comes back. Threads the caller starts meanwhile inherit the pin. What tells a wait that gives
/// its core away from one that keeps it: a thread that spins inside a blocking MPI wait gets about
/// as much of the CPU as the spinner; one that yields or sleeps between polls a small part of it.
class SharedCore {
 public:
  SharedCore() {
    sched_getaffinity(0, sizeof saved_, &saved_);
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &saved_)) {
        cpu_ = c;
        break;
      }
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu_, &one);
    sched_setaffinity(0, sizeof one, &one);
    spinner_ = std::thread([this] {
      while (!stop_.load(std::memory_order_relaxed)) {
      }
    });
    pthread_getcpuclockid(spinner_.native_handle(), &clock_);
  }
  ~SharedCore() {
    stop_ = true;
    spinner_.join();
    sched_setaffinity(0, sizeof saved_, &saved_);
  }
  SharedCore(const SharedCore&) = delete;
  SharedCore& operator=(const SharedCore&) = delete;
  int cpu() const { return cpu_; }
  /// CPU seconds the spinning thread has run.
  double spinner_cpu_s() const {
    timespec ts{};
    clock_gettime(clock_, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
  }

 private:
  cpu_set_t saved_{};
  int cpu_ = 0;
  std::atomic<bool> stop_{false};
  std::thread spinner_;
  clockid_t clock_{};
};

/// A barrier of `c` that rank 0 entered late: no rank may leave it before rank 0 entered. Every
/// rank passes when it entered and when it left; one all_reduce (max) on `c` tells every rank when
/// rank 0 entered. Causal, so it holds however late any rank gets the CPU.
inline void expect_left_after_rank0(dt::Comm& c, std::int64_t entered, std::int64_t left,
                                    const std::string& what) {
  std::int64_t rank0_entered = c.rank() == 0 ? entered : 0;
  c.all_reduce(dt::view_of(&rank0_entered, 1), dt::ReduceOp::max);
  if (c.rank() != 0) {
    ++H.checks;
    if (left < rank0_entered)
      H.fail(what, str("left ", static_cast<double>(rank0_entered - left) / 1e6,
                       " ms before rank 0 entered"));
  }
}

/// The forms every call of a communicator is checked in: blocking, blocking with a timeout,
/// blocking with the polled wait of real-time threads (kPolledWait), and non-blocking completed
/// by wait() or by polling test().
enum class Form { blocking, timeout, polled, iwait, itest };
constexpr Form kForms[] = {Form::blocking, Form::timeout, Form::polled, Form::iwait, Form::itest};
constexpr int kFormCount = static_cast<int>(sizeof kForms / sizeof kForms[0]);
inline const char* form_name(Form f) {
  switch (f) {
    case Form::blocking:
      return "blocking";
    case Form::timeout:
      return "blocking+timeout";
    case Form::polled:
      return "blocking+polled";
    case Form::iwait:
      return "i*+wait";
    case Form::itest:
      return "i*+test";
  }
  return "?";
}
inline bool nonblocking(Form f) { return f == Form::iwait || f == Form::itest; }
inline dt::CommOptions opts_for(Form f) {
  dt::CommOptions o;
  if (f == Form::timeout) o.timeout = dt::Millis(120000);
  if (f == Form::polled) o.timeout = dt::kPolledWait;
  return o;
}

/// Completes every Work in `ws` by wait() or by polling test(); each must then test() true.
inline void complete(Form f, std::vector<dt::Work*> ws) {
  if (f == Form::itest) {
    std::vector<bool> done(ws.size(), false);
    for (bool all = false; !all;) {
      all = true;
      for (std::size_t k = 0; k < ws.size(); ++k) {
        if (!done[k]) done[k] = ws[k]->test();
        all = all && done[k];
      }
      if (!all) std::this_thread::yield();
    }
  } else {
    for (dt::Work* w : ws) w->wait();
  }
  for (dt::Work* w : ws) H.expect(w->test(), "Work::test after completion", "returned false");
}

/// Runs the blocking call (blocking/timeout forms) or the non-blocking one plus completion.
template <class B, class NB>
void run_form(Form f, B&& blocking, NB&& start) {
  if (nonblocking(f)) {
    dt::Work w = start();
    H.expect(w.valid(), "Work::valid", "non-blocking call returned an empty Work");
    complete(f, {&w});
  } else {
    blocking(opts_for(f));
  }
}

/// The main() of an MPI test: MPI_Init_thread (multiple), `usage` (exit 2) when fewer than
/// `args` arguments follow the program name, then body(argv) with exceptions counted as
/// failures, then H.finish(name) and MPI_Finalize.
template <class Body>
int mpi_test_main(int argc, char** argv, const char* name, int args, const char* usage,
                  Body&& body) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &H.rank);
  const auto t0 = std::chrono::steady_clock::now();
  if (argc < args + 1) {
    if (H.rank == 0) std::fprintf(stderr, "usage: %s %s\n", name, usage);
    MPI_Finalize();
    return 2;
  }
  try {
    body(argv);
  } catch (const std::exception& e) {
    H.fail("run", e.what());
  }
  const int rc =
      H.finish(name, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  MPI_Finalize();
  return rc;
}

}  // namespace dt_test
