// test_collectives: every dt::Comm collective x dtype x op, at any rank count (run under 1, 2, 3
// and 4 ranks; 3 is not a power of two), sizes 0, 1, 7 and 1M elements, on the world and on split
// sub-communicators, in the blocking, blocking-with-timeout and non-blocking (wait and test) forms,
// against references computed here from the known per-rank inputs.
//
// Inputs are small integers in [-20, 20] (u8: [0, 40]) that depend on the rank in the communicator
// under test, the element index and the case, so every sum is exact in every dtype and a wrong
// route, block or root shows up as a wrong value. References follow dt/comm.hpp: avg is the exact
// sum divided by size(), truncating toward zero for integers, in float and rounded once for
// bf16/f16 (rounding done here independently of dt's conversion), in double for f64.
//
// Also: split() ordering by key and color -1, chunked element-wise ops (MpiComm::set_max_chunk),
// in-place all_gather, several outstanding operations, Work timeouts and stored errors, and
// argument validation. Each failed check prints "rank R: FAIL <what>: <details>"; rank 0 prints a
// summary and every rank exits 1 if any rank failed.
//
// Every rank uses the same form for a given collective: MPI never matches a non-blocking
// collective with a blocking one, and MpiComm maps blocking calls without a timeout onto blocking
// MPI calls and everything else onto non-blocking ones.
//
// Modes (argv[1]): "mpi" (default) tests dt's MPI communicator; "shm" the shared-memory one
// (dt::ShmComm) with a small staging area and chunk so buffers go through many pieces, plus buffers
// placed in its arena (argv[2], optional: the path all_reduce must take, e.g. "hier" on real
// nodes); "hier" the same with the ranks split into two simulated nodes, so
// all_reduce takes the hierarchical path (shared memory inside, MPI across).
//
// Environment: DT_TEST_VERBOSE=1 prints per-section times on rank 0.
#include <fcntl.h>
#include <mpi.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "check_harness.hpp"
#include "comm/mpi_comm.hpp"
#include "comm/shm_comm.hpp"
#include "dt/comm.hpp"
#include "dt/dtype.hpp"
#include "dt/error.hpp"
#include "dt/runtime.hpp"
#include "dt/tensor.hpp"

namespace {

using dt::Comm;
using dt::CommOptions;
using dt::DType;
using dt::Millis;
using dt::ReduceOp;
using dt::Work;
using Clock = std::chrono::steady_clock;
using namespace dt_test;

// ---- values and references ------------------------------------------------------------------

template <class T>
constexpr bool is16 = std::is_same_v<T, dt::bf16> || std::is_same_v<T, dt::f16>;
template <class T>
constexpr bool nonneg_v = std::is_same_v<T, std::uint8_t>;

// Value of rank r at element i in case `salt`: [-20, 20], or [0, 40] for unsigned types.
inline int gen(int r, std::size_t i, std::uint32_t salt, bool nonneg) {
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
  return gen(r, i, salt, nonneg_v<T>);
}

template <class T>
T enc(double v) {
  if constexpr (is16<T>)
    return T(static_cast<float>(v));  // exact: only small integers are encoded
  else
    return static_cast<T>(v);
}
template <class T>
double dec(T v) {
  if constexpr (is16<T>)
    return static_cast<double>(static_cast<float>(v));  // exact by dtype.hpp
  else
    return static_cast<double>(v);
}

// Rounds x to nearest, ties to even, keeping `mant` explicit mantissa bits (normal range only,
// which is all the avg references need: |x| in [1/4, 40]).
double round_mantissa(double x, int mant) {
  if (x == 0 || !std::isfinite(x)) return x;
  int e = 0;
  std::frexp(x, &e);  // x = m * 2^e, 0.5 <= |m| < 1
  const double ulp = std::ldexp(1.0, e - 1 - mant);
  return std::nearbyint(x / ulp) * ulp;  // default rounding mode: to nearest even
}

// avg reference from an exact integer sum.
template <class T>
double avg_ref(std::int64_t sum, int n) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<double>(sum / n);  // C++: truncation toward zero
  } else if constexpr (std::is_same_v<T, double>) {
    return static_cast<double>(sum) / static_cast<double>(n);
  } else {
    const float q = static_cast<float>(sum) / static_cast<float>(n);
    if constexpr (std::is_same_v<T, float>) return q;
    if constexpr (std::is_same_v<T, dt::bf16>) return round_mantissa(q, 7);
    return round_mantissa(q, 10);  // f16
  }
}

// op over ranks [0, n) of value(r).
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

// Compares got[0, n) with ref(i); reports the count and the first mismatch.
template <class T, class Ref>
bool expect_buf(const std::string& what, const T* got, std::size_t n, Ref&& ref) {
  std::size_t bad = 0, first = 0;
  double fg = 0, fe = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double e = ref(i);
    const double gv = dec(got[i]);
    if (!(gv == e)) {
      if (bad == 0) {
        first = i;
        fg = gv;
        fe = e;
      }
      ++bad;
    }
  }
  return H.expect(
      bad == 0, what,
      str(bad, " of ", n, " elements wrong; first at ", first, ": got ", fg, ", expected ", fe));
}

constexpr double kSentinel = 77;  // never an input value (|v| <= 40)

template <class T>
std::vector<T> filled(std::size_t n, int r, std::uint32_t salt, std::size_t base = 0) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = enc<T>(genv<T>(r, base + i, salt));
  return v;
}

constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};
constexpr std::size_t kBig = std::size_t{1} << 20;
constexpr std::size_t kSizes[] = {0, 1, 7, kBig};

std::uint32_t salt_of(int a, int b, int c, int d, int e) {
  return static_cast<std::uint32_t>((((a * 31 + b) * 31 + c) * 31 + d) * 31 + e);
}

// ---- one case per collective ----------------------------------------------------------------

template <class T>
void case_all_reduce(Comm& c, std::size_t n, ReduceOp op, Form f, std::uint32_t salt) {
  const std::string what = str("all_reduce(", dt::dtype_name(dt::dtype_v<T>), " x ", n, ", ",
                               dt::reduce_op_name(op), ", ", form_name(f), ") on ", c.name());
  guarded(what, [&] {
    std::vector<T> buf = filled<T>(n, c.rank(), salt);
    run_form(
        f, [&](const CommOptions& o) { c.all_reduce(dt::view_of(buf), op, o); },
        [&] { return c.iall_reduce(dt::view_of(buf), op); });
    const int s = c.size();
    expect_buf(what, buf.data(), n, [&](std::size_t i) {
      return reduce_ref<T>(op, s, [&](int r) { return genv<T>(r, i, salt); });
    });
  });
}

template <class T>
void case_broadcast(Comm& c, std::size_t n, int root, Form f, std::uint32_t salt) {
  const std::string what = str("broadcast(", dt::dtype_name(dt::dtype_v<T>), " x ", n, ", root ",
                               root, ", ", form_name(f), ") on ", c.name());
  guarded(what, [&] {
    // Non-roots start from their own (different) values, so a missing copy is visible.
    std::vector<T> buf = filled<T>(n, c.rank() == root ? root : 1000 + c.rank(), salt);
    run_form(
        f, [&](const CommOptions& o) { c.broadcast(dt::view_of(buf), root, o); },
        [&] { return c.ibroadcast(dt::view_of(buf), root); });
    expect_buf(what, buf.data(), n, [&](std::size_t i) { return genv<T>(root, i, salt); });
  });
}

template <class T>
void case_all_gather(Comm& c, std::size_t n, Form f, std::uint32_t salt, bool in_place) {
  const std::string what = str("all_gather(", dt::dtype_name(dt::dtype_v<T>), " x ", n, ", ",
                               in_place ? "in place, " : "", form_name(f), ") on ", c.name());
  guarded(what, [&] {
    const int s = c.size(), me = c.rank();
    std::vector<T> out(n * static_cast<std::size_t>(s), enc<T>(kSentinel));
    std::vector<T> in;
    dt::ConstTensorView inv;
    if (in_place) {
      for (std::size_t i = 0; i < n; ++i) out[me * n + i] = enc<T>(genv<T>(me, i, salt));
      inv = dt::view_of(static_cast<const T*>(out.data() + me * n), n);
    } else {
      in = filled<T>(n, me, salt);
      inv = dt::view_of(static_cast<const std::vector<T>&>(in));
    }
    run_form(
        f, [&](const CommOptions& o) { c.all_gather(inv, dt::view_of(out), o); },
        [&] { return c.iall_gather(inv, dt::view_of(out)); });
    expect_buf(what, out.data(), out.size(),
               [&](std::size_t j) { return genv<T>(static_cast<int>(j / n), j % n, salt); });
    if (!in_place)
      expect_buf(what + " input untouched", in.data(), n,
                 [&](std::size_t i) { return genv<T>(me, i, salt); });
  });
}

template <class T>
void case_reduce_scatter(Comm& c, std::size_t n, ReduceOp op, Form f, std::uint32_t salt) {
  const std::string what =
      str("reduce_scatter(", dt::dtype_name(dt::dtype_v<T>), " x ", n, " per rank, ",
          dt::reduce_op_name(op), ", ", form_name(f), ") on ", c.name());
  guarded(what, [&] {
    const int s = c.size(), me = c.rank();
    std::vector<T> in = filled<T>(n * static_cast<std::size_t>(s), me, salt);
    std::vector<T> out(n, enc<T>(kSentinel));
    run_form(
        f,
        [&](const CommOptions& o) {
          c.reduce_scatter(dt::view_of(static_cast<const std::vector<T>&>(in)), dt::view_of(out),
                           op, o);
        },
        [&] {
          return c.ireduce_scatter(dt::view_of(static_cast<const std::vector<T>&>(in)),
                                   dt::view_of(out), op);
        });
    const std::size_t base = static_cast<std::size_t>(me) * n;
    expect_buf(what, out.data(), n, [&](std::size_t i) {
      return reduce_ref<T>(op, s, [&](int r) { return genv<T>(r, base + i, salt); });
    });
  });
}

