# shellcheck shell=bash disable=SC2034
# Shared by slurm/prolog and slurm/epilog (sourced, not run).
#
# Settings (environment of the prolog and epilog; a site sets them in a wrapper, as
# scripts/slurm-local does):
#   DT_QOS_CONFIG       the tiers (default: configs/qos.ini of this installation)
#   DT_QOS_CGROUP_ROOT  where the cgroup hierarchies are mounted (default /sys/fs/cgroup); tests
#                       point it at a temporary tree
#   DT_QOS_CGROUP_PARENT  the group under which job groups are made (default dt): one group name,
#                       made and removed by the hooks
#   DT_QOS_STATE_DIR    the records of what the prolog did, one per job (default /run/dt-qos);
#                       dt_train reads its job's record from there (--qos.state-dir)
#   DT_QOS_LOG          log of every action (default /var/log/dt-qos.log)
#   DT_QOS_NUMA_ROOT    NUMA nodes in sysfs (default /sys/devices/system/node)

QOS_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -z "${DT_QOS_CONFIG:-}" ]; then
  # Source tree (slurm/ next to configs/) or installation (share/dt/slurm next to share/dt/configs).
  DT_QOS_CONFIG=$QOS_HERE/../configs/qos.ini
fi
CG_ROOT=${DT_QOS_CGROUP_ROOT:-/sys/fs/cgroup}
CG_PARENT=${DT_QOS_CGROUP_PARENT:-dt}
STATE_DIR=${DT_QOS_STATE_DIR:-/run/dt-qos}
QOS_LOG=${DT_QOS_LOG:-/var/log/dt-qos.log}
NUMA_ROOT=${DT_QOS_NUMA_ROOT:-/sys/devices/system/node}
JOB=${SLURM_JOB_ID:-${SLURM_JOBID:-}}
HOOK=$(basename "$0")

# locked CMD...: runs CMD holding this node's QoS lock (a lock on STATE_DIR itself), so that the
# prologs and epilogs of jobs that start and end together do not interleave their reads and
# writes of the shared parent groups and their real-time budgets. CMD does only that work: what
# may wait (Slurm's commands, 20 s each for a slow slurmctld) comes before, so that the hooks of
# several jobs starting at once get the lock in time. Without flock, or when the lock is not had
# within 60 s, CMD runs all the same (a hook must never hold a job up for long). CMD runs in a
# subshell either way: a shell error that ends it half-way (bash's message goes to stderr) leaves
# the caller running, to log it, and its exit code non-zero.
locked() {
  if command -v flock >/dev/null 2>&1 && mkdir -p "$STATE_DIR" 2>/dev/null; then
    (
      flock -w 60 9 || qlog "warning: no lock on $STATE_DIR within 60 s; going on without it"
      "$@"
    ) 9<"$STATE_DIR"
  else
    ( "$@" )
  fi
}

# qlog MESSAGE: one line in the QoS log (and on stderr, which Slurm keeps in slurmd's log when
# debugging). Never fails.
qlog() {
  local line
  line="$(date '+%Y-%m-%dT%H:%M:%S') $(hostname -s 2>/dev/null) $HOOK job=${JOB:-?}: $*"
  { mkdir -p "$(dirname "$QOS_LOG")" && echo "$line" >>"$QOS_LOG"; } 2>/dev/null || true
  { echo "$line" >&2; } 2>/dev/null || true
}

