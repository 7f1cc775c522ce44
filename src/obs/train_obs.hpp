// The telemetry of one training run on one rank: the dt_train_* and dt_ckpt_* metrics in the
// default registry, the exporters chosen by the metrics.* options, and the trace.* timeline.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dt/metrics.hpp"
#include "dt/train.hpp"

namespace dt::obs {

/// Job label of pushes and textfiles: `configured`, else $SLURM_JOB_ID, else "dt_train".
std::string job_name(const std::string& configured);
/// The textfile path of `rank`: every "{rank}" in `pattern` replaced by the rank.
std::string textfile_for_rank(const std::string& pattern, int rank);

class TrainTelemetry {
 public:
  /// Registers the metrics, starts the exporters and the trace. Every rank prints the address of
  /// its HTTP endpoint. Throws dt::ConfigError naming the option (a port in use, a textfile
  /// pattern without {rank} on several ranks, a trace directory that cannot be made). `run`: the
  /// id the run's ranks share, written into their timelines.
  TrainTelemetry(const TrainConfig& c, int rank, int world, double flops_per_token,
                 const std::string& run = "");
  /// Stops the exporters and the trace without writing anything more.
  ~TrainTelemetry();
  TrainTelemetry(const TrainTelemetry&) = delete;
  TrainTelemetry& operator=(const TrainTelemetry&) = delete;

  /// After each optimiser step: gauges, the step-time histogram, and every metrics.every steps a
  /// background textfile write and push.
  void on_step(const StepStats& s);
  void on_eval(double val_loss);
  /// Seconds the training loop was blocked by a checkpoint save (the whole save when synchronous,
  /// the snapshot when asynchronous).
  void on_checkpoint_blocked(double seconds);
  /// A checkpoint write finished (synchronous, or in the background).
  void on_checkpoint_written(double seconds, std::uint64_t bytes);
  /// At the end of the run or on a drain: a last textfile write and push, in this thread, and the
  /// trace file. Never throws (failures are warnings).
  void finish() noexcept;
  /// A textfile write and push in this thread, now: what a rank that fails exports before the
  /// job is aborted. Never throws.
  void publish_now() noexcept;

 private:
  struct Metrics;
  std::unique_ptr<Metrics> m_;
  std::unique_ptr<metrics::Exporter> exporter_;
  int rank_;
  std::int64_t every_;
  double tokens_per_step_, flops_per_token_, peak_flops_;
  int world_;
  bool tracing_ = false;
};

}  // namespace dt::obs