// Ring: rank r sends its values to r + 1 and receives r - 1's (a self-message on one rank).
template <class T>
void case_ring(Comm& c, std::size_t n, Form f, std::uint32_t salt, int tag) {
  const std::string what = str("send/recv ring(", dt::dtype_name(dt::dtype_v<T>), " x ", n, ", ",
                               form_name(f), ") on ", c.name());
  guarded(what, [&] {
    const int s = c.size(), me = c.rank();
    const int next = (me + 1) % s, prev = (me + s - 1) % s;
    const std::vector<T> out = filled<T>(n, me, salt);
    std::vector<T> in(n, enc<T>(kSentinel));
    if (nonblocking(f)) {
      Work rw = c.irecv(dt::view_of(in), prev, tag);
      Work sw = c.isend(dt::view_of(out), next, tag);
      complete(f, {&sw, &rw});
    } else if (s == 1) {
      // A blocking send to oneself needs the receive posted first (and vice versa).
      const CommOptions o = opts_for(f);
      Work rw = c.irecv(dt::view_of(in), 0, tag);
      c.send(dt::view_of(out), 0, tag, o);
      rw.wait();
      expect_buf(what + " (irecv + blocking send)", in.data(), n,
                 [&](std::size_t i) { return genv<T>(0, i, salt); });
      std::fill(in.begin(), in.end(), enc<T>(kSentinel));
      Work sw = c.isend(dt::view_of(out), 0, tag + 1);
      c.recv(dt::view_of(in), 0, tag + 1, o);
      sw.wait();
    } else if (me % 2 == 0) {  // even ranks send first, odd ranks receive first: no cycle
      c.send(dt::view_of(out), next, tag, opts_for(f));
      c.recv(dt::view_of(in), prev, tag, opts_for(f));
    } else {
      c.recv(dt::view_of(in), prev, tag, opts_for(f));
      c.send(dt::view_of(out), next, tag, opts_for(f));
    }
    expect_buf(what, in.data(), n, [&](std::size_t i) { return genv<T>(prev, i, salt); });
    expect_buf(what + " send buffer untouched", out.data(), n,
               [&](std::size_t i) { return genv<T>(me, i, salt); });
  });
}

// Pair between ranks 0 and 1 (others idle). Non-blocking: rank 0 posts two sends with different
// tags and rank 1 receives them in the opposite order (matching is by tag), then answers.
template <class T>
void case_pair(Comm& c, std::size_t n, Form f, std::uint32_t salt, int tag) {
  if (c.size() < 2 || c.rank() > 1) return;
  const std::string what = str("send/recv pair 0<->1(", dt::dtype_name(dt::dtype_v<T>), " x ", n,
                               ", ", form_name(f), ") on ", c.name());
  guarded(what, [&] {
    const std::uint32_t sa = salt, sb = salt + 1, sc = salt + 2;
    if (c.rank() == 0) {
      const std::vector<T> a = filled<T>(n, 0, sa), cc = filled<T>(n, 0, sc);
      std::vector<T> b(n, enc<T>(kSentinel));
      if (nonblocking(f)) {
        Work w1 = c.isend(dt::view_of(a), 1, tag);
        Work w2 = c.isend(dt::view_of(cc), 1, tag + 1);
        Work w3 = c.irecv(dt::view_of(b), 1, tag + 2);
        complete(f, {&w3, &w2, &w1});
      } else {
        c.send(dt::view_of(a), 1, tag, opts_for(f));
        c.send(dt::view_of(cc), 1, tag + 1, opts_for(f));
        c.recv(dt::view_of(b), 1, tag + 2, opts_for(f));
      }
      expect_buf(what + " reply", b.data(), n, [&](std::size_t i) { return genv<T>(1, i, sb); });
    } else {
      std::vector<T> a(n, enc<T>(kSentinel)), cc(n, enc<T>(kSentinel));
      const std::vector<T> b = filled<T>(n, 1, sb);
      if (nonblocking(f)) {
        Work w2 = c.irecv(dt::view_of(cc), 0, tag + 1);
        Work w1 = c.irecv(dt::view_of(a), 0, tag);
        Work w3 = c.isend(dt::view_of(b), 0, tag + 2);
        complete(f, {&w2, &w1, &w3});
      } else {
        c.recv(dt::view_of(a), 0, tag, opts_for(f));
        c.recv(dt::view_of(cc), 0, tag + 1, opts_for(f));
        c.send(dt::view_of(b), 0, tag + 2, opts_for(f));
      }
      expect_buf(what + " tag " + std::to_string(tag), a.data(), n,
                 [&](std::size_t i) { return genv<T>(0, i, sa); });
      expect_buf(what + " tag " + std::to_string(tag + 1), cc.data(), n,
                 [&](std::size_t i) { return genv<T>(0, i, sc); });
    }
  });
}

// ---- suites ---------------------------------------------------------------------------------

template <class F>
void for_each_dtype(F&& f) {
  int k = 0;
  for (DType t : dt::kAllDTypes) {
    dt::visit_dtype(t, [&](auto z) { f(z, k); });
    ++k;
  }
}

// At 1M elements only a subset of the forms runs (rotating with dtype and op, so every form
// still meets every dtype and op at 1M somewhere); the small sizes run every form.
bool run_big(std::size_t n, int dtype_k, int op_k, Form f, int rot) {
  if (n < kBig) return true;
  const int fk = static_cast<int>(f);
  return fk == (dtype_k + op_k + rot) % kFormCount;
}

void suite_all_reduce(Comm& c, int id) {
  for_each_dtype([&](auto z, int dk) {
    using T = decltype(z);
    for (int ok = 0; ok < 4; ++ok)
      for (std::size_t n : kSizes)
        for (Form f : kForms)
          if (run_big(n, dk, ok, f, 0))
            case_all_reduce<T>(
                c, n, kOps[ok], f,
                salt_of(id, dk, ok, static_cast<int>(n % 1000), static_cast<int>(f)));
  });
}

void suite_reduce_scatter(Comm& c, int id) {
  for_each_dtype([&](auto z, int dk) {
    using T = decltype(z);
    // The big case takes 1M elements of input (blocks of ceil(1M / size)); a 1M block per rank
    // would cost size() times more and add no path the smaller blocks miss.
    const std::size_t big_block = (kBig + static_cast<std::size_t>(c.size()) - 1) / c.size();
    for (int ok = 0; ok < 4; ++ok)
      for (std::size_t n : kSizes)
        for (Form f : kForms)
          if (run_big(n, dk, ok, f, 1))
            case_reduce_scatter<T>(
                c, n == kBig ? big_block : n, kOps[ok], f,
                salt_of(id + 1, dk, ok, static_cast<int>(n % 1000), static_cast<int>(f)));
  });
}

void suite_broadcast(Comm& c, int id) {
  for_each_dtype([&](auto z, int dk) {
    using T = decltype(z);
    for (int root = 0; root < c.size(); ++root)
      for (std::size_t n : kSizes)
        for (Form f : kForms)
          if (run_big(n, dk, root, f, 2))
            case_broadcast<T>(
                c, n, root, f,
                salt_of(id + 2, dk, root, static_cast<int>(n % 1000), static_cast<int>(f)));
  });
}

void suite_all_gather(Comm& c, int id) {
  for_each_dtype([&](auto z, int dk) {
    using T = decltype(z);
    for (std::size_t n : kSizes)
      for (Form f : kForms)
        for (int ip = 0; ip < 2; ++ip)
          if (run_big(n, dk, ip, f, 3))
            case_all_gather<T>(
                c, n, f, salt_of(id + 3, dk, ip, static_cast<int>(n % 1000), static_cast<int>(f)),
                ip == 1);
  });
}

void suite_p2p(Comm& c, int id) {
  for_each_dtype([&](auto z, int dk) {
    using T = decltype(z);
    for (std::size_t n : kSizes)
      for (Form f : kForms) {
        const int tag = 1000 + dk * 100 + static_cast<int>(f) * 10;
        if (run_big(n, dk, 0, f, 0))
          case_ring<T>(c, n, f,
                       salt_of(id + 4, dk, 0, static_cast<int>(n % 1000), static_cast<int>(f)),
                       tag);
        if (run_big(n, dk, 1, f, 0))
          case_pair<T>(c, n, f,
                       salt_of(id + 5, dk, 1, static_cast<int>(n % 1000), static_cast<int>(f)),
                       tag + 5);
      }
  });
}

// Barrier: rank 0 arrives ~200 ms late; nobody may leave before it arrived.
void suite_barrier(Comm& c) {
  for (Form f : kForms) {
    const std::string what = str("barrier(", form_name(f), ") on ", c.name());
    guarded(what, [&] {
      c.barrier();  // line up
      if (c.rank() == 0 && c.size() > 1) std::this_thread::sleep_for(Millis(200));
      const std::int64_t entered = monotonic_ns();
      run_form(
          f, [&](const CommOptions& o) { c.barrier(o); }, [&] { return c.ibarrier(); });
      const std::int64_t left = monotonic_ns();
      expect_left_after_rank0(c, entered, left, what);
    });
  }
}

