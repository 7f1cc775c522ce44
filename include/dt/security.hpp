// dt::security: job keys, AES-256-GCM sealing of tensor traffic, sealed collectives.
//
// Keys. A job key is 32 random bytes in a file (security.key_file) owned by the job's user and
// readable by nobody else (mode 0600 or 0400). Make one and hand it to every node of a job:
//
//     head -c 32 /dev/urandom > ~/.dt/job.key && chmod 600 ~/.dt/job.key
//     # inside the batch script, before srun: copy it to node-local storage on every node
//     sbcast --force ~/.dt/job.key /tmp/dt-$SLURM_JOB_ID.key    # sbcast keeps owner and mode
//     srun ./dt_train --security.seal=all --security.key_file=/tmp/dt-$SLURM_JOB_ID.key ...
//     # epilog or end of script: srun rm -f /tmp/dt-$SLURM_JOB_ID.key
//
// From the job key, HKDF-SHA-256 (OpenSSL EVP_KDF) derives one key per job, channel and direction:
// salt = "dt/job/" + Slurm job id, info = the 16-byte salts that sender and receiver each draw
// afresh each time a channel is created, channel name, sender rank and receiver rank. So a message
// from another job, another channel, another run of the same job (a requeue) or the other
// direction never verifies, and a sender's key depends on randomness it drew itself: no salt
// altered or replayed on the way makes it reuse a key and nonce. Checkpoint keys are derived from
// the job key and a random per-file salt only (a checkpoint outlives the job that wrote it).
//
// Sealed messages (wire format version 2, "dtS2"; all integers little-endian). A message of n
// plaintext bytes is cut into records of at most R bytes (SealOptions::record_bytes, the same on
// every rank of a channel): ceil(n / R) records, one empty record for an empty message. Each record
// is sealed on its own and travels as up to two messages of the inner transport on the message's
// tag: its ciphertext (omitted when empty), received straight into the caller's buffer and opened
// there in place, then its 72-byte trailer:
//   0  "dtS2"   4  sender u32   8  receiver u32   12  tag i32   16  sequence u64 (per sender,
//   receiver and tag, from 0)   24  counter u64 (per sender and receiver, from 0; one value per
//   record)   32  message plaintext bytes u64   40  record index u32   44  record count u32
//   48  record plaintext bytes u64   56  16-byte GCM tag.
// The first 56 bytes (the header) are the record's AAD. A record in one buffer (the fuzzer's and
// the unit tests' view) is its ciphertext followed by its trailer, as the two messages arrive.
// The 96-bit nonce is sender (24 bits) | receiver (24 bits) | counter (48 bits): every record takes
// a fresh counter value, so a nonce never repeats under a key. The receiver checks sender,
// receiver, tag, the next expected sequence number for (sender, tag), the message length, and that
// record i of n arrives where record i of n is expected: a bit flipped anywhere, a replayed,
// reordered, truncated or redirected message, and a record of a message dropped, repeated, moved
// or taken from another message are rejected with dt::SecurityError naming the peer and the
// sequence number, and counted in dt_security_auth_failures_total{reason=...}.
//
// Cost: the sender seals record k+1 while the transport carries record k, the receiver opens
// record k (in place, while it is in cache) while record k+1 arrives; one AES-GCM pass per byte on
// each side, no copy besides the transport's own. A record of 256 KiB fits in a core's L2 cache,
// so it is opened while its ciphertext is still there.
//
// Shared memory: between ranks of one node (as MPI sees nodes: MPI_Comm_split_type SHARED), the
// records do not go through the transport at all. Each ordered pair of ranks has a mailbox in a
// node-wide POSIX shared-memory segment: a ring of record slots (SealOptions::shm_ring_bytes)
// with a head and a tail counter. The sender seals each record straight into the next free slot
// and publishes it; the receiver authenticates and decrypts it straight from the slot into the
// caller's buffer and frees the slot. So each byte is encrypted once and decrypted once, with no
// copy in between, and both sides work at once, record by record. Records, nonces, headers and
// every check are those of the transport path, and so are the errors (a rejected record fails its
// receive with dt::SecurityError naming the peer and the sequence number; every other pending
// or later operation through the channel's mailboxes then fails too, a failed receive's buffer
// keeps nothing of the records it opened, and none touches a caller's buffer any more). A message
// that arrives before its receive is posted waits in the mailbox; it is copied aside (as MPI keeps
// unexpected messages) only when a receive of another tag waits behind it, or when a wait has made
// no progress for a millisecond. Synchronisation is by atomics in the segment: waits spin briefly,
// then yield the core; a wait that makes no progress fails with dt::CommError when the peer's end
// was destroyed or its process is gone, instead of hanging. Sends complete when every record is in
// the mailbox; every wait on the channel advances every pending operation, and a helper thread
// seals pending sends when nobody has advanced them for a millisecond (so a send completes while
// its caller computes or waits elsewhere, as MPI's do). Tamper faults apply on this path as on the
// transport's.
//
// Failure policy: a SecurityError must end the job (no rank may go on with bad data). Callers catch
// it at the top of the rank and call abort_job(), which prints the reason and calls MPI_Abort, so
// ranks waiting for the rejected data do not hang.
#pragma once

