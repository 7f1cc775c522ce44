// dt::ShmSegment: one POSIX shared-memory object that every rank of a node maps; dt::Backoff: the
// bounded-spin-then-yield pause of waits on flags kept in such a segment.
//
// Shared by dt::ShmComm (collectives through shared memory) and the sealed point-to-point
// mailboxes of dt::security (sealed_shm.hpp).
#pragma once

#include <sched.h>
#include <time.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace dt {

class MpiComm;

static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "shared-memory flags need lock-free 64-bit atomics");

/// A mapping of one POSIX shared-memory object (RAII, move-only).
class ShmSegment {
 public:
  ShmSegment() = default;
  /// Collective over `local` (ranks that share memory): local rank 0 creates an object of `bytes`
  /// bytes named "/<prefix>-<pid>-<n>" (mode 0600), reserves its memory with posix_fallocate (a
  /// full /dev/shm fails here rather than with SIGBUS at first touch), every rank maps it, and
  /// once every rank has mapped it (or failed) the name is unlinked, so a crashed job leaves
  /// nothing in /dev/shm. A system failure throws nothing: the returned segment is then empty
  /// and *err holds this rank's reason (another rank's failure shows up only there; callers
  /// agree on success with a reduction of their own). The memory is zero-filled. Throws
  /// dt::CommError only when MPI itself fails.
  static ShmSegment create(const MpiComm& local, std::size_t bytes, const char* prefix,
                           std::string* err);
  ~ShmSegment();
  ShmSegment(ShmSegment&& o) noexcept;
  ShmSegment& operator=(ShmSegment&& o) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  char* data() const noexcept { return static_cast<char*>(p_); }
  std::size_t size() const noexcept { return bytes_; }
  explicit operator bool() const noexcept { return p_ != nullptr; }

 private:
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

inline void cpu_relax() noexcept {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

/// True for SCHED_FIFO/SCHED_RR threads (the progress thread of a QoS tier): sched_yield() never
/// hands their core to an ordinary thread, so they must sleep instead of spinning.
bool realtime_thread() noexcept;

/// One waiting step after another: 128 spins (a peer a few microseconds behind), then yielding
/// the core (ordinary threads) or sleeping 10 us at a time (real-time threads, whose timer slack
/// is 0). reset() after progress.
class Backoff {
 public:
  void operator()() noexcept {
    if (spins_ < 128) {
      ++spins_;
      cpu_relax();
    } else if (rt_) {
      const timespec ts{0, 10000};
      nanosleep(&ts, nullptr);
    } else {
      sched_yield();
    }
  }
  void reset() noexcept { spins_ = 0; }
  /// True once spinning is over (the waiter yields or sleeps).
  bool idle() const noexcept { return spins_ >= 128; }

 private:
  unsigned spins_ = 0;
  bool rt_ = realtime_thread();
};

}  // namespace dt
