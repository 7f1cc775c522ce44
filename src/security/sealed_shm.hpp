// dt::security::ShmMailboxes: sealed records between the ranks of one node through shared memory
// (dt/security.hpp, "Shared memory").
//
// Layout: one POSIX shared-memory object per node and channel (dt::ShmSegment), one region per
// local rank holding its inbound mailboxes, one per local sender. A mailbox is a ring of K slots
// of one record each (its 72-byte trailer, then up to record_bytes of ciphertext) with two
// counters on cache lines of their own: `head` (records the sender has published) and `tail`
// (records the receiver has released). The sender seals a record straight into the slot at head
// and publishes it (release store); the receiver authenticates and decrypts it straight from the
// slot into the caller's buffer and releases the slot. So each byte takes one AES-GCM pass on
// each side and no copy, and sender and receiver overlap record by record.
//
// Matching: records of a message follow each other in the ring, in send order. The first record
// of a message is routed by the tag in its (not yet authenticated) header to the oldest posted
// receive for that tag. With none posted, the message waits in the ring for its receive, unless
// a receive of another tag from the same peer is posted (it waits behind) or a wait has made no
// progress for a millisecond (both sides may be blocked sending to each other): then it is kept
// aside (its records copied out of the ring, as MPI keeps unexpected messages) until a receive
// for the tag is posted. Whatever a record is routed to, opening it checks every header field
// against what the receive expects (dt::security::open_record).
//
// Progress: isend seals as many records as the ring has room for at once; receives open what has
// arrived. Every test() and wait() of a Work of the mailboxes advances all of them (sealing into
// free slots, opening arrived records), and a helper thread seals pending sends when no caller
// has advanced the mailboxes for a millisecond, so a send completes while its caller computes or
// waits on another communicator (as MPI's do). Receives advance only inside their callers' calls.
// Waits spin briefly, then yield the core (sleep on real-time threads), and after a millisecond
// without progress sleep 50 us at a time, leaving the core to the peer on a shared node.
//
// Failures: a rejected record fails its receive with dt::SecurityError (naming the peer and the
// sequence number, counted in dt_security_auth_failures_total). The channel's mailboxes are then
// finished: every pending and later operation fails with the same error and nothing more touches
// a caller's buffer (the job is about to end; buffers may be freed while it unwinds). A wait that
// makes no progress checks its peer: a peer whose transport was destroyed (close()) with the
// awaited message unsent or unread, or whose process is gone, ends the channel likewise with
// dt::CommError instead of a hang. close() also stops the helper thread.
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/mpi_comm.hpp"
#include "comm/shm_segment.hpp"
#include "sealed_p2p.hpp"

namespace dt::security {

class ShmMailboxes : public std::enable_shared_from_this<ShmMailboxes> {
 public:
  struct Config {
    std::string name;              ///< the channel's name, for messages
    std::size_t record_bytes = 0;  ///< the channel's record size (the same on every rank)
    std::size_t ring_bytes = 0;    ///< SealOptions::shm_ring_bytes
    bool enabled = true;           ///< false on any rank of a node: that node has no mailboxes
    int simulated_nodes = 0;       ///< SealOptions::simulated_nodes
    std::vector<bool> plain;       ///< per peer: traffic stays unsealed (no mailbox)
  };
  /// Collective over `comm` (the transport's MPI communicator; its ranks are the transport's).
  /// Returns nullptr when no peer of this rank's node gets a mailbox: the node has one rank,
  /// a rank there disabled them, records are larger than kMaxShmRecordBytes, or the segment could
  /// not be created on some rank of the node (all ranks of a node agree). `peers` holds every
  /// peer's keys (SealedP2p::Peer, by rank); `pool` the buffers of messages kept aside.
  static std::shared_ptr<ShmMailboxes> create(MPI_Comm comm, const Config& cfg,
                                              std::vector<std::shared_ptr<SealedP2p::Peer>> peers,
                                              std::shared_ptr<BufferPool> pool);
  ~ShmMailboxes();
  ShmMailboxes(const ShmMailboxes&) = delete;
  ShmMailboxes& operator=(const ShmMailboxes&) = delete;

  /// Whether messages to and from `peer` travel through a mailbox.
  bool serves(int peer) const noexcept;
  /// Slots per mailbox.
  std::size_t slots() const noexcept { return slots_; }

