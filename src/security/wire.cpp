// The sealed-message format: header encoding, sealing and the checks of the receiver.
#include <cstring>

#include "dt/error.hpp"
#include "dt/security.hpp"

namespace dt::security {

namespace {

constexpr std::uint8_t kMagic[4] = {'d', 't', 'S', '1'};

void put(std::uint8_t* p, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<std::uint8_t>((v >> (8 * i)) & 0xFF);
}
std::uint64_t get(const std::uint8_t* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace

const char* reject_name(Reject r) noexcept {
  switch (r) {
    case Reject::malformed:
      return "malformed";
    case Reject::authentication:
      return "authentication";
    case Reject::sequence:
      return "sequence";
    case Reject::redirected:
      return "redirected";
  }
  return "?";
}

void encode_header(const Header& h, std::uint8_t* out) {
  std::memcpy(out, kMagic, 4);
  put(out + 4, h.sender, 4);
  put(out + 8, h.receiver, 4);
  put(out + 12, static_cast<std::uint32_t>(h.tag), 4);
  put(out + 16, h.sequence, 8);
  put(out + 24, h.counter, 8);
  put(out + 32, h.length, 8);
}

Header parse_header(const std::uint8_t* wire, std::size_t wire_bytes) {
  DT_CHECK(SecurityError, wire_bytes >= kSealOverhead, "malformed sealed message: ", wire_bytes,
           " bytes, shorter than the ", kSealOverhead, "-byte envelope");
  DT_CHECK(SecurityError, std::memcmp(wire, kMagic, 4) == 0,
           "malformed sealed message: wrong magic (not a dt sealed message)");
  Header h;
  h.sender = static_cast<std::uint32_t>(get(wire + 4, 4));
  h.receiver = static_cast<std::uint32_t>(get(wire + 8, 4));
  h.tag = static_cast<std::int32_t>(static_cast<std::uint32_t>(get(wire + 12, 4)));
  h.sequence = get(wire + 16, 8);
  h.counter = get(wire + 24, 8);
  h.length = get(wire + 32, 8);
  DT_CHECK(SecurityError, h.length == wire_bytes - kSealOverhead,
           "malformed sealed message: header says ", h.length, " bytes of payload, the message has ",
           wire_bytes - kSealOverhead, " (truncated or padded)");
  return h;
}

std::array<std::uint8_t, kNonceBytes> nonce_of(const Header& h) {
  std::array<std::uint8_t, kNonceBytes> n{};
  put(n.data(), h.sender & 0xFFFFFFu, 3);
  put(n.data() + 3, h.receiver & 0xFFFFFFu, 3);
  put(n.data() + 6, h.counter & kMaxCounter, 6);
  return n;
}

void seal_message(Aead& enc, const Header& h, const void* plain, std::uint8_t* wire) {
  DT_CHECK(SecurityError, h.counter <= kMaxCounter, "sealed traffic from rank ", h.sender,
           " to rank ", h.receiver, ": message counter exhausted (", h.counter,
           "); re-create the channel for a fresh key");
  encode_header(h, wire);
  const auto nonce = nonce_of(h);
  enc.seal(nonce.data(), wire, kHeaderBytes, plain, h.length, wire + kHeaderBytes,
           wire + kHeaderBytes + h.length);
}

Header open_message(Aead& dec, const std::uint8_t* wire, std::size_t wire_bytes, const Expect& e,
                    void* out, Reject* why) {
  auto reject = [&](Reject r) {
    if (why) *why = r;
  };
  const std::string from = "message " + std::to_string(e.sequence) + " from rank " +
                           std::to_string(e.sender) + " to rank " + std::to_string(e.receiver) +
                           " (tag " + std::to_string(e.tag) + ") on " + e.channel;
  Header h;
  try {
    h = parse_header(wire, wire_bytes);
  } catch (const SecurityError& err) {
    reject(Reject::malformed);
    DT_THROW(SecurityError, "rejected ", from, ": ", err.message());
  }
  if (h.length != e.length) {
    reject(Reject::malformed);
    DT_THROW(SecurityError, "rejected ", from, ": ", h.length, " bytes where ", e.length,
             " were expected (truncated or altered)");
  }
  const auto nonce = nonce_of(h);
  if (!dec.open(nonce.data(), wire, kHeaderBytes, wire + kHeaderBytes, h.length, out,
                wire + kHeaderBytes + h.length)) {
    reject(Reject::authentication);
    DT_THROW(SecurityError, "rejected ", from, " (sequence number ", h.sequence,
             " in its header): authentication failed; the message was altered, or sealed with "
             "another key (another job, channel or direction)");
  }
  // Authentic from here on: the header was sealed by the peer's key for this direction.
  if (h.sender != static_cast<std::uint32_t>(e.sender) ||
      h.receiver != static_cast<std::uint32_t>(e.receiver) || h.tag != e.tag) {
    reject(Reject::redirected);
    DT_THROW(SecurityError, "rejected ", from, ": it was sealed for rank ", h.sender, " -> ",
             h.receiver, " tag ", h.tag, " (redirected)");
  }
  if (h.sequence != e.sequence) {
    reject(Reject::sequence);
    DT_THROW(SecurityError, "rejected ", from, ": it carries sequence number ", h.sequence,
             (h.sequence < e.sequence ? " (replayed)" : " (reordered or a message was dropped)"));
  }
  return h;
}

}  // namespace dt::security
