// dt::Device: one opened device plugin (hal/dt_hal_v4.h, ABI version 4, or an older version
// through an adapter: hal/dt_hal_v3.h, hal/dt_hal_v2.h, hal/dt_hal.h) and its context.
//
// "cpu" is the built-in CPU device; any other NAME is loaded from libdt_hal_NAME.so found in the
// plugin path. The built-in device goes through the same table as a loaded one. Every kernel call
// goes through call(), which reports a missing (optional) entry or a failed status as a
// dt::DeviceError naming the device, the entry and the plugin's own message. An older plugin is
// seen through a version-4 table whose newer entries are NULL, so call() on one of them reports it
// missing like any optional entry.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dt/dtype.hpp"
#include "dt/error.hpp"
#include "dt_hal.h"
#include "dt_hal_v2.h"
#include "dt_hal_v3.h"
#include "dt_hal_v4.h"

namespace dt {

class DeviceError : public Error {
  using Error::Error;
};

class Device {
 public:
  /// Opens device `index` of plugin `name`; a negative index opens device local_rank modulo the
  /// plugin's device_count (one GPU per rank of a node). plugin_path: colon-separated directories
  /// searched in order for libdt_hal_NAME.so. Throws dt::ConfigError when the plugin is missing
  /// or has a different ABI version (naming both versions), dt::DeviceError when it fails to open
  /// (with the plugin's own message, e.g. that no GPU is present).
  static Device open(const std::string& name, const std::string& plugin_path, int index = 0,
                     int local_rank = 0);
  ~Device();
  /// A Device may be moved only while no Buffer or Graph holds it (they keep its address): moving
  /// one that is held aborts, naming the device and the count.
  Device(Device&& o) noexcept;
  Device& operator=(Device&&) = delete;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  const std::string& name() const noexcept { return name_; }
  /// Where the table came from: "built-in" or the plugin file.
  const std::string& origin() const noexcept { return origin_; }
  /// The version-1 part of the table (every plugin has it).
  const dt_hal_v1_t& table() const noexcept { return table_.v3.v2.v1; }
  /// The version-2 part; its own entries are NULL for a version-1 plugin.
  const dt_hal_v2_t& table2() const noexcept { return table_.v3.v2; }
  /// The version-3 part; its own entries are NULL for an older plugin.
  const dt_hal_v3_t& table3() const noexcept { return table_.v3; }
  /// The whole table; version-4 entries are NULL for an older plugin.
  const dt_hal_v4_t& table4() const noexcept { return table_; }
  /// ABI version of the plugin as loaded (1 to 4).
  int abi_version() const noexcept { return abi_version_; }
  /// The device index opened (the plugin's numbering: a CUDA device ordinal).
  int index() const noexcept { return index_; }
  void* ctx() const noexcept { return ctx_; }
  bool has(const void* entry) const noexcept { return entry != nullptr; }
  /// Whether the host may read and write this device's memory directly: true for the CPU device
  /// (a table named "cpu", built in or loaded), false for every other device, whose tensors dt
  /// moves only through copy (checkpoints, samples) and reduces through a device communicator.
  bool host_memory() const noexcept;
  /// The plugin's describe() line, or "NAME (ORIGIN)" where it has none.
  std::string describe() const;

  /// Calls table entry `entry` (named `what` in errors) with the context and `args`; `entry` is
  /// a member of the table of any version (dt_hal_v1_t::gemm, dt_hal_v4_t::flash_attention_fwd).
  template <class Table, class... Fn, class... Args>
  void call(int (*Table::*entry)(void*, Fn...), const char* what, Args&&... args) const {
    auto fn = part<Table>().*entry;
    if (!fn) missing(what);
    const int st = fn(ctx_, std::forward<Args>(args)...);
    if (st != DT_HAL_OK) failed(what, st);
  }
  /// The part of the table of version Table (dt_hal_v1_t .. dt_hal_v4_t).
  template <class Table>
  const Table& part() const noexcept {
    if constexpr (std::is_same_v<Table, dt_hal_v1_t>) {
      return table();
    } else if constexpr (std::is_same_v<Table, dt_hal_v2_t>) {
      return table2();
    } else if constexpr (std::is_same_v<Table, dt_hal_v3_t>) {
      return table3();
    } else {
      static_assert(std::is_same_v<Table, dt_hal_v4_t>, "not a dt device table");
      return table4();
    }
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

  /// A captured graph of device work (RAII; the version-2 graph entries), from capture().
  class Graph {
   public:
    Graph() = default;
    ~Graph();
    Graph(Graph&& o) noexcept : dev_(o.dev_), graph_(o.graph_) { o.graph_ = nullptr; }
    Graph& operator=(Graph&& o) noexcept;
    Graph(const Graph&) = delete;
    Graph& operator=(const Graph&) = delete;
    explicit operator bool() const noexcept { return graph_ != nullptr; }
    /// Runs the recorded work again, on the device's current stream.
    void launch() const;

   private:
    friend class Device;
    const Device* dev_ = nullptr;
    void* graph_ = nullptr;
  };
  /// Captures the device work `work` issues on the current stream (graph_begin .. graph_end)
  /// without running it. If `work` throws, the capture is ended and dropped and the exception
  /// goes on; a call the device refused inside the capture fails graph_end with its reason.
  Graph capture(const std::function<void()>& work) const;

 private:
  Device() = default;
  [[noreturn]] void missing(const char* what) const;
  [[noreturn]] void failed(const char* what, int status) const;
  // Takes the table of a loaded plugin (the newest ABI version it exports); throws
  // dt::ConfigError with the reason alone where it is no dt plugin of a supported version, or
  // lacks an entry every device needs.
  void adopt_table(void* handle);

  struct Library;
  std::string name_;
  std::string origin_;
  std::unique_ptr<Library> lib_;
  dt_hal_v4_t table_{};  // a copy: the plugin's own table, or an adapter of an older one
  int abi_version_ = 0;
  int index_ = 0;
  void* ctx_ = nullptr;
  mutable std::atomic<long> holders_{0};  // Buffers with memory and Graphs made from this Device
};

/// The dt_hal_dtype of a dt::DType (f32, bf16, f16); throws dt::InvalidArgument for the others.
dt_hal_dtype hal_dtype(DType t);

/// Names of the table entries that training with parameters and gradients in fp32 and matrix
/// products in `compute` (f32, bf16 or f16) needs and `dev` lacks, in table order; empty when
/// everything is there. f32 needs the version-1 kernels; bf16 and f16 also need gemm_ex, cast
/// and scale_check_finite. graphs (engine.cuda_graphs): also the stream and graph entries.
std::vector<std::string> missing_training_kernels(const Device& dev, DType compute = DType::f32,
                                                  bool graphs = false);

/// Throws dt::ConfigError "device 'NAME' (ORIGIN) cannot train in DTYPE: it lacks the kernels
/// a, b, c" when missing_training_kernels() is not empty. Costs nothing on the device: call it once
/// after Device::open, before any allocation, so a device that cannot train is refused up front.
void require_training_kernels(const Device& dev, DType compute = DType::f32, bool graphs = false);

/// The default plugin path: $DT_PLUGIN_PATH (set by the dt module) if set, then DIR/../plugins
/// and DIR/../lib/dt/plugins next to the executable, then dt/plugins next to libdt.
std::string default_plugin_path();

}  // namespace dt
