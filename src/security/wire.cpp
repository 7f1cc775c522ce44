// The sealed-message format: header encoding, sealing and the checks of the receiver.
#include <openssl/crypto.h>

#include <cstring>

#include "dt/error.hpp"
#include "dt/security.hpp"

namespace dt::security {

namespace {

constexpr std::uint8_t kMagic[4] = {'d', 't', 'S', '2'};  // format version 2

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

std::uint64_t record_count(std::uint64_t bytes, std::size_t record_bytes) noexcept {
  if (bytes == 0 || record_bytes == 0) return 1;
  return (bytes - 1) / record_bytes + 1;
}

void encode_header(const Header& h, std::uint8_t* out) {
  std::memcpy(out, kMagic, 4);
  put(out + 4, h.sender, 4);
  put(out + 8, h.receiver, 4);
  put(out + 12, static_cast<std::uint32_t>(h.tag), 4);
  put(out + 16, h.sequence, 8);
  put(out + 24, h.counter, 8);
  put(out + 32, h.message_length, 8);
  put(out + 40, h.record, 4);
  put(out + 44, h.records, 4);
  put(out + 48, h.length, 8);
}

Header parse_trailer(const std::uint8_t* trailer, std::size_t trailer_bytes,
                     std::size_t ciphertext_bytes) {
  DT_CHECK(SecurityError, trailer_bytes == kTrailerBytes, "malformed sealed message: a ",
           trailer_bytes, "-byte trailer where ", kTrailerBytes, " bytes belong");
  DT_CHECK(SecurityError, std::memcmp(trailer, kMagic, 4) == 0,
           "malformed sealed message: wrong magic (not a dt sealed message of format version 2)");
  Header h;
  h.sender = static_cast<std::uint32_t>(get(trailer + 4, 4));
  h.receiver = static_cast<std::uint32_t>(get(trailer + 8, 4));
  h.tag = static_cast<std::int32_t>(static_cast<std::uint32_t>(get(trailer + 12, 4)));
  h.sequence = get(trailer + 16, 8);
  h.counter = get(trailer + 24, 8);
  h.message_length = get(trailer + 32, 8);
  h.record = static_cast<std::uint32_t>(get(trailer + 40, 4));
  h.records = static_cast<std::uint32_t>(get(trailer + 44, 4));
  h.length = get(trailer + 48, 8);
  DT_CHECK(SecurityError, h.length == ciphertext_bytes, "malformed sealed message: header says ",
           h.length, " bytes of payload, the record has ", ciphertext_bytes,
           " (truncated or padded)");
  DT_CHECK(SecurityError, h.record < h.records, "malformed sealed message: record ", h.record,
           " of ", h.records);
  return h;
}

Header parse_header(const std::uint8_t* wire, std::size_t wire_bytes) {
  DT_CHECK(SecurityError, wire_bytes >= kSealOverhead, "malformed sealed message: ", wire_bytes,
           " bytes, shorter than the ", kSealOverhead, "-byte trailer");
  const std::size_t n = wire_bytes - kTrailerBytes;
  return parse_trailer(wire + n, kTrailerBytes, n);
}

std::array<std::uint8_t, kNonceBytes> nonce_of(const Header& h) {
  std::array<std::uint8_t, kNonceBytes> n{};
  put(n.data(), h.sender & 0xFFFFFFu, 3);
  put(n.data() + 3, h.receiver & 0xFFFFFFu, 3);
  put(n.data() + 6, h.counter & kMaxCounter, 6);
  return n;
}

void seal_record(Aead& enc, const Header& h, const void* plain, std::uint8_t* ciphertext,
                 std::uint8_t* trailer) {
  DT_CHECK(SecurityError, h.counter <= kMaxCounter, "sealed traffic from rank ", h.sender,
           " to rank ", h.receiver, ": message counter exhausted (", h.counter,
           "); re-create the channel for a fresh key");
  encode_header(h, trailer);
  const auto nonce = nonce_of(h);
  enc.seal(nonce.data(), trailer, kHeaderBytes, plain, h.length, ciphertext,
           trailer + kHeaderBytes);
}

void seal_message(Aead& enc, const Header& h, const void* plain, std::uint8_t* wire) {
  seal_record(enc, h, plain, wire, wire + h.length);
}

std::string route_of(const Expect& e) {
  auto rank = [](int r, int world) {
    std::string t = "rank " + std::to_string(r);
    if (world >= 0 && world != r) t += " (world rank " + std::to_string(world) + ")";
    return t;
  };
  return "from " + rank(e.sender, e.sender_world) + " to " + rank(e.receiver, e.receiver_world);
}

Header open_record(Aead& dec, const std::uint8_t* ciphertext, std::size_t ciphertext_bytes,
                   const std::uint8_t* trailer, std::size_t trailer_bytes, const Expect& e,
                   void* out, Reject* why) {
  auto reject = [&](Reject r) {
    if (why) *why = r;
  };
  auto from = [&] {  // built only for a rejection
    std::string f = "message " + std::to_string(e.sequence) + " " + route_of(e) + " (tag " +
                    std::to_string(e.tag) + ") on " + e.channel;
    if (e.records > 1)
      f += ", record " + std::to_string(e.record) + " of " + std::to_string(e.records);
    return f;
  };
  Header h;
  try {
    h = parse_trailer(trailer, trailer_bytes, ciphertext_bytes);
  } catch (const SecurityError& err) {
    reject(Reject::malformed);
    DT_THROW(SecurityError, "rejected ", from(), ": ", err.message());
  }
  if (h.length != e.length) {
    reject(Reject::malformed);
    DT_THROW(SecurityError, "rejected ", from(), ": ", h.length, " bytes where ", e.length,
             " were expected (truncated or altered)");
  }
  const auto nonce = nonce_of(h);
  if (!dec.open(nonce.data(), trailer, kHeaderBytes, ciphertext, h.length, out,
                trailer + kHeaderBytes)) {
    reject(Reject::authentication);
    DT_THROW(SecurityError, "rejected ", from(), " (sequence number ", h.sequence,
             " in its header): authentication failed; the message was altered, or sealed with "
             "another key (another job, channel or direction)");
  }
  // Authentic from here on: the header was sealed by the peer's key for this direction. A message
  // refused below (replayed, redirected, out of order) is genuine but not the one expected: its
  // plaintext is wiped before the refusal, so no stale data stays in the caller's buffer.
  struct Wipe {
    void* out;
    std::size_t n;
    bool keep = false;
    ~Wipe() {
      if (!keep) OPENSSL_cleanse(out, n);
    }
  } wipe{out, h.length};
  if (h.sender != static_cast<std::uint32_t>(e.sender) ||
      h.receiver != static_cast<std::uint32_t>(e.receiver) || h.tag != e.tag) {
    reject(Reject::redirected);
    DT_THROW(SecurityError, "rejected ", from(), ": it was sealed for rank ", h.sender, " -> ",
             h.receiver, " tag ", h.tag, " (redirected)");
  }
  if (h.sequence != e.sequence) {
    reject(Reject::sequence);
    DT_THROW(SecurityError, "rejected ", from(), ": it carries sequence number ", h.sequence,
             (h.sequence < e.sequence ? " (replayed)" : " (reordered or a message was dropped)"));
  }
  if (h.message_length != e.message_length || h.records != e.records) {
    reject(Reject::malformed);
    DT_THROW(SecurityError, "rejected ", from(), ": it is part of a message of ", h.message_length,
             " bytes in ", h.records, " records where ", e.message_length, " bytes in ", e.records,
             " were expected (truncated or altered)");
  }
  if (h.record != e.record) {
    reject(Reject::sequence);
    DT_THROW(SecurityError, "rejected ", from(), ": it is record ", h.record, " of ", h.records,
             " (records of the message dropped, repeated or reordered)");
  }
  wipe.keep = true;
  return h;
}

Header open_message(Aead& dec, const std::uint8_t* wire, std::size_t wire_bytes, const Expect& e,
                    void* out, Reject* why) {
  if (wire_bytes < kTrailerBytes) {
    // The trailer check names the short buffer.
    return open_record(dec, wire, 0, wire, wire_bytes, e, out, why);
  }
  const std::size_t n = wire_bytes - kTrailerBytes;
  return open_record(dec, wire, n, wire + n, kTrailerBytes, e, out, why);
}

}  // namespace dt::security
