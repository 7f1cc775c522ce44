// dt::Trainer: data-parallel GPT training with global-batch semantics.
//
// The config fixes the global batch (sequences per optimiser step). Each rank of the data-parallel
// communicator takes a contiguous share, in micro-batches; gradients are scaled by
// 1 / (global batch x seq_len) and summed with all_reduce, so the same config and seed give the
// same trajectory on any number of ranks (up to float summation order).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dt/checkpoint.hpp"
#include "dt/comm.hpp"
#include "dt/config.hpp"
#include "dt/data.hpp"
#include "dt/device.hpp"
#include "dt/gpt.hpp"
#include "dt/mesh.hpp"
#include "dt/optim.hpp"

namespace dt {

namespace security {
class SecretKey;
}

namespace obs {
class TrainTelemetry;
}

/// train.seed's default.
inline constexpr std::int64_t kDefaultSeed = 1337;

struct TrainConfig {
  GptConfig model;  ///< model.vocab 0: taken from the data file
  std::string data_path;
  std::string data_format = "auto";
  double val_fraction = 0.1;
  std::int64_t steps = 100;
  std::int64_t batch = 8;        ///< global sequences per step
  std::int64_t micro_batch = 0;  ///< sequences per forward on a rank; 0: the whole share
  /// A drain signal during a step gives it up at a micro-batch boundary (where it can be).
  bool drain_within_step = true;
  std::int64_t seed = kDefaultSeed;
  std::int64_t log_every = 10;
  std::string log_file;          ///< JSON lines per step (rank 0)
  std::int64_t eval_every = 50;  ///< 0: only at the start and the end
  std::int64_t eval_windows = 32;
  OptimConfig optim;
  std::int64_t sample_tokens = 0;
  double sample_temperature = 0.8;
  std::string sample_prompt = "\n";
  std::string sample_prompt_ids;  ///< "ID,ID,...": token ids that start the sample instead
  std::string device = "cpu";
  std::string plugin_path;
  std::int64_t device_index = -1;  ///< -1: the local rank modulo the plugin's device count
  std::int64_t threads = 1;
  std::string bind = "auto";
  bool pmix = true;
  bool print_config = false;
  // checkpoints
  std::string ckpt_dir;         ///< "" disables checkpoints (and draining writes nothing)
  std::int64_t ckpt_every = 0;  ///< steps between saves (0: only at the end and on drain)
  std::int64_t ckpt_keep = 3;
  double ckpt_lock_wait_s = 120;  ///< waiting for another run's claim on ckpt_dir (FolderLock)
  double ckpt_timeout_s = 3600;   ///< a save or load's limit for the hang watchdog (0: none)
  bool ckpt_async = false;
  std::string ckpt_resume = "auto";         ///< auto | none | PATH
  bool eval_only = false;                   ///< report the loss of the resumed weights and stop
  std::int64_t eval_sequences = 64;         ///< --eval-only: first K validation sequences, in order
  std::string config_text;                  ///< effective config, stored in checkpoints
  std::int64_t test_kill_during_save = -1;  ///< testing only: this rank SIGKILLs itself mid-save
  std::int64_t test_fail_rank = -1;         ///< testing only: this rank fails (dt::Error) at ...
  std::int64_t test_fail_step = 2;          ///< ... this step (from 0), while the others go on
  std::int64_t test_fail_save_at_step = 0;  ///< testing only: the save of this step fails
  // gradient reduction (data parallelism)
  double bucket_mb = 25;            ///< bucket size; 0: one all_reduce per parameter tensor
  std::string allreduce = "auto";   ///< auto | shm | mpi
  std::int64_t shm_min_bytes = 0;   ///< smaller all_reduce messages go to MPI
  std::int64_t test_sim_nodes = 0;  ///< testing only: ranks split into this many simulated nodes
  // hang watchdog
  double comm_timeout_s = 600;         ///< a collective in flight longer than this aborts the job
  std::string comm_dump_dir = ".";     ///< where the watchdog writes its dump
  std::int64_t test_stall_rank = -1;   ///< testing only: stops before step test.skip-step
  std::string test_stall_at = "step";  ///< ... or before the evaluation after it
  std::int64_t test_skip_collective = -1;    ///< testing only: this rank never joins a collective
  std::int64_t test_skip_step = 2;           ///< ... the loss all_reduce of this step
  std::int64_t test_stall_during_save = -1;  ///< testing only: this rank stops mid-save
  double test_start_delay_s = 0;             ///< testing only: start-up waits this long
  double test_save_delay_s = 0;              ///< testing only: the last rank's saves wait this long
  std::int64_t test_hold_at_step = 0;  ///< testing only: wait for a drain signal after this step
  // metrics and timeline (include/dt/metrics.hpp, include/dt/trace.hpp)
  int metrics_port = 0;  ///< HTTP /metrics at port + local_rank; 0 off; -1 a free port
  std::string metrics_host = "0.0.0.0";
  std::string metrics_textfile;        ///< node_exporter textfile; {rank} becomes the rank
  std::string metrics_push_url;        ///< Pushgateway base URL
  std::string metrics_push_auth_file;  ///< USER:PASSWORD of the Pushgateway's basic auth
  std::string metrics_push_user, metrics_push_password;  ///< read from it by validate_and_load
  double metrics_push_timeout_s = 2.0;      ///< connect / read / write timeout of one push
  double metrics_request_deadline_s = 5.0;  ///< an HTTP connection's whole time on the endpoint
  std::string metrics_job;                  ///< push job label ("": $SLURM_JOB_ID, else dt_train)
  std::int64_t metrics_every = 10;
  double peak_flops = 1e11;  ///< per rank, for model FLOP utilisation
  std::string trace_dir;     ///< "" off
  int local_rank = 0;        ///< set by the app from the runtime (metrics port offset)
  // parallel layout (include/dt/mesh.hpp): dp x tp x pp ranks
  int par_dp = 0;  ///< 0: world / (tp x pp)
  int par_tp = 1;
  int par_pp = 1;
  std::int64_t par_microbatches = 0;  ///< per data-parallel rank and step; 0: from micro_batch
  int par_zero = 0;       ///< ZeRO stage: 0 replicas, 1 optimizer, 2 + gradients, 3 + parameters
  bool par_auto = false;  ///< choose the layout from world, topology and memory
  std::string par_engine = "auto";  ///< auto: fused model when tp = pp = 1; graph: always graph
  bool cuda_graphs = false;         ///< replay a micro-batch's device work from graphs
  std::string mem_limit = "0";      ///< per-rank memory limit of a plan ("8G"; 0: none)
  bool print_plan = false;          ///< print the per-rank plan, write plan_dot, and stop
  std::string plan_dot = "dt-plan.dot";
  std::string p2p = "mpi";                   ///< pipeline point-to-point transport: mpi | ucx
  std::string test_sim_placement = "block";  ///< testing only: block | cyclic
  RankSite site;  ///< where this rank runs (set by the app from the runtime)
  // mixed precision
  std::string dtype = "fp32";  ///< fp32 | bf16 | fp16: storage of the compute weights and gradients
  std::string grad_reduce =
      "fp32";  ///< fp32 | bf16: what the data-parallel gradient all_reduce carries
  double loss_scale_initial = 65536;
  std::int64_t loss_scale_growth_interval = 2000;
  int loss_scale_hysteresis = 1;
  double loss_scale_min = 1;
  std::int64_t test_inject_inf_rank = -1;  ///< testing only: this rank's gradient gets an Inf
  std::int64_t test_inject_inf_step = 2;   ///< ... at this step
  std::int64_t test_inject_inf_every = 0;  ///< ... and every this many steps after it (0: once)
  bool test_cast_weights = false;          ///< testing only: no 16-bit weight copy for the products
  // security (include/dt/security.hpp)
  std::string seal = "off";  ///< off | p2p (pipeline messages) | all (and collectives)
  std::string key_file;      ///< 32-byte job key, owner-only permissions
  /// The key of key_file, read once by validate_and_load: the ranks' comparison and every use
  /// take this one (a file replaced meanwhile cannot give two keys).
  std::shared_ptr<const security::SecretKey> key;
  std::string aes = "auto";             ///< AES-256-GCM code: auto | openssl | ipsec-mb
  bool seal_exempt_node_local = false;  ///< traffic inside a node's shared memory stays plain
  bool seal_shm = true;       ///< sealed traffic inside a node goes through shared-memory mailboxes
  bool ckpt_encrypt = false;  ///< checkpoints encrypted at rest with the job key
  /// testing only: flip:N | replay:N | reorder:N | drop-record:N | swap-records:N
  std::string test_tamper = "none";
  std::int64_t test_tamper_rank = -1;  ///< testing only: the rank whose sends are tampered with
};

/// Exit code of a run that drained on SIGUSR1/SIGTERM after writing a checkpoint: job scripts
/// requeue on it (EX_TEMPFAIL).
inline constexpr int kExitDrained = 75;
/// Exit code of a run that drained on SIGUSR1/SIGTERM with nothing to save it in (no ckpt.dir):
/// not requeued, which would start it again from step 0.
inline constexpr int kExitDrainedUnsaved = 76;

/// Routes SIGUSR1 and SIGTERM to a drain request (a flag; nothing else happens in the handler).
void install_drain_signals();
bool drain_requested() noexcept;

/// Registers every option of dt_train on `o` (sections model, train, optim, data, sample, eval,
/// runtime, parallel, engine, mem, plan, comm, ckpt, loss-scale, security, metrics, trace and
/// test, and print-config, print-plan and eval-only), writing into `c`.
void add_train_options(Options& o, TrainConfig& c);

/// After o.parse(): throws dt::ConfigError when --parallel.auto is on and any of --parallel.dp,
/// --parallel.tp or --parallel.pp was given as well (on the command line or in the config file,
/// whatever its value), naming them.
void check_layout_options(const Options& o, const TrainConfig& c);

/// Checks everything that does not need MPI and loads the data: throws dt::ConfigError naming
/// the option and value. Call on every rank before the runtime starts.
TokenFile validate_and_load(TrainConfig& c);

/// The check of a resumed model before anything is allocated: the checkpoint the run would resume
/// first (--ckpt.resume=PATH, or for auto the one the folder's `latest` names, else its newest)
/// must have been written by a model of this run's --model.vocab, seq-len, layers, heads and embd.
/// Throws dt::CheckpointError "checkpoint does not match the model: FILE was trained with
/// --model.embd=32 (this run: 64), ..." naming every setting that differs; returns quietly where
/// there is no such file or it records no settings (the load decides then), except that with
/// --eval-only no file is a dt::ConfigError ("no checkpoint to evaluate"). Not collective.
void check_resume_model(const TrainConfig& c);

/// GPT-2's end-of-text token, which separates documents in its token files.
inline constexpr std::int32_t kGpt2EndOfText = 50256;

/// The tokens that start the sample of a run on data of `format`: --sample.prompt-ids when given,
/// else the bytes of --sample.prompt for byte data, else GPT-2's end-of-text token (token 0 for a
/// vocabulary without it). Throws dt::ConfigError naming the option for an id or byte that the
/// model's vocabulary lacks (validate_and_load checks it before anything is allocated).
std::vector<std::int32_t> sample_prompt_tokens(const TrainConfig& c, const std::string& format);

/// Collective over `world`: every rank holds the data rank 0 holds (format, token count and
/// token_digest), else throws dt::ConfigError on each rank that differs, naming `path`, its host
/// and both figures (a node-local copy of another version, say). Call after validate_and_load.
void check_same_data(Comm& world, const TokenFile& data, const std::string& path);

/// Collective over `world`, where c seals traffic or encrypts checkpoints: every rank read the
/// job key rank 0 read (compared by security::key_fingerprint), else throws dt::ConfigError on
/// each rank that differs, naming its key file and host. Without it, a node with another key
/// would write checkpoint chunks that no key opens, or fail to open rank 0's.
void check_same_key(Comm& world, const TrainConfig& c);

/// Collective over `world`: every rank's device keeps its tensors where rank 0's does (host or
/// device memory: the communicators, gradient buffers and collectives are chosen by it), else
/// throws dt::ConfigError on each rank that differs, naming both devices and the rank's host.
/// Devices of one kind may differ (a node's vendor plugin of the CPU device, say).
void check_same_device_kind(Comm& world, const Device& dev);

/// Collective over `world`: every rank parsed the options rank 0 parsed (`options`: each rank's
/// Options::dump()), else throws dt::ConfigError on each rank that differs, naming the first
/// option that differs, its value there and on rank 0, and the rank's host (a config file that
/// differs between nodes, say). Options that name what is local to a node (the config file's
/// path, the data's and the key file's paths, the device and its plugin path, threads and
/// binding, the QoS files, the metrics port, host, textfile and push credentials, the trace and
/// dump folders, the step log, print-config), those Options::node_local marks and `node_local`
/// names, may differ: the data's
/// content is checked by check_same_data.
void check_same_options(Comm& world, const std::string& options,
                        const std::vector<std::string>& node_local);

/// One optimiser step's figures (identical on every rank).
struct StepStats {
  std::int64_t step = 0;  ///< 0-based index of the step just taken
  double loss = 0;        ///< mean training loss over the global batch
  double lr = 0;
  double grad_norm = 0;  ///< before clipping (infinite on a skipped step)
  double seconds = 0;
  bool skipped = false;   ///< mixed precision: the gradients overflowed, no update was made
  double loss_scale = 1;  ///< the loss scale this step used
  /// A drain signal came during the step, and every rank gave it up at the same micro-batch
  /// boundary: nothing changed (weights, optimizer and loss scale are as after the step before,
  /// the next step is this one again), and the other fields but `step` and `seconds` mean
  /// nothing.
  bool given_up = false;
};

class GradBuckets;
struct GradWire;
class LossScaler;
namespace security {
class Keys;
struct SealedCommOptions;
struct Tamper;
}  // namespace security
class StageEngine;
class ZeroShards;
struct Plan;

class Trainer {
 public:
  /// Checks the split of the global batch over `comm` (dt::ConfigError), then allocates the model
  /// and optimiser on `dev` and initialises the weights from the seed.
  ///
  /// Devices whose memory the host cannot touch (Device::host_memory() false) keep gradients and
  /// activations in device memory. Their collectives (data-parallel gradients, the tensor-parallel
  /// group, the tied embedding) go through `device_comm`, called collectively over a host
  /// communicator's ranks to make a communicator for device tensors over the same group (NCCL);
  /// without one, or when collectives are sealed, through a dt::StagedComm over the host
  /// communicator. Pipeline messages always go through a dt::StagedP2p over the host transport.
  using DeviceCommFactory =
      std::function<std::unique_ptr<Comm>(Comm& group, const std::string& name)>;
  Trainer(Comm& comm, const Device& dev, const TrainConfig& c, const TokenFile& data,
          DeviceCommFactory device_comm = {});
  ~Trainer();

