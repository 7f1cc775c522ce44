// dt data layer: token files (bytes, llm.c, auto), their errors, the train/validation split,
// the counter-based training sampler, fixed evaluation windows and byte decoding.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <set>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include "dt/data.hpp"
#include "dt/error.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;

namespace {

using TempDir = dt::test::TempDir;

void put_le32(std::string& s, size_t at, int32_t v) {
  const auto u = static_cast<uint32_t>(v);
  for (int b = 0; b < 4; ++b)
    s[at + static_cast<size_t>(b)] = static_cast<char>((u >> (8 * b)) & 0xFF);
}

// An llm.c token file image: header (magic, version, count) then the tokens as LE uint16.
std::string llmc_image(const std::vector<uint16_t>& toks, int32_t count = -1,
                       int32_t version = dt::kLlmcVersion, int32_t magic = dt::kLlmcMagic) {
  std::string s(1024, '\0');
  put_le32(s, 0, magic);
  put_le32(s, 4, version);
  put_le32(s, 8, count < 0 ? static_cast<int32_t>(toks.size()) : count);
  for (uint16_t t : toks) {
    s += static_cast<char>(t & 0xFF);
    s += static_cast<char>(t >> 8);
  }
  return s;
}

// The message of the ConfigError that f throws; "" when it throws nothing.
std::string config_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const dt::ConfigError& e) {
    return e.message();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Checks that loading `path` as `format` throws a ConfigError naming the path and every part.
void check_load_error(const std::string& path, const std::string& format,
                      std::initializer_list<std::string> parts) {
  const std::string msg = config_error([&] { dt::load_tokens(path, format); });
  INFO("message: " << msg);
  CHECK(contains(msg, "'" + path + "'"));
  for (const auto& p : parts) CHECK(contains(msg, p));
}

dt::TokenFile synthetic(size_t n) {
  dt::TokenFile f;
  f.path = "synthetic";
  f.format = "llmc";
  f.vocab = dt::kGpt2Vocab;
  std::vector<uint16_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint16_t>(i % 50000);
  f.tokens = dt::TokenStore(std::move(t));
  f.max_token_plus_one = 50000;
  return f;
}

// Token i == i, so a window's content reveals its start.
std::vector<uint16_t> iota_tokens(size_t n) {
  std::vector<uint16_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint16_t>(i);
  return t;
}

struct Batch {
  std::vector<int32_t> in, tg;
  Batch(int64_t count, int T) : in(static_cast<size_t>(count * T)), tg(in.size()) {}
};

Batch fill(const dt::Sampler& s, uint64_t step, int64_t first, int64_t count) {
  Batch b(count, s.seq_len());
  s.fill(step, first, count, b.in.data(), b.tg.data());
  return b;
}

}  // namespace

TEST_CASE("data: bytes format makes every byte a token") {
  TempDir dir;
  const std::string text = std::string("hi\n") + '\0' + "\xff\x80z";
  const std::string path = dir.write("text.txt", text);
  const dt::TokenFile f = dt::load_tokens(path, "bytes");
  CHECK(f.format == "bytes");
  CHECK(f.path == path);
  CHECK(f.vocab == 256);
  CHECK(f.max_token_plus_one == 256);
  REQUIRE(f.size() == text.size());
  for (size_t i = 0; i < text.size(); ++i)
    CHECK(f.tokens[i] == static_cast<unsigned char>(text[i]));

  const dt::TokenFile g = dt::load_tokens(dir.write("abc", "abca"), "bytes");
  CHECK(g.max_token_plus_one == 'c' + 1);
}

