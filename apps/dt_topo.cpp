// dt_topo: topology report and cluster connectivity check.
//
//   srun ./dt_topo            (or: mpiexec -n 4 ./dt_topo)
//
// Prints a per-node table, then checks all_reduce, all_gather and a ring of send/recv across all
// ranks with content verification, measures latency (8 B ping-pong) and bandwidth (16 MiB) for
// every neighbour pair (r, r+1 mod n) over the point-to-point transport of --comm.p2p (MPI or
// UCX), and exits 1 naming every failing rank or pair.
// Exit codes: 0 all good, 1 a check failed, 2 bad options, 3 a rank hit an error or a timeout.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>
#include <new>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "dt/comm.hpp"
#include "dt/config.hpp"
#include "dt/p2p.hpp"
#include "dt/runtime.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Settings {
  std::string bind;
  bool pmix = true;
  std::string latency_bytes_s, bandwidth_bytes_s;  // sizes as given (dt::parse_size)
  long latency_bytes = 8;
  long latency_iters = 200;
  long bandwidth_bytes = 16 << 20;
  long bandwidth_iters = 4;
  long check_elems = 1 << 20;
  double timeout_s = 60;
  long corrupt_rank = -1;
  std::string p2p = "mpi";
};

const char* plural(std::size_t n) { return n == 1 ? "" : "s"; }

std::string range_list(const std::vector<int>& v) {
  std::ostringstream os;
  for (std::size_t i = 0; i < v.size();) {
    std::size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    os << (i ? "," : "") << v[i];
    if (j > i) os << "-" << v[j];
    i = j + 1;
  }
  return os.str();
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream is(s);
  while (std::getline(is, cur, sep)) out.push_back(cur);
  return out;
}

// The value rank r sends at element i: different for every rank, so a block from the wrong rank
// shows.
float pattern(int r, std::size_t i) {
  return static_cast<float>((r + 1) * 4 + static_cast<int>(i % 61));
}

// The value rank r contributes to the all_reduce at element i: at most 316, so that every partial
// sum of up to 53,000 ranks stays below 2^24 and is exact in f32 in any order (pattern's sums
// pass 2^24 near 2,900 ranks and round, and a healthy job would fail the check).
float sum_pattern(int r, std::size_t i) {
  return static_cast<float>((r % 64 + 1) * 4 + static_cast<int>(i % 61));
}

class Checker {
 public:
  Checker(dt::Runtime& rt, const Settings& s, dt::P2p& p2p)
      : rt_(rt), w_(rt.world()), p_(p2p), s_(s), timeout_(static_cast<long>(s.timeout_s * 1000)) {}

  int run() {
    print_table();
    check_all_reduce();
    check_all_gather();
    check_ring();
    measure_pairs();
    return report();
  }

 private:
  bool corrupt() const { return s_.corrupt_rank == w_.rank(); }

  void fill(std::vector<float>& v, int r, float (*value)(int, std::size_t) = pattern) const {
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = value(r, i);
    if (corrupt() && r == w_.rank() && !v.empty()) v[v.size() / 2] += 1.0f;  // the wrong buffer
  }

  void wait(dt::Work w) { w.wait(timeout_); }

  // Collects flags[n] from all ranks (max) so rank 0 can name who failed.
  std::vector<std::int32_t> gather_flags(std::vector<std::int32_t> flags) {
    wait(w_.iall_reduce(dt::view_of(flags), dt::ReduceOp::max));
    return flags;
  }

