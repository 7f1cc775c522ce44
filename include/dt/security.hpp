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
// salt = "dt/job/" + Slurm job id, info = channel name, a 16-byte session salt that rank 0 draws
// afresh each time a channel is created, sender rank and receiver rank. So a message from another
// job, another channel, another run of the same job (a requeue) or the other direction never
// verifies. Checkpoint keys are derived from the job key and a random per-file salt only (a
// checkpoint outlives the job that wrote it).
//
// Sealed messages (wire format, all integers little-endian; the 40-byte header is the AAD):
//   0  "dtS1"   4  sender u32   8  receiver u32   12  tag i32   16  sequence u64 (per sender,
//   receiver and tag, from 0)   24  counter u64 (per sender and receiver, from 0)   32  plaintext
//   bytes u64   40  ciphertext   40+n  16-byte GCM tag.
// The 96-bit nonce is sender (24 bits) | receiver (24 bits) | counter (48 bits), so it never
// repeats under a key. The receiver checks sender, receiver, tag, length and the next expected
// sequence number for (sender, tag): a bit flipped anywhere, a replayed, reordered, truncated or
// redirected message is rejected with dt::SecurityError naming the peer and the sequence number,
// and counted in dt_security_auth_failures_total{reason=...}.
//
// Failure policy: a SecurityError must end the job (no rank may go on with bad data). Callers catch
// it at the top of the rank and call abort_job(), which prints the reason and calls MPI_Abort, so
// ranks waiting for the rejected data do not hang.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dt/comm.hpp"

namespace dt::security {

inline constexpr std::size_t kKeyBytes = 32;
inline constexpr std::size_t kSaltBytes = 16;
inline constexpr std::size_t kNonceBytes = 12;
inline constexpr std::size_t kTagBytes = 16;
inline constexpr std::size_t kHeaderBytes = 40;
/// Bytes a sealed message adds to its plaintext.
inline constexpr std::size_t kSealOverhead = kHeaderBytes + kTagBytes;
/// Tags at and above this value are reserved by sealed transports for their own traffic.
inline constexpr int kReservedTagBase = 0x7FFF0000;

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

/// The Slurm job id of this process (SLURM_JOB_ID), or "none" outside Slurm.
std::string slurm_job_id();

/// 16 random bytes from OpenSSL's CSPRNG. Throws dt::SecurityError if it fails.
Salt random_salt();

/// Key derivation from one job key.
class Keys {
 public:
  /// `job_id` is mixed into every traffic key (use slurm_job_id()).
  Keys(SecretKey job_key, std::string job_id);
  const std::string& job_id() const noexcept { return job_id_; }
  /// The key of messages from `sender` to `receiver` on `channel` in the session `session`.
  SecretKey traffic_key(const std::string& channel, const Salt& session, int sender,
                        int receiver) const;
  /// The key of a checkpoint file with this file salt (independent of the job id).
  SecretKey checkpoint_key(const Salt& file_salt) const;

 private:
  SecretKey job_key_;
  std::string job_id_;
};

/// HKDF-SHA-256 (RFC 5869) of `ikm` with `salt` and `info` into 32 bytes.
Key hkdf_sha256(const std::uint8_t* ikm, std::size_t ikm_len, const std::uint8_t* salt,
                std::size_t salt_len, const std::uint8_t* info, std::size_t info_len);

/// One AES-256-GCM key schedule in an OpenSSL EVP context (RAII, move-only). Not thread-safe.
class Aead {
 public:
  Aead(const SecretKey& key, bool encrypt);
  ~Aead();
  Aead(Aead&& o) noexcept;
  Aead& operator=(Aead&& o) noexcept;
  Aead(const Aead&) = delete;
  Aead& operator=(const Aead&) = delete;

  /// Encrypts n bytes of `in` into `out` (may be the same pointer) and writes the 16-byte tag.
  void seal(const std::uint8_t* nonce, const std::uint8_t* aad, std::size_t aad_len,
            const void* in, std::size_t n, void* out, std::uint8_t* tag);
  /// Decrypts into `out` and checks the tag; false when it does not verify (then `out` holds
  /// unverified bytes that must not be used).
  bool open(const std::uint8_t* nonce, const std::uint8_t* aad, std::size_t aad_len,
            const void* in, std::size_t n, void* out, const std::uint8_t* tag);

