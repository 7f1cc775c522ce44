// Placing a process in its job's QoS cgroups: what a rank (dt::qos::configure) and the SPANK
// plugin of slurmstepd (src/qos/spank_dt_qos.cpp) share. Depends on the C++ library and
// dt/error.hpp only, so that the plugin carries no MPI, HDF5 or other library of libdt into
// slurmstepd.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace dt::qos::placement {

/// `s` split at `sep`, without empty pieces.
std::vector<std::string> split(const std::string& s, char sep);

/// A path as /proc/PID/mountinfo writes it, with space, tab, newline and backslash as octal
/// escapes (\040 ...), decoded.
std::string unescape(const std::string& s);

/// The cgroup hierarchy a directory lies in: its path inside the hierarchy ("/a/b"), and how
/// /proc/PID/cgroup names the hierarchy (v2: ""; v1: its controllers, e.g. {"cpu", "cpuacct"}).
struct CgroupPlace {
  bool found = false;
  bool v2 = false;
  std::string path;
  std::vector<std::string> controllers;
};

/// A cgroup file system as mounted: the hierarchy's group shown at the mount point (`root`, "/"
/// but in a container's view), and for v1 its controllers (the super options, e.g. "rw" too).
struct CgroupMount {
  std::string root, point;
  bool v2 = false;
  std::vector<std::string> controllers;
};

/// The cgroup and cgroup2 file systems of /proc/self/mountinfo, in its order.
std::vector<CgroupMount> cgroup_mounts();

/// Where `dir` lies among the cgroup file systems mounted (/proc/self/mountinfo; the mount whose
/// mount point is the longest prefix of dir, resolved through links first, as /sys/fs/cgroup/cpu
/// often is one). Not found: dir is on no cgroup file system (a test tree standing for one).
CgroupPlace cgroup_place(const std::string& dir);

/// The group of process `proc` ("/proc/self", "/proc/PID") in the hierarchy `h`, from its
/// cgroup file; "" when not listed.
std::string own_group(const CgroupPlace& h, const std::string& proc = "/proc/self");

/// Why moving this process into the cgroup directory `dir` (at `to`, its cgroup_place) would take
/// it out of the group Slurm's cgroup plugins made for job `job_id` (a group job_<job_id> in the
/// same hierarchy, which dir is not inside; an empty job_id: any job_<digits>); "" when it would
/// not, also where dir is on no cgroup file system. `who` begins the message ("this rank",
/// "task 3").
std::string leaves_slurm_job(const CgroupPlace& to, const std::string& dir,
                             const std::string& job_id, const std::string& who);

/// Moves process `pid` (its every thread) into the cgroup directory `dir` (at `to`, its
/// cgroup_place) by writing it to
/// dir/cgroup.procs, unless it is there already (then nothing is written: on cgroup v2 that
/// write would need the rights of a move). The file must exist (it is never created) and not be a
/// symbolic link. Returns "" or why the group refused it.
std::string enter(const CgroupPlace& to, const std::string& dir, pid_t pid);

/// Why the record `path` may not be trusted by a process running as root: "" when the file and
/// its folder are owned by root and writable by no one else, and the file is a regular file (not
/// a link). slurmstepd's plugin writes, as root, into each group a record names.
std::string trusted_record_problem(const std::string& path);

/// The calling thread's CPU affinity (empty where it cannot be read).
std::vector<unsigned char> affinity();

/// After a move into a cpuset group: kernels before 6.2 reset the thread's affinity to the whole
/// cpuset, losing the launcher's binding (srun --cpu-bind). Restores `before` within what the
/// cpuset now allows (newer kernels keep it, and then nothing changes). Returns why it could not.
std::string keep_affinity(const std::vector<unsigned char>& before);

/// The record slurm/prolog wrote for job `job_id` under `state_dir`: the first of
/// state_dir/CLUSTER/job-ID.conf (where `cluster` is not empty) and state_dir/job-ID.conf that
/// exists; "" when neither does.
std::string find_record(const std::string& state_dir, const std::string& job_id,
                        const std::string& cluster);

}  // namespace dt::qos::placement