TEST_CASE("data: a byte file is mapped, one byte a token, with the digest of its tokens") {
  TempDir dir;
  std::string big(300000, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 7919 + i / 3) & 0xFF);
  const dt::TokenFile f = dt::load_tokens(dir.write("big.txt", big), "bytes");
  // The file's pages (shared by a node's ranks), not a copy widened to two bytes a token.
  CHECK(f.tokens.mapped());
  CHECK_FALSE(f.tokens.data().wide());
  REQUIRE(f.tokens.data().raw() != nullptr);
  CHECK(std::memcmp(f.tokens.data().raw(), big.data(), big.size()) == 0);
  // The digest checkpoints hold is that of the tokens as uint16, as when byte files were
  // widened: the same tokens held as uint16 in memory give it.
  std::vector<uint16_t> wide(big.size());
  for (size_t i = 0; i < big.size(); ++i) wide[i] = static_cast<unsigned char>(big[i]);
  dt::TokenFile g;
  g.format = "bytes";
  g.tokens = dt::TokenStore(wide);
  CHECK(g.tokens.data().wide());
  CHECK(dt::token_digest(f) == dt::token_digest(g));
  // And that digest is the one checkpoints have held all along (FNV-1a over the format, the
  // count as 8 bytes and each token as 2, both little-endian on this machine), worked out here
  // independently for a small file, which is digested whole.
  const std::string text = "hi\n\xff";
  std::uint64_t want = 0xcbf29ce484222325ULL;
  auto fnv = [&want](unsigned char b) { want = (want ^ b) * 0x100000001b3ULL; };
  for (char c : std::string("bytes")) fnv(static_cast<unsigned char>(c));
  for (int i = 0; i < 8; ++i) fnv(i == 0 ? static_cast<unsigned char>(text.size()) : 0);
  for (char c : text) {
    fnv(static_cast<unsigned char>(c));
    fnv(0);
  }
  CHECK(dt::token_digest(dt::load_tokens(dir.write("small.txt", text), "bytes")) == want);
  // Windows read from bytes equal those read from the uint16 copy.
  const size_t starts[3] = {0, 12345, big.size() - 17};
  std::vector<int32_t> in_b(3 * 16), tg_b(3 * 16), in_w(3 * 16), tg_w(3 * 16);
  dt::fill_windows(f.data(f.all()), f.size(), 16, starts, 3, in_b.data(), tg_b.data(), 256);
  dt::fill_windows(g.data(g.all()), g.size(), 16, starts, 3, in_w.data(), tg_w.data(), 256);
  CHECK(in_b == in_w);
  CHECK(tg_b == tg_w);
  CHECK(in_b[16] == static_cast<unsigned char>(big[12345]));
  CHECK(tg_b[16 + 15] == static_cast<unsigned char>(big[12345 + 16]));
}

TEST_CASE("data: bytes format reads a large file correctly") {
  TempDir dir;
  std::string big((size_t{1} << 20) + 7, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 131 + i / 256) & 0xFF);
  const dt::TokenFile f = dt::load_tokens(dir.write("big.bin", big), "auto");
  CHECK(f.format == "bytes");
  REQUIRE(f.size() == big.size());
  size_t bad = 0;
  for (size_t i = 0; i < big.size(); ++i) bad += f.tokens[i] != static_cast<unsigned char>(big[i]);
  CHECK(bad == 0);
}

TEST_CASE("data: llmc format reads the header and little-endian uint16 tokens") {
  TempDir dir;
  const std::vector<uint16_t> toks = {0, 1, 255, 256, 0x1234, 50256, 7};
  const std::string path = dir.write("gpt2.bin", llmc_image(toks));
  for (const char* format : {"llmc", "auto"}) {
    CAPTURE(format);
    const dt::TokenFile f = dt::load_tokens(path, format);
    CHECK(f.format == "llmc");
    CHECK(f.vocab == 50257);
    CHECK(f.max_token_plus_one == 50257);
    CHECK(f.tokens.to_vector() == toks);
#if !(defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__)
    CHECK(f.tokens.mapped());  // the file's pages, not a copy (big-endian machines swap a copy)
#endif
  }
  const dt::TokenFile small = dt::load_tokens(dir.write("small.bin", llmc_image({3, 300, 5})));
  CHECK(small.vocab == 50257);
  CHECK(small.max_token_plus_one == 301);
}