 private:
  void* ctx_ = nullptr;  // EVP_CIPHER_CTX
  bool encrypt_ = true;
};

// ---- the sealed-message format --------------------------------------------------------------

struct Header {
  std::uint32_t sender = 0;
  std::uint32_t receiver = 0;
  std::int32_t tag = 0;
  std::uint64_t sequence = 0;  ///< per (sender, receiver, tag)
  std::uint64_t counter = 0;   ///< per (sender, receiver): the nonce
  std::uint64_t length = 0;    ///< plaintext bytes
};

/// Largest counter (48 bits); a pair that would pass it gets dt::SecurityError (re-key).
inline constexpr std::uint64_t kMaxCounter = (std::uint64_t{1} << 48) - 1;
/// Largest rank a sealed transport serves (24 bits).
inline constexpr int kMaxRank = (1 << 24) - 1;

void encode_header(const Header& h, std::uint8_t* out);
/// Parses the header of a sealed message of `wire_bytes` bytes. Throws dt::SecurityError
/// ("malformed sealed message ...") for a short buffer, a wrong magic, or a length that does not
/// match the buffer. Never reads past wire_bytes.
Header parse_header(const std::uint8_t* wire, std::size_t wire_bytes);
/// The nonce of a header: sender | receiver | counter.
std::array<std::uint8_t, kNonceBytes> nonce_of(const Header& h);

/// Seals h.length bytes of `plain` into `wire` (kSealOverhead + h.length bytes).
void seal_message(Aead& enc, const Header& h, const void* plain, std::uint8_t* wire);

/// What the receiver expects of the next message.
struct Expect {
  int sender = 0;
  int receiver = 0;
  int tag = 0;
  std::uint64_t sequence = 0;
  std::size_t length = 0;
  std::string channel;  ///< for messages
};

/// Why a message was rejected (the label of dt_security_auth_failures_total).
enum class Reject { malformed, authentication, sequence, redirected };
const char* reject_name(Reject r) noexcept;

/// Opens a sealed message into `out` (e.length bytes). Throws dt::SecurityError naming the peer,
/// the sequence number and the reason when the message is malformed, does not authenticate, is
/// not the next in sequence (replay, reorder), is addressed to another rank or tag, or has another
/// length (truncation); *why (if given) says which check failed. `out` holds no usable data after
/// a throw. Returns the header. Counts nothing (see count_failure).
Header open_message(Aead& dec, const std::uint8_t* wire, std::size_t wire_bytes, const Expect& e,
                    void* out, Reject* why = nullptr);

/// Adds one to dt_security_auth_failures_total{reason}.
void count_failure(Reject r) noexcept;

// ---- sealed point-to-point ------------------------------------------------------------------

/// Test-only faults applied by a sender to its own outgoing sealed messages, counted from 0 over
/// every sealed message this rank sends on the channel.
struct Tamper {
  enum class Kind { none, flip, replay, reorder };
  Kind kind = Kind::none;
  /// flip: one bit of the ciphertext (or of the tag for an empty message) of message `at`.
  /// replay: the next message to the same (peer, tag) after `at` is replaced by a copy of `at`.
  /// reorder: message `at` is held back and sent after the next message to the same (peer, tag).
  std::uint64_t at = 0;
};
/// Parses "none", "flip:N", "replay:N" or "reorder:N" (N the message index); throws
/// dt::ConfigError naming `option` otherwise.
Tamper parse_tamper(const std::string& text, const std::string& option = "test.tamper");

struct SealOptions {
  /// Part of the key derivation: two sealed transports of one job must use different channels.
  std::string channel = "p2p";
  /// Peers whose messages travel unsealed (ranks of the same node when shared-memory traffic is
  /// exempted); empty: every peer is sealed. Must be symmetric across ranks.
  std::vector<int> plain_peers;
  Tamper tamper;  ///< testing only
};

/// Wraps `inner` so that every message is sealed with AES-256-GCM. Collective over `inner` (every
/// rank calls it with the same channel): rank 0 draws the session salt and sends it to every rank
/// on tag kReservedTagBase (in the clear: it is no secret, and an altered salt only makes every
/// message fail authentication). Tags must lie in [0, kReservedTagBase) (dt::InvalidArgument).
/// isend seals on the calling thread before it returns (cost: one AES-GCM pass, about 3 GB/s per
/// core with AES-NI); a receive's Work decrypts and verifies when the inner receive completes,
/// in test() or wait(), and throws dt::SecurityError there if the message is rejected (the error
/// is stored and rethrown by every later call). The receive buffer holds no data of a rejected
/// message that could pass for valid: callers must treat the error as fatal (abort_job).
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
/// then broken and refuses further operations.
std::unique_ptr<Comm> make_sealed_comm(Comm& world, const Keys& keys,
                                       const SealedCommOptions& opts = {});

/// Prints "dt: rank R: security: <what>; aborting the job" to stderr and calls
/// MPI_Abort(MPI_COMM_WORLD, 5). For the top-level handler of a rank.
[[noreturn]] void abort_job(const std::exception& e);

}  // namespace dt::security