// Several operations outstanding at once, completed in reverse order.
void suite_outstanding(Comm& c) {
  const std::string what = str("outstanding operations on ", c.name());
  guarded(what, [&] {
    const int s = c.size(), me = c.rank(), root = s - 1;
    const std::uint32_t salt = 4242;
    std::vector<float> a = filled<float>(1000, me, salt);
    std::vector<dt::bf16> b = filled<dt::bf16>(7, me == root ? root : 1000 + me, salt + 1);
    const std::vector<std::int64_t> gin = filled<std::int64_t>(5, me, salt + 2);
    std::vector<std::int64_t> gout(5 * static_cast<std::size_t>(s), 77);
    const std::vector<dt::f16> rin = filled<dt::f16>(3 * static_cast<std::size_t>(s), me, salt + 3);
    std::vector<dt::f16> rout(3, enc<dt::f16>(kSentinel));
    std::vector<std::int32_t> c2 = filled<std::int32_t>(9, me, salt + 4);
    Work w1 = c.iall_reduce(dt::view_of(a), ReduceOp::sum);
    Work w2 = c.ibroadcast(dt::view_of(b), root);
    Work w3 = c.iall_gather(dt::view_of(gin), dt::view_of(gout));
    Work w4 = c.ireduce_scatter(dt::view_of(rin), dt::view_of(rout), ReduceOp::avg);
    Work w5 = c.ibarrier();
    Work w6 = c.iall_reduce(dt::view_of(c2), ReduceOp::avg);
    for (Work* w : {&w6, &w5, &w4, &w3, &w2, &w1}) w->wait();
    expect_buf(what + ": all_reduce f32 sum", a.data(), a.size(), [&](std::size_t i) {
      return reduce_ref<float>(ReduceOp::sum, s, [&](int r) { return genv<float>(r, i, salt); });
    });
    expect_buf(what + ": broadcast bf16", b.data(), b.size(),
               [&](std::size_t i) { return genv<dt::bf16>(root, i, salt + 1); });
    expect_buf(what + ": all_gather i64", gout.data(), gout.size(), [&](std::size_t j) {
      return genv<std::int64_t>(static_cast<int>(j / 5), j % 5, salt + 2);
    });
    expect_buf(what + ": reduce_scatter f16 avg", rout.data(), rout.size(), [&](std::size_t i) {
      return reduce_ref<dt::f16>(ReduceOp::avg, s,
                                 [&](int r) { return genv<dt::f16>(r, me * 3 + i, salt + 3); });
    });
    expect_buf(what + ": all_reduce i32 avg", c2.data(), c2.size(), [&](std::size_t i) {
      return reduce_ref<std::int32_t>(ReduceOp::avg, s,
                                      [&](int r) { return genv<std::int32_t>(r, i, salt + 4); });
    });
    // A finished Work stays finished: no second division for avg.
    w6.wait();
    H.expect(w6.test(), what, "test() false after wait()");
    expect_buf(what + ": all_reduce i32 avg after repeated wait/test", c2.data(), c2.size(),
               [&](std::size_t i) {
                 return reduce_ref<std::int32_t>(
                     ReduceOp::avg, s, [&](int r) { return genv<std::int32_t>(r, i, salt + 4); });
               });
  });
}

double section_ms(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void full_suite(Comm& c, int id, int world_rank) {
  struct S {
    const char* name;
    std::function<void()> run;
  };
  const S parts[] = {
      {"all_reduce", [&] { suite_all_reduce(c, id); }},
      {"broadcast", [&] { suite_broadcast(c, id); }},
      {"all_gather", [&] { suite_all_gather(c, id); }},
      {"reduce_scatter", [&] { suite_reduce_scatter(c, id); }},
      {"send/recv", [&] { suite_p2p(c, id); }},
      {"barrier", [&] { suite_barrier(c); }},
      {"outstanding", [&] { suite_outstanding(c); }},
  };
  for (const S& p : parts) {
    const auto t0 = Clock::now();
    p.run();
    if (world_rank == 0 && std::getenv("DT_TEST_VERBOSE"))
      std::printf("  %-14s on %-16s %8.0f ms\n", p.name, c.name().c_str(), section_ms(t0));
  }
}

// ---- split ----------------------------------------------------------------------------------

// Parity split with key = -rank: the sub-communicator is ordered by descending world rank.
std::unique_ptr<Comm> check_parity_split(Comm& world) {
  const int wr = world.rank(), ws = world.size();
  std::unique_ptr<Comm> sub = world.split(wr % 2, -wr);
  const std::string what = str("split(", wr % 2, ", -rank) of ", world.name());
  if (!H.expect(sub != nullptr, what, "returned nullptr for a non-negative color")) return sub;
  int expect_size = 0, expect_rank = 0;
  for (int r = 0; r < ws; ++r)
    if (r % 2 == wr % 2) {
      ++expect_size;
      if (r > wr) ++expect_rank;
    }
  H.expect(sub->size() == expect_size, what, str("size ", sub->size(), ", expected ", expect_size));
  H.expect(sub->rank() == expect_rank, what, str("rank ", sub->rank(), ", expected ", expect_rank));
  H.expect(contains(sub->name(), "split") && contains(sub->name(), world.name()), what,
           str("name '", sub->name(), "'"));
  guarded(what + " membership", [&] {
    std::vector<std::int32_t> me{wr}, all(static_cast<std::size_t>(sub->size()), -1);
    sub->all_gather(dt::view_of(me), dt::view_of(all));
    std::vector<std::int32_t> want;
    for (int r = ws - 1; r >= 0; --r)
      if (r % 2 == wr % 2) want.push_back(r);
    H.expect(all == want, what, "members not the same-parity ranks in descending world order");
  });
  return sub;
}

// Color -1 on the last rank: it gets nullptr, the others a working communicator in rank order.
// max and min with a NaN on one rank: NaN at that element on every rank, on every path (small,
// regular and large buffers; shared memory, hierarchical and MPI), the others exact.
template <class T>
void check_nan_one(Comm& c, std::size_t n, int holder) {
  const int me = c.rank(), p = c.size();
  const std::size_t at = n / 2;
  for (ReduceOp op : {ReduceOp::max, ReduceOp::min}) {
    std::vector<T> buf(n);
    for (std::size_t i = 0; i < n; ++i)
      buf[i] = static_cast<T>((i * 7 + static_cast<std::size_t>(me) * 13) % 101);
    if (me == holder) buf[at] = std::numeric_limits<T>::quiet_NaN();
    c.all_reduce(dt::view_of(buf), op);
    std::size_t bad = 0, first = 0;
    for (std::size_t i = 0; i < n; ++i) {
      T want = static_cast<T>((i * 7) % 101);
      for (int r = 1; r < p; ++r) {
        const T v = static_cast<T>((i * 7 + static_cast<std::size_t>(r) * 13) % 101);
        want = op == ReduceOp::max ? std::max(want, v) : std::min(want, v);
      }
      const bool ok = i == at ? std::isnan(buf[i]) : buf[i] == want;
      if (!ok && bad++ == 0) first = i;
    }
    H.expect(bad == 0,
             str(op == ReduceOp::max ? "max" : "min", " of ", dt::dtype_name(dt::dtype_v<T>), " x ",
                 n, " with a NaN on rank ", holder, " at ", at),
             str(bad, " elements wrong, first ", first, ": ", static_cast<double>(buf[first])));
  }
}

void check_nan(Comm& c) {
  for (std::size_t n : {std::size_t{1}, std::size_t{4096}, std::size_t{300000}})
    for (int holder : {0, c.size() - 1}) {
      check_nan_one<float>(c, n, holder);
      check_nan_one<double>(c, n, holder);
    }
}

void check_negative_color(Comm& world) {
  const int wr = world.rank(), ws = world.size();
  const bool out = wr == ws - 1;
  std::unique_ptr<Comm> s = world.split(out ? -1 : 3, wr);
  const std::string what = str("split(", out ? -1 : 3, ", rank) of ", world.name());
  if (out) {
    H.expect(s == nullptr, what, "color -1 did not return nullptr");
    return;
  }
  if (!H.expect(s != nullptr, what, "returned nullptr")) return;
  H.expect(s->size() == ws - 1 && s->rank() == wr, what,
           str("rank ", s->rank(), " of ", s->size(), ", expected ", wr, " of ", ws - 1));
  case_all_reduce<std::int32_t>(*s, 7, ReduceOp::sum, Form::blocking, 99);
  case_broadcast<float>(*s, 7, s->size() - 1, Form::iwait, 98);
  // A split of a split.
  std::unique_ptr<Comm> s2 = s->split(0, s->rank());
  if (H.expect(s2 != nullptr, what + "/split", "returned nullptr")) {
    H.expect(s2->size() == s->size() && s2->rank() == s->rank(), what + "/split",
             "wrong rank/size");
    case_all_reduce<double>(*s2, 7, ReduceOp::avg, Form::iwait, 97);
  }
}

// ---- chunking -------------------------------------------------------------------------------

void check_chunking(Comm& world) {
  std::unique_ptr<Comm> d = world.split(0, world.rank());
  auto* m = dynamic_cast<dt::MpiComm*>(d.get());
  if (!H.expect(m != nullptr, "chunking", "split() of an MpiComm is not an MpiComm")) return;
  expect_throw<dt::InvalidArgument>("set_max_chunk(0)", [&] { m->set_max_chunk(0); });
  // A tag above this MPI's MPI_TAG_UB (8388607 with Open MPI's UCX layer): refused, naming it.
  int* tag_ub = nullptr;
  int has_ub = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &has_ub);
  if (has_ub && tag_ub && *tag_ub < INT_MAX) {
    float x = 0;
    expect_throw<dt::InvalidArgument>("send with a tag above MPI_TAG_UB",
                                      [&] { m->send(dt::view_of(&x, 1), 0, *tag_ub + 1); },
                                      {"MPI_TAG_UB = " + std::to_string(*tag_ub)});
  }
  // Non-blocking all_gather and reduce_scatter whose whole output (input) passes INT_MAX
  // elements, each rank's part within it: refused before MPI sees them (Open MPI's libnbc counts
  // the whole in an int). The views are never read: a small buffer stands for them.
  if (d->size() > 1) {
    const std::size_t part = (std::size_t{1} << 31) / static_cast<std::size_t>(d->size()) + 1;
    const std::size_t whole = part * static_cast<std::size_t>(d->size());
    float stand_in[1] = {0};
    const dt::ConstTensorView in_part{stand_in, part, dt::DType::f32};
    const dt::ConstTensorView in_whole{stand_in, whole, dt::DType::f32};
    const dt::TensorView out_part{stand_in, part, dt::DType::f32};
    const dt::TensorView out_whole{stand_in, whole, dt::DType::f32};
    expect_throw<dt::InvalidArgument>("iall_gather of more than INT_MAX elements in all",
                                      [&] { m->iall_gather(in_part, out_whole); },
                                      {"all_gather (non-blocking: the whole output)", "int range"});
    expect_throw<dt::InvalidArgument>(
        "ireduce_scatter of more than INT_MAX elements in all",
        [&] { m->ireduce_scatter(in_whole, out_part, ReduceOp::sum); },
        {"reduce_scatter (non-blocking: the whole input)", "int range"});
  }
  const std::size_t big = kBig + 3;
  m->set_max_chunk(1000);  // 1M + 3 elements: 1048 full chunks and one of 579
  for_each_dtype([&](auto z, int dk) {
    using T = decltype(z);
    case_all_reduce<T>(*d, big, kOps[(dk + 1) % 4], kForms[dk % 4], salt_of(50, dk, 0, 0, 0));
  });
  case_broadcast<double>(*d, big, d->size() - 1, Form::blocking, 51);
  case_broadcast<dt::bf16>(*d, big, 0, Form::iwait, 52);
  case_ring<std::int32_t>(*d, big, Form::blocking, 53, 300);
  case_ring<dt::f16>(*d, big, Form::itest, 54, 310);
  case_pair<std::uint8_t>(*d, big, Form::iwait, 55, 320);
  // Tiny chunks with a remainder: 7 = 3 + 3 + 1 and 6 = 3 + 3.
  m->set_max_chunk(3);
  for_each_dtype([&](auto z, int dk) {
    using T = decltype(z);
    for (std::size_t n : {std::size_t{6}, std::size_t{7}}) {
      case_all_reduce<T>(*d, n, kOps[dk % 4], Form::iwait, salt_of(56, dk, 0, 0, 0));
      case_all_reduce<T>(*d, n, ReduceOp::avg, Form::blocking, salt_of(57, dk, 0, 0, 0));
      case_broadcast<T>(*d, n, dk % d->size(), Form::blocking, salt_of(58, dk, 0, 0, 0));
      case_ring<T>(*d, n, Form::itest, salt_of(59, dk, 0, 0, 0), 330);
      case_ring<T>(*d, n, Form::blocking, salt_of(60, dk, 0, 0, 0), 340);
    }
  });
  // The world itself, restored afterwards.
  if (auto* wm = dynamic_cast<dt::MpiComm*>(&world)) {
    wm->set_max_chunk(1000);
    case_all_reduce<float>(world, big, ReduceOp::sum, Form::blocking, 61);
    case_all_reduce<std::int64_t>(world, big, ReduceOp::avg, Form::iwait, 62);
    case_broadcast<std::int32_t>(world, big, world.size() - 1, Form::blocking, 63);
    case_ring<dt::bf16>(world, big, Form::iwait, 65, 360);
    wm->set_max_chunk(std::size_t{1} << 30);
  } else {
    H.fail("chunking", "world is not an MpiComm");
  }
}