# ini_lines: DT_QOS_CONFIG as dt's own INI reader (src/core/config.cpp) reads a config file, one
# line per section header ("[NAME]") and per setting ("SECTION<tab>KEY<tab>VALUE"): CRLF line ends
# and a UTF-8 byte order mark are taken; '#' or ';' first on a line and '#' after a space or tab
# start a comment (any other '#', and a ';' after the start of the line, is part of the value);
# spaces and tabs around names, keys and values go. Prints nothing for an unreadable file.
# The awk functions both readers share: trim(T), and clean(LINE), the line without its byte order
# mark, comment and surrounding blanks ("" for a blank or comment line).
INI_AWK_LIB='
    function trim(t) { gsub(/^[ \t\r]+|[ \t\r]+$/, "", t); return t }
    function clean(line) {
      if (NR == 1 && substr(line, 1, 3) == "\357\273\277") line = substr(line, 4)
      if (match(line, /[ \t]#/)) line = substr(line, 1, RSTART)
      line = trim(line)
      return line ~ /^[#;]/ ? "" : line
    }'
ini_lines() {
  LC_ALL=C awk "$INI_AWK_LIB"'
    {
      line = clean($0)
      if (line == "") next
      if (line ~ /^\[/) {
        sec = (line ~ /\]$/) ? trim(substr(line, 2, length(line) - 2)) : ""
        print "[" sec "]"
        next
      }
      i = index(line, "=")
      if (i > 1) print sec "\t" trim(substr(line, 1, i - 1)) "\t" trim(substr(line, i + 1))
    }' "$DT_QOS_CONFIG" 2>/dev/null
}

# ini_get SECTION KEY: the value of KEY in [SECTION] of DT_QOS_CONFIG ("" when absent; see
# ini_lines for comments and line ends).
ini_get() {
  ini_lines | awk -F '\t' -v sec="$1" -v key="$2" '
    NF >= 3 && $1 == sec && $2 == key { print substr($0, length($1) + length($2) + 3); exit }'
}

# ini_has_section SECTION
ini_has_section() {
  ini_lines | grep -qxF "[$1]"
}

# ini_problems: what dt's own reader would refuse in DT_QOS_CONFIG, or the hooks cannot use, one
# line each ("line N: ..."): a line that is no [SECTION] or KEY = VALUE, a section or a key set
# twice (the first applies), a key a section does not take ([default]: tier, comment; a tier:
# weight, cpuset, fifo, rt-budget; [slurm-qos]: Slurm QOS names, each naming a tier), and ranges
# whose LOW is above their HIGH. The hooks log them and go on with what the file says.
ini_problems() {
  LC_ALL=C awk "$INI_AWK_LIB"'
    {
      line = clean($0)
      if (line == "") next
      if (line ~ /^\[.*\]$/) {
        sec = trim(substr(line, 2, length(line) - 2))
        if (sec in secs) print "line " NR ": section [" sec "] again (line " secs[sec] "): the first applies"
        else secs[sec] = NR
        next
      }
      i = index(line, "=")
      if (i <= 1) { print "line " NR ": \"" line "\" is not [SECTION] or KEY = VALUE"; next }
      key = trim(substr(line, 1, i - 1)); value = trim(substr(line, i + 1))
      if ((sec, key) in keys) {
        print "line " NR ": " key " in [" sec "] again (line " keys[sec, key] "): the first applies"
        next
      }
      keys[sec, key] = NR
      if (sec == "default") {
        if (key != "tier" && key != "comment")
          print "line " NR ": [default] takes tier and comment, not " key
      } else if (sec == "slurm-qos") {
        maps[key] = value; mapline[key] = NR
      } else if (key != "weight" && key != "cpuset" && key != "fifo" && key != "rt-budget") {
        print "line " NR ": a tier ([" sec "]) takes weight, cpuset, fifo and rt-budget, not " key
      } else if ((key == "weight" || key == "fifo") && value ~ /^[0-9]+-[0-9]+$/) {
        split(value, r, "-")
        if (r[1] + 0 > r[2] + 0) print "line " NR ": [" sec "] " key " = " value ": LOW is above HIGH"
      }
    }
    END {
      for (q in maps)
        if (maps[q] == "default" || maps[q] == "slurm-qos" || !(maps[q] in secs))
          print "line " mapline[q] ": [slurm-qos] " q " = " maps[q] " names no tier of the file"
    }' "$DT_QOS_CONFIG" 2>/dev/null
}

# parent_ok: whether CG_PARENT is one group name (the hooks make and remove one level: a nested
# parent would get no cpuset or real-time budget of its own, and be left behind); logs why not.
parent_ok() {
  [[ "$CG_PARENT" =~ ^[A-Za-z0-9_.][A-Za-z0-9_.-]*$ && "$CG_PARENT" != . && "$CG_PARENT" != .. ]] &&
    return 0
  qlog "error: DT_QOS_CGROUP_PARENT='$CG_PARENT' is not one group name (letters, digits, _ . -);" \
    "no group is made or removed"
  return 1
}

# rt_share PARENT [EXCEPT]: the real-time runtime the job groups under PARENT (v1 cpu hierarchy)
# hold, per million of the CPU time, leaving out the group EXCEPT.
rt_share() {
  local f g r p share=0
  for f in "$1"/job_*/cpu.rt_runtime_us; do
    g=$(dirname "$f")
    [ "$g" = "${2:-}" ] && continue
    r=$(dec "$(cat "$f" 2>/dev/null)") && p=$(dec "$(cat "$g/cpu.rt_period_us" 2>/dev/null)") &&
      [ "$p" -gt 0 ] && share=$((share + r * 1000000 / p))
  done
  echo "$share"
}

# dec VALUE: VALUE, digits only, as a decimal number without leading zeros (08 is 8 and 025 is 25,
# where bash arithmetic refuses the one and reads the other as octal); fails, printing nothing,
# for anything else and for more than 9 digits (past any value here, far from an overflow).
dec() {
  [[ "$1" =~ ^0*([0-9]{1,9})$ ]] || return 1
  echo $((10#${BASH_REMATCH[1]}))
}

# cg_is_cgroupfs DIR: DIR lies on a real cgroup file system (not a test tree).
cg_is_cgroupfs() {
  case "$(stat -f -c %T "$1" 2>/dev/null)" in
    cgroupfs | cgroup2fs) return 0 ;;
  esac
  return 1
}

# cg_mode: v2 when CG_ROOT is a unified hierarchy with the cpu controller, v1 when it holds a
# cpu controller hierarchy, else none.
cg_mode() {
  if [ -f "$CG_ROOT/cgroup.controllers" ] && grep -qw cpu "$CG_ROOT/cgroup.controllers"; then
    echo v2
  elif [ -n "$(cg_v1_dir cpu)" ]; then
    echo v1
  else
    echo none
  fi
}

# cg_v1_dir CONTROLLER: the v1 hierarchy of CONTROLLER under CG_ROOT ("" when none), also when
# mounted together with others (cpu,cpuacct).
cg_v1_dir() {
  local d file
  case $1 in
    cpu) file=cpu.shares ;;
    cpuset) file=cpuset.cpus ;;
  esac
  for d in "$CG_ROOT/$1" "$CG_ROOT"/*"$1"*; do
    [ -f "$d/$file" ] || continue
    case ",$(basename "$d")," in *",$1,"*)
      echo "$d"
      return
      ;;
    esac
  done
}

# job_groups: every group directory a prolog of this job may have made, whether or not it exists.
job_groups() {
  echo "$CG_ROOT/$CG_PARENT/job_$JOB"
  local c d
  for c in cpu cpuset; do
    d=$(cg_v1_dir "$c")
    [ -n "$d" ] && echo "$d/$CG_PARENT/job_$JOB"
  done
}

RECORD=$STATE_DIR/job-$JOB.conf
