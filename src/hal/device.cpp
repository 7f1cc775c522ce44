#include "dt/device.hpp"

#include <algorithm>
#include <atomic>

#include <dlfcn.h>
#include <elf.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "cpu_device.h"
#include "dt/dtype.hpp"
#include "hal/library_path.hpp"

namespace dt {

namespace {
const char* status_name(int s) {
  switch (s) {
    case DT_HAL_ERR_INVALID:
      return "invalid argument";
    case DT_HAL_ERR_NOMEM:
      return "out of memory";
    case DT_HAL_ERR_DEVICE:
      return "device failure";
    case DT_HAL_ERR_UNSUPPORTED:
      return "unsupported";
  }
  return "unknown status";
}

std::vector<std::string> split_path(const std::string& p) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream is(p);
  while (std::getline(is, cur, ':'))
    if (!cur.empty()) out.push_back(cur);
  return out;
}
// Why the 64-bit ELF file `path` of `size` bytes is cut short ("" when it is not, or is no 64-bit
// ELF file: dlopen judges those). dlopen maps a library's segments as the headers say, and
// touching a page past the end of the file raises SIGBUS: a copy cut short (one still being
// copied onto a shared file system, say) would kill the process instead of being skipped.
std::string elf_cut_short(const std::string& path, std::uint64_t size) {
  std::ifstream in(path, std::ios::binary);
  Elf64_Ehdr eh{};
  if (!in.read(reinterpret_cast<char*>(&eh), sizeof eh)) return "";
  // Only a 64-bit file of this machine's byte order is read here (dlopen names what others are).
  constexpr unsigned char kOwnOrder =
      __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ ? ELFDATA2LSB : ELFDATA2MSB;
  if (std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 || eh.e_ident[EI_CLASS] != ELFCLASS64 ||
      eh.e_ident[EI_DATA] != kOwnOrder || eh.e_phentsize != sizeof(Elf64_Phdr))
    return "";
  auto cut = [size](std::uint64_t end, const char* what) {
    return "the file is cut short: " + std::string(what) + " end at byte " + std::to_string(end) +
           ", the file has " + std::to_string(size) + " (a copy not yet complete?)";
  };
  const std::uint64_t ph_end = eh.e_phoff + static_cast<std::uint64_t>(eh.e_phnum) * eh.e_phentsize;
  if (ph_end > size) return cut(ph_end, "its program headers");
  in.seekg(static_cast<std::streamoff>(eh.e_phoff));
  for (int i = 0; i < eh.e_phnum; ++i) {
    Elf64_Phdr ph{};
    if (!in.read(reinterpret_cast<char*>(&ph), sizeof ph))
      return cut(ph_end, "its program headers");
    if (ph.p_type == PT_LOAD && ph.p_offset + ph.p_filesz > size)
      return cut(ph.p_offset + ph.p_filesz, "its segments");
  }
  return "";
}
}  // namespace

struct Device::Library final : detail::SharedLibrary {};

namespace detail {
SharedLibrary::~SharedLibrary() {
  if (handle) dlclose(handle);
}

void load_from_path(const std::string& file, const std::string& search_path,
                    const std::string& what, SharedLibrary& out,
                    const std::function<std::string(const SharedLibrary&)>& accept) {
  std::vector<std::string> refused;  // "FILE: why"
  for (const auto& dir : split_path(search_path)) {
    const std::string path = dir + "/" + file;
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) continue;
    if (const std::string why = elf_cut_short(path, static_cast<std::uint64_t>(st.st_size));
        !why.empty()) {
      refused.push_back(path + ": " + why);
      continue;
    }
    out.handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (out.handle == nullptr) {
      const char* why = dlerror();
      refused.push_back(path + ": " + (why ? why : "dlopen failed"));
      continue;
    }
    out.path = path;
    const std::string why = accept ? accept(out) : std::string();
    if (why.empty()) break;
    refused.push_back(path + ": " + why);
    dlclose(out.handle);
    out.handle = nullptr;
    out.path.clear();
  }
  if (out.handle == nullptr) {
    std::string all;
    for (const auto& r : refused) all += (all.empty() ? "" : "; ") + r;
    DT_CHECK(ConfigError, !refused.empty(), what, ": plugin ", file,
             " not found in the plugin path '", search_path, "'");
    DT_THROW(ConfigError, what, ": no copy of ", file, " in the plugin path '", search_path,
             "' could be loaded: ", all);
  }
  for (const auto& r : refused)
    std::fprintf(stderr, "dt: warning: %s: skipped %s (using %s)\n", what.c_str(), r.c_str(),
                 out.path.c_str());
}