  void print_table() {
    const auto& t = rt_.topology();
    std::string gpus;
    for (const auto& g : t.machine.gpus) gpus += (gpus.empty() ? "" : ",") + g;
    if (gpus.empty()) gpus = "-";
    // One rank's description as text, exchanged with all_gather at the longest rank's length (a
    // binding's CPU list can run to kilobytes on a large node).
    std::ostringstream os;
    os << t.machine.host << '|' << t.placement.node_id << '|' << t.placement.local_rank << '|'
       << t.machine.packages << '|' << t.machine.numa_nodes << '|' << t.machine.cores << '|'
       << t.machine.pus << '|' << gpus << '|' << t.binding.mode << '|' << t.binding.cpus << '|'
       << t.placement.source << '|' << t.placement.num_nodes;
    const std::string mine = os.str();
    std::int64_t width = static_cast<std::int64_t>(mine.size()) + 1;
    wait(w_.iall_reduce(dt::view_of(&width, 1), dt::ReduceOp::max));
    const auto kRecord = static_cast<std::size_t>(width);
    std::vector<std::uint8_t> rec(kRecord, 0);
    std::memcpy(rec.data(), mine.data(), mine.size());
    std::vector<std::uint8_t> all(kRecord * static_cast<std::size_t>(w_.size()));
    wait(w_.iall_gather(dt::ConstTensorView{rec.data(), kRecord, dt::DType::u8}, dt::view_of(all)));
    hosts_.resize(w_.size());
    struct Node {
      std::string host, shape, gpus, source;
      std::vector<int> ranks;
      std::string binding;
    };
    std::map<int, Node> nodes;
    for (int r = 0; r < w_.size(); ++r) {
      std::string s(reinterpret_cast<const char*>(&all[kRecord * r]));
      auto f = split(s, '|');
      if (f.size() < 12) continue;
      hosts_[r] = f[0];
      Node& n = nodes[std::stoi(f[1])];
      n.host = f[0];
      n.shape = f[3] + " " + f[4] + " " + f[5] + " " + f[6];
      n.gpus = f[7];
      n.source = f[10];
      n.ranks.push_back(r);
      n.binding += (n.binding.empty() ? "" : " ") + std::to_string(r) + ":" + f[9] +
                   (f[8] == "cores" ? "" : "(" + f[8] + ")");
    }
    if (w_.rank() != 0) return;
    std::printf("dt_topo: %d rank%s on %zu node%s (placement from %s)\n", w_.size(),
                plural(static_cast<std::size_t>(w_.size())), nodes.size(), plural(nodes.size()),
                nodes.empty() ? "?" : nodes.begin()->second.source.c_str());
    std::printf("%-5s %-20s %-10s %-8s %-5s %-5s %-4s %-12s %s\n", "node", "host", "ranks",
                "packages", "cores", "pus", "numa", "gpus", "binding (rank:cpus)");
    for (const auto& [id, n] : nodes) {
      auto sh = split(n.shape, ' ');
      std::printf("%-5d %-20s %-10s %-8s %-5s %-5s %-4s %-12s %s\n", id, n.host.c_str(),
                  range_list(n.ranks).c_str(), sh[0].c_str(), sh[2].c_str(), sh[3].c_str(),
                  sh[1].c_str(), n.gpus.c_str(), n.binding.c_str());
    }
    std::fflush(stdout);
  }

  void check_all_reduce() {
    const int n = w_.size();
    std::vector<float> buf(static_cast<std::size_t>(s_.check_elems));
    fill(buf, w_.rank(), sum_pattern);
    // Checksum of what this rank contributed, to find the rank whose input was wrong.
    double mine = 0, want_mine = 0;
    for (std::size_t i = 0; i < buf.size(); ++i) {
      mine += buf[i] * static_cast<double>(i % 1009 + 1);
      want_mine += sum_pattern(w_.rank(), i) * static_cast<double>(i % 1009 + 1);
    }
    wait(w_.iall_reduce(dt::view_of(buf), dt::ReduceOp::sum));
    bool ok = true;
    for (std::size_t i = 0; i < buf.size() && ok; ++i) {
      double want = 0;
      for (int r = 0; r < n; ++r) want += sum_pattern(r, i);
      ok = buf[i] == static_cast<float>(want);
    }
    std::vector<std::int32_t> wrong_result(n, 0), wrong_input(n, 0);
    wrong_result[w_.rank()] = ok ? 0 : 1;
    wrong_input[w_.rank()] = mine == want_mine ? 0 : 1;
    wrong_result = gather_flags(wrong_result);
    wrong_input = gather_flags(wrong_input);
    // A wrong contribution spoils every rank's sum: blame the contributor, and blame a receiving
    // rank only when all contributions were right.
    const bool any_input =
        std::any_of(wrong_input.begin(), wrong_input.end(), [](int x) { return x; });
    for (int r = 0; r < n; ++r) {
      if (wrong_input[r])
        fail("all_reduce: rank " + std::to_string(r) + " contributed a wrong buffer", r);
      if (wrong_result[r] && !any_input)
        fail("all_reduce: rank " + std::to_string(r) + " received a wrong sum", r);
    }
    ok_line("all_reduce", wrong_input, wrong_result);
  }

