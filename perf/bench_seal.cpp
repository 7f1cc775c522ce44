// bench_seal: the cost of AES-256-GCM sealing in dt's tensor traffic, side by side in one run.
//
//   mpiexec -n 2 bench_seal [--iters N]
// prints, on rank 0:
//   seal-only   one core sealing 1/4/16 MiB messages in memory (dt::security::Aead, the ceiling
//               for sealed traffic on one core)
//   p2p         rank 0 streams messages of 1/4/16 MiB to rank 1 (a window of 4 in flight), over
//               plain MPI point-to-point and over seal_p2p(MPI): GB/s of payload
//   all_reduce  16 MiB of f32 (sum) over MPI_Allreduce (dt::MpiComm), over dt's sealed
//               communicator, and over the same communicator with every peer exempted (dt's
//               algorithm without cryptography): GB/s algorithm bandwidth (bytes / time)
// Each figure is the median of --iters timed repetitions after one warm-up.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "comm/mpi_comm.hpp"
#include "dt/p2p.hpp"
#include "dt/security.hpp"

namespace {

namespace sec = dt::security;
using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class F>
double timed(int iters, dt::Comm& world, F&& f) {
  std::vector<double> t;
  for (int i = 0; i <= iters; ++i) {
    world.barrier();
    const auto t0 = Clock::now();
    f();
    world.barrier();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (i > 0) t.push_back(s);  // the first run warms up
  }
  return median(t);
}

double seal_only(std::size_t bytes, int iters) {
  sec::Key k{};
  k.fill(7);
  sec::Aead enc(sec::SecretKey(k), true);
  std::vector<std::uint8_t> in(bytes, 1), out(bytes + 16);
  std::uint8_t nonce[12] = {0}, aad[40] = {0};
  std::vector<double> t;
  for (int i = 0; i <= iters; ++i) {
    nonce[0] = static_cast<std::uint8_t>(i);
    const auto t0 = Clock::now();
    enc.seal(nonce, aad, sizeof aad, in.data(), bytes, out.data(), out.data() + bytes);
    if (i > 0) t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return static_cast<double>(bytes) / median(t) / 1e9;
}

// Rank 0 sends `msgs` messages of `bytes` to rank 1 with `window` in flight.
void stream(dt::P2p& p, std::vector<float>& buf, int msgs, int window) {
  const auto view = dt::view_of(buf);
  std::vector<dt::Work> ws;
  for (int m = 0; m < msgs; ++m) {
    if (static_cast<int>(ws.size()) == window) {
      ws.front().wait();
      ws.erase(ws.begin());
    }
    ws.push_back(p.rank() == 0 ? p.isend(view, 1, 3) : p.irecv(view, 0, 3));
  }
  for (auto& w : ws) w.wait();
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int iters = 5;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--iters") iters = std::max(1, std::atoi(argv[i + 1]));
  {
    auto world = dt::MpiComm::dup(MPI_COMM_WORLD, "world");
    const bool lead = world->rank() == 0;
    if (world->size() != 2) {
      if (lead) std::fprintf(stderr, "bench_seal: run with mpiexec -n 2\n");
      MPI_Finalize();
      return 2;
    }
    sec::Key k{};
    k.fill(42);
    const sec::Keys keys(sec::SecretKey(k), sec::slurm_job_id());
    const std::size_t sizes[] = {std::size_t{1} << 20, std::size_t{4} << 20, std::size_t{16} << 20};
    if (lead) std::printf("%-40s %10s\n", "case", "GB/s");
    for (std::size_t s : sizes) {
      const double g = seal_only(s, iters * 4);
      if (lead) std::printf("seal-only %5zu MiB (one core)               %10.2f\n", s >> 20, g);
    }
    auto plain = dt::make_p2p("mpi", *world);
    auto sealed = sec::seal_p2p(dt::make_p2p("mpi", *world), keys, {});
    for (std::size_t s : sizes) {
      const int msgs = static_cast<int>(std::max<std::size_t>(8, (std::size_t{256} << 20) / s));
      std::vector<float> buf(s / sizeof(float), 1.0f);
      const double tp = timed(iters, *world, [&] { stream(*plain, buf, msgs, 4); });
      const double ts = timed(iters, *world, [&] { stream(*sealed, buf, msgs, 4); });
      const double gb = static_cast<double>(s) * msgs / 1e9;
      if (lead) {
        std::printf("p2p %5zu MiB plain MPI                      %10.2f\n", s >> 20, gb / tp);
        std::printf("p2p %5zu MiB sealed                         %10.2f  (%.0f%% of plain)\n",
                    s >> 20, gb / ts, 100.0 * tp / ts);
      }
    }
    const std::size_t n = (std::size_t{16} << 20) / sizeof(float);
    std::vector<float> buf(n, 1.0f);
    sec::SealedCommOptions so;
    auto sc = sec::make_sealed_comm(*world, keys, so);
    so.exempt_node_local = true;  // one node: every peer exempted, no cryptography
    auto xc = sec::make_sealed_comm(*world, keys, so);
    const double tm = timed(iters, *world, [&] { world->all_reduce(dt::view_of(buf), dt::ReduceOp::sum); });
    const double ts = timed(iters, *world, [&] { sc->all_reduce(dt::view_of(buf), dt::ReduceOp::sum); });
    const double tx = timed(iters, *world, [&] { xc->all_reduce(dt::view_of(buf), dt::ReduceOp::sum); });
    const double gb = static_cast<double>(n * sizeof(float)) / 1e9;
    if (lead) {
      std::printf("all_reduce 16 MiB f32 MPI_Allreduce          %10.2f\n", gb / tm);
      std::printf("all_reduce 16 MiB f32 dt ring, exempted      %10.2f\n", gb / tx);
      std::printf("all_reduce 16 MiB f32 dt sealed              %10.2f  (%.0f%% of MPI, %.0f%% of "
                  "dt unsealed)\n",
                  gb / ts, 100.0 * tm / ts, 100.0 * tx / ts);
    }
  }
  MPI_Finalize();
  return 0;
}