void* find_symbol(const SharedLibrary& lib, const char* name) { return dlsym(lib.handle, name); }
}  // namespace detail

std::string default_plugin_path() {
  // Set by the dt module (modulefiles/dt): the plugins of the installation the user loaded.
  const char* env = std::getenv("DT_PLUGIN_PATH");
  std::string path;
  // A folder named twice (the installation's lib/dt/plugins is both next to the program and
  // next to libdt) is listed once.
  std::vector<std::string> seen;
  auto add = [&path, &seen](const std::string& dir) {
    char real[PATH_MAX];
    const std::string key = ::realpath(dir.c_str(), real) ? std::string(real) : dir;
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) return;
    seen.push_back(key);
    path += (path.empty() ? "" : ":") + dir;
  };
  if (env != nullptr)
    for (const auto& dir : split_path(env)) add(dir);
  char exe[PATH_MAX] = {0};
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    std::string dir(exe, static_cast<std::size_t>(n));
    dir = dir.substr(0, dir.rfind('/'));
    add(dir + "/../plugins");
    add(dir + "/../lib/dt/plugins");
  }
  // Next to libdt itself (lib/dt/plugins, in the build tree as installed): where a program of
  // another prefix that links libdt finds the installation's plugins and its NCCL communicator.
  Dl_info self{};
  if (dladdr(reinterpret_cast<const void*>(&default_plugin_path), &self) != 0 && self.dli_fname) {
    const std::string lib = self.dli_fname;
    const std::size_t slash = lib.rfind('/');
    if (slash != std::string::npos) add(lib.substr(0, slash) + "/dt/plugins");
  }
  return path;
}

namespace {
// The adapters: a version-4 table whose newer entries are NULL.
dt_hal_v4_t adapt_v3(const dt_hal_v3_t& v3) {
  dt_hal_v4_t t{};
  t.v3 = v3;
  return t;
}
dt_hal_v4_t adapt_v2(const dt_hal_v2_t& v2) {
  dt_hal_v3_t t{};
  t.v2 = v2;
  return adapt_v3(t);
}
dt_hal_v4_t adapt_v1(const dt_hal_v1_t& v1) {
  dt_hal_v2_t t{};
  t.v1 = v1;
  return adapt_v2(t);
}

// The table a loaded plugin exports behind `symbol` (null when it exports no such symbol), which
// must carry `version` in its first int (every dt table starts with its version); a copy that
// does not is refused (ConfigError, the reason alone: the path is named by whoever reports it).
template <class Table>
const Table* exported_table(void* handle, const char* symbol, int version) {
  using Entry = const Table* (*)(void);
  const auto entry = reinterpret_cast<Entry>(dlsym(handle, symbol));
  if (entry == nullptr) return nullptr;
  const Table* t = entry();
  DT_CHECK(ConfigError, t != nullptr, "returned no table from ", symbol);
  const int has = *reinterpret_cast<const int*>(t);
  DT_CHECK(ConfigError, has == version, "has ABI version ", has, ", this dt needs ABI version ",
           version, " behind ", symbol);
  return t;
}
}  // namespace

