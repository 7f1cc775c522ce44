// test_sealed: sealed point-to-point and sealed collectives under mpiexec, against references
// computed here from known per-rank inputs (small integers, so every sum is exact in every dtype).
//
//   test_sealed p2p mpi|ucx [noshm]   sealed send/recv over make_p2p(kind): ring and pairs, every
//                                     dtype, sizes 0..1M+3, blocking and non-blocking forms, with
//                                     the default records (256 KiB) and with 4 KiB records (many
//                                     per message, the last one shorter); a message sealed under
//                                     another job's key is rejected. Same-node peers go through
//                                     the shared-memory mailboxes (checked), which are also tested
//                                     on their own: byte-exact data at sizes around the record
//                                     boundaries and past the mailbox's size, many messages on
//                                     several tags both ways at once, messages sent before their
//                                     receive is posted, a send completed while its sender waits
//                                     elsewhere, a peer that goes away; a rejected message breaks
//                                     the channel (pending and later receives from its sender
//                                     fail, no buffer keeps any of the plaintext), through the
//                                     mailboxes and the transport. "noshm": the transport only
//   test_sealed coll mpi|ucx [exempt|nodes2|noshm]
//                                     every collective x dtype x op, odd sizes, all forms, on the
//                                     world and a split; "exempt": same-node traffic unsealed;
//                                     "nodes2": two simulated nodes, same-node traffic unsealed;
//                                     "noshm": sealed traffic through the transport only
//   test_sealed tamper p2p|coll mpi|ucx flip:N|replay:N|reorder:N|drop-record:N|swap-records:N
//               [noshm]               rank 0 damages its own N-th sealed message (p2p: messages of
//                                     4 records of 4 KiB); the receiving rank must reject it with
//                                     dt::SecurityError and abort the job (the test passes when
//                                     the job ends non-zero, naming it); p2p checks that the
//                                     messages take the path asked for (mailboxes by default)
// Each failed check prints "rank R: FAIL <what>: <details>"; rank 0 prints a summary.
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../mpi/check_harness.hpp"
#include "comm/mpi_comm.hpp"
#include "dt/comm.hpp"
#include "dt/dtype.hpp"
#include "dt/error.hpp"
#include "dt/metrics.hpp"
#include "dt/p2p.hpp"
#include "dt/security.hpp"
#include "dt/tensor.hpp"
#include "security/sealed_p2p.hpp"

namespace {

using dt::Comm;
using dt::CommOptions;
using dt::DType;
using dt::Millis;
using dt::ReduceOp;
using dt::Work;
namespace sec = dt::security;
using namespace dt_test;

template <class T>
constexpr bool is16 = std::is_same_v<T, dt::bf16> || std::is_same_v<T, dt::f16>;

int gen(int r, std::size_t i, std::uint32_t salt, bool nonneg) {
  std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u ^
                    (static_cast<std::uint32_t>(r + 1) * 0x9E3779B9u + salt * 0x85EBCA6Bu);
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  x ^= x >> 12;
  x *= 0x297A2D39u;
  x ^= x >> 15;
  const int v = static_cast<int>(x % 41u);
  return nonneg ? v : v - 20;
}
template <class T>
int genv(int r, std::size_t i, std::uint32_t salt) {
  return gen(r, i, salt, std::is_same_v<T, std::uint8_t>);
}
template <class T>
T enc(double v) {
  if constexpr (is16<T>)
    return T(static_cast<float>(v));
  else
    return static_cast<T>(v);
}
template <class T>
double dec(T v) {
  if constexpr (is16<T>)
    return static_cast<double>(static_cast<float>(v));
  else
    return static_cast<double>(v);
}
double round_mantissa(double x, int mant) {
  if (x == 0 || !std::isfinite(x)) return x;
  int e = 0;
  std::frexp(x, &e);
  const double ulp = std::ldexp(1.0, e - 1 - mant);
  return std::nearbyint(x / ulp) * ulp;
}
template <class T>
double avg_ref(std::int64_t sum, int n) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<double>(sum / n);
  } else if constexpr (std::is_same_v<T, double>) {
    return static_cast<double>(sum) / static_cast<double>(n);
  } else {
    const float q = static_cast<float>(sum) / static_cast<float>(n);
    if constexpr (std::is_same_v<T, float>) return q;
    if constexpr (std::is_same_v<T, dt::bf16>) return round_mantissa(q, 7);
    return round_mantissa(q, 10);
  }
}
template <class T, class V>
double reduce_ref(ReduceOp op, int n, V&& value) {
  std::int64_t s = 0, mx = INT64_MIN, mn = INT64_MAX;
  for (int r = 0; r < n; ++r) {
    const std::int64_t v = value(r);
    s += v;
    mx = std::max(mx, v);
    mn = std::min(mn, v);
  }
  switch (op) {
    case ReduceOp::sum:
      return static_cast<double>(s);
    case ReduceOp::max:
      return static_cast<double>(mx);
    case ReduceOp::min:
      return static_cast<double>(mn);
    case ReduceOp::avg:
      return avg_ref<T>(s, n);
  }
  return 0;
}
template <class T, class Ref>
bool expect_buf(const std::string& what, const T* got, std::size_t n, Ref&& ref) {
  std::size_t bad = 0, first = 0;
  double fg = 0, fe = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double e = ref(i), g = dec(got[i]);
    if (!(g == e)) {
      if (bad++ == 0) {
        first = i;
        fg = g;
        fe = e;
      }
    }
  }
  return H.expect(bad == 0, what,
                  str(bad, " of ", n, " wrong; first at ", first, ": got ", fg, ", expected ", fe));
}
template <class T>
std::vector<T> filled(std::size_t n, int r, std::uint32_t salt) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = enc<T>(genv<T>(r, i, salt));
  return v;
}
template <class F>
void for_each_dtype(F&& f) {
  int k = 0;
  for (DType t : dt::kAllDTypes) {
    dt::visit_dtype(t, [&](auto z) { f(z, k); });
    ++k;
  }
}

constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};
// Odd sizes: fewer elements than ranks, not divisible by any rank count, several segments.
constexpr std::size_t kSizes[] = {0, 1, 7, 65537, (std::size_t{1} << 20) + 3};
constexpr std::size_t kBig = 65537;

std::uint32_t salt_of(int a, int b, int c, int d) {
  return static_cast<std::uint32_t>(((a * 31 + b) * 31 + c) * 31 + d);
}

// ---- collectives ----------------------------------------------------------------------------

void suite_collectives(Comm& c, int id) {
  const int s = c.size(), me = c.rank();
  for_each_dtype([&](auto z, int dk) {
    using T = decltype(z);
    const char* tn = dt::dtype_name(dt::dtype_v<T>);
    for (std::size_t n : kSizes)
      for (int fk = 0; fk < kFormCount; ++fk) {
        const Form f = kForms[fk];
        // The largest size with one rotating form per dtype, to bound the run time.
        if (n > kBig && fk != dk % kFormCount) continue;
        for (int ok = 0; ok < 4; ++ok) {
          const ReduceOp op = kOps[ok];
          if (n > kBig && ok != (dk + fk) % 4) continue;
          const std::uint32_t salt = salt_of(id, dk, static_cast<int>(n % 1000), fk * 4 + ok);
          const std::string w = str("all_reduce(", tn, " x ", n, ", ", dt::reduce_op_name(op), ", ",
                                    form_name(f), ") on ", c.name());
          guarded(w, [&] {
            std::vector<T> buf = filled<T>(n, me, salt);
            run_form(
                f, [&](const CommOptions& o) { c.all_reduce(dt::view_of(buf), op, o); },
                [&] { return c.iall_reduce(dt::view_of(buf), op); });
            expect_buf(w, buf.data(), n, [&](std::size_t i) {
              return reduce_ref<T>(op, s, [&](int r) { return genv<T>(r, i, salt); });
            });
          });
          const std::size_t bn = n / static_cast<std::size_t>(s) + (n % 2);  // block per rank
          const std::string w2 = str("reduce_scatter(", tn, " x ", bn, " per rank, ",
                                     dt::reduce_op_name(op), ", ", form_name(f), ") on ", c.name());
          guarded(w2, [&] {
            const std::vector<T> in = filled<T>(bn * static_cast<std::size_t>(s), me, salt + 1);
            std::vector<T> out(bn, enc<T>(77));
            run_form(
                f,
                [&](const CommOptions& o) {
                  c.reduce_scatter(dt::view_of(in), dt::view_of(out), op, o);
                },
                [&] { return c.ireduce_scatter(dt::view_of(in), dt::view_of(out), op); });
            expect_buf(w2, out.data(), bn, [&](std::size_t i) {
              return reduce_ref<T>(op, s, [&](int r) {
                return genv<T>(r, static_cast<std::size_t>(me) * bn + i, salt + 1);
              });
            });
          });
        }
        const std::uint32_t salt = salt_of(id + 1, dk, static_cast<int>(n % 1000), fk);
        for (int root = 0; root < s; ++root) {
          if (n > kBig && root != s - 1) continue;
          const std::string w = str("broadcast(", tn, " x ", n, ", root ", root, ", ", form_name(f),
                                    ") on ", c.name());
          guarded(w, [&] {
            std::vector<T> buf = filled<T>(n, me == root ? root : 1000 + me, salt);
            run_form(
                f, [&](const CommOptions& o) { c.broadcast(dt::view_of(buf), root, o); },
                [&] { return c.ibroadcast(dt::view_of(buf), root); });
            expect_buf(w, buf.data(), n, [&](std::size_t i) { return genv<T>(root, i, salt); });
          });
        }
        const std::size_t gn = n > kBig ? n / static_cast<std::size_t>(s) : n;
        for (int ip = 0; ip < 2; ++ip) {
          const std::string w = str("all_gather(", tn, " x ", gn, ip ? ", in place, " : ", ",
                                    form_name(f), ") on ", c.name());
          guarded(w, [&] {
            std::vector<T> out(gn * static_cast<std::size_t>(s), enc<T>(77));
            std::vector<T> in = filled<T>(gn, me, salt + 2);
            dt::ConstTensorView inv = dt::view_of(static_cast<const std::vector<T>&>(in));
            if (ip) {
              std::copy(in.begin(), in.end(), out.begin() + static_cast<std::ptrdiff_t>(me * gn));
              inv = dt::view_of(static_cast<const T*>(out.data() + me * gn), gn);
            }
            run_form(
                f, [&](const CommOptions& o) { c.all_gather(inv, dt::view_of(out), o); },
                [&] { return c.iall_gather(inv, dt::view_of(out)); });
            expect_buf(w, out.data(), out.size(), [&](std::size_t j) {
              return genv<T>(static_cast<int>(j / gn), j % gn, salt + 2);
            });
          });
        }
      }
  });
  // Barrier: rank 0 arrives 200 ms late; nobody leaves before.
  for (Form f : kForms) {
    const std::string w = str("barrier(", form_name(f), ") on ", c.name());
    guarded(w, [&] {
      c.barrier();
      if (me == 0 && s > 1) std::this_thread::sleep_for(Millis(200));
      const std::int64_t entered = monotonic_ns();
      run_form(
          f, [&](const CommOptions& o) { c.barrier(o); }, [&] { return c.ibarrier(); });
      const std::int64_t left = monotonic_ns();
      expect_left_after_rank0(c, entered, left, w);
    });
  }
  // Several outstanding, completed in reverse order.
  guarded("outstanding on " + c.name(), [&] {
    std::vector<float> a = filled<float>(1000, me, 11);
    std::vector<std::int32_t> b = filled<std::int32_t>(33, me == 0 ? 0 : 500 + me, 12);
    std::vector<double> g(5 * static_cast<std::size_t>(s));
    const std::vector<double> gin = filled<double>(5, me, 13);
    Work w1 = c.iall_reduce(dt::view_of(a), ReduceOp::sum);
    Work w2 = c.ibroadcast(dt::view_of(b), 0);
    Work w3 = c.iall_gather(dt::view_of(gin), dt::view_of(g));
    Work w4 = c.ibarrier();
    for (Work* w : {&w4, &w3, &w2, &w1}) w->wait();
    expect_buf("outstanding all_reduce", a.data(), a.size(), [&](std::size_t i) {
      return reduce_ref<float>(ReduceOp::sum, s, [&](int r) { return genv<float>(r, i, 11); });
    });
    expect_buf("outstanding broadcast", b.data(), b.size(),
               [&](std::size_t i) { return genv<std::int32_t>(0, i, 12); });
    expect_buf("outstanding all_gather", g.data(), g.size(),
               [&](std::size_t j) { return genv<double>(static_cast<int>(j / 5), j % 5, 13); });
  });
  // Sealed send/recv through the communicator: a ring.
  guarded("send/recv ring on " + c.name(), [&] {
    const int next = (me + 1) % s, prev = (me + s - 1) % s;
    const std::vector<std::int64_t> out = filled<std::int64_t>(1001, me, 14);
    std::vector<std::int64_t> in(1001, 77);
    Work r = c.irecv(dt::view_of(in), prev, 5);
    Work w = c.isend(dt::view_of(out), next, 5);
    r.wait();
    w.wait();
    expect_buf("ring", in.data(), in.size(),
               [&](std::size_t i) { return genv<std::int64_t>(prev, i, 14); });
  });
  // Argument checks throw before any traffic.
  std::vector<float> x(3), bad(3 * static_cast<std::size_t>(s) + 1);
  expect_throw<dt::InvalidArgument>("all_gather output size on " + c.name(), [&] {
    c.all_gather(dt::view_of(static_cast<const std::vector<float>&>(x)), dt::view_of(bad));
  });
  expect_throw<dt::InvalidArgument>("reduce_scatter input size on " + c.name(), [&] {
    c.reduce_scatter(dt::view_of(static_cast<const std::vector<float>&>(bad)), dt::view_of(x),
                     ReduceOp::sum);
  });
  expect_throw<dt::InvalidArgument>("broadcast root on " + c.name(),
                                    [&] { c.broadcast(dt::view_of(x), s); }, {"root"});
  expect_throw<dt::InvalidArgument>("reserved tag on " + c.name(),
                                    [&] { c.send(dt::view_of(x), 0, sec::kReservedTagBase); });
}

