// Fuzz target: the sealed-message parser (src/security/wire.cpp), wire format version 2 (records).
// The first byte chooses the mode:
//  even: the input is one record as it arrives from the network (ciphertext, then the 72-byte
//        trailer); it must be rejected with dt::SecurityError (it cannot carry a valid tag) and
//        never read out of bounds.
//  odd, bit 1 clear: a valid one-record message (payload from the input) is damaged at
//        input-chosen places (bit flips, truncation, extension); unless the damage is empty, it
//        must be rejected with dt::SecurityError.
//  odd, bit 1 set: a valid message of several records (payload and record size from the input)
//        arrives with its records dropped, repeated, swapped or replaced by records of the
//        message before it, as the input says; the receiver opens them in order as records
//        0, 1, ... of the message: each record that is not the original one at its place must be
//        rejected, each that is must open to its plaintext.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dt/error.hpp"
#include "dt/security.hpp"
#include "fuzz_util.hpp"

namespace sec = dt::security;

namespace {
const sec::Keys& keys() {
  static const sec::Keys k = [] {
    sec::Key b{};
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::uint8_t>(i);
    return sec::Keys(sec::SecretKey(b), "fuzz");
  }();
  return k;
}
const sec::Salt kSession{};

sec::Aead& enc() {
  static sec::Aead a(keys().traffic_key("fuzz", kSession, kSession, 1, 2), true);
  return a;
}
sec::Aead& dec() {
  static sec::Aead a(keys().traffic_key("fuzz", kSession, kSession, 1, 2), false);
  return a;
}

sec::Expect expect(std::uint64_t sequence, std::size_t message_length, std::size_t rb,
                   std::uint32_t record) {
  sec::Expect e;
  e.sender = 1;
  e.receiver = 2;
  e.tag = 7;
  e.sequence = sequence;
  e.message_length = message_length;
  e.records = static_cast<std::uint32_t>(sec::record_count(message_length, rb));
  e.record = record;
  e.length = std::min(rb, message_length - std::min<std::size_t>(message_length, record * rb));
  e.channel = "fuzz";
  return e;
}

// The records of one message, each ciphertext then trailer.
std::vector<std::vector<std::uint8_t>> seal(const std::string& payload, std::size_t rb,
                                            std::uint64_t sequence, std::uint64_t counter) {
  const std::uint64_t n = sec::record_count(payload.size(), rb);
  std::vector<std::vector<std::uint8_t>> out;
  for (std::uint64_t i = 0; i < n; ++i) {
    sec::Header h;
    h.sender = 1;
    h.receiver = 2;
    h.tag = 7;
    h.sequence = sequence;
    h.counter = counter + i;
    h.message_length = payload.size();
    h.record = static_cast<std::uint32_t>(i);
    h.records = static_cast<std::uint32_t>(n);
    h.length = std::min<std::size_t>(rb, payload.size() - i * rb);
    std::vector<std::uint8_t> wire(h.length + sec::kSealOverhead);
    sec::seal_message(enc(), h, payload.data() + i * rb, wire.data());
    out.push_back(std::move(wire));
  }
  return out;
}

int raw(dt_fuzz::Reader& in) {
  // Opens under a key nothing here seals with: the messages the other modes seal (which the
  // fuzzer sees in its comparisons) are valid, but not under this key.
  static sec::Aead dec_raw(keys().traffic_key("fuzz-raw", kSession, kSession, 1, 2), false);
  const std::string wire = in.rest();
  const std::size_t n = wire.size() >= sec::kSealOverhead ? wire.size() - sec::kSealOverhead : 0;
  sec::Expect e = expect(3, n, n == 0 ? 1 : n, 0);
  // Exact-size heap copies so that any overread is caught by the sanitizer.
  std::vector<std::uint8_t> w(wire.begin(), wire.end());
  std::vector<std::uint8_t> out(e.length);
  try {
    sec::Header h = sec::parse_header(w.data(), w.size());
    (void)h;
  } catch (const dt::SecurityError&) {
  }
  try {
    sec::open_message(dec_raw, w.data(), w.size(), e, out.data());
  } catch (const dt::SecurityError&) {
    return 0;
  }
  std::abort();  // a message nobody sealed was accepted
}

int damaged(dt_fuzz::Reader& in) {
  const std::size_t len = in.byte() * 7u;
  const std::string payload = in.bytes(len);
  const std::uint64_t counter = in.u64(2);
  std::vector<std::uint8_t> wire =
      seal(payload, payload.empty() ? 1 : payload.size(), 3, counter)[0];
  const std::vector<std::uint8_t> original = wire;
  // Damage: pairs of (position, xor mask); then an optional resize.
  const int flips = in.byte() % 4;
  for (int i = 0; i < flips; ++i) {
    const std::size_t pos = in.u64(2) % wire.size();
    wire[pos] ^= in.byte();
  }
  const std::uint8_t resize = in.byte();
  if (resize & 1) wire.resize(wire.size() - std::min<std::size_t>(wire.size(), resize >> 1));
  if (resize & 2) wire.resize(wire.size() + (resize >> 2), 0);
  const sec::Expect e = expect(3, payload.size(), payload.empty() ? 1 : payload.size(), 0);
  std::vector<std::uint8_t> out(e.length);
  try {
    sec::open_message(dec(), wire.data(), wire.size(), e, out.data());
  } catch (const dt::SecurityError&) {
    if (wire == original) std::abort();  // an intact message was rejected
    return 0;
  }
  if (wire != original) std::abort();  // a damaged message was accepted
  if (!payload.empty() && std::memcmp(out.data(), payload.data(), payload.size()) != 0)
    std::abort();
  return 0;
}

int records(dt_fuzz::Reader& in) {
  const std::size_t rb = 1 + in.byte() % 64;
  const std::size_t len = in.byte() * 3u;
  const std::string payload = in.bytes(len);
  const auto prev = seal(payload, rb, 2, 0);  // the message before (sequence 2)
  const auto msg = seal(payload, rb, 3, prev.size());
  // The records as they arrive: indices into msg, or into prev when >= msg.size().
  std::vector<std::size_t> order(msg.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  const int edits = in.byte() % 4;
  for (int k = 0; k < edits && !order.empty(); ++k) {
    const std::uint8_t op = in.byte();
    const std::size_t i = in.byte() % order.size(), j = in.byte() % order.size();
    switch (op % 4) {
      case 0:  // dropped
        order.erase(order.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      case 1:  // repeated
        order.insert(order.begin() + static_cast<std::ptrdiff_t>(i), order[j]);
        break;
      case 2:  // swapped
        std::swap(order[i], order[j]);
        break;
      default:  // the previous message's record j in place i
        order[i] = msg.size() + std::min(j, prev.size() - 1);
        break;
    }
  }
  const std::size_t n = std::min(order.size(), msg.size());
  for (std::size_t pos = 0; pos < n; ++pos) {
    const std::vector<std::uint8_t>& wire =
        order[pos] < msg.size() ? msg[order[pos]] : prev[order[pos] - msg.size()];
    const bool original = order[pos] == pos;
    const sec::Expect e = expect(3, payload.size(), rb, static_cast<std::uint32_t>(pos));
    std::vector<std::uint8_t> out(e.length);
    try {
      sec::open_message(dec(), wire.data(), wire.size(), e, out.data());
    } catch (const dt::SecurityError&) {
      if (original) std::abort();  // the right record at its place was rejected
      return 0;                    // the receiver stops at the first rejected record
    }
    if (!original) std::abort();  // a record out of place was accepted
    if (e.length > 0 && std::memcmp(out.data(), payload.data() + pos * rb, e.length) != 0)
      std::abort();
  }
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  dt_fuzz::Reader in(data, size);
  const std::uint8_t mode = in.byte();
  if (mode % 2 == 0) return raw(in);
  if ((mode & 2) == 0) return damaged(in);
  return records(in);
}
