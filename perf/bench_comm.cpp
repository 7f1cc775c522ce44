// Side-by-side: dt::Comm collectives against the plain MPI calls they wrap, in one run.
//   mpiexec -n 2 perf/bench_comm [iters]
// Prints, per size, the median time of each and the ratio dt/MPI (1.00 = no overhead), and the
// cost of bf16 sums (user op, half the bytes) relative to f32 sums of the same element count.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "dt/runtime.hpp"

namespace {
double median_seconds(int iters, const std::function<void()>& f, MPI_Comm sync) {
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    MPI_Barrier(sync);
    const auto a = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  double m = t[t.size() / 2];
  MPI_Allreduce(MPI_IN_PLACE, &m, 1, MPI_DOUBLE, MPI_MAX, sync);
  return m;
}
}  // namespace

int main(int argc, char** argv) {
  dt::Runtime rt(&argc, &argv);
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  dt::Comm& w = rt.world();
  if (rt.rank() == 0)
    std::printf(
        "| bytes (f32) | MPI_Allreduce us | dt all_reduce us | dt/MPI | dt bf16 sum us (same "
        "elements) | bf16/f32 |\n"
        "|---:|---:|---:|---:|---:|---:|\n");
  for (std::size_t bytes :
       {std::size_t{8}, std::size_t{64} << 10, std::size_t{1} << 20, std::size_t{16} << 20}) {
    const std::size_t n = bytes / 4;
    std::vector<float> a(n, 1.0f), b(n, 1.0f);
    std::vector<dt::bf16> h(n, dt::bf16(1.0f));
    double t_mpi = 0, t_dt = 0, t_h = 0;
    // Interleave the three so that machine noise hits them alike.
    for (int rep = 0; rep < 3; ++rep) {
      t_mpi += median_seconds(
          iters,
          [&] {
            MPI_Allreduce(MPI_IN_PLACE, a.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM,
                          MPI_COMM_WORLD);
          },
          MPI_COMM_WORLD);
      t_dt += median_seconds(
          iters, [&] { w.all_reduce(dt::view_of(b), dt::ReduceOp::sum); }, MPI_COMM_WORLD);
      t_h += median_seconds(
          iters, [&] { w.all_reduce(dt::view_of(h), dt::ReduceOp::sum); }, MPI_COMM_WORLD);
      std::fill(a.begin(), a.end(), 1.0f);
      std::fill(b.begin(), b.end(), 1.0f);
      std::fill(h.begin(), h.end(), dt::bf16(1.0f));
    }
    if (rt.rank() == 0)
      std::printf("| %zu | %.1f | %.1f | %.2f | %.1f | %.2f |\n", bytes, t_mpi / 3 * 1e6,
                  t_dt / 3 * 1e6, t_dt / t_mpi, t_h / 3 * 1e6, t_h / t_dt);
  }
  return 0;
}
