// Keys, HKDF, AES-256-GCM and the sealed-message format, in one process (doctest).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "../unit/temp_dir.hpp"
#include "dt/error.hpp"
#include "dt/metrics.hpp"
#include "dt/security.hpp"

using namespace dt::security;

namespace {

std::string key_bytes(char fill = 'k') { return std::string(kKeyBytes, fill); }

Keys test_keys(const std::string& job = "1234", char fill = 'k') {
  Key k{};
  std::memset(k.data(), fill, k.size());
  return Keys(SecretKey(k), job);
}

double failures(const char* reason) {
  return dt::metrics::default_registry()
      .counter("dt_security_auth_failures_total",
               "Sealed messages rejected (bad tag, replay, reorder, redirect, malformed)",
               {{"reason", reason}})
      .value();
}

// One sealed message from `from` to `to`.
std::vector<std::uint8_t> make_msg(const Keys& keys, const Salt& session, int from, int to,
                                   int tag, std::uint64_t seq, std::uint64_t counter,
                                   const std::string& text) {
  Aead enc(keys.traffic_key("test", session, from, to), true);
  Header h;
  h.sender = static_cast<std::uint32_t>(from);
  h.receiver = static_cast<std::uint32_t>(to);
  h.tag = tag;
  h.sequence = seq;
  h.counter = counter;
  h.length = text.size();
  std::vector<std::uint8_t> wire(text.size() + kSealOverhead);
  seal_message(enc, h, text.data(), wire.data());
  return wire;
}

Expect expect_of(int from, int to, int tag, std::uint64_t seq, std::size_t len) {
  Expect e;
  e.sender = from;
  e.receiver = to;
  e.tag = tag;
  e.sequence = seq;
  e.length = len;
  e.channel = "test";
  return e;
}

// Opens `wire` as the receiver `to` expecting (from, tag, seq, len); returns the error text, or
// "" and the plaintext in *out.
std::string try_open(const Keys& keys, const Salt& session, const std::vector<std::uint8_t>& wire,
                     const Expect& e, std::string* out = nullptr, Reject* why = nullptr) {
  Aead dec(keys.traffic_key("test", session, e.sender, e.receiver), false);
  std::string buf(e.length, '\0');
  try {
    open_message(dec, wire.data(), wire.size(), e, buf.data(), why);
  } catch (const dt::SecurityError& err) {
    return err.what();
  }
  if (out) *out = buf;
  return "";
}

}  // namespace

TEST_CASE("key file: 0600 loads, 0644 and 0640 and 0604 are refused naming file and mode") {
  dt::test::TempDir dir("dt_sec");
  const std::string p = dir.write("job.key", key_bytes());
  ::chmod(p.c_str(), 0600);
  SecretKey k = load_key_file(p);
  CHECK(k.bytes()[0] == 'k');
  ::chmod(p.c_str(), 0400);
  CHECK_NOTHROW(load_key_file(p));
  for (mode_t m : {0644, 0640, 0604, 0660, 0602}) {
    ::chmod(p.c_str(), m);
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(m));
    try {
      load_key_file(p);
      FAIL("mode ", mode, " was accepted");
    } catch (const dt::ConfigError& e) {
      const std::string w = e.what();
      CHECK_MESSAGE(w.find(p) != std::string::npos, w);
      CHECK_MESSAGE(w.find(mode) != std::string::npos, w);
      CHECK_MESSAGE(w.find("security.key_file") != std::string::npos, w);
    }
  }
}

TEST_CASE("key file: wrong size, missing, directory, symlink, other owner are refused") {
  dt::test::TempDir dir("dt_sec");
  const std::string shortk = dir.write("short.key", std::string(31, 'x'));
  ::chmod(shortk.c_str(), 0600);
  CHECK_THROWS_WITH_AS(load_key_file(shortk), doctest::Contains("holds 31 bytes"),
                       dt::ConfigError);
  const std::string longk = dir.write("long.key", std::string(64, 'x'));
  ::chmod(longk.c_str(), 0600);
  CHECK_THROWS_WITH_AS(load_key_file(longk), doctest::Contains("holds 64 bytes"),
                       dt::ConfigError);
  CHECK_THROWS_WITH_AS(load_key_file((dir.path / "none.key").string()),
                       doctest::Contains("none.key"), dt::ConfigError);
  const std::string good = dir.write("good.key", key_bytes());
  ::chmod(good.c_str(), 0600);
  const std::string link = (dir.path / "link.key").string();
  REQUIRE(::symlink(good.c_str(), link.c_str()) == 0);
  CHECK_THROWS_AS(load_key_file(link), dt::ConfigError);  // O_NOFOLLOW
  if (::geteuid() == 0) {
    REQUIRE(::chown(good.c_str(), 65534, 65534) == 0);
    CHECK_THROWS_WITH_AS(load_key_file(good), doctest::Contains("owned by uid 65534"),
                         dt::ConfigError);
  }
}