// ---- Work semantics -------------------------------------------------------------------------

void check_work_semantics(Comm& c) {
  {
    Work w;
    H.expect(!w.valid(), "empty Work", "valid() is true");
    expect_throw<dt::InvalidArgument>("empty Work::wait", [&] { w.wait(); });
    expect_throw<dt::InvalidArgument>("empty Work::test", [&] { w.test(); });
  }
  if (c.size() < 2) return;
  const int me = c.rank();
  const int tag = 900;

  // 1. A receive times out (message names the receive), stays pending, and completes later.
  c.barrier();
  if (me == 0) {
    std::vector<std::int32_t> buf(16, -1);
    Work w = c.irecv(dt::view_of(buf), 1, tag);
    guarded("irecv timeout", [&] {
      H.expect(!w.test(), "irecv timeout", "test() true before the peer sent");
      expect_throw<dt::CommError>("irecv wait(50ms) before the send", [&] { w.wait(Millis(50)); },
                                  {"recv", "from 1", "tag 900", "timed out", "50 ms"});
      expect_throw<dt::CommError>("irecv second wait(30ms) before the send",
                                  [&] { w.wait(Millis(30)); }, {"recv", "30 ms"});
      w.wait();
      expect_buf("irecv after timed-out waits", buf.data(), buf.size(),
                 [&](std::size_t i) { return genv<std::int32_t>(1, i, 900); });
      H.expect(w.test(), "irecv timeout", "test() false after wait()");
    });
  } else if (me == 1) {
    guarded("irecv timeout (sender)", [&] {
      std::this_thread::sleep_for(Millis(600));
      const std::vector<std::int32_t> buf = filled<std::int32_t>(16, 1, 900);
      c.send(dt::view_of(buf), 0, tag);
    });
  }

  // 2. Truncation: a message longer than the receive buffer is a stored, rethrown CommError.
  c.barrier();
  if (me == 0) {
    guarded("truncated irecv", [&] {
      std::vector<std::int32_t> small(4, -1);
      Work w = c.irecv(dt::view_of(small), 1, tag + 1);
      expect_throw<dt::CommError>("truncated irecv: wait", [&] { w.wait(); }, {"recv", "from 1"});
      expect_throw<dt::CommError>("truncated irecv: second wait rethrows", [&] { w.wait(); });
      expect_throw<dt::CommError>("truncated irecv: test rethrows", [&] { w.test(); });
      expect_throw<dt::CommError>("truncated irecv: wait(timeout) rethrows",
                                  [&] { w.wait(Millis(10)); });
      expect_throw<dt::CommError>("truncated blocking recv",
                                  [&] { c.recv(dt::view_of(small), 1, tag + 2); });
      expect_throw<dt::CommError>(
          "truncated blocking recv with timeout",
          [&] { c.recv(dt::view_of(small), 1, tag + 3, CommOptions{Millis(60000)}); }, {"recv"});
      // Polling test() sees the error too.
      Work w2 = c.irecv(dt::view_of(small), 1, tag + 4);
      expect_throw<dt::CommError>("truncated irecv: test", [&] {
        while (!w2.test()) std::this_thread::yield();
      });
      expect_throw<dt::CommError>("truncated irecv: wait after failed test", [&] { w2.wait(); });
    });
  } else if (me == 1) {
    guarded("truncated irecv (sender)", [&] {
      const std::vector<std::int32_t> big = filled<std::int32_t>(8, 1, 901);
      for (int k = 1; k <= 4; ++k) c.send(dt::view_of(big), 0, tag + k);
    });
  }

  // 2b. comm.hpp: a receive delivers exactly buf.numel elements; a shorter message is an error
  // (not a silently stale buffer tail).
  {
    c.barrier();
    if (me == 0) {
      std::vector<std::int32_t> buf(8, -1);
      expect_throw<dt::CommError>("blocking recv of a shorter message",
                                  [&] { c.recv(dt::view_of(buf), 1, tag + 5); }, {"recv"});
      expect_throw<dt::CommError>("irecv of a shorter message",
                                  [&] { c.irecv(dt::view_of(buf), 1, tag + 6).wait(); }, {"recv"});
    } else if (me == 1) {
      guarded("short message (sender)", [&] {
        const std::vector<std::int32_t> shorter = filled<std::int32_t>(4, 1, 905);
        c.send(dt::view_of(shorter), 0, tag + 5);
        c.send(dt::view_of(shorter), 0, tag + 6);
      });
    }
  }

  // 3. A collective times out on rank 0 while the others are late, then completes.
  c.barrier();
  if (me == 0) {
    guarded("ibarrier timeout", [&] {
      Work w = c.ibarrier();
      expect_throw<dt::CommError>("ibarrier wait(20ms) while peers are late",
                                  [&] { w.wait(Millis(20)); }, {"barrier", "timed out"});
      w.wait();
    });
  } else {
    // The late ranks use the same (non-blocking) form: MPI never matches a non-blocking
    // collective with a blocking one (MPI-3.1 section 5.12), and MpiComm maps them one-to-one.
    std::this_thread::sleep_for(Millis(500));
    guarded("ibarrier timeout (late rank)", [&] { c.ibarrier().wait(); });
  }

  // 4. Same for all_reduce avg: after a timed-out wait the result is divided exactly once.
  c.barrier();
  {
    std::vector<float> buf = filled<float>(7, me, 902);
    if (me == 0) {
      guarded("iall_reduce timeout", [&] {
        Work w = c.iall_reduce(dt::view_of(buf), ReduceOp::avg);
        expect_throw<dt::CommError>("iall_reduce wait(20ms) while peers are late",
                                    [&] { w.wait(Millis(20)); }, {"all_reduce", "avg"});
        w.wait();
        w.wait();
        w.test();
      });
    } else {
      std::this_thread::sleep_for(Millis(500));
      guarded("iall_reduce timeout (late rank)",
              [&] { c.iall_reduce(dt::view_of(buf), ReduceOp::avg).wait(); });
    }
    const int s = c.size();
    expect_buf("all_reduce avg after a timed-out wait", buf.data(), buf.size(), [&](std::size_t i) {
      return reduce_ref<float>(ReduceOp::avg, s, [&](int r) { return genv<float>(r, i, 902); });
    });
  }

  // 5. A blocking call with CommOptions::timeout throws when the peers are late (on its own
  // communicator, which is then used again once everyone has joined). Every rank passes a
  // timeout, so every rank uses the same MPI form.
  c.barrier();
  {
    std::unique_ptr<Comm> d = c.split(0, me);
    if (me == 0) {
      expect_throw<dt::CommError>("barrier(timeout 20ms) while peers are late",
                                  [&] { d->barrier(CommOptions{Millis(20)}); }, {"barrier"});
    } else {
      std::this_thread::sleep_for(Millis(500));
      guarded("barrier(timeout) (late rank)", [&] { d->barrier(CommOptions{Millis(60000)}); });
    }
    case_all_reduce<std::int64_t>(*d, 7, ReduceOp::sum, Form::blocking, 903);
  }
  c.barrier();

  // 6. A collective given up on rank 0 (its wait timed out), whose communicator then goes before
  // the late ranks come to it (once rank 0 says so): rank 0's part stays pending in MPI, and
  // theirs completes. (Open MPI drops the pending part of a freed communicator: the others waited
  // for it forever, or rank 0 crashed in MPI's progress at 4 ranks.)
  {
    std::unique_ptr<Comm> e = c.split(0, me);
    std::int32_t gone = 1;
    if (me == 0) {
      expect_throw<dt::CommError>("barrier(timeout 20ms) before its communicator goes",
                                  [&] { e->barrier(CommOptions{Millis(20)}); }, {"barrier"});
      e.reset();
      for (int r = 1; r < c.size(); ++r) c.send(dt::view_of(&gone, 1), r, 8300);
    } else {
      c.recv(dt::view_of(&gone, 1), 0, 8300);
      guarded("barrier(timeout) after rank 0's communicator went",
              [&] { e->barrier(CommOptions{Millis(20000)}); });
    }
  }
  c.barrier();
}