TEST_CASE(
    "data: u16 format reads nanoGPT's headerless uint16 tokens; auto notes a *.bin read as bytes") {
  TempDir dir;
  const std::vector<uint16_t> toks = {0, 1, 255, 256, 0x1234, 50256, 7};
  std::string raw;
  for (uint16_t t : toks) {
    raw.push_back(static_cast<char>(t & 0xFF));
    raw.push_back(static_cast<char>(t >> 8));
  }
  const std::string path = dir.write("train.bin", raw);
  const dt::TokenFile f = dt::load_tokens(path, "u16");
  CHECK(f.format == "u16");
  CHECK(f.vocab == 50257);
  CHECK(f.max_token_plus_one == 50257);
  CHECK(f.note.empty());
  CHECK(f.tokens.to_vector() == toks);
#if !(defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__)
  CHECK(f.tokens.mapped());
#endif
  // Under auto the same file is bytes (no llm.c magic), with a note naming the u16 format.
  const dt::TokenFile b = dt::load_tokens(path, "auto");
  CHECK(b.format == "bytes");
  CHECK(b.size() == raw.size());
  CHECK(b.note.find("--data.format=u16") != std::string::npos);
  CHECK(b.note.find(path) != std::string::npos);
  CHECK(dt::load_tokens(dir.write("text.txt", raw), "auto").note.empty());  // not *.bin
  CHECK(dt::load_tokens(path, "bytes").note.empty());                       // bytes on purpose
  check_load_error(dir.write("odd.bin", raw + "x"), "u16", {"odd.bin", "15 bytes", "uint16"});
  check_load_error(dir.write("llmc.bin", llmc_image(toks)), "u16",
                   {"llmc.bin", "is an llm.c token file", "--data.format=llmc"});
  std::string big = raw;
  big[0] = static_cast<char>(0x51);  // 0xC351 = 50001 < 50257: fine; then 0xFFFF: not
  big[1] = static_cast<char>(0xC3);
  CHECK(dt::load_tokens(dir.write("ok.bin", big), "u16").tokens[0] == 50001);
  big[1] = static_cast<char>(0xFF);  // 65535: another tokenizer's, for model.vocab to admit
  big[0] = static_cast<char>(0xFF);
  const dt::TokenFile over = dt::load_tokens(dir.write("over.bin", big), "u16");
  CHECK(over.vocab == 50257);
  CHECK(over.max_token_plus_one == 65536);
}

// This process's private (anonymous) resident memory, in KiB.
long rss_anon_kib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("RssAnon:", 0) == 0) return std::stol(line.substr(8));
  return -1;
}

#if !(defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__)
TEST_CASE("data: an llm.c file is mapped, not copied into the process") {
  TempDir dir;
  constexpr size_t kTokens = size_t{16} << 20;  // 32 MiB of tokens
  std::string path;
  {
    std::vector<uint16_t> toks(kTokens);
    for (size_t i = 0; i < kTokens; ++i) toks[i] = static_cast<uint16_t>((i * 7919) % 50257);
    path = dir.write("big.bin", llmc_image(toks));
  }
  const long before = rss_anon_kib();
  REQUIRE(before >= 0);
  const dt::TokenFile f = dt::load_tokens(path);  // checks every token: touches every page
  const long grown = rss_anon_kib() - before;
  CHECK(f.tokens.mapped());
  REQUIRE(f.size() == kTokens);
  CHECK(f.tokens[kTokens - 1] == static_cast<uint16_t>(((kTokens - 1) * 7919) % 50257));
  INFO("private memory grew by " << grown << " KiB");
  CHECK(grown < 4096);  // a copy would be 32768 KiB
}

