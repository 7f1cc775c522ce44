// dt::security::SealedP2p: AES-256-GCM sealing around any dt::P2p (see dt/security.hpp).
#pragma once

#include <atomic>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/abandon.hpp"
#include "dt/security.hpp"

namespace dt::security {

/// Reusable message buffers (uninitialised bytes), so that large messages do not fault in fresh
/// pages on every send. get() hands out the most recently returned of the smallest buffers that
/// fit, so a buffer is reused while it is still in cache. Thread-safe.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  struct Buf {
    std::unique_ptr<std::uint8_t[]> p;
    std::size_t cap = 0;
    std::size_t size = 0;
    std::uint8_t* data() const noexcept { return p.get(); }
  };
  /// Returns the buffer to the pool when destroyed.
  class Handle {
   public:
    Handle() = default;
    Handle(std::shared_ptr<BufferPool> pool, std::unique_ptr<Buf> b)
        : pool_(std::move(pool)), b_(std::move(b)) {}
    Handle(Handle&&) noexcept = default;
    Handle& operator=(Handle&& o) noexcept;
    ~Handle();
    Buf* operator->() const noexcept { return b_.get(); }
    /// Gives the buffer up without freeing it (abandon()): for a buffer a transport may still be
    /// using when its owner goes away (an unfinished operation of a failing job).
    void leak() noexcept;
    explicit operator bool() const noexcept { return b_ != nullptr; }

   private:
    std::shared_ptr<BufferPool> pool_;
    std::unique_ptr<Buf> b_;
  };
  Handle get(std::size_t bytes);
  void put(std::unique_ptr<Buf> b) noexcept;

 private:
  std::mutex mu_;
  std::multimap<std::size_t, std::unique_ptr<Buf>> free_;  // by capacity; equal keys: LIFO
  std::size_t free_bytes_ = 0;
};

/// dt::abandon (comm/abandon.hpp) of a pool buffer's memory.
void abandon(std::unique_ptr<BufferPool::Buf> b) noexcept;
using dt::abandon;

class ShmMailboxes;

class SealedP2p final : public P2p {
 public:
  /// See seal_p2p(). Collective over `inner`.
  static std::unique_ptr<SealedP2p> create(std::unique_ptr<P2p> inner, const Keys& keys,
                                           const SealOptions& opts);
  ~SealedP2p() override;

  int rank() const noexcept override { return inner_->rank(); }
  int size() const noexcept override { return inner_->size(); }
  const std::string& name() const noexcept override { return name_; }

  Work isend(ConstTensorView buf, int dst, int tag) override;
  Work irecv(TensorView buf, int src, int tag) override;

  /// Whether messages to and from `peer` are sealed.
  bool sealed_with(int peer) const noexcept;
  /// Whether sealed messages to and from `peer` travel through a shared-memory mailbox.
  bool shm_with(int peer) const noexcept;
  /// Sends and receives of internal traffic may use tags at and above kReservedTagBase.
  Work isend_internal(ConstTensorView buf, int dst, int tag);
  Work irecv_internal(TensorView buf, int src, int tag);

  struct Peer;
  struct TamperState;

 private:
  SealedP2p() = default;
  void check_tag(int tag, const char* op) const;
  void check_peer(int peer, const char* op) const;
  const std::shared_ptr<Peer>& peer(int p) const;
  Work isend_tampered(ConstTensorView buf, int dst, int tag);

  std::unique_ptr<P2p> inner_;
  std::string name_;
  std::string channel_;
  std::size_t record_bytes_ = kDefaultRecordBytes;
  std::vector<bool> plain_;
  std::vector<int> world_;  // each rank's rank in MPI_COMM_WORLD (-1: not known), for messages
  std::vector<std::shared_ptr<Peer>> peers_;  // shared with receives that outlive this object
  std::shared_ptr<BufferPool> pool_;
  std::unique_ptr<TamperState> tamper_;
  std::shared_ptr<ShmMailboxes> shm_;  // same-node peers; null: none (or turned off)
};

/// Per peer: keys, counters and sequence numbers. Through a mailbox, `enc` and `dec` are used by
/// the mailboxes only (under their lock).
struct SealedP2p::Peer {
  std::mutex send_mu;  // held while one message's records are sealed and posted, in order
  std::optional<Aead> enc;
  std::uint64_t counter = 0;              // records sent to this peer (the nonce counter)
  std::map<int, std::uint64_t> send_seq;  // per tag
  std::mutex recv_mu;                     // held while one message's receives are posted
  std::map<int, std::uint64_t> recv_seq;  // per tag, assigned when a receive is posted
  std::mutex dec_mu;                      // opening happens outside recv_mu
  std::optional<Aead> dec;
  // Through the transport: once a message from this peer is rejected (or a receive from it
  // cancelled), the channel is broken.
  // Every later receive from it, and every pending one at its next step, fails with the same
  // error and gives up its records.
  std::atomic<bool> broken{false};
  std::mutex fail_mu;
  std::exception_ptr failed;  // under fail_mu; set once, before `broken`
  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lk(fail_mu);
    if (!failed) failed = std::move(e);
    broken.store(true, std::memory_order_release);
  }
  std::exception_ptr failure() {
    std::lock_guard<std::mutex> lk(fail_mu);
    return failed;
  }
};

}  // namespace dt::security
