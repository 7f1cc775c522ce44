// Parallel layouts: training with any dp x tp x pp layout (graph engine, 1F1B pipeline, tensor-
// parallel collectives) gives the same losses, validation loss and final parameters as the fused
// model on one rank, within 1e-5 relative, over 5 steps of the micro config (with 4 layers and 4
// heads, so that tp and pp up to 4 are possible).
// Sharded data parallelism (parallel.zero) on the fused model is held to the same reference.
//   mpiexec -n N test_layouts DATA_FILE [batch=B] DPxTPxPP[:ucx][:zN][:graph][:mK][:bX] ...
// batch=B sets the global batch (8 otherwise) of the reference and every layout. ":ucx" sends
// the pipeline's activations over UCX instead of MPI; ":zN" trains with parallel.zero=N (N = 1,
// 2, 3; on the fused model when tp = pp = 1, unless ":graph"; with tp or pp the graph engine);
// ":mK" uses micro-batches of K sequences (K = the rank's share: one micro-batch a step, fewer
// than the pipeline's stages); ":bX" sets train.bucket-mb=X (ZeRO-1 merges layers into buckets
// of X MiB; 0: layer by layer).
#include <cctype>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "dt/gpt.hpp"
#include "dt/runtime.hpp"
#include "dt/train.hpp"
#include "micro_train.hpp"

namespace {

struct Run {
  std::vector<double> losses;
  double val = 0;
  std::vector<float> params;
  std::string sampled;         // sample() after global_parameters(): "" or its error
  bool stale_refused = false;  // sample() after one more step, not gathered again: refused
};

Run train(dt::Comm& comm, const dt::Device& dev, const dt::TrainConfig& c,
          const dt::TokenFile& data) {
  dt::Trainer t(comm, dev, c, data);
  Run r;
  for (int s = 0; s < c.steps; ++s) r.losses.push_back(t.step().loss);
  r.val = t.evaluate();
  r.params = t.global_parameters();
  // Sampling reads the parameters just assembled; after one more step it needs them again where
  // no rank holds the whole model (the graph engine, ZeRO-3): it must not read the old ones.
  const std::vector<std::int32_t> prompt = {1};
  try {
    t.sample(prompt, 4, 1.0, 7);
  } catch (const std::exception& e) {
    r.sampled = e.what();
  }
  t.step();
  try {
    t.sample(prompt, 4, 1.0, 7);
  } catch (const dt::InvalidArgument& e) {
    r.stale_refused = std::string(e.what()).find("not assembled as of step") != std::string::npos;
  }
  return r;
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: test_layouts DATA_FILE DPxTPxPP[:ucx] ...\n");
    return 2;
  }
  dt::TrainConfig c = dt::test::micro_train(argv[1], 5, 4, 4);
  int first = 2;  // the first layout argument
  if (std::string(argv[2]).rfind("batch=", 0) == 0) {
    c.batch = std::stol(std::string(argv[2]).substr(6));
    first = 3;
  }
  const dt::TokenFile data = dt::validate_and_load(c);

  dt::Runtime rt(&argc, &argv);
  auto dev = dt::Device::open("cpu", "");
  const int me = rt.rank();

