"""The CPUs of the namespaced nodes (tests/multinode): physical cores, and node I's share.

    python3 cpus.py I N      prints node I's CPUs (of N nodes) as taskset wants them: the I-th
                             of N equal slices of the physical cores this process may use, with
                             their CPUs (the hyperthreads of one core stay together); of the CPUs
                             when there are fewer cores than nodes; CPU (I-1) mod count when there
                             are fewer CPUs too.
"""
import os
import sys


def core(cpu):
    """(package, core) of `cpu` from sysfs; a core of its own when sysfs does not say."""
    base = "/sys/devices/system/cpu/cpu%d/topology/" % cpu
    try:
        return (open(base + "physical_package_id").read().strip(),
                open(base + "core_id").read().strip())
    except OSError:
        return ("?", str(cpu))


def node_cpus(i, n, cpus):
    groups = {}
    for c in sorted(cpus):
        groups.setdefault(core(c), []).append(c)
    units = sorted(groups.values()) if len(groups) >= n else [[c] for c in sorted(cpus)]
    if len(units) < n:
        return [sorted(cpus)[(i - 1) % len(cpus)]]
    return sorted(c for u in units[(i - 1) * len(units) // n:i * len(units) // n] for c in u)


if __name__ == "__main__":
    i, n = int(sys.argv[1]), int(sys.argv[2])
    print(",".join(map(str, node_cpus(i, n, os.sched_getaffinity(0)))))