  void check_all_gather() {
    const int n = w_.size();
    const std::size_t m =
        static_cast<std::size_t>(s_.check_elems) / static_cast<std::size_t>(n) + 1;
    std::vector<float> mine(m), all(m * n);
    fill(mine, w_.rank());
    wait(w_.iall_gather(dt::view_of(mine), dt::view_of(all)));
    std::vector<std::int32_t> bad_block(n, 0);
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < m; ++i)
        if (all[r * m + i] != pattern(r, i)) {
          bad_block[r] = 1;
          break;
        }
    bad_block = gather_flags(bad_block);
    for (int r = 0; r < n; ++r)
      if (bad_block[r]) fail("all_gather: the block of rank " + std::to_string(r) + " is wrong", r);
    ok_line("all_gather", bad_block, {});
  }

  void check_ring() {
    const int n = w_.size(), me = w_.rank();
    if (n < 2) return;
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    std::vector<float> out(static_cast<std::size_t>(s_.check_elems)), in(out.size());
    fill(out, me);
    auto rw = p_.irecv(dt::view_of(in), prev, 101);
    auto sw = p_.isend(dt::view_of(out), next, 101);
    wait(std::move(sw));
    wait(std::move(rw));
    std::vector<std::int32_t> bad_from(n, 0);
    for (std::size_t i = 0; i < in.size(); ++i)
      if (in[i] != pattern(prev, i)) {
        bad_from[prev] = 1;
        break;
      }
    bad_from = gather_flags(bad_from);
    for (int r = 0; r < n; ++r)
      if (bad_from[r])
        fail("ring send/recv: pair " + std::to_string(r) + "->" + std::to_string((r + 1) % n) +
                 " delivered wrong data",
             r);
    ok_line("ring send/recv", bad_from, {});
  }

  // Latency and bandwidth of pair (i, i+1 mod n), measured in rounds of disjoint pairs.
  void measure_pairs() {
    const int n = w_.size(), me = w_.rank();
    if (n < 2) return;
    const int pairs = n == 2 ? 1 : n;
    std::vector<double> lat(pairs, 0.0), bw(pairs, 0.0);
    std::vector<std::int32_t> bad(pairs, 0);
    auto round_of = [&](int i) { return (n % 2 == 1 && i == n - 1) ? 2 : i % 2; };
    std::vector<std::uint8_t> small(static_cast<std::size_t>(s_.latency_bytes));
    std::vector<float> big(static_cast<std::size_t>(s_.bandwidth_bytes) / sizeof(float));
    std::vector<float> expect_big(big.size());
    for (int round = 0; round < 3; ++round) {
      for (int i = 0; i < pairs; ++i) {
        if (round_of(i) != round) continue;
        const int a = i, b = (i + 1) % n;
        if (me != a && me != b) continue;
        const int peer = me == a ? b : a;
        const int tag = 200 + round;
        // Latency: ping-pong of latency_bytes, after a warm-up.
        const long warm = 10;
        Clock::time_point t0{};
        for (long it = 0; it < warm + s_.latency_iters; ++it) {
          if (it == warm) t0 = Clock::now();
          if (me == a) {
            wait(p_.isend(dt::view_of(small), peer, tag));
            wait(p_.irecv(dt::view_of(small), peer, tag));
          } else {
            wait(p_.irecv(dt::view_of(small), peer, tag));
            wait(p_.isend(dt::view_of(small), peer, tag));
          }
        }
        const double rtt = std::chrono::duration<double>(Clock::now() - t0).count();
        // Bandwidth: a streams bandwidth_iters messages to b, b acknowledges the last one.
        std::int32_t ack = 0;
        if (me == a) fill(big, a);
        const auto t1 = Clock::now();
        for (long it = 0; it < s_.bandwidth_iters; ++it) {
          if (me == a)
            wait(p_.isend(dt::view_of(big), peer, tag));
          else
            wait(p_.irecv(dt::view_of(big), peer, tag));
        }
        if (me == a) {
          wait(p_.irecv(dt::view_of(&ack, 1), peer, tag));
          const double secs = std::chrono::duration<double>(Clock::now() - t1).count();
          lat[i] = rtt / static_cast<double>(s_.latency_iters) / 2.0 * 1e6;
          bw[i] = static_cast<double>(s_.bandwidth_iters) * s_.bandwidth_bytes / secs / 1e9;
        } else {
          for (std::size_t k = 0; k < big.size(); ++k)
            if (big[k] != pattern(a, k)) {
              bad[i] = 1;
              break;
            }
          wait(p_.isend(dt::view_of(&ack, 1), peer, tag));
        }
      }
    }
    wait(w_.iall_reduce(dt::view_of(lat), dt::ReduceOp::max));
    wait(w_.iall_reduce(dt::view_of(bw), dt::ReduceOp::max));
    bad = gather_flags(bad);
    // Every rank records the failures (and so exits as rank 0 does); rank 0 prints the table.
    if (me == 0)
      std::printf("%-10s %-42s %12s %14s %s\n", "pair", "hosts", "latency(us)", "bandwidth(GB/s)",
                  "data");
    for (int i = 0; i < pairs; ++i) {
      const int a = i, b = (i + 1) % n;
      std::string pair = std::to_string(a) + "->" + std::to_string(b);
      std::string hosts = hosts_[a] + " -> " + hosts_[b];
      if (me == 0)
        std::printf("%-10s %-42s %12.2f %14.3f %s\n", pair.c_str(), hosts.c_str(), lat[i], bw[i],
                    bad[i] ? "WRONG" : "ok");
      if (bad[i])
        fail("pair " + pair + ": " + std::to_string(s_.bandwidth_bytes) +
                 "-byte message arrived with wrong content",
             a);
    }
    std::fflush(stdout);
  }

  void fail(const std::string& what, int rank) {
    failures_.push_back(what);
    bad_ranks_.insert(rank);
  }

  void ok_line(const char* name, const std::vector<std::int32_t>& a,
               const std::vector<std::int32_t>& b) {
    if (w_.rank() != 0) return;
    const bool ok = std::none_of(a.begin(), a.end(), [](int x) { return x; }) &&
                    std::none_of(b.begin(), b.end(), [](int x) { return x; });
    std::printf("check %-15s %s\n", name, ok ? "ok" : "FAILED");
    std::fflush(stdout);
  }

  int report() {
    // Every rank gathered the same flags, so every rank agrees on the exit code.
    if (w_.rank() == 0) {
      for (const auto& f : failures_) std::printf("dt_topo: FAILED: %s\n", f.c_str());
      if (failures_.empty()) {
        std::printf("dt_topo: all checks passed on %d rank%s\n", w_.size(),
                    plural(static_cast<std::size_t>(w_.size())));
      } else {
        std::vector<int> v(bad_ranks_.begin(), bad_ranks_.end());
        std::printf("dt_topo: failing ranks: %s\n", range_list(v).c_str());
      }
      std::fflush(stdout);
    }
    return failures_.empty() ? 0 : 1;
  }

  dt::Runtime& rt_;
  dt::Comm& w_;
  dt::P2p& p_;  // the ring and the pair measurements (comm.p2p)
  const Settings& s_;
  dt::Millis timeout_;
  std::vector<std::string> hosts_;
  std::vector<std::string> failures_;
  std::set<int> bad_ranks_;
};