#include <sys/stat.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dt/comm.hpp"

namespace dt::security {

inline constexpr std::size_t kKeyBytes = 32;
inline constexpr std::size_t kSaltBytes = 16;
inline constexpr std::size_t kNonceBytes = 12;
inline constexpr std::size_t kTagBytes = 16;
inline constexpr std::size_t kHeaderBytes = 56;
/// A record's trailer: its header (the AAD) and its GCM tag.
inline constexpr std::size_t kTrailerBytes = kHeaderBytes + kTagBytes;
/// Bytes sealing adds to each record's plaintext.
inline constexpr std::size_t kSealOverhead = kTrailerBytes;
/// Default plaintext bytes per record (SealOptions::record_bytes).
inline constexpr std::size_t kDefaultRecordBytes = std::size_t{256} << 10;
/// Largest record size a channel accepts (record lengths fit in an EVP call).
inline constexpr std::size_t kMaxRecordBytes = std::size_t{1} << 30;
/// Tags at and above this value are reserved by sealed transports for their own traffic (two of
/// them). Every MPI takes tags up to 32767 (MPI_TAG_UB may be no larger: 8388607 with Open MPI's
/// UCX layer), and MpiComm keeps 32767 for itself: the reserved tags lie below.
inline constexpr int kReservedTagBase = 32512;

using Key = std::array<std::uint8_t, kKeyBytes>;
using Salt = std::array<std::uint8_t, kSaltBytes>;

/// A secret key that is wiped from memory on destruction. Copyable (each copy is wiped).
class SecretKey {
 public:
  SecretKey() = default;
  explicit SecretKey(const Key& k) : k_(k) {}
  SecretKey(const SecretKey&) = default;
  SecretKey& operator=(const SecretKey&) = default;
  ~SecretKey();
  const Key& bytes() const noexcept { return k_; }