// ---- argument validation --------------------------------------------------------------------

void check_arguments(Comm& c) {
  using dt::InvalidArgument;
  const int s = c.size();
  const std::string on = " on " + c.name();
  std::vector<float> in(3, 1.0f), out_bad(3 * static_cast<std::size_t>(s) + 1),
      out_short(3 * static_cast<std::size_t>(s) - 1);
  std::vector<double> out_d(3 * static_cast<std::size_t>(s));
  const CommOptions to{Millis(60000)};
  auto cin = dt::view_of(static_cast<const std::vector<float>&>(in));

  expect_throw<InvalidArgument>("all_gather output too long" + on,
                                [&] { c.all_gather(cin, dt::view_of(out_bad)); });
  expect_throw<InvalidArgument>("all_gather output too short" + on,
                                [&] { c.all_gather(cin, dt::view_of(out_short)); });
  expect_throw<InvalidArgument>("all_gather(timeout) output size" + on,
                                [&] { c.all_gather(cin, dt::view_of(out_bad), to); });
  expect_throw<InvalidArgument>("iall_gather output size" + on,
                                [&] { c.iall_gather(cin, dt::view_of(out_bad)); });
  expect_throw<InvalidArgument>("all_gather f32 -> f64" + on,
                                [&] { c.all_gather(cin, dt::view_of(out_d)); });
  expect_throw<InvalidArgument>("iall_gather f32 -> f64" + on,
                                [&] { c.iall_gather(cin, dt::view_of(out_d)); });

  std::vector<float> rs_out(3);
  std::vector<double> rs_out_d(3);
  auto rs_in = dt::view_of(static_cast<const std::vector<float>&>(out_bad));
  expect_throw<InvalidArgument>("reduce_scatter input size" + on, [&] {
    c.reduce_scatter(rs_in, dt::view_of(rs_out), ReduceOp::sum);
  });
  expect_throw<InvalidArgument>("ireduce_scatter input size" + on, [&] {
    c.ireduce_scatter(rs_in, dt::view_of(rs_out), ReduceOp::avg);
  });
  std::vector<float> rs_in_ok(3 * static_cast<std::size_t>(s));
  expect_throw<InvalidArgument>("reduce_scatter f32 -> f64" + on, [&] {
    c.reduce_scatter(dt::view_of(static_cast<const std::vector<float>&>(rs_in_ok)),
                     dt::view_of(rs_out_d), ReduceOp::max);
  });

  std::vector<std::int32_t> b(4);
  for (int root : {s, s + 5, -1}) {
    const std::string r = " root " + std::to_string(root) + on;
    expect_throw<InvalidArgument>("broadcast" + r, [&] { c.broadcast(dt::view_of(b), root); },
                                  {"root"});
    expect_throw<InvalidArgument>("broadcast(timeout)" + r,
                                  [&] { c.broadcast(dt::view_of(b), root, to); });
    expect_throw<InvalidArgument>("ibroadcast" + r, [&] { c.ibroadcast(dt::view_of(b), root); });
  }
  for (int peer : {s, s + 1, -1}) {
    const std::string p = " peer " + std::to_string(peer) + on;
    expect_throw<InvalidArgument>("send" + p, [&] { c.send(dt::view_of(b), peer, 1); }, {"peer"});
    expect_throw<InvalidArgument>("send(timeout)" + p,
                                  [&] { c.send(dt::view_of(b), peer, 1, to); });
    expect_throw<InvalidArgument>("isend" + p, [&] { c.isend(dt::view_of(b), peer, 1); });
    expect_throw<InvalidArgument>("recv" + p, [&] { c.recv(dt::view_of(b), peer, 1); });
    expect_throw<InvalidArgument>("recv(timeout)" + p,
                                  [&] { c.recv(dt::view_of(b), peer, 1, to); });
    expect_throw<InvalidArgument>("irecv" + p, [&] { c.irecv(dt::view_of(b), peer, 1); });
  }
  // Nothing above started any traffic: the communicator still works.
  case_all_reduce<std::int32_t>(c, 7, ReduceOp::max, Form::blocking, 904);
}

// Independent check of the reference rounding used for avg (against hand-computed values).
void check_reference_rounding() {
  // 7/3 = 2.333.. in float; bf16 keeps 8 significant bits: 2.328125; f16 11 bits: 2.333984375.
  const float q = 7.0f / 3.0f;
  H.expect(round_mantissa(q, 7) == 2.328125, "reference rounding bf16", str(round_mantissa(q, 7)));
  H.expect(round_mantissa(q, 10) == 2.333984375, "reference rounding f16",
           str(round_mantissa(q, 10)));
  // Ties to even: 1 + 2^-8 is halfway between bf16 1 and 1 + 2^-7 -> 1.
  H.expect(round_mantissa(1.0 + std::ldexp(1.0, -8), 7) == 1.0, "reference rounding tie", "");
  H.expect(round_mantissa(1.0 + 3 * std::ldexp(1.0, -8), 7) == 1.0 + std::ldexp(1.0, -6),
           "reference rounding tie up", "");
  // Encoding round-trips the small integers the inputs use.
  for (int v = -20; v <= 77; ++v) {
    H.expect(dec(enc<dt::bf16>(v)) == v && dec(enc<dt::f16>(v)) == v, "bf16/f16 small integers",
             std::to_string(v));
  }
}

}  // namespace

// all_reduce on buffers placed in the shared-memory arena (the zero-copy path) at several
// offsets, every dtype and op, odd sizes, against the same references.
void check_arena(dt::ShmComm& c) {
  const std::size_t sizes[] = {0, 1, 7, 1000, 300001};
  for_each_dtype([&](auto z, int dk) {
    using T = decltype(z);
    for (int ok = 0; ok < 4; ++ok)
      for (std::size_t n : sizes) {
        const std::size_t off = (static_cast<std::size_t>(dk) * 7 + n % 5) * 64;
        if ((off + n) * sizeof(T) > c.arena_bytes()) continue;
        T* buf = reinterpret_cast<T*>(static_cast<char*>(c.arena()) + off);
        const std::uint32_t salt = salt_of(90, dk, ok, static_cast<int>(n % 1000), 0);
        const ReduceOp op = kOps[ok];
        const std::string what = str("arena all_reduce(", dt::dtype_name(dt::dtype_v<T>), " x ", n,
                                     ", ", dt::reduce_op_name(op), ", offset ", off, ") on ",
                                     c.name(), " [", c.path("all_reduce", n * sizeof(T)), "]");
        guarded(what, [&] {
          const std::vector<T> init = filled<T>(n, c.rank(), salt);
          std::copy(init.begin(), init.end(), buf);
          if (ok % 2 == 0)
            c.all_reduce(dt::TensorView{buf, n, dt::dtype_v<T>}, op);
          else
            c.iall_reduce(dt::TensorView{buf, n, dt::dtype_v<T>}, op).wait();
          const int s = c.size();
          expect_buf(what, buf, n, [&](std::size_t i) {
            return reduce_ref<T>(op, s, [&](int r) { return genv<T>(r, i, salt); });
          });
        });
      }
  });
}