// ---- point-to-point -------------------------------------------------------------------------

void suite_p2p(dt::P2p& p, int id) {
  const int s = p.size(), me = p.rank();
  const int next = (me + 1) % s, prev = (me + s - 1) % s;
  for_each_dtype([&](auto z, int dk) {
    using T = decltype(z);
    for (std::size_t n : kSizes)
      for (int fk = 0; fk < kFormCount; ++fk) {
        if (n > kBig && fk != dk % kFormCount) continue;
        const Form f = kForms[fk];
        const std::uint32_t salt = salt_of(id, dk, static_cast<int>(n % 1000), fk);
        const int tag = 100 + dk * 10 + fk;
        const std::string w = str("sealed ring(", dt::dtype_name(dt::dtype_v<T>), " x ", n, ", ",
                                  form_name(f), ") on ", p.name());
        guarded(w, [&] {
          const std::vector<T> out = filled<T>(n, me, salt);
          std::vector<T> in(n, enc<T>(77));
          if (nonblocking(f) || s == 1) {
            Work r = p.irecv(dt::view_of(in), prev, tag);
            Work sw = p.isend(dt::view_of(out), next, tag);
            complete(f, {&r, &sw});
          } else {
            const CommOptions o = opts_for(f);
            if (me % 2 == 0) {
              p.send(dt::view_of(out), next, tag, o);
              p.recv(dt::view_of(in), prev, tag, o);
            } else {
              p.recv(dt::view_of(in), prev, tag, o);
              p.send(dt::view_of(out), next, tag, o);
            }
          }
          expect_buf(w, in.data(), n, [&](std::size_t i) { return genv<T>(prev, i, salt); });
        });
      }
  });
  // Several messages on two tags, received in the other tag order (matching is by tag; the
  // sequence numbers are per tag).
  if (s >= 2 && me <= 1) {
    guarded("two tags crossed on " + p.name(), [&] {
      const int peer = 1 - me;
      std::vector<std::vector<float>> got(6, std::vector<float>(100, 77));
      std::vector<Work> ws;
      if (me == 0) {
        std::vector<std::vector<float>> msgs;
        for (int k = 0; k < 6; ++k) msgs.push_back(filled<float>(100, k, 15));
        for (int k = 0; k < 6; ++k) ws.push_back(p.isend(dt::view_of(msgs[k]), peer, 7 + k % 2));
        for (Work& w : ws) w.wait();
      } else {
        for (int k : {1, 3, 5, 0, 2, 4})
          ws.push_back(p.irecv(dt::view_of(got[k]), peer, 7 + k % 2));
        for (auto it = ws.rbegin(); it != ws.rend(); ++it) it->wait();
        for (int k = 0; k < 6; ++k)
          expect_buf(str("two tags crossed, message ", k), got[k].data(), 100,
                     [&](std::size_t i) { return genv<float>(k, i, 15); });
      }
    });
  }
  expect_throw<dt::InvalidArgument>("negative tag on " + p.name(), [&] {
    std::vector<float> x(1);
    p.isend(dt::view_of(x), next, -1);
  });
}