  StepStats step();
  /// Mean loss over the fixed validation windows (all ranks share the work).
  double evaluate();
  /// Generates `n` tokens after `prompt` on this rank (no communication). Where no rank holds the
  /// whole model (the graph engine; ZeRO-3), its parameters must have been assembled since the
  /// last step or resume (global_parameters(), collective, as run() does); InvalidArgument if not.
  std::vector<std::int32_t> sample(const std::vector<std::int32_t>& prompt, std::int64_t n,
                                   double temperature, std::uint64_t seed);
  /// Runs the whole job with progress lines on rank 0; returns the process exit code (0, or
  /// kExitDrained after a drain, kExitDrainedUnsaved after one without ckpt.dir). Resumes from
  /// ckpt_resume first.
  int run();
  /// Loads the checkpoint chosen by ckpt_resume; returns the file used ("" when starting fresh).
  std::string resume_from_checkpoint();
  /// Writes a checkpoint of the current state (synchronously unless ckpt_async and !sync).
  void save_checkpoint_now(bool sync);
  /// Mean loss over the first `n` validation sequences taken in order (no sampling).
  double evaluate_in_order(std::int64_t n);
  /// The tensors of the training state: /model/..., /optim/exp_avg/..., /optim/exp_avg_sq/...
  /// The checkpointed state as this rank holds it. `save`: only the parts this rank writes
  /// (each element once over all ranks); else every part it holds (replicas too).
  std::vector<CkptTensor> state_tensors(bool save = true);

