// Parallel HDF5 checkpoints.
//
// One HDF5 file per checkpoint, DIR/step-N.h5, holding global (unsharded) float32 datasets under
// their nanoGPT names: /model/<name>, /optim/exp_avg/<name>, /optim/exp_avg_sq/<name>. The writing
// is spread over the ranks: the datasets are cut into fixed chunks of kChunkElements elements
// (in row-major order), the chunks of all datasets are numbered in order, and rank r writes a
// contiguous share of those chunks (or, for tensors sharded over the ranks, the chunks it holds
// most of; see save_checkpoint) through MPI-IO (collective metadata, independent transfers of
// large contiguous runs). Every chunk has a SHA-256 digest in
// /checksums/<dataset path> ([chunks, 32] uint8), so any reader, with any layout, can verify any
// part. Root attributes: format ("dt-checkpoint"), format_version, step, tokens, optimizer_step,
// data_position, rng_seed, loss_scale, config, layout, dt_version, chunk_elements; from format
// version 2, meta_sha256: the hex SHA-256 of step to layout, checked on every read, so that a
// damaged step or config is refused as a damaged chunk is; datasets and manifest_sha256: how
// many datasets the save wrote and the SHA-256 of their names and shapes, which verify_file
// checks, so that a tensor lost with its digests is found (version-1 files have none of these);
// from version 3, loss_scale_growth_tracker, loss_scale_hysteresis_left and steps_skipped (the
// loss scaler's schedule, also covered by meta_sha256); from version 4, data: what the run trained
// on (format, token count, dt::token_digest), which a resume compares with its own data (also
// covered by meta_sha256).
//
// Encryption at rest (ckpt.encrypt, with the job key of dt/security.hpp): every chunk of every
// dataset is sealed with AES-256-GCM under a per-file key (HKDF of the job key and a random
// 16-byte salt, root attribute key_salt), nonce = dataset ordinal (32 bits) | chunk index (64
// bits), AAD = "dt-ckpt-v1", dataset path, chunk index and chunk bytes, so a chunk moved to
// another place or file never authenticates. The datasets keep their shapes and hold the
// ciphertext (same size as the data); /crypto/<dataset path> ([chunks, 28] uint8) holds each
// chunk's nonce and tag; /checksums digests the ciphertext, so any reader can check integrity
// without the key, and resharding is unchanged. Root attributes: encryption ("aes-256-gcm"),
// key_salt and key_check (hex; the tag of an empty message under the file key), which tells a
// wrong key apart from damage. Errors about keys start with "checkpoint key:".
//
// Commit: the file is written as step-N.h5.partial, fsynced on every rank, renamed to step-N.h5
// once every rank finished, and DIR/latest ("step-N.h5\n") is replaced atomically. A crash at any
// point leaves the previous checkpoints and pointer intact.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dt/comm.hpp"
#include "dt/tensor.hpp"