// Ranks that disagree about the buffer (arena on some, not on others) get an error, not a hang
// or wrong data; the communicator is unusable afterwards, so this runs last. Only meaningful
// with two or more ranks on a node. (A small message ignores the arena: it is copied anyway.)
void check_arena_mismatch(dt::ShmComm& c) {
  constexpr std::size_t n = 2 * dt::ShmComm::kSmallBytes / sizeof(float);
  if (c.local_size() > 1 && c.path("all_reduce", n * sizeof(float)) != std::string("mpi")) {
    std::vector<float> outside(n, 1.0f);
    float* inside = static_cast<float*>(c.arena());
    const bool use_inside = c.local_rank() == 0;
    expect_throw<dt::CommError>(
        str("arena/outside mismatch on ", c.name()),
        [&] {
          c.all_reduce(use_inside ? dt::TensorView{inside, n, DType::f32} : dt::view_of(outside),
                       ReduceOp::sum, CommOptions{Millis(20000)});
        },
        {"segment offset"});
  }
}

// The largest contribution of one rank that takes the small path on this node.
std::size_t small_limit(const dt::ShmComm& c) {
  return std::min(dt::ShmComm::kSmallBytes,
                  dt::ShmComm::kSmallTotal / static_cast<std::size_t>(c.local_size()));
}

// A float of rank r at element i of case `salt`, with a spread of exponents and mantissas, so that
// sums round and their order shows in the bits.
float spread(int r, std::size_t i, std::uint32_t salt) {
  const int a = gen(r, i, salt, false), b = gen(r, i, salt + 1, false);
  return std::ldexp(static_cast<float>(a) + 0.3183099f * static_cast<float>(b + 21), b / 2);
}

// Collectives around the point where the low 32 bits of the round counter, which the progress
// words carry, wrap: results stay exact (a chunk is never taken before it is reduced).
void check_round_wrap(dt::ShmComm& c) {
  const int me = c.rank(), s = c.size();
  c.barrier();
  c.set_rounds_for_test((std::uint64_t{1} << 32) - 3);
  c.barrier();
  for (int k = 0; k < 6; ++k) {
    const std::size_t n = 70000 + static_cast<std::size_t>(k) * 999;  // several pieces and chunks
    std::vector<float> buf(n);
    for (std::size_t i = 0; i < n; ++i) buf[i] = spread(me, i, 40 + static_cast<std::uint32_t>(k));
    c.all_reduce(dt::view_of(buf), ReduceOp::max);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) {
      float want = spread(0, i, 40 + static_cast<std::uint32_t>(k));
      for (int r = 1; r < s; ++r)
        want = std::max(want, spread(r, i, 40 + static_cast<std::uint32_t>(k)));
      wrong += buf[i] != want;
    }
    H.expect(wrong == 0,
             str("all_reduce ", k, " around the wrap of the round counter on ", c.name()),
             str(wrong, " of ", n, " elements wrong"));
  }
}

// The small-message path of one node: the path each size takes; a buffer reduced whole (the
// other path) and in small pieces gives the same bits, those of a float sum in rank order made
// here; and thousands of consecutive small collectives of changing sizes, with ranks delayed in
// turn so that some run ahead into the next call while others still read this one (each rank's
// two slots, used in turn), interleaved with larger ones, all checked.
void check_small(dt::ShmComm& c) {
  if (c.num_nodes() != 1 || c.path("all_reduce", 8) == std::string("mpi")) return;
  const int s = c.size(), me = c.rank();
  const std::size_t limit = small_limit(c), L = static_cast<std::size_t>(s);
  const std::string on = " on " + c.name();
  auto expect_path = [&](const char* op, std::size_t bytes, const char* want) {
    H.expect(c.path(op, bytes) == std::string(want), str("path of ", op, " of ", bytes, " B", on),
             str(c.path(op, bytes), " instead of ", want));
  };
  expect_path("all_reduce", 0, "shm-small");
  expect_path("all_reduce", limit, "shm-small");
  expect_path("all_reduce", limit + 1, "shm");
  expect_path("broadcast", limit, "shm-small");
  expect_path("all_gather", limit + 1, "shm");
  expect_path("reduce_scatter", limit / L, "shm-small");  // its output: L times that goes in
  expect_path("reduce_scatter", limit / L + 1, "shm");

  guarded("small pieces against the whole" + on, [&] {
    const std::size_t piece = limit / sizeof(float), n = 5 * piece + 3;
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
      std::vector<float> whole(n), pieces(n), want(n);
      for (std::size_t i = 0; i < n; ++i) {
        whole[i] = pieces[i] = spread(me, i, 77);
        float acc = spread(0, i, 77);
        for (int r = 1; r < s; ++r) acc += spread(r, i, 77);
        want[i] = op == ReduceOp::avg ? acc / static_cast<float>(s) : acc;
      }
      c.all_reduce(dt::view_of(whole), op);
      for (std::size_t b = 0; b < n; b += piece)
        c.all_reduce(dt::TensorView{pieces.data() + b, std::min(piece, n - b), DType::f32}, op);
      const std::string what = str("f32 ", dt::reduce_op_name(op), " of ", n, " elements", on);
      ++H.checks;
      if (std::memcmp(whole.data(), want.data(), n * sizeof(float)) != 0)
        H.fail(what, "whole buffer (path " + std::string(c.path("all_reduce", n * 4)) +
                         ") differs from the float sum in rank order");
      ++H.checks;
      if (std::memcmp(pieces.data(), want.data(), n * sizeof(float)) != 0)
        H.fail(what, str("in pieces of ", piece, " (path ", c.path("all_reduce", piece * 4),
                         ") differs from the float sum in rank order"));
    }
  });

  guarded("consecutive small collectives" + on, [&] {
    const std::size_t most = limit / sizeof(std::int32_t);
    int bad = 0;
    for (int round = 0; round < 4000 && bad < 3; ++round) {
      // A rank delayed now and then (a different one each time) lets the others run ahead.
      if ((round + me) % 3 == 0) {
        const auto until = Clock::now() + std::chrono::microseconds(5 + (round * 7 + me) % 40);
        while (Clock::now() < until) {
        }
      }
      const auto salt = static_cast<std::uint32_t>(round);
      const bool large = round % 50 == 49;  // the other path, now and then
      const std::size_t n = large ? 3 * most + 1 : static_cast<std::size_t>(round * 37) % most;
      const int kind = round % 4;
      std::string what;
      bool ok = true;
      if (kind == 0) {
        std::vector<std::int32_t> buf = filled<std::int32_t>(n, me, salt);
        c.all_reduce(dt::view_of(buf), ReduceOp::sum);
        for (std::size_t i = 0; i < n && ok; ++i) {
          std::int64_t want = 0;
          for (int r = 0; r < s; ++r) want += genv<std::int32_t>(r, i, salt);
          ok = buf[i] == want;
        }
        what = "all_reduce";
      } else if (kind == 1) {
        const int root = round % s;
        std::vector<std::int32_t> buf = filled<std::int32_t>(n, me == root ? root : 100 + me, salt);
        c.broadcast(dt::view_of(buf), root);
        for (std::size_t i = 0; i < n && ok; ++i) ok = buf[i] == genv<std::int32_t>(root, i, salt);
        what = "broadcast";
      } else if (kind == 2) {
        const std::size_t m = n / L;
        const std::vector<std::int32_t> in = filled<std::int32_t>(m, me, salt);
        std::vector<std::int32_t> out(m * L, -99);
        c.all_gather(dt::view_of(in), dt::view_of(out));
        for (std::size_t j = 0; j < m * L && ok; ++j)
          ok = out[j] == genv<std::int32_t>(static_cast<int>(j / m), j % m, salt);
        what = "all_gather";
      } else {
        const std::size_t m = n / L;
        const std::vector<std::int32_t> in = filled<std::int32_t>(m * L, me, salt);
        std::vector<std::int32_t> out(m, -99);
        c.reduce_scatter(dt::view_of(in), dt::view_of(out), ReduceOp::max);
        for (std::size_t i = 0; i < m && ok; ++i) {
          int want = INT_MIN;
          for (int r = 0; r < s; ++r)
            want =
                std::max(want, genv<std::int32_t>(r, static_cast<std::size_t>(me) * m + i, salt));
          ok = out[i] == want;
        }
        what = "reduce_scatter";
      }
      ++H.checks;
      if (!ok) {
        ++bad;
        H.fail(str(what, " #", round, " of ", n, " elements", on), "wrong values");
      }
    }
  });
}

