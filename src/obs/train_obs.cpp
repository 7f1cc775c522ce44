#include "obs/train_obs.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "dt/device.hpp"
#include "dt/error.hpp"
#include "dt/security.hpp"
#include "dt/trace.hpp"

#ifndef DT_VERSION
#define DT_VERSION "unknown"
#endif

namespace dt::obs {

using metrics::Counter;
using metrics::Gauge;
using metrics::Histogram;

std::string job_name(const std::string& configured) {
  if (!configured.empty()) return configured;
  const char* slurm = std::getenv("SLURM_JOB_ID");
  return slurm && *slurm ? slurm : "dt_train";
}

std::string textfile_for_rank(const std::string& pattern, int rank) {
  std::string out = pattern;
  const std::string key = "{rank}", r = std::to_string(rank);
  for (std::size_t p = out.find(key); p != std::string::npos; p = out.find(key, p + r.size()))
    out.replace(p, key.size(), r);
  return out;
}

namespace {
// Resident memory of this process, sampled whenever the registry is rendered.
void register_memory_collector(metrics::Registry& reg) {
  static std::once_flag once;
  std::call_once(once, [&reg] {
    Gauge& rss = reg.gauge("dt_process_resident_bytes", "Resident memory of the rank's process.");
    Gauge& peak =
        reg.gauge("dt_process_max_resident_bytes", "Peak resident memory of the rank's process.");
    Gauge& dev = reg.gauge("dt_device_allocated_bytes",
                           "Device memory dt holds through its device plugin (all devices).");
    Gauge& dev_peak =
        reg.gauge("dt_device_max_allocated_bytes",
                  "Most device memory dt has held at once through its device plugin.");
    reg.on_collect([&rss, &peak, &dev, &dev_peak] {
      dev.set(static_cast<double>(Device::allocated_bytes()));
      dev_peak.set(static_cast<double>(Device::max_allocated_bytes()));
      const metrics::ResidentMemory m = metrics::resident_memory();
      rss.set(m.now);
      peak.set(m.peak);
    });
  });
}
}  // namespace

struct TrainTelemetry::Metrics {
  Gauge *step, *loss, *val_loss, *lr, *grad_norm, *loss_scale, *tokens_per_s, *mfu;
  Counter* tokens;
  Histogram* step_seconds;
  Counter *ckpt_saves, *ckpt_save_s, *ckpt_block_s, *ckpt_bytes;
  Gauge *ckpt_last_save_s, *ckpt_last_block_s, *ckpt_last_bytes;
};

TrainTelemetry::TrainTelemetry(const TrainConfig& c, int rank, int world, double flops_per_token,
                               const std::string& run)
    : m_(std::make_unique<Metrics>()),
      rank_(rank),
      every_(c.metrics_every),
      tokens_per_step_(static_cast<double>(c.batch) * c.model.block),
      flops_per_token_(flops_per_token),
      peak_flops_(c.peak_flops),
      world_(world) {
  metrics::Registry& reg = metrics::default_registry();
  register_memory_collector(reg);
  reg.gauge("dt_build_info", "dt version of the training binary.", {{"version", DT_VERSION}})
      .set(1);
  reg.gauge("dt_world_size", "Ranks in the job.").set(world);
  Metrics& m = *m_;
  m.step = &reg.gauge("dt_train_step", "Optimiser steps taken.");
  m.loss = &reg.gauge("dt_train_loss", "Mean training loss of the last step (global batch).");
  m.val_loss = nullptr;  // registered by the first evaluation: a run without one exports none
  m.lr = &reg.gauge("dt_train_learning_rate", "Learning rate of the last step.");
  m.grad_norm =
      &reg.gauge("dt_train_grad_norm", "Global gradient norm of the last step, before clipping.");
  m.loss_scale = &reg.gauge("dt_train_loss_scale", "Loss scale (1 without mixed precision).");
  m.loss_scale->set(1.0);
  m.tokens_per_s = &reg.gauge("dt_train_tokens_per_second",
                              "Training tokens per second over all ranks, last step.");
  m.mfu = &reg.gauge("dt_train_model_flops_utilization",
                     "Model FLOP/s per rank of the last step over metrics.peak-flops (0..1).");
  m.tokens = &reg.counter("dt_train_tokens_total", "Training tokens processed over all ranks.");
  m.step_seconds = &reg.histogram(
      "dt_train_step_seconds", "Wall time of one optimiser step.",
      {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300});
  m.ckpt_saves = &reg.counter("dt_ckpt_saves_total", "Checkpoints written.");
  m.ckpt_save_s = &reg.counter("dt_ckpt_save_seconds_total",
                               "Seconds spent writing checkpoints (in the background or not).");
  m.ckpt_block_s = &reg.counter("dt_ckpt_blocking_seconds_total",
                                "Seconds training was blocked by checkpoint saves.");
  m.ckpt_bytes = &reg.counter("dt_ckpt_bytes_total", "Tensor bytes in the checkpoints written.");
  m.ckpt_last_save_s =
      &reg.gauge("dt_ckpt_last_save_seconds", "Seconds the last checkpoint write took.");
  m.ckpt_last_block_s = &reg.gauge("dt_ckpt_last_blocking_seconds",
                                   "Seconds training was blocked by the last checkpoint save.");
  m.ckpt_last_bytes = &reg.gauge("dt_ckpt_last_bytes", "Tensor bytes of the last checkpoint.");
  if (c.seal != "off") security::register_failure_counters();

  DT_CHECK(ConfigError,
           c.metrics_textfile.empty() || world == 1 ||
               c.metrics_textfile.find("{rank}") != std::string::npos,
           "option --metrics.textfile: '", c.metrics_textfile, "' would be written by all ", world,
           " ranks: put {rank} in the name (e.g. /var/lib/node_exporter/dt-{rank}.prom)");
  metrics::ExporterOptions eo;
  const std::string job = job_name(c.metrics_job);
  eo.textfile = textfile_for_rank(c.metrics_textfile, rank);
  eo.textfile_labels = {{"dt_job", job}, {"rank", std::to_string(rank)}};
  eo.host = c.metrics_host;
  eo.port = c.metrics_port > 0 ? c.metrics_port + c.local_rank : c.metrics_port;
  DT_CHECK(ConfigError, eo.port <= 65535, "option --metrics.port: ", c.metrics_port,
           " plus local rank ", c.local_rank, " is above 65535");
  eo.push_url = c.metrics_push_url;
  eo.push_timeout_s = c.metrics_push_timeout_s;
  eo.request_deadline_s = c.metrics_request_deadline_s;
  eo.push_user = c.metrics_push_user;
  eo.push_password = c.metrics_push_password;
  eo.job = job;
  eo.instance = std::to_string(rank);
  exporter_ = std::make_unique<metrics::Exporter>(reg, eo, [rank](const std::string& w) {
    std::fprintf(stderr, "dt_train: rank %d: warning: %s\n", rank, w.c_str());
    std::fflush(stderr);
  });
  if (exporter_->port() > 0) {
    const bool everywhere = eo.host == "0.0.0.0" || eo.host == "::";
    // Served everywhere: the node's name, which a scraper on another node can use. An IPv6
    // address goes in brackets in a URL (http://[::1]:9400/metrics).
    char node[256] = "localhost";
    if (everywhere && ::gethostname(node, sizeof node - 1) != 0) std::strcpy(node, "localhost");
    const std::string host = everywhere                               ? std::string(node)
                             : eo.host.find(':') != std::string::npos ? "[" + eo.host + "]"
                                                                      : eo.host;
    std::printf("dt_train: rank %d: metrics at http://%s:%d/metrics%s\n", rank, host.c_str(),
                exporter_->port(),
                everywhere ? " (served on every interface; --metrics.host=127.0.0.1 keeps it on "
                             "this node)"
                           : "");
    std::fflush(stdout);
  }
  if (!c.trace_dir.empty()) {
    trace::start(rank, c.trace_dir, world, run);
    tracing_ = true;
  }
}

TrainTelemetry::~TrainTelemetry() {
  if (tracing_) trace::stop();
}

void TrainTelemetry::on_step(const StepStats& s) {
  Metrics& m = *m_;
  m.step->set(static_cast<double>(s.step + 1));
  m.loss->set(s.loss);
  m.lr->set(s.lr);
  m.grad_norm->set(s.grad_norm);
  m.tokens->inc(tokens_per_step_);
  m.step_seconds->observe(s.seconds);
  if (s.seconds > 0) {
    const double tps = tokens_per_step_ / s.seconds;
    m.tokens_per_s->set(tps);
    m.mfu->set(tps * flops_per_token_ / world_ / peak_flops_);
  }
  if ((s.step + 1) % every_ == 0) exporter_->publish();
}

void TrainTelemetry::on_eval(double val_loss) {
  if (!m_->val_loss)
    m_->val_loss = &metrics::default_registry().gauge("dt_train_val_loss", "Last validation loss.");
  m_->val_loss->set(val_loss);
}

void TrainTelemetry::on_checkpoint_blocked(double seconds) {
  m_->ckpt_block_s->inc(seconds);
  m_->ckpt_last_block_s->set(seconds);
}

void TrainTelemetry::on_checkpoint_written(double seconds, std::uint64_t bytes) {
  m_->ckpt_saves->inc();
  m_->ckpt_save_s->inc(seconds);
  m_->ckpt_bytes->inc(static_cast<double>(bytes));
  m_->ckpt_last_save_s->set(seconds);
  m_->ckpt_last_bytes->set(static_cast<double>(bytes));
}

void TrainTelemetry::publish_now() noexcept {
  try {
    exporter_->publish_now();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dt_train: rank %d: warning: metrics not exported: %s\n", rank_, e.what());
  }
}

void TrainTelemetry::finish() noexcept {
  // The last push waits for the gateway like every other: said where a push failed or still
  // waits, as a gateway that never answers holds the exit for that long (the push in flight,
  // which sends older values, is stopped).
  if (exporter_->push_waits())
    std::fprintf(stderr,
                 "dt_train: rank %d: the last metrics push waits up to %g s for the "
                 "Pushgateway (--metrics.push-timeout-s), which has failed or not yet answered\n",
                 rank_, exporter_->push_timeout_s());
  publish_now();
  if (tracing_) {
    try {
      const std::string path = trace::write();
      if (const std::size_t lost = trace::dropped_count())
        std::fprintf(stderr,
                     "dt_train: rank %d: warning: the timeline keeps the first %zu events of each "
                     "thread: %zu later ones are not in it\n",
                     rank_, trace::kMaxEventsPerThread, lost);
      if (rank_ == 0) {
        std::printf(
            "dt_train: timeline written to %s (one file per rank; dt_trace merge joins them)\n",
            path.c_str());
        std::fflush(stdout);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dt_train: rank %d: warning: timeline not written: %s\n", rank_,
                   e.what());
    }
  }
}

}  // namespace dt::obs