// ---- shared-memory mailboxes ---------------------------------------------------------------

// Pseudo-random bytes of the message from `from` to `to` (every byte value occurs).
std::vector<std::uint8_t> bytes_of(std::size_t n, int from, int to, std::uint32_t salt) {
  std::vector<std::uint8_t> v(n);
  std::uint64_t x = (static_cast<std::uint64_t>(from + 1) << 40) ^
                    (static_cast<std::uint64_t>(to + 1) << 20) ^ salt ^ 0x9E3779B97F4A7C15ull;
  for (std::uint8_t& b : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<std::uint8_t>(x >> 24);
  }
  return v;
}
bool same_bytes(const std::string& what, const std::vector<std::uint8_t>& got,
                const std::vector<std::uint8_t>& want) {
  std::size_t first = 0;
  while (first < got.size() && first < want.size() && got[first] == want[first]) ++first;
  return H.expect(got.size() == want.size() && first == got.size(), what,
                  str(got.size(), " bytes, first difference at byte ", first));
}

// Per rank of `world`: the lowest world rank on its node (MPI_Comm_split_type SHARED).
std::vector<std::int32_t> nodes_of(dt::MpiComm& world) {
  std::unique_ptr<dt::MpiComm> local = world.split_shared();
  std::int32_t leader = world.rank();
  local->broadcast(dt::view_of(&leader, 1), 0);
  std::vector<std::int32_t> node(static_cast<std::size_t>(world.size()));
  world.all_gather(dt::view_of(static_cast<const std::int32_t*>(&leader), 1), dt::view_of(node));
  return node;
}

