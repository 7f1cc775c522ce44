// dt::watchdog: the flight recorder of every collective and the hang watchdog.
//
// Every collective a dt communicator runs is recorded in this process's flight recorder: the
// communicator's name, its sequence number on that communicator (the n-th collective called on
// it, the same on every rank), the operation, backend, dtype, size, and when it started and
// finished on this rank. Completing a record also feeds the dt_comm_* metrics and, when tracing
// is on, the timeline.
//
// The Watchdog (one per rank, started by the application after the runtime) checks the recorder
// every 50 ms. When a collective has been in flight longer than the timeout, it asks every
// other rank for its state over a communicator of its own (a duplicate of the world that only
// watchdog threads use, so a stuck collective elsewhere does not stop it), waits up to 5 s for
// the answers, then writes a dump (every rank's recent collectives, what each is doing, which
// ranks never reached the stuck collective) to DIR/dt-watchdog-rank<R>.json, prints one line
// naming the collective and the missing ranks, and aborts the job (MPI_Abort) with exit_code.
//
// Time the process spends stopped does not count towards the limits: a gap in the watchdog's
// checks during which, or within a second after which, a SIGCONT comes (Slurm's `scontrol
// suspend` and `resume` send SIGSTOP and SIGCONT) is forgiven; the records keep their real start
// and end, and the dt_comm_* seconds leave the stopped time out. A gap without a SIGCONT (the
// thread kept off its CPU, a debugger's pause) counts, a second later: set comm.timeout-s=0 and
// ckpt.timeout-s=0 to debug a rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <mpi.h>

#include "dt/dtype.hpp"

namespace dt::watchdog {

/// One operation in the flight recorder (move-only). complete() (or destruction) marks it done.
class OpRecord {
 public:
  OpRecord() = default;
  /// `op` and `backend` must be string literals. `timeout_s`: how long this operation may take
  /// before the watchdog calls it a hang (negative: the watchdog's timeout; 0: never). `peer`:
  /// for a point-to-point receive or send, the world rank it waits for (then `seq` is not counted
  /// as the communicator's collectives are); -1 for a collective. `communication`: false for an
  /// operation watched for hangs that the dt_comm_* metrics and the timeline's comm events leave
  /// out: one that moves no tensors between ranks (a checkpoint save), or a wait for part of an
  /// operation only (a pipeline's wait for a send to be received).
  OpRecord(const std::string& comm, std::uint64_t seq, const char* op, const char* backend, DType t,
           std::size_t count, double timeout_s = -1, int peer = -1,
           bool communication = true) noexcept;
  OpRecord(OpRecord&& o) noexcept : slot_(o.slot_), gen_(o.gen_) { o.slot_ = -1; }
  OpRecord& operator=(OpRecord&& o) noexcept;
  OpRecord(const OpRecord&) = delete;
  OpRecord& operator=(const OpRecord&) = delete;
  ~OpRecord() { complete(); }
  void complete() noexcept;

 private:
  long slot_ = -1;
  std::uint64_t gen_ = 0;
};

/// While alive, the operations this thread records without a limit of their own may take
/// `timeout_s` (0: any time) instead of the watchdog's timeout: for checkpoint saves and loads,
/// whose collectives wait for the slowest rank's reads or writes. Nests.
class LimitScope {
 public:
  explicit LimitScope(double timeout_s) noexcept;
  ~LimitScope();
  LimitScope(const LimitScope&) = delete;
  LimitScope& operator=(const LimitScope&) = delete;

 private:
  double prev_;
};

/// While alive, the operations this thread records run in the background: non-blocking, left
/// running while the rank works or waits elsewhere, and read later (a pipeline's drain vote).
/// They have no time limit (their reader watches the wait with a record of its own), a rank is
/// not taken to wait in one, and when every rank has reached one that does not complete, a rank
/// that left it running and waits in nothing else is named as busy elsewhere. They are left out
/// of the dt_comm_* metrics and the timeline's comm events (their time includes other work).
class BackgroundScope {
 public:
  BackgroundScope() noexcept;
  ~BackgroundScope();
  BackgroundScope(const BackgroundScope&) = delete;
  BackgroundScope& operator=(const BackgroundScope&) = delete;

 private:
  bool prev_;
};

/// Registers the world ranks of communicator `comm` (the name its records carry), so that a hang
/// on it is judged among its members alone: a rank outside it has not "not reached" it. A name
/// registered again takes the new members. Communicators without members registered are judged
/// among every rank.
void note_members(const std::string& comm, std::vector<int> world_ranks);

/// What the calling rank is doing, for the dump ("forward", "checkpoint save"); `what` must be a
/// string literal. `step` < 0: not in a step.
void set_activity(const char* what, std::int64_t step = -1) noexcept;

/// This rank's state as JSON: activity, per-communicator progress, the recent records.
std::string state_json(int rank);

struct Settings {
  double timeout_s = 600;  ///< 0: no limit for operations without one of their own
  /// LimitScopes with a limit above 0 will be used: the thread runs even when timeout_s is 0.
  /// (Neither: no watchdog thread; the recorder still records.)
  bool scoped_limits = false;
  std::string dump_dir = ".";
  int exit_code = 4;
  double test_late_once_s = 0;   ///< testing only: the thread's first check is this much late
  double test_start_late_s = 0;  ///< testing only: the thread starts this much after construction
};

/// For a rank that failed and is about to abort the job: asks every other rank, through the
/// running watchdog's thread, to write its timeline (--trace.dir; dt::trace::write), and waits
/// until all have answered or `wait_s` passed. `why` goes with the question. Does nothing
/// without a running watchdog or on one rank.
void collect_timelines(const std::string& why, double wait_s = 5.0) noexcept;

class Watchdog {
 public:
  /// Collective over `world` (duplicates it). Starts the thread unless timeout_s is 0 and
  /// scoped_limits is false.
  Watchdog(MPI_Comm world, const Settings& s);
  /// Stops the thread; call before MPI is finalised (destroy before the Runtime).
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dt::watchdog