  // The reference: the fused model on one rank, the whole global batch.
  Run ref;
  {
    auto self = rt.world().split(me, 0);
    if (me == 0) ref = train(*self, dev, c, data);
  }
  const std::vector<dt::ParamInfo> names = dt::gpt_params(c.model);
  int failures = 0;
  for (int a = first; a < argc; ++a) {
    std::string spec = argv[a];
    dt::TrainConfig cl = c;
    cl.par_engine = "graph";  // 1x1x1 too: the engine itself against the fused model
    bool graph = false;
    for (std::size_t colon; (colon = spec.rfind(':')) != std::string::npos;
         spec = spec.substr(0, colon)) {
      const std::string opt = spec.substr(colon + 1);
      if (opt == "ucx") {
        cl.p2p = "ucx";
      } else if (opt.size() > 1 && opt[0] == 'm' &&
                 std::isdigit(static_cast<unsigned char>(opt[1]))) {
        cl.micro_batch = std::stol(opt.substr(1));  // sequences per micro-batch
      } else if (opt == "graph") {
        graph = true;
      } else if (opt.size() > 1 && opt[0] == 'b' &&
                 std::isdigit(static_cast<unsigned char>(opt[1]))) {
        cl.bucket_mb = std::stod(opt.substr(1));  // ZeRO-1: layers merged into buckets of this
      } else if (opt.size() == 2 && opt[0] == 'z' && opt[1] >= '1' && opt[1] <= '3') {
        cl.par_zero = opt[1] - '0';
      } else {
        std::fprintf(stderr, "test_layouts: '%s': unknown option ':%s'\n", argv[a], opt.c_str());
        return 2;
      }
    }
    // Sharding runs on the fused model unless tp, pp or ":graph" ask for the engine.
    if (cl.par_zero > 0 && !graph) cl.par_engine = "auto";
    if (std::sscanf(spec.c_str(), "%dx%dx%d", &cl.par_dp, &cl.par_tp, &cl.par_pp) != 3) {
      std::fprintf(stderr, "test_layouts: '%s' is not DPxTPxPP\n", argv[a]);
      return 2;
    }
    const Run got = train(rt.world(), dev, cl, data);
    if (me != 0) continue;
    std::printf("layout %s (dp=%d tp=%d pp=%d, p2p %s, zero %d):\n", argv[a], cl.par_dp, cl.par_tp,
                cl.par_pp, cl.p2p.c_str(), cl.par_zero);
    for (int s = 0; s < c.steps; ++s) {
      const double d =
          rel(got.losses[static_cast<std::size_t>(s)], ref.losses[static_cast<std::size_t>(s)]);
      std::printf("  step %d: loss %.8f, 1 rank %.8f, rel diff %.2e\n", s,
                  got.losses[static_cast<std::size_t>(s)], ref.losses[static_cast<std::size_t>(s)],
                  d);
      if (!(d <= 1e-5)) {
        std::printf("FAIL: %s: loss of step %d differs by %.2e relative\n", argv[a], s, d);
        ++failures;
      }
    }
    const double dv = rel(got.val, ref.val);
    std::printf("  val loss %.8f, 1 rank %.8f, rel diff %.2e\n", got.val, ref.val, dv);
    if (!(dv <= 1e-5)) {
      std::printf("FAIL: %s: validation loss differs by %.2e relative\n", argv[a], dv);
      ++failures;
    }
    // Final parameters, per tensor: relative L2 distance.
    double worst = 0;
    std::string worst_name;
    for (const dt::ParamInfo& p : names) {
      double num = 0, den = 0;
      for (std::size_t k = p.offset; k < p.offset + p.numel; ++k) {
        const double x = got.params[k], y = ref.params[k];
        num += (x - y) * (x - y);
        den += y * y;
      }
      const double d = std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
      if (d > worst) {
        worst = d;
        worst_name = p.name;
      }
      if (!(d <= 1e-5)) {
        std::printf("FAIL: %s: parameter %s differs by %.2e relative (L2)\n", argv[a],
                    p.name.c_str(), d);
        ++failures;
      }
    }
    std::printf("  parameters: largest relative L2 difference %.2e (%s)\n", worst,
                worst_name.c_str());
    if (!got.sampled.empty()) {
      std::printf("FAIL: %s: sample() after global_parameters(): %s\n", argv[a],
                  got.sampled.c_str());
      ++failures;
    }
    const bool sharded =
        cl.par_engine == "graph" || cl.par_tp > 1 || cl.par_pp > 1 || cl.par_zero == 3;
    if (got.stale_refused != sharded) {
      std::printf("FAIL: %s: sample() a step after global_parameters() was %s\n", argv[a],
                  got.stale_refused ? "refused, though this rank holds the whole model"
                                    : "not refused (it read the parameters of the step before)");
      ++failures;
    }
  }
  rt.world().broadcast(dt::view_of(&failures, 1), 0);
  if (me == 0) std::printf(failures ? "FAILED: %d checks\n" : "PASSED\n", failures);
  return failures ? 1 : 0;
}
