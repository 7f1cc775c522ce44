// A thread's open trace Scopes, readable from another thread while it changes them (the
// timeline written at a hang shows what each thread was inside). Internal to src/obs/trace.cpp;
// in a header of its own so that the unit tests can race its reader against its writer directly.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace dt::trace {

// One thread's open Scopes, outermost first: written by that thread only, read by write() from
// another (the watchdog's, at a hang) under a sequence lock: `seq` is odd while the owner changes
// them, and a reader retries when it changed meanwhile.
struct OpenScopes {
  static constexpr int kMax = 32;  // deeper ones are counted, not kept
  struct Slot {
    std::atomic<const char*> name{nullptr}, category{nullptr}, arg_name{nullptr};
    std::atomic<std::int64_t> arg{0}, t0{0};
  };
  std::atomic<std::uint32_t> seq{0};
  std::atomic<int> depth{0};
  Slot slots[kMax];

  void push(const char* name, const char* category, const char* arg_name, std::int64_t arg,
            std::int64_t t0) noexcept {
    const std::uint32_t q = seq.load(std::memory_order_relaxed);
    seq.store(q + 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    const int d = depth.load(std::memory_order_relaxed);
    if (d < kMax) {
      Slot& slot = slots[d];
      slot.name.store(name, std::memory_order_relaxed);
      slot.category.store(category, std::memory_order_relaxed);
      slot.arg_name.store(arg_name, std::memory_order_relaxed);
      slot.arg.store(arg, std::memory_order_relaxed);
      slot.t0.store(t0, std::memory_order_relaxed);
    }
    depth.store(d + 1, std::memory_order_relaxed);
    seq.store(q + 2, std::memory_order_release);
  }
  void pop() noexcept {
    const int d = depth.load(std::memory_order_relaxed);
    if (d == 0) return;
    const std::uint32_t q = seq.load(std::memory_order_relaxed);
    seq.store(q + 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    depth.store(d - 1, std::memory_order_relaxed);
    seq.store(q + 2, std::memory_order_release);
  }
  struct Open {
    const char* name;
    const char* category;
    const char* arg_name;
    std::int64_t arg, t0;
  };
  /// The open Scopes (empty when the owner kept changing them through every try).
  std::vector<Open> snapshot() const {
    std::vector<Open> out;
    for (int attempt = 0; attempt < 1000; ++attempt) {
      out.clear();
      const std::uint32_t q = seq.load(std::memory_order_acquire);
      if (q & 1U) continue;
      const int d = std::min(depth.load(std::memory_order_relaxed), kMax);
      for (int i = 0; i < d; ++i)
        out.push_back(Open{slots[i].name.load(std::memory_order_relaxed),
                           slots[i].category.load(std::memory_order_relaxed),
                           slots[i].arg_name.load(std::memory_order_relaxed),
                           slots[i].arg.load(std::memory_order_relaxed),
                           slots[i].t0.load(std::memory_order_relaxed)});
      std::atomic_thread_fence(std::memory_order_acquire);
      if (seq.load(std::memory_order_relaxed) == q) return out;
    }
    out.clear();
    return out;
  }
};

}  // namespace dt::trace
