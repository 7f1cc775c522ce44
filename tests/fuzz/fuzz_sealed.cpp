// Fuzz target: the sealed-message parser (src/security/wire.cpp).
// Mode 0: the input is a message as it arrives from the network; it must be rejected with
// dt::SecurityError (it cannot carry a valid tag) and never read out of bounds.
// Mode 1: a valid message (payload from the input) is damaged at input-chosen places (bit flips,
// truncation, extension); unless the damage is empty, it must be rejected with dt::SecurityError.
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
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  dt_fuzz::Reader in(data, size);
  const std::uint8_t mode = in.byte();
  static sec::Aead enc(keys().traffic_key("fuzz", kSession, 1, 2), true);
  static sec::Aead dec(keys().traffic_key("fuzz", kSession, 1, 2), false);
  // Mode 0 opens under a key nothing here seals with: the messages mode 1 seals (which the fuzzer
  // sees in its comparisons) are valid, but not under this key.
  static sec::Aead dec_raw(keys().traffic_key("fuzz-raw", kSession, 1, 2), false);
  sec::Expect e;
  e.sender = 1;
  e.receiver = 2;
  e.tag = 7;
  e.sequence = 3;
  e.channel = "fuzz";
  if (mode % 2 == 0) {
    const std::string wire = in.rest();
    e.length = wire.size() >= sec::kSealOverhead ? wire.size() - sec::kSealOverhead : 0;
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
  const std::size_t len = in.byte() * 7u;
  const std::string payload = in.bytes(len);
  e.length = payload.size();
  sec::Header h;
  h.sender = 1;
  h.receiver = 2;
  h.tag = 7;
  h.sequence = 3;
  h.counter = in.u64(2);
  h.length = payload.size();
  std::vector<std::uint8_t> wire(payload.size() + sec::kSealOverhead);
  sec::seal_message(enc, h, payload.data(), wire.data());
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
  std::vector<std::uint8_t> out(e.length);
  try {
    sec::open_message(dec, wire.data(), wire.size(), e, out.data());
  } catch (const dt::SecurityError&) {
    if (wire == original) std::abort();  // an intact message was rejected
    return 0;
  }
  if (wire != original) std::abort();  // a damaged message was accepted
  if (!payload.empty() && std::memcmp(out.data(), payload.data(), payload.size()) != 0)
    std::abort();
  return 0;
}
