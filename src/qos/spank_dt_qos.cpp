// spank_dt_qos.so: a SPANK plugin of slurmstepd that puts every task of a job into the QoS groups
// slurm/prolog made for it, before the task runs its program.
//
// A rank of dt_train moves itself into those groups (dt::qos::configure). On cgroup v2 it may do
// so only where it may write the cgroup.procs of the common ancestor of where it is and where it
// goes: the root's for ROOT/dt/job_J, so an ordinary user's ranks stay out and keep the tier's
// thread policies without its CPU weight and cpuset. slurmstepd runs this plugin as root in each
// task between fork and exec (slurm_spank_task_init_privileged), so every task of the job (the
// batch script, each srun task, and all they start) is in the tier's groups from its first
// instruction, on v1 and v2 alike, whoever runs it.
//
// Rules are those of a rank: the record of the job (slurm/prolog's STATE_DIR/job-ID.conf, a file
// root alone may write, in a folder root alone may write) names the groups, each of which must
// be a group of a cgroup file system; a group that would take the task out of the group Slurm's
// cgroup plugins made for the job is left alone (where those plugins place the task after this
// plugin, their placement comes last, so the task ends in Slurm's group either way: under
// Slurm's cgroup/v2 plugins, whose one hierarchy holds every controller, dt's groups are never
// entered); a task already in a group is not written again; the task's CPU affinity is kept
// within the new cpuset. No record (a job before the prolog ran, or a site without dt's prolog):
// nothing is done. A failure is logged and never fails the task: a job runs without its tier
// rather than not at all, as the prolog never drains a node.
//
// plugstack.conf (one line; state_dir is the prolog's DT_QOS_STATE_DIR, default /run/dt-qos; an
// argument it does not take is logged and leaves the plugin out):
//   optional /opt/dt/lib/dt/slurm/spank_dt_qos.so state_dir=/run/dt-qos
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <string>

#include "dt/qos.hpp"
#include "placement.hpp"

// spank.h declares the callbacks without C linkage for C++: it is read as C.
extern "C" {
#include <slurm/slurm.h>
#include <slurm/spank.h>
}

// What SPANK_PLUGIN(dt_qos, 1) declares, with the external linkage a C++ const lacks.
extern "C" {
extern const char plugin_name[] = "dt_qos";
extern const char plugin_type[] = "spank";
extern const unsigned int plugin_version = SLURM_VERSION_NUMBER;
extern const unsigned int spank_plugin_version = 1;
}

namespace {

std::string g_state_dir = "/run/dt-qos";
bool g_disabled = false;  // a plugstack.conf argument it does not take: it does nothing

// The plugin's arguments from plugstack.conf; false (with the error logged) for one it does not
// take.
bool parse_args(int ac, char** av) {
  for (int i = 0; i < ac; ++i) {
    const char* a = av[i];
    if (std::strncmp(a, "state_dir=", 10) == 0 && a[10] == '/') {
      g_state_dir = a + 10;
    } else {
      slurm_error("dt_qos: plugstack.conf argument '%s' is not state_dir=/ABSOLUTE/PATH", a);
      return false;
    }
  }
  return true;
}

void place_task(spank_t sp) {
  std::uint32_t job = 0, step = 0, task = 0;
  if (g_disabled || spank_get_item(sp, S_JOB_ID, &job) != ESPANK_SUCCESS) return;
  spank_get_item(sp, S_JOB_STEPID, &step);
  spank_get_item(sp, S_TASK_GLOBAL_ID, &task);
  const std::string id = std::to_string(job);
  // The prolog's DT_QOS_STATE_DIR itself: nothing of the job's environment (which its user
  // sets) goes into a path root reads.
  const std::string record = dt::qos::placement::find_record(g_state_dir, id, "");
  if (record.empty()) {
    slurm_debug("dt_qos: job %s: no QoS record in %s", id.c_str(), g_state_dir.c_str());
    return;
  }
  if (const std::string why = dt::qos::placement::trusted_record_problem(record); !why.empty()) {
    slurm_error("dt_qos: job %s: QoS record %s not used: %s", id.c_str(), record.c_str(),
                why.c_str());
    return;
  }
  const dt::qos::Tier tier = dt::qos::read_record(record);
  const std::string step_name = step == SLURM_BATCH_SCRIPT       ? "batch"
                                : step == SLURM_INTERACTIVE_STEP ? "interactive"
                                : step == SLURM_EXTERN_CONT      ? "extern"
                                                                 : std::to_string(step);
  const std::string who = "task " + std::to_string(task) + " of job " + id + " step " + step_name +
                          " (pid " + std::to_string(::getpid()) + ")";
  const std::vector<unsigned char> binding = dt::qos::placement::affinity();
  std::string entered;
  for (const std::string& g : tier.cgroups) {
    // Only a group of a cgroup file system: a record is the prolog's, but what root writes
    // into is checked all the same.
    const dt::qos::placement::CgroupPlace to = dt::qos::placement::cgroup_place(g);
    if (!to.found) {
      slurm_error("dt_qos: %s: %s is not a group of a cgroup file system; it is left alone",
                  who.c_str(), g.c_str());
      continue;
    }
    if (const std::string why = dt::qos::placement::leaves_slurm_job(to, g, id, who);
        !why.empty()) {
      slurm_verbose("dt_qos: %s: it stays there", why.c_str());
      continue;
    }
    if (const std::string why = dt::qos::placement::enter(to, g, ::getpid()); !why.empty()) {
      slurm_error("dt_qos: cannot move %s into %s (%s); it runs in its current group", who.c_str(),
                  g.c_str(), why.c_str());
      continue;
    }
    entered += " " + g;
  }
  if (const std::string why = dt::qos::placement::keep_affinity(binding); !why.empty())
    slurm_error("dt_qos: %s: %s", who.c_str(), why.c_str());
  slurm_verbose("dt_qos: %s: tier %s, groups entered:%s", who.c_str(), tier.name.c_str(),
                entered.empty() ? " none" : entered.c_str());
}

}  // namespace

extern "C" {

// A bad argument leaves the plugin out (logged), and never fails the job: Slurm fails a step for
// a negative return of a required plugin only, and this one returns 0 either way.
int slurm_spank_init(spank_t sp, int ac, char** av) {
  if (!spank_remote(sp)) return ESPANK_SUCCESS;
  try {
    g_disabled = !parse_args(ac, av);
  } catch (...) {
    g_disabled = true;
  }
  if (g_disabled) slurm_error("dt_qos: left out: the job's tasks are not placed in QoS groups");
  return ESPANK_SUCCESS;
}

int slurm_spank_task_init_privileged(spank_t sp, int /*ac*/, char** /*av*/) {
  try {
    place_task(sp);
  } catch (const std::exception& e) {
    slurm_error("dt_qos: %s", e.what());
  } catch (...) {
    slurm_error("dt_qos: unknown error placing a task");
  }
  return ESPANK_SUCCESS;
}

}  // extern "C"