 private:
  Key k_{};
};

/// Reads a 32-byte job key from `path`. Throws dt::ConfigError naming the file when it cannot be
/// opened, is not a regular file, is not owned by the effective user, has any group or other
/// permission bit set (the message shows the mode in octal, e.g. 0644), or does not hold exactly
/// 32 bytes.
SecretKey load_key_file(const std::string& path);

/// Opens a file that holds a secret (read only, not following a link) and checks that it is a
/// regular file of this process's user that group and others cannot access; returns its
/// descriptor (the caller closes it) and fills *st. Throws dt::ConfigError naming `option`, the
/// path and what is wrong (with the chmod that mends it).
int open_private_file(const std::string& option, const std::string& path, struct stat* st);

/// The credentials of --metrics.push-auth-file: one line "USER:PASSWORD" (a trailing line
/// break allowed) in a private file (open_private_file). Throws dt::ConfigError naming the
/// option and the file, never the password.
std::pair<std::string, std::string> load_basic_auth_file(const std::string& option,
                                                         const std::string& path);

/// The n bytes at p as lowercase hex digits, two per byte.
std::string to_hex(const std::uint8_t* p, std::size_t n);

/// A fingerprint of `key` (16 hex digits, derived by HKDF with a label of its own, so it tells
/// nothing about the key or the keys derived from it): equal keys give equal fingerprints, and
/// ranks compare them to find one that read another key.
std::string key_fingerprint(const SecretKey& key);

/// The Slurm job id of this process (SLURM_JOB_ID), or "none" outside Slurm.
std::string slurm_job_id();

/// 16 random bytes from OpenSSL's CSPRNG. Throws dt::SecurityError if it fails.
Salt random_salt();

namespace detail {
/// Testing only: when set, random_salt() returns this salt (a salt replayed from an earlier run).
extern const Salt* salt_for_test;
}  // namespace detail

/// Defined where AesImpl exists (for code that also builds against older dt: perf/bench_seal.cpp).
#define DT_SECURITY_HAS_AES_IMPL 1

/// Which code computes AES-256-GCM. Both give the same bytes (the algorithm is the standard one),
/// so ranks that use different ones still talk.
enum class AesImpl {
  automatic,  ///< ipsec_mb when dt was built with it and it has AVX-512 code for this CPU; else
              ///< openssl
  openssl,    ///< OpenSSL's EVP interface
  ipsec_mb,   ///< Intel ipsec-mb (VAES and VPCLMULQDQ on CPUs that have them)
};
/// "auto", "openssl" or "ipsec-mb".
const char* aes_impl_name(AesImpl a) noexcept;
/// Parses aes_impl_name's text; throws dt::ConfigError naming `what` and the accepted values.
AesImpl parse_aes_impl(const std::string& text, const std::string& what);
/// Whether this build has it (automatic and openssl: always).
bool aes_impl_available(AesImpl a) noexcept;
/// What `automatic` means on this machine (openssl or ipsec_mb); others are returned unchanged.
AesImpl resolve_aes_impl(AesImpl a) noexcept;
/// The code path ipsec-mb chose for this CPU ("avx512+vaes", "avx512", "avx2", ...), or "" where
/// it is not available.
std::string ipsec_mb_arch();
/// Why ipsec_mb is not available ("" when it is).
std::string ipsec_mb_unavailable();

/// Key derivation from one job key.
class Keys {
 public:
  /// `job_id` is mixed into every traffic key (use slurm_job_id()).
  Keys(SecretKey job_key, std::string job_id, AesImpl aes = AesImpl::automatic);
  const std::string& job_id() const noexcept { return job_id_; }
  /// The AES-GCM code the Aeads of these keys use (resolved: openssl or ipsec_mb).
  AesImpl aes() const noexcept { return aes_; }
  /// The key of messages from `sender` to `receiver` on `channel`, with the salts the two drew
  /// for this channel instance.
  SecretKey traffic_key(const std::string& channel, const Salt& sender_salt,
                        const Salt& receiver_salt, int sender, int receiver) const;
  /// The key of a checkpoint file with this file salt (independent of the job id).
  SecretKey checkpoint_key(const Salt& file_salt) const;

 private:
  SecretKey job_key_;
  std::string job_id_;
  AesImpl aes_;
};

/// HKDF-SHA-256 (RFC 5869) of `ikm` with `salt` and `info` into 32 bytes.
Key hkdf_sha256(const std::uint8_t* ikm, std::size_t ikm_len, const std::uint8_t* salt,
                std::size_t salt_len, const std::uint8_t* info, std::size_t info_len);

/// One AES-256-GCM key schedule (RAII, move-only). Not thread-safe. Throws dt::SecurityError when
/// `impl` is ipsec_mb and this build has no ipsec-mb.
class Aead {
 public:
  Aead(const SecretKey& key, bool encrypt, AesImpl impl = AesImpl::automatic);
  ~Aead();
  Aead(Aead&& o) noexcept;
  Aead& operator=(Aead&& o) noexcept;
  Aead(const Aead&) = delete;
  Aead& operator=(const Aead&) = delete;

  /// Encrypts n bytes of `in` into `out` (may be the same pointer) and writes the 16-byte tag.
  void seal(const std::uint8_t* nonce, const std::uint8_t* aad, std::size_t aad_len, const void* in,
            std::size_t n, void* out, std::uint8_t* tag);
  /// Decrypts into `out` and checks the tag; false when it does not verify (then `out` is
  /// zeroed: no unverified byte stays where a caller that catches the error could use it).
  bool open(const std::uint8_t* nonce, const std::uint8_t* aad, std::size_t aad_len, const void* in,
            std::size_t n, void* out, const std::uint8_t* tag);
  /// openssl or ipsec_mb (openssl also for a moved-from Aead, which holds neither).
  AesImpl impl() const noexcept { return imb_ ? AesImpl::ipsec_mb : AesImpl::openssl; }