  /// The fused model (data parallelism only; null on the graph engine path).
  Gpt& model() noexcept { return *model_; }
  /// The whole model's parameters in gpt_params() order, assembled from every rank's shards.
  /// Collective over the trainer's communicator.
  std::vector<float> global_parameters();
  /// The layout this trainer runs ("dp=4 tp=1 pp=1").
  std::string layout() const;
  /// Prints the per-rank plan and the placement and writes the DOT file (rank 0; the other ranks
  /// do nothing). Throws dt::ConfigError when the DOT file cannot be written.
  void print_plan();
  /// The metrics' textfile write and push, now (a rank that fails, before the abort). Never
  /// throws.
  void publish_metrics() noexcept;
  AdamW& optimizer() noexcept { return *opt_; }
  std::int64_t next_step() const noexcept { return step_; }

 private:
  Comm& comm_;
  const Device& dev_;
  TrainConfig c_;
  const TokenFile& data_;
  const std::string
      data_id_;  ///< data_identity(data_): what checkpoints record and resume compares
  Split split_;
  std::unique_ptr<Sampler> sampler_;
  std::vector<std::size_t> eval_starts_;
  std::int64_t local_batch_ = 0, micro_ = 0;
  bool drain_noted_ = false;  ///< a drain signal that came during a step was said
  /// At a micro-batch boundary of the step (`done` of `total` micro-batches run): true when the
  /// ranks agree to give the step up for a drain.
  bool give_up_step(std::int64_t done, std::int64_t total);
  // engine.cuda_graphs: the device stream all the trainer's work goes to; declared before what
  // uses it (the communicators, the model), so it is destroyed after them.
  std::unique_ptr<void, std::function<void(void*)>> graph_stream_;
  std::unique_ptr<Comm> grad_comm_;  // gradient all_reduce (shared memory or MPI); holds the
                                     // gradient buffer when it is a shared-memory arena
  /// A step of several micro-batches (a pipeline: more than drain_lag_ + 1) can be given up for
  /// a drain between two of them: the ranks vote at the boundaries (a 4-byte all_reduce of their
  /// drain flags, on a communicator of its own). One pipeline stage: the vote is blocking, so a
  /// rank stuck in a micro-batch shows to the watchdog as the one the others wait for, and no
  /// collective stays open across a micro-batch's compute. Several stages (drain_lag_ > 0): the
  /// vote taken before micro-batch k's forward is read before micro-batch k + drain_lag_'s, when
  /// every stage of the pipeline has taken it (a blocking vote would hold each stage until the last
  /// one reached the same micro-batch). It is taken as a background operation
  /// (watchdog::BackgroundScope) and watched while read: a rank stuck in a pass is named by the
  /// stages waiting for its messages, or by the ranks waiting for its next vote (or for the one it
  /// took, as busy elsewhere).
  bool drain_within_step_ = false;
  int drain_lag_ = 0;
  /// A step's pipeline drain votes (drain_lag_ > 0). Declared before the vote's communicator,
  /// so that their buffers outlive it and any vote an error left pending.
  struct PipeVotes;
  std::unique_ptr<PipeVotes> pipe_votes_;
  std::uint64_t votes_ = 0;  ///< votes taken on drain_vote_comm_, which carries nothing else
  std::unique_ptr<Comm> drain_vote_comm_;
  std::unique_ptr<Gpt> model_;
  std::unique_ptr<GradBuckets> buckets_;
  std::unique_ptr<AdamW> opt_;
  std::vector<std::int32_t> inputs_, targets_;
  std::int64_t step_ = 0;
  std::int64_t tokens_ = 0;  ///< training tokens seen, over resumes (checkpoint attribute tokens)
  std::unique_ptr<AsyncCheckpointer> async_;
  std::int64_t last_saved_ = -1;
  /// The checkpoint of ckpt.dir a requeued run (resume=auto) resumes from, as far as this run
  /// knows: the last it committed there, or the one it resumed from the folder; "" when neither.
  std::string resumable_;
  bool test_save_failed_ = false;  // test.fail-save-at-step has failed its save
  std::uint64_t saves_ = 0;        // synchronous saves so far (the watchdog's sequence numbers)
  void log(const std::string& line) const;
  /// Mean loss over the validation windows starting at `starts`, shared out over the ranks.
  double loss_over(const std::vector<std::size_t>& starts);
  void finish_checkpoints();
  void log_save_notes(const SaveStats& st);
  /// Testing only: prints `what` and never returns (the watchdog ends the job).
  // `step`: the step number the watchdog's activity names.
  [[noreturn]] void stall_for_test(const char* what, std::int64_t step);
  /// Testing only: stops (stall_for_test) when this is test.stall-rank in step test.skip-step
  /// and test.stall-at is `at`, saying where ("before the step", ...) as activity and line.
  void stall_at(const char* at, const char* where, std::int64_t step);
  /// A step ran (or was skipped for an overflow): its data is consumed.
  void count_step() {
    ++step_;
    tokens_ += c_.batch * c_.model.block;
  }
  std::unique_ptr<obs::TrainTelemetry> obs_;
  // The graph engine (tensor and pipeline parallelism).
  std::unique_ptr<Plan> plan_;
  std::unique_ptr<DeviceMesh> mesh_;
  std::unique_ptr<P2p> p2p_;
  std::unique_ptr<StageEngine> engine_;
  std::vector<char> counted_;        // per local parameter: counted once in the global norm
  std::vector<char> unique_;         // per stage parameter: this tp/pp position's copy counts
  std::vector<char> owner_;          // per stage parameter: unique_ on data-parallel rank 0
  std::vector<float> full_state_;    // global parameters (sampling, global_parameters())
  bool full_state_current_ = false;  // full_state_ holds the parameters as they are now
  // Security: the job's keys and the sealed communicators (seal=all).
  std::unique_ptr<security::Keys> keys_;
  std::unique_ptr<Comm> sealed_world_, sealed_tp_, sealed_tied_;
  /// The communicator of the trainer's own collectives (sealed with seal=all).
  Comm& coll() { return sealed_world_ ? *sealed_world_ : comm_; }
  // Mixed precision: fp32 master weights; the model computes with their rounding to c_.dtype.
  std::unique_ptr<LossScaler> scaler_;
  Device::Buffer master_;
  bool low_precision() const { return c_.dtype != "fp32"; }
  float* master_ptr() const;
  /// Rounds n floats of device memory to c_.dtype in place (Inf beyond the format's range).
  void round_to_dtype(float* data, std::size_t n);
  void refresh_working_weights();
  /// Divides n gradients by the loss scale; true when one of them is Inf or NaN (this rank).
  bool unscale_found_inf(float* grads, std::size_t n, float loss_scale);
  Device::Buffer lp_buf_, lp_flag_;  // 16-bit copy for rounding; the device's overflow flag
  Device::Buffer weights16_;         // unsharded bf16/fp16: the weights as the products read them
  DeviceCommFactory device_comm_;
  /// The data-parallel gradient communicator over `group` (the fused model and the stage engine
  /// alike): sealed with seal=all (where the test's tamper applies to collectives), the
  /// device's (device memory, unsealed), else shared memory (allreduce != mpi; on host memory
  /// with an arena of `numel` floats that *storage gets, for the gradients) or an MPI split;
  /// device tensors reach a host communicator through StagedComm.
  GradWire grad_wire() const;  // train.grad-reduce for GradBuckets
  std::unique_ptr<Comm> make_grad_comm(Comm& group, std::size_t numel,
                                       const security::SealedCommOptions& sealed,
                                       const security::Tamper& tamper, bool tamper_collectives,
                                       float** storage);
  /// The communicator for device tensors over `group` (see DeviceCommFactory); `sealed`, when
  /// given, is the sealed host communicator to stage through instead.
  std::unique_ptr<Comm> device_comm(Comm& group, const std::string& name,
                                    std::unique_ptr<Comm> sealed = nullptr);
  std::unique_ptr<Comm> device_tp_, device_tied_;  // device memory: tp and tied collectives
  Comm& tied_comm() const;
  std::vector<float> host_state_;  // device memory: checkpoints go through this host copy
  void state_to_device();
  // engine.cuda_graphs on the fused model: the captured forward+backward of one micro-batch and
  // the loss scale inside it; how often it was captured and replayed.
  Device::Graph graph_;
  float graph_scale_ = 0;
  bool graph_warm_ = false;
  std::int64_t graph_captures_ = 0, graph_replays_ = 0;
  void micro_batch_graph(float scale);
  /// Rank 0 prints what engine.cuda_graphs captured and replayed (the stage engine: for each
  /// stage). Collective.
  void report_graphs();
  double pipe_idle_s_ = 0, pipe_total_s_ = 0;  // 1F1B schedule time and its blocked part
  std::int64_t pipe_steps_ = 0;
  /// Rank 0 prints the measured pipeline bubble against 1F1B theory. Collective.
  void report_bubble();
  void setup_engine(const security::SealedCommOptions& sealed, const security::Tamper& tamper,
                    bool tamper_collectives);
  /// One step's forward and backward passes on the 1F1B schedule; returns this rank's loss sum.
  /// Sets `*given_up` where the ranks voted to give the step up for a drain: every stage then runs
  /// the backward passes of the micro-batches begun (the 1F1B schedule of that many), so no
  /// message is left in flight, and the step's gradients are dropped.
  double pipeline_step(float scale, bool* given_up);
  /// The pipeline's drain vote before micro-batch k's forward (of m): reads vote k - drain_lag_
  /// (true: give the step up here) and takes vote k.
  bool pipeline_drain_vote(int k, int m);
  /// Says once, on this rank, that a drain signal came during the step (`asked`: drain_requested()
  /// as the caller read it), before micro-batch `done` of `total`.
  void note_drain_mid_step(bool asked, std::int64_t done, std::int64_t total);
  /// Logs that the ranks gave the step up after `done` of its `total` micro-batches.
  void log_given_up(std::int64_t done, std::int64_t total);
  /// Assembles the global parameters from every rank's shards into full_state_. Collective.
  void gather_state();
  /// Whether no rank holds the whole model (the graph engine; ZeRO-3 on the fused model).
  bool model_sharded() const noexcept;
  /// Where model_sharded(): the whole model's parameters into full_state_ (for sampling), and
  /// true. Collective.
  bool assemble_whole();
  const std::vector<ParamInfo>& param_list() const;
  float* params_ptr() const;
  float* grads_ptr() const;
  /// Elements of the master parameters, gradients and moments this rank updates.
  std::size_t state_numel() const;
  // Sharded data parallelism (parallel.zero >= 1; the fused model or the stage engine).
  std::unique_ptr<ZeroShards> zero_;
  std::vector<char> zero_counted_;  // per shard piece: counted in the global norm (all)
  std::size_t bucket_bytes() const {
    return static_cast<std::size_t>(c_.bucket_mb * 1024.0 * 1024.0);
  }
  void setup_zero(const security::SealedCommOptions& sealed, const security::Tamper& tamper,
                  bool tamper_collectives);
  /// The initial weights from the seed (and zeroed optimiser state).
  void init_weights();
  /// Prints this rank's model-state bytes and activation estimate (rank 0 prints).
  void report_memory();
  /// Why the plan's `ranks_here` ranks on this node cannot fit the memory it has left
  /// (qos::memory_available), naming the node and both figures; "" when they may.
  std::string node_memory_problem(int ranks_here) const;
  /// Rank 0 prints every rank's measured peak resident memory. Collective.
  void report_peak_memory();
};

}  // namespace dt
