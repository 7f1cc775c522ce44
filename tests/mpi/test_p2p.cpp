// test_p2p: the same point-to-point cases over every dt::make_p2p kind ("mpi", then "ucx"), at any
// rank count (run under 1, 2 and 4 ranks; at 1 rank every message goes from the rank to itself).
//
// Cases: sizes 0 B, 1 B, odd sizes up to 64 MiB (64 MiB around the ring) and every dtype's element
// size, from every rank to every rank (itself included); 256 messages in flight per pair; 64
// messages with one tag (must arrive in send order); tags received in the reverse order of the
// sends; a ring exchange over several rounds; blocking send/recv with and without a timeout;
// too-long and too-short messages (eager and rendezvous sizes, receive posted before and after the
// message arrives) fail the receive with dt::CommError and the run goes on; a receive nobody sends
// to times out in wait(50 ms) with a CommError naming it, stays pending and completes once the
// message is sent; a receive cancelled before its message is sent is withdrawn and the message
// goes to the next receive; bad peers and a bad kind are rejected. Over UCX also: a start-up that
// fails on one rank fails on all; an error unwinding through the communicator on one rank, whose
// peers wait on it, ends it within about 1 s rather than the 10 s an ordinary end may wait.
//
// Message contents are bytes derived from (source, destination, tag, index) by a hash computed
// independently on both sides, so a message delivered to the wrong buffer, in the wrong order or
// partly shows up as wrong bytes. Each failed check prints "rank R: FAIL <kind> <what>: <details>";
// rank 0 prints a summary and every rank exits 1 if any rank failed.
//
// Arguments: the kinds to run (default: mpi ucx). DT_TEST_VERBOSE=1 prints per-case times.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "check_harness.hpp"
#include "comm/ucx_p2p.hpp"
#include "dt/comm.hpp"
#include "dt/dtype.hpp"
#include "dt/error.hpp"
#include "dt/p2p.hpp"
#include "dt/runtime.hpp"
#include "dt/tensor.hpp"

namespace {

using dt::Comm;
using dt::CommOptions;
using dt::DType;
using dt::Millis;
using dt::P2p;
using dt::Work;
using Clock = std::chrono::steady_clock;
using namespace dt_test;

// ---- message contents -----------------------------------------------------------------------

std::uint64_t mix(std::uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
std::uint64_t word(int src, int dst, int tag, std::size_t w) {
  return mix(mix(mix(static_cast<std::uint64_t>(src) * 1000003u + static_cast<std::uint64_t>(dst)) ^
                 static_cast<std::uint64_t>(static_cast<std::uint32_t>(tag))) ^
             w);
}

// A message of `nbytes` from src to dst with tag; byte i is byte (i % 8) of word(i / 8).
std::vector<unsigned char> message(int src, int dst, int tag, std::size_t nbytes) {
  std::vector<unsigned char> v(nbytes);
  const std::size_t words = nbytes / 8;
  for (std::size_t w = 0; w < words; ++w) {
    const std::uint64_t x = word(src, dst, tag, w);
    std::memcpy(v.data() + 8 * w, &x, 8);
  }
  if (nbytes % 8) {
    const std::uint64_t x = word(src, dst, tag, words);
    std::memcpy(v.data() + 8 * words, &x, nbytes % 8);
  }
  return v;
}

bool expect_message(const std::string& what, const std::vector<unsigned char>& got, int src,
                    int dst, int tag) {
  const std::vector<unsigned char> want = message(src, dst, tag, got.size());
  if (got == want) return H.expect(true, what, "");
  std::size_t bad = 0, first = got.size();
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) {
      if (first == got.size()) first = i;
      ++bad;
    }
  return H.expect(false, what,
                  str(bad, " of ", got.size(), " bytes wrong, first at ", first, ": got ",
                      int(got[first]), ", expected ", int(want[first])));
}

// The receive buffer, pre-filled with a pattern that is never the expected message.
std::vector<unsigned char> recv_buffer(std::size_t nbytes) {
  return std::vector<unsigned char>(nbytes, 0xA5);
}

// A view of `bytes` as elements of `t` (bytes.size() must be a multiple of its size).
dt::TensorView as_view(std::vector<unsigned char>& bytes, DType t) {
  return {bytes.data(), bytes.size() / dt::dtype_size(t), t};
}
dt::ConstTensorView as_cview(const std::vector<unsigned char>& bytes, DType t) {
  return {bytes.data(), bytes.size() / dt::dtype_size(t), t};
}

constexpr Millis kCaseTimeout{30000};  // a lost message fails the case instead of hanging

// Waits for each Work; failures (and timeouts) are reported under `what`.
void wait_all(std::vector<Work>& ws, const std::string& what) {
  for (std::size_t k = 0; k < ws.size(); ++k) {
    try {
      ws[k].wait(kCaseTimeout);
    } catch (const std::exception& e) {
      H.fail(what, str("work ", k, ": ", e.what()));
    }
  }
}

// A message exchange: sends and receives posted in the given order, then all waited on.
struct Exchange {
  // Moving an inner vector keeps its storage, so the views handed to isend/irecv stay valid.
  std::vector<std::vector<unsigned char>> sbuf, rbuf;
  struct Recv {
    int src, tag;
  };
  std::vector<Recv> recvs;
  std::vector<Work> works;  // destroyed before the buffers