// Checks of the mailbox path: same-node peers (node[q] == node[me]) use mailboxes, the others
// the transport; messages go both ways at once between every pair, whichever path they take.
void suite_shm(dt::P2p& p, Comm& world, const std::vector<std::int32_t>& node, std::size_t rb,
               int id) {
  const int s = p.size(), me = p.rank();
  if (s < 2) return;
  auto* sp = dynamic_cast<sec::SealedP2p*>(&p);
  for (int q = 0; q < s; ++q)
    if (q != me) {
      const bool local = node[static_cast<std::size_t>(q)] == node[static_cast<std::size_t>(me)];
      H.expect(sp && sp->shm_with(q) == local, str("mailbox to rank ", q, " on ", p.name()),
               local ? "sealed messages to this same-node peer do not use shared memory"
                     : "a peer on another node is served by shared memory");
    }
  const std::uint32_t salt = static_cast<std::uint32_t>(id) * 1000u;
  // Every rank exchanges one message with every other rank at each size, both ways at once:
  // empty, one byte, odd, around one and two records, and several MiB (past the mailbox).
  const std::size_t sizes[] = {
      0, 1, 4097, rb - 1, rb, rb + 1, 2 * rb - 1, 2 * rb + 1, (std::size_t{3} << 20) + 5};
  int k = 0;
  for (std::size_t n : sizes) {
    ++k;
    const std::string w = str("mailboxes, ", n, " bytes, all pairs both ways on ", p.name());
    guarded(w, [&] {
      std::vector<std::vector<std::uint8_t>> in(static_cast<std::size_t>(s)), out(in.size());
      std::vector<Work> ws;
      for (int q = 0; q < s; ++q) {
        if (q == me) continue;
        in[static_cast<std::size_t>(q)].assign(n, 0xAA);
        out[static_cast<std::size_t>(q)] = bytes_of(n, me, q, salt + static_cast<std::uint32_t>(k));
        ws.push_back(p.irecv(dt::view_of(in[static_cast<std::size_t>(q)]), q, 20 + k));
      }
      for (int q = 0; q < s; ++q)
        if (q != me)
          ws.push_back(p.isend(dt::view_of(static_cast<const std::vector<std::uint8_t>&>(
                                   out[static_cast<std::size_t>(q)])),
                               q, 20 + k));
      for (Work& x : ws) x.wait();
      for (int q = 0; q < s; ++q)
        if (q != me)
          same_bytes(str(w, ", from rank ", q), in[static_cast<std::size_t>(q)],
                     bytes_of(n, q, me, salt + static_cast<std::uint32_t>(k)));
    });
  }
  // Many messages in flight on several tags: to every peer 3 messages on each of 4 tags, sizes
  // from a few bytes to several records; receives posted in the reverse tag order of the sends
  // and completed in reverse posting order.
  guarded("mailboxes, 12 messages on 4 tags per pair on " + p.name(), [&] {
    auto size_of = [&](int t, int m) {
      return static_cast<std::size_t>(t * 3 + m) * (rb / 3) + 11;
    };
    std::vector<std::vector<std::uint8_t>> in, out;
    std::vector<std::pair<int, int>> who;  // (peer, t * 3 + m) of in[i]
    in.reserve(12 * static_cast<std::size_t>(s));
    out.reserve(12 * static_cast<std::size_t>(s));
    std::vector<Work> rs, ws;
    for (int q = 0; q < s; ++q)
      for (int t = 3; t >= 0 && q != me; --t)
        for (int m = 0; m < 3; ++m) {
          in.emplace_back(size_of(t, m), 0);
          who.emplace_back(q, t * 3 + m);
          rs.push_back(p.irecv(dt::view_of(in.back()), q, 60 + t));
        }
    for (int m = 0; m < 3; ++m)
      for (int t = 0; t < 4; ++t)
        for (int q = 0; q < s; ++q)
          if (q != me) {
            out.push_back(bytes_of(size_of(t, m), me, q,
                                   salt + 100u + static_cast<std::uint32_t>(t * 3 + m)));
            ws.push_back(p.isend(
                dt::view_of(static_cast<const std::vector<std::uint8_t>&>(out.back())), q, 60 + t));
          }
    for (auto it = rs.rbegin(); it != rs.rend(); ++it) it->wait();
    for (Work& x : ws) x.wait();
    for (std::size_t i = 0; i < in.size(); ++i)
      same_bytes(str("message ", who[i].second, " from rank ", who[i].first), in[i],
                 bytes_of(in[i].size(), who[i].first, me,
                          salt + 100u + static_cast<std::uint32_t>(who[i].second)));
  });
  const int next = (me + 1) % s, prev = (me + s - 1) % s;
  // Sent before the receive is posted, received in the other order: the mailbox keeps flowing
  // (the first message is kept aside), and sends larger than the mailbox complete.
  guarded("mailboxes, sent before the receives are posted on " + p.name(), [&] {
    const std::size_t n = (std::size_t{3} << 19) + 17;  // two of them overfill a mailbox
    const auto a = bytes_of(n, me, next, salt + 200), b = bytes_of(n, me, next, salt + 201);
    Work wa = p.isend(dt::view_of(a), next, 80);
    Work wb = p.isend(dt::view_of(b), next, 81);
    world.barrier();
    std::vector<std::uint8_t> ra(n), rb2(n);
    p.recv(dt::view_of(rb2), prev, 81);
    p.recv(dt::view_of(ra), prev, 80);
    wa.wait();
    wb.wait();
    same_bytes("message on tag 80", ra, bytes_of(n, prev, me, salt + 200));
    same_bytes("message on tag 81", rb2, bytes_of(n, prev, me, salt + 201));
  });
  // A send larger than the mailbox completes while its sender waits on something else (here a
  // plain MPI message the receiver sends only once it has the whole sealed message).
  guarded("mailboxes, send completed while its sender waits elsewhere on " + p.name(), [&] {
    const std::size_t n = (std::size_t{6} << 20) + 3;
    const auto out = bytes_of(n, me, next, salt + 300);
    std::vector<std::uint8_t> in(n);
    std::int32_t token = 0;
    Work r = p.irecv(dt::view_of(in), prev, 90);
    Work w = p.isend(dt::view_of(out), next, 90);
    if (me % 2 == 0) {  // even ranks wait on MPI first, odd ones on their receive first
      Work t = world.irecv(dt::view_of(&token, 1), next, 91);
      t.wait();
      r.wait(Millis(60000));
      world.send(dt::view_of(static_cast<const std::int32_t*>(&token), 1), prev, 91);
    } else {
      r.wait(Millis(60000));
      world.send(dt::view_of(static_cast<const std::int32_t*>(&token), 1), prev, 91);
      world.recv(dt::view_of(&token, 1), next, 91);
    }
    w.wait();
    same_bytes("message on tag 90", in, bytes_of(n, prev, me, salt + 300));
  });
}

