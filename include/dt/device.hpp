// dt::Device: one opened device plugin (hal/dt_hal.h, ABI version 1) and its context.
//
// "cpu" is the built-in CPU device; any other NAME is loaded from libdt_hal_NAME.so found in the
// plugin path. The built-in device goes through the same table as a loaded one. Every kernel call
// goes through call(), which reports a missing (optional) entry or a failed status as a
// dt::DeviceError naming the device, the entry and the plugin's own message.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "dt/error.hpp"
#include "dt_hal.h"

namespace dt {

class DeviceError : public Error {
  using Error::Error;
};

class Device {
 public:
  /// Opens device `index` of plugin `name`. plugin_path: colon-separated directories searched in
  /// order for libdt_hal_NAME.so. Throws dt::ConfigError when the plugin is missing or has a
  /// different ABI version (naming both versions), dt::DeviceError when it fails to open.
  static Device open(const std::string& name, const std::string& plugin_path, int index = 0);
  ~Device();
  Device(Device&& o) noexcept;
  Device& operator=(Device&&) = delete;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  const std::string& name() const noexcept { return name_; }
  /// Where the table came from: "built-in" or the plugin file.
  const std::string& origin() const noexcept { return origin_; }
  const dt_hal_v1_t& table() const noexcept { return *table_; }
  void* ctx() const noexcept { return ctx_; }
  bool has(const void* entry) const noexcept { return entry != nullptr; }

  /// Calls table entry `entry` (named `what` in errors) with the context and `args`.
  template <class... Fn, class... Args>
  void call(int (*dt_hal_v1_t::*entry)(void*, Fn...), const char* what, Args&&... args) const {
    auto fn = table_->*entry;
    if (!fn) missing(what);
    const int st = fn(ctx_, std::forward<Args>(args)...);
    if (st != DT_HAL_OK) failed(what, st);
  }

  /// Bytes of device memory dt's Buffers hold in this process (all devices), and the most held at
  /// once: what dt allocated through the plugins, not what the device has in use overall.
  static std::size_t allocated_bytes() noexcept;
  static std::size_t max_allocated_bytes() noexcept;

  /// Device memory of `bytes` (RAII). Contents undefined.
  class Buffer {
   public:
    Buffer() = default;
    Buffer(const Device& d, std::size_t bytes);
    ~Buffer();
    Buffer(Buffer&& o) noexcept : dev_(o.dev_), ptr_(o.ptr_), bytes_(o.bytes_) {
      o.ptr_ = nullptr;
      o.bytes_ = 0;
    }
    Buffer& operator=(Buffer&& o) noexcept;
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    template <class T>
    T* as() const noexcept {
      return static_cast<T*>(ptr_);
    }
    void* get() const noexcept { return ptr_; }
    std::size_t bytes() const noexcept { return bytes_; }

   private:
    const Device* dev_ = nullptr;
    void* ptr_ = nullptr;
    std::size_t bytes_ = 0;
  };

 private:
  Device() = default;
  [[noreturn]] void missing(const char* what) const;
  [[noreturn]] void failed(const char* what, int status) const;

  struct Library;
  std::string name_;
  std::string origin_;
  std::unique_ptr<Library> lib_;
  const dt_hal_v1_t* table_ = nullptr;
  void* ctx_ = nullptr;
};

/// The default plugin path: $DT_PLUGIN_PATH (set by the dt module) if set, then DIR/../plugins
/// and DIR/../lib/dt/plugins next to the executable.
std::string default_plugin_path();

}  // namespace dt