// A mapped file that changes under the run: a window holding a token outside the vocabulary is
// refused, never handed to the model.
TEST_CASE("data: a token file changed in use is refused at the window") {
  TempDir dir;
  const std::string path = dir.write("c.bin", llmc_image(std::vector<uint16_t>(100, 5)));
  const dt::TokenFile f = dt::load_tokens(path);
  REQUIRE(f.tokens.mapped());
  const dt::Sampler s(f.data(f.all()), f.size(), 99, 1, "training split of " + path, 1000);
  std::vector<int32_t> in(99), tg(99);
  CHECK_NOTHROW(s.fill(0, 0, 1, in.data(), tg.data()));
  {
    std::fstream out(path, std::ios::in | std::ios::out | std::ios::binary);
    out.seekp(1024 + 2 * 50);
    const unsigned char t[2] = {0x60, 0xEA};  // 60000
    out.write(reinterpret_cast<const char*>(t), 2);
  }
  REQUIRE(f.tokens[50] == 60000);  // the mapping shows the change
  const std::string msg = config_error([&] { s.fill(0, 0, 1, in.data(), tg.data()); });
  CHECK(contains(msg, "training split of " + path +
                          ": the window at token 0 holds token 60000, outside the vocabulary of "
                          "1000"));
  const size_t start = 0;
  const std::string msg2 = config_error([&] {
    dt::fill_windows(f.tokens.data(), f.size(), 99, &start, 1, in.data(), tg.data(), 1000,
                     "validation split of " + path);
  });
  CHECK(
      contains(msg2, "validation split of " + path + ": the window at token 0 holds token 60000"));
}
#endif

TEST_CASE("data: token_digest tells copies of other content, size or format apart") {
  TempDir dir;
  std::string big(300000, 'a');
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>('a' + (i * 7919) % 26);
  const auto digest = [&](const std::string& name, const std::string& bytes,
                          const char* fmt = "bytes") {
    return dt::token_digest(dt::load_tokens(dir.write(name, bytes), fmt));
  };
  const std::uint64_t d = digest("a", big);
  CHECK(digest("a2", big) == d);  // another copy of the same bytes
  std::string last = big;
  last.back() = last.back() == 'z' ? 'y' : 'z';  // the last block is always sampled
  CHECK(digest("b", last) != d);
  std::string first = big;
  first[0] = '#';
  CHECK(digest("c", first) != d);
  CHECK(digest("d", big.substr(0, big.size() - 1)) != d);  // one token shorter
  // A small file is digested whole: any token counts.
  const std::string small(5000, 'q');
  std::string mid = small;
  mid[2500] = 'r';
  CHECK(digest("e", small) != digest("f", mid));
  // The same tokens as llm.c and as bytes are different data.
  const std::vector<uint16_t> toks = {104, 105};
  CHECK(dt::token_digest(dt::load_tokens(dir.write("g.bin", llmc_image(toks)))) !=
        digest("h", "hi"));
}

TEST_CASE("data: auto picks llmc only on the magic, bytes otherwise") {
  TempDir dir;
  const std::string llmc = dir.write("a.bin", llmc_image({10, 20}));
  CHECK(dt::load_tokens(llmc, "auto").format == "llmc");
  CHECK(dt::load_tokens(llmc).format == "llmc");  // auto is the default

  // The same file read as bytes: every byte, header included; magic 20240520 = 0x0134D888.
  const dt::TokenFile raw = dt::load_tokens(llmc, "bytes");
  CHECK(raw.format == "bytes");
  REQUIRE(raw.size() == 1024 + 4);
  CHECK(raw.tokens[0] == 0x88);
  CHECK(raw.tokens[1] == 0xD8);
  CHECK(raw.tokens[2] == 0x34);
  CHECK(raw.tokens[3] == 0x01);
  CHECK(raw.tokens[1024] == 10);

  // Another magic (and no llm.c header otherwise: a count the size does not match), or a file
  // too short to hold one: bytes. (A whole llm.c header under another magic is refused below.)
  CHECK(dt::load_tokens(dir.write("b.bin", llmc_image({1}, 5, 1, 12345)), "auto").format ==
        "bytes");
  const dt::TokenFile tiny = dt::load_tokens(dir.write("c.txt", "ab"), "auto");
  CHECK(tiny.format == "bytes");
  CHECK(tiny.size() == 2);
}

