// Keys, HKDF, AES-256-GCM and the sealed-message format, in one process (doctest).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <unistd.h>
#include <algorithm>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "../unit/temp_dir.hpp"
#include "dt/error.hpp"
#include "dt/metrics.hpp"
#include "dt/p2p.hpp"
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
std::vector<std::uint8_t> make_msg(const Keys& keys, const Salt& session, int from, int to, int tag,
                                   std::uint64_t seq, std::uint64_t counter,
                                   const std::string& text) {
  Aead enc(keys.traffic_key("test", session, session, from, to), true);
  Header h;
  h.sender = static_cast<std::uint32_t>(from);
  h.receiver = static_cast<std::uint32_t>(to);
  h.tag = tag;
  h.sequence = seq;
  h.counter = counter;
  h.message_length = text.size();
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
  e.message_length = len;
  e.length = len;
  e.channel = "test";
  return e;
}

// Opens `wire` as the receiver `to` expecting (from, tag, seq, len); returns the error text, or
// "" and the plaintext in *out.
std::string try_open(const Keys& keys, const Salt& session, const std::vector<std::uint8_t>& wire,
                     const Expect& e, std::string* out = nullptr, Reject* why = nullptr) {
  Aead dec(keys.traffic_key("test", session, session, e.sender, e.receiver), false);
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
  CHECK_THROWS_WITH_AS(load_key_file(shortk), doctest::Contains("holds 31 bytes"), dt::ConfigError);
  const std::string longk = dir.write("long.key", std::string(64, 'x'));
  ::chmod(longk.c_str(), 0600);
  CHECK_THROWS_WITH_AS(load_key_file(longk), doctest::Contains("holds 64 bytes"), dt::ConfigError);
  CHECK_THROWS_WITH_AS(load_key_file((dir.path / "none.key").string()),
                       doctest::Contains("none.key"), dt::ConfigError);
  const std::string good = dir.write("good.key", key_bytes());
  ::chmod(good.c_str(), 0600);
  const std::string link = (dir.path / "link.key").string();
  REQUIRE(::symlink(good.c_str(), link.c_str()) == 0);
  CHECK_THROWS_WITH_AS(load_key_file(link),  // O_NOFOLLOW, said as such
                       doctest::Contains("link.key' is a symbolic link: a key file is never opened "
                                         "through a link"),
                       dt::ConfigError);
  // A FIFO at the path (planted in a shared /tmp, say) is refused, not waited on.
  const std::string fifo = (dir.path / "fifo.key").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH_AS(load_key_file(fifo), doctest::Contains("is not a regular file"),
                       dt::ConfigError);
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

TEST_CASE("key fingerprint: 16 hex digits, equal for equal keys, another for any other key") {
  using dt::security::Key;
  Key a{};
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<std::uint8_t>(i * 37 + 11);
  const std::string fa = dt::security::key_fingerprint(dt::security::SecretKey(a));
  CHECK(fa.size() == 16);
  CHECK(fa.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(dt::security::key_fingerprint(dt::security::SecretKey(a)) == fa);
  // Independent of the key's bytes as they are: the HKDF of the key under its own label.
  const Key d = dt::security::hkdf_sha256(
      a.data(), a.size(), reinterpret_cast<const std::uint8_t*>("dt key fingerprint v1"), 21,
      reinterpret_cast<const std::uint8_t*>("dt key fingerprint v1"), 21);
  char hex[17];
  for (int i = 0; i < 8; ++i) std::snprintf(hex + 2 * i, 3, "%02x", d[static_cast<std::size_t>(i)]);
  CHECK(fa == std::string(hex));
  for (std::size_t byte : {std::size_t{0}, std::size_t{17}, std::size_t{31}}) {
    Key b = a;
    b[byte] ^= 0x01;
    CHECK(dt::security::key_fingerprint(dt::security::SecretKey(b)) != fa);
  }
}

TEST_CASE("traffic keys differ per job, direction, channel and either rank's salt") {
  const Keys a = test_keys("100"), b = test_keys("101");
  const Salt s1 = random_salt(), s2 = random_salt(), s3 = random_salt();
  CHECK(s1 != s2);
  const Key k01 = a.traffic_key("c", s1, s2, 0, 1).bytes();
  CHECK(k01 == a.traffic_key("c", s1, s2, 0, 1).bytes());
  CHECK(k01 != a.traffic_key("c", s1, s2, 1, 0).bytes());
  CHECK(k01 != a.traffic_key("c", s2, s1, 1, 0).bytes());
  CHECK(k01 != b.traffic_key("c", s1, s2, 0, 1).bytes());
  CHECK(k01 != a.traffic_key("d", s1, s2, 0, 1).bytes());
  CHECK(k01 != a.traffic_key("c", s3, s2, 0, 1).bytes());               // the sender's salt
  CHECK(k01 != a.traffic_key("c", s1, s3, 0, 1).bytes());               // the receiver's
  CHECK(k01 != a.traffic_key("c", s2, s1, 0, 1).bytes());               // which is whose
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
  CHECK(std::string(wire.begin(), wire.begin() + 36) != text);  // ciphertext first, then trailer
  CHECK(std::memcmp(wire.data() + text.size(), "dtS2", 4) == 0);
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
      // Ciphertext and GCM tag: authentication; the header (the AAD) is checked as well.
      if (byte < text.size() || byte >= text.size() + kHeaderBytes)
        CHECK(why == Reject::authentication);
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

// The records of one message of `text` cut into records of `rb` bytes, each ciphertext then
// trailer, counters from `counter0`.
std::vector<std::vector<std::uint8_t>> make_records(const Keys& keys, const Salt& session, int from,
                                                    int to, int tag, std::uint64_t seq,
                                                    std::uint64_t counter0, const std::string& text,
                                                    std::size_t rb) {
  Aead enc(keys.traffic_key("test", session, session, from, to), true);
  const std::uint64_t n = record_count(text.size(), rb);
  std::vector<std::vector<std::uint8_t>> out;
  for (std::uint64_t i = 0; i < n; ++i) {
    Header h;
    h.sender = static_cast<std::uint32_t>(from);
    h.receiver = static_cast<std::uint32_t>(to);
    h.tag = tag;
    h.sequence = seq;
    h.counter = counter0 + i;
    h.message_length = text.size();
    h.record = static_cast<std::uint32_t>(i);
    h.records = static_cast<std::uint32_t>(n);
    h.length = std::min<std::size_t>(rb, text.size() - i * rb);
    std::vector<std::uint8_t> wire(h.length + kSealOverhead);
    seal_message(enc, h, text.data() + i * rb, wire.data());
    out.push_back(std::move(wire));
  }
  return out;
}

// What the receiver expects of record i of a message of `len` bytes in records of `rb`.
Expect expect_record(int from, int to, int tag, std::uint64_t seq, std::size_t len, std::size_t rb,
                     std::uint32_t i) {
  Expect e = expect_of(from, to, tag, seq, len);
  e.records = static_cast<std::uint32_t>(record_count(len, rb));
  e.record = i;
  e.length = std::min<std::size_t>(rb, len - i * rb);
  return e;
}

TEST_CASE("records: count and layout") {
  CHECK(record_count(0, 4096) == 1);
  CHECK(record_count(1, 4096) == 1);
  CHECK(record_count(4096, 4096) == 1);
  CHECK(record_count(4097, 4096) == 2);
  CHECK(record_count(std::uint64_t{16} << 20, 256 << 10) == 64);
  // The trailer's fields, little-endian, at their documented offsets.
  Header h;
  h.sender = 1;
  h.receiver = 2;
  h.tag = 3;
  h.sequence = 4;
  h.counter = 5;
  h.message_length = 6;
  h.record = 7;
  h.records = 8;
  h.length = 9;
  std::uint8_t t[kHeaderBytes];
  encode_header(h, t);
  CHECK(std::memcmp(t, "dtS2", 4) == 0);
  for (auto [off, v] :
       {std::pair{4, 1}, {8, 2}, {12, 3}, {16, 4}, {24, 5}, {32, 6}, {40, 7}, {44, 8}, {48, 9}})
    CHECK_MESSAGE(t[off] == v, "offset ", off);
  std::vector<std::uint8_t> tr(kTrailerBytes);
  encode_header(h, tr.data());
  const Header back = parse_trailer(tr.data(), tr.size(), 9);
  CHECK(back.record == 7);
  CHECK(back.records == 8);
  CHECK(back.message_length == 6);
  CHECK_THROWS_WITH_AS(parse_trailer(tr.data(), tr.size(), 8), doctest::Contains("malformed"),
                       dt::SecurityError);
  CHECK_THROWS_WITH_AS(parse_trailer(tr.data(), tr.size() - 1, 9), doctest::Contains("trailer"),
                       dt::SecurityError);
  h.record = 8;  // not below the record count
  encode_header(h, tr.data());
  CHECK_THROWS_WITH_AS(parse_trailer(tr.data(), tr.size(), 9), doctest::Contains("record 8 of 8"),
                       dt::SecurityError);
}

TEST_CASE(
    "records of one message open only in order: dropped, repeated, swapped, foreign or "
    "truncated records are rejected") {
  const Keys keys = test_keys();
  const Salt s = random_salt();
  const std::size_t rb = 4096;
  std::string text(3 * rb, '\0');
  for (std::size_t i = 0; i < text.size(); ++i) text[i] = static_cast<char>(i * 31 + 7);
  const auto recs = make_records(keys, s, 1, 3, 7, 4, 100, text, rb);
  REQUIRE(recs.size() == 3);
  Aead dec(keys.traffic_key("test", s, s, 1, 3), false);
  auto open_as = [&](const std::vector<std::uint8_t>& wire, std::uint32_t i, std::uint64_t seq,
                     std::size_t len, std::string* got, Reject* why) {
    const Expect e = expect_record(1, 3, 7, seq, len, rb, i);
    std::string buf(e.length, '\0');
    try {
      open_message(dec, wire.data(), wire.size(), e, buf.data(), why);
    } catch (const dt::SecurityError& err) {
      return std::string(err.what());
    }
    if (got) *got += buf;
    return std::string();
  };
  // In order: every record opens, the message is whole, the nonces differ.
  std::string got;
  for (std::uint32_t i = 0; i < 3; ++i)
    CHECK(open_as(recs[i], i, 4, text.size(), &got, nullptr) == "");
  CHECK(got == text);
  CHECK(parse_header(recs[0].data(), recs[0].size()).counter == 100);
  CHECK(parse_header(recs[2].data(), recs[2].size()).counter == 102);
  // Record 1 where record 0 is expected (swapped), record 0 again where 1 is (repeated), record
  // 2 where 1 is (one dropped): authentic, but out of place.
  Reject why = Reject::malformed;
  std::string err = open_as(recs[1], 0, 4, text.size(), nullptr, &why);
  CHECK(why == Reject::sequence);
  CHECK(err.find("message 4 from rank 1 to rank 3 (tag 7)") != std::string::npos);
  CHECK(err.find("record 0 of 3") != std::string::npos);
  CHECK(err.find("it is record 1 of 3") != std::string::npos);
  err = open_as(recs[0], 1, 4, text.size(), nullptr, &why);
  CHECK(why == Reject::sequence);
  CHECK(err.find("it is record 0 of 3") != std::string::npos);
  err = open_as(recs[2], 1, 4, text.size(), nullptr, &why);
  CHECK(why == Reject::sequence);
  // The message cut after record 1: the next message's first record arrives as record 2.
  const auto next = make_records(keys, s, 1, 3, 7, 5, 103, text, rb);
  err = open_as(next[0], 2, 4, text.size(), nullptr, &why);
  CHECK(why == Reject::sequence);
  CHECK(err.find("carries sequence number 5") != std::string::npos);
  // A record of another message at the same place (replayed message).
  const auto before = make_records(keys, s, 1, 3, 7, 3, 97, text, rb);
  err = open_as(before[1], 1, 4, text.size(), nullptr, &why);
  CHECK(err.find("replayed") != std::string::npos);
  // A shorter message whose first records look alike: the message length is authenticated.
  const std::string shorter = text.substr(0, 2 * rb);
  const auto cut = make_records(keys, s, 1, 3, 7, 4, 100, shorter, rb);
  err = open_as(cut[0], 0, 4, text.size(), nullptr, &why);
  CHECK(why == Reject::malformed);
  CHECK(err.find("part of a message of 8192 bytes in 2 records") != std::string::npos);
  // The record count is authenticated: changing it in the trailer breaks the GCM tag.
  auto forged = recs[2];
  forged[rb + 44] = 2;  // records = 2, so record 2 would look like the last one of 2
  forged[rb + 40] = 1;
  err = open_as(forged, 2, 4, text.size(), nullptr, &why);
  CHECK(!err.empty());
  // Every bit of the trailer of a middle record matters.
  for (std::size_t byte = rb; byte < recs[1].size(); ++byte) {
    auto w = recs[1];
    w[byte] ^= 0x01;
    CHECK_MESSAGE(!open_as(w, 1, 4, text.size(), nullptr, nullptr).empty(), "byte ", byte);
  }
}

// ---- seal_p2p over an in-process transport --------------------------------------------------

// Two ranks in one thread: isend queues a copy, a receive takes the next queued message of its
// (source, tag) when tested; waiting for a message nobody sent fails instead of hanging.
struct Wire {
  struct Msg {
    int src, dst, tag;
    std::vector<std::uint8_t> bytes;
  };
  std::mutex mu;  // the two ends are created at once, on two threads (they exchange salts)
  std::map<std::tuple<int, int, int>, std::deque<std::vector<std::uint8_t>>> queues;
  std::vector<Msg> log;  // everything sent, in order
  // An attacker on the wire: a message sent from src to dst on tag arrives as these bytes.
  std::map<std::tuple<int, int, int>, std::vector<std::uint8_t>> replace;
  // Sends made while `hold` is set stay pending, and fail once `down` is set.
  bool hold = false, down = false;
};

class HeldWork final : public dt::WorkImpl {
 public:
  explicit HeldWork(const Wire& w) : w_(w) {}
  bool test() override {
    DT_CHECK(dt::CommError, !w_.down, "loop send: the link is down");
    return false;
  }
  bool wait_for(dt::Millis) override {
    DT_CHECK(dt::CommError, test(), "loop send: held forever");
    return true;
  }
  std::string describe() const override { return "held loop send"; }
  int rank() const override { return 0; }

 private:
  const Wire& w_;
};

class DoneWork final : public dt::WorkImpl {
 public:
  bool test() override { return true; }
  bool wait_for(dt::Millis) override { return true; }
  std::string describe() const override { return "loop send"; }
  int rank() const override { return 0; }
};

class LoopRecv final : public dt::WorkImpl {
 public:
  LoopRecv(Wire& w, int src, int dst, int tag, dt::TensorView buf)
      : w_(w), src_(src), dst_(dst), tag_(tag), buf_(buf) {}
  bool test() override {
    if (done_) return true;
    std::lock_guard<std::mutex> lk(w_.mu);
    auto& q = w_.queues[{src_, dst_, tag_}];
    if (q.empty()) return false;
    std::vector<std::uint8_t> m = std::move(q.front());
    q.pop_front();
    DT_CHECK(dt::CommError, m.size() == buf_.nbytes(), "loop recv: ", m.size(), " bytes, ",
             buf_.nbytes(), " expected");
    if (!m.empty()) std::memcpy(buf_.data, m.data(), m.size());
    return done_ = true;
  }
  // Waits up to 10 s for the message only while the two ends are being created (the salts);
  // later, a message not sent yet is a test failure at once.
  bool wait_for(dt::Millis) override {
    const bool setup = tag_ == dt::security::kReservedTagBase;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!test() && setup && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    DT_CHECK(dt::CommError, test(), "loop recv from ", src_, " tag ", tag_, ": nothing was sent");
    return true;
  }
  std::string describe() const override { return "loop recv"; }
  int rank() const override { return dst_; }

 private:
  Wire& w_;
  int src_, dst_, tag_;
  dt::TensorView buf_;
  bool done_ = false;
};

class LoopP2p final : public dt::P2p {
 public:
  LoopP2p(Wire& w, int rank) : w_(w), rank_(rank) {}
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return 2; }
  const std::string& name() const noexcept override { return name_; }
  dt::Work isend(dt::ConstTensorView buf, int dst, int tag) override {
    const auto* p = static_cast<const std::uint8_t*>(buf.data);
    std::vector<std::uint8_t> m(p, p + buf.nbytes());
    std::lock_guard<std::mutex> lk(w_.mu);
    if (auto r = w_.replace.find({rank_, dst, tag}); r != w_.replace.end()) m = r->second;
    w_.log.push_back({rank_, dst, tag, m});
    if (w_.hold) return dt::Work(std::make_unique<HeldWork>(w_));
    w_.queues[{rank_, dst, tag}].push_back(std::move(m));
    return dt::Work(std::make_unique<DoneWork>());
  }
  dt::Work irecv(dt::TensorView buf, int src, int tag) override {
    return dt::Work(std::make_unique<LoopRecv>(w_, src, rank_, tag, buf));
  }

 private:
  Wire& w_;
  int rank_;
  std::string name_ = "loop";
};

struct LoopPair {
  Wire wire;
  std::unique_ptr<dt::P2p> a, b;  // ranks 0 and 1
  std::vector<Wire::Msg> setup;   // what the two sent each other while being created
  // `replay`: the setup messages of another pair, delivered instead of this pair's.
  explicit LoopPair(std::size_t record_bytes, Tamper tamper = {},
                    const std::vector<Wire::Msg>* replay = nullptr) {
    if (replay)
      for (const Wire::Msg& m : *replay) wire.replace[{m.src, m.dst, m.tag}] = m.bytes;
    const Keys keys = test_keys();
    SealOptions so;
    so.record_bytes = record_bytes;
    so.tamper = tamper;
    SealOptions plain_so = so;
    plain_so.tamper = {};
    std::exception_ptr failed;
    std::thread tb([&] {  // the two ends exchange their salts
      try {
        b = seal_p2p(std::make_unique<LoopP2p>(wire, 1), keys, plain_so);
      } catch (...) {
        failed = std::current_exception();
      }
    });
    a = seal_p2p(std::make_unique<LoopP2p>(wire, 0), keys, so);
    tb.join();
    if (failed) std::rethrow_exception(failed);
    setup = wire.log;
    wire.log.clear();
    wire.replace.clear();
  }
};

std::vector<float> ramp(std::size_t n, float base) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = base + static_cast<float>(i);
  return v;
}

TEST_CASE(
    "seal_p2p: records travel as ciphertext and trailer, one counter value each, opened "
    "in place") {
  LoopPair lp(4096);
  const std::vector<float> m0 = ramp(2500, 1), m1 = ramp(1024, 5), m2;  // 10000, 4096, 0 bytes
  lp.a->isend(dt::view_of(m0), 1, 5).wait();
  lp.a->isend(dt::view_of(m1), 1, 6).wait();
  lp.a->isend(dt::view_of(m2), 1, 5).wait();
  // m0: 3 records (4096, 4096, 1808), m1: 1, m2: one empty record (its trailer only).
  std::vector<std::size_t> sizes;
  for (const Wire::Msg& m : lp.wire.log) sizes.push_back(m.bytes.size());
  const std::vector<std::size_t> want = {4096,          kTrailerBytes, 4096,
                                         kTrailerBytes, 1808,          kTrailerBytes,
                                         4096,          kTrailerBytes, kTrailerBytes};
  CHECK(sizes == want);
  std::vector<std::uint64_t> counters;  // the trailer's counter field (offset 24)
  for (const Wire::Msg& m : lp.wire.log)
    if (m.bytes.size() == kTrailerBytes) {
      std::uint64_t c = 0;
      for (int i = 0; i < 8; ++i) c |= static_cast<std::uint64_t>(m.bytes[24 + i]) << (8 * i);
      counters.push_back(c);
    }
  CHECK(counters == std::vector<std::uint64_t>{0, 1, 2, 3, 4});           // across tags, per record
  CHECK(std::memcmp(lp.wire.log[0].bytes.data(), m0.data(), 4096) != 0);  // ciphertext
  std::vector<float> r0(2500), r1(1024), r2;
  dt::Work w1 = lp.b->irecv(dt::view_of(r1), 0, 6);  // the other tag first
  dt::Work w0 = lp.b->irecv(dt::view_of(r0), 0, 5);
  dt::Work w2 = lp.b->irecv(dt::view_of(r2), 0, 5);
  w0.wait();
  w1.wait();
  w2.wait();
  CHECK(r0 == m0);
  CHECK(r1 == m1);
}

TEST_CASE("seal_p2p: a failed send reports its error on every later call") {
  LoopPair lp(4096);
  lp.wire.hold = true;
  const std::vector<float> m = ramp(3000, 1);  // 3 records
  dt::Work w = lp.a->isend(dt::view_of(m), 1, 4);
  CHECK_FALSE(w.test());
  lp.wire.down = true;
  for (int i = 0; i < 3; ++i) {
    CHECK_THROWS_WITH_AS(w.test(), doctest::Contains("the link is down"), dt::CommError);
    CHECK_THROWS_WITH_AS(w.wait(), doctest::Contains("the link is down"), dt::CommError);
  }
}

TEST_CASE("seal_p2p: salts replayed from an earlier channel make no sender reuse a key") {
  // A requeued job keeps its job id; an attacker who replays the salts of an earlier run's
  // channel to both ends must not get the same ciphertext (the same key and nonce) again.
  const std::vector<float> m = ramp(1024, 3);
  auto first_ciphertext = [&](LoopPair& lp, dt::P2p& from, int to) {
    lp.wire.log.clear();
    from.isend(dt::view_of(m), to, 9).wait();
    REQUIRE(lp.wire.log.size() == 2);
    return lp.wire.log[0].bytes;
  };
  LoopPair one(4096);
  REQUIRE(one.setup.size() == 2);  // one salt message each way
  const auto a1 = first_ciphertext(one, *one.a, 1), b1 = first_ciphertext(one, *one.b, 0);
  LoopPair two(4096, {}, &one.setup);
  const auto a2 = first_ciphertext(two, *two.a, 1), b2 = first_ciphertext(two, *two.b, 0);
  CHECK(a2 != a1);
  CHECK(b2 != b1);
  // The receivers derived their keys from the replayed salts: nothing verifies.
  std::vector<float> r(1024);
  CHECK_THROWS_AS(two.b->irecv(dt::view_of(r), 0, 9).wait(), dt::SecurityError);
}

TEST_CASE(
    "seal_p2p: a record dropped, records swapped, a bit flipped, a message replayed or "
    "reordered is rejected naming peer and sequence") {
  struct Case {
    const char* tamper;
    const char* want;
  };
  const Case cases[] = {
      {"drop-record:1",
       "message 1 from rank 0 to rank 1 (tag 9) on loop/sealed, record 2 of 3: "
       "it carries sequence number 2"},
      {"swap-records:1",
       "message 1 from rank 0 to rank 1 (tag 9) on loop/sealed, record 0 of 3: "
       "it is record 1 of 3"},
      {"flip:1", "message 1 from rank 0 to rank 1 (tag 9) on loop/sealed, record 1 of 3 "},
      {"replay:0",
       "message 1 from rank 0 to rank 1 (tag 9) on loop/sealed, record 0 of 3: it "
       "carries sequence number 0 (replayed)"},
      {"reorder:1",
       "message 1 from rank 0 to rank 1 (tag 9) on loop/sealed, record 0 of 3: it "
       "carries sequence number 2 (reordered"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.tamper);
    LoopPair lp(4096, parse_tamper(c.tamper));
    std::vector<std::vector<float>> out;
    for (int k = 0; k < 4; ++k) out.push_back(ramp(3072, static_cast<float>(k)));  // 3 records
    for (int k = 0; k < 4; ++k) lp.a->isend(dt::view_of(out[k]), 1, 9).wait();
    std::string err;
    int k = 0;
    for (; k < 4 && err.empty(); ++k) {
      std::vector<float> in(3072);
      try {
        lp.b->recv(dt::view_of(in), 0, 9);
        CHECK(in == out[k]);
      } catch (const dt::SecurityError& e) {
        err = e.what();
      }
    }
    CHECK_MESSAGE(err.find(c.want) != std::string::npos, err);
    CHECK(k == 2);  // message 0 arrived intact, message 1 was rejected
  }
}

TEST_CASE("a message that fails authentication leaves zeros, not its unverified plaintext") {
  const Keys keys = test_keys();
  const Salt s = random_salt();
  Aead enc(keys.traffic_key("c", s, s, 0, 1), true), dec(keys.traffic_key("c", s, s, 0, 1), false);
  std::uint8_t nonce[kNonceBytes] = {7}, tag[kTagBytes] = {};
  std::vector<std::uint8_t> text(1000), wire(1000), out(1000, 0x55);
  for (std::size_t i = 0; i < text.size(); ++i) text[i] = static_cast<std::uint8_t>(i * 13 + 1);
  enc.seal(nonce, nullptr, 0, text.data(), text.size(), wire.data(), tag);
  REQUIRE(dec.open(nonce, nullptr, 0, wire.data(), wire.size(), out.data(), tag));
  CHECK(out == text);
  wire[10] ^= 1;  // one bit flipped: every other byte would decrypt to the plaintext
  std::fill(out.begin(), out.end(), 0x55);
  CHECK_FALSE(dec.open(nonce, nullptr, 0, wire.data(), wire.size(), out.data(), tag));
  CHECK(std::all_of(out.begin(), out.end(), [](std::uint8_t b) { return b == 0; }));
}

namespace {

// The AES-GCM code this build has: OpenSSL always, ipsec-mb where dt was built with it.
std::vector<AesImpl> impls() {
  std::vector<AesImpl> v{AesImpl::openssl};
  if (aes_impl_available(AesImpl::ipsec_mb)) {
    v.push_back(AesImpl::ipsec_mb);
  } else {
    MESSAGE("SKIP (part): this build has no ipsec-mb; AES-GCM is tested through OpenSSL alone");
  }
  return v;
}

std::vector<std::uint8_t> hex(const char* h) {
  std::vector<std::uint8_t> v;
  for (std::size_t i = 0; h[i] && h[i + 1]; i += 2)
    v.push_back(static_cast<std::uint8_t>(std::stoi(std::string(h + i, 2), nullptr, 16)));
  return v;
}

}  // namespace

TEST_CASE("AES-256-GCM: the GCM specification's test vectors, through each implementation") {
  // McGrew and Viega, "The Galois/Counter Mode of Operation", test cases 13 to 16 (AES-256).
  struct Vector {
    const char *key, *iv, *plain, *aad, *cipher, *tag;
  };
  const char* k0 = "0000000000000000000000000000000000000000000000000000000000000000";
  const char* k1 = "feffe9928665731c6d6a8f9467308308feffe9928665731c6d6a8f9467308308";
  const char* p1 =
      "d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a721c3c0c95956809532fcf0e2449a6"
      "b525b16aedf5aa0de657ba637b391aafd255";
  const char* c1 =
      "522dc1f099567d07f47f37a32a84427d643a8cdcbfe5c0c97598a2bd2555d1aa8cb08e48590dbb3da7b08b1056"
      "828838c5f61e6393ba7a0abcc9f662898015ad";
  const Vector vectors[] = {
      {k0, "000000000000000000000000", "", "", "", "530f8afbc74536b9a963b4f1c4cb738b"},
      {k0, "000000000000000000000000", "00000000000000000000000000000000", "",
       "cea7403d4d606b6e074ec5d3baf39d18", "d0d1c8a799996bf0265b98b5d48ab919"},
      {k1, "cafebabefacedbaddecaf888", p1, "", c1, "b094dac5d93471bdec1a502270e3cc6c"},
      {k1, "cafebabefacedbaddecaf888", "", "", "", ""},  // 16: p1 and c1 less 4 bytes, with AAD
  };
  for (const AesImpl impl : impls()) {
    CAPTURE(aes_impl_name(impl));
    for (int i = 0; i < 4; ++i) {
      CAPTURE(i + 13);
      Vector v = vectors[i];
      std::vector<std::uint8_t> plain = hex(v.plain), aad = hex(v.aad), cipher = hex(v.cipher),
                                want_tag = hex(v.tag);
      if (i == 3) {
        plain = hex(p1);
        plain.resize(60);
        cipher = hex(c1);
        cipher.resize(60);
        aad = hex("feedfacedeadbeeffeedfacedeadbeefabaddad2");
        want_tag = hex("76fc6ece0f4e1768cddf8853bb2d551b");
      }
      const std::vector<std::uint8_t> key = hex(v.key), iv = hex(v.iv);
      Key k{};
      std::copy(key.begin(), key.end(), k.begin());
      Aead enc(SecretKey(k), true, impl), dec(SecretKey(k), false, impl);
      CHECK(enc.impl() == impl);
      std::vector<std::uint8_t> out(plain.size() + 1, 0xEE), back(plain.size() + 1, 0xEE);
      std::uint8_t tag[kTagBytes];
      enc.seal(iv.data(), aad.data(), aad.size(), plain.data(), plain.size(), out.data(), tag);
      CHECK(std::equal(cipher.begin(), cipher.end(), out.begin()));
      CHECK(out[plain.size()] == 0xEE);  // nothing written past the end
      CHECK(std::equal(want_tag.begin(), want_tag.end(), tag));
      CHECK(dec.open(iv.data(), aad.data(), aad.size(), cipher.data(), cipher.size(), back.data(),
                     want_tag.data()));
      CHECK(std::equal(plain.begin(), plain.end(), back.begin()));
      CHECK(back[plain.size()] == 0xEE);
    }
  }
}

TEST_CASE("AES-256-GCM: OpenSSL and ipsec-mb give the same bytes and open each other's") {
  const auto all = impls();
  if (all.size() < 2) return;
  std::mt19937_64 rng(20261205);
  auto fill = [&](std::vector<std::uint8_t>& v) {
    for (auto& b : v) b = static_cast<std::uint8_t>(rng());
  };
  const std::size_t sizes[] = {
      0, 1, 15, 16, 17, 63, 64, 255, 256, 257, 4095, 65536 + 3, (std::size_t{1} << 20) + 7};
  for (const std::size_t n : sizes) {
    for (const std::size_t aad_len : {std::size_t{0}, std::size_t{13}, std::size_t{80}}) {
      CAPTURE(n);
      CAPTURE(aad_len);
      Key k{};
      for (auto& b : k) b = static_cast<std::uint8_t>(rng());
      std::vector<std::uint8_t> plain(n), aad(aad_len), nonce(kNonceBytes);
      fill(plain);
      fill(aad);
      fill(nonce);
      Aead e_ssl(SecretKey(k), true, AesImpl::openssl),
          e_imb(SecretKey(k), true, AesImpl::ipsec_mb);
      Aead d_ssl(SecretKey(k), false, AesImpl::openssl),
          d_imb(SecretKey(k), false, AesImpl::ipsec_mb);
      std::vector<std::uint8_t> c_ssl(n), c_imb(n);
      std::uint8_t t_ssl[kTagBytes], t_imb[kTagBytes];
      e_ssl.seal(nonce.data(), aad.data(), aad_len, plain.data(), n, c_ssl.data(), t_ssl);
      e_imb.seal(nonce.data(), aad.data(), aad_len, plain.data(), n, c_imb.data(), t_imb);
      CHECK(c_ssl == c_imb);
      CHECK(std::memcmp(t_ssl, t_imb, kTagBytes) == 0);
      if (n > 0) CHECK(c_imb != plain);
      // Each opens the other's, in place as the mailboxes do.
      std::vector<std::uint8_t> a = c_imb, b = c_ssl;
      CHECK(d_ssl.open(nonce.data(), aad.data(), aad_len, a.data(), n, a.data(), t_imb));
      CHECK(d_imb.open(nonce.data(), aad.data(), aad_len, b.data(), n, b.data(), t_ssl));
      CHECK(a == plain);
      CHECK(b == plain);
      // In-place sealing gives the same bytes.
      std::vector<std::uint8_t> in_place = plain;
      std::uint8_t t2[kTagBytes];
      e_imb.seal(nonce.data(), aad.data(), aad_len, in_place.data(), n, in_place.data(), t2);
      CHECK(in_place == c_ssl);
      CHECK(std::memcmp(t2, t_ssl, kTagBytes) == 0);
      // A flipped bit of the ciphertext, the AAD or the tag fails, and leaves zeros.
      for (int what = 0; what < 3; ++what) {
        if ((what == 0 && n == 0) || (what == 1 && aad_len == 0)) continue;
        CAPTURE(what);
        std::vector<std::uint8_t> c = c_ssl, ad = aad;
        std::uint8_t t[kTagBytes];
        std::memcpy(t, t_ssl, kTagBytes);
        if (what == 0) c[rng() % n] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
        if (what == 1) ad[rng() % aad_len] ^= 0x80;
        if (what == 2) t[rng() % kTagBytes] ^= 0x01;
        for (Aead* d : {&d_ssl, &d_imb}) {
          std::vector<std::uint8_t> out(n, 0x55);
          CHECK_FALSE(d->open(nonce.data(), ad.data(), aad_len, c.data(), n, out.data(), t));
          CHECK(std::all_of(out.begin(), out.end(), [](std::uint8_t x) { return x == 0; }));
        }
      }
    }
  }
}

TEST_CASE("AES-256-GCM: moved, failing in place, and used from several threads at once") {
  Key k{};
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<std::uint8_t>(i * 7 + 3);
  std::vector<std::uint8_t> text(5000);
  for (std::size_t i = 0; i < text.size(); ++i) text[i] = static_cast<std::uint8_t>(i * 31 + 5);
  const std::uint8_t nonce[kNonceBytes] = {1, 2, 3}, aad[5] = {9, 8, 7, 6, 5};
  // The reference: OpenSSL, unmoved.
  std::vector<std::uint8_t> want(text.size());
  std::uint8_t want_tag[kTagBytes];
  Aead(SecretKey(k), true, AesImpl::openssl)
      .seal(nonce, aad, sizeof aad, text.data(), text.size(), want.data(), want_tag);
  for (const AesImpl impl : impls()) {
    CAPTURE(aes_impl_name(impl));
    // Moved into a std::optional, out of a function, and by assignment over another key.
    std::optional<Aead> enc;
    enc.emplace(Aead(SecretKey(k), true, impl));
    Aead dec = Aead(SecretKey(Key{}), false, impl);
    Aead moved(SecretKey(k), false, impl);
    dec = std::move(moved);
    CHECK(enc->impl() == impl);
    CHECK(dec.impl() == impl);
    std::vector<std::uint8_t> c(text.size());
    std::uint8_t tag[kTagBytes];
    enc->seal(nonce, aad, sizeof aad, text.data(), text.size(), c.data(), tag);
    CHECK(c == want);
    CHECK(std::memcmp(tag, want_tag, kTagBytes) == 0);
    // A failed open in place leaves zeros where the ciphertext was.
    std::vector<std::uint8_t> buf = c;
    buf[4321] ^= 0x10;
    CHECK_FALSE(dec.open(nonce, aad, sizeof aad, buf.data(), buf.size(), buf.data(), tag));
    CHECK(std::all_of(buf.begin(), buf.end(), [](std::uint8_t b) { return b == 0; }));
    buf = c;
    CHECK(dec.open(nonce, aad, sizeof aad, buf.data(), buf.size(), buf.data(), tag));
    CHECK(buf == text);
    // Four threads, each with its own Aeads (one shared manager underneath), at once.
    std::vector<int> ok(4, 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&, t] {
        Aead e(SecretKey(k), true, impl), d(SecretKey(k), false, impl);
        bool good = true;
        for (int r = 0; r < 200 && good; ++r) {
          std::vector<std::uint8_t> x(text.size()), y(text.size());
          std::uint8_t g[kTagBytes];
          e.seal(nonce, aad, sizeof aad, text.data(), text.size(), x.data(), g);
          good = x == want && std::memcmp(g, want_tag, kTagBytes) == 0 &&
                 d.open(nonce, aad, sizeof aad, x.data(), x.size(), y.data(), g) && y == text;
        }
        ok[static_cast<std::size_t>(t)] = good ? 1 : 0;
      });
    for (auto& th : threads) th.join();
    CHECK(ok == std::vector<int>(4, 1));
  }
}