TEST_CASE("HKDF-SHA-256 matches RFC 5869 test case 1") {
  std::vector<std::uint8_t> ikm(22, 0x0b);
  const std::uint8_t salt[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const std::uint8_t info[] = {0xf0, 0xf1, 0xf2, 0xf3, 0xf4, 0xf5, 0xf6, 0xf7, 0xf8, 0xf9};
  const Key okm = hkdf_sha256(ikm.data(), ikm.size(), salt, sizeof salt, info, sizeof info);
  const std::uint8_t want[32] = {0x3c, 0xb2, 0x5f, 0x25, 0xfa, 0xac, 0xd5, 0x7a, 0x90, 0x43, 0x4f,
                                 0x64, 0xd0, 0x36, 0x2f, 0x2a, 0x2d, 0x2d, 0x0a, 0x90, 0xcf, 0x1a,
                                 0x5a, 0x4c, 0x5d, 0xb0, 0x2d, 0x56, 0xec, 0xc4, 0xc5, 0xbf};
  CHECK(std::memcmp(okm.data(), want, 32) == 0);
}

TEST_CASE("traffic keys differ per job, direction, channel and session") {
  const Keys a = test_keys("100"), b = test_keys("101");
  const Salt s1 = random_salt(), s2 = random_salt();
  CHECK(s1 != s2);
  const Key k01 = a.traffic_key("c", s1, 0, 1).bytes();
  CHECK(k01 == a.traffic_key("c", s1, 0, 1).bytes());
  CHECK(k01 != a.traffic_key("c", s1, 1, 0).bytes());
  CHECK(k01 != b.traffic_key("c", s1, 0, 1).bytes());
  CHECK(k01 != a.traffic_key("d", s1, 0, 1).bytes());
  CHECK(k01 != a.traffic_key("c", s2, 0, 1).bytes());
  CHECK(a.checkpoint_key(s1).bytes() == b.checkpoint_key(s1).bytes());  // job-independent
  CHECK(a.checkpoint_key(s1).bytes() != a.checkpoint_key(s2).bytes());
  CHECK(a.checkpoint_key(s1).bytes() != test_keys("100", 'x').checkpoint_key(s1).bytes());
}

TEST_CASE("sealed message: round trip, empty message, nonce layout") {
  const Keys keys = test_keys();
  const Salt s = random_salt();
  const std::string text = "activations of stage 1, microbatch 7";
  auto wire = make_msg(keys, s, 2, 5, 42, 0, 0, text);
  CHECK(wire.size() == text.size() + kSealOverhead);
  CHECK(std::string(wire.begin() + kHeaderBytes, wire.begin() + kHeaderBytes + 36) != text);
  std::string got;
  CHECK(try_open(keys, s, wire, expect_of(2, 5, 42, 0, text.size()), &got) == "");
  CHECK(got == text);
  auto empty = make_msg(keys, s, 2, 5, 42, 1, 1, "");
  CHECK(try_open(keys, s, empty, expect_of(2, 5, 42, 1, 0)) == "");
  Header h;
  h.sender = 0xABCDEF;
  h.receiver = 0x123456;
  h.counter = 0x0000BBCCDDEEFF11ull;
  const auto n = nonce_of(h);
  const std::uint8_t want[12] = {0xEF, 0xCD, 0xAB, 0x56, 0x34, 0x12,
                                 0x11, 0xFF, 0xEE, 0xDD, 0xCC, 0xBB};
  CHECK(std::memcmp(n.data(), want, 12) == 0);
}

TEST_CASE("sealed message: every bit flip, replay, reorder, redirect, truncation is rejected") {
  const Keys keys = test_keys();
  const Salt s = random_salt();
  const std::string text(100, 'a');
  const auto wire = make_msg(keys, s, 1, 3, 7, 4, 9, text);
  const double auth0 = failures("authentication");
  int flips = 0, rejected = 0;
  for (std::size_t byte = 0; byte < wire.size(); ++byte)
    for (int bit = 0; bit < 8; bit += 3) {
      auto w = wire;
      w[byte] ^= static_cast<std::uint8_t>(1u << bit);
      ++flips;
      Reject why = Reject::malformed;
      const std::string err = try_open(keys, s, w, expect_of(1, 3, 7, 4, 100), nullptr, &why);
      if (!err.empty()) ++rejected;
      if (byte >= kHeaderBytes) CHECK(why == Reject::authentication);
    }
  CHECK(rejected == flips);
  // Replay: the same message again, when the receiver expects the next sequence number.
  std::string err = try_open(keys, s, wire, expect_of(1, 3, 7, 5, 100));
  CHECK(err.find("replayed") != std::string::npos);
  CHECK(err.find("message 5 from rank 1") != std::string::npos);
  // Reorder: message 4 arrives first while 3 is expected.
  err = try_open(keys, s, wire, expect_of(1, 3, 7, 3, 100));
  CHECK(err.find("reordered") != std::string::npos);
  // Redirected: sealed for 1 -> 3, presented to 2 (with 1 -> 2's key: fails authentication).
  err = try_open(keys, s, wire, expect_of(1, 2, 7, 4, 100));
  CHECK(err.find("authentication failed") != std::string::npos);
  // Another tag with the right key: the tag is authenticated.
  Reject why = Reject::malformed;
  err = try_open(keys, s, wire, expect_of(1, 3, 8, 4, 100), nullptr, &why);
  CHECK(why == Reject::redirected);
  // The other direction's key.
  err = try_open(keys, s, wire, expect_of(3, 1, 7, 4, 100));
  CHECK(err.find("authentication failed") != std::string::npos);
  // Another job's key.
  err = try_open(test_keys("999"), s, wire, expect_of(1, 3, 7, 4, 100));
  CHECK(err.find("authentication failed") != std::string::npos);
  // Truncated (and the header's length kept), or cut to less than the envelope.
  auto cut = wire;
  cut.resize(wire.size() - 1);
  err = try_open(keys, s, cut, expect_of(1, 3, 7, 4, 100));
  CHECK(err.find("malformed") != std::string::npos);
  cut.resize(10);
  err = try_open(keys, s, cut, expect_of(1, 3, 7, 4, 100));
  CHECK(err.find("malformed") != std::string::npos);
  // A shorter message than expected, correctly sealed.
  const auto shorter = make_msg(keys, s, 1, 3, 7, 4, 9, std::string(99, 'a'));
  err = try_open(keys, s, shorter, expect_of(1, 3, 7, 4, 100));
  CHECK(err.find("99 bytes where 100 were expected") != std::string::npos);
  // open_message only reports; the transports count each rejection once.
  CHECK(failures("authentication") == auth0);
  count_failure(Reject::authentication);
  CHECK(failures("authentication") == auth0 + 1);
  CHECK(dt::metrics::default_registry().render().find(
            "dt_security_auth_failures_total{reason=\"authentication\"} 1") != std::string::npos);
}

TEST_CASE("counter exhaustion is refused") {
  const Keys keys = test_keys();
  Aead enc(keys.traffic_key("c", random_salt(), 0, 1), true);
  Header h;
  h.counter = kMaxCounter + 1;
  std::vector<std::uint8_t> wire(kSealOverhead);
  CHECK_THROWS_WITH_AS(seal_message(enc, h, nullptr, wire.data()),
                       doctest::Contains("counter exhausted"), dt::SecurityError);
}

TEST_CASE("parse_tamper") {
  CHECK(parse_tamper("none").kind == Tamper::Kind::none);
  CHECK(parse_tamper("flip:3").kind == Tamper::Kind::flip);
  CHECK(parse_tamper("flip:3").at == 3);
  CHECK(parse_tamper("replay:0").kind == Tamper::Kind::replay);
  CHECK(parse_tamper("reorder:12").at == 12);
  for (const char* bad : {"flip", "flip:", "flip:x", "swap:1", "flip:-1"})
    CHECK_THROWS_WITH_AS(parse_tamper(bad), doctest::Contains("test.tamper"), dt::ConfigError);
}