TEST_CASE("data: token file errors name the path and the problem") {
  TempDir dir;
  SUBCASE("missing file") {
    check_load_error((dir.path / "nope.bin").string(), "auto", {"No such file or directory"});
  }
  SUBCASE("directory") { check_load_error(dir.path.string(), "bytes", {"not a regular file"}); }
  SUBCASE("FIFO without a writer: refused at once, not waited on in open()") {
    const std::string fifo = (dir.path / "fifo").string();
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    check_load_error(fifo, "auto", {"not a regular file"});
  }
  SUBCASE("unreadable file") {
    const std::string p = dir.write("secret.bin", "abc");
    ::chmod(p.c_str(), 0);
    if (::geteuid() == 0) {
      MESSAGE("running as root: permissions do not stop reads, only checking that it loads");
      CHECK(dt::load_tokens(p).size() == 3);
    } else {
      check_load_error(p, "auto", {"Permission denied"});
    }
  }
  SUBCASE("empty file") {
    for (const char* fmt : {"auto", "bytes", "llmc"})
      check_load_error(dir.write("e", ""), fmt, {"empty"});
  }
  SUBCASE("unknown format") {
    check_load_error(dir.write("x", "abc"), "gpt2", {"unknown token file format 'gpt2'"});
  }
  SUBCASE("magic mismatch when llmc is asked for") {
    check_load_error(dir.write("m.bin", llmc_image({1, 2}, -1, 1, 12345)), "llmc",
                     {"magic 12345", "20240520"});
    check_load_error(dir.write("t.txt", "plain text, not tokens"), "llmc", {"magic"});
  }
  SUBCASE("an llm.c file of LLaMA 3 (uint32 tokens) is named as such, not read as bytes") {
    const std::string p = dir.write("llama3.bin", llmc_image({1, 2}, -1, 1, 20240801));
    for (const char* fmt : {"auto", "llmc", "u16"})
      check_load_error(p, fmt, {"llm.c token file of LLaMA 3", "uint32", "does not read"});
  }
  SUBCASE("an llm.c header under another magic is taken for a damaged llm.c file, not bytes") {
    const std::string p = dir.write("damaged.txt", llmc_image({1, 2, 3}, -1, 1, 20240521));
    check_load_error(p, "auto", {"has an llm.c header", "3 tokens", "magic 20240521", "damaged"});
    CHECK(dt::load_tokens(p, "bytes").format == "bytes");  // as asked
  }
  SUBCASE("unsupported version") {
    for (const char* fmt : {"auto", "llmc"})
      check_load_error(dir.write("v.bin", llmc_image({1, 2}, -1, 2)), fmt, {"version 2"});
  }
  SUBCASE("header count disagrees with the file size") {
    // 4 tokens in the file, header claims 3: both numbers stated.
    check_load_error(dir.write("c.bin", llmc_image({1, 2, 3, 4}, 3)), "auto",
                     {"header says 3 tokens", "8 bytes"});
    // Odd number of token bytes.
    std::string odd = llmc_image({1, 2});
    odd += 'x';
    check_load_error(dir.write("odd.bin", odd), "llmc", {"header says 2 tokens", "5 bytes"});
  }
  SUBCASE("truncated token data") {
    check_load_error(dir.write("tr.bin", llmc_image({1, 2, 3}, 5)), "auto",
                     {"truncated", "5 tokens", "10 bytes", "only 6 bytes"});
  }
  SUBCASE("truncated header") {
    const std::string head = llmc_image({}).substr(0, 100);
    for (const char* fmt : {"auto", "llmc"})
      check_load_error(dir.write("h.bin", head), fmt, {"truncated", "100 bytes", "1024"});
    check_load_error(dir.write("h2.bin", "ab"), "llmc", {"truncated", "2 bytes"});
  }
  SUBCASE("no tokens") {
    check_load_error(dir.write("z.bin", llmc_image({})), "auto", {"no tokens"});
  }
  SUBCASE("negative count") {
    // A negative count argument means "the real count" in llmc_image; patch the header instead.
    std::string img = llmc_image({1});
    put_le32(img, 8, -7);
    check_load_error(dir.write("n2.bin", img), "auto", {"negative token count -7"});
  }
  SUBCASE("a token beyond GPT-2's vocabulary loads (model.vocab decides)") {
    const dt::TokenFile f = dt::load_tokens(dir.write("big.bin", llmc_image({1, 50257, 3})));
    CHECK(f.vocab == 50257);
    CHECK(f.max_token_plus_one == 50258);
  }
}