// A receive whose peer destroys its end of the channel without sending fails with CommError
// instead of waiting for ever (over MPI: a UCX transport's destructor waits for its peers').
// Ranks 0 and 1 must share a node.
void check_peer_closed(Comm& world, const std::vector<std::int32_t>& node, const sec::Keys& keys) {
  if (world.size() < 2 || node[0] != node[1]) return;
  const int me = world.rank();
  std::unique_ptr<dt::P2p> q = sec::seal_p2p(dt::make_p2p("mpi", world), keys, {});
  std::vector<float> buf(1000);
  Work w;
  if (me == 1) w = q->irecv(dt::view_of(buf), 0, 4);
  world.barrier();
  if (me == 0) q.reset();
  world.barrier();
  if (me == 1)
    expect_throw<dt::CommError>("receive from a peer that closed its end",
                                [&] { w.wait(Millis(60000)); },
                                {"from rank 0", "closed its end of the channel"});
  world.barrier();
}

// A rejected message breaks the channel from its sender: rank 0 sends a message whose third of
// four records is flipped, then (once rank 1 has rejected it) a good one. Rank 1 posted both
// receives before either arrived. The first fails naming message 0 and keeps none of its
// plaintext (its two good records included); the second fails with the same error instead of
// receiving the good message, and keeps none of it; a later receive from rank 0 fails at once.
void check_broken_channel(const std::string& kind, Comm& world, const sec::Keys& keys, bool shm) {
  if (world.size() < 2) return;
  const int me = world.rank();
  sec::SealOptions so;
  so.record_bytes = 4096;
  so.shm = shm;
  if (me == 0) so.tamper = sec::parse_tamper("flip:0");
  std::unique_ptr<dt::P2p> q = sec::seal_p2p(dt::make_p2p(kind, world), keys, so);
  const std::string w = str("broken channel (", shm ? "mailboxes" : "transport", ")");
  constexpr std::size_t n = 4096;  // floats: 4 records
  const std::vector<float> a = filled<float>(n, 0, 40), b = filled<float>(n, 0, 41);
  Work w2;
  if (me == 0) {
    guarded(w + ": the flipped message", [&] { q->isend(dt::view_of(a), 1, 11).wait(); });
    world.barrier();  // rank 1 has rejected it
    guarded(w + ": the good message", [&] { w2 = q->isend(dt::view_of(b), 1, 11); });
    world.barrier();
  } else if (me == 1) {
    // NaN never equals what was sent, so an untouched buffer counts as holding none of it.
    std::vector<float> in1(n, std::nanf("")), in2(n, std::nanf(""));
    Work r1, r2;
    guarded(w + ": posting", [&] {
      r1 = q->irecv(dt::view_of(in1), 0, 11);
      r2 = q->irecv(dt::view_of(in2), 0, 11);
    });
    const std::string names = "rejected message 0 from rank 0 to rank 1";
    expect_throw<dt::SecurityError>(w + ": the flipped message", [&] { r1.wait(); }, {names});
    auto holds_none = [](const std::vector<float>& got, const std::vector<float>& sent) {
      for (std::size_t i = 0; i < got.size(); ++i)
        if (got[i] == sent[i] && sent[i] != 0.0f) return false;
      return true;
    };
    H.expect(holds_none(in1, a), w + ": the rejected message's buffer",
             "holds some of its plaintext");
    world.barrier();
    world.barrier();  // the good message has been sent
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    expect_throw<dt::SecurityError>(w + ": a receive pending behind it",
                                    [&] { r2.wait(Millis(10000)); }, {names});
    H.expect(holds_none(in2, b), w + ": the pending receive's buffer",
             "holds the good message sent after the channel broke");
    std::vector<float> in3(n);
    expect_throw<dt::SecurityError>(w + ": a receive posted afterwards",
                                    [&] { q->irecv(dt::view_of(in3), 0, 11).wait(Millis(10000)); },
                                    {names});
    if (!shm) {
      // Records the failures could not give up within their second (a loaded node) are given up
      // now, so the buffers may go: nothing writes into them any more.
      const bool c1 = r1.cancel(Millis(60000)), c2 = r2.cancel(Millis(60000));  // both, always
      H.expect(c1 && c2, w + ": the failed receives withdrawn",
               "records still posted after a minute");
    }
  } else {
    world.barrier();
    world.barrier();
  }
  world.barrier();
}