  void send(P2p& p, int dst, int tag, std::size_t nbytes, DType t = DType::u8) {
    sbuf.push_back(message(p.rank(), dst, tag, nbytes));
    works.push_back(p.isend(as_cview(sbuf.back(), t), dst, tag));
  }
  void recv(P2p& p, int src, int tag, std::size_t nbytes, DType t = DType::u8) {
    rbuf.push_back(recv_buffer(nbytes));
    recvs.push_back({src, tag});
    works.push_back(p.irecv(as_view(rbuf.back(), t), src, tag));
  }
  void finish(P2p& p, const std::string& what) {
    wait_all(works, what);
    for (std::size_t k = 0; k < rbuf.size(); ++k)
      expect_message(
          str(what, " (from ", recvs[k].src, ", tag ", recvs[k].tag, ", ", rbuf[k].size(), " B)"),
          rbuf[k], recvs[k].src, p.rank(), recvs[k].tag);
  }
};

// ---- cases ----------------------------------------------------------------------------------

// Every rank sends every size to every rank (itself included); 64 MiB goes around the ring.
void check_sizes(P2p& p) {
  const int n = p.size(), r = p.rank();
  const std::size_t sizes[] = {0, 1, 3, 8, 4095, 65537, (std::size_t{1} << 20) + 3};
  Exchange x;
  int tag = 1000;
  for (std::size_t s : sizes) {
    for (int peer = 0; peer < n; ++peer) x.recv(p, peer, tag, s);
    for (int peer = 0; peer < n; ++peer) x.send(p, peer, tag, s);
    ++tag;
  }
  for (DType t : dt::kAllDTypes) {
    for (std::size_t elems : {std::size_t{1}, std::size_t{13}, std::size_t{4099}}) {
      const std::size_t s = elems * dt::dtype_size(t);
      for (int peer = 0; peer < n; ++peer) x.recv(p, peer, tag, s, t);
      for (int peer = 0; peer < n; ++peer) x.send(p, peer, tag, s, t);
      ++tag;
    }
  }
  const std::size_t big = std::size_t{64} << 20;
  x.recv(p, (r + n - 1) % n, tag, big, DType::f32);
  x.send(p, (r + 1) % n, tag, big, DType::f32);
  x.finish(p, "sizes");
}

// 256 messages in flight per pair (to the next and from the previous rank), of varying sizes.
void check_many_outstanding(P2p& p) {
  const int n = p.size(), r = p.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  Exchange x;
  for (int k = 0; k < 256; ++k) x.recv(p, prev, 2000 + k, static_cast<std::size_t>(k * 37 % 1001));
  for (int k = 0; k < 256; ++k) x.send(p, next, 2000 + k, static_cast<std::size_t>(k * 37 % 1001));
  x.finish(p, "256 outstanding");
}

// 64 messages with the same tag and growing sizes (k + 1 f32) must match in send order: a
// mismatch shows up as a length error or wrong contents (the contents encode the sequence number
// through the size, since message() is a prefix-stable function of the index).
void check_same_tag_order(P2p& p) {
  const int n = p.size(), r = p.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  Exchange x;
  for (int k = 0; k < 64; ++k) x.send(p, next, 3000, static_cast<std::size_t>(4 * (k + 1)));
  for (int k = 0; k < 64; ++k) x.recv(p, prev, 3000, static_cast<std::size_t>(4 * (k + 1)));
  x.finish(p, "same-tag order");
  // Sizes alone do not tell the order of equally sized messages: here each message carries its
  // sequence number in its first 4 bytes.
  std::vector<std::int32_t> out(32), in(32, -1);
  std::vector<Work> ws;
  for (std::int32_t k = 0; k < 32; ++k) {
    out[k] = k;
    ws.push_back(p.isend(dt::view_of(&out[k], 1), next, 3001));
  }
  for (std::size_t k = 0; k < 32; ++k) ws.push_back(p.irecv(dt::view_of(&in[k], 1), prev, 3001));
  wait_all(ws, "same-tag order (sequence numbers)");
  for (std::int32_t k = 0; k < 32; ++k)
    H.expect(in[k] == k, "same-tag order (sequence numbers)",
             str("receive ", k, " got message ", in[k]));
}

// The receiver posts tags in the reverse order of the sends, eager and rendezvous sizes mixed.
void check_reverse_tags(P2p& p) {
  const int n = p.size(), r = p.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  auto size_of = [](int t) {
    return t % 4 == 0 ? std::size_t{300001} : static_cast<std::size_t>(t * 10 + 1);
  };
  Exchange x;
  for (int t = 0; t < 32; ++t) x.send(p, next, 4000 + t, size_of(t));
  for (int t = 31; t >= 0; --t) x.recv(p, prev, 4000 + t, size_of(t));
  std::reverse(x.works.begin(), x.works.end());  // wait on the receives first
  x.finish(p, "reverse tags");
}

// A value goes around the ring `rounds` times; every rank adds its rank each time.
void check_ring(P2p& p) {
  const int n = p.size(), r = p.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  constexpr int kRounds = 8;
  std::int64_t token = r == 0 ? 1000 : 0;
  for (int k = 0; k < kRounds * n; ++k) {
    // In step k, the rank (k % n) holds the token and passes it on after adding its rank.
    const int holder = k % n;
    if (holder == r) {
      token += r;
      Exchange x;
      x.send(p, next, 5000 + k, 4096 + static_cast<std::size_t>(k));
      std::vector<Work> ws;
      ws.push_back(p.isend(dt::view_of(&token, 1), next, 5500 + k));
      if (next == r) {  // one rank: the token comes straight back
        std::int64_t back = -1;
        ws.push_back(p.irecv(dt::view_of(&back, 1), prev, 5500 + k));
        x.recv(p, prev, 5000 + k, 4096 + static_cast<std::size_t>(k));
        wait_all(ws, "ring token");
        token = back;
      } else {
        wait_all(ws, "ring token");
      }
      x.finish(p, "ring payload");
    } else if ((holder + 1) % n == r) {
      Exchange x;
      x.recv(p, prev, 5000 + k, 4096 + static_cast<std::size_t>(k));
      std::vector<Work> ws;
      ws.push_back(p.irecv(dt::view_of(&token, 1), prev, 5500 + k));
      wait_all(ws, "ring token");
      x.finish(p, "ring payload");
    }
  }
  // Rank 0 ends holding the token after the last step's holder (n - 1) passed it on.
  if (r == 0)
    H.expect(token == 1000 + static_cast<std::int64_t>(kRounds) * n * (n - 1) / 2, "ring token",
             str("got ", token, ", expected ", 1000 + kRounds * n * (n - 1) / 2));
}

// Blocking send/recv (defaults of dt::P2p) between pairs (0,1), (2,3), ...; with and without a
// timeout. Skipped at odd rank counts for the last rank, and at 1 rank.
void check_blocking(P2p& p, Comm& world) {
  const int n = p.size(), r = p.rank();
  const int partner = r ^ 1;
  if (partner < n) {
    for (std::size_t s : {std::size_t{5}, std::size_t{1} << 20}) {
      for (bool timed : {false, true}) {
        CommOptions o;
        if (timed) o.timeout = Millis(20000);
        const int tag = 6000 + (timed ? 1 : 0) + (s > 5 ? 2 : 0);
        std::vector<unsigned char> out = message(r, partner, tag, s), in = recv_buffer(s);
        const std::string what = str("blocking", timed ? "+timeout" : "", " ", s, " B");
        guarded(what, [&] {
          if (r % 2 == 0) {
            p.send(as_cview(out, DType::u8), partner, tag, o);
            p.recv(as_view(in, DType::u8), partner, tag, o);
          } else {
            p.recv(as_view(in, DType::u8), partner, tag, o);
            p.send(as_cview(out, DType::u8), partner, tag, o);
          }
          expect_message(what, in, partner, r, tag);
        });
      }
    }
  }
  world.barrier();
}

// Too-long and too-short messages fail the receive with CommError; the sender completes and the
// next message between the same pair goes through.
void check_length_errors(P2p& p, Comm& world) {
  const int n = p.size(), r = p.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  struct Case {
    std::size_t sent, expected;
    bool long_msg;
  };
  const Case cases[] = {{100, 64, true}, {64, 100, false},         {1, 0, true},
                        {0, 1, false},   {1 << 20, 1 << 19, true}, {1 << 19, 1 << 20, false}};
  int tag = 7000;
  for (const Case& c : cases) {
    for (bool posted_first : {true, false}) {
      const std::string what =
          str(c.long_msg ? "too-long" : "too-short", " message (", c.sent, " B into ", c.expected,
              " B, receive posted ", posted_first ? "first" : "after the send", ")");
      if (H.prefix == "mpi" && c.long_msg && c.sent > (1 << 16)) {
        // Open MPI 4.1's shared-memory single-copy path (vader + CMA) copies a truncated
        // rendezvous message in full, past the end of the receive buffer: heap corruption in
        // this process, not a CommError. Only the UCX path is checked at this size.
        if (r == 0 && posted_first)
          std::printf("note: %s not checked on mpi (Open MPI writes past the buffer)\n",
                      what.c_str());
        world.barrier();
        continue;
      }
      if (H.prefix == "mpi" && c.long_msg && posted_first && prev == r && c.expected > 0) {
        // Open MPI 4.1 delivers a too-long message from a rank to itself into an already posted
        // receive silently truncated (MPI_Test succeeds, the count is the buffer's).
        if (r == 0)
          std::printf("note: %s not checked on mpi at 1 rank (Open MPI truncates silently)\n",
                      what.c_str());
        world.barrier();
        continue;
      }
      // The receive buffer is followed by a guard zone the size of the message.
      std::vector<unsigned char> out = message(r, next, tag, c.sent),
                                 in = recv_buffer(c.expected + c.sent);
      const dt::TensorView rv{in.data(), c.expected, DType::u8};
      Work rw, sw;
      guarded(what, [&] {
        if (posted_first) {
          rw = p.irecv(rv, prev, tag);
          world.barrier();
          sw = p.isend(as_cview(out, DType::u8), next, tag);
        } else {
          sw = p.isend(as_cview(out, DType::u8), next, tag);
          world.barrier();
          rw = p.irecv(rv, prev, tag);
        }
        expect_throw<dt::CommError>(what, [&] { rw.wait(kCaseTimeout); },
                                    {str("from ", prev, ", tag ", tag), "recv"});
        // The stored error comes back on every later call.
        expect_throw<dt::CommError>(what + ", test() after the failure", [&] { rw.test(); });
        sw.wait(kCaseTimeout);
        std::size_t past = 0;
        for (std::size_t i = c.expected; i < in.size(); ++i) past += in[i] != 0xA5;
        H.expect(past == 0, what, str(past, " bytes written past the end of the receive buffer"));
      });
      world.barrier();
      // The pair still works.
      Exchange x;
      x.recv(p, prev, tag + 1, 33);
      x.send(p, next, tag + 1, 33);
      x.finish(p, what + ", next message");
      tag += 2;
      world.barrier();
    }
  }
}

// A receive nobody sends to: wait(50 ms) throws CommError naming the op, rank and timeout; it stays
// pending and completes once the message is sent.
void check_timeout(P2p& p, Comm& world) {
  const int n = p.size(), r = p.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  const int tag = 8000;
  std::vector<unsigned char> in = recv_buffer(1000), out = message(r, next, tag, 1000);
  Work rw = p.irecv(as_view(in, DType::u8), prev, tag);
  const auto t0 = Clock::now();
  expect_throw<dt::CommError>(
      "wait(50 ms) on a receive nobody sent to", [&] { rw.wait(Millis(50)); },
      {"timed out after 50 ms", str("rank ", r), "recv", str("from ", prev, ", tag ", tag)});
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  H.expect(ms >= 45 && ms < 5000, "wait(50 ms) duration", str(ms, " ms"));
  guarded("test() while pending", [&] {
    H.expect(!rw.test(), "test() while pending", "returned true before the message was sent");
  });
  world.barrier();
  guarded("timed-out receive completes", [&] {
    Work sw = p.isend(as_cview(out, DType::u8), next, tag);
    rw.wait(kCaseTimeout);
    sw.wait(kCaseTimeout);
    expect_message("timed-out receive completes", in, prev, r, tag);
  });
  world.barrier();
}

// Work::cancel: a receive nobody has sent to yet is withdrawn (true); its wait() and test() then
// throw CommError; the message sent afterwards goes to the next receive posted, and the withdrawn
// buffer stays untouched. A finished receive stays finished, and an empty Work is nothing to
// cancel.
void check_cancel(P2p& p, Comm& world) {
  const int n = p.size(), r = p.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  const int tag = 8100;
  for (std::size_t bytes : {std::size_t{100}, std::size_t{1} << 20}) {  // eager, rendezvous
    const std::string w = str(bytes, " B");
    std::vector<unsigned char> first = recv_buffer(bytes), second = recv_buffer(bytes);
    const std::vector<unsigned char> out = message(r, next, tag, bytes);
    Work r1 = p.irecv(as_view(first, DType::u8), prev, tag);
    bool cancelled = false;
    guarded(str("cancel of a pending receive, ", w), [&] { cancelled = r1.cancel(Millis(1000)); });
    H.expect(cancelled, str("cancel of a pending receive, ", w), "returned false");
    expect_throw<dt::CommError>(str("wait() after cancel, ", w), [&] { r1.wait(kCaseTimeout); },
                                {"cancelled"});
    expect_throw<dt::CommError>(str("test() after cancel, ", w), [&] { (void)r1.test(); },
                                {"cancelled"});
    world.barrier();
    guarded(str("the message after a cancel, ", w), [&] {
      Work sw = p.isend(as_cview(out, DType::u8), next, tag);
      Work r2 = p.irecv(as_view(second, DType::u8), prev, tag);
      r2.wait(kCaseTimeout);
      sw.wait(kCaseTimeout);
      expect_message(str("the message after a cancel goes to the next receive, ", w), second, prev,
                     r, tag);
      H.expect(first == recv_buffer(bytes), str("a cancelled receive's buffer, ", w),
               "was written");
      H.expect(r2.cancel(Millis(10)) && r2.test(), str("cancel of a finished receive, ", w),
               "it did not stay finished");
    });
    world.barrier();
  }
  H.expect(Work().cancel(), "cancel of an empty Work", "returned false");
}

// Completion by polling test() instead of wait().
void check_test_polling(P2p& p) {
  const int n = p.size(), r = p.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  Exchange x;
  for (int k = 0; k < 8; ++k) x.recv(p, prev, 9000 + k, static_cast<std::size_t>(k) << 15);
  for (int k = 0; k < 8; ++k) x.send(p, next, 9000 + k, static_cast<std::size_t>(k) << 15);
  const auto deadline = Clock::now() + kCaseTimeout;
  std::vector<bool> done(x.works.size(), false);
  for (bool all = false; !all && Clock::now() < deadline;) {
    all = true;
    for (std::size_t k = 0; k < x.works.size(); ++k) {
      if (!done[k]) done[k] = x.works[k].test();
      all = all && done[k];
    }
    if (!all) std::this_thread::yield();
  }
  for (std::size_t k = 0; k < done.size(); ++k)
    H.expect(done[k], "completion by test()", str("work ", k, " not done after 30 s"));
  x.finish(p, "completion by test()");
}

void check_arguments(P2p& p) {
  std::vector<float> b(4);
  expect_throw<dt::InvalidArgument>("isend to rank size()",
                                    [&] { p.isend(dt::view_of(b), p.size(), 1); },
                                    {str("peer ", p.size())});
  expect_throw<dt::InvalidArgument>("irecv from rank -1", [&] { p.irecv(dt::view_of(b), -1, 1); },
                                    {"peer -1"});
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

}  // namespace

// UCX that cannot start on one rank (no transport it is allowed to use: a real ucp_init failure)
// fails make_p2p on every rank, with that rank's error there and its number on the others, and
// leaves no rank waiting in the start-up's collectives (which would end in the alarm).
void check_ucx_start_fails_on_one(Comm& world) {
  if (world.size() < 2) return;
  const int bad = world.size() - 1;
  const char* old = std::getenv("UCX_TLS");
  const std::string saved = old ? old : "";
  if (world.rank() == bad) setenv("UCX_TLS", "no-such-transport", 1);
  if (world.rank() == bad)
    expect_throw<dt::CommError>("UCX start-up failing here", [&] { dt::make_p2p("ucx", world); },
                                {"ucp_init failed on rank " + std::to_string(bad)});
  else
    expect_throw<dt::CommError>("UCX start-up failing on another rank",
                                [&] { dt::make_p2p("ucx", world); },
                                {"rank " + std::to_string(bad) + " could not start UCX"});
  if (world.rank() == bad) {
    if (old)
      setenv("UCX_TLS", saved.c_str(), 1);
    else
      unsetenv("UCX_TLS");
  }
  world.barrier();
}

// An error that unwinds through a UCX point-to-point on one rank only, while the others wait on a
// message from it (as a job's ranks do when one rejects a message): that rank's end of the
// communicator waits about 1 s for peers that will never close theirs, not the 10 s of an
// ordinary end, so the error reaches its handler (which would end the job) at once. The others
// then hear of it over MPI, withdraw their receive and end theirs, which never throws.
void check_ucx_unwinding_on_one(Comm& world) {
  if (world.size() < 2) return;
  const int bad = world.size() - 1, me = world.rank();
  constexpr int kTag = 8200, kPastTag = 8201;
  std::unique_ptr<P2p> p;
  guarded("make_p2p", [&] { p = dt::make_p2p("ucx", world); });
  if (!p) return;
  std::vector<unsigned char> in = recv_buffer(100);
  if (me == bad) {
    double ms = -1;
    auto t0 = Clock::now();
    try {
      const std::unique_ptr<P2p> q = std::move(p);
      Work rw = q->irecv(as_view(in, DType::u8), 0, kTag);  // nobody sends: pending at the end
      t0 = Clock::now();
      throw std::runtime_error("an error on this rank only");
    } catch (const std::runtime_error&) {
      ms = ms_since(t0);
    }
    H.expect(ms >= 0 && ms < 5000, "the end of a communicator an error unwinds through",
             str(ms, " ms (an ordinary end waits for its peers up to 10 s)"));
    int past = 1;
    for (int r = 0; r < world.size(); ++r)
      if (r != bad) MPI_Send(&past, 1, MPI_INT, r, kPastTag, MPI_COMM_WORLD);
  } else {
    Work rw = p->irecv(as_view(in, DType::u8), bad, kTag);
    bool heard = false, early = false;
    for (const auto deadline = Clock::now() + kCaseTimeout; !heard && Clock::now() < deadline;) {
      guarded("the receive from the failing rank", [&] { early = early || rw.test(); });
      int flag = 0;
      MPI_Iprobe(bad, kPastTag, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
      if (flag) {
        int past = 0;
        MPI_Recv(&past, 1, MPI_INT, bad, kPastTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        heard = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    H.expect(heard, "word from the failing rank", "none after 30 s");
    H.expect(!early, "the receive from the failing rank", "completed, though nothing was sent");
    bool withdrawn = false;
    guarded("cancel of the receive", [&] { withdrawn = rw.cancel(Millis(1000)); });
    H.expect(withdrawn, "cancel of the receive from the failing rank", "returned false");
    const auto t0 = Clock::now();
    p.reset();
    H.expect(ms_since(t0) < 15000, "the end of a communicator whose peer has gone",
             str(ms_since(t0), " ms"));
  }
  world.barrier();
}

int main(int argc, char** argv) {
  alarm(240);  // a hang must not outlive the test: SIGALRM ends this rank, mpiexec the others
  const auto t_start = Clock::now();
  int rc = 0;
  {
    dt::Runtime rt(&argc, &argv);
    Comm& world = rt.world();
    H.rank = world.rank();
    const bool verbose = std::getenv("DT_TEST_VERBOSE") != nullptr;
    std::vector<std::string> kinds;
    for (int i = 1; i < argc; ++i) kinds.emplace_back(argv[i]);
    if (kinds.empty()) kinds = {"mpi", "ucx"};

    H.prefix = "make_p2p";
    expect_throw<dt::ConfigError>("make_p2p(\"tcp\")", [&] { dt::make_p2p("tcp", world); },
                                  {"comm.p2p", "'tcp'", "mpi, ucx"});
    H.expect(dt::UcxP2p::wire_tag(3, -1) == 0x00000003FFFFFFFFull, "wire tag",
             "(3, -1) is not 0x00000003ffffffff");

    for (const std::string& kind : kinds) {
      H.prefix = kind;
      std::unique_ptr<P2p> p;
      guarded("make_p2p", [&] { p = dt::make_p2p(kind, world); });
      if (!p) continue;
      H.expect(contains(p->name(), kind == "mpi" ? "p2p" : "ucx"), "name", p->name());
      H.expect(p->rank() == world.rank() && p->size() == world.size(), "rank and size",
               str(p->rank(), "/", p->size()));
      auto step = [&](const char* name, auto&& f) {
        const auto t0 = Clock::now();
        guarded(name, f);
        world.barrier();
        if (verbose && H.rank == 0)
          std::printf("%s %-24s %8.0f ms\n", kind.c_str(), name, ms_since(t0));
        std::fflush(stdout);
      };
      step("sizes", [&] { check_sizes(*p); });
      step("256 outstanding", [&] { check_many_outstanding(*p); });
      step("same-tag order", [&] { check_same_tag_order(*p); });
      step("reverse tags", [&] { check_reverse_tags(*p); });
      step("ring", [&] { check_ring(*p); });
      step("blocking", [&] { check_blocking(*p, world); });
      step("length errors", [&] { check_length_errors(*p, world); });
      step("timeout", [&] { check_timeout(*p, world); });
      step("cancel", [&] { check_cancel(*p, world); });
      step("test() polling", [&] { check_test_polling(*p); });
      step("arguments", [&] { check_arguments(*p); });
      const auto t0 = Clock::now();
      p.reset();  // collective for ucx: closes endpoints, fences
      if (verbose && H.rank == 0)
        std::printf("%s %-24s %8.0f ms\n", kind.c_str(), "close", ms_since(t0));
      if (kind == "ucx") {
        check_ucx_start_fails_on_one(world);
        H.prefix = "ucx unwinding";
        check_ucx_unwinding_on_one(world);
      }
    }

    rc = H.finish("test_p2p", ms_since(t_start) / 1000);
  }
  return rc;
}