TEST_CASE("AES-256-GCM: which implementation, and a build without one refused by name") {
  CHECK(parse_aes_impl("auto", "x") == AesImpl::automatic);
  CHECK(parse_aes_impl("openssl", "x") == AesImpl::openssl);
  CHECK(parse_aes_impl("ipsec-mb", "x") == AesImpl::ipsec_mb);
  CHECK_THROWS_WITH_AS(
      parse_aes_impl("aesni", "option --security.aes"),
      doctest::Contains("option --security.aes='aesni': expected auto, openssl or ipsec-mb"),
      dt::ConfigError);
  const AesImpl a = resolve_aes_impl(AesImpl::automatic);
  CHECK(a != AesImpl::automatic);
  CHECK(resolve_aes_impl(AesImpl::openssl) == AesImpl::openssl);
  CHECK(test_keys().aes() == a);
  CHECK(Aead(SecretKey(Key{}), true).impl() == a);
  if (aes_impl_available(AesImpl::ipsec_mb)) {
    CHECK(!ipsec_mb_arch().empty());
    // auto takes ipsec-mb exactly where it runs its AVX-512 code with VAES on this CPU.
    CHECK((a == AesImpl::ipsec_mb) == (ipsec_mb_arch() == "avx512+vaes"));
    // Of /proc/cpuinfo's flags, independently of ipsec-mb's own detection.
    std::ifstream cpuinfo("/proc/cpuinfo");
    std::string line, flags;
    while (std::getline(cpuinfo, line))
      if (line.rfind("flags", 0) == 0) {
        flags = line + " ";
        break;
      }
    if (!flags.empty()) {
      const bool wide = flags.find(" avx512f ") != std::string::npos &&
                        flags.find(" vaes ") != std::string::npos &&
                        flags.find(" vpclmulqdq ") != std::string::npos;
      CHECK((a == AesImpl::ipsec_mb) == wide);
    }
    MESSAGE("ipsec-mb code for this CPU: " << ipsec_mb_arch()
                                           << "; auto: " << std::string(aes_impl_name(a)));
  } else {
    CHECK(a == AesImpl::openssl);
    CHECK(ipsec_mb_arch().empty());
    CHECK_THROWS_WITH_AS(Keys(SecretKey(Key{}), "1", AesImpl::ipsec_mb),
                         doctest::Contains("AES-256-GCM code 'ipsec-mb': "), dt::ConfigError);
    CHECK(!ipsec_mb_unavailable().empty());
    CHECK_THROWS_AS(Aead(SecretKey(Key{}), true, AesImpl::ipsec_mb), dt::SecurityError);
  }
}