  /// Sends one message: records sealed from `src` (first.message_length bytes) with the header
  /// `first` (sequence, tag, record count; `first.counter` is the first record's counter, record
  /// i takes first.counter + i). Completes when every record is in the mailbox.
  Work send(std::string what, int dst, const void* src, const Header& first);
  /// Sends records already sealed (ciphertext then trailer in each buffer), in this order (the
  /// test-only faults of Tamper). Completes when every record is in the mailbox.
  Work send_raw(std::string what, int dst, std::vector<BufferPool::Handle> records);
  /// Receives one message as `e` describes it (sender, tag, sequence, message_length, records)
  /// into `out` (e.message_length bytes).
  Work recv(std::string what, int src, void* out, const Expect& e);
  /// This rank's end is going away: peers waiting for it fail instead of waiting, and the helper
  /// thread stops (operations still pending advance only in their Works' calls).
  void close() noexcept;

  struct Op;
  struct SendOp;
  struct RecvOp;
  /// Advances every mailbox until `op` is done or nothing moves; true when anything moved.
  /// `stuck`: the caller's wait has not moved for a while; messages whose receive is not posted
  /// are then kept aside whatever else is posted (see step_in).
  bool advance(Op& op, bool stuck);
  /// Throws dt::CommError into `op` when its peer closed its end or its process is gone.
  void check_peer(Op& op);
  /// The state of `op`: rethrows its error; true when done.
  bool finished(Op& op);
  /// Withdraws `op` (`what` names it): true when it has finished, or when it was pending and the
  /// channel's mailboxes are then finished with "cancelled" (as on a failure: a receive's message
  /// would reach the next receive under another sequence number, a send's rest would be taken for
  /// the next message's records). Nothing reads or writes its buffer any more.
  bool cancel(Op& op, const std::string& what);

 private:
  struct RingCtl;
  struct RankCtl;
  struct Stashed {
    BufferPool::Handle buf;  // ciphertext, then trailer
    std::size_t len = 0;     // ciphertext bytes
  };
  struct InMsg {  // a message begun in the ring, not yet handed over
    int tag = 0;
    std::uint32_t total = 1;   // ring records that belong to it
    std::uint32_t taken = 0;   // ring records taken so far
    std::vector<Stashed> raw;  // records kept aside before its receive was posted
    std::shared_ptr<RecvOp> recv;
  };
  struct OutMsg {
    std::shared_ptr<SendOp> op;
    const std::uint8_t* src = nullptr;
    Header h;  // h.counter: the first record's
    std::vector<BufferPool::Handle> raw;
    std::uint32_t count = 0, next = 0;
  };
  struct Outbound {
    RingCtl* ctl = nullptr;
    char* slots = nullptr;
    std::uint64_t head = 0, tail_seen = 0;
    std::list<OutMsg> queue;
  };
  struct Inbound {
    RingCtl* ctl = nullptr;
    char* slots = nullptr;
    std::uint64_t tail = 0;
    std::map<int, std::list<std::shared_ptr<RecvOp>>> posted;  // by tag, oldest first
    std::list<InMsg> msgs;  // in ring order; the last may be `cur`
    InMsg* cur = nullptr;   // the message the next ring record belongs to
  };

  ShmMailboxes() = default;
  bool step_out(int peer);
  bool step_in(int peer, bool stuck);
  bool round(bool sends_only, bool stuck);
  void open_one(RecvOp& r, const std::uint8_t* ct, std::size_t ct_bytes,
                const std::uint8_t* trailer);
  void fail_all(std::exception_ptr e);
  void finish(Op& op);
  void started(Op& op);
  void helper();
  RankCtl& rank_ctl(int local) const noexcept;
  char* ring_at(int from_local, int to_local) const noexcept;
  char* slot(char* slots, std::uint64_t i) const noexcept {
    return slots + (i % slots_) * slot_bytes_;
  }

  std::string name_;
  int rank_ = 0;
  std::size_t record_bytes_ = 0, slot_bytes_ = 0, slots_ = 0, ring_total_ = 0, region_bytes_ = 0;
  std::vector<int> local_of_;  // per peer: its local rank on this node, or -1
  int me_local_ = 0;
  ShmSegment seg_;
  std::vector<std::shared_ptr<SealedP2p::Peer>> peers_;
  std::shared_ptr<BufferPool> pool_;
  std::vector<int> served_;  // peers with a mailbox
  std::vector<Outbound> out_;
  std::vector<Inbound> in_;

  std::mutex mu_;              // every mailbox and operation state
  std::exception_ptr failed_;  // the channel's first failure: nothing moves any more
  int open_ops_ = 0;           // pending sends (the helper thread's work)
  std::atomic<int> open_ops_seen_{0};
  std::atomic<std::int64_t> caller_advanced_ns_{0};

  std::mutex helper_mu_;
  std::condition_variable helper_cv_;
  bool stop_ = false;
  std::thread helper_;
};

/// Largest record a mailbox slot holds; channels with larger records use the transport.
inline constexpr std::size_t kMaxShmRecordBytes = std::size_t{16} << 20;

}  // namespace dt::security
