// dt data layer: token files, the train/validation split, training-window sampling for data
// parallelism, fixed evaluation windows, and byte-token decoding for text samples.
//
// Token files come in three formats:
//   bytes  every byte of any file is one token (vocab 256).
//   llmc   the llm.c format: a header of 256 little-endian int32 (magic 20240520, version 1,
//          token count), then that many little-endian uint16 tokens (GPT-2's, vocab 50257).
//   u16    little-endian uint16 GPT-2 tokens without a header (nanoGPT's prepare.py writes
//          train.bin and val.bin so).
// llmc and u16 files may hold another tokenizer's tokens (up to 65535) where model.vocab is
// given to fit them.
// "auto" picks llmc when the file starts with the magic, bytes otherwise (a headerless file
// cannot be told from bytes: a *.bin file read as bytes gets a note that says so). Every problem
// with a file throws dt::ConfigError naming the path and what is wrong.
//
// Sampling is stateless and counter-based: the training window of global sequence g at step s is
// a pure function of (seed, s, g). There is no position inside the Sampler; the position is the
// trainer's step counter. A run resumed at step s (same file, split, seq_len and seed) draws
// exactly the windows the uninterrupted run would have drawn, and the global batch of a step is
// the same whatever the number of ranks: rank r fills its contiguous share [first, first + count)
// of the global sequence indices.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dt {

/// A contiguous range [begin, end) of token offsets into a TokenFile.
struct TokenRange {
  size_t begin = 0;
  size_t end = 0;
  size_t size() const { return end - begin; }
  bool empty() const { return end == begin; }
};

/// Where tokens are: stored one byte each (a byte file's own bytes) or as uint16 (token files),
/// read as uint16 either way. A pointer's arithmetic and comparisons, without its bounds.
class TokenPtr {
 public:
  TokenPtr() = default;
  TokenPtr(std::nullptr_t) {}                                  // NOLINT: as a null pointer
  TokenPtr(const uint16_t* p) : p_(p), wide_(p != nullptr) {}  // NOLINT: as the pointer
  TokenPtr(const uint8_t* p) : p_(p) {}                        // NOLINT: as the pointer

  uint16_t operator[](size_t i) const {
    return wide_ ? static_cast<const uint16_t*>(p_)[i] : static_cast<const uint8_t*>(p_)[i];
  }
  uint16_t operator*() const { return (*this)[0]; }
  TokenPtr operator+(size_t i) const {
    TokenPtr q = *this;
    q.p_ = static_cast<const char*>(p_) + i * (wide_ ? 2 : 1);
    return q;
  }
  bool operator==(const TokenPtr& o) const {
    return p_ == o.p_ && (p_ == nullptr || wide_ == o.wide_);
  }
  bool operator!=(const TokenPtr& o) const { return !(*this == o); }
  /// Stored as uint16 (true) or one byte a token (false).
  bool wide() const { return wide_; }
  /// The storage: uint16_t or uint8_t as wide() says.
  const void* raw() const { return p_; }

 private:
  const void* p_ = nullptr;
  bool wide_ = false;
};

/// Read-only tokens: the pages of a token or byte file mapped into memory (so that the processes
/// of a node that read one file share one copy, in the page cache: a byte file costs a byte a
/// token once a node), or a vector of their own (tokens made in memory). Copies share storage.
class TokenStore {
 public:
  TokenStore() = default;
  explicit TokenStore(std::vector<uint16_t> tokens);
  /// `count` tokens at `first` (uint16 or bytes), kept valid by `owner` (a mapping, say).
  TokenStore(std::shared_ptr<const void> owner, TokenPtr first, size_t count, bool mapped);
  TokenStore(const TokenStore&) = default;
  TokenStore& operator=(const TokenStore&) = default;
  /// A moved-from store is empty (as a moved-from vector is), never a view of storage it let go.
  TokenStore(TokenStore&& o) noexcept { *this = std::move(o); }
  TokenStore& operator=(TokenStore&& o) noexcept {
    owner_ = std::move(o.owner_);
    p_ = std::exchange(o.p_, TokenPtr());
    n_ = std::exchange(o.n_, 0);
    mapped_ = std::exchange(o.mapped_, false);
    return *this;
  }

  TokenPtr data() const { return p_; }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  uint16_t operator[](size_t i) const { return p_[i]; }
  /// The tokens as uint16 values (a copy).
  std::vector<uint16_t> to_vector() const;
  /// The tokens are a file's pages (shared with other processes mapping that file).
  bool mapped() const { return mapped_; }

 private:
  std::shared_ptr<const void> owner_;
  TokenPtr p_;
  size_t n_ = 0;
  bool mapped_ = false;
};

/// The tokens of one file. An llm.c file is mapped, not read: it must not change while a run
/// uses it (as with any memory-mapped data set, a file cut short then ends the process).
struct TokenFile {
  std::string path;
  std::string format;  ///< the format actually read: "bytes", "llmc" or "u16"
  std::string note;    ///< a warning about how the file was read ("" when none)
  TokenStore tokens;   ///< never empty after load_tokens
  /// The vocabulary the format stands for: 256 for bytes, GPT-2's 50257 for llmc and u16 (the
  /// default of model.vocab); tokens of another tokenizer may go up to 65535 (max_token_plus_one).
  int vocab = 0;
  int max_token_plus_one = 0;  ///< largest token present + 1