TEST_CASE("data: split sizes") {
  const dt::TokenFile f = synthetic(1000);
  dt::Split s = dt::split(f, 0.1);
  CHECK(s.train.begin == 0);
  CHECK(s.train.end == 900);
  CHECK(s.val.begin == 900);
  CHECK(s.val.end == 1000);
  CHECK(s.train.size() + s.val.size() == f.size());
  CHECK(f.data(s.val) == f.tokens.data() + 900);
  CHECK(*f.data(s.val) == f.tokens[900]);

  s = dt::split(f, 0.0);
  CHECK(s.train.size() == 1000);
  CHECK(s.val.empty());

  s = dt::split(f, 0.0001);  // rounds to 0 tokens, but validation is never empty when asked for
  CHECK(s.val.size() == 1);
  CHECK(s.train.size() == 999);

  s = dt::split(f, 0.25);
  CHECK(s.val.size() == 250);
  CHECK(s.train.end == s.val.begin);

  for (double bad : {-0.1, 1.0, 1.5, std::nan("")}) {
    CAPTURE(bad);
    const std::string msg = config_error([&] { dt::split(f, bad); });
    CHECK(contains(msg, "validation fraction"));
  }
  CHECK_THROWS_AS(f.data(dt::TokenRange{10, 1001}), dt::InvalidArgument);
  CHECK_THROWS_AS(f.data(dt::TokenRange{10, 5}), dt::InvalidArgument);

  // A validation part too small for a window is reported by the sampler / eval windows.
  const dt::TokenFile small = synthetic(100);
  const dt::Split t = dt::split(small, 0.05);  // 5 validation tokens
  REQUIRE(t.val.size() == 5);
  std::string msg =
      config_error([&] { dt::Sampler(small.data(t.val), t.val.size(), 8, 1, "validation split"); });
  CHECK(contains(msg, "validation split has 5 tokens"));
  CHECK(contains(msg, "9 tokens"));
  msg = config_error([&] { dt::eval_windows(t.val.size(), 8, 1); });
  CHECK(contains(msg, "has 5 tokens"));
  CHECK(contains(msg, "9 tokens"));
}

TEST_CASE("data: sampler constructor checks") {
  const auto toks = iota_tokens(16);
  const std::string msg = config_error([&] { dt::Sampler(toks.data(), 8, 8, 1); });
  CHECK(contains(msg, "has 8 tokens"));
  CHECK(contains(msg, "seq_len + 1 = 9"));
  CHECK(contains(config_error([&] { dt::Sampler(toks.data(), 16, 0, 1); }), "sequence length"));
  CHECK_NOTHROW(dt::Sampler(toks.data(), 9, 8, 1));
  CHECK_THROWS_AS(dt::Sampler(nullptr, 16, 4, 1), dt::InvalidArgument);
  const dt::Sampler s(toks.data(), 16, 4, 99);
  CHECK(s.size() == 16);
  CHECK(s.seq_len() == 4);
  CHECK(s.seed() == 99);
  CHECK(s.num_starts() == 12);
  std::vector<int32_t> buf(8);
  CHECK_THROWS_AS(s.fill(0, -1, 1, buf.data(), buf.data()), dt::InvalidArgument);
  CHECK_THROWS_AS(s.fill(0, 0, -1, buf.data(), buf.data()), dt::InvalidArgument);
  CHECK_THROWS_AS(s.fill(0, 0, 1, nullptr, buf.data()), dt::InvalidArgument);
  CHECK_NOTHROW(s.fill(0, 0, 0, nullptr, nullptr));
}