// Where every wait of a collective is an MPI wait (one rank per node: all_reduce's part across
// nodes, the MPI fallbacks), kPolledWait polls instead of blocking inside MPI, whose waits spin.
// Checked on a rank that waits 0.8 s for rank 0, on both kinds of thread:
//  - a real-time thread (SCHED_FIFO, as a QoS tier's progress thread), which no ordinary thread of
//    its core could preempt, sleeps between polls: it spends well under half of the wait on a CPU;
//  - an ordinary thread yields between polls: beside a thread that spins on the same CPU it gets
//    well under half of what that thread gets (one that spins inside MPI gets about as much).
// Where this process may not make a thread real-time, that half is skipped with a line.
void check_polled_idle(dt::ShmComm& c) {
  float most_local = static_cast<float>(c.local_size());  // nodes may differ: agree
  c.all_reduce(dt::TensorView{&most_local, 1, DType::f32}, ReduceOp::max);
  if (most_local != 1.0f || c.size() < 2) return;
  const int s = c.size(), me = c.rank();
  const std::size_t n = std::size_t{1} << 18;  // 1 MiB of f32: all_reduce across nodes
  const CommOptions polled{dt::kPolledWait};
  std::vector<float> buf(n);
  // One late call of `what` (the same on every rank), its wait checked on this thread: against the
  // wall time on a real-time thread, against a spinning neighbour on its CPU otherwise.
  auto waited = [&](const char* what, bool realtime, const std::function<void()>& call) {
    std::unique_ptr<SharedCore> core;
    if (me != 0 && !realtime) core = std::make_unique<SharedCore>();
    c.barrier();
    if (me == 0) std::this_thread::sleep_for(std::chrono::milliseconds(800));
    const double cpu0 = thread_cpu_s(), spin0 = core ? core->spinner_cpu_s() : 0;
    const auto t0 = Clock::now();
    call();
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    const double cpu = thread_cpu_s() - cpu0;
    const double spin = core ? core->spinner_cpu_s() - spin0 : 0;
    if (me == 0) return;
    const std::string kind = realtime ? " on a real-time thread" : " on an ordinary thread";
    H.expect(wall > 0.5, str(what, " with kPolledWait", kind, " waits for rank 0 on ", c.name()),
             str("returned after ", wall, " s"));
    if (realtime)
      H.expect(cpu < 0.5 * wall, str(what, " with kPolledWait", kind, " sleeps on ", c.name()),
               str(cpu, " s of CPU in ", wall, " s of waiting (path ", c.path(what, n * 4), ")"));
    else
      H.expect(cpu < 0.5 * spin,
               str(what, " with kPolledWait", kind, " gives its CPU away on ", c.name()),
               str(cpu, " s of CPU against ", spin, " s of a thread spinning on CPU ", core->cpu(),
                   " in ", wall, " s of waiting (path ", c.path(what, n * 4), ")"));
  };
  auto both = [&](bool realtime) {
    for (std::size_t i = 0; i < n; ++i) buf[i] = spread(me, i, 5);
    waited("all_reduce", realtime, [&] { c.all_reduce(dt::view_of(buf), ReduceOp::sum, polled); });
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) {
      double want = 0;
      for (int r = 0; r < s; ++r) want += spread(r, i, 5);
      wrong += std::fabs(buf[i] - want) > 1e-5 * (1 + std::fabs(want));
    }
    H.expect(wrong == 0, str("all_reduce with kPolledWait on ", c.name()),
             str(wrong, " of ", n, " elements wrong"));
    for (std::size_t i = 0; i < n; ++i) buf[i] = me == 0 ? static_cast<float>(i) : -1.0f;
    waited("broadcast", realtime, [&] { c.broadcast(dt::view_of(buf), 0, polled); });
    for (std::size_t i = 0; i < n; ++i) wrong += buf[i] != static_cast<float>(i);
    H.expect(wrong == 0, str("broadcast with kPolledWait on ", c.name()),
             str(wrong, " of ", n, " elements wrong"));
  };
  both(false);
  // The same calls from a new thread made real-time where allowed (every rank makes them, also
  // where it is not: the checks then stay away).
  int rt = 0;
  std::thread t([&] {
    sched_param sp{};
    sp.sched_priority = 1;
    // As a QoS tier makes its threads real-time (src/qos/qos.cpp): with SCHED_RESET_ON_FORK.
    rt = sched_setscheduler(0, SCHED_FIFO | SCHED_RESET_ON_FORK, &sp) == 0 ? 1 : 0;
    float all = static_cast<float>(rt);
    c.all_reduce(dt::TensorView{&all, 1, DType::f32}, ReduceOp::min);
    if (all == 1.0f) {
      both(true);
    } else if (me == 0) {
      std::printf("skipped: kPolledWait on a real-time thread (SCHED_FIFO not allowed here)\n");
    }
  });
  t.join();
}

// The same on the regular (staged) path, with sizes alike: another reduce op, another dtype,
// another broadcast root; and sizes that differ only past the staging area's first piece (the
// first rounds alike, the calls not). Each case breaks its communicator.
void check_regular_mismatch(Comm& world, const dt::ShmConfig& cfg) {
  const std::size_t n = 2 * dt::ShmComm::kSmallBytes;  // elements: past the small path
  const std::size_t piece = cfg.staging_bytes / sizeof(float);
  for (int variant = 0; variant < 4; ++variant) {
    auto c = dt::ShmComm::create(dynamic_cast<dt::MpiComm&>(world), "regular-mismatch", cfg);
    const bool odd = c->local_rank() == 0;
    std::vector<float> f(n, 1.0f);
    std::vector<std::int32_t> i(n, 1);
    const CommOptions o{Millis(20000)};
    std::string want_a, want_b, what;
    std::function<void()> call;
    if (variant == 0) {
      what = "sum and max";
      call = [&] { c->all_reduce(dt::view_of(f), odd ? ReduceOp::max : ReduceOp::sum, o); };
      want_a = str("all_reduce(f32 x ", n, ", max)");
      want_b = str("all_reduce(f32 x ", n, ", sum)");
    } else if (variant == 1) {
      what = "f32 and i32";
      call = [&] {
        odd ? c->all_reduce(dt::view_of(i), ReduceOp::sum, o)
            : c->all_reduce(dt::view_of(f), ReduceOp::sum, o);
      };
      want_a = str("all_reduce(i32 x ", n, ", sum)");
      want_b = str("all_reduce(f32 x ", n, ", sum)");
    } else if (variant == 2) {
      what = "roots 0 and 1";
      call = [&] { c->broadcast(dt::view_of(f), odd ? 1 : 0, o); };
      want_a = str("broadcast(f32 x ", n, ", root 1)");
      want_b = str("broadcast(f32 x ", n, ", root 0)");
    } else {
      what = "sizes alike in the first piece";
      f.assign(odd ? piece + 5 : piece, 1.0f);
      call = [&] { c->all_reduce(dt::view_of(f), ReduceOp::sum, o); };
      want_a = str("all_reduce(f32 x ", piece + 5, ", sum)");
      want_b = str("all_reduce(f32 x ", piece, ", sum)");
    }
    const std::string msg = expect_throw<dt::CommError>(
        str(what, " on the regular path of ", c->name()), call, {"collective #1"});
    H.expect(contains(msg, want_a) && contains(msg, want_b),
             what + " on the regular path: the message names both calls", msg);
    expect_throw<dt::CommError>(str("all_reduce after the mismatch on ", c->name()),
                                [&] { c->all_reduce(dt::view_of(f), ReduceOp::sum); },
                                {"failed earlier"});
  }
}

// Settings that differ between ranks (rank 0's one larger): every rank refuses the communicator,
// naming the setting and the range the ranks passed, instead of mapping mismatched segments or
// waiting on a path the others do not take.
void check_config_mismatch(Comm& world, const dt::ShmConfig& cfg) {
  const char* names[] = {"arena_bytes", "staging_bytes", "chunk_bytes", "min_bytes",
                         "simulated_nodes"};
  for (int f = 0; f < 5; ++f) {
    dt::ShmConfig mine = cfg;
    const bool odd = world.rank() == 0;
    std::string range;
    switch (f) {
      case 0:
        if (odd) mine.arena_bytes += 4096;
        range = str(cfg.arena_bytes, " to ", cfg.arena_bytes + 4096);
        break;
      case 1:
        if (odd) mine.staging_bytes *= 2;
        range = str(cfg.staging_bytes, " to ", cfg.staging_bytes * 2);
        break;
      case 2:
        if (odd) mine.chunk_bytes *= 2;
        range = str(cfg.chunk_bytes, " to ", cfg.chunk_bytes * 2);
        break;
      case 3:
        if (odd) mine.min_bytes += 1024;
        range = str(cfg.min_bytes, " to ", cfg.min_bytes + 1024);
        break;
      default:
        if (odd) mine.simulated_nodes += 1;
        range = str(cfg.simulated_nodes, " to ", cfg.simulated_nodes + 1);
        break;
    }
    if (world.size() == 1) range = "";  // nobody to differ from: it is created
    const std::string what = str("ShmComm::create with ", names[f], " differing on rank 0");
    if (world.size() == 1) {
      H.expect(dt::ShmComm::create(dynamic_cast<dt::MpiComm&>(world), "mismatch", mine) != nullptr,
               what + " (one rank)", "not created");
      continue;
    }
    expect_throw<dt::InvalidArgument>(
        what, [&] { dt::ShmComm::create(dynamic_cast<dt::MpiComm&>(world), "mismatch", mine); },
        {str("passed different ", names[f], " (from ", range, ")"), "mismatch"});
  }
  // The communicator still works for settings that agree.
  auto c = dt::ShmComm::create(dynamic_cast<dt::MpiComm&>(world), "agreed", cfg);
  std::vector<float> x(1000, 1.0f);
  c->all_reduce(dt::view_of(x), ReduceOp::sum);
  H.expect(x[999] == static_cast<float>(world.size()), "all_reduce after the refusals",
           str("got ", x[999]));
}