// The value of size option `name` (dt::parse_size), within [min, max] (max_text: max as written
// in the help).
long size_option(const char* name, const std::string& text, long min, long max,
                 const char* max_text) {
  const std::uint64_t v = dt::parse_size(name, text);
  DT_CHECK(dt::ConfigError, v >= static_cast<std::uint64_t>(min), "option --", name, ": ", text,
           " is below the minimum ", min);
  DT_CHECK(dt::ConfigError, v <= static_cast<std::uint64_t>(max), "option --", name, ": ", text,
           " is above the maximum ", max_text);
  return static_cast<long>(v);
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  dt::Options opts("dt_topo", "Topology report and connectivity check for the ranks of a job.");
  opts.add("runtime.bind", &s.bind, "auto", "CPU binding of each local rank",
           {"auto", "cores", "none"})
      .add("runtime.pmix", &s.pmix, true, "use PMIx job information when the launcher provides it")
      .add("check.elements", &s.check_elems, 1 << 20,
           "f32 elements per rank in the all_reduce, all_gather and ring checks", 1L, 1L << 28)
      .add("check.latency-bytes", &s.latency_bytes_s, "8",
           "message size of the latency ping-pong (bytes; K, M, G suffixes) [1..1M]")
      .add("check.latency-iters", &s.latency_iters, 200, "ping-pong round trips per pair", 1L,
           1000000L)
      .add("check.bandwidth-bytes", &s.bandwidth_bytes_s, "16M",
           "message size of the bandwidth test (bytes; K, M, G suffixes; a multiple of 4) [4..1G]")
      .add("check.bandwidth-iters", &s.bandwidth_iters, 4,
           "messages per pair in the bandwidth test", 1L, 10000L)
      .add("check.timeout", &s.timeout_s, 60.0,
           "seconds any single step may take before the rank reports a hang", 0.001, 86400.0)
      .add("test.corrupt-rank", &s.corrupt_rank, -1,
           "testing only: this rank sends a wrong buffer in every check", -1L, 1L << 30)
      .add("comm.p2p", &s.p2p, "mpi",
           "point-to-point transport of the ring check and the pair measurements", {"mpi", "ucx"});
  // Option errors: reported once (dt::quiet_option_errors).
  const int rc = dt::run_with_config_errors(
      "dt_topo",
      [&] {
        if (!opts.parse(argc, argv)) return 0;
        s.latency_bytes = size_option("check.latency-bytes", s.latency_bytes_s, 1, 1 << 20, "1M");
        s.bandwidth_bytes =
            size_option("check.bandwidth-bytes", s.bandwidth_bytes_s, 4, 1 << 30, "1G");
        DT_CHECK(dt::ConfigError, s.bandwidth_bytes % 4 == 0,
                 "option --check.bandwidth-bytes: ", s.bandwidth_bytes_s,
                 " is not a multiple of 4");
        return -1;
      },
      dt::quiet_option_errors(argc, argv));
  if (rc >= 0) return rc;

  dt::RuntimeOptions ro;
  ro.bind = dt::parse_bind_mode(s.bind);
  ro.use_pmix = s.pmix;
  const auto runtime = dt::start_runtime(&argc, &argv, ro, "dt_topo");
  dt::Runtime& rt = *runtime;
  if (s.corrupt_rank >= rt.size() && rt.rank() == 0)
    std::fprintf(stderr, "dt_topo: warning: --test.corrupt-rank=%ld is not a rank of this job\n",
                 s.corrupt_rank);
  try {
    const auto p2p = dt::make_p2p(s.p2p, rt.world());
    Checker c(rt, s, *p2p);
    return c.run();
  } catch (const std::bad_alloc&) {  // a size within the options' range that memory lacks
    std::fprintf(stderr,
                 "dt_topo: rank %d: out of memory for the buffers: give a smaller "
                 "--check.elements or --check.bandwidth-bytes\n",
                 rt.rank());
    rt.abort(3);
  } catch (const std::exception& e) {  // dt::Error and any other: the other ranks must not wait
    std::fprintf(stderr, "dt_topo: rank %d: %s\n", rt.rank(), e.what());
    rt.abort(3);
  }
}