TEST_CASE("a genuine message refused as replayed or redirected leaves zeros in the buffer") {
  const Keys keys = test_keys();
  const Salt s = random_salt();
  const std::string text(300, 'p');
  const auto wire = make_msg(keys, s, 1, 3, 7, 4, 4, text);
  Aead dec(keys.traffic_key("test", s, s, 1, 3), false);
  for (const Expect& e : {expect_of(1, 3, 7, 5, text.size()), expect_of(1, 3, 8, 4, text.size())}) {
    CAPTURE(e.sequence);
    CAPTURE(e.tag);
    std::string buf(text.size(), 'x');
    Reject why{};
    CHECK_THROWS_AS(open_message(dec, wire.data(), wire.size(), e, buf.data(), &why),
                    dt::SecurityError);
    CHECK((why == Reject::sequence || why == Reject::redirected));
    CHECK(buf == std::string(text.size(), '\0'));
  }
  std::string got;
  CHECK(try_open(keys, s, wire, expect_of(1, 3, 7, 4, text.size()), &got).empty());
  CHECK(got == text);
}

TEST_CASE("counter exhaustion is refused") {
  const Keys keys = test_keys();
  Aead enc(keys.traffic_key("c", random_salt(), random_salt(), 0, 1), true);
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
  CHECK(parse_tamper("drop-record:4").kind == Tamper::Kind::drop_record);
  CHECK(parse_tamper("swap-records:0").kind == Tamper::Kind::swap_records);
  for (const char* bad : {"flip", "flip:", "flip:x", "swap:1", "flip:-1"})
    CHECK_THROWS_WITH_AS(parse_tamper(bad), doctest::Contains("test.tamper"), dt::ConfigError);
}