void Device::adopt_table(void* handle) {
  // The newest version this dt knows first: a plugin may export several.
  if (auto t4 =
          exported_table<dt_hal_v4_t>(handle, DT_HAL_PLUGIN_V4_SYMBOL, DT_HAL_API_VERSION_4)) {
    table_ = *t4;
    abi_version_ = DT_HAL_API_VERSION_4;
  } else if (auto t3 = exported_table<dt_hal_v3_t>(handle, DT_HAL_PLUGIN_V3_SYMBOL,
                                                   DT_HAL_API_VERSION_3)) {
    table_ = adapt_v3(*t3);
    abi_version_ = DT_HAL_API_VERSION_3;
  } else if (auto t2 = exported_table<dt_hal_v2_t>(handle, DT_HAL_PLUGIN_V2_SYMBOL,
                                                   DT_HAL_API_VERSION_2)) {
    table_ = adapt_v2(*t2);
    abi_version_ = DT_HAL_API_VERSION_2;
  } else if (auto t1 = exported_table<dt_hal_v1_t>(handle, DT_HAL_PLUGIN_V1_SYMBOL,
                                                   DT_HAL_API_VERSION_1)) {
    table_ = adapt_v1(*t1);
    abi_version_ = DT_HAL_API_VERSION_1;
  } else {
    for (int v = DT_HAL_API_VERSION_4 + 1; v < 16; ++v) {
      const std::string sym = "dt_hal_plugin_v" + std::to_string(v);
      if (dlsym(handle, sym.c_str()))
        DT_THROW(ConfigError, "provides ABI version ", v, " (", sym,
                 "), this dt supports ABI versions ", DT_HAL_API_VERSION_1, " to ",
                 DT_HAL_API_VERSION_4);
    }
    DT_THROW(ConfigError, "not a dt device plugin (no ", DT_HAL_PLUGIN_V4_SYMBOL, ", ",
             DT_HAL_PLUGIN_V3_SYMBOL, ", ", DT_HAL_PLUGIN_V2_SYMBOL, " or ",
             DT_HAL_PLUGIN_V1_SYMBOL, " symbol)");
  }
  DT_CHECK(ConfigError,
           (table_.v3.attention_fwd_ex == nullptr) == (table_.v3.attention_bwd_ex == nullptr),
           "provides only one of attention_fwd_ex and attention_bwd_ex (they go in pairs)");
  DT_CHECK(ConfigError,
           (table_.flash_attention_fwd == nullptr) == (table_.flash_attention_bwd == nullptr),
           "provides only one of flash_attention_fwd and flash_attention_bwd (they go in pairs)");
  const dt_hal_v1_t& t = table_.v3.v2.v1;
  for (auto [fn, what] :
       {std::pair<const void*, const char*>{reinterpret_cast<const void*>(t.open), "open"},
        {reinterpret_cast<const void*>(t.close), "close"},
        {reinterpret_cast<const void*>(t.alloc), "alloc"},
        {reinterpret_cast<const void*>(t.release), "release"},
        {reinterpret_cast<const void*>(t.last_error), "last_error"}})
    DT_CHECK(ConfigError, fn != nullptr, "lacks the required entry ", what);
}

Device Device::open(const std::string& name, const std::string& plugin_path, int index,
                    int local_rank) {
  Device d;
  d.name_ = name;
  if (name == "cpu") {
    d.table_ = *dt_hal_cpu_v4();
    d.abi_version_ = DT_HAL_API_VERSION_4;
    d.origin_ = "built-in";
  } else {
    DT_CHECK(ConfigError, !name.empty() && name.find('/') == std::string::npos, "device name '",
             name, "' must be a plain name such as cpu or cuda");
    d.lib_ = std::make_unique<Library>();
    // Every copy on the path is judged as a plugin of an ABI version this dt supports, with the
    // entries every device needs: one that is not (another dt's build first in the path, a
    // foreign library of the same name) is skipped for a later copy, as one that does not load.
    detail::load_from_path("libdt_hal_" + name + ".so", plugin_path, "device '" + name + "'",
                           *d.lib_, [&d](const detail::SharedLibrary& lib) -> std::string {
                             try {
                               d.adopt_table(lib.handle);
                             } catch (const ConfigError& e) {
                               return e.message();
                             }
                             return "";
                           });
    d.origin_ = d.lib_->path;
  }
  const dt_hal_v1_t& t = d.table_.v3.v2.v1;
  if (index < 0 && t.device_count == nullptr) index = 0;  // a plugin that cannot count: its first
  if (index < 0) {                                        // one device per local rank, round robin
    int count = 0;
    const int cs = t.device_count(&count);
    if (cs != DT_HAL_OK || count < 1) {
      const char* msg = t.last_error(nullptr);
      DT_THROW(DeviceError, "device '", name, "' (", d.origin_, "): no device to open (",
               cs != DT_HAL_OK ? status_name(cs) : "device_count = 0", ")", msg && *msg ? ": " : "",
               msg ? msg : "");
    }
    index = std::max(local_rank, 0) % count;
  }
  d.index_ = index;
  const int st = t.open(index, &d.ctx_);
  if (st != DT_HAL_OK) {
    // open() has no context to hold its message: the plugin keeps it for last_error(NULL).
    const char* msg = t.last_error(nullptr);
    d.ctx_ = nullptr;
    DT_THROW(DeviceError, "device '", name, "' (", d.origin_, "): open(", index, ") failed (",
             status_name(st), ")", msg && *msg ? ": " : "", msg ? msg : "");
  }
  return d;
}

