// Data-parallel equivalence: training on all ranks of the world gives the same losses and the
// same parameters as training the same config and seed on one rank (with gradient accumulation
// over micro-batches instead), within 1e-5 relative.
//   mpiexec -n N test_dp DATA_FILE
#include <mpi.h>
#include <stdlib.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "dt/runtime.hpp"
#include "dt/train.hpp"
#include "micro_train.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: test_dp DATA_FILE\n");
    return 2;
  }
  dt::TrainConfig c = dt::test::micro_train(argv[1], 5);
  const dt::TokenFile data = dt::validate_and_load(c);

  dt::Runtime rt(&argc, &argv);
  auto dev = dt::Device::open("cpu", "");
  const int n = rt.size(), me = rt.rank();

  dt::Trainer dp(rt.world(), dev, c, data);
  std::vector<double> losses;
  for (int s = 0; s < c.steps; ++s) losses.push_back(dp.step().loss);
  const double val = dp.evaluate();

  // The reference: one rank, the whole global batch, in micro-batches of 2 sequences.
  auto self = rt.world().split(me, 0);
  int failures = 0;
  if (me == 0) {
    dt::TrainConfig c1 = c;
    c1.micro_batch = 2;
    dt::Trainer one(*self, dev, c1, data);
    for (int s = 0; s < c.steps; ++s) {
      const double ref = one.step().loss;
      const double rel = std::abs(losses[s] - ref) / std::abs(ref);
      std::printf("step %d: loss %d ranks %.8f, 1 rank %.8f, rel diff %.2e\n", s, n, losses[s], ref,
                  rel);
      if (!(rel <= 1e-5)) {
        std::printf("FAIL: loss of step %d differs by %.2e relative\n", s, rel);
        ++failures;
      }
    }
    const double val1 = one.evaluate();
    if (!(std::abs(val - val1) <= 1e-5 * std::abs(val1))) {
      std::printf("FAIL: validation loss %.8f vs %.8f\n", val, val1);
      ++failures;
    }
    double worst = 0;
    for (const auto& p : one.model().params()) {
      const float* a = dp.model().param_data() + p.offset;
      const float* b = one.model().param_data() + p.offset;
      double dd = 0, bb = 0;
      for (std::size_t k = 0; k < p.numel; ++k) {
        dd += (static_cast<double>(a[k]) - b[k]) * (static_cast<double>(a[k]) - b[k]);
        bb += static_cast<double>(b[k]) * b[k];
      }
      const double rel = std::sqrt(dd / bb);
      worst = std::max(worst, rel);
      if (!(rel <= 1e-5)) {
        std::printf("FAIL: %s differs by %.2e relative (norm)\n", p.name.c_str(), rel);
        ++failures;
      }
    }
    std::printf("parameters: worst relative difference %.2e over %zu tensors\n", worst,
                one.model().params().size());
    // The run must have moved the weights, or equality would prove nothing.
    dt::Trainer fresh(*self, dev, c1, data);
    double moved = 0;
    for (std::size_t k = 0; k < fresh.model().num_params(); ++k)
      moved = std::max(moved, static_cast<double>(std::abs(fresh.model().param_data()[k] -
                                                           one.model().param_data()[k])));
    if (!(moved > 1e-3)) {
      std::printf("FAIL: training did not change the parameters (max change %.2e)\n", moved);
      ++failures;
    }
  }
  // Every rank holds the same parameters after the data-parallel run.
  {
    std::vector<float> p0(dp.model().param_data(),
                          dp.model().param_data() + dp.model().num_params());
    MPI_Bcast(p0.data(), static_cast<int>(p0.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
    if (!std::equal(p0.begin(), p0.end(), dp.model().param_data())) {
      std::printf("FAIL: rank %d parameters differ from rank 0's\n", me);
      ++failures;
    }
  }
  // A checkpoint of another head count (every tensor of the same shape): resume_from_checkpoint
  // refuses it before reading any of it into the trainer's state. (The trainer records the model's
  // settings in the file also where no options text was given, as here.)
  {
    char tmpl[] = "/tmp/dt-test-dp-XXXXXX";
    std::string dir(64, '\0');
    if (me == 0 && ::mkdtemp(tmpl)) dir.assign(tmpl, std::strlen(tmpl));
    MPI_Bcast(dir.data(), 64, MPI_CHAR, 0, MPI_COMM_WORLD);
    dir.resize(std::strlen(dir.c_str()));
    if (dir.empty()) {
      std::printf("FAIL: no temporary folder\n");
      ++failures;
    } else {
      dt::TrainConfig two = c;
      two.ckpt_dir = dir;
      {
        dt::Trainer saved(rt.world(), dev, two, data);
        saved.step();
        saved.save_checkpoint_now(true);
      }
      dt::TrainConfig four = two;
      four.model.heads = 4;
      four.ckpt_resume = "auto";
      dt::Trainer t(rt.world(), dev, four, data);
      const std::vector<float> before = t.global_parameters();
      std::string refused;
      try {
        t.resume_from_checkpoint();
      } catch (const dt::CheckpointError& e) {
        refused = e.what();
      }
      if (refused.find("checkpoint does not match the model") == std::string::npos ||
          refused.find("--model.heads=2 (this run: 4)") == std::string::npos) {
        std::printf("FAIL: rank %d: a checkpoint of 2 heads resumed into 4: '%s'\n", me,
                    refused.c_str());
        ++failures;
      }
      if (t.global_parameters() != before || t.next_step() != 0) {
        std::printf("FAIL: rank %d: the refused checkpoint changed the trainer (next step %ld)\n",
                    me, static_cast<long>(t.next_step()));
        ++failures;
      }
      MPI_Barrier(MPI_COMM_WORLD);
      if (me == 0) std::filesystem::remove_all(dir);
    }
  }
  MPI_Allreduce(MPI_IN_PLACE, &failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (me == 0) std::printf("test_dp: %d ranks, %d failures\n", n, failures);
  return failures == 0 ? 0 : 1;
}
