// dt::HwlocTopology's binding: how cores are shared out, which ranks share a launcher's binding,
// and bind() on this machine (read back with sched_getaffinity, as the kernel enforces it).
#include <doctest/doctest.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "cpus.hpp"
#include "topo/hwloc_topo.hpp"

namespace {

using dt::test::allow_cpus;
using dt::test::allowed_cpus;

std::string list(const std::vector<int>& cpus) {
  std::string s;
  for (int c : cpus) s += (s.empty() ? "" : ",") + std::to_string(c);
  return s;
}

bool has(const std::vector<int>& cpus, int c) {
  return std::find(cpus.begin(), cpus.end(), c) != cpus.end();
}

// Restores this process's CPU set when a test case ends. Also keeps hwloc's PCI component out:
// binding needs no devices, and libpciaccess, which that component uses, keeps allocations past
// the topology's end, which LeakSanitizer reports in the sanitizer build.
struct KeepAffinity {
  std::vector<int> before = allowed_cpus();
  KeepAffinity() { setenv("HWLOC_COMPONENTS", "-pci", 1); }
  ~KeepAffinity() {
    try {
      allow_cpus(before, true);
    } catch (...) {  // a failed REQUIRE: reported already, and a destructor must not throw
    }
    unsetenv("HWLOC_COMPONENTS");
  }
};

}  // namespace

TEST_CASE("share_of: contiguous, disjoint shares that cover every item; round robin past that") {
  for (int items = 1; items <= 9; ++items)
    for (int count = 1; count <= items; ++count) {
      int next = 0;
      for (int i = 0; i < count; ++i) {
        const auto [first, last] = dt::share_of(items, i, count);
        CHECK(first == next);
        CHECK(last > first);
        CHECK(last - first <= (items + count - 1) / count);
        next = last;
      }
      CHECK(next == items);
    }
  CHECK(dt::share_of(2, 0, 5) == std::pair<int, int>{0, 1});
  CHECK(dt::share_of(2, 3, 5) == std::pair<int, int>{1, 2});
  CHECK(dt::share_of(2, 4, 5) == std::pair<int, int>{0, 1});
}

TEST_CASE("sharers_of: the local ranks given the same binding, in local rank order") {
  // mpirun --bind-to socket, 6 ranks by slot on two sockets of 8 cores: 0-2 on the first.
  const std::vector<std::string> socket{"0-15", "0-15", "0-15", "16-31", "16-31", "16-31"};
  CHECK(dt::sharers_of(socket, 0) == std::pair<int, int>{0, 3});
  CHECK(dt::sharers_of(socket, 2) == std::pair<int, int>{2, 3});
  CHECK(dt::sharers_of(socket, 3) == std::pair<int, int>{0, 3});
  CHECK(dt::sharers_of(socket, 5) == std::pair<int, int>{2, 3});
  // By node (round robin): the same masks interleaved.
  const std::vector<std::string> rr{"0-15", "16-31", "0-15", "16-31"};
  CHECK(dt::sharers_of(rr, 2) == std::pair<int, int>{1, 2});
  CHECK(dt::sharers_of(rr, 1) == std::pair<int, int>{0, 2});
  // srun --cpu-bind=cores: every rank its own.
  const std::vector<std::string> own{"0", "1", "2", "3"};
  for (int r = 0; r < 4; ++r) CHECK(dt::sharers_of(own, r) == std::pair<int, int>{0, 1});
}

TEST_CASE(
    "bind: unbound ranks split the node; a launcher's binding of one rank or one core is kept") {
  KeepAffinity keep;
  const std::vector<int> all = keep.before;
  dt::HwlocTopology hw;
  const std::string whole = hw.current("x").cpus;

  SUBCASE("unbound ranks split the node's cores") {
    const std::vector<std::string> masks(2, whole);
    const dt::Binding b = hw.bind(dt::BindMode::automatic, 1, masks);
    CHECK(b.mode == "cores");
    const std::vector<int> got = allowed_cpus();
    if (all.size() >= 2) CHECK(got.size() < all.size());
  }
  if (all.size() < 2) return;
  const int first = all.front();
  SUBCASE("a binding this rank alone holds is kept") {
    allow_cpus({first}, true);
    const std::vector<std::string> masks{std::to_string(first), whole};
    const dt::Binding b = hw.bind(dt::BindMode::automatic, 0, masks);
    CHECK(b.mode == "launcher");
    CHECK(allowed_cpus() == std::vector<int>{first});
  }
  SUBCASE("one core shared: nothing to split, kept") {
    allow_cpus({first}, true);
    const std::vector<std::string> masks(3, std::to_string(first));
    const dt::Binding b = hw.bind(dt::BindMode::automatic, 2, masks);
    CHECK(b.mode == "launcher");
    CHECK(allowed_cpus() == std::vector<int>{first});
  }
  SUBCASE("cores mode ignores the launcher's binding") {
    allow_cpus({first}, true);
    const std::vector<std::string> masks{std::to_string(first)};
    const dt::Binding b = hw.bind(dt::BindMode::cores, 0, masks);
    CHECK(b.mode == "cores");
    CHECK(allowed_cpus() == all);
  }
}