std::string Device::describe() const {
  if (table_.v3.v2.describe) {
    char buf[256] = {0};
    if (table_.v3.v2.describe(ctx_, buf, sizeof buf) == DT_HAL_OK && buf[0]) {
      buf[sizeof buf - 1] = '\0';  // a plugin that filled the buffer whole
      return buf;
    }
  }
  return name_ + " (" + origin_ + ")";
}

Device::Device(Device&& o) noexcept
    : name_(std::move(o.name_)),
      origin_(std::move(o.origin_)),
      lib_(std::move(o.lib_)),
      table_(o.table_),
      abi_version_(o.abi_version_),
      index_(o.index_),
      ctx_(o.ctx_) {
  o.ctx_ = nullptr;
  const long held = o.holders_.load();
  if (held != 0) {  // a programming error: they would point at the moved-from Device
    std::fprintf(stderr,
                 "dt: fatal: device '%s' moved while %ld of its buffers or graphs hold its "
                 "address\n",
                 name_.c_str(), held);
    std::abort();
  }
}

Device::~Device() {
  if (ctx_ && table_.v3.v2.v1.close) table_.v3.v2.v1.close(ctx_);
}

void Device::missing(const char* what) const {
  DT_THROW(DeviceError, "device '", name_, "' (", origin_, ") does not provide ", what);
}

void Device::failed(const char* what, int status) const {
  const char* msg = table_.v3.v2.v1.last_error ? table_.v3.v2.v1.last_error(ctx_) : "";
  DT_THROW(DeviceError, "device '", name_, "' (", origin_, "): ", what, " failed (",
           status_name(status), "): ", msg ? msg : "");
}

namespace {
std::atomic<std::size_t> g_allocated{0}, g_max_allocated{0};
void count_alloc(std::size_t bytes) noexcept {
  const std::size_t now = g_allocated.fetch_add(bytes) + bytes;
  std::size_t peak = g_max_allocated.load();
  while (now > peak && !g_max_allocated.compare_exchange_weak(peak, now)) {
  }
}
}  // namespace

std::size_t Device::allocated_bytes() noexcept { return g_allocated.load(); }
std::size_t Device::max_allocated_bytes() noexcept { return g_max_allocated.load(); }

Device::Buffer::Buffer(const Device& d, std::size_t bytes) : dev_(&d), bytes_(bytes) {
  const int st = d.table_.v3.v2.v1.alloc(d.ctx_, bytes, &ptr_);
  if (st != DT_HAL_OK) d.failed("alloc", st);
  count_alloc(bytes_);
  if (ptr_) ++d.holders_;
}

Device::Buffer::~Buffer() {
  if (ptr_ && dev_) {
    dev_->table_.v3.v2.v1.release(dev_->ctx_, ptr_);
    g_allocated.fetch_sub(bytes_);
    --dev_->holders_;
  }
}

Device::Buffer& Device::Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ && dev_) {
      dev_->table_.v3.v2.v1.release(dev_->ctx_, ptr_);
      g_allocated.fetch_sub(bytes_);
      --dev_->holders_;
    }
    dev_ = o.dev_;
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

Device::Graph::~Graph() {
  if (graph_ && dev_) {
    if (dev_->table_.v3.v2.graph_destroy) dev_->table_.v3.v2.graph_destroy(dev_->ctx_, graph_);
    --dev_->holders_;
  }
}

Device::Graph& Device::Graph::operator=(Graph&& o) noexcept {
  if (this != &o) {
    if (graph_ && dev_) {
      if (dev_->table_.v3.v2.graph_destroy) dev_->table_.v3.v2.graph_destroy(dev_->ctx_, graph_);
      --dev_->holders_;
    }
    dev_ = o.dev_;
    graph_ = o.graph_;
    o.graph_ = nullptr;
  }
  return *this;
}

void Device::Graph::launch() const {
  DT_CHECK(InvalidArgument, graph_ != nullptr && dev_ != nullptr, "launch of an empty graph");
  dev_->call(&dt_hal_v2_t::graph_launch, "graph_launch", graph_);
}

Device::Graph Device::capture(const std::function<void()>& work) const {
  call(&dt_hal_v2_t::graph_begin, "graph_begin");
  try {
    work();
  } catch (...) {
    void* abandoned = nullptr;  // end the capture; the error above is the one to report
    if (table_.v3.v2.graph_end && table_.v3.v2.graph_end(ctx_, &abandoned) == DT_HAL_OK &&
        abandoned && table_.v3.v2.graph_destroy)
      table_.v3.v2.graph_destroy(ctx_, abandoned);
    throw;
  }
  Graph g;
  g.dev_ = this;
  call(&dt_hal_v2_t::graph_end, "graph_end", &g.graph_);
  if (g.graph_) ++holders_;
  return g;
}