TEST_CASE("data: sampler is deterministic in (seed, step, sequence)") {
  const auto toks = iota_tokens(60000);
  const int T = 16;
  const dt::Sampler a(toks.data(), toks.size(), T, 1234);
  const dt::Sampler b(toks.data(), toks.size(), T, 1234);
  const dt::Sampler c(toks.data(), toks.size(), T, 1235);
  for (uint64_t step : {uint64_t{0}, uint64_t{1}, uint64_t{77}, uint64_t{1} << 40}) {
    CAPTURE(step);
    const Batch x = fill(a, step, 0, 16), y = fill(b, step, 0, 16), z = fill(c, step, 0, 16);
    CHECK(x.in == y.in);
    CHECK(x.tg == y.tg);
    CHECK(x.in != z.in);  // another seed draws other windows
    // "Resume": a fresh sampler asked for this step again gives the same batch.
    const dt::Sampler resumed(toks.data(), toks.size(), T, 1234);
    CHECK(fill(resumed, step, 0, 16).in == x.in);
  }
  CHECK(fill(a, 0, 0, 16).in != fill(a, 1, 0, 16).in);  // steps differ
  // Sequences within a step differ.
  std::set<size_t> starts;
  for (int64_t g = 0; g < 64; ++g) starts.insert(a.window_start(5, g));
  CHECK(starts.size() > 60);
  // Order of calls does not matter: the window is a pure function.
  const size_t w = a.window_start(3, 7);
  (void)a.window_start(9, 1);
  CHECK(a.window_start(3, 7) == w);
}

TEST_CASE("data: sampler global batch is the same whatever the rank split") {
  const auto toks = iota_tokens(50000);
  const int T = 8;
  const dt::Sampler s(toks.data(), toks.size(), T, 42);
  for (uint64_t step : {uint64_t{0}, uint64_t{3}, uint64_t{1000}}) {
    CAPTURE(step);
    const Batch all = fill(s, step, 0, 8);
    const Batch lo = fill(s, step, 0, 4), hi = fill(s, step, 4, 4);
    std::vector<int32_t> in = lo.in, tg = lo.tg;
    in.insert(in.end(), hi.in.begin(), hi.in.end());
    tg.insert(tg.end(), hi.tg.begin(), hi.tg.end());
    CHECK(in == all.in);
    CHECK(tg == all.tg);
    // Eight ranks of one sequence each.
    for (int64_t g = 0; g < 8; ++g) {
      const Batch one = fill(s, step, g, 1);
      CHECK(std::equal(one.in.begin(), one.in.end(), all.in.begin() + g * T));
    }
  }
}

TEST_CASE("data: sampler targets are the inputs shifted by one") {
  const auto toks = iota_tokens(3000);
  const int T = 12;
  const dt::Sampler s(toks.data(), toks.size(), T, 7);
  const Batch b = fill(s, 11, 5, 6);
  for (int64_t i = 0; i < 6; ++i) {
    const auto start = static_cast<int32_t>(s.window_start(11, 5 + i));
    for (int t = 0; t < T; ++t) {
      const size_t k = static_cast<size_t>(i * T + t);
      CHECK(b.in[k] == start + t);
      CHECK(b.tg[k] == start + t + 1);
      if (t + 1 < T) CHECK(b.tg[k] == b.in[k + 1]);
    }
  }
}

TEST_CASE("data: sampler windows stay in range and reach every start") {
  const int T = 32;
  for (size_t n : {size_t{T + 1}, size_t{T + 2}, size_t{T + 41}}) {
    CAPTURE(n);
    const auto toks = iota_tokens(n);
    const dt::Sampler s(toks.data(), n, T, 2024);
    const size_t starts = n - T;  // valid starts: [0, n - T - 1]
    std::vector<size_t> hits(starts, 0);
    const int draws = 200 * static_cast<int>(starts);
    bool in_range = true;
    for (int d = 0; d < draws; ++d) {
      const size_t st = s.window_start(static_cast<uint64_t>(d / 16), d % 16);
      if (st + T + 1 > n) {
        in_range = false;
        break;
      }
      ++hits[st];
    }
    REQUIRE(in_range);
    CHECK(hits.front() > 0);
    CHECK(hits.back() > 0);
    // Roughly uniform: each start within 50% of the expected 200 hits.
    for (size_t i = 0; i < starts; ++i) {
      CAPTURE(i);
      CHECK(hits[i] > 100);
      CHECK(hits[i] < 300);
    }
    // fill copies exactly the window at that start (last token reachable as a target).
    const Batch b = fill(s, 0, 0, 1);
    CHECK(b.tg.back() == static_cast<int32_t>(s.window_start(0, 0) + T));
  }
}

