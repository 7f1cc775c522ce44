// Mixed precision on the CPU: fp16 dynamic loss scaling and bf16 training of the micro config.
//   mpiexec -n N test_mixed DATA_FILE [DPxTPxPP [zK]]     (zK: parallel.zero=K)
// 1. fp16: an Inf put into one rank's gradients at step 2 makes every rank skip that step, halves
//    the loss scale and leaves every parameter bit unchanged; after growth-interval (3) clean
//    steps the scale doubles again.
// 2. bf16 (weights and gradients rounded to bf16, fp32 master weights) tracks the fp32 losses of
//    the same run within 2e-3 relative over 20 steps.
// 3. With more than one data-parallel rank and no ZeRO: train.grad-reduce=bf16 (the gradient
//    all_reduce carried in bf16) tracks the fp32 losses within 5e-4 relative over 20 steps
//    (measured 3.4e-5: only the gradients' sums are rounded, not the weights), and differs.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "dt/runtime.hpp"
#include "dt/train.hpp"
#include "micro_train.hpp"

namespace {
int failures = 0;
void check(bool ok, const std::string& what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAIL", what.c_str());
  if (!ok) ++failures;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: test_mixed DATA_FILE [DPxTPxPP]\n");
    return 2;
  }
  dt::TrainConfig c = dt::test::micro_train(argv[1], 20);
  if (argc > 2 && std::sscanf(argv[2], "%dx%dx%d", &c.par_dp, &c.par_tp, &c.par_pp) != 3) {
    std::fprintf(stderr, "test_mixed: '%s' is not DPxTPxPP\n", argv[2]);
    return 2;
  }
  if (argc > 3) {
    if (std::strlen(argv[3]) != 2 || argv[3][0] != 'z' || argv[3][1] < '1' || argv[3][1] > '3') {
      std::fprintf(stderr, "test_mixed: '%s' is not z1, z2 or z3\n", argv[3]);
      return 2;
    }
    c.par_zero = argv[3][1] - '0';
  }
  const dt::TokenFile data = dt::validate_and_load(c);
  dt::Runtime rt(&argc, &argv);
  auto dev = dt::Device::open("cpu", "");
  dt::Comm& world = rt.world();
  const bool lead = rt.rank() == 0;
  // The same decision on every rank: the smallest and largest value over all ranks agree.
  auto same_everywhere = [&](double v) {
    double lo = v, hi = v;
    world.all_reduce(dt::view_of(&lo, 1), dt::ReduceOp::min);
    world.all_reduce(dt::view_of(&hi, 1), dt::ReduceOp::max);
    return lo == hi;
  };

  {
    dt::TrainConfig c16 = c;
    c16.dtype = "fp16";
    c16.loss_scale_growth_interval = 3;
    c16.test_inject_inf_rank = world.size() - 1;
    c16.test_inject_inf_step = 2;
    dt::Trainer t(world, dev, c16, data);
    for (int s = 0; s < 2; ++s) {
      const dt::StepStats st = t.step();
      check(!st.skipped && st.loss_scale == 65536.0,
            "fp16 step " + std::to_string(s) + " is applied at loss scale 65536");
    }
    const std::vector<float> before = t.global_parameters();
    const dt::StepStats st = t.step();
    const std::vector<float> after = t.global_parameters();
    check(st.skipped, "step 2 with an Inf in rank " + std::to_string(world.size() - 1) +
                          "'s gradients is skipped");
    check(same_everywhere(st.skipped ? 1 : 0), "every rank skipped step 2");
    check(before.size() == after.size() &&
              std::memcmp(before.data(), after.data(), before.size() * sizeof(float)) == 0,
          "the skipped step left every parameter bit unchanged");
    double scale = 0;
    for (int s = 3; s < 6; ++s) {
      const dt::StepStats k = t.step();
      check(!k.skipped && k.loss_scale == 32768.0,
            "step " + std::to_string(s) + " runs at the halved scale 32768");
      check(same_everywhere(k.loss_scale), "every rank has the same scale");
    }
    const dt::StepStats g = t.step();
    scale = g.loss_scale;
    check(scale == 65536.0, "after 3 clean steps the scale doubles to 65536 (got " +
                                std::to_string(scale) + ")");
    const std::vector<float> end = t.global_parameters();
    check(std::memcmp(after.data(), end.data(), end.size() * sizeof(float)) != 0,
          "clean steps do change the parameters");
  }

  std::vector<double> l32, l16;
  {
    dt::Trainer t(world, dev, c, data);
    for (int s = 0; s < c.steps; ++s) l32.push_back(t.step().loss);
  }
  {
    dt::TrainConfig cb = c;
    cb.dtype = "bf16";
    dt::Trainer t(world, dev, cb, data);
    for (int s = 0; s < c.steps; ++s) l16.push_back(t.step().loss);
  }
  // The largest relative difference of a run's losses from the fp32 run's.
  auto largest_rel = [&](const std::vector<double>& l) {
    double w = 0;
    for (std::size_t s = 0; s < l.size(); ++s) w = std::max(w, std::abs(l[s] - l32[s]) / l32[s]);
    return w;
  };
  const double worst = largest_rel(l16);
  char line[160];
  std::snprintf(line, sizeof line,
                "bf16 losses track fp32 within 2e-3 relative over %ld steps (largest %.2e; last "
                "%.5f vs %.5f)",
                static_cast<long>(c.steps), worst, l16.back(), l32.back());
  check(worst <= 2e-3, line);
  // bf16 rounding must be visible at all: identical losses would mean it was not applied.
  check(worst > 0, "bf16 losses differ from fp32 (the rounding is applied)");

  if (world.size() / (c.par_tp * c.par_pp) > 1 && c.par_zero == 0) {
    dt::TrainConfig cw = c;
    cw.grad_reduce = "bf16";
    std::vector<double> lw;
    {
      dt::Trainer t(world, dev, cw, data);
      for (int s = 0; s < c.steps; ++s) lw.push_back(t.step().loss);
    }
    const double wire = largest_rel(lw);
    std::snprintf(line, sizeof line,
                  "gradients reduced in bf16 track the fp32 reduction within 5e-4 relative over "
                  "%ld steps (largest %.2e)",
                  static_cast<long>(c.steps), wire);
    check(wire <= 5e-4, line);
    check(wire > 0, "gradients reduced in bf16 give other losses than in fp32 (the wire is bf16)");
  }

  world.all_reduce(dt::view_of(&failures, 1), dt::ReduceOp::max);
  if (lead) std::printf(failures ? "FAILED\n" : "PASSED\n");
  return failures ? 1 : 0;
}
