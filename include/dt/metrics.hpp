// dt::metrics: counters, gauges and histograms in the Prometheus data model, and their exporters.
//
// A Registry holds metric families (name, help, type); a family holds series, one per label set.
// Label sets are fixed when a series is registered: registration (a mutex and a map lookup)
// returns a reference that stays valid for the registry's lifetime, and the hot path only touches
// that object's atomics (a relaxed add or store; no lock, no allocation). Asking again for the
// same name and labels returns the same series, so there are never per-step labels and the number
// of series stays bounded (a family refuses more than Registry::max_series_per_family()).
//
// render() writes the Prometheus text exposition format 0.0.4 (# HELP / # TYPE lines, histograms
// as cumulative _bucket{le="..."} series with _sum and _count, label values escaped), which the
// three exporters serve: a node_exporter textfile (written atomically), HTTP /metrics from a
// background thread (cpp-httplib) and a push to a Prometheus Pushgateway.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dt::metrics {

/// Label pairs (name, value). Names match [a-zA-Z_][a-zA-Z0-9_]* and do not start with "__";
/// values are any UTF-8 text.
using Labels = std::vector<std::pair<std::string, std::string>>;

/// A value that only goes up (calls, bytes, seconds). Thread-safe.
class Counter {
 public:
  /// Adds `v` (>= 0; a negative v is ignored, counters never go down).
  void inc(double v = 1.0) noexcept;
  double value() const noexcept { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> v_{0.0};
};

/// A value that goes up and down (loss, bytes resident). Thread-safe.
class Gauge {
 public:
  void set(double v) noexcept { v_.store(v, std::memory_order_relaxed); }
  void add(double v) noexcept;
  double value() const noexcept { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> v_{0.0};
};

/// Observations counted into fixed buckets (upper bounds, strictly increasing; +Inf implied).
/// observe() costs a scan of the bounds and two relaxed atomic updates. Thread-safe.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v) noexcept;
  const std::vector<double>& bounds() const noexcept { return bounds_; }
  /// Observations per bucket, NOT cumulative; the last entry is the +Inf bucket.
  std::vector<std::uint64_t> bucket_counts() const;
  std::uint64_t count() const noexcept;
  double sum() const noexcept { return sum_.load(std::memory_order_relaxed); }

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<std::uint64_t>[]> buckets_;  // bounds_.size() + 1
  std::atomic<double> sum_{0.0};
};

/// Bucket bounds start, start*factor, ... (count of them).
std::vector<double> exponential_buckets(double start, double factor, int count);

class Registry {
 public:
  explicit Registry(std::size_t max_series_per_family = 256);
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  /// The series `name`{labels} of a counter family, created on first use. Throws
  /// dt::InvalidArgument for a bad metric or label name, a name already registered with another
  /// type, help or buckets, or a family that already holds max_series_per_family() series.
  Counter& counter(const std::string& name, const std::string& help, Labels labels = {});
  Gauge& gauge(const std::string& name, const std::string& help, Labels labels = {});
  /// Every series of one histogram family has the same bounds.
  Histogram& histogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                       Labels labels = {});

  /// Runs `fn` at the start of every render(), before the values are read (for gauges that are
  /// sampled rather than pushed, such as resident memory). `fn` must not call render().
  void on_collect(std::function<void()> fn);

  /// The whole registry in the Prometheus text format, families in registration order, series in
  /// registration order. `extra` labels are put in front of every series' own labels (for the
  /// textfile collector, which merges the files of several ranks).
  std::string render(const Labels& extra = {}) const;