// Local rank 0 gives up an all_reduce on its timeout (the others come late) and destroys the
// communicator: the destruction returns at once, not when (or if) the peers arrive, and the
// peers, arriving later, get a CommError naming rank 0 instead of waiting for it forever. The
// same after a rank destroyed a communicator the others go on using.
void check_give_up(Comm& world, const dt::ShmConfig& cfg) {
  auto c = dt::ShmComm::create(dynamic_cast<dt::MpiComm&>(world), "give-up", cfg);
  if (c->local_size() < 2 || c->num_nodes() != 1) return;
  const bool first = c->local_rank() == 0;
  std::vector<float> buf(2 * dt::ShmComm::kSmallBytes, 1.0f);
  if (first) {
    expect_throw<dt::CommError>(
        "all_reduce alone on its timeout",
        [&] { c->all_reduce(dt::view_of(buf), ReduceOp::sum, CommOptions{Millis(200)}); },
        {"timed out"});
    const auto t0 = Clock::now();
    c.reset();
    const double ms = section_ms(t0);
    H.expect(ms < 5000, "destruction after a timeout", str("took ", ms, " ms"));
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    expect_throw<dt::CommError>(
        "all_reduce after local rank 0 gave up",
        [&] { c->all_reduce(dt::view_of(buf), ReduceOp::sum, CommOptions{Millis(20000)}); },
        {"local rank 0 gave up"});
  }
  world.barrier();
  // Local rank 0 destroys a communicator after a finished all_reduce; the others, calling one
  // more, fail naming it instead of waiting for it.
  auto d = dt::ShmComm::create(dynamic_cast<dt::MpiComm&>(world), "left", cfg);
  d->all_reduce(dt::view_of(buf), ReduceOp::sum);
  if (first) {
    d.reset();
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    expect_throw<dt::CommError>("all_reduce after local rank 0 destroyed its communicator",
                                [&] { d->all_reduce(dt::view_of(buf), ReduceOp::sum); },
                                {"local rank 0 has destroyed the communicator"});
  }
  world.barrier();
  // A call that timed out and then ran (its peers came late) does not make a later destruction
  // give up an operation in flight: it waits for the peers as after no timeout, and they finish
  // it. The timeout's message names the call.
  auto e = dt::ShmComm::create(dynamic_cast<dt::MpiComm&>(world), "late", cfg);
  std::vector<float> u(buf.size(), 1.0f);
  if (first) {
    expect_throw<dt::CommError>(
        "all_reduce before late peers, on its timeout",
        [&] { e->all_reduce(dt::view_of(buf), ReduceOp::sum, CommOptions{Millis(50)}); },
        {"all_reduce(f32 x " + std::to_string(buf.size()) + ", sum) on late", "timed out"});
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    e->all_reduce(dt::view_of(buf), ReduceOp::sum);
  }
  e->all_reduce(dt::view_of(u), ReduceOp::sum);
  const float L = static_cast<float>(e->local_size());
  if (first) {
    { const Work w = e->iall_reduce(dt::view_of(u), ReduceOp::sum); }
    e.reset();
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    guarded("all_reduce in flight at local rank 0's destruction", [&] {
      e->all_reduce(dt::view_of(u), ReduceOp::sum, CommOptions{Millis(20000)});
      H.expect(u[0] == L * L, "all_reduce in flight at local rank 0's destruction",
               str("u[0] = ", u[0], ", expected ", L * L));
    });
  }
  world.barrier();
}

// A staging area too small for a node's local ranks, where another node's (of fewer ranks) is
// not: refused on every rank, not on that node's alone while the others wait in the creation.
void check_tiny_staging(Comm& world, dt::ShmConfig cfg) {
  cfg.staging_bytes = 8;  // one element: enough for a node of one rank
  const int nodes = cfg.simulated_nodes > 0 ? cfg.simulated_nodes : 1;
  if (world.size() <= nodes) return;  // every node of one rank: nothing to refuse
  expect_throw<dt::InvalidArgument>(
      "a staging area of 8 bytes",
      [&] { dt::ShmComm::create(dynamic_cast<dt::MpiComm&>(world), "tiny", cfg); },
      {"cannot hold one 8-byte element per local rank (", "(on rank 0)"});
}

// Ranks whose calls disagree on the small path get an error on every rank, not a hang or wrong
// data: one rank with a small message and the others with a large one (each path sees the other),
// and the same size with another reduce op. Each case breaks its communicator.
void check_small_mismatch(Comm& world, const dt::ShmConfig& cfg) {
  for (int variant = 0; variant < 2; ++variant) {
    auto c = dt::ShmComm::create(dynamic_cast<dt::MpiComm&>(world), "small-mismatch", cfg);
    if (c->local_size() < 2 || c->num_nodes() != 1) return;
    if (variant == 0) check_regular_mismatch(world, cfg);
    const bool odd = c->local_rank() == 0;
    const std::size_t n = variant == 0 && !odd ? 2 * dt::ShmComm::kSmallBytes : 8;
    const ReduceOp op = variant == 1 && odd ? ReduceOp::max : ReduceOp::sum;
    std::vector<float> buf(n, 1.0f);
    const std::string msg = expect_throw<dt::CommError>(
        str(variant == 0 ? "small and large" : "sum and max", " all_reduce on ", c->name()),
        [&] { c->all_reduce(dt::view_of(buf), op, CommOptions{Millis(20000)}); },
        {"collective #1"});
    if (variant == 1)
      H.expect(
          contains(msg, "all_reduce(f32 x 8, max)") && contains(msg, "all_reduce(f32 x 8, sum)"),
          "sum and max all_reduce: the message names both calls", msg);
    else
      H.expect(contains(msg, odd ? "another size or kind" : "small-message path"),
               "small and large all_reduce: the message says which path the other rank took", msg);
    // The communicator refuses what follows, on the small path too, and barriers (through MPI,
    // which the ranks that failed may never call).
    expect_throw<dt::CommError>(str("all_reduce after the mismatch on ", c->name()),
                                [&] { c->all_reduce(dt::view_of(buf), op); }, {"failed earlier"});
    expect_throw<dt::CommError>(str("barrier after the mismatch on ", c->name()),
                                [&] { c->barrier(); }, {"failed earlier"});
    expect_throw<dt::CommError>(str("queued barrier after the mismatch on ", c->name()),
                                [&] { c->ibarrier().wait(); }, {"failed earlier"});
  }
}

int main(int argc, char** argv) {
  // A hang (a bug in a collective) must not outlive the test: the default SIGALRM action ends
  // this rank and mpiexec ends the others.
  alarm(550);
  const auto t_start = Clock::now();
  int rc = 0;
  {
    dt::Runtime rt(&argc, &argv);
    Comm& world = rt.world();
    H.rank = world.rank();
    const bool verbose = std::getenv("DT_TEST_VERBOSE") != nullptr;
    auto step = [&](const char* name, auto&& f) {
      const auto t0 = Clock::now();
      guarded(name, f);
      if (verbose && H.rank == 0) std::printf("%-28s %8.0f ms\n", name, section_ms(t0));
      std::fflush(stdout);
    };

    const std::string mode = argc > 1 ? argv[1] : "mpi";
    if (mode == "shm" || mode == "hier") {
      dt::ShmConfig cfg;
      cfg.arena_bytes = std::size_t{4} << 20;
      cfg.staging_bytes = std::size_t{64} << 10;  // 1M-element buffers go through many pieces
      cfg.chunk_bytes = std::size_t{4} << 10;
      cfg.simulated_nodes = mode == "hier" ? 2 : 0;
      // Names a segment of rank 0 would take, already in /dev/shm (a killed process of the same
      // pid left them, say): the segment takes another.
      std::vector<std::string> taken;
      if (H.rank == 0 && !std::getenv("SLURM_JOB_ID"))
        for (int k = 0; k < 8; ++k) {
          taken.push_back(str("/dt-shm-", static_cast<long>(getpid()), "-", k));
          const int fd = shm_open(taken.back().c_str(), O_CREAT | O_RDWR, 0600);
          if (fd >= 0) close(fd);
        }
      std::unique_ptr<dt::ShmComm> shm;
      step("shm create",
           [&] { shm = dt::ShmComm::create(dynamic_cast<dt::MpiComm&>(world), mode, cfg); });
      for (const std::string& t : taken) shm_unlink(t.c_str());
      if (shm) {
        if (H.rank == 0)
          std::printf("%s: %d node(s), %d local ranks, all_reduce path %s\n", mode.c_str(),
                      shm->num_nodes(), shm->local_size(), shm->path("all_reduce", 1 << 20));
        if (argc > 2)  // the path all_reduce must take here (e.g. hier across real nodes)
          H.expect(shm->path("all_reduce", 1 << 20) == std::string(argv[2]), "all_reduce path",
                   str(shm->path("all_reduce", 1 << 20), " instead of ", argv[2], " on ",
                       shm->num_nodes(), " node(s)"));
        step("shm suite", [&] { full_suite(*shm, 20, H.rank); });
        step("shm arena", [&] { check_arena(*shm); });
        step("shm NaN in max and min", [&] { check_nan(*shm); });
        step("shm round counter wrap", [&] { check_round_wrap(*shm); });
        step("shm work semantics", [&] { check_work_semantics(*shm); });
        step("shm argument validation", [&] { check_arguments(*shm); });
        step("shm small messages", [&] { check_small(*shm); });
        step("shm polled waits", [&] { check_polled_idle(*shm); });
        step("shm arena mismatch", [&] { check_arena_mismatch(*shm); });
        step("shm small mismatch", [&] { check_small_mismatch(world, cfg); });
        step("shm config mismatch", [&] { check_config_mismatch(world, cfg); });
        step("shm give up", [&] { check_give_up(world, cfg); });
        step("shm tiny staging", [&] { check_tiny_staging(world, cfg); });
      }
    } else {
      step("reference rounding", [&] { check_reference_rounding(); });
      step("world suite", [&] { full_suite(world, 0, H.rank); });
      std::unique_ptr<Comm> sub;
      step("parity split", [&] { sub = check_parity_split(world); });
      if (sub) step("parity split suite", [&] { full_suite(*sub, 10, H.rank); });
      step("negative color", [&] { check_negative_color(world); });
      step("chunking", [&] { check_chunking(world); });
      step("NaN in max and min", [&] { check_nan(world); });
      step("work semantics", [&] { check_work_semantics(world); });
      step("argument validation (world)", [&] { check_arguments(world); });
      if (sub) step("argument validation (split)", [&] { check_arguments(*sub); });
      sub.reset();
    }

    rc = H.finish("test_collectives", section_ms(t_start) / 1000);
  }
  return rc;
}
