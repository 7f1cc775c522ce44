// Loss scaling across ranks on the CPU device: an Inf injected into one rank's gradients makes
// every rank skip that step (parameters and moments unchanged), halve the scale, and keep the same
// scale as the others; the scale grows again after the clean interval. Run under mpiexec -n 2+.
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../mpi/check_harness.hpp"
#include "comm/mpi_comm.hpp"
#include "dt/device.hpp"
#include "dt/loss_scale.hpp"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  const auto t0 = std::chrono::steady_clock::now();
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  dt_test::Harness h;
  h.rank = rank;
  try {
    auto comm = dt::MpiComm::dup(MPI_COMM_WORLD, "world");
    dt::Device dev = dt::Device::open("cpu", "");
    dt::LossScaleConfig cfg;
    cfg.initial = 1024;
    cfg.growth_interval = 3;
    dt::LossScaler scaler(cfg);
    const std::int64_t n = 37;
    std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), g(n);
    for (std::int64_t i = 0; i < n; ++i) p[i] = 0.01f * static_cast<float>(i - 18);
    const int bad_step = 2, bad_rank = size - 1;
    const float expect_scale[] = {1024, 1024, 512, 512, 512, 1024, 1024};
    std::int64_t t = 0;
    for (int step = 0; step < 7; ++step) {
      // The "backward pass": gradients of a loss scaled by scale().
      for (std::int64_t i = 0; i < n; ++i)
        g[i] = scaler.scale() * (0.5f * p[i] + 0.001f * static_cast<float>(rank + step));
      if (step == bad_step && rank == bad_rank) g[n - 3] = INFINITY;
      std::int32_t found = 0;
      dev.call(&dt_hal_v2_t::scale_check_finite, "scale_check_finite", g.data(), n,
               scaler.inv_scale(), &found);
      const bool global = dt::overflow_anywhere(*comm, found != 0);
      h.expect(global == (step == bad_step), "global overflow decision",
               "step " + std::to_string(step) + ": got " + std::to_string(global));
      const std::vector<float> p0 = p, m0 = m;
      if (scaler.update(global)) {
        comm->all_reduce(dt::view_of(g), dt::ReduceOp::avg);
        dev.call(&dt_hal_v1_t::adamw, "adamw", p.data(), static_cast<const float*>(g.data()),
                 m.data(), v.data(), n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.0f, ++t);
        h.expect(p != p0, "a clean step changes the parameters", "step " + std::to_string(step));
      } else {
        h.expect(p == p0 && m == m0, "a skipped step leaves parameters and moments unchanged",
                 "step " + std::to_string(step));
      }
      h.expect(scaler.scale() == expect_scale[step], "scale after the step",
               "step " + std::to_string(step) + ": " + std::to_string(scaler.scale()) +
                   ", expected " + std::to_string(expect_scale[step]));
      // Every rank holds the same scale and the same parameters.
      float mine[2] = {scaler.scale(), p[5]}, lo[2], hi[2];
      MPI_Allreduce(mine, lo, 2, MPI_FLOAT, MPI_MIN, MPI_COMM_WORLD);
      MPI_Allreduce(mine, hi, 2, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
      h.expect(lo[0] == hi[0] && lo[1] == hi[1], "ranks agree on scale and parameters",
               "step " + std::to_string(step));
    }
    h.expect(scaler.steps_skipped() == 1, "one step skipped",
             std::to_string(scaler.steps_skipped()));
  } catch (const std::exception& e) {
    h.fail("exception", e.what());
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int rc = h.finish("loss_scale_mpi", s);
  MPI_Finalize();
  return rc;
}