namespace dt {

namespace security {
class Keys;
}

inline constexpr const char* kCheckpointFormat = "dt-checkpoint";
inline constexpr int kCheckpointVersion = 4;
/// Elements per checksum chunk (1 MiB of float32).
inline constexpr std::size_t kChunkElements = std::size_t{1} << 18;

/// Marks a CkptTensor whose data is the whole tensor.
inline constexpr std::size_t kWholeTensor = ~std::size_t{0};

/// A strided piece of a tensor held by one rank: the row-major elements
/// begin + j * stride + [0, len) for j in [0, count), stored densely at `data` (count * len
/// floats, row j at data + j * len). The rows must not overlap (stride >= len when count > 1);
/// stride is unused when count == 1. Examples for an [R, C] tensor: the column block [c0, c1)
/// of a tensor-parallel shard is {c0, c1 - c0, C, R}; the element range [a, b) is {a, b - a};
/// rows [r0, r1) are {r0 * C, (r1 - r0) * C}; a q|k|v shard is three column blocks; a range of
/// a column shard in its own row-major order is up to three (cut row, whole rows, cut row).
struct CkptPiece {
  std::size_t begin = 0;
  std::size_t len = 0;
  std::size_t stride = 0;
  std::size_t count = 1;
  float* data = nullptr;
  std::size_t numel() const { return len * count; }
};

/// One float32 tensor of the state: its dataset path, global shape and the part of it this rank
/// holds, in one of three forms:
///  - whole (the default: `pieces` empty, end == kWholeTensor): `data` is the whole tensor. Such a
///    tensor is replicated: every rank must hold it whole, and each writes a share of its chunks.
///  - a range (`pieces` empty, end != kWholeTensor): the row-major elements [begin, end), with
///    `data` pointing at element `begin` (parallel.zero). begin == end: this rank holds none of
///    the tensor.
///  - pieces (`pieces` not empty; data, begin and end are ignored): exactly the listed pieces
///    (tensor-parallel shards, q|k|v blocks, slices of them). Pieces with len == 0 or count == 0
///    hold nothing. An empty `pieces` selects one of the forms above, so a rank holding no piece
///    of a tensor says so with the empty range (end = begin) or a list of empty pieces.
/// A tensor held in ranges or pieces is sharded: save_checkpoint needs the ranks' parts to cover
/// it exactly once; load_checkpoint fills any parts (they may overlap, or leave elements out).
struct CkptTensor {
  std::string path;  ///< "/model/transformer.wte.weight"
  Shape shape;
  float* data = nullptr;
  std::size_t begin = 0;
  std::size_t end = kWholeTensor;
  std::vector<CkptPiece> pieces = {};
  std::size_t numel() const { return shape_numel(shape); }
  bool whole() const { return pieces.empty() && end == kWholeTensor; }
  std::size_t held_end() const { return end == kWholeTensor ? numel() : end; }
};

/// The scalar state stored as attributes.
struct CkptMeta {
  std::int64_t step = 0;            ///< optimiser steps taken (training resumes at this step)
  std::int64_t tokens = 0;          ///< training tokens seen
  std::int64_t optimizer_step = 0;  ///< AdamW t
  std::int64_t data_position = 0;   ///< sampler position (the step counter)
  std::int64_t rng_seed = 0;
  double loss_scale = 1.0;
  /// The loss scaler's schedule, so that a resumed run scales as an uninterrupted one: clean steps
  /// in a row, overflows left until the next back-off (0 or 1: the next overflow backs off), steps
  /// skipped. -1: not recorded (files of format version 2 and older, imported checkpoints).
  std::int64_t loss_scale_growth_tracker = -1;
  std::int64_t loss_scale_hysteresis_left = -1;
  std::int64_t steps_skipped = -1;
  std::string config;  ///< effective config, "name = value" lines
  std::string layout;  ///< parallel layout that wrote it, e.g. "dp=2"
  /// The training data: "FORMAT, N tokens, digest HEX" (dt::data_identity). Empty: not recorded
  /// (files of format version 3 and older, imported checkpoints).
  std::string data;
};

/// Timings of one save.
struct SaveStats {
  std::string path;
  double write_seconds = 0;  ///< create, write, hash, fsync, commit
  std::uint64_t bytes = 0;   ///< tensor bytes in the file
  /// Rank 0: checkpoints of a step not below this one ("OLD -> NEW" names), which the save set
  /// aside instead of deleting (a run that resumed from an older step, or started afresh).
  std::vector<std::string> set_aside;
  /// Rank 0: what failed after the commit (the folder's fsync, the retention's pruning); the
  /// checkpoint is committed all the same.
  std::vector<std::string> warnings;
};

/// Writes, commits and prunes a checkpoint of `tensors` at meta.step into `dir` (created if
/// missing). Collective over `comm` (an MPI communicator). Keeps `keep` (>= 1) checkpoints, the
/// new one and the newest below its step (keep=1: the previous one is removed once the new one is
/// committed), and removes stale *.partial files; checkpoints of its step or later are
/// renamed to *.superseded (SaveStats::set_aside), never deleted. Throws dt::CheckpointError naming
/// the file and the failing call; then nothing is committed and the previous checkpoint stays the
/// latest (what fails once `latest` names the new file, such as pruning, is a SaveStats warning).
/// `after_write` (a fault-injection seam for tests) runs on every rank once its data is in the
/// .partial file, before anything is made durable or committed. Every chunk is written and digested
/// by one rank. Replicated (whole) tensors: each rank writes a share of the chunks from its own
/// copy. Sharded tensors (ranges, pieces): the ranks' parts must cover each tensor exactly once,
/// else, before anything is written, a CheckpointError names the tensor and the first gap or
/// overlap (or the rank whose part does not fit the tensor). The ranks learn each other's pieces (4
/// numbers each); a chunk is written by the rank holding more than half of it, if any, else by the
/// rank whose share of all chunks it falls in, and the other holders of its elements send them
/// there, all in one MPI_Alltoallw straight from the pieces. Memory: the chunks a rank writes
/// (about 1/ranks of the state) and metadata in the number of pieces. With `keys` (ckpt.encrypt)
/// the datasets are encrypted (see above); each rank seals its own chunks (about 3 GB/s per core),
/// in place for sharded tensors and into one sealed copy of its share of the replicated ones.
SaveStats save_checkpoint(Comm& comm, const std::string& dir,
                          const std::vector<CkptTensor>& tensors, const CkptMeta& meta, int keep,
                          const std::function<void()>& after_write = {},
                          const security::Keys* keys = nullptr);

/// Reads `path` into `tensors` and verifies every chunk digest. A whole tensor is read whole on
/// every rank (each rank hashes its share of the chunks); a range or pieces (see CkptTensor) read
/// only the chunks that meet them, a bounded batch at a time, verify all of them and copy out what
/// the rank holds. Any decomposition loads a file written with any other (parts may overlap
/// between ranks; a rank's part outside the tensor is refused on every rank, naming the rank and
/// tensor). Collective. Throws dt::CheckpointError naming the file and each
/// bad dataset/chunk, or, for a checkpoint of another model, each tensor whose shape differs or
/// is missing (with a message that starts "checkpoint does not match the model"). After a
/// failure the tensors may hold part of the file's data.
/// Encryption: an encrypted file needs `keys`, and with `keys` only an encrypted file loads;
/// otherwise, and for a wrong key (found before any data is decrypted), the error starts with
/// "checkpoint key:". Every rank decrypts every chunk it reads; a chunk that does not
/// authenticate fails the load, naming the dataset and chunk. Data that passes its checksums and
/// fails authentication (chunks, their nonces and tags, or the root attributes of a version 2+
/// file) was rewritten by someone without the key together with the checksums: that throws
/// dt::SecurityError ("PATH: tampered: ..." for chunks), never a CheckpointError.
/// `accept`, where given, is called with the path and the file's metadata before any tensor is
/// read, and refuses the file by throwing (a CheckpointError "checkpoint does not match the
/// model: ..." for a model the shapes alone do not tell apart): the tensors are then untouched.
/// It must decide alike on every rank.
using CkptAccept = std::function<void(const std::string& path, const CkptMeta& meta)>;
CkptMeta load_checkpoint(Comm& comm, const std::string& path,
                         const std::vector<CkptTensor>& tensors,
                         const security::Keys* keys = nullptr, const CkptAccept& accept = {});

/// The committed checkpoints of `dir`, newest first (step-N.h5; no verification). These listings
/// are empty for a folder that does not exist, and throw dt::CheckpointError for one that cannot
/// be listed (not taken for empty: a resume would start afresh).
struct CkptEntry {
  std::string path;
  std::int64_t step = 0;
  std::uint64_t bytes = 0;
};
std::vector<CkptEntry> list_checkpoints(const std::string& dir);
/// The committed checkpoints of `dir` as rank 0 of `comm` lists them, on every rank (collective).
/// Ranks that each list a shared folder can see it differently (a run committing in between, a
/// file system's stale cache), and what is then done with each file is collective. Where rank 0
/// cannot list the folder, every rank throws its dt::CheckpointError.
std::vector<CkptEntry> list_checkpoints(Comm& comm, const std::string& dir);
/// The step N of a checkpoint file named step-N.h5 (the name alone, or a path), or -1 for any
/// other name.
std::int64_t checkpoint_step_of_name(const std::string& path);
/// The step-N.h5.partial leftovers of interrupted saves.
std::vector<std::string> list_partials(const std::string& dir);
/// The checkpoints set aside as another line of training (step-N.h5.superseded[.K]), by name.
std::vector<std::string> list_set_aside(const std::string& dir);
/// The file `dir/latest` points to ("" if missing or unreadable; where it holds no file name,
/// such as binary bytes or a path, a description "dir/(latest holds ...)").
std::string read_latest(const std::string& dir);
/// "the pointer DIR/latest names FILE", or for read_latest's description "the pointer
/// DIR/latest holds ...", for messages.
std::string latest_described(const std::string& dir, const std::string& latest);

/// Resolves --ckpt.resume: "none" -> "", a path -> that path, "auto" -> the newest checkpoint of
/// `dir` that loads and verifies (the one `latest` names first), from the list rank 0 reads.
/// Checkpoints that fail are reported through `log` by name and skipped; a model mismatch is not
/// skipped but thrown. A key error ("checkpoint key:", see load_checkpoint) may be one file's
/// damage: older files are tried, and the first key error is thrown if none loads, so that a
/// wrong key never starts the run afresh. A tampered file (dt::SecurityError, see
/// load_checkpoint) stops it at once: no older file is tried. When `dir` holds checkpoints and none
/// loads, throws dt::CheckpointError (nothing is changed); so it does, on every rank, when rank 0
/// cannot list `dir` (not taken for empty). Loads into `tensors` and returns the
/// file used in *used (empty when `dir` holds no checkpoint: starting fresh). `accept`: as for
/// load_checkpoint, for each file tried. Collective.
CkptMeta resume(Comm& comm, const std::string& mode, const std::string& dir,
                const std::vector<CkptTensor>& tensors, std::string* used,
                const std::function<void(const std::string&)>& log,
                const security::Keys* keys = nullptr, const CkptAccept& accept = {});

/// Problems found by verify_file (empty: the file verifies). Without `keys` the digests are
/// checked (an encrypted file's ciphertext too); with `keys` an encrypted file's chunks are also
/// decrypted and authenticated, and a wrong key is one problem starting "checkpoint key: wrong
/// key". A plain file verifies with or without keys.
std::vector<std::string> verify_file(Comm& comm, const std::string& path,
                                     const security::Keys* keys = nullptr);

/// The settings a checkpoint file was written with (its `config` attribute, "name = value"
/// lines), read without loading or verifying anything; "" when the file cannot be read as a dt
/// checkpoint or records none. Not collective (plain HDF5 open): a check before the load, which
/// stays the one that verifies.
std::string checkpoint_config(const std::string& path);

/// Whether `keys` is the key of the encrypted checkpoint `path`, from its key attributes alone (no
/// data is read). Collective. Throws dt::CheckpointError starting "checkpoint key:" for a plain
/// file, a wrong key or damaged key attributes, another CheckpointError for a file that cannot
/// be read as a checkpoint, and dt::SecurityError for root attributes rewritten by someone
/// without the key (tampering).
void check_checkpoint_key(Comm& comm, const std::string& path, const security::Keys& keys);

/// The encryption of a checkpoint file ("aes-256-gcm", or "" when plain). Not collective (plain
/// HDF5 open). Throws dt::CheckpointError naming the file when it cannot be opened.
std::string checkpoint_encryption(const std::string& path);

/// One writer's claim on a checkpoint folder (a training run's rank 0, dt_ckpt import): an
/// exclusive flock on DIR/.dt-lock, a file that also says who holds it. Two runs writing one
/// folder would set aside and delete each other's checkpoints and move `latest` between them.
/// Creates DIR. While another process holds the claim it waits up to `wait_s` seconds (a claim
/// of a node that failed can outlive its processes on a shared file system for a minute or
/// more), telling `note` once, then throws CheckpointError naming DIR and the holder. On a file
/// system without flock it claims nothing and returns with warning() set. Released on
/// destruction, or when the process ends, however it ends (the file stays).
class FolderLock {
 public:
  /// `who`: what claims it ("dt_train", "dt_ckpt import"), written into the file with the host,
  /// process id, Slurm job id and time.
  /// `stop`, asked while it waits, ends the wait when it returns true (a drain signal, say): the
  /// folder is then not claimed, and stopped() says why. A `latest` in `dir` that is not a file
  /// or a link (a folder) is refused (CheckpointError): no commit could replace it.
  FolderLock(const std::string& dir, const std::string& who, double wait_s = 0,
             const std::function<void(const std::string&)>& note = {},
             const std::function<bool()>& stop = {});
  ~FolderLock();
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;
  /// Why the folder could not be locked (the file system refused flock); empty when it is.
  const std::string& warning() const noexcept { return warning_; }
  /// Why `stop` ended the wait ("" when it did not: the folder is claimed, or cannot be locked).
  const std::string& stopped() const noexcept { return stopped_; }