  std::size_t max_series_per_family() const noexcept { return max_series_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::size_t max_series_;
};

/// The process-wide registry that dt's own instrumentation (record_comm, the trainer) writes to.
/// Never destroyed, so exporter threads may read it until the process exits.
Registry& default_registry();

/// This process's resident memory and its peak, in bytes, as the kernel counts them exactly
/// (VmRSS and VmHWM of /proc/self/status; getrusage's ru_maxrss lags behind, below the current
/// figure). 0 where they cannot be read.
struct ResidentMemory {
  double now = 0, peak = 0;
};
ResidentMemory resident_memory();

/// The hook the communication layer calls once per completed collective or point-to-point
/// operation: adds 1 to dt_comm_calls_total, `bytes` to dt_comm_bytes_total and `seconds` to
/// dt_comm_seconds_total, each with labels op and backend, in default_registry(). `op` and
/// `backend` are short fixed names ("all_reduce", "mpi"); nullptr reads as "unknown". After
/// 64 distinct (op, backend) pairs further pairs are counted as op="other", backend="other".
/// The cost after the first call with a pair: a few string compares and three relaxed atomic
/// adds. Never throws; if memory runs out the call is dropped.
void record_comm(const char* op, const char* backend, std::size_t bytes, double seconds) noexcept;

/// Escapes a label value for the text format (backslash, double quote, newline).
std::string escape_label_value(const std::string& v);

/// Writes `text` to `path` so that a reader sees the old file or the new one, never a part: the
/// text goes to a new file PATH.tmp.<pid>.<n> in the same directory (n counts this process's
/// calls, so that two threads writing one path at once each rename a whole file of their own;
/// a name already there, a symbolic link included, is passed over), which is then renamed over
/// PATH. With `durable` the file's data is on disk (fsync) before the rename; the caller syncs
/// the folder. Throws dt::Error naming the file and the failing call (the temporary file is
/// removed).
void write_file_atomically(const std::string& path, const std::string& text, bool durable = false);
/// How the temporary files of write_file_atomically(path) begin (PATH.tmp.), for removing those
/// a process left when it ended before its rename.
std::string temporary_prefix(const std::string& path);

/// Where the exporters send the registry.
struct ExporterOptions {
  std::string textfile;          ///< node_exporter textfile path ("" off); rewritten atomically
  Labels textfile_labels;        ///< constant labels on every series of the textfile
  std::string host = "0.0.0.0";  ///< address the HTTP endpoint binds
  int port = 0;                  ///< HTTP /metrics port: 0 off, -1 a free port chosen by the OS
  std::string push_url;          ///< Pushgateway base URL, e.g. http://gw:9091 ("" off)
  std::string job;               ///< Pushgateway grouping key: job
  std::string instance;          ///< Pushgateway grouping key: instance
  double push_timeout_s = 2.0;   ///< connect / read / write timeout of one push
  /// An HTTP connection is closed this long after a thread took it up, answered or not (a second
  /// without a byte from the client closes it sooner). One request per connection.
  double request_deadline_s = 5.0;
  std::string push_user, push_password;  ///< basic authentication of pushes (empty user: none)
};

/// The URL path of a push: /metrics/job/<job>/instance/<instance>, each value percent-encoded, or
/// in the Pushgateway's base64 form (job@base64/...) when it is empty or contains a slash.
std::string push_path(const std::string& job, const std::string& instance);

/// Serves and sends a registry. The HTTP server runs in its own thread from construction until
/// destruction (up to 32 connections at once, each on a thread of its own, 256 more waiting and
/// any beyond closed at once, fewer where RLIMIT_NOFILE is below 6144: a sixteenth of it in
/// all; GET /metrics, anything else 404). publish() hands a
/// textfile write and a push to a background thread and returns at once; publish_now() does them
/// in the caller's thread. A failed write or push calls `warn` once per kind (later failures are
/// only counted in dt_metrics_export_failures_total{kind=...}): metrics never stop the job.
class Exporter {
 public:
  /// Throws dt::ConfigError naming host and port when the HTTP port cannot be bound, and when
  /// push_url is not an http:// URL.
  Exporter(Registry& registry, ExporterOptions opts,
           std::function<void(const std::string&)> warn = {});
  /// Stops the server and the background thread (a textfile write in flight finishes first, a
  /// push in flight is stopped).
  ~Exporter();
  Exporter(const Exporter&) = delete;
  Exporter& operator=(const Exporter&) = delete;

  /// The port the HTTP endpoint listens on (0 when off).
  int port() const noexcept { return port_; }
  void publish();
  /// Returns true when every enabled export of this call succeeded. A push still in flight in
  /// the background is stopped first (this one sends newer values), so the call returns within
  /// about ExporterOptions::push_timeout_s even where the gateway never answers.
  bool publish_now();
  /// Whether a push to the Pushgateway has failed, or has waited more than 0.1 s for its answer
  /// now (one that never answers holds each push for up to ExporterOptions::push_timeout_s).
  bool push_waits() const noexcept;
  double push_timeout_s() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace dt::metrics
