// dt_train: train a GPT on a text or token file over all ranks of the job.
//
//   srun ./dt_train --config configs/gpt-tiny.ini [--train.steps=500 ...]
//
// Exit codes: 0 done; 2 bad options, config or data (before any model memory is allocated);
// 3 a rank failed during training (the job is aborted so that no rank hangs).
#include <cstdio>

#include "dt/config.hpp"
#include "dt/device.hpp"
#include "dt/runtime.hpp"
#include "dt/train.hpp"

int main(int argc, char** argv) {
  dt::TrainConfig cfg;
  dt::Options opts("dt_train", "Train a GPT-2-style model with data parallelism over MPI ranks.");
  dt::add_train_options(opts, cfg);
  dt::TokenFile data;
  int rc = dt::run_with_config_errors("dt_train", [&] {
    if (!opts.parse(argc, argv)) return 0;
    data = dt::validate_and_load(cfg);
    return -1;
  });
  if (rc >= 0) return rc;

  dt::RuntimeOptions ro;
  ro.bind = dt::parse_bind_mode(cfg.bind);
  ro.use_pmix = cfg.pmix;
  dt::Runtime rt(&argc, &argv, ro);
  const bool lead = rt.rank() == 0;
  if (cfg.print_config && lead) std::printf("%s", opts.dump().c_str());
  std::unique_ptr<dt::Device> dev;
  std::unique_ptr<dt::Trainer> trainer;
  // Config errors found after start-up are the same on every rank: all exit 2 together.
  rc = dt::run_with_config_errors(lead ? "dt_train" : nullptr, [&] {
    dev = std::make_unique<dt::Device>(dt::Device::open(
        cfg.device, cfg.plugin_path.empty() ? dt::default_plugin_path() : cfg.plugin_path));
    trainer = std::make_unique<dt::Trainer>(rt.world(), *dev, cfg, data);
    return -1;
  });
  if (rc >= 0) return rc;
  try {
    return trainer->run();
  } catch (const dt::Error& e) {
    std::fprintf(stderr, "dt_train: rank %d: %s\n", rt.rank(), e.what());
    rt.abort(3);
  }
}