TEST_CASE("data: eval windows are fixed, evenly spaced and split across ranks") {
  const int T = 10;
  SUBCASE("non-overlapping when there is room") {
    const size_t n = 1000;
    const auto w = dt::eval_windows(n, T, 20);
    CHECK(w == dt::eval_windows(n, T, 20));  // the same data at every evaluation
    REQUIRE(w.size() == 20);
    CHECK(w.front() == 0);
    CHECK(w.back() == n - T - 1);
    for (size_t i = 1; i < w.size(); ++i) CHECK(w[i] - w[i - 1] >= size_t{T + 1});
  }
  SUBCASE("exactly tiled") {
    const auto w = dt::eval_windows(55, T, 5);  // 5 x 11 tokens
    CHECK(w == std::vector<size_t>{0, 11, 22, 33, 44});
  }
  SUBCASE("overlapping when there is not room, still distinct and in range") {
    const size_t n = 40;
    const auto w = dt::eval_windows(n, T, 30);  // 30 of the 30 distinct starts
    REQUIRE(w.size() == 30);
    for (size_t i = 0; i < w.size(); ++i) CHECK(w[i] == i);
    const auto v = dt::eval_windows(n, T, 7);
    CHECK(v.front() == 0);
    CHECK(v.back() == n - T - 1);
    for (size_t i = 1; i < v.size(); ++i) CHECK(v[i] > v[i - 1]);
  }
  SUBCASE("one window") { CHECK(dt::eval_windows(100, T, 1) == std::vector<size_t>{0}); }
  SUBCASE("errors") {
    std::string msg = config_error([&] { dt::eval_windows(40, T, 31); });
    CHECK(contains(msg, "30 distinct windows"));
    CHECK(contains(msg, "31 evaluation windows"));
    CHECK(contains(config_error([&] { dt::eval_windows(40, T, 0); }), "got 0"));
    msg = config_error([&] { dt::eval_windows(10, T, 1, "val part"); });
    CHECK(contains(msg, "val part has 10 tokens"));
    CHECK(contains(msg, "11 tokens"));
  }
  SUBCASE("filled across ranks equals filled at once") {
    const auto toks = iota_tokens(500);
    const auto w = dt::eval_windows(toks.size(), T, 8);
    Batch all(8, T), a(5, T), b(3, T);
    dt::fill_windows(toks.data(), toks.size(), T, w.data(), 8, all.in.data(), all.tg.data());
    dt::fill_windows(toks.data(), toks.size(), T, w.data(), 5, a.in.data(), a.tg.data());
    dt::fill_windows(toks.data(), toks.size(), T, w.data() + 5, 3, b.in.data(), b.tg.data());
    a.in.insert(a.in.end(), b.in.begin(), b.in.end());
    a.tg.insert(a.tg.end(), b.tg.begin(), b.tg.end());
    CHECK(a.in == all.in);
    CHECK(a.tg == all.tg);
    for (size_t i = 0; i < 8; ++i) {
      CHECK(all.in[i * T] == static_cast<int32_t>(w[i]));
      CHECK(all.tg[i * T + T - 1] == static_cast<int32_t>(w[i] + T));
    }
    const size_t bad_start = toks.size() - T;  // one token short
    CHECK_THROWS_AS(
        dt::fill_windows(toks.data(), toks.size(), T, &bad_start, 1, a.in.data(), a.tg.data()),
        dt::InvalidArgument);
  }
}

TEST_CASE("data: decode_bytes prints text and escapes the rest") {
  const std::vector<int32_t> toks = {'H', 'i', ' ',  '\n', '\\', '\t', '\r',
                                     0,   1,   0x7F, 0xFF, 300,  -1};
  CHECK(dt::decode_bytes(toks.data(), toks.size()) ==
        "Hi \n\\\\\\t\\r\\x00\\x01\\x7F\\xFF\\{300}\\{-1}");
  CHECK(dt::decode_bytes(toks.data(), 2) == "Hi");
  CHECK(dt::decode_bytes(nullptr, 0).empty());
}