 private:
  int fd_ = -1;
  std::string warning_, stopped_;
};

/// Who holds `dir`'s FolderLock, in the holder's words ("" when nobody does, or where that
/// cannot be told: no lock file, no flock).
std::string folder_holder(const std::string& dir);

/// Background saves: save() copies this rank's part of the tensors into a host snapshot (of a
/// replicated tensor only the chunks it writes; of a range or pieces all of them) and returns; a
/// thread writes the snapshot on its own duplicated communicator. The next save() and wait()
/// block until the previous write finished; a write error is rethrown there.
class AsyncCheckpointer {
 public:
  /// With `keys` (copied) every save is encrypted (ckpt.encrypt). `timeout_s`: how long a save's
  /// collectives may take before the hang watchdog ends the job (watchdog::LimitScope; negative:
  /// the watchdog's timeout, 0: any time).
  AsyncCheckpointer(Comm& comm, std::string dir, int keep, const security::Keys* keys = nullptr,
                    double timeout_s = -1);
  ~AsyncCheckpointer();  ///< waits for the last write (errors are logged to stderr)
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  /// Allocates (and touches) the snapshot for tensors of these sizes now, so that the first
  /// save() only copies.
  void reserve(const std::vector<CkptTensor>& tensors);
  /// Returns the seconds the caller was blocked (waiting for the previous write + snapshot).
  /// `after_write`: save_checkpoint's fault-injection seam, run on the writer thread.
  double save(const std::vector<CkptTensor>& tensors, const CkptMeta& meta,
              std::function<void()> after_write = {});
  /// Waits for the write in flight; returns its stats (path empty if none ran).
  SaveStats wait();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dt