TEST_CASE("bind: a launcher's binding of several cores shared by two ranks: disjoint halves") {
  KeepAffinity keep;
  const std::vector<int> all = keep.before;
  if (all.size() < 3) {
    MESSAGE(
        "SKIP: a shared launcher binding of 2+ cores that is not the whole node needs 3 CPUs "
        "or more; this process may use ",
        all.size());
    return;
  }
  dt::HwlocTopology hw;
  const std::string whole = hw.current("x").cpus;
  const std::vector<int> mine(all.begin() + 1, all.end());  // all but the first
  const std::vector<std::string> masks{whole, list(mine), list(mine)};
  std::set<int> seen;
  for (int lr = 1; lr <= 2; ++lr) {
    allow_cpus(mine, true);
    const dt::Binding b = hw.bind(dt::BindMode::automatic, lr, masks);
    CHECK(b.mode == "split");
    const std::vector<int> got = allowed_cpus();
    CHECK(!got.empty());
    for (int c : got) {
      CHECK(has(mine, c));
      CHECK(seen.insert(c).second);
    }
  }
}

// The GPUs of a node as its PCI devices say (an hwloc XML topology, read through HWLOC_XMLFILE):
// compute GPUs (3D controllers), GPU vendors' display controllers, headless ones ("display
// other", AMD Instinct, Intel Data Center GPU Max) and processing accelerators (Habana Gaudi);
// not a BMC's display chip, Intel's integrated graphics, nor other devices.
TEST_CASE("describe: GPUs by PCI class and vendor") {
  struct Dev {
    const char* busid;
    const char* type;  // "CLASS [VENDOR:DEVICE] [SUBVENDOR:SUBDEVICE] REV"
  };
  const Dev devs[] = {
      {"0000:01:00.0", "0302 [10de:2330] [10de:16c1] a1"},  // NVIDIA H100
      {"0000:02:00.0", "0380 [1002:740c] [1002:0c34] 01"},  // AMD MI250X
      {"0000:03:00.0", "0380 [8086:0bd5] [8086:0000] 2f"},  // Intel Data Center GPU Max
      {"0000:04:00.0", "1200 [1da3:1020] [1da3:0000] 01"},  // Habana Gaudi2
      {"0000:05:00.0", "0300 [10de:2204] [10de:0000] a1"},  // NVIDIA VGA
      {"0000:06:00.0", "0300 [1a03:2000] [1a03:2000] 41"},  // ASPEED BMC display
      {"0000:07:00.0", "0300 [8086:4680] [8086:0000] 0c"},  // Intel integrated graphics
      {"0000:08:00.0", "0200 [15b3:101b] [15b3:0000] 00"},  // Mellanox NIC
  };
  std::string xml =
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<!DOCTYPE topology SYSTEM \"hwloc2.dtd\">\n"
      "<topology version=\"2.0\">\n"
      "<object type=\"Machine\" os_index=\"0\" cpuset=\"0x1\" complete_cpuset=\"0x1\" "
      "allowed_cpuset=\"0x1\" nodeset=\"0x1\" complete_nodeset=\"0x1\" allowed_nodeset=\"0x1\" "
      "gp_index=\"1\">\n"
      "<object type=\"Package\" os_index=\"0\" cpuset=\"0x1\" complete_cpuset=\"0x1\" "
      "nodeset=\"0x1\" complete_nodeset=\"0x1\" gp_index=\"2\">\n"
      "<object type=\"NUMANode\" os_index=\"0\" cpuset=\"0x1\" complete_cpuset=\"0x1\" "
      "nodeset=\"0x1\" complete_nodeset=\"0x1\" gp_index=\"3\" local_memory=\"1073741824\"/>\n"
      "<object type=\"Core\" os_index=\"0\" cpuset=\"0x1\" complete_cpuset=\"0x1\" "
      "nodeset=\"0x1\" complete_nodeset=\"0x1\" gp_index=\"4\">\n"
      "<object type=\"PU\" os_index=\"0\" cpuset=\"0x1\" complete_cpuset=\"0x1\" "
      "nodeset=\"0x1\" complete_nodeset=\"0x1\" gp_index=\"5\"/>\n"
      "</object>\n</object>\n"
      "<object type=\"Bridge\" gp_index=\"6\" bridge_type=\"0-1\" depth=\"0\" "
      "bridge_pci=\"0000:[00-08]\">\n";
  int gp = 10;
  for (const Dev& d : devs)
    xml += std::string("<object type=\"PCIDev\" gp_index=\"") + std::to_string(gp++) +
           "\" pci_busid=\"" + d.busid + "\" pci_type=\"" + d.type +
           "\" pci_link_speed=\"0.000000\"/>\n";
  xml += "</object>\n</object>\n</topology>\n";
  char path[] = "/tmp/dt-topo-XXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  close(fd);
  std::ofstream(path) << xml;
  const char* before = std::getenv("HWLOC_XMLFILE");
  const std::string kept = before ? before : "";
  setenv("HWLOC_XMLFILE", path, 1);
  std::vector<std::string> gpus;
  {
    const dt::HwlocTopology hw;
    gpus = hw.describe().gpus;
  }
  if (before)
    setenv("HWLOC_XMLFILE", kept.c_str(), 1);
  else
    unsetenv("HWLOC_XMLFILE");
  std::remove(path);
  CHECK(gpus == std::vector<std::string>{"pci:0000:01:00.0", "pci:0000:02:00.0", "pci:0000:03:00.0",
                                         "pci:0000:04:00.0", "pci:0000:05:00.0"});
}