 private:
  void release() noexcept;
  // A usable Aead of the right direction, and n within GCM's limit (dt::SecurityError).
  void check_call(bool sealing, std::size_t n) const;
  void* ctx_ = nullptr;  // EVP_CIPHER_CTX (openssl)
  void* imb_ = nullptr;  // the key schedule and hash keys (ipsec_mb)
  bool encrypt_ = true;
};

// ---- the sealed-message format --------------------------------------------------------------

/// The header of one record (its AAD).
struct Header {
  std::uint32_t sender = 0;
  std::uint32_t receiver = 0;
  std::int32_t tag = 0;
  std::uint64_t sequence = 0;        ///< per (sender, receiver, tag): the message
  std::uint64_t counter = 0;         ///< per (sender, receiver), one per record: the nonce
  std::uint64_t message_length = 0;  ///< plaintext bytes of the whole message
  std::uint32_t record = 0;          ///< index of this record in the message
  std::uint32_t records = 1;         ///< records of the message
  std::uint64_t length = 0;          ///< plaintext bytes of this record
};

/// Largest counter (48 bits); a pair that would pass it gets dt::SecurityError (re-key).
inline constexpr std::uint64_t kMaxCounter = (std::uint64_t{1} << 48) - 1;
/// Largest rank a sealed transport serves (24 bits).
inline constexpr int kMaxRank = (1 << 24) - 1;

/// Records of a message of `bytes` plaintext bytes cut into records of `record_bytes` (> 0): at
/// least one (an empty message is one empty record). Record i starts at i * record_bytes.
std::uint64_t record_count(std::uint64_t bytes, std::size_t record_bytes) noexcept;

void encode_header(const Header& h, std::uint8_t* out);
/// Parses the trailer of a record whose ciphertext has `ciphertext_bytes` bytes. Throws
/// dt::SecurityError ("malformed sealed message ...") for a trailer that is not kTrailerBytes
/// long, a wrong magic, a record length that does not match the ciphertext, or a record index
/// outside the record count. Never reads past trailer_bytes.
Header parse_trailer(const std::uint8_t* trailer, std::size_t trailer_bytes,
                     std::size_t ciphertext_bytes);
/// parse_trailer of a record in one buffer (ciphertext then trailer, `wire_bytes` in all).
Header parse_header(const std::uint8_t* wire, std::size_t wire_bytes);
/// The nonce of a header: sender | receiver | counter.
std::array<std::uint8_t, kNonceBytes> nonce_of(const Header& h);

/// Seals h.length bytes of `plain` into `ciphertext` (h.length bytes; may be `plain`) and
/// `trailer` (kTrailerBytes). Throws dt::SecurityError when h.counter is past kMaxCounter.
void seal_record(Aead& enc, const Header& h, const void* plain, std::uint8_t* ciphertext,
                 std::uint8_t* trailer);
/// seal_record into one buffer `wire` of h.length + kSealOverhead bytes (ciphertext, trailer).
void seal_message(Aead& enc, const Header& h, const void* plain, std::uint8_t* wire);

/// What the receiver expects of the next record.
struct Expect {
  int sender = 0;
  int receiver = 0;
  int tag = 0;
  std::uint64_t sequence = 0;
  std::uint64_t message_length = 0;  ///< plaintext bytes of the whole message
  std::uint32_t record = 0;
  std::uint32_t records = 1;
  std::size_t length = 0;  ///< plaintext bytes of this record
  std::string channel;     ///< for messages
  /// The sender's and receiver's ranks in MPI_COMM_WORLD where the channel's ranks are others
  /// (a communicator split from the world); -1 where not known. Rejections name both.
  int sender_world = -1;
  int receiver_world = -1;
};

/// "from rank S to rank R" of a message `e` describes, with the world ranks where they differ
/// ("from rank 1 (world rank 2) to rank 0 (world rank 0)").
std::string route_of(const Expect& e);

/// Why a message was rejected (the label of dt_security_auth_failures_total).
enum class Reject { malformed, authentication, sequence, redirected };
const char* reject_name(Reject r) noexcept;

/// Opens a record: authenticates `ciphertext` (ciphertext_bytes) with its trailer and decrypts
/// it into `out` (e.length bytes; may be `ciphertext`, opened in place). Throws dt::SecurityError
/// naming the peer, the sequence number (and the record of a message of several) and the reason
/// when the record is malformed, does not authenticate, belongs to another message (replay,
/// reorder), is addressed to another rank or tag, is not the expected record of its message
/// (dropped, repeated or moved records), or has another length (truncation); *why (if given)
/// says which check failed. `out` holds no usable data after a throw. Returns the header. Counts
/// nothing (see count_failure).
Header open_record(Aead& dec, const std::uint8_t* ciphertext, std::size_t ciphertext_bytes,
                   const std::uint8_t* trailer, std::size_t trailer_bytes, const Expect& e,
                   void* out, Reject* why = nullptr);
/// open_record of a record in one buffer (ciphertext then trailer, `wire_bytes` in all).
Header open_message(Aead& dec, const std::uint8_t* wire, std::size_t wire_bytes, const Expect& e,
                    void* out, Reject* why = nullptr);

/// Adds one to dt_security_auth_failures_total{reason}.
void count_failure(Reject r) noexcept;
/// Registers dt_security_auth_failures_total for every reason at 0, so that a sealed run exports
/// the series from its start (a counter that first appears at its first failure is hard to
/// alert on).
void register_failure_counters() noexcept;

// ---- sealed point-to-point ------------------------------------------------------------------

/// Test-only faults applied by a sender to its own outgoing sealed messages, counted from 0 over
/// every sealed message this rank sends on the channel.
struct Tamper {
  enum class Kind { none, flip, replay, reorder, drop_record, swap_records };
  Kind kind = Kind::none;
  /// flip: one bit of the ciphertext (or of the tag for an empty message) of message `at`.
  /// replay: the next message to the same (peer, tag) after `at` is replaced by a copy of `at`.
  /// reorder: message `at` is held back and sent after the next message to the same (peer, tag).
  /// drop_record: the last record of message `at` is never sent (a truncated message).
  /// swap_records: records 0 and 1 of message `at` travel in the other order (a message of one
  /// record travels unchanged).
  std::uint64_t at = 0;
};
/// Parses "none", "flip:N", "replay:N", "reorder:N", "drop-record:N" or "swap-records:N" (N the
/// message index); throws dt::ConfigError naming `option` otherwise.
Tamper parse_tamper(const std::string& text, const std::string& option = "test.tamper");

struct SealOptions {
  /// Part of the key derivation: two sealed transports of one job must use different channels.
  std::string channel = "p2p";
  /// Peers whose messages travel unsealed (ranks of the same node when shared-memory traffic is
  /// exempted); empty: every peer is sealed. Must be symmetric across ranks.
  std::vector<int> plain_peers;
  /// Plaintext bytes per record, in [4096, kMaxRecordBytes]; must be the same on every rank of
  /// the channel (dt::InvalidArgument otherwise, found when the channel is created). 64 KiB to
  /// 1 MiB keeps a record in cache between its transfer and its sealing or opening.
  std::size_t record_bytes = kDefaultRecordBytes;
  /// Sealed messages between ranks of one node (MPI_Comm_split_type SHARED over the transport's
  /// communicator) go through shared-memory mailboxes instead of the transport (see "Shared
  /// memory" above). false on any rank of a node: that node uses the transport. Transports not
  /// backed by MPI (make_p2p's are) always use the transport.
  bool shm = true;
  /// Bytes of one mailbox (one per ordered pair of sealed ranks of a node), rounded down to whole
  /// records, at least two and at most 256; the smallest value of a node's ranks applies; shrunk
  /// (to two records at least) where a node's mailboxes would take more than 1 GiB. The sender
  /// runs at most this far ahead of its receiver: on a node whose cores are shared with other
  /// jobs, the two are seldom scheduled at once, and a mailbox of a few scheduler time slices of
  /// sealing keeps each busy while the other waits (8 MiB: about twice as fast as 2 MiB there,
  /// perf/RESULTS.md); when both run at once, the receiver reads what the sender has just
  /// written, from the shared cache, whatever the size.
  std::size_t shm_ring_bytes = std::size_t{8} << 20;
  /// Testing only: mailboxes serve only ranks of the same simulated node (this many contiguous
  /// blocks of ranks), as SealedCommOptions::simulated_nodes.
  int simulated_nodes = 0;
  Tamper tamper;  ///< testing only
};

/// Wraps `inner` so that every message is sealed with AES-256-GCM. Collective over `inner` (every
/// rank calls it with the same channel and record size): every rank draws a salt and sends it with
/// its record size to every rank (MPI_Allgather over the transport's MPI communicator, else one
/// message each way on tag kReservedTagBase), in the clear: it is no secret, and an altered salt
/// only makes messages fail authentication. Tags must lie in
/// [0, kReservedTagBase) (dt::InvalidArgument).
/// isend seals record by record on the calling thread and hands each record to the transport as
/// soon as it is sealed, so the peer receives and opens record k while record k+1 is sealed; it
/// returns when the last record is posted (cost: one AES-GCM pass, about 3 GB/s per core with
/// AES-NI, into pooled buffers that are reused while still in cache). A receive posts every
/// record's ciphertext straight into the caller's buffer (so, as with MPI, pending receives must
/// not share buffer space); its Work opens the records in place, in order, as they arrive, in
/// test() or wait(), and throws dt::SecurityError there if a record is rejected (the error is
/// stored and rethrown by every later call). A rejected message breaks the channel from its
/// sender: receives from that peer still pending fail with the same error at their next test() or
/// wait(), later ones at once. A failed receive gives up the records it has not received
/// (Work::cancel, within a second in all), so the transport writes no more into its buffer, and
/// zeroes what it received; where a record could not be given up (already in transfer for over
/// that second, or a transport that cannot withdraw receives) only the opened records are zeroed,
/// and the buffer must stay valid as for an unfinished receive, until the receive's
/// Work::cancel(grace) returns true: it retries them (and then zeroes the whole buffer). The
/// receive buffer holds no data of a rejected message: callers must treat the error as fatal
/// (abort_job). Work::cancel of an unfinished receive through the transport withdraws its records
/// (zeroing the buffer once all are) and breaks the channel from its peer (its message would reach
/// the next receive under another sequence number): later receives from it fail with the cancelled
/// one's dt::CommError. Through a mailbox, Work::cancel of an unfinished receive ends the channel's
/// mailboxes as a rejected message does (every pending operation with a mailbox fails with the
/// cancelled one's dt::CommError, and so do later ones): it returns true at once, and nothing
/// writes into the buffer any more; so does Work::cancel of a send not yet wholly in its mailbox
/// (which reads its buffer until then). A send through the transport reads the caller's buffer
/// only within isend() and cannot be cancelled (false).
std::unique_ptr<P2p> seal_p2p(std::unique_ptr<P2p> inner, const Keys& keys,
                              const SealOptions& opts = {});

// ---- sealed collectives ---------------------------------------------------------------------

struct SealedCommOptions {
  /// Inner transport: "mpi" or "ucx" (dt::make_p2p).
  std::string p2p = "mpi";
  /// Messages are cut into segments of at most this many bytes, so sealing, transfer and opening
  /// overlap.
  std::size_t segment_bytes = std::size_t{1} << 20;
  /// Traffic between ranks of one node (MPI_COMM_TYPE_SHARED) travels unsealed.
  bool exempt_node_local = false;
  /// Sealed traffic between ranks of one node goes through shared-memory mailboxes
  /// (SealOptions::shm).
  bool shm = true;
  /// Testing only: pretend the ranks sit on this many nodes (contiguous blocks of ranks).
  int simulated_nodes = 0;
  Tamper tamper;  ///< testing only
};

/// A dt::Comm whose collectives are dt's own algorithms over sealed point-to-point messages, so
/// every hop decrypts, reduces and re-encrypts (MPI cannot reduce ciphertext). Collective over
/// `world`, which must be an MPI communicator (dt::InvalidArgument otherwise).
///
/// Algorithms: all_reduce = reduce_scatter + all_gather, each rank owning one block; the owner
/// combines every rank's block in rank order 0..size-1 (dt's reduce_elements), so results are
/// bitwise identical on every rank and equal to dt::ShmComm's; reduce_scatter and all_gather send
/// each block straight to the ranks that need it; broadcast is a pipelined chain from the root;
/// barrier is a dissemination barrier of empty sealed messages. Per rank, all_reduce seals and
/// opens 2 (size-1)/size of the buffer. All operations run in call order on the communicator's
/// progress thread; the blocking forms wait for them (with CommOptions::timeout). Send/recv are
/// sealed too (tags below kReservedTagBase). split() creates a sealed communicator on the split.
/// A rejected message throws dt::SecurityError from the operation's Work; the communicator is
/// then broken and refuses further operations. A failed operation withdraws the receives it had
/// posted (within a second) and its sends still reading the buffer (through a mailbox); where a
/// receive could not be withdrawn (a transfer under way), its buffers must stay valid as for an
/// unfinished operation (the communicator gives up its own).
std::unique_ptr<Comm> make_sealed_comm(Comm& world, const Keys& keys,
                                       const SealedCommOptions& opts = {});

/// Prints "dt: rank R: security: <what>; aborting the job" to stderr and calls
/// MPI_Abort(MPI_COMM_WORLD, 5). For the top-level handler of a rank.
[[noreturn]] void abort_job(const std::exception& e);

}  // namespace dt::security
