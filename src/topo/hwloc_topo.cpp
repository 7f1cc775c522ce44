#include "hwloc_topo.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "dt/error.hpp"

namespace dt {

namespace {

struct BitmapFree {
  void operator()(hwloc_bitmap_s* b) const noexcept { hwloc_bitmap_free(b); }
};
using Bitmap = std::unique_ptr<hwloc_bitmap_s, BitmapFree>;

Bitmap make_bitmap() {
  Bitmap b(hwloc_bitmap_alloc());
  if (!b) throw std::bad_alloc();
  return b;
}

std::string list_string(hwloc_const_bitmap_t b) {
  char* s = nullptr;
  if (hwloc_bitmap_list_asprintf(&s, b) < 0 || !s) return "?";
  std::string out = s;
  std::free(s);
  return out.empty() ? "-" : out;
}

bool is_gpu_pci(const hwloc_obj_t o) {
  const unsigned cls = o->attr->pcidev.class_id;
  const unsigned vendor = o->attr->pcidev.vendor_id;
  if (cls == 0x0302) return true;  // 3D controller: compute GPUs and accelerators
  // Display controllers (VGA 0x0300; "other" 0x0380, as headless data-centre GPUs such as AMD
  // Instinct and Intel Data Center GPU Max present themselves) and processing accelerators
  // (0x1200) only from GPU and accelerator vendors: NVIDIA, AMD, Intel (not its integrated VGA,
  // 0x0300) and Habana. Server BMC display chips are not GPUs.
  const bool gpu_vendor = vendor == 0x10de || vendor == 0x1002;
  const bool accel_vendor = gpu_vendor || vendor == 0x8086 || vendor == 0x1da3;
  return (cls == 0x0300 && gpu_vendor) || ((cls == 0x0380 || cls == 0x1200) && accel_vendor);
}

}  // namespace

const char* bind_mode_name(BindMode m) noexcept {
  switch (m) {
    case BindMode::automatic:
      return "auto";
    case BindMode::cores:
      return "cores";
    case BindMode::none:
      return "none";
  }
  return "?";
}

BindMode parse_bind_mode(const std::string& s) {
  if (s == "auto") return BindMode::automatic;
  if (s == "cores") return BindMode::cores;
  if (s == "none") return BindMode::none;
  DT_THROW(ConfigError, "bind mode '", s, "' is not one of auto, cores, none");
}

HwlocTopology::HwlocTopology() {
  DT_CHECK(Error, hwloc_topology_init(&t_) == 0,
           "hwloc_topology_init failed: ", std::strerror(errno));
  hwloc_topology_set_io_types_filter(t_, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(t_) != 0) {
    const int err = errno;
    hwloc_topology_destroy(t_);
    t_ = nullptr;
    DT_THROW(Error, "hwloc_topology_load failed: ", std::strerror(err));
  }
}

HwlocTopology::~HwlocTopology() {
  if (t_) hwloc_topology_destroy(t_);
}

MachineInfo HwlocTopology::describe() const {
  MachineInfo m;
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  m.host = host;
  m.packages = hwloc_get_nbobjs_by_type(t_, HWLOC_OBJ_PACKAGE);
  m.numa_nodes = hwloc_get_nbobjs_by_type(t_, HWLOC_OBJ_NUMANODE);
  m.cores = hwloc_get_nbobjs_by_type(t_, HWLOC_OBJ_CORE);
  m.pus = hwloc_get_nbobjs_by_type(t_, HWLOC_OBJ_PU);
  for (hwloc_obj_t p = hwloc_get_next_pcidev(t_, nullptr); p; p = hwloc_get_next_pcidev(t_, p)) {
    if (!is_gpu_pci(p)) continue;
    std::string name;
    // Prefer the name the driver gives (cuda0, rsmi0, card1) over the PCI address.
    for (hwloc_obj_t c = p->io_first_child; c; c = c->next_sibling) {
      if (c->type != HWLOC_OBJ_OS_DEVICE) continue;
      const auto t = c->attr->osdev.type;
      if ((t == HWLOC_OBJ_OSDEV_COPROC || t == HWLOC_OBJ_OSDEV_GPU) && c->name) {
        name = c->name;
        if (t == HWLOC_OBJ_OSDEV_COPROC) break;
      }
    }
    if (name.empty()) {
      char addr[32];
      std::snprintf(addr, sizeof addr, "pci:%04x:%02x:%02x.%x", p->attr->pcidev.domain,
                    p->attr->pcidev.bus, p->attr->pcidev.dev, p->attr->pcidev.func);
      name = addr;
    }
    m.gpus.push_back(name);
  }
  return m;
}

Binding HwlocTopology::current(const char* mode) const {
  Binding b;
  b.mode = mode;
  Bitmap cpus = make_bitmap();
  if (hwloc_get_cpubind(t_, cpus.get(), HWLOC_CPUBIND_PROCESS) != 0)
    hwloc_bitmap_copy(cpus.get(), hwloc_topology_get_allowed_cpuset(t_));
  b.cpus = list_string(cpus.get());
  Bitmap nodes = make_bitmap();
  hwloc_cpuset_to_nodeset(t_, cpus.get(), nodes.get());
  b.numa = list_string(nodes.get());
  return b;
}

std::pair<int, int> share_of(int items, int index, int count) {
  DT_ASSERT(items > 0 && count > 0 && index >= 0 && index < count, "share_of(", items, ", ", index,
            ", ", count, ")");
  if (count > items) return {index % items, index % items + 1};
  return {static_cast<int>(static_cast<long>(index) * items / count),
          static_cast<int>(static_cast<long>(index + 1) * items / count)};
}

std::pair<int, int> sharers_of(const std::vector<std::string>& masks, int me) {
  DT_ASSERT(me >= 0 && static_cast<std::size_t>(me) < masks.size(), "local rank ", me, " of ",
            masks.size());
  int index = 0, count = 0;
  for (std::size_t r = 0; r < masks.size(); ++r) {
    if (masks[r] != masks[static_cast<std::size_t>(me)]) continue;
    if (static_cast<int>(r) < me) ++index;
    ++count;
  }
  return {index, count};
}

Binding HwlocTopology::bind(BindMode mode, int local_rank, const std::vector<std::string>& masks) {
  if (mode == BindMode::none) {
    return current("none");
  }
  Bitmap cur = make_bitmap();
  const bool have_cur = hwloc_get_cpubind(t_, cur.get(), HWLOC_CPUBIND_PROCESS) == 0;
  hwloc_const_cpuset_t allowed = hwloc_topology_get_allowed_cpuset(t_);
  // What is split, among how many ranks: the node's cores among all local ranks, or the
  // launcher's binding among the local ranks it was given to.
  Bitmap region = make_bitmap();
  hwloc_bitmap_copy(region.get(), allowed);
  int index = local_rank, count = static_cast<int>(masks.size());
  const bool split =
      mode == BindMode::automatic && have_cur && !hwloc_bitmap_isincluded(allowed, cur.get());
  if (split) {
    std::tie(index, count) = sharers_of(masks, local_rank);
    if (count <= 1) return current("launcher");
    hwloc_bitmap_and(region.get(), cur.get(), allowed);
  }
  std::vector<hwloc_obj_t> cores;
  for (hwloc_obj_t c = hwloc_get_next_obj_by_type(t_, HWLOC_OBJ_CORE, nullptr); c;
       c = hwloc_get_next_obj_by_type(t_, HWLOC_OBJ_CORE, c))
    if (c->cpuset && hwloc_bitmap_intersects(c->cpuset, region.get())) cores.push_back(c);
  if (cores.empty() || count <= 0) return current("none");
  if (split && cores.size() == 1) return current("launcher");
  const auto [first, last] = share_of(static_cast<int>(cores.size()), index, count);
  Bitmap set = make_bitmap();
  for (int c = first; c < last; ++c)
    hwloc_bitmap_or(set.get(), set.get(), cores[static_cast<std::size_t>(c)]->cpuset);
  hwloc_bitmap_and(set.get(), set.get(), region.get());
  if (hwloc_set_cpubind(t_, set.get(), HWLOC_CPUBIND_PROCESS) != 0) {
    Binding b = current("none");
    b.mode = std::string("failed (") + std::strerror(errno) + ")";
    return b;
  }
  return current(split ? "split" : "cores");
}

}  // namespace dt
