#include "dt/data.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dt/error.hpp"

namespace dt {

namespace {

constexpr size_t kHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);

// Closes the descriptor on every path out of load_tokens.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

int32_t le32(const unsigned char* p) {
  const uint32_t v = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                     (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
  int32_t out;
  std::memcpy(&out, &v, sizeof out);
  return out;
}

// Reads up to len bytes at offset into dst; returns the number read (< len only at end of file).
size_t read_at(int fd, void* dst, size_t len, size_t offset, const std::string& path) {
  auto* out = static_cast<unsigned char*>(dst);
  size_t done = 0;
  while (done < len) {
    // One large read; the loop only continues where the kernel caps a single read (~2 GiB).
    const size_t chunk = std::min<size_t>(len - done, size_t{1} << 30);
    const ssize_t got = ::pread(fd, out + done, chunk, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      DT_THROW(ConfigError, "cannot read token file '", path, "': ", std::strerror(errno));
    }
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  return done;
}

void read_exact(int fd, void* dst, size_t len, size_t offset, const std::string& path) {
  const size_t got = read_at(fd, dst, len, offset, path);
  DT_CHECK(ConfigError, got == len, "token file '", path, "' is truncated: expected ", len,
           " bytes at offset ", offset, ", read ", got, " (did the file change while reading?)");
}

// The file's `size` bytes mapped: a read-only mapping that ends with the last TokenStore.
std::shared_ptr<const void> map_file(int fd, size_t size, const std::string& path) {
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED)
    DT_THROW(ConfigError, "cannot map token file '", path, "': ", std::strerror(errno));
  return std::shared_ptr<const void>(
      map, [size](const void* m) { ::munmap(const_cast<void*>(m), size); });
}

void load_bytes(int fd, size_t size, TokenFile& f) {
  // Mapped, each byte a token: the ranks of a node share the file's pages, one byte a token.
  std::shared_ptr<const void> map = map_file(fd, size, f.path);
  const auto* bytes = static_cast<const uint8_t*>(map.get());
  uint8_t max_tok = 0;
  for (size_t i = 0; i < size; ++i) max_tok = std::max(max_tok, bytes[i]);
  f.tokens = TokenStore(std::move(map), bytes, size, true);
  f.format = "bytes";
  f.vocab = 256;
  f.max_token_plus_one = static_cast<int>(max_tok) + 1;
}

// The `count` little-endian uint16 tokens at byte `offset` of the file (of `size` bytes) into f:
// mapped (read and swapped on a big-endian host), its largest token noted (model.vocab must hold
// it: GPT-2's 50257 by default, more for another tokenizer's tokens).
void map_tokens(int fd, size_t size, size_t offset, size_t count, TokenFile& f) {
  const std::string& path = f.path;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  std::vector<uint16_t> own(count);
  read_exact(fd, own.data(), count * sizeof(uint16_t), offset, path);
  for (auto& t : own) t = static_cast<uint16_t>((t >> 8) | (t << 8));
  f.tokens = TokenStore(std::move(own));
#else
  // Mapped, not read: the ranks of a node that train on one file share its pages (a file of 10^9
  // tokens is 2 GB once per node, not once per rank), and none copies it at start.
  std::shared_ptr<const void> map = map_file(fd, size, path);
  const auto* first =
      reinterpret_cast<const uint16_t*>(static_cast<const char*>(map.get()) + offset);
  f.tokens = TokenStore(std::move(map), first, count, true);
#endif
  // Over the uint16 storage itself (a whole file's tokens, each read once at start).
  const auto* stored = static_cast<const uint16_t*>(f.tokens.data().raw());
  uint16_t max_tok = 0;
  for (size_t i = 0; i < f.tokens.size(); ++i) max_tok = std::max(max_tok, stored[i]);
  f.vocab = kGpt2Vocab;
  f.max_token_plus_one = static_cast<int>(max_tok) + 1;
}

// The magic of llm.c's LLaMA 3 token files (uint32 tokens), which dt does not read.
constexpr int32_t kLlmcLlama3Magic = 20240801;
std::string llama3_refusal(const std::string& path) {
  return "token file '" + path + "' is an llm.c token file of LLaMA 3 (magic " +
         std::to_string(kLlmcLlama3Magic) +
         ", uint32 tokens), which dt does not read: it reads GPT-2's llm.c files (magic " +
         std::to_string(kLlmcMagic) + ", uint16 tokens), nanoGPT's uint16 files and bytes";
}

void load_llmc(int fd, size_t size, TokenFile& f) {
  const std::string& path = f.path;
  unsigned char header[kHeaderBytes];
  const size_t head = std::min(size, kHeaderBytes);
  read_exact(fd, header, head, 0, path);
  DT_CHECK(ConfigError, head >= 4, "token file '", path, "' is truncated: ", size,
           " bytes, an llm.c header is ", kHeaderBytes, " bytes");
  const int32_t magic = le32(header);
  DT_CHECK(ConfigError, magic != kLlmcLlama3Magic, llama3_refusal(path));
  DT_CHECK(ConfigError, magic == kLlmcMagic, "token file '", path,
           "' is not an llm.c token file: magic ", magic, ", expected ", kLlmcMagic);
  DT_CHECK(ConfigError, size >= kHeaderBytes, "token file '", path, "' is truncated: ", size,
           " bytes, an llm.c header is ", kHeaderBytes, " bytes");
  const int32_t version = le32(header + 4);
  DT_CHECK(ConfigError, version == kLlmcVersion, "token file '", path,
           "' has unsupported llm.c version ", version, " (supported: ", kLlmcVersion, ")");
  const int32_t count = le32(header + 8);
  const size_t body = size - kHeaderBytes;
  DT_CHECK(ConfigError, count >= 0, "token file '", path, "' header has a negative token count ",
           count);
  DT_CHECK(ConfigError, count > 0 || body > 0, "token file '", path, "' contains no tokens");
  const size_t want = static_cast<size_t>(count) * sizeof(uint16_t);
  DT_CHECK(ConfigError, body >= want, "token file '", path, "' is truncated: header says ", count,
           " tokens (", want, " bytes) but only ", body, " bytes follow the header");
  DT_CHECK(ConfigError, body == want, "token file '", path, "': header says ", count,
           " tokens but the file holds ", body, " bytes of tokens (",
           static_cast<double>(body) / 2.0, " tokens)");

  map_tokens(fd, size, kHeaderBytes, static_cast<size_t>(count), f);
  f.format = "llmc";
}

// nanoGPT's prepare.py output (train.bin, val.bin): little-endian uint16 GPT-2 tokens, no header.
void load_u16(int fd, size_t size, TokenFile& f) {
  DT_CHECK(ConfigError, size % 2 == 0, "token file '", f.path, "' holds ", size,
           " bytes, not a whole number of uint16 tokens (--data.format=u16)");
  if (size >= 4) {
    unsigned char magic[4];
    read_exact(fd, magic, 4, 0, f.path);
    DT_CHECK(ConfigError, le32(magic) != kLlmcMagic, "token file '", f.path,
             "' is an llm.c token file (it starts with the llm.c magic), not headerless uint16 "
             "tokens: give --data.format=llmc or auto");
    DT_CHECK(ConfigError, le32(magic) != kLlmcLlama3Magic, llama3_refusal(f.path));
  }
  map_tokens(fd, size, 0, size / 2, f);
  f.format = "u16";
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

void check_window_buffers(int64_t count, const int32_t* inputs, const int32_t* targets) {
  DT_CHECK_GE(InvalidArgument, count, 0, "window count must not be negative");
  DT_CHECK(InvalidArgument, count == 0 || (inputs != nullptr && targets != nullptr),
           "inputs and targets must not be null");
}

// Copies a window of seq_len + 1 tokens; every token must be below `vocab`. The file was checked
// when it was loaded, but a mapped file that changes under the run would otherwise hand the
// model's embedding an index outside it. `what` and `at` (the window's first token in it) name
// the window in an error.
template <typename T>
void copy_window(const T* w, int seq_len, int32_t* in, int32_t* tg, int vocab,
                 const std::string& what, size_t at) {
  unsigned top = 0;
  for (int t = 0; t < seq_len; ++t) {
    in[t] = w[t];
    tg[t] = w[t + 1];
    top = std::max<unsigned>(top, w[t + 1]);
  }
  top = std::max<unsigned>(top, w[0]);
  DT_CHECK(ConfigError, top < static_cast<unsigned>(vocab), what, ": the window at token ", at,
           " holds token ", top, ", outside the vocabulary of ", vocab,
           " (did the token file change while this run used it?)");
}

void copy_window(TokenPtr tokens, size_t at, int seq_len, int32_t* in, int32_t* tg, int vocab,
                 const std::string& what) {
  const TokenPtr w = tokens + at;
  if (w.wide())
    copy_window(static_cast<const uint16_t*>(w.raw()), seq_len, in, tg, vocab, what, at);
  else
    copy_window(static_cast<const uint8_t*>(w.raw()), seq_len, in, tg, vocab, what, at);
}

}  // namespace

TokenStore::TokenStore(std::vector<uint16_t> tokens) {
  auto v = std::make_shared<const std::vector<uint16_t>>(std::move(tokens));
  p_ = v->data();
  n_ = v->size();
  owner_ = std::move(v);
}

TokenStore::TokenStore(std::shared_ptr<const void> owner, TokenPtr first, size_t count, bool mapped)
    : owner_(std::move(owner)), p_(first), n_(count), mapped_(mapped) {}

std::vector<uint16_t> TokenStore::to_vector() const {
  std::vector<uint16_t> v(n_);
  for (size_t i = 0; i < n_; ++i) v[i] = p_[i];
  return v;
}

TokenPtr TokenFile::data(const TokenRange& r) const {
  DT_CHECK(InvalidArgument, r.begin <= r.end && r.end <= tokens.size(), "token range [", r.begin,
           ", ", r.end, ") is not inside '", path, "' of ", tokens.size(), " tokens");
  return tokens.data() + r.begin;
}

TokenFile load_tokens(const std::string& path, const std::string& format) {
  DT_CHECK(ConfigError,
           format == "auto" || format == "bytes" || format == "llmc" || format == "u16",
           "unknown token file format '", format, "' for '", path,
           "' (expected auto, bytes, llmc or u16)");
  Fd fd;
  // O_NONBLOCK: a FIFO without a writer opens at once (and is refused below) instead of blocking
  // the rank in open(); regular files ignore it.
  fd.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd.fd < 0)
    DT_THROW(ConfigError, "cannot open token file '", path, "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0)
    DT_THROW(ConfigError, "cannot stat token file '", path, "': ", std::strerror(errno));
  DT_CHECK(ConfigError, S_ISREG(st.st_mode), "token file '", path, "' is not a regular file");
  const size_t size = static_cast<size_t>(st.st_size);
  DT_CHECK(ConfigError, size > 0, "token file '", path, "' is empty");

  TokenFile f;
  f.path = path;
  bool llmc = format == "llmc";
  if (format == "auto" && size >= 4) {
    unsigned char magic[4];
    read_exact(fd.fd, magic, 4, 0, path);
    llmc = le32(magic) == kLlmcMagic;
    DT_CHECK(ConfigError, le32(magic) != kLlmcLlama3Magic, llama3_refusal(path));
    // The rest of an llm.c header (its version, and a token count that is the file's size) under
    // another magic: a damaged llm.c file, not text to be read as bytes.
    if (!llmc && size > kHeaderBytes) {
      unsigned char rest[8];
      read_exact(fd.fd, rest, 8, 4, path);
      const int32_t count = le32(rest + 4);
      DT_CHECK(ConfigError,
               !(le32(rest) == kLlmcVersion && count > 0 &&
                 static_cast<size_t>(count) * 2 + kHeaderBytes == size),
               "token file '", path, "' has an llm.c header (version ", kLlmcVersion, ", ", count,
               " tokens, as its size says) under the magic ", le32(magic), " instead of ",
               kLlmcMagic, ": a damaged llm.c file? Give --data.format=bytes to read it as bytes");
    }
  }
  if (format == "u16") {
    load_u16(fd.fd, size, f);
  } else if (llmc) {
    load_llmc(fd.fd, size, f);
  } else {
    load_bytes(fd.fd, size, f);
    const bool bin = path.size() > 4 && path.compare(path.size() - 4, 4, ".bin") == 0;
    if (format == "auto" && bin)
      f.note = "'" + path +
               "' has no llm.c header and is read as bytes (vocab 256); if it holds nanoGPT's "
               "uint16 tokens without a header (prepare.py's train.bin), give --data.format=u16";
  }
  return f;
}

std::uint64_t token_digest(const TokenFile& f) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  auto mix = [&h](const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ULL;
  };
  mix(f.format.data(), f.format.size());
  const std::uint64_t n = f.size();
  mix(&n, sizeof n);
  // Over the tokens as uint16 in the machine's order, however they are stored (a digest written
  // into checkpoints: the same tokens give the same digest whatever their storage).
  auto mix_tokens = [&mix, &f](std::size_t at, std::size_t count) {
    uint16_t block[1024];
    for (std::size_t done = 0; done < count;) {
      const std::size_t k = std::min<std::size_t>(count - done, 1024);
      for (std::size_t i = 0; i < k; ++i) block[i] = f.tokens[at + done + i];
      mix(block, k * sizeof(uint16_t));
      done += k;
    }
  };
  constexpr std::size_t kBlocks = 64, kBlock = 1024;
  if (n <= kBlocks * kBlock) {
    mix_tokens(0, n);
    return h;
  }
  for (std::size_t k = 0; k < kBlocks; ++k)
    mix_tokens(static_cast<std::size_t>((n - kBlock) * k / (kBlocks - 1)), kBlock);
  return h;
}

std::string data_identity(const std::string& format, std::uint64_t tokens, std::uint64_t digest) {
  char d[24];
  std::snprintf(d, sizeof d, "%016llx", static_cast<unsigned long long>(digest));
  return format + ", " + std::to_string(tokens) + " tokens, digest " + d;
}

std::string data_identity(const TokenFile& f) {
  return data_identity(f.format, f.size(), token_digest(f));
}

Split split(const TokenFile& file, double val_fraction) {
  DT_CHECK(ConfigError, std::isfinite(val_fraction) && val_fraction >= 0 && val_fraction < 1,
           "validation fraction must be in [0, 1), got ", val_fraction, " (for '", file.path, "')");
  const size_t n = file.size();
  size_t val = static_cast<size_t>(std::llround(static_cast<double>(n) * val_fraction));
  if (val_fraction > 0) val = std::max<size_t>(val, 1);
  val = std::min(val, n);
  Split s;
  s.train = {0, n - val};
  s.val = {n - val, n};
  return s;
}

Sampler::Sampler(TokenPtr tokens, size_t n, int seq_len, uint64_t seed, const std::string& what,
                 int vocab)
    : tokens_(tokens), n_(n), seq_len_(seq_len), seed_(seed), vocab_(vocab), what_(what) {
  DT_CHECK(ConfigError, seq_len >= 1, "sequence length must be >= 1, got ", seq_len);
  DT_CHECK(ConfigError, n >= static_cast<size_t>(seq_len) + 1, what, " has ", n,
           " tokens, too few for one window of seq_len + 1 = ", static_cast<size_t>(seq_len) + 1,
           " tokens");
  DT_CHECK(InvalidArgument, tokens != TokenPtr(), "Sampler: tokens must not be null");
}

size_t Sampler::window_start(uint64_t step, int64_t seq) const {
  DT_CHECK_GE(InvalidArgument, seq, 0, "global sequence index must not be negative");
  const uint64_t m = num_starts();  // >= 1
  uint64_t x = splitmix64(splitmix64(splitmix64(seed_) ^ step) ^ static_cast<uint64_t>(seq));
  // Lemire's multiply-shift with rejection: exactly uniform in [0, m).
  unsigned __int128 p = static_cast<unsigned __int128>(x) * m;
  uint64_t low = static_cast<uint64_t>(p);
  if (low < m) {
    const uint64_t threshold = (0 - m) % m;
    while (low < threshold) {
      x = splitmix64(x);
      p = static_cast<unsigned __int128>(x) * m;
      low = static_cast<uint64_t>(p);
    }
  }
  return static_cast<size_t>(p >> 64);
}

void Sampler::fill(uint64_t step, int64_t first_seq, int64_t count, int32_t* inputs,
                   int32_t* targets) const {
  DT_CHECK_GE(InvalidArgument, first_seq, 0, "first global sequence must not be negative");
  check_window_buffers(count, inputs, targets);
  const size_t T = static_cast<size_t>(seq_len_);
  for (int64_t i = 0; i < count; ++i) {
    const size_t start = window_start(step, first_seq + i);
    copy_window(tokens_, start, seq_len_, inputs + static_cast<size_t>(i) * T,
                targets + static_cast<size_t>(i) * T, vocab_, what_);
  }
}

std::vector<size_t> eval_windows(size_t n, int seq_len, int64_t count, const std::string& what) {
  DT_CHECK(ConfigError, seq_len >= 1, "sequence length must be >= 1, got ", seq_len);
  DT_CHECK(ConfigError, count >= 1, "number of evaluation windows must be >= 1, got ", count);
  const size_t w = static_cast<size_t>(seq_len) + 1;
  DT_CHECK(ConfigError, n >= w, what, " has ", n,
           " tokens, too few for one window of seq_len + 1 = ", w, " tokens");
  const size_t last = n - w;  // largest start
  DT_CHECK(ConfigError, static_cast<uint64_t>(count) <= last + 1, what, " has ", n,
           " tokens, only ", last + 1, " distinct windows of ", w, " tokens, fewer than the ",
           count, " evaluation windows asked for");
  std::vector<size_t> starts(static_cast<size_t>(count));
  if (count == 1) {
    starts[0] = 0;
    return starts;
  }
  const unsigned __int128 span = last;
  const unsigned __int128 gaps = static_cast<uint64_t>(count - 1);
  for (size_t i = 0; i < starts.size(); ++i) starts[i] = static_cast<size_t>(span * i / gaps);
  return starts;
}

void fill_windows(TokenPtr tokens, size_t n, int seq_len, const size_t* starts, int64_t count,
                  int32_t* inputs, int32_t* targets, int vocab, const std::string& what) {
  DT_CHECK_GE(InvalidArgument, seq_len, 1, "sequence length must be >= 1");
  check_window_buffers(count, inputs, targets);
  DT_CHECK(InvalidArgument, count == 0 || (tokens != TokenPtr() && starts != nullptr),
           "tokens and starts must not be null");
  const size_t T = static_cast<size_t>(seq_len);
  for (int64_t i = 0; i < count; ++i) {
    const size_t s = starts[i];
    DT_CHECK(InvalidArgument, s < n && n - s >= T + 1, "window ", i, " at ", s, " of ", T + 1,
             " tokens does not fit in ", n, " tokens");
    copy_window(tokens, s, seq_len, inputs + static_cast<size_t>(i) * T,
                targets + static_cast<size_t>(i) * T, vocab, what);
  }
}

std::string decode_bytes(const int32_t* tokens, size_t n) {
  std::string out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const int32_t t = tokens[i];
    if (t < 0 || t > 255) {
      out += "\\{" + std::to_string(t) + "}";
    } else if (t == '\\') {
      out += "\\\\";
    } else if (t == '\n' || (t >= 0x20 && t < 0x7F)) {
      out += static_cast<char>(t);
    } else if (t == '\t') {
      out += "\\t";
    } else if (t == '\r') {
      out += "\\r";
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", static_cast<unsigned>(t));
      out += buf;
    }
  }
  return out;
}

}  // namespace dt