// Cancelling a receive: rank 1 posts a three-record receive from rank 0, which sends nothing,
// and cancels it. The cancel withdraws it (true, at once; a second cancel too) and its wait throws
// "cancelled". Through the transport, the buffer is zeroed (as a failed receive's) and the channel
// from rank 0 is broken: a later receive from rank 0 fails at once with the same error, as the
// message the cancelled receive was to get would reach it under the wrong sequence number; every
// other channel still carries messages (a ring but for 0 -> 1). Through the mailboxes, which
// match by tag in order too, the cancel ends them all as a failure does: rank 1's later receive
// from rank 0 and send to rank 0 fail with the cancelled receive's error; nothing was opened, so
// the buffer is untouched. A send through a mailbox, larger than it and not received, is cancelled
// too.
void check_cancel(const std::string& kind, Comm& world, const std::vector<std::int32_t>& node,
                  const sec::Keys& keys, bool shm) {
  if (world.size() < 2 || (shm && node[0] != node[1])) return;
  const int me = world.rank(), n = world.size();
  sec::SealOptions so;
  so.record_bytes = 4096;
  so.shm = shm;
  std::unique_ptr<dt::P2p> q = sec::seal_p2p(dt::make_p2p(kind, world), keys, so);
  const std::string w = str("cancel (", shm ? "mailboxes" : "transport", ")");
  if (me == 1) {
    std::vector<float> in(2500, 7.0f);  // 10000 bytes: 3 records
    Work r = q->irecv(dt::view_of(in), 0, 12);
    H.expect(r.cancel(Millis(60000)), w + ": a pending receive", "not withdrawn");
    H.expect(r.cancel(Millis(0)), w + ": a second cancel", "not withdrawn");
    expect_throw<dt::CommError>(w + ": wait after the cancel", [&] { r.wait(Millis(10000)); },
                                {"cancelled", "recv(10000 bytes from 0, tag 12)"});
    const float want = shm ? 7.0f : 0.0f;
    bool as_wanted = true;
    for (float v : in) as_wanted = as_wanted && v == want;
    H.expect(as_wanted, w + ": the cancelled receive's buffer", shm ? "written" : "not zeroed");
    std::vector<float> later(16);
    expect_throw<dt::CommError>(w + ": a receive from rank 0 after the cancel",
                                [&] { q->irecv(dt::view_of(later), 0, 13).wait(Millis(10000)); },
                                {"cancelled"});
    if (shm)
      expect_throw<dt::CommError>(w + ": a send to rank 0 after the cancel",
                                  [&] { q->isend(dt::view_of(later), 0, 13).wait(Millis(10000)); },
                                  {"cancelled"});
  }
  if (shm) {
    // A send larger than its mailbox, which rank 0 does not receive: cancelled, it is withdrawn
    // (true at once) and its wait throws "cancelled".
    sec::SealOptions small = so;
    small.shm_ring_bytes = 64 << 10;
    std::unique_ptr<dt::P2p> q2 = sec::seal_p2p(dt::make_p2p(kind, world), keys, small);
    if (me == 1) {
      const std::vector<float> big = filled<float>(64 << 10, me, 51);  // 256 KiB
      Work sw = q2->isend(dt::view_of(big), 0, 15);
      H.expect(!sw.test(), w + ": a send larger than its mailbox", "completed unreceived");
      H.expect(sw.cancel(Millis(0)), w + ": a pending send", "not withdrawn");
      expect_throw<dt::CommError>(w + ": wait after the send's cancel",
                                  [&] { sw.wait(Millis(10000)); }, {"cancelled", "send("});
    }
    world.barrier();
  } else {
    const int to = (me + 1) % n, from = (me + n - 1) % n;
    const std::vector<float> out = filled<float>(1000, me, 50);
    std::vector<float> got(1000);
    guarded(w + ": traffic beside the cancelled channel", [&] {
      Work rr, ss;
      if (!(me == 1 && from == 0)) rr = q->irecv(dt::view_of(got), from, 14);
      if (!(me == 0 && to == 1)) ss = q->isend(dt::view_of(out), to, 14);
      if (ss.valid()) ss.wait(Millis(60000));
      if (rr.valid()) {
        rr.wait(Millis(60000));
        expect_buf(w + ": traffic beside the cancelled channel", got.data(), got.size(),
                   [&](std::size_t i) { return genv<float>(from, i, 50); });
      }
    });
  }
  world.barrier();
}

// A message sealed under another job's key never verifies: rank 1 derives its keys for job
// "other" and must reject rank 0's message, naming rank 0 and the sequence number.
void check_other_job(const std::string& kind, Comm& world, const sec::SecretKey& key) {
  if (world.size() < 2) return;
  const int me = world.rank();
  sec::Keys keys(key, me == 1 ? "other-job" : "this-job");
  std::unique_ptr<dt::P2p> p = sec::seal_p2p(dt::make_p2p(kind, world), keys, {});
  std::vector<float> buf(64, 1.0f);
  const double before = dt::metrics::default_registry()
                            .counter("dt_security_auth_failures_total",
                                     "Sealed messages rejected (bad tag, replay, reorder, "
                                     "redirect, malformed)",
                                     {{"reason", "authentication"}})
                            .value();
  if (me == 0) {
    guarded("other job (sender)", [&] { p->send(dt::view_of(buf), 1, 3); });
  } else if (me == 1) {
    expect_throw<dt::SecurityError>("message sealed under another job's key",
                                    [&] { p->recv(dt::view_of(buf), 0, 3); },
                                    {"message 0 from rank 0", "authentication failed"});
    const std::string text = dt::metrics::default_registry().render();
    H.expect(text.find("dt_security_auth_failures_total{reason=\"authentication\"} " +
                       std::to_string(static_cast<int>(before) + 1)) != std::string::npos,
             "auth failure counted", text.substr(0, 400));
  }
  world.barrier();
}

sec::SecretKey test_key() {
  sec::Key k{};
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<std::uint8_t>(i * 7 + 3);
  return sec::SecretKey(k);
}