dt_hal_dtype hal_dtype(DType t) {
  switch (t) {
    case DType::f32:
      return DT_HAL_F32;
    case DType::bf16:
      return DT_HAL_BF16;
    case DType::f16:
      return DT_HAL_F16;
    default:
      break;
  }
  DT_THROW(InvalidArgument, "dtype ", dtype_name(t),
           " has no device kernels (the devices compute in f32, bf16 or f16)");
}

bool Device::host_memory() const noexcept {
  return table_.v3.v2.v1.name != nullptr && std::strcmp(table_.v3.v2.v1.name, "cpu") == 0;
}

std::vector<std::string> missing_training_kernels(const Device& dev, DType compute, bool graphs) {
  DT_CHECK(InvalidArgument,
           compute == DType::f32 || compute == DType::bf16 || compute == DType::f16,
           "training dtype ", dtype_name(compute), " is not one of f32, bf16, f16");
  const dt_hal_v2_t& t = dev.table2();
  const dt_hal_v1_t& v = t.v1;
  auto p = [](auto fn) { return reinterpret_cast<const void*>(fn); };
  // Everything the GPT forward, backward and optimiser step call, in table order.
  const std::pair<const void*, const char*> needed[] = {
      {p(v.copy), "copy"},
      {p(v.fill_zero), "fill_zero"},
      {p(v.synchronize), "synchronize"},
      {p(v.gemm), "gemm"},
      {p(v.bias_add), "bias_add"},
      {p(v.bias_grad), "bias_grad"},
      {p(v.add), "add"},
      {p(v.scale), "scale"},
      {p(v.sum_squares), "sum_squares"},
      {p(v.embedding_fwd), "embedding_fwd"},
      {p(v.embedding_bwd), "embedding_bwd"},
      {p(v.layernorm_fwd), "layernorm_fwd"},
      {p(v.layernorm_bwd), "layernorm_bwd"},
      {p(v.gelu_fwd), "gelu_fwd"},
      {p(v.gelu_bwd), "gelu_bwd"},
      {p(v.attention_fwd), "attention_fwd"},
      {p(v.attention_bwd), "attention_bwd"},
      {p(v.softmax_xent_fwd), "softmax_xent_fwd"},
      {p(v.softmax_xent_bwd), "softmax_xent_bwd"},
      {p(v.adamw), "adamw"},
  };
  std::vector<std::string> out;
  for (const auto& [fn, what] : needed)
    if (!fn) out.emplace_back(what);
  if (compute != DType::f32) {
    const std::pair<const void*, const char*> mixed[] = {
        {p(t.gemm_ex), "gemm_ex"},
        {p(t.cast), "cast"},
        {p(t.scale_check_finite), "scale_check_finite"},
    };
    for (const auto& [fn, what] : mixed)
      if (!fn) out.emplace_back(what);
  }
  if (graphs) {
    const std::pair<const void*, const char*> capture[] = {
        {p(t.stream_create), "stream_create"}, {p(t.stream_destroy), "stream_destroy"},
        {p(t.set_stream), "set_stream"},       {p(t.graph_begin), "graph_begin"},
        {p(t.graph_end), "graph_end"},         {p(t.graph_launch), "graph_launch"},
        {p(t.graph_destroy), "graph_destroy"},
    };
    for (const auto& [fn, what] : capture)
      if (!fn) out.emplace_back(what);
  }
  return out;
}

void require_training_kernels(const Device& dev, DType compute, bool graphs) {
  const std::vector<std::string> missing = missing_training_kernels(dev, compute, graphs);
  if (missing.empty()) return;
  std::string list;
  for (const auto& m : missing) list += (list.empty() ? "" : ", ") + m;
  DT_THROW(
      ConfigError, "device '", dev.name(), "' (", dev.origin(), ", ABI version ", dev.abi_version(),
      ") cannot train in ", dtype_name(compute), graphs ? " with --engine.cuda_graphs" : "",
      ": it lacks the ", graphs ? "entr" : "kernel",
      graphs ? (missing.size() == 1 ? "y " : "ies ") : (missing.size() == 1 ? " " : "s "), list);
}

}  // namespace dt
