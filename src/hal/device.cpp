#include "dt/device.hpp"

#include <atomic>

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "cpu_device.h"

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
}  // namespace

// Owns a dlopen handle.
struct Device::Library {
  void* handle = nullptr;
  ~Library() {
    if (handle) dlclose(handle);
  }
};

std::string default_plugin_path() {
  // Set by the dt module (modulefiles/dt): the plugins of the installation the user loaded.
  const char* env = std::getenv("DT_PLUGIN_PATH");
  std::string from_env = env && *env ? std::string(env) + ":" : "";
  char exe[PATH_MAX] = {0};
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return from_env;
  std::string dir(exe, static_cast<std::size_t>(n));
  dir = dir.substr(0, dir.rfind('/'));
  return from_env + dir + "/../plugins:" + dir + "/../lib/dt/plugins";
}

Device Device::open(const std::string& name, const std::string& plugin_path, int index) {
  Device d;
  d.name_ = name;
  if (name == "cpu") {
    d.table_ = dt_hal_cpu_v1();
    d.origin_ = "built-in";
  } else {
    DT_CHECK(ConfigError, !name.empty() && name.find('/') == std::string::npos, "device name '",
             name, "' must be a plain name such as cpu or cuda");
    const std::string file = "libdt_hal_" + name + ".so";
    std::string found;
    for (const auto& dir : split_path(plugin_path)) {
      struct stat st;
      if (::stat((dir + "/" + file).c_str(), &st) == 0) {
        found = dir + "/" + file;
        break;
      }
    }
    DT_CHECK(ConfigError, !found.empty(), "device '", name, "': plugin ", file,
             " not found in the plugin path '", plugin_path, "'");
    d.lib_ = std::make_unique<Library>();
    d.lib_->handle = dlopen(found.c_str(), RTLD_NOW | RTLD_LOCAL);
    DT_CHECK(ConfigError, d.lib_->handle != nullptr, "device '", name, "': cannot load ", found,
             ": ", dlerror());
    d.origin_ = found;
    auto entry =
        reinterpret_cast<dt_hal_plugin_v1_fn>(dlsym(d.lib_->handle, DT_HAL_PLUGIN_V1_SYMBOL));
    if (!entry) {
      for (int v = 2; v < 16; ++v) {
        const std::string sym = "dt_hal_plugin_v" + std::to_string(v);
        if (dlsym(d.lib_->handle, sym.c_str()))
          DT_THROW(ConfigError, "device '", name, "': plugin ", found, " provides ABI version ", v,
                   " (", sym, "), this dt needs ABI version ", DT_HAL_API_VERSION_1);
      }
      DT_THROW(ConfigError, "device '", name, "': ", found, " is not a dt device plugin (no ",
               DT_HAL_PLUGIN_V1_SYMBOL, " symbol)");
    }
    d.table_ = entry();
    DT_CHECK(ConfigError, d.table_ != nullptr, "device '", name, "': plugin ", found,
             " returned no table");
  }
  DT_CHECK(ConfigError, d.table_->api_version == DT_HAL_API_VERSION_1, "device '", name,
           "': ", d.origin_, " has ABI version ", d.table_->api_version,
           ", this dt needs ABI version ", DT_HAL_API_VERSION_1);
  for (auto [fn, what] :
       {std::pair<const void*, const char*>{reinterpret_cast<const void*>(d.table_->open), "open"},
        {reinterpret_cast<const void*>(d.table_->close), "close"},
        {reinterpret_cast<const void*>(d.table_->alloc), "alloc"},
        {reinterpret_cast<const void*>(d.table_->release), "release"},
        {reinterpret_cast<const void*>(d.table_->last_error), "last_error"}})
    DT_CHECK(ConfigError, fn != nullptr, "device '", name, "': ", d.origin_,
             " lacks the required entry ", what);
  const int st = d.table_->open(index, &d.ctx_);
  DT_CHECK(DeviceError, st == DT_HAL_OK, "device '", name, "': open(", index,
           ") failed: ", status_name(st));
  return d;
}

Device::Device(Device&& o) noexcept
    : name_(std::move(o.name_)),
      origin_(std::move(o.origin_)),
      lib_(std::move(o.lib_)),
      table_(o.table_),
      ctx_(o.ctx_) {
  o.table_ = nullptr;
  o.ctx_ = nullptr;
}

Device::~Device() {
  if (table_ && ctx_) table_->close(ctx_);
}

void Device::missing(const char* what) const {
  DT_THROW(DeviceError, "device '", name_, "' (", origin_, ") does not provide ", what);
}

void Device::failed(const char* what, int status) const {
  const char* msg = table_->last_error ? table_->last_error(ctx_) : "";
  DT_THROW(DeviceError, "device '", name_, "': ", what, " failed (", status_name(status),
           "): ", msg ? msg : "");
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
  const int st = d.table_->alloc(d.ctx_, bytes, &ptr_);
  if (st != DT_HAL_OK) d.failed("alloc", st);
  count_alloc(bytes_);
}

Device::Buffer::~Buffer() {
  if (ptr_ && dev_) {
    dev_->table_->release(dev_->ctx_, ptr_);
    g_allocated.fetch_sub(bytes_);
  }
}

Device::Buffer& Device::Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ && dev_) {
      dev_->table_->release(dev_->ctx_, ptr_);
      g_allocated.fetch_sub(bytes_);
    }
    dev_ = o.dev_;
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

}  // namespace dt