int run(int argc, char** argv, int world_rank) {
  const std::string mode = argc > 1 ? argv[1] : "coll";
  const std::string kind = argc > 2 ? argv[2] : "mpi";
  std::unique_ptr<dt::MpiComm> world = dt::MpiComm::dup(MPI_COMM_WORLD, "world");
  const sec::Keys keys(test_key(), "test-job");
  H.rank = world_rank;
  if (mode == "tamper") {
    // argv: tamper p2p|coll mpi|ucx SPEC
    const std::string what = kind;
    const std::string p2p = argc > 3 ? argv[3] : "mpi";
    const sec::Tamper t = sec::parse_tamper(argc > 4 ? argv[4] : "flip:0");
    const bool shm = !(argc > 5 && std::string(argv[5]) == "noshm");
    try {
      if (what == "p2p") {
        sec::SealOptions so;
        so.record_bytes = 4096;  // 4 records per message: record-level faults apply
        so.shm = shm;
        if (world_rank == 0) so.tamper = t;
        auto p = sec::seal_p2p(dt::make_p2p(p2p, *world), keys, so);
        const int s = p->size(), me = p->rank();
        const auto* sp = dynamic_cast<const sec::SealedP2p*>(p.get());
        if (s > 1 && (!sp || sp->shm_with((me + 1) % s) != shm)) {
          std::printf("rank %d: FAIL the messages do not take the path asked for (%s)\n",
                      world_rank, shm ? "shared memory" : "transport");
          std::fflush(stdout);
          return 1;
        }
        // Every rank sends 6 equal messages to the next rank and receives 6 from the previous.
        for (int k = 0; k < 6; ++k) {
          const std::vector<float> out = filled<float>(4096, me, 20 + k);
          std::vector<float> in(4096);
          Work r = p->irecv(dt::view_of(in), (me + s - 1) % s, 9);
          Work w = p->isend(dt::view_of(out), (me + 1) % s, 9);
          w.wait();
          r.wait();
        }
      } else {
        sec::SealedCommOptions o;
        o.p2p = p2p;
        o.segment_bytes = 64 << 10;
        o.shm = shm;
        if (world_rank == 0) o.tamper = t;
        auto c = sec::make_sealed_comm(*world, keys, o);
        std::vector<float> buf = filled<float>(std::size_t{1} << 20, c->rank(), 30);
        c->all_reduce(dt::view_of(buf), ReduceOp::sum);
        c->barrier();
      }
    } catch (const dt::SecurityError& e) {
      sec::abort_job(e);
    }
    std::printf("rank %d: no tampering detected\n", world_rank);
    std::fflush(stdout);
    return 1;
  }
  if (mode == "p2p") {
    const bool shm = !(argc > 3 && std::string(argv[3]) == "noshm");
    sec::SealOptions so;
    so.shm = shm;
    auto p = sec::seal_p2p(dt::make_p2p(kind, *world), keys, so);
    const std::vector<std::int32_t> node = nodes_of(*world);
    suite_p2p(*p, 1);
    if (shm) suite_shm(*p, *world, node, so.record_bytes, 1);
    sec::SealOptions small = so;
    small.record_bytes = 4096;
    auto p4 = sec::seal_p2p(dt::make_p2p(kind, *world), keys, small);
    suite_p2p(*p4, 2);
    if (shm) {
      suite_shm(*p4, *world, node, small.record_bytes, 2);
      check_peer_closed(*world, node, keys);
    } else {
      const auto* sp = dynamic_cast<const sec::SealedP2p*>(p.get());
      for (int q = 0; q < world->size(); ++q)
        H.expect(sp && !sp->shm_with(q), str("no mailbox to rank ", q),
                 "SealOptions::shm = false, yet a mailbox is used");
    }
    // Every rank must cut messages into the same records: a mismatch is refused at creation, on
    // every rank (rank 0 too, which would otherwise go on and wait for the others), naming the
    // first rank that differs.
    if (world->size() > 1) {
      sec::SealOptions odd;
      odd.record_bytes = world_rank == 0 ? 8192 : 16384;
      expect_throw<dt::InvalidArgument>(
          "record size mismatch",
          [&] { (void)sec::seal_p2p(dt::make_p2p(kind, *world), keys, odd); },
          {"rank 1 cuts messages into records of 16384 bytes, rank 0 into 8192"});
    }
    check_other_job(kind, *world, test_key());
    check_broken_channel(kind, *world, keys, shm);
    check_cancel(kind, *world, node, keys, shm);
  } else {
    sec::SealedCommOptions o;
    o.p2p = kind;
    o.segment_bytes = 40000;  // not a multiple of any element size: uneven segments
    const std::string variant = argc > 3 ? argv[3] : "";
    if (variant == "exempt") o.exempt_node_local = true;
    if (variant == "noshm") o.shm = false;
    if (variant == "nodes2") {
      o.exempt_node_local = true;
      o.simulated_nodes = 2;
    }
    auto c = sec::make_sealed_comm(*world, keys, o);
    suite_collectives(*c, 1);
    std::unique_ptr<Comm> sub = c->split(world_rank % 2, -world_rank);
    if (H.expect(sub != nullptr, "split", "returned nullptr")) {
      H.expect(sub->name().find("sealed") != std::string::npos, "split name", sub->name());
      suite_collectives(*sub, 2);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const auto t0 = std::chrono::steady_clock::now();
  int rc = 0;
  try {
    rc = run(argc, argv, rank);
  } catch (const std::exception& e) {
    H.fail("run", e.what());
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string name = std::string("test_sealed ") + (argc > 1 ? argv[1] : "coll") + " " +
                           (argc > 2 ? argv[2] : "mpi") +
                           (argc > 3 ? std::string(" ") + argv[3] : "");
  const int hrc = H.finish(name.c_str(), secs);
  MPI_Finalize();
  return rc ? rc : hrc;
}
