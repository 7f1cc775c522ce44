// dt::qos: the job's QoS tier inside each rank.
//
// On a Slurm node, slurm/prolog gives each job a tier from configs/qos.ini (realtime, high,
// best_effort), makes the job's cgroup with the tier's CPU weight and cpuset, and records what it
// did in DT_QOS_STATE_DIR/job-<id>.conf (key=value lines, see slurm/prolog). A rank learns its
// tier from that record (options qos.file and qos.state-dir), moves itself into the job's
// cgroup(s) (never out of the group Slurm's cgroup plugins made for the job), and then each of
// its threads takes the policy of its role:
//
//   Role::comm     the communication progress thread (named "dt-progress"): SCHED_FIFO at the
//                  tier's priority (the low end of the tier's fifo range). It must block (condition
//                  variables, blocking waits), never busy-poll: a FIFO thread that spins starves
//                  every other thread and rank on its core.
//   Role::compute  the main (training) thread: SCHED_OTHER at the process's nice value. It busy-
//                  polls inside MPI calls, so it never runs SCHED_FIFO.
//   Role::io       checkpoint writers ("dt-ckpt") and metrics: SCHED_BATCH at the process's nice
//                  value + 10 (capped at 19): about a tenth of a core's time while compute wants
//                  it, all of it when compute waits.
//
// comm strictly precedes compute and io (real-time class); compute precedes io by weight (1024
// against 110 per CFS share) rather than strictly, so a checkpoint writer that other ranks wait
// for in a collective can never be starved for good (no livelock when ranks outnumber cores).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dt {
class Options;
}

namespace dt::qos {

enum class Role { comm, compute, io };

/// Where a rank finds its tier: options qos.file and qos.state-dir.
struct Settings {
  std::string file = "auto";  ///< auto | none | PATH of a record
  std::string state_dir = "/run/dt-qos";
};

/// Registers qos.file and qos.state-dir on `o`, writing into `s`.
void add_options(Options& o, Settings& s);

/// A job's tier as slurm/prolog recorded it.
struct Tier {
  std::string name;       ///< realtime | high | best_effort; "" when no tier is configured
  std::string requested;  ///< what the job asked for (differs from name after a fallback)
  std::string source;     ///< comment | slurm-qos NAME | default | fallback from 'X'
  int weight = 0;         ///< the cgroup CPU weight the prolog set (v2 scale)
  int fifo = 0;           ///< SCHED_FIFO priority of Role::comm (1-99); 0: left as it is
  std::string mode;       ///< v1 | v2 | none: the cgroup version the prolog found
  std::vector<std::string> cgroups;  ///< the job's group directories (v1: one per controller)
  std::string file;                  ///< the record it was read from
  /// Of cgroups, those configure() did not move this process into (Slurm's group of the job
  /// holds it there, or the group refused it); empty in a record.
  std::vector<std::string> not_entered;
  /// Why this process may not run a thread SCHED_FIFO at `fifo` (configure() tries it on a thread
  /// of its own, in the groups it entered: an ordinary user without RLIMIT_RTPRIO, a group without
  /// a real-time budget); "" where it may, or fifo is 0. Empty in a record.
  std::string fifo_refused;
};

/// The record `s` points at: "" for none. auto (when SLURM_JOB_ID is set): the first of
/// state_dir/$SLURM_CLUSTER_NAME/job-$SLURM_JOB_ID.conf and state_dir/job-$SLURM_JOB_ID.conf
/// that exists, else none. Throws dt::ConfigError when qos.file
/// names a file that does not exist.
std::string record_path(const Settings& s);

/// Reads a record. Throws dt::ConfigError naming the file (and line) when it cannot be read, a
/// line is not key=value, a number is not a number, or the tier name is missing.
Tier read_record(const std::string& path);

/// Makes `t` the process's tier (an empty name: none); current() then holds it with the groups
/// this process stayed out of (Tier::not_entered). Moves the whole process into each of
/// t.cgroups (writes its pid to cgroup.procs where it is not there already, as slurmstepd's
/// plugin spank_dt_qos.so leaves a task) except those that would take it out of Slurm's
/// group of the job (detail::leaves_slurm_job; warned about); a group that refuses is warned about
/// on stderr, once each, by the node's first rank (launcher_local_rank() 0 or none; the others
/// find the same), and the process goes on where it is. The calling thread keeps its CPU
/// binding within what the groups allow (kernels before 6.2 reset it to the whole cpuset on the
/// move). Applies Role::compute to the calling thread. Call from the main thread before the threads
/// that call apply_to_current_thread start. Returns the warnings it printed (for tests). Never
/// throws.
std::vector<std::string> configure(const Tier& t) noexcept;

namespace detail {
/// Testing only: called by configure() after it has moved the process into its groups (to stand
/// for a kernel that resets the affinity there).
extern void (*after_move_for_test)();
/// Why moving this process into the cgroup directory `dir` would take it out of the group Slurm's
/// cgroup plugins made for its job (a group job_<SLURM_JOB_ID> in the same hierarchy, which dir
/// is not inside); "" when it would not, also where dir is on no cgroup file system.
/// configure() leaves such a group alone: Slurm's cores, memory limit and accounting hold the
/// rank, not the tier's cpuset.
std::string leaves_slurm_job(const std::string& dir);
}  // namespace detail

/// The memory this process may still take, in bytes: the least of the node's MemAvailable plus
/// SwapFree (/proc/meminfo) and, for its memory cgroup and each group above it (v2 memory.max
/// less memory.current, v1 memory.limit_in_bytes less memory.usage_in_bytes, the inactive page
/// cache not counted as used), the room under each limit set, plus the node's free swap. An upper
/// bound: what exceeds it cannot be had. `where` (if given) gets what set the figure
/// ("/proc/meminfo" or the group's limit file). 0 with `where` empty when none can be read. Never
/// throws.
std::uint64_t memory_available(std::string* where = nullptr) noexcept;

/// The tier configure() installed (name "" when none).
Tier current();

/// One line describing the tier for the job log, e.g. "tier high (comment): cgroup v1 ...,
/// communication thread SCHED_FIFO 60" ("normal priority (SCHED_FIFO 60 refused: WHY)" where
/// configure() found it refused); a fallback names the tier that was asked for.
std::string describe(const Tier& t);

/// Applies the job's tier policy for `role` to the calling thread (see the roles above). comm:
/// SCHED_FIFO with the tier's priority where permitted. Never throws; a refused policy logs one
/// warning per process and role and the thread keeps its current policy. A no-op when no tier is
/// configured.
void apply_to_current_thread(Role role) noexcept;

}  // namespace dt::qos