  size_t size() const { return tokens.size(); }
  TokenRange all() const { return {0, tokens.size()}; }
  /// Pointer to the first token of `r`; throws dt::InvalidArgument when r is not inside the file.
  TokenPtr data(const TokenRange& r) const;
};

/// The llm.c token file magic number (header[0]) and the one version read (header[1]).
constexpr int32_t kLlmcMagic = 20240520;
constexpr int32_t kLlmcVersion = 1;
constexpr int kLlmcHeaderInts = 256;
constexpr int kGpt2Vocab = 50257;

/// A digest for telling two copies of a data set apart (ranks on different nodes reading
/// node-local files): FNV-1a over the format, the token count and 64 blocks of 1024 tokens spread
/// evenly over the tokens, the first and the last included (a file of up to 64 Ki tokens whole).
/// Cheap on any size; copies that differ only between the blocks are not told apart.
std::uint64_t token_digest(const TokenFile& f);
/// What a data set is, for messages and checkpoints: "FORMAT, N tokens, digest HEX" (the digest
/// of token_digest, 16 hex digits).
std::string data_identity(const std::string& format, std::uint64_t tokens, std::uint64_t digest);
std::string data_identity(const TokenFile& f);

/// Reads a token file. format: "auto", "bytes", "llmc" or "u16". The file is mapped (an llm.c or
/// u16 file on little-endian machines; a byte file anywhere) and checked in place.
/// Throws dt::ConfigError naming the path on: an unknown format, a missing / unreadable /
/// non-regular file, an empty file, an llmc magic mismatch, an unsupported version, a header token
/// count that disagrees with the file size, a truncated file, a u16 file of an odd size.
TokenFile load_tokens(const std::string& path, const std::string& format = "auto");

/// The train part (first) and the validation part (last) of a token file.
struct Split {
  TokenRange train;
  TokenRange val;
};

/// Splits off the last round(size * val_fraction) tokens (at least 1 when val_fraction > 0) as
/// validation; the rest, from offset 0, is training. val_fraction must be in [0, 1) or
/// dt::ConfigError. A part too small for a window is reported by the Sampler / eval_windows.
Split split(const TokenFile& file, double val_fraction);

/// Deterministic, seeded training-window sampler over n tokens. A window is seq_len + 1 tokens
/// starting uniformly in [0, n - seq_len - 1]. Immutable and thread-safe; holds a pointer to the
/// tokens, which must outlive it.
class Sampler {
 public:
  /// Throws dt::ConfigError when seq_len < 1 or n < seq_len + 1 (naming both numbers and `what`,
  /// e.g. "training split"); dt::InvalidArgument when tokens is null. `vocab`: every token a
  /// window hands out is checked to be below it (a mapped token file changed under the run; the
  /// error names `what` and the window's start).
  Sampler(TokenPtr tokens, size_t n, int seq_len, uint64_t seed,
          const std::string& what = "token range", int vocab = 65536);

  /// Start offset of the window of global sequence `seq` (>= 0) at `step`: a pure function of
  /// (seed, step, seq), uniform in [0, n - seq_len - 1].
  size_t window_start(uint64_t step, int64_t seq) const;

  /// Fills count x seq_len inputs and targets (row-major, one row per sequence) for global
  /// sequences first_seq .. first_seq + count - 1 of `step`; targets[i][t] = inputs[i][t + 1]
  /// of the same window, i.e. the token after inputs[i][t]. Throws dt::InvalidArgument on
  /// first_seq < 0, count < 0, or null buffers with count > 0; dt::ConfigError on a token not
  /// below `vocab`.
  void fill(uint64_t step, int64_t first_seq, int64_t count, int32_t* inputs,
            int32_t* targets) const;

  int seq_len() const { return seq_len_; }
  size_t size() const { return n_; }
  uint64_t seed() const { return seed_; }
  /// Number of distinct window starts: n - seq_len.
  size_t num_starts() const { return n_ - static_cast<size_t>(seq_len_); }

 private:
  TokenPtr tokens_;
  size_t n_;
  int seq_len_;
  uint64_t seed_;
  int vocab_;
  std::string what_;
};

/// Start offsets of `count` fixed evaluation windows (seq_len + 1 tokens each) over n tokens,
/// evenly spaced from 0 to n - seq_len - 1 (first and last included when count > 1). The windows
/// do not overlap whenever count * (seq_len + 1) <= n; otherwise they overlap evenly. Starts are
/// strictly increasing. Split them across ranks by index (rank r takes a contiguous share).
/// Throws dt::ConfigError when seq_len < 1, count < 1, n < seq_len + 1, or count > n - seq_len
/// (more windows than distinct starts), naming the numbers and `what`.
std::vector<size_t> eval_windows(size_t n, int seq_len, int64_t count,
                                 const std::string& what = "validation split");

/// Fills count x seq_len inputs / targets from the windows at starts[0 .. count) over tokens[0,
/// n). Throws dt::InvalidArgument when a window does not fit in n tokens or a buffer is null,
/// dt::ConfigError on a token not below `vocab` (naming `what` and the window's start).
void fill_windows(TokenPtr tokens, size_t n, int seq_len, const size_t* starts, int64_t count,
                  int32_t* inputs, int32_t* targets, int vocab = 65536,
                  const std::string& what = "validation split");

/// Byte tokens as printable text: printable ASCII and '\n' as is, '\\' as "\\\\", '\t' '\r' as
/// "\\t" "\\r", other bytes as "\\xHH", tokens outside [0, 255] as "\\{N}".
std::string decode_bytes(const int32_t* tokens, size_t n);

}  // namespace dt
