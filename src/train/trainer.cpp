#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>
#include <type_traits>

#include <atomic>
#include <csignal>

#include "comm/mpi_comm.hpp"
#include "comm/shm_comm.hpp"
#include "comm/staged_comm.hpp"
#include "dt/loss_scale.hpp"
#include "dt/metrics.hpp"
#include "dt/p2p.hpp"
#include "dt/qos.hpp"
#include "dt/security.hpp"
#include "dt/trace.hpp"
#include "dt/train.hpp"
#include "dt/watchdog.hpp"
#include "engine/grad_buckets.hpp"
#include "engine/pipeline.hpp"
#include "engine/plan.hpp"
#include "engine/zero.hpp"
#include "obs/train_obs.hpp"

namespace dt {

namespace {
// The one process-wide flag a signal handler may touch; read by other threads too, so a lock-free
// atomic rather than a volatile sig_atomic_t.
std::atomic<int> g_drain{0};
static_assert(std::atomic<int>::is_always_lock_free, "the drain flag must be async-signal-safe");
extern "C" void on_drain_signal(int) { g_drain.store(1, std::memory_order_relaxed); }

// The (name, value) pairs of a config text of "name = value" lines (Options::dump, as a
// checkpoint stores it), in order.
std::vector<std::pair<std::string, std::string>> config_lines(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  std::istringstream is(text);
  for (std::string line; std::getline(is, line);) {
    const auto eq = line.find(" = ");
    if (eq == std::string::npos) continue;
    // Values as they were set: dump quotes some (a path with spaces at its ends, say), and
    // checkpoints of format 3 and older hold them unquoted.
    std::string v = line.substr(eq + 3);
    try {
      v = Options::unquote(v);
    } catch (const ConfigError&) {  // not a value dump wrote: compared as it is
    }
    out.emplace_back(line.substr(0, eq), v);
  }
  return out;
}

// The value of option `name` in a config text; empty where the text lacks it.
std::string config_value(const std::string& text, const std::string& name) {
  for (auto& [n, v] : config_lines(text))
    if (n == name) return v;
  return "";
}

// Refuses (CheckpointError) the checkpoint `path`, whose settings are `saved`, when it was written
// by a model of another vocab, seq-len, layers, heads or embd than `model`, naming each that
// differs (settings the file lacks are taken).
void check_model_of(const std::string& path, const std::string& saved, const GptConfig& model) {
  std::string differ;
  for (const auto& [name, value] : model_settings(model)) {
    const std::string was = config_value(saved, name);
    if (!was.empty() && was != std::to_string(value))
      differ += std::string(differ.empty() ? "" : ", ") + "--" + name + "=" + was +
                " (this run: " + std::to_string(value) + ")";
  }
  DT_CHECK(CheckpointError, differ.empty(), "checkpoint does not match the model: ", path,
           " was trained with ", differ);
}

}  // namespace

void install_drain_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_drain_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

bool drain_requested() noexcept { return g_drain.load(std::memory_order_relaxed) != 0; }

void add_train_options(Options& o, TrainConfig& c) {
  o.add("model.vocab", &c.model.vocab, 0, "vocabulary size; 0 takes it from the data file", 0,
        1 << 20)
      .add("model.seq-len", &c.model.block, 128, "context length (positions) and training window",
           1, 1 << 16)
      .add("model.layers", &c.model.layers, 4, "transformer blocks", 1, 1024)
      .add("model.heads", &c.model.heads, 4, "attention heads per block (must divide model.embd)",
           1, 1024)
      .add("model.embd", &c.model.embd, 256, "embedding width", 1, 1 << 16)
      .add("model.pad-vocab", &c.model.pad_vocab, 0,
           "round the vocabulary of the head's products and loss up to a multiple of this (64 "
           "turns GPT-2's 50257 into 50304, which a GPU's fast matrix kernels want); the "
           "parameters keep model.vocab rows and the padding never gets probability (0, 1: no "
           "padding)",
           0, 1 << 16)
      .add("model.attention", &c.model.flash_attention, true,
           "what attention keeps for its backward: flash, one log-sum-exp per query row (the "
           "backward recomputes the probabilities; on a device without the flash_attention "
           "kernels, ABI version 4, it falls back to full), or full, the T x T probabilities",
           {"flash", "full"})
      .add("data.path", &c.data_path, "", "training text or token file (required)")
      .node_local()
      .add("data.format", &c.data_format, "auto",
           "bytes: any file, vocab 256; llmc: llm.c token file (header, uint16 GPT-2 tokens); "
           "u16: uint16 GPT-2 tokens without a header (nanoGPT's train.bin); auto: llmc or bytes",
           {"auto", "bytes", "llmc", "u16"})
      .add("data.val-fraction", &c.val_fraction, 0.1, "share of the file held out for validation",
           0.0, 0.9)
      .add("train.steps", &c.steps, 100, "optimiser steps", 1L, 1L << 40)
      .add("train.batch", &c.batch, 8, "global batch: sequences per step over all ranks", 1L,
           1L << 30)
      .add("train.micro-batch", &c.micro_batch, 0,
           "sequences per forward on one rank (0: the rank's whole share); must divide the share",
           0L, 1L << 30)
      .add("train.drain-within-step", &c.drain_within_step, true,
           "a drain signal during a step of several micro-batches gives the step up at a "
           "micro-batch boundary the ranks agree on (a 4-byte vote at each boundary; pipeline "
           "parallelism takes one before each forward pass but the first and the last "
           "parallel.pp, reads it parallel.pp forward passes later, then runs the backward passes "
           "of the micro-batches begun, so a step of at most parallel.pp + 1 micro-batches has "
           "none), and the run drains as of the step before; a signal after the step's last vote, "
           "and every signal with false, drains after the step")
      .add("train.seed", &c.seed, kDefaultSeed, "seed of the weights and the data order", 0L,
           (1L << 62))
      .add("train.log-every", &c.log_every, 10, "steps between progress lines", 1L, 1L << 40)
      .add("train.log-file", &c.log_file, "",
           "append one JSON line per step (step, loss, lr, grad_norm, seconds; val_loss when "
           "evaluated; loss_scale, skipped in bf16/fp16) to this file")
      .node_local()
      .add("train.eval-every", &c.eval_every, 50,
           "steps between validation losses (0: only first and last)", 0L, 1L << 40)
      .add("train.eval-windows", &c.eval_windows, 32, "fixed validation windows per evaluation", 1L,
           1L << 30)
      .add("optim.lr", &c.optim.lr, 1e-3, "peak learning rate", 0.0, 10.0)
      .add("optim.min-lr", &c.optim.min_lr, 1e-4, "learning rate at the end of the cosine", 0.0,
           10.0)
      .add("optim.warmup", &c.optim.warmup, 10, "linear warmup steps", 0L, 1L << 40)
      .add("optim.decay-steps", &c.optim.decay_steps, 0,
           "step where the cosine reaches min-lr (0: train.steps)", 0L, 1L << 40)
      .add("optim.beta1", &c.optim.beta1, 0.9, "AdamW beta1", 0.0, 0.999999)
      .add("optim.beta2", &c.optim.beta2, 0.95, "AdamW beta2", 0.0, 0.999999)
      .add("optim.eps", &c.optim.eps, 1e-8,
           "AdamW epsilon (above 0: a parameter whose gradients are all zero, such as the key "
           "bias, would divide 0 by 0)",
           1e-30, 1.0)
      .add("optim.weight-decay", &c.optim.weight_decay, 0.1,
           "decoupled weight decay on matrices and embeddings", 0.0, 10.0)
      .add("optim.grad-clip", &c.optim.grad_clip, 1.0, "global gradient norm limit (0: off)", 0.0,
           1e6)
      .add("sample.tokens", &c.sample_tokens, 0, "tokens to generate at the end (0: none)", 0L,
           1L << 20)
      .add("sample.temperature", &c.sample_temperature, 0.8, "sampling temperature", 1e-3, 100.0)
      .add("sample.prompt", &c.sample_prompt, "\n",
           "text that starts the sample (byte data; token data starts from GPT-2's end-of-text "
           "token 50256)")
      .add("sample.prompt-ids", &c.sample_prompt_ids, "",
           "token ids that start the sample instead of --sample.prompt, comma-separated "
           "(e.g. 50256,464,3290), each below --model.vocab")
      .add("runtime.device", &c.device, "cpu",
           "device plugin: cpu (built in) or NAME for libdt_hal_NAME.so")
      .node_local()
      .add("runtime.device-index", &c.device_index, -1,
           "device of the plugin each rank opens (-1: the rank's local rank modulo the number of "
           "devices, so the ranks of a node spread over its GPUs)",
           -1L, 1L << 20)
      .node_local()
      .add("runtime.plugin-path", &c.plugin_path, "",
           "colon-separated directories searched for device plugins (empty: $DT_PLUGIN_PATH, "
           "then the installation's plugin folders, next to the program and next to libdt)")
      .node_local()
      .add("runtime.threads", &c.threads, 1, "BLAS threads per rank", 1L, 1024L)
      .node_local()
      .add("runtime.bind", &c.bind, "auto", "CPU binding of each local rank",
           {"auto", "cores", "none"})
      .node_local()
      .add("runtime.pmix", &c.pmix, true, "use PMIx job information when the launcher provides it")
      .add("print-config", &c.print_config, false, "print the effective configuration and go on")
      .node_local()
      .add("ckpt.dir", &c.ckpt_dir, "", "checkpoint directory (empty: no checkpoints)")
      .add("ckpt.every", &c.ckpt_every, 0, "steps between checkpoints (0: only at the end)", 0L,
           1L << 40)
      .add("ckpt.keep", &c.ckpt_keep, 3, "newest checkpoints kept", 1L, 1000000L)
      .add("ckpt.lock-wait-s", &c.ckpt_lock_wait_s, 120.0,
           "how long a run waits for another run's claim on ckpt.dir (DIR/.dt-lock) to end "
           "before it refuses to start (a claim of a node that failed can outlive it on a "
           "shared file system for a while)",
           0.0, 86400.0)
      .add("ckpt.timeout-s", &c.ckpt_timeout_s, 3600.0,
           "hang watchdog: a checkpoint save or load (its collectives wait for the slowest "
           "rank's writes or reads) not finished after this many seconds ends the job, as "
           "comm.timeout-s does for other collectives (0: no limit)",
           0.0, 1e9)
      .add("ckpt.async", &c.ckpt_async, false,
           "write checkpoints in the background from a host snapshot")
      .add("ckpt.resume", &c.ckpt_resume, "auto",
           "auto: newest checkpoint of ckpt.dir that verifies; none; or a checkpoint file")
      .add("eval-only", &c.eval_only, false,
           "load the checkpoint of ckpt.resume, report the loss of eval.sequences and stop")
      .add("train.bucket-mb", &c.bucket_mb, 25.0,
           "gradient bucket size in MiB: each bucket's all_reduce starts as soon as backward has "
           "produced it (0: one all_reduce per parameter tensor); with parallel.zero=1 the "
           "reduce-scatter of layers smaller than this merges up to it (during backward on the "
           "fused model, after it with tensor or pipeline parallelism)",
           0.0, 1e6)
      .add("comm.allreduce", &c.allreduce, "auto",
           "gradient all_reduce: shm (shared memory inside a node, hierarchical across nodes), "
           "mpi, or auto (shm)",
           {"auto", "shm", "mpi"})
      .add("comm.shm-min-bytes", &c.shm_min_bytes, 0,
           "all_reduce messages smaller than this take MPI instead of shared memory (measured "
           "crossover on the build machines: see perf/RESULTS.md)",
           0L, 1L << 40)
      .add("comm.timeout-s", &c.comm_timeout_s, 600.0,
           "hang watchdog: a collective not finished after this many seconds makes the watchdog "
           "name the ranks that never reached it, write a dump to comm.dump-dir and abort the "
           "job with exit code 4 (0: no limit; ckpt.timeout-s still applies to checkpoints)",
           0.0, 1e9)
      .add("comm.dump-dir", &c.comm_dump_dir, ".",
           "folder for the watchdog's dump dt-watchdog-rank<R>.json (the job's output folder)")
      .node_local()
      .add("test.stall-rank", &c.test_stall_rank, -1,
           "testing only: this rank stops at the start of step test.skip-step, before its "
           "pipeline messages and collectives, so the others hang waiting for it and the "
           "watchdog must name it",
           -1L, 1L << 30)
      .add("test.stall-at", &c.test_stall_at, "step",
           "testing only: where test.stall-rank stops: before step test.skip-step + 1 (step); "
           "after that step's first micro-batch (micro-batch, with several a step; a pipeline: "
           "before the second one's forward pass); a pipeline, just after it took the drain vote "
           "there (after-vote, with more than parallel.pp + 1 micro-batches a step); a pipeline, "
           "before that step's first backward pass (backward); or before the evaluation after "
           "step test.skip-step (evaluation)",
           {"step", "micro-batch", "after-vote", "backward", "evaluation"})
      .add("test.skip-collective", &c.test_skip_collective, -1,
           "testing only: this rank never joins the loss all_reduce of step test.skip-step (it "
           "waits instead), so the others hang there and the watchdog must name it",
           -1L, 1L << 30)
      .add("test.skip-step", &c.test_skip_step, 2, "testing only: see test.skip-collective", 0L,
           1L << 40)
      .add("test.save-delay-s", &c.test_save_delay_s, 0.0,
           "testing only: the last rank's synchronous saves wait this long after their writes, "
           "so the other ranks wait for it in the save's collectives, as behind a slow disk",
           0.0, 3600.0)
      .add("test.start-delay-s", &c.test_start_delay_s, 0.0,
           "testing only: every rank waits this long once its options are read, before it loads "
           "the data and starts MPI, so that a test's signal arrives during start-up",
           0.0, 3600.0)
      .add("test.stall-during-save", &c.test_stall_during_save, -1,
           "testing only: this rank stops in the middle of a synchronous save (inside HDF5's "
           "collective writes), so the others hang there and the watchdog must end the job",
           -1L, 1L << 30)
      .add("test.hold-at-step", &c.test_hold_at_step, 0,
           "testing only: after step N (and its ckpt.every save) the ranks wait until any of them "
           "gets a drain signal (at most 300 s), so that a test's signal drains the job at step "
           "N (0: off)",
           0L, 1L << 40)
      .add("test.simulated-nodes", &c.test_sim_nodes, 0,
           "testing only: treat blocks of consecutive ranks as this many nodes for the "
           "hierarchical all_reduce (0: the real nodes)",
           0L, 1L << 20)
      .add("test.fail-save-at-step", &c.test_fail_save_at_step, 0,
           "testing only: the first checkpoint save of this step fails on every rank once its "
           "data is written, before anything is committed (0: none), in the background with "
           "ckpt.async; a second save of the step (a drain's) succeeds",
           0L, 1L << 62)
      .add("test.kill-during-save", &c.test_kill_during_save, -1,
           "testing only: this rank kills itself (SIGKILL) in the middle of a synchronous save",
           -1L, 1L << 30)
      .add("test.fail-rank", &c.test_fail_rank, -1,
           "testing only: this rank fails (an error, exit 3) before the optimizer of step "
           "test.fail-step while the others go on: a failure of one rank",
           -1L, 1L << 30)
      .add("test.fail-step", &c.test_fail_step, 2,
           "testing only: see test.fail-rank (counted from 0: 2 is the step printed as step 3)", 0L,
           1L << 40)
      .add("parallel.dp", &c.par_dp, 0,
           "data-parallel ranks (0: the ranks left by tp and pp); dp x tp x pp = ranks", 0, 1 << 20)
      .add("parallel.tp", &c.par_tp, 1,
           "tensor-parallel ranks: attention heads and MLP columns split over a group inside a "
           "node (must divide model.heads)",
           1, 1 << 12)
      .add("parallel.pp", &c.par_pp, 1,
           "pipeline stages: contiguous layers cut by cost, run on a 1F1B schedule (at most "
           "model.layers)",
           1, 1 << 12)
      .add("parallel.microbatches", &c.par_microbatches, 0,
           "micro-batches per step and data-parallel rank (0: from train.micro-batch; with "
           "pipeline stages and neither set, up to 4 per stage)",
           0L, 1L << 30)
      .add("parallel.auto", &c.par_auto, false,
           "choose dp, tp and pp from the world size, the ranks per node and the memory estimate "
           "(mem.limit), and print why")
      .add("parallel.engine", &c.par_engine, "auto",
           "auto: the fused model when tp = pp = 1, the graph engine otherwise; graph: always the "
           "graph engine",
           {"auto", "graph"})
      .add("engine.cuda_graphs", &c.cuda_graphs, false,
           "capture the device work of a micro-batch's forward and backward once (the fused "
           "model: after one eager micro-batch; the graph engine: after one eager step; again "
           "when the loss scale changes) and replay it for every later one: a CUDA graph on a "
           "GPU, a recorded call list on the CPU device. With tensor or pipeline parallelism (the "
           "graph engine) each stretch of device work between collectives and pipeline messages "
           "is a graph of its own. Not with parallel.zero = 2 or 3; gradients are reduced after "
           "the replay")
      .add("parallel.zero", &c.par_zero, 0,
           "sharded data parallelism: 0 replicas; 1 shards the AdamW state over the data-parallel "
           "ranks; 2 also the gradients; 3 also the parameters (gathered per layer when used)",
           0, 3)
      .add("mem.limit", &c.mem_limit, "0",
           "memory per rank a plan may use (estimate of parameters, gradients, optimizer state and "
           "activations), e.g. 8G; a plan over it is refused before training (0: no limit)")
      .add("print-plan", &c.print_plan, false,
           "print the parallel plan (placement, each stage's partitioned graph and memory "
           "estimate), write it as Graphviz DOT to --plan.dot, and stop")
      .add("plan.dot", &c.plan_dot, "dt-plan.dot", "file --print-plan writes the DOT graph to")
      .add("comm.p2p", &c.p2p, "mpi",
           "point-to-point transport of pipeline activations and their gradients", {"mpi", "ucx"})
      .add("train.dtype", &c.dtype, "fp32",
           "precision of the compute copy of the weights and of the gradients: fp32, bf16 or "
           "fp16 (fp32 master weights and optimizer state; fp16 with dynamic loss scaling; "
           "gradients are reduced in fp32 unless train.grad-reduce says otherwise)",
           {"fp32", "bf16", "fp16"})
      .add("train.grad-reduce", &c.grad_reduce, "fp32",
           "precision the data-parallel gradient all_reduce carries: fp32, or bf16 (each bucket "
           "rounded to bf16, summed in float and rounded at each step of the reduction, and "
           "widened back: half the traffic; not with parallel.zero)",
           {"fp32", "bf16"})
      .add("loss-scale.initial", &c.loss_scale_initial, 65536.0,
           "train.dtype=fp16: the first loss scale", 1e-30, 1e30)
      .add("loss-scale.growth-interval", &c.loss_scale_growth_interval, 2000,
           "train.dtype=fp16: clean steps in a row after which the scale doubles", 1L, 1L << 40)
      .add("loss-scale.hysteresis", &c.loss_scale_hysteresis, 1,
           "train.dtype=fp16: the scale halves at this overflow since the last growth and at "
           "each one after it until the next growth (1: at every overflow; each overflow step "
           "is skipped)",
           1, 1 << 20)
      .add("loss-scale.min", &c.loss_scale_min, 1.0,
           "train.dtype=fp16: the scale never falls below this", 1e-30, 1e30)
      .add("test.inject-inf-rank", &c.test_inject_inf_rank, -1,
           "testing only: this rank puts an Inf into its gradients at step test.inject-inf-step "
           "(with a loss scaler every rank must skip that step; in fp32, where it reaches every "
           "rank through the reduction, the run must end there with the weights untouched)",
           -1L, 1L << 30)
      .add("test.inject-inf-step", &c.test_inject_inf_step, 2,
           "testing only: see test.inject-inf-rank (counted from 0: 2 is the step printed as "
           "step 3)",
           0L, 1L << 40)
      .add("test.inject-inf-every", &c.test_inject_inf_every, 0,
           "testing only: with test.inject-inf-rank, also every this many steps after "
           "test.inject-inf-step (0: once)",
           0L, 1L << 40)
      .add("test.cast-weights", &c.test_cast_weights, false,
           "testing and benchmarks only: bf16/fp16 matrix products cast the weights for every "
           "product instead of reading the 16-bit copy kept after each optimizer step")
      .add("security.seal", &c.seal, "off",
           "AES-256-GCM sealing of tensor traffic: off; p2p (pipeline activations and their "
           "gradients); all (also every collective: dt's own algorithms decrypt, reduce and "
           "re-encrypt at each hop)",
           {"off", "p2p", "all"})
      .add("security.key_file", &c.key_file, "",
           "32-byte job key (owned by the job's user, no group or other permissions; distribute "
           "it with sbcast); needed by security.seal and ckpt.encrypt")
      .node_local()
      .add("security.aes", &c.aes, "auto",
           "AES-256-GCM code for sealing and encrypted checkpoints: openssl (OpenSSL's EVP); "
           "ipsec-mb (Intel ipsec-mb: VAES and AVX-512 where the CPU has them); auto (ipsec-mb "
           "where dt was built with it and the CPU has AVX-512 with VAES and VPCLMULQDQ, else "
           "openssl). The bytes are the same either way",
           {"auto", "openssl", "ipsec-mb"})
      .node_local()
      .add("security.exempt-node-local", &c.seal_exempt_node_local, false,
           "traffic between ranks of one node (shared memory) stays unsealed")
      .add("security.shm", &c.seal_shm, true,
           "sealed traffic between ranks of one node goes through shared-memory mailboxes (each "
           "byte sealed once into the receiver's mailbox and opened once out of it); false: "
           "through the transport (comm.p2p: MPI or UCX)")
      .add("ckpt.encrypt", &c.ckpt_encrypt, false,
           "encrypt checkpoints at rest (AES-256-GCM per chunk) with the job key")
      .add("test.tamper", &c.test_tamper, "none",
           "testing only: test.tamper-rank alters its sealed messages: flip:N (one bit of message "
           "N), replay:N, reorder:N, drop-record:N, swap-records:N (records of a message of "
           "several)")
      .add("test.tamper-rank", &c.test_tamper_rank, -1L, "testing only: see test.tamper", -1L,
           1L << 30)
      .add("test.simulated-placement", &c.test_sim_placement, "block",
           "testing only: how test.simulated-nodes maps ranks to nodes for placement: block "
           "(consecutive ranks) or cyclic (round robin, as srun --distribution=cyclic)",
           {"block", "cyclic"})
      .add("eval.sequences", &c.eval_sequences, 64,
           "--eval-only: the first K validation sequences, taken in order", 1L, 1L << 40);
  o.add("metrics.port", &c.metrics_port, 0,
        "HTTP /metrics of each rank on this port plus its local rank (0: off; -1: a free port, "
        "printed)",
        -1, 65535)
      .node_local()
      .add("metrics.host", &c.metrics_host, "0.0.0.0", "address the /metrics endpoint listens on")
      .node_local()
      .add("metrics.textfile", &c.metrics_textfile, "",
           "file for node_exporter's textfile collector, rewritten atomically every "
           "metrics.every steps and at the end; {rank} becomes the rank")
      .node_local()
      .add("metrics.push-url", &c.metrics_push_url, "",
           "Pushgateway (http://HOST:PORT): each rank pushes every metrics.every steps and at the "
           "end, as job metrics.job, instance = rank; a failed push is a warning")
      .add("metrics.push-auth-file", &c.metrics_push_auth_file, "",
           "file holding USER:PASSWORD for a Pushgateway behind basic authentication (private "
           "to the job's user, as security.key_file; credentials in metrics.push-url are "
           "refused)")
      .node_local()
      .add("metrics.push-timeout-s", &c.metrics_push_timeout_s, 2.0,
           "seconds one push may take to connect, send and be answered before it counts as "
           "failed",
           0.001, 3600.0)
      .add("metrics.request-deadline-s", &c.metrics_request_deadline_s, 5.0,
           "seconds an HTTP connection to the /metrics endpoint may take, answered or not, "
           "from the moment a server thread takes it up (a second without a byte closes it "
           "sooner)",
           0.001, 3600.0)
      .add("metrics.job", &c.metrics_job, "",
           "job label of pushes (empty: $SLURM_JOB_ID, else dt_train)")
      .add("metrics.every", &c.metrics_every, 10, "steps between textfile writes and pushes", 1L,
           1L << 40)
      .add("metrics.peak-flops", &c.peak_flops, 1e11,
           "peak FLOP/s of one rank, the denominator of model FLOP utilisation (default: about "
           "one AVX2+FMA core at 3 GHz in fp32; an H100 SXM is 989e12 in bf16)",
           1.0, 1e18)
      .add("trace.dir", &c.trace_dir, "",
           "write a Chrome trace-event timeline of each rank to DIR/trace-rank<R>.json (empty: "
           "off)")
      .node_local();
}

namespace {
// Rank 0's `mine` (a value of plain bytes), on every rank. Collective over `world`.
template <class T>
T rank0_value(Comm& world, const T& mine) {
  static_assert(std::is_trivially_copyable_v<T>);
  T first = mine;
  world.broadcast(view_of(reinterpret_cast<std::uint8_t*>(&first), sizeof first), 0);
  return first;
}
// This node's host name, for messages.
std::string host_name() {
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  return host;
}
}  // namespace

void check_same_data(Comm& world, const TokenFile& data, const std::string& path) {
  // Rank 0's figures: token count, digest, and the format as an index into kFormats.
  static const std::string kFormats[] = {"bytes", "llmc", "u16", "?"};
  const auto format =
      static_cast<std::uint64_t>(std::find(kFormats, kFormats + 3, data.format) - kFormats);
  const std::array<std::uint64_t, 3> mine = {data.size(), token_digest(data), format};
  const std::array<std::uint64_t, 3> first = rank0_value(world, mine);
  if (mine == first) return;
  auto describe = [](const std::array<std::uint64_t, 3>& f) {
    return data_identity(kFormats[f[2] < 3 ? f[2] : 3], f[0], f[1]);
  };
  DT_THROW(ConfigError, "option --data.path: ", path, " on this rank's node (", host_name(),
           ") holds ", describe(mine), "; rank 0's holds ", describe(first),
           ": every rank must read the same data");
}

void check_same_key(Comm& world, const TrainConfig& c) {
  if (c.seal == "off" && !c.ckpt_encrypt) return;
  // A key that fails to load here still takes part in the broadcast (as no fingerprint), so that
  // no rank is left waiting in it; the error is thrown after.
  std::string mine, load_error;
  try {
    mine = security::key_fingerprint(c.key ? *c.key : security::load_key_file(c.key_file));
  } catch (const Error& e) {
    load_error = e.message();
  }
  std::array<char, 16> fp{};
  std::copy_n(mine.begin(), std::min(mine.size(), fp.size()), fp.begin());
  const std::array<char, 16> first = rank0_value(world, fp);
  DT_CHECK(ConfigError, load_error.empty(), load_error);
  const std::string theirs(first.begin(), first.end());
  if (theirs == mine) return;
  DT_THROW(ConfigError, "option --security.key_file: ", c.key_file, " on this rank's node (",
           host_name(), ") holds another key than rank 0's (fingerprints ", mine, " and ", theirs,
           "): every rank must use the same job key");
}

void check_same_device_kind(Comm& world, const Device& dev) {
  const int host = dev.host_memory() ? 1 : 0;
  const int first = rank0_value(world, host);
  const std::string first_name = broadcast_text(world, dev.name(), 0);
  auto where = [](int h) { return h ? "in host memory" : "in device memory"; };
  DT_CHECK(ConfigError, first == host, "option --runtime.device: '", dev.name(),
           "' on this rank's node (", host_name(), ") keeps tensors ", where(host), ", rank 0's '",
           first_name, "' ", where(first),
           ": every rank must train on devices of one kind (the communicators differ)");
}

void check_same_options(Comm& world, const std::string& options,
                        const std::vector<std::string>& node_local) {
  const std::string first = broadcast_text(world, options, 0);
  if (first == options) return;
  const std::set<std::string> local(node_local.begin(), node_local.end());
  const auto theirs = config_lines(first), mine = config_lines(options);  // rank 0's order
  const std::map<std::string, std::string> mine_by(mine.begin(), mine.end()),
      theirs_by(theirs.begin(), theirs.end());
  const std::string host = host_name();
  for (const auto& [name, value] : theirs) {
    if (local.count(name)) continue;
    const auto it = mine_by.find(name);
    DT_CHECK(ConfigError, it != mine_by.end(), "option --", name, " (", value,
             " on rank 0) is unknown to dt_train on this rank's node (", host,
             "): every rank must run the same dt_train");
    DT_CHECK(ConfigError, it->second == value, "option --", name, " is '", it->second,
             "' on this rank (node ", host, ") but '", value,
             "' on rank 0: every rank must train with the same options (a config file that "
             "differs between nodes?)");
  }
  for (const auto& [name, value] : mine)
    DT_CHECK(ConfigError, local.count(name) || theirs_by.count(name), "option --", name, " (",
             value, " here, on node ", host,
             ") is unknown to rank 0's dt_train: every rank must run the same dt_train");
}

namespace {
// The step log (--train.log-file), opened for appending: a FIFO that nobody reads is refused
// (O_NONBLOCK: ENXIO) instead of blocking the start, as is the training data itself (the log
// would be appended to it). The descriptor is blocking again on return.
int open_step_log(const std::string& path, const std::string& data_path) {
  struct stat log_st {
  }, data_st{};
  DT_CHECK(ConfigError,
           !(::stat(path.c_str(), &log_st) == 0 && ::stat(data_path.c_str(), &data_st) == 0 &&
             log_st.st_dev == data_st.st_dev && log_st.st_ino == data_st.st_ino),
           "option --train.log-file: ", path, " is the training data (--data.path=", data_path,
           "): the step log would be appended to it");
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_NONBLOCK | O_CLOEXEC, 0666);
  DT_CHECK(ConfigError, fd >= 0, "option --train.log-file: cannot open ", path, " for appending: ",
           errno == ENXIO ? std::string("a FIFO that no process reads") : std::strerror(errno));
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

// --plan.dot, before the plan is made: a file there is replaced only where it is a DOT graph (an
// earlier plan), never the training data, a config or a checkpoint named by mistake; a folder
// that cannot take the file is refused now, not after the plan is printed.
void check_plan_dot(const std::string& path) {
  DT_CHECK(ConfigError, !path.empty(), "option --plan.dot is empty: expected a file name");
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    DT_CHECK(ConfigError, S_ISREG(st.st_mode), "option --plan.dot: ", path,
             S_ISDIR(st.st_mode) ? " is a folder" : " is not a plain file",
             ": expected a file to write the plan's DOT graph to");
    std::string head(8, '\0');
    std::FILE* f = std::fopen(path.c_str(), "rb");
    const std::size_t n = f ? std::fread(head.data(), 1, head.size(), f) : 0;
    if (f) std::fclose(f);
    head.resize(n);
    DT_CHECK(ConfigError, st.st_size == 0 || head == "digraph ", "option --plan.dot: ", path,
             " exists and is not a Graphviz DOT graph (it does not start with 'digraph'): it is "
             "left as it is. Name a new file, or remove that one");
    return;
  }
  const std::size_t slash = path.rfind('/');
  const std::string folder =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int err = file_creation_error(folder);
  DT_CHECK(ConfigError, err == 0, "option --plan.dot: cannot write ", path, " (making a file in ",
           folder, ": ", std::strerror(err), ")");
}

// A stall seam that the run's schedule never reaches would pass a test silently: refused.
// (A run resumed past test.skip-step starts after it too; that is not known before the resume.)
void check_stall_seams(const TrainConfig& c) {
  const std::int64_t k = c.test_skip_step;
  const std::string at = "option --test.skip-step: " + std::to_string(k);
  if (c.test_skip_collective >= 0)
    DT_CHECK(ConfigError, k < c.steps, at, " is not before the last step (--train.steps=", c.steps,
             "): --test.skip-collective skips the loss all_reduce of step ", k + 1);
  if (c.test_stall_rank < 0 || c.eval_only) return;
  if (c.test_stall_at != "evaluation") {
    DT_CHECK(ConfigError, k < c.steps, at, " is not before the last step (--train.steps=", c.steps,
             "): --test.stall-rank stops ", c.test_stall_at == "step" ? "before step " : "in step ",
             k + 1);
    return;
  }
  DT_CHECK(ConfigError, c.val_fraction > 0,
           "option --test.stall-at=evaluation: there is no evaluation with --data.val-fraction=0");
  const bool evaluated =
      k <= c.steps && (k == 0 || k == c.steps || (c.eval_every > 0 && k % c.eval_every == 0));
  DT_CHECK(ConfigError, evaluated, at,
           ": no evaluation follows that step, so --test.stall-at=evaluation would never stop "
           "(evaluations come before the first step, every --train.eval-every=",
           c.eval_every, " steps and after the last, --train.steps=", c.steps, ")");
}

}  // namespace

void check_resume_model(const TrainConfig& c) {
  std::string path;
  if (c.ckpt_resume != "auto" && c.ckpt_resume != "none") {
    path = c.ckpt_resume;
  } else if (c.ckpt_resume == "auto" && !c.ckpt_dir.empty()) {
    path = read_latest(c.ckpt_dir);
    struct stat st {};
    if (path.empty() || ::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
      const std::vector<CkptEntry> all = list_checkpoints(c.ckpt_dir);
      path = all.empty() ? "" : all.front().path;
    }
  }
  if (path.empty()) {
    // Nothing to evaluate: refused before the model is made (the resume would find none).
    // (--eval-only without --ckpt.dir or a file is refused with the options.)
    DT_CHECK(ConfigError, !c.eval_only, "option --eval-only: no checkpoint to evaluate in '",
             c.ckpt_dir, "'");
    return;
  }
  const std::string saved = checkpoint_config(path);
  if (saved.empty()) return;
  check_model_of(path, saved, c.model);
}

std::vector<std::int32_t> sample_prompt_tokens(const TrainConfig& c, const std::string& format) {
  const std::int64_t V = c.model.vocab;
  std::vector<std::int32_t> ids;
  if (!c.sample_prompt_ids.empty()) {
    std::size_t at = 0;
    for (;;) {
      const std::size_t comma = c.sample_prompt_ids.find(',', at);
      const std::string item = c.sample_prompt_ids.substr(at, comma - at);
      char* end = nullptr;
      errno = 0;
      const long long v = std::strtoll(item.c_str(), &end, 10);
      DT_CHECK(ConfigError,
               !item.empty() && std::isdigit(static_cast<unsigned char>(item[0])) && *end == '\0' &&
                   errno == 0 && v < V,
               "option --sample.prompt-ids: '", item, "' (item ", ids.size() + 1,
               ") is not a token id: expected comma-separated whole numbers from 0 to ", V - 1,
               " (--model.vocab=", V, ")");
      ids.push_back(static_cast<std::int32_t>(v));
      if (comma == std::string::npos) break;
      at = comma + 1;
    }
    return ids;
  }
  if (format != "bytes")
    return {static_cast<std::int32_t>(V > kGpt2EndOfText ? kGpt2EndOfText : 0)};
  // Byte data has no start token of its own: a sample starts from the prompt's bytes.
  DT_CHECK(ConfigError, !c.sample_prompt.empty(),
           "option --sample.prompt is empty: a sample of byte data starts from the prompt's "
           "bytes (the default is a line break), or give --sample.prompt-ids");
  const bool default_prompt = c.sample_prompt == "\n";
  for (std::size_t k = 0; k < c.sample_prompt.size(); ++k) {
    const auto b = static_cast<unsigned char>(c.sample_prompt[k]);
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02X", b);
    DT_CHECK(ConfigError, b < V, "option --sample.prompt",
             default_prompt ? " (its default, a line break)" : "", ": byte ", hex, " (byte ", k + 1,
             " of the prompt) is outside the model's vocabulary (--model.vocab=", V,
             "): give a prompt of bytes below ", V, " or a larger --model.vocab");
    ids.push_back(b);
  }
  return ids;
}

void check_layout_options(const Options& o, const TrainConfig& c) {
  if (!c.par_auto) return;
  std::string given;
  for (const auto& [name, value] :
       {std::pair<const char*, std::int64_t>{"dp", c.par_dp}, {"tp", c.par_tp}, {"pp", c.par_pp}})
    if (o.given(std::string("parallel.") + name))
      given += std::string(given.empty() ? "" : " and ") + "--parallel." + name + "=" +
               std::to_string(value);
  DT_CHECK(ConfigError, given.empty(),
           "option --parallel.auto chooses dp, tp and pp itself: it cannot be combined with ",
           given, " (drop --parallel.auto to choose the layout yourself)");
}

TokenFile validate_and_load(TrainConfig& c) {
  DT_CHECK(ConfigError, !c.data_path.empty(), "option --data.path is required (a text file or an ",
           "llm.c token file)");
  DT_CHECK(ConfigError, c.model.embd % c.model.heads == 0, "option --model.heads: ", c.model.heads,
           " does not divide --model.embd=", c.model.embd);
  check_model_split(c.par_tp, c.par_pp, c.model);
  parse_size("mem.limit", c.mem_limit);
  // Rank 0 alone writes the step log: its node alone is asked.
  if (!c.log_file.empty() && launcher_rank() <= 0) ::close(open_step_log(c.log_file, c.data_path));
  DT_CHECK(ConfigError, !c.ckpt_resume.empty(),
           "option --ckpt.resume is empty: expected auto (the newest checkpoint in --ckpt.dir), "
           "none, or a checkpoint file");
  security::parse_tamper(c.test_tamper, "test.tamper");
  check_stall_seams(c);
  if (c.print_plan && launcher_rank() <= 0) check_plan_dot(c.plan_dot);
  if (!c.metrics_push_auth_file.empty()) {
    DT_CHECK(ConfigError, !c.metrics_push_url.empty(),
             "option --metrics.push-auth-file is given without --metrics.push-url");
    std::tie(c.metrics_push_user, c.metrics_push_password) =
        security::load_basic_auth_file("option --metrics.push-auth-file", c.metrics_push_auth_file);
  }
  if (c.seal != "off" || c.ckpt_encrypt) {
    DT_CHECK(ConfigError, !c.key_file.empty(), "option --security.key_file is required by ",
             c.seal != "off" ? "--security.seal=" + c.seal : std::string("--ckpt.encrypt"));
    // Refused here, naming the file and its mode; kept for every use.
    c.key = std::make_shared<const security::SecretKey>(security::load_key_file(c.key_file));
  }
  // The watchdog writes its dump there when a collective hangs, too late to say it cannot: a
  // folder given is made and checked now (the default, the working folder, is checked then).
  if (c.comm_dump_dir != ".") ensure_writable_dir("--comm.dump-dir", c.comm_dump_dir);
  const security::AesImpl aes = security::parse_aes_impl(c.aes, "option --security.aes");
  DT_CHECK(ConfigError, security::aes_impl_available(aes), "option --security.aes=", c.aes, ": ",
           security::ipsec_mb_unavailable(), " (expected auto or openssl)");
  DT_CHECK(ConfigError, c.optim.min_lr <= c.optim.lr, "option --optim.min-lr: ", c.optim.min_lr,
           " is above --optim.lr=", c.optim.lr);
  DT_CHECK(ConfigError, c.dtype != "fp16" || c.loss_scale_min <= c.loss_scale_initial,
           "option --loss-scale.min: ", c.loss_scale_min,
           " is above --loss-scale.initial=", c.loss_scale_initial);
  // Refused where the fall comes within the run; a decay past the run's end changes nothing in
  // it (and is what --print-config writes for a run whose warmup outlasts it).
  DT_CHECK(ConfigError,
           c.optim.decay_steps == 0 || c.optim.decay_steps > c.optim.warmup ||
               c.optim.decay_steps >= c.steps,
           "option --optim.decay-steps: ", c.optim.decay_steps,
           " is not above --optim.warmup=", c.optim.warmup,
           " (the learning rate would fall before it reached --optim.lr)");
  if (c.optim.decay_steps == 0) c.optim.decay_steps = c.steps;
  DT_CHECK(ConfigError, c.test_hold_at_step <= c.steps,
           "option --test.hold-at-step: ", c.test_hold_at_step, " is above --train.steps=", c.steps,
           " (the run never reaches it)");
  TokenFile data = load_tokens(c.data_path, c.data_format);
  const bool vocab_given = c.model.vocab != 0;
  if (!vocab_given) c.model.vocab = data.vocab;
  DT_CHECK(ConfigError, data.max_token_plus_one <= c.model.vocab,
           "option --model.vocab: ", c.model.vocab,
           vocab_given ? std::string()
                       : " (the default for " + data.format + " data" +
                             (data.format == "bytes" ? "" : ", GPT-2's") + ")",
           " is too small for ", c.data_path, ", whose largest token is ",
           data.max_token_plus_one - 1, ": give --model.vocab=", data.max_token_plus_one,
           " or more");
  // Refused now, not after training; ids given for no sample are checked too (a typo there is
  // one still when sampling is turned on).
  if (c.sample_tokens > 0 || !c.sample_prompt_ids.empty()) sample_prompt_tokens(c, data.format);
  const Split s = split(data, c.val_fraction);
  // Constructing these checks that seq-len fits both parts (ConfigError naming the numbers).
  Sampler(data.data(s.train), s.train.size(), c.model.block, static_cast<std::uint64_t>(c.seed),
          "training split of " + c.data_path + " (--model.seq-len, --data.val-fraction)");
  if (c.val_fraction > 0 && !c.eval_only)  // (--eval-only evaluates eval.sequences in order)
    eval_windows(s.val.size(), c.model.block, c.eval_windows,
                 "validation split of " + c.data_path +
                     " (--data.val-fraction, --model.seq-len, --train.eval-windows)");
  if (c.eval_only) {
    DT_CHECK(ConfigError,
             c.ckpt_resume != "none" && !(c.ckpt_resume == "auto" && c.ckpt_dir.empty()),
             "option --eval-only needs a checkpoint: --ckpt.resume=PATH or --ckpt.dir with "
             "--ckpt.resume=auto");
    DT_CHECK(ConfigError, c.val_fraction > 0,
             "option --eval-only evaluates the validation split, and --data.val-fraction=0 "
             "leaves none");
    const std::size_t need = static_cast<std::size_t>(c.eval_sequences) * c.model.block + 1;
    DT_CHECK(ConfigError, need <= s.val.size(), "option --eval.sequences: ", c.eval_sequences,
             " sequences of ", c.model.block, " tokens need ", need,
             " validation tokens, the validation split of ", c.data_path, " has ", s.val.size());
  }
  return data;
}

namespace {
// This rank's site for placement, with the test-only simulated nodes applied.
RankSite site_of(const TrainConfig& c, int rank, int size) {
  RankSite s = c.site;
  if (c.test_sim_nodes <= 0) return s;
  const int k = static_cast<int>(std::min<std::int64_t>(c.test_sim_nodes, size));
  if (c.test_sim_placement == "cyclic") {
    s.node = rank % k;
    s.local_rank = rank / k;
  } else {
    s.node = static_cast<int>(static_cast<long>(rank) * k / size);
    int first = 0;
    while (static_cast<int>(static_cast<long>(first) * k / size) != s.node) ++first;
    s.local_rank = rank - first;
  }
  s.numa = 0;
  s.host = "simnode" + std::to_string(s.node);
  return s;
}

// The drain votes' communicator (sealed: kVoteComm/sealed).
constexpr const char* kVoteComm = "world/drain-vote";

// A record of the wait for vote `seq` on the votes' communicator `comm` for the watchdog, not
// counted in dt_comm_* (the communicator records and counts the vote itself, as it is taken, by
// the same number).
watchdog::OpRecord vote_record(const std::string& comm, std::uint64_t seq, bool sealed) {
  return watchdog::OpRecord(comm, seq, "all_reduce", sealed ? "sealed" : "mpi", DType::i32, 1, -1,
                            -1, false);
}
}  // namespace

struct Trainer::PipeVotes {
  PipeVotes(std::string comm_name, bool is_sealed)
      : comm(std::move(comm_name)), sealed(is_sealed) {}
  std::string comm;                ///< the votes' communicator
  bool sealed;                     ///< security.seal=all (the records' backend)
  std::vector<std::int32_t> flag;  ///< vote k's buffer: this rank's drain flag, then the max
  std::vector<Work> work;
  std::vector<std::uint64_t> seq;  ///< vote k's sequence number
  std::size_t settled = 0;         ///< the votes before this one are complete (or were never taken)
  std::size_t taken = 0;           ///< the votes before this one were taken or skipped

  void reset(int micro_batches) {
    const std::size_t n = static_cast<std::size_t>(micro_batches);
    flag.assign(n, 0);
    work.clear();
    work.resize(n);
    seq.assign(n, 0);
    settled = taken = 0;
  }
  /// Waits for vote i, watched for hangs from here (it ran in the background until now).
  void wait(std::size_t i) {
    if (!work[i].valid() || work[i].test()) return;
    const watchdog::OpRecord rec = vote_record(comm, seq[i], sealed);
    work[i].wait();
  }
  /// Completes the votes every rank has taken, oldest first.
  void poll() {
    while (settled < taken && (!work[settled].valid() || work[settled].test())) ++settled;
  }
  /// Waits for every vote taken (each rank took the same ones).
  void finish() {
    for (; settled < taken; ++settled) wait(settled);
  }
};

Trainer::Trainer(Comm& comm, const Device& dev, const TrainConfig& c, const TokenFile& data,
                 DeviceCommFactory device_comm)
    : comm_(comm),
      dev_(dev),
      c_(c),
      data_(data),
      data_id_(data_identity(data)),
      split_(split(data, c.val_fraction)),
      device_comm_(std::move(device_comm)) {
  const std::int64_t n = comm.size();
  // A test seam aimed at a rank the job does not have would silently do nothing.
  for (const auto& [name, rank] :
       {std::pair<const char*, std::int64_t>{"test.stall-rank", c_.test_stall_rank},
        {"test.skip-collective", c_.test_skip_collective},
        {"test.stall-during-save", c_.test_stall_during_save},
        {"test.kill-during-save", c_.test_kill_during_save},
        {"test.fail-rank", c_.test_fail_rank},
        {"test.inject-inf-rank", c_.test_inject_inf_rank},
        {"test.tamper-rank", c_.test_tamper_rank}})
    DT_CHECK(ConfigError, rank < n, "option --", name, ": ", rank, " is not a rank of this ", n,
             "-rank job");
  // The plan (layout, micro-batches, stages, memory estimate) is checked before any allocation.
  const std::vector<RankSite> sites = gather_sites(comm_, site_of(c_, comm_.rank(), comm_.size()));
  // One id for the timelines of this run's ranks (dt_trace merge refuses files of other runs),
  // drawn here, next to the collective before it, before anything that may fail on one rank.
  std::uint64_t run = 0;
  if (comm_.rank() == 0)
    run = static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) ^
          (static_cast<std::uint64_t>(::getpid()) << 40) ^ std::hash<std::string>{}(host_name());
  run = rank0_value(comm_, run);
  char run_id[24];
  std::snprintf(run_id, sizeof run_id, "%016llx", static_cast<unsigned long long>(run));
  std::map<int, int> per_node;
  for (const RankSite& s : sites) ++per_node[s.node];
  const bool flash_wanted = c_.model.flash_attention;  // model.attention=flash
  c_.model.flash_attention = flash_attention(dev_, flash_wanted);
  PlanRequest pr;
  pr.model = c_.model;
  pr.batch = c_.batch;
  pr.micro_batch = c_.micro_batch;
  pr.microbatches = c_.par_microbatches;
  pr.layout = Layout{c_.par_dp, c_.par_tp, c_.par_pp};
  pr.zero = static_cast<int>(c_.par_zero);
  pr.graph_engine = c_.par_engine == "graph";
  pr.bucket_bytes = bucket_bytes();
  pr.automatic = c_.par_auto;
  pr.low_precision = c_.dtype != "fp32";
  pr.grad_wire16 = c_.grad_reduce == "bf16";
  pr.mem_limit = static_cast<double>(parse_size("mem.limit", c_.mem_limit));
  pr.world = comm_.size();
  pr.evaluation_only = c_.eval_only;
  pr.ranks_per_node = comm_.size();
  for (const auto& kv : per_node) pr.ranks_per_node = std::min(pr.ranks_per_node, kv.second);
  plan_ = std::make_unique<Plan>(make_plan(pr));
  const Layout& L = plan_->layout;
  local_batch_ = plan_->local_batch;
  micro_ = plan_->micro;
  const bool graph_engine = L.tp > 1 || L.pp > 1 || c_.par_engine == "graph";
  // A drain between two micro-batches of a step. Several pipeline stages read each vote
  // drain_lag_ micro-batches after taking it, so a step needs more than drain_lag_ + 1 of them.
  drain_lag_ = vote_lag(L.pp);
  drain_within_step_ =
      c_.drain_within_step && !c_.eval_only && plan_->microbatches > drain_lag_ + 1;
  const bool seam = c_.test_stall_rank >= 0 && !c_.eval_only;
  DT_CHECK(ConfigError, !seam || c_.test_stall_at != "micro-batch" || plan_->microbatches > 1,
           "option --test.stall-at=micro-batch: the stop after a step's first micro-batch needs "
           "several micro-batches a step (this run has 1 micro-batch)");
  DT_CHECK(ConfigError,
           !seam || c_.test_stall_at != "after-vote" || (drain_within_step_ && drain_lag_ > 0),
           "option --test.stall-at=after-vote: the stop after a pipeline's first drain vote needs "
           "pipeline parallelism with --train.drain-within-step and more than parallel.pp + 1 "
           "micro-batches a step (this run has parallel.pp=",
           L.pp, ", ", plan_->microbatches, " micro-batch(es) a step",
           c_.drain_within_step ? "" : ", --train.drain-within-step=false", ")");
  DT_CHECK(ConfigError, !seam || c_.test_stall_at != "backward" || L.pp > 1,
           "option --test.stall-at=backward: the stop before a pipeline stage's first backward "
           "pass needs pipeline parallelism (this run has parallel.pp=",
           L.pp, ")");
  // On the layout as planned (parallel.auto may choose it), before anything is allocated.
  DT_CHECK(ConfigError, !c_.cuda_graphs || c_.par_zero <= 1,
           "option --engine.cuda_graphs needs whole parameters and gradients during the passes "
           "(parallel.zero = 0 or 1): ZeRO-2 and 3 gather and reduce them layer by layer from "
           "the host, which a graph cannot hold; got zero = ",
           c_.par_zero);
  // Device memory: collectives through a device communicator or staged through the host; the
  // ZeRO shards are still gathered into host buffers through the same communicators.
  DT_CHECK(ConfigError, dev_.host_memory() || c_.par_zero == 0, "device '", dev_.name(),
           "' keeps tensors in device memory, where sharded data parallelism does not run yet "
           "(parallel.zero = ",
           c_.par_zero, "; use parallel.zero = 0)");
  DT_CHECK(ConfigError, c_.grad_reduce == "fp32" || c_.grad_reduce == "bf16",
           "option --train.grad-reduce: '", c_.grad_reduce, "' is not one of fp32|bf16");
  DT_CHECK(ConfigError, c_.grad_reduce == "fp32" || c_.par_zero == 0,
           "option --train.grad-reduce=", c_.grad_reduce,
           " applies to the all_reduce of unsharded data parallelism; parallel.zero = ",
           c_.par_zero, " reduce-scatters the gradients in fp32 (use train.grad-reduce=fp32)");
  // What this rank's device or node may lack alone is agreed on, so that no rank goes on into
  // the collectives below (the mesh's) while another has failed.
  std::string lacking;
  if (c_.grad_reduce != "fp32" && !(dev_.abi_version() >= 2 && dev_.table2().cast != nullptr))
    lacking = "option --train.grad-reduce=" + c_.grad_reduce + ": device '" + dev_.name() + "' (" +
              dev_.origin() + ") has no cast kernel to round the gradients with";
  if (lacking.empty() && dev_.host_memory() && !c_.print_plan)
    lacking = node_memory_problem(per_node[sites[static_cast<std::size_t>(comm_.rank())].node]);
  const auto [lacking_rank, first_lacking] = first_problem(comm_, lacking);
  DT_CHECK(ConfigError, first_lacking.empty(), first_lacking);
  if (graph_engine || c_.print_plan) mesh_ = std::make_unique<DeviceMesh>(comm_, L, sites);
  if (c_.print_plan) return;  // nothing is allocated: print_plan() is all this trainer does
  if (flash_wanted && !c_.model.flash_attention)
    log("dt_train: device '" + dev_.name() + "' (ABI version " +
        std::to_string(dev_.abi_version()) +
        ") has no flash_attention kernels: attention keeps its probabilities "
        "(model.attention=full)");
  if (c_.dtype != "fp32" && dev_.table3().attention_fwd_ex == nullptr)
    log("dt_train: device '" + dev_.name() + "' (ABI version " +
        std::to_string(dev_.abi_version()) + ") has no attention_fwd_ex: attention runs in fp32");
  if (c_.seal != "off" || c_.ckpt_encrypt)
    keys_ = std::make_unique<security::Keys>(
        c_.key ? *c_.key : security::load_key_file(c_.key_file), security::slurm_job_id(),
        security::parse_aes_impl(c_.aes, "option --security.aes"));
  if (keys_)
    log(std::string("dt_train: AES-256-GCM by ") +
        (keys_->aes() == security::AesImpl::ipsec_mb
             ? "ipsec-mb (" + security::ipsec_mb_arch() + " code)"
             : std::string("OpenSSL's EVP")));
  security::SealedCommOptions sealed;
  sealed.p2p = c_.p2p;
  sealed.exempt_node_local = c_.seal_exempt_node_local;
  sealed.shm = c_.seal_shm;
  sealed.simulated_nodes = static_cast<int>(c_.test_sim_nodes);
  const security::Tamper tamper = c_.test_tamper_rank == comm_.rank()
                                      ? security::parse_tamper(c_.test_tamper, "test.tamper")
                                      : security::Tamper{};
  // Tampering targets the pipeline's messages where there are any, else the collectives.
  const bool tamper_collectives = L.pp == 1;
  if (c_.seal == "all") sealed_world_ = security::make_sealed_comm(comm_, *keys_, sealed);
  if (c_.optim.decay_steps == 0) c_.optim.decay_steps = c_.steps;
  sampler_ = std::make_unique<Sampler>(data.data(split_.train), split_.train.size(), c_.model.block,
                                       static_cast<std::uint64_t>(c_.seed),
                                       "training split of " + c_.data_path, c_.model.vocab);
  if (c_.val_fraction > 0 && !c_.eval_only)
    eval_starts_ = eval_windows(split_.val.size(), c_.model.block, c_.eval_windows);
  if (dev_.table().set_threads)
    dev_.call(&dt_hal_v1_t::set_threads, "set_threads", static_cast<int>(c_.threads));
  if (c_.cuda_graphs) {
    // Capture needs a stream of its own; all the trainer's device work goes there, in order.
    void* stream = nullptr;
    dev_.call(&dt_hal_v2_t::stream_create, "stream_create", &stream);
    const Device* d = &dev_;
    graph_stream_ = std::unique_ptr<void, std::function<void(void*)>>(stream, [d](void* st) {
      d->table2().set_stream(d->ctx(), nullptr);
      d->table2().stream_destroy(d->ctx(), st);
    });
    dev_.call(&dt_hal_v2_t::set_stream, "set_stream", stream);
  }
  if (graph_engine) {
    setup_engine(sealed, tamper, tamper_collectives);
  } else if (c_.par_zero > 0) {
    setup_zero(sealed, tamper, tamper_collectives);
  } else {
    float* grad_storage = nullptr;
    if (n > 1) {
      const auto ps = gpt_params(c_.model);
      grad_comm_ = make_grad_comm(comm_, ps.back().offset + ps.back().numel, sealed, tamper,
                                  tamper_collectives, &grad_storage);
    }
    model_ = std::make_unique<Gpt>(dev_, c_.model, static_cast<int>(micro_), grad_storage);
    if (n > 1)
      buckets_ = std::make_unique<GradBuckets>(*grad_comm_, model_->grad_data(), model_->params(),
                                               bucket_bytes(), grad_wire());
    model_->init(static_cast<std::uint64_t>(c_.seed));
    opt_ = std::make_unique<AdamW>(dev_, model_->params(), model_->num_params());
  }
  if (low_precision()) {
    const DType compute = c_.dtype == "bf16" ? DType::bf16 : DType::f16;
    if (model_) model_->set_compute(compute);
    if (engine_) engine_->set_compute(compute);
    LossScaleConfig lc;
    lc.dynamic = c_.dtype == "fp16";
    lc.initial = lc.dynamic ? c_.loss_scale_initial : 1.0;
    lc.growth_interval = c_.loss_scale_growth_interval;
    lc.hysteresis = c_.loss_scale_hysteresis;
    lc.min_scale = lc.dynamic ? c_.loss_scale_min : 1.0;
    lc.max_scale = std::max(lc.max_scale, lc.initial);
    scaler_ = std::make_unique<LossScaler>(lc);
    if (!zero_) {  // sharded: the ZeRO master shard is the fp32 copy
      const std::size_t count = param_list().back().offset + param_list().back().numel;
      master_ = Device::Buffer(dev_, count * sizeof(float));
      dev_.call(&dt_hal_v1_t::copy, "copy", master_.get(), static_cast<const void*>(params_ptr()),
                count * sizeof(float), DT_HAL_DEVICE_TO_DEVICE);
    }
    refresh_working_weights();
  }
  if (c_.ckpt_async && !c_.ckpt_dir.empty()) {
    async_ = std::make_unique<AsyncCheckpointer>(comm_, c_.ckpt_dir, static_cast<int>(c_.ckpt_keep),
                                                 c_.ckpt_encrypt ? keys_.get() : nullptr,
                                                 c_.ckpt_timeout_s);
    async_->reserve(state_tensors());
  }
  if (drain_within_step_ && comm_.size() > 1) {
    // Its own communicator, named so in the watchdog's lines ("all_reduce #N on world/drain-vote").
    const auto* world = dynamic_cast<const MpiComm*>(&comm_);
    DT_CHECK(InvalidArgument, world != nullptr, "dt_train: the world communicator ", comm_.name(),
             " is not an MPI communicator");
    auto vote = MpiComm::dup(world->handle(), kVoteComm);
    if (c_.seal == "all")
      drain_vote_comm_ = security::make_sealed_comm(*vote, *keys_, sealed);
    else
      drain_vote_comm_ = std::move(vote);
    if (drain_lag_ > 0)
      pipe_votes_ = std::make_unique<PipeVotes>(drain_vote_comm_->name(), c_.seal == "all");
  }
  const std::size_t bt = static_cast<std::size_t>(micro_) * c_.model.block;
  inputs_.resize(bt);
  targets_.resize(bt);
  obs_ = std::make_unique<obs::TrainTelemetry>(
      c_, comm_.rank(), comm_.size(), gpt_flops_per_token(c_.model, c_.model.block), run_id);
}

void Trainer::setup_engine(const security::SealedCommOptions& sealed,
                           const security::Tamper& tamper, bool tamper_collectives) {
  const Layout& L = plan_->layout;
  const MeshCoord& mc = mesh_->coord();
  graph::Graph sg = plan_->stage(mc.pp);
  StageComms sc;
  if (c_.seal == "all" && L.tp > 1)
    sealed_tp_ = security::make_sealed_comm(mesh_->tp(), *keys_, sealed);
  if (c_.seal == "all" && mesh_->tied())
    sealed_tied_ = security::make_sealed_comm(*mesh_->tied(), *keys_, sealed);
  sc.tp = L.tp > 1 ? (sealed_tp_ ? sealed_tp_.get() : &mesh_->tp()) : nullptr;
  if (!dev_.host_memory()) {  // activations and gradients in device memory
    if (L.tp > 1)
      sc.tp = (device_tp_ = device_comm(mesh_->tp(), "tp", std::move(sealed_tp_))).get();
    if (mesh_->tied()) device_tied_ = device_comm(*mesh_->tied(), "tied", std::move(sealed_tied_));
  }
  sc.tp_rank = mc.tp;
  if (L.pp > 1) {
    p2p_ = make_p2p(c_.p2p, comm_);
    if (c_.seal != "off") {
      security::SealOptions so;
      so.channel = "pipeline";
      so.shm = c_.seal_shm;
      so.tamper = tamper;
      // The peers on this node as MPI knows them, never node ids gathered over the network;
      // simulated nodes (testing) from the mesh's sites.
      if (c_.seal_exempt_node_local && c_.test_sim_nodes > 0) {
        for (std::size_t r = 0; r < mesh_->sites().size(); ++r)
          if (mesh_->sites()[r].node ==
                  mesh_->sites()[static_cast<std::size_t>(comm_.rank())].node &&
              static_cast<int>(r) != comm_.rank())
            so.plain_peers.push_back(static_cast<int>(r));
      } else if (c_.seal_exempt_node_local) {
        auto* world = dynamic_cast<MpiComm*>(&comm_);
        DT_CHECK(ConfigError, world != nullptr,
                 "option --security.exempt-node-local needs an MPI world communicator (to ask MPI "
                 "which ranks share this node), got ",
                 comm_.name());
        so.plain_peers = world->node_peers();
      }
      p2p_ = security::seal_p2p(std::move(p2p_), *keys_, so);
    }
    if (!dev_.host_memory()) p2p_ = std::make_unique<StagedP2p>(dev_, std::move(p2p_));
    sc.p2p = p2p_.get();
    for (int s = 0; s < L.pp; ++s) sc.stage_rank.push_back(mesh_->rank_of(mc.dp, s, mc.tp));
  }
  GptStorage storage;
  std::unique_ptr<Comm> zero_gather, zero_reduce;
  if (c_.par_zero > 0) {
    // Sharded data parallelism over the mesh's data-parallel dimension: the stage's flat
    // buffers in a layout padded per unit (each block, the final norm, every other tensor).
    auto make = [&](bool tampered) -> std::unique_ptr<Comm> {
      if (c_.seal != "all") return mesh_->dp().split(0, mesh_->dp().rank());
      security::SealedCommOptions so = sealed;
      if (tampered && tamper_collectives) so.tamper = tamper;
      return security::make_sealed_comm(mesh_->dp(), *keys_, so);
    };
    zero_gather = make(false);
    zero_reduce = make(true);
    std::function<void(float*, std::size_t)> round;
    if (low_precision()) round = [this](float* d, std::size_t k) { round_to_dtype(d, k); };
    const std::vector<ParamInfo> table = StageEngine::param_table(sg);
    const std::vector<ZeroUnit> units =
        zero_units(static_cast<int>(c_.par_zero), layer_units(table), table, bucket_bytes());
    zero_ = std::make_unique<ZeroShards>(dev_, static_cast<int>(c_.par_zero), table, units,
                                         std::move(zero_gather), std::move(zero_reduce),
                                         std::move(round), embedding_unit(units, table));
    storage.layout = zero_->padded();
    storage.numel = zero_->padded_numel();
    storage.own_params = c_.par_zero < 3;
    storage.own_grads = c_.par_zero < 2;
  } else if (L.dp > 1) {
    grad_comm_ = make_grad_comm(mesh_->dp(), StageEngine::count_params(sg), sealed, tamper,
                                tamper_collectives, &storage.grad_storage);
  }
  engine_ = std::make_unique<StageEngine>(dev_, std::move(sg), c_.model, mc.pp, L.pp,
                                          plan_->in_flight(mc.pp), sc, std::move(storage));
  // One copy of each element per data-parallel rank counts: tensor-parallel rank 0's of a
  // replicated tensor, the first stage's of a tensor tied across stages.
  unique_.clear();
  for (std::size_t i = 0; i < engine_->params().size(); ++i) {
    const graph::TensorInfo& t = engine_->param_tensor(i);
    const bool split = t.sharding.kind != graph::Sharding::Kind::replicated;
    unique_.push_back((split || mc.tp == 0) && !(t.tied && mc.pp != 0));
  }
  if (L.dp > 1 && !zero_)
    buckets_ = std::make_unique<GradBuckets>(*grad_comm_, engine_->grad_data(), engine_->params(),
                                             bucket_bytes(), grad_wire());
  if (zero_) {
    engine_->set_unit_hooks(zero_->units(), zero_->hooks());
    // Each data-parallel rank holds other pieces: count every piece of a tensor this rank's
    // tensor-parallel and pipeline position owns.
    zero_counted_.clear();
    for (const ZeroPiece& pc : zero_->pieces()) zero_counted_.push_back(unique_[pc.param]);
  }
  init_weights();
  // One copy of every global element counts: data-parallel rank 0, tensor-parallel rank 0 for
  // replicated tensors, and the first stage for tensors tied across stages.
  owner_.clear();
  for (std::size_t i = 0; i < engine_->params().size(); ++i)
    owner_.push_back(mc.dp == 0 && unique_[i]);
  // (The whole model's parameters, full_state_, are assembled only where asked for: sampling,
  // global_parameters(). A copy on every rank would cost each the whole model's memory.)
}

void Trainer::setup_zero(const security::SealedCommOptions& sealed, const security::Tamper& tamper,
                         bool tamper_collectives) {
  // Two communicators over the data-parallel ranks (all of them here), one per progress thread.
  auto make_comm = [&](bool tampered) -> std::unique_ptr<Comm> {
    if (c_.seal != "all") return comm_.split(0, comm_.rank());
    security::SealedCommOptions so = sealed;
    if (tampered && tamper_collectives) so.tamper = tamper;
    return security::make_sealed_comm(comm_, *keys_, so);
  };
  std::function<void(float*, std::size_t)> round;
  if (low_precision()) round = [this](float* d, std::size_t n) { round_to_dtype(d, n); };
  auto gather = make_comm(false);
  auto reduce = make_comm(true);
  zero_ =
      std::make_unique<ZeroShards>(dev_, c_.par_zero, gpt_params(c_.model),
                                   zero_units(static_cast<int>(c_.par_zero), gpt_units(c_.model),
                                              gpt_params(c_.model), bucket_bytes()),
                                   std::move(gather), std::move(reduce), std::move(round));
  GptStorage st;
  st.layout = zero_->padded();
  st.numel = zero_->padded_numel();
  st.own_params = c_.par_zero < 3;
  st.own_grads = c_.par_zero < 2;
  model_ = std::make_unique<Gpt>(dev_, c_.model, static_cast<int>(micro_), st);
  model_->set_unit_hooks(zero_->hooks());
  zero_counted_.assign(zero_->shard_params().size(), 1);
  init_weights();
}

void Trainer::init_weights() {
  const auto seed = static_cast<std::uint64_t>(c_.seed);
  if (engine_ && zero_) {
    if (engine_->param_data()) {
      engine_->init(seed);
      zero_->take_shard(engine_->param_data());
    } else {
      zero_->init_shard(
          [this, seed](std::size_t i, float* out) { engine_->init_param(seed, i, out); });
    }
    opt_ = std::make_unique<AdamW>(dev_, zero_->shard_params(), zero_->shard_numel());
    zero_->publish(engine_->param_data());
    return;
  } else if (engine_) {
    engine_->init(seed);
    opt_ = std::make_unique<AdamW>(dev_, engine_->params(), engine_->num_params());
  } else if (zero_) {
    if (model_->param_data()) {
      model_->init(seed);
      zero_->take_shard(model_->param_data());
    } else {
      zero_->init_shard(
          [this, seed](std::size_t i, float* out) { gpt_init_param(c_.model, seed, i, out); });
    }
    opt_ = std::make_unique<AdamW>(dev_, zero_->shard_params(), zero_->shard_numel());
    zero_->publish(model_->param_data());
    return;
  } else {
    model_->init(seed);
    opt_ = std::make_unique<AdamW>(dev_, model_->params(), model_->num_params());
  }
  if (low_precision() && master_.bytes()) {
    dev_.call(&dt_hal_v1_t::copy, "copy", master_.get(), static_cast<const void*>(params_ptr()),
              master_.bytes(), DT_HAL_DEVICE_TO_DEVICE);
    refresh_working_weights();
  }
}

Trainer::~Trainer() {
  // Pipeline drain votes an error left pending: their Work goes before the communicator, which
  // then stays unfreed (MPI), or finishes them into the buffers that outlive it (sealed).
  if (pipe_votes_) pipe_votes_->work.clear();
  // Gradient buckets an error left queued run as their queue ends: before the engine, whose
  // gradient buffer they may reduce (members go in reverse order, and engine_ is declared later).
  buckets_.reset();
}

GradWire Trainer::grad_wire() const {
  GradWire w;
  if (c_.grad_reduce == "bf16") {
    w.type = DType::bf16;
    w.dev = &dev_;
  }
  return w;
}

std::unique_ptr<Comm> Trainer::make_grad_comm(Comm& group, std::size_t numel,
                                              const security::SealedCommOptions& sealed,
                                              const security::Tamper& tamper,
                                              bool tamper_collectives, float** storage) {
  std::unique_ptr<Comm> sealed_comm;
  if (c_.seal == "all") {
    security::SealedCommOptions so = sealed;
    if (tamper_collectives) so.tamper = tamper;
    sealed_comm = security::make_sealed_comm(group, *keys_, so);
  }
  const bool host = dev_.host_memory();
  if (!host && device_comm_ && !sealed_comm) return device_comm_(group, group.name() + "/grads");
  std::unique_ptr<Comm> c = std::move(sealed_comm);
  auto* mpi = dynamic_cast<MpiComm*>(&group);
  if (!c && c_.allreduce != "mpi" && mpi) {
    // Host memory: the gradients live in the shared-memory arena, so each bucket's all_reduce
    // needs no copy. Device memory: no arena; the staged copies go through shared memory.
    ShmConfig sc;
    sc.arena_bytes = host ? numel * sizeof(float) : 0;
    sc.min_bytes = static_cast<std::size_t>(c_.shm_min_bytes);
    sc.simulated_nodes = static_cast<int>(c_.test_sim_nodes);
    auto shm = ShmComm::create(*mpi, group.name() + "/grads", sc);
    if (host) *storage = static_cast<float*>(shm->arena());
    c = std::move(shm);
  }
  if (!c) c = group.split(0, group.rank());
  // Device tensors reach the host communicator through copies.
  if (!host) c = std::make_unique<StagedComm>(dev_, std::move(c));
  return c;
}

std::unique_ptr<Comm> Trainer::device_comm(Comm& group, const std::string& name,
                                           std::unique_ptr<Comm> sealed) {
  if (!sealed && device_comm_) return device_comm_(group, group.name() + "/" + name);
  return std::make_unique<StagedComm>(dev_,
                                      sealed ? std::move(sealed) : group.split(0, group.rank()));
}

Comm& Trainer::tied_comm() const {
  if (device_tied_) return *device_tied_;
  return sealed_tied_ ? *sealed_tied_ : *mesh_->tied();
}

// engine.cuda_graphs: the forward and backward of the micro-batch staged in the model. The first
// runs eagerly (a device may allocate lazily, which a capture forbids); the next is captured and
// launched; later ones replay. The loss scale is a kernel argument inside the graph, so a new
// scale (fp16 after an overflow or a clean interval) is captured again.
void Trainer::micro_batch_graph(float scale) {
  if (!graph_warm_) {
    model_->run_forward();
    model_->backward(scale);
    graph_warm_ = true;
    return;
  }
  if (!graph_ || graph_scale_ != scale) {
    graph_ = Device::Graph();
    const trace::Scope capture_scope("graph capture", "train");
    graph_ = dev_.capture([&] {
      model_->run_forward();
      model_->backward(scale);
    });
    graph_scale_ = scale;
    ++graph_captures_;
  }
  graph_.launch();
  ++graph_replays_;
}

void Trainer::stall_for_test(const char* what, std::int64_t step) {
  if (std::strncmp(what, "test.", 5) != 0) watchdog::set_activity("test.stall-during-save", step);
  std::fprintf(stderr, "dt_train: rank %d: %s at step %lld: waiting for the watchdog\n",
               comm_.rank(), what, static_cast<long long>(step));
  std::fflush(stderr);
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

void Trainer::stall_at(const char* at, const char* where, std::int64_t step) {
  if (c_.test_stall_rank != comm_.rank() || step_ != c_.test_skip_step || c_.test_stall_at != at)
    return;
  // The watchdog's activity points into it as long as the rank stops (stall_for_test never
  // returns).
  const std::string activity = std::string("test.stall-rank: stopped ") + where;
  watchdog::set_activity(activity.c_str(), step);
  stall_for_test(("test.stall-rank: stopping " + std::string(where)).c_str(), step);
}

StepStats Trainer::step() {
  // The watchdog's activities within a step name it as the progress lines do (from 1).
  const trace::Scope step_scope("step", "train", "step", step_ + 1);
  const auto t0 = std::chrono::steady_clock::now();
  const int T = c_.model.block;
  const float loss_scale = scaler_ ? scaler_->scale() : 1.0f;
  full_state_current_ = false;  // the parameters change
  const float scale = static_cast<float>(loss_scale / (static_cast<double>(c_.batch) * T));
  stall_at("step", "before the step", step_ + 1);
  watchdog::set_activity("forward and backward", step_ + 1);
  double loss_sum = 0;
  if (zero_) zero_->begin_step();
  // A step given up for a drain (give_up_step): the ranks voted so at one micro-batch boundary.
  // ZeRO-2/3 wait for the reductions queued for the micro-batches run (ZeRO-1 queued none).
  auto given_up = [&] {
    if (zero_) zero_->finish_grads();
    StepStats s;
    s.step = step_;
    s.given_up = true;
    s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return s;
  };
  if (engine_) {
    engine_->zero_grad();
    bool gave_up = false;
    loss_sum = pipeline_step(scale, &gave_up);
    if (gave_up) return given_up();
  } else {
    model_->zero_grad();
    const std::int64_t first = comm_.rank() * local_batch_;
    for (std::int64_t m = 0; m < local_batch_; m += micro_) {
      if (m == micro_) stall_at("micro-batch", "after the first micro-batch", step_ + 1);
      if (m > 0 && give_up_step(m / micro_, local_batch_ / micro_)) return given_up();
      const trace::Scope micro_scope("micro-batch", "train", "index", m / micro_);
      sampler_->fill(static_cast<std::uint64_t>(step_), first + m, micro_, inputs_.data(),
                     targets_.data());
      if (c_.cuda_graphs) {
        // No host callbacks inside a graph: the buckets are handed over after the last one.
        model_->stage(inputs_.data(), targets_.data(), static_cast<int>(micro_), T);
        micro_batch_graph(scale);
        loss_sum += model_->loss_sum();
        if (m + micro_ < local_batch_) continue;
        if (buckets_) buckets_->ready(0, model_->params().size());
        if (zero_)  // stage 1: every unit's gradients are final, last unit first as in backward
          for (int u = static_cast<int>(zero_->units().size()); u-- > 0;)
            zero_->grads_final(u, model_->grad_data() + zero_->unit_offset(u));
        continue;
      }
      loss_sum += model_->forward(inputs_.data(), targets_.data(), static_cast<int>(micro_), T);
      // The last micro-batch's backward hands each finished bucket (ZeRO-1: merged unit) to the
      // progress thread; ZeRO-2/3 reduce every micro-batch's units through the model's hooks.
      const bool last = m + micro_ >= local_batch_;
      if (zero_ && zero_->stage() == 1 && last)
        model_->backward(scale, [&](std::size_t a, std::size_t) {
          // A bucket of several layers is final with its first layer.
          const int u = zero_->unit_starting_at(a);
          if (u >= 0) zero_->grads_final(u, model_->grad_data() + zero_->unit_offset(u));
        });
      else if (buckets_ && last)
        model_->backward(scale, [&](std::size_t a, std::size_t b) { buckets_->ready(a, b); });
      else
        model_->backward(scale);
    }
  }
  if (zero_ && !engine_) {
    watchdog::set_activity("gradient reduce_scatter wait", step_ + 1);
    zero_->finish_grads();
  }
  if (comm_.size() > 1) {
    if (c_.test_skip_collective == comm_.rank() && step_ == c_.test_skip_step) {
      watchdog::set_activity("test.skip-collective: waiting instead of the loss all_reduce",
                             step_ + 1);
      stall_for_test("test.skip-collective: skipping the loss all_reduce", step_ + 1);
    }
    watchdog::set_activity("loss all_reduce", step_ + 1);
    coll().all_reduce(view_of(&loss_sum, 1), ReduceOp::sum);
    watchdog::set_activity("gradient all_reduce wait", step_ + 1);
    const trace::Scope wait_scope("gradient all_reduce wait", "comm");
    if (buckets_) buckets_->finish();
    // A tensor used on the first and the last stage (wte) gets both stages' gradients
    // (ZeRO-2/3: its shards, below).
    if (mesh_ && mesh_->tied() && engine_->grad_data())
      for (std::size_t i = 0; i < engine_->params().size(); ++i)
        if (engine_->param_tensor(i).tied) {
          const ParamInfo& p = engine_->params()[i];
          tied_comm().all_reduce(view_of(engine_->grad_data() + p.offset, p.numel), ReduceOp::sum);
        }
  }
  if (zero_ && engine_) {
    watchdog::set_activity("gradient reduce_scatter wait", step_ + 1);
    if (zero_->stage() == 1)  // the stage's gradients, tied ones complete: every unit at once
      for (int u = 0; u < static_cast<int>(zero_->units().size()); ++u)
        zero_->grads_final(u, engine_->grad_data() + zero_->unit_offset(u));
    zero_->finish_grads();
    // ZeRO-2/3: the tied word embedding is a unit of its own on the first and the last stage,
    // so the two stages' shards of it match: add them.
    if (zero_->stage() >= 2 && mesh_->tied())
      for (int u = 0; u < static_cast<int>(zero_->units().size()); ++u)
        if (engine_->param_tensor(zero_->units()[static_cast<std::size_t>(u)].first).tied)
          tied_comm().all_reduce(
              view_of(zero_->grads() + zero_->unit_local(u), zero_->unit_slice(u)), ReduceOp::sum);
  }
  watchdog::set_activity("optimizer", step_ + 1);
  StepStats s;
  s.step = step_;
  s.loss = loss_sum / (static_cast<double>(c_.batch) * T);
  s.loss_scale = loss_scale;
  // Steps are named as the progress lines, the step log and the checkpoints name them (from 1).
  DT_CHECK(Error, std::isfinite(s.loss), "training loss is ", s.loss, " at step ", step_ + 1,
           " (diverged: lower --optim.lr or raise --optim.warmup)");
  const trace::Scope optimizer_scope("optimizer", "train");
  DT_CHECK(Error, c_.test_fail_rank != comm_.rank() || step_ != c_.test_fail_step,
           "test.fail-rank: failing at step ", step_ + 1);
  const std::size_t n = state_numel();
  if (scaler_) round_to_dtype(grads_ptr(), n);  // as c_.dtype stores them (fp16: Inf past 65504)
  const std::int64_t since = step_ - c_.test_inject_inf_step, every = c_.test_inject_inf_every;
  // The seam: rank test.inject-inf-rank's gradient holds an Inf. With a loss scaler that rank
  // alone writes it, before the overflow check that all ranks decide together. In fp32 the
  // gradients here are already reduced, so an Inf that rank contributed is in every replica:
  // every rank writes it (one rank alone would make replicas disagree, which no real overflow
  // does, and ranks whose norm does not count that copy would step on).
  if (c_.test_inject_inf_rank >= 0 &&  // (a rank of the job: checked in the constructor)
      (scaler_ == nullptr || c_.test_inject_inf_rank == comm_.rank()) &&
      (since == 0 || (every > 0 && since > 0 && since % every == 0))) {
    const float inf = INFINITY;
    dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(grads_ptr()),
              static_cast<const void*>(&inf), sizeof inf, DT_HAL_HOST_TO_DEVICE);
  }
  if (scaler_) {
    // One decision for all ranks: any non-finite gradient anywhere skips the step everywhere.
    const bool overflow = overflow_anywhere(coll(), unscale_found_inf(grads_ptr(), n, loss_scale));
    if (!scaler_->update(overflow)) {
      s.skipped = true;
      s.grad_norm = INFINITY;
      s.lr = lr_at(c_.optim, step_);
      count_step();
      s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      return s;
    }
  }
  s.grad_norm = zero_ ? opt_->clip_grad_norm(grads_ptr(), c_.optim.grad_clip, zero_counted_, coll())
                : engine_ ? opt_->clip_grad_norm(grads_ptr(), c_.optim.grad_clip, owner_, coll())
                          : opt_->clip_grad_norm(grads_ptr(), c_.optim.grad_clip);
  // The norm is global (every rank has the same): a non-finite gradient that no loss scaler
  // caught (fp32) ends the run on every rank before it reaches the weights, so no checkpoint of
  // them is written.
  DT_CHECK(Error, std::isfinite(s.grad_norm), "gradient norm is ", s.grad_norm, " at step ",
           step_ + 1,
           " (diverged: lower --optim.lr or raise --optim.warmup); the weights stay as they were "
           "after step ",
           step_);
  s.lr = lr_at(c_.optim, step_);
  opt_->step(master_ptr(), grads_ptr(), s.lr, c_.optim);
  if (scaler_ || zero_) refresh_working_weights();
  count_step();
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

void Trainer::report_graphs() {
  if (!engine_) {
    if (comm_.rank() == 0)
      std::printf("engine.cuda_graphs: %lld capture(s), %lld micro-batch(es) run from a graph\n",
                  static_cast<long long>(graph_captures_), static_cast<long long>(graph_replays_));
    return;
  }
  // The stage engine: the first rank of every stage (data- and tensor-parallel rank 0) reports.
  const int stages = plan_->layout.pp;
  const MeshCoord& mc = mesh_->coord();
  std::vector<std::int64_t> n(3 * static_cast<std::size_t>(stages), 0);
  if (mc.dp == 0 && mc.tp == 0) {
    const StageEngine::GraphCounts g = engine_->graph_counts();
    const std::size_t at = 3 * static_cast<std::size_t>(mc.pp);
    n[at] = g.captured;
    n[at + 1] = g.launched;
    n[at + 2] = g.passes;
  }
  if (comm_.size() > 1) coll().all_reduce(view_of(n.data(), n.size()), ReduceOp::sum);
  if (comm_.rank() != 0) return;
  for (int s = 0; s < stages; ++s) {
    const std::size_t at = 3 * static_cast<std::size_t>(s);
    std::printf(
        "engine.cuda_graphs: stage %d: %lld graph(s) captured, %lld launch(es), %lld "
        "pass(es) run from graphs\n",
        s, static_cast<long long>(n[at]), static_cast<long long>(n[at + 1]),
        static_cast<long long>(n[at + 2]));
  }
}

void Trainer::note_drain_mid_step(bool asked, std::int64_t done, std::int64_t total) {
  // A drain signal that comes during a step of many micro-batches (a long step) is said at once,
  // so that its sender knows it was heard; the step is given up where it can be, else finished.
  if (drain_noted_ || !asked) return;
  drain_noted_ = true;
  if (drain_within_step_ && drain_lag_ == 0)
    std::printf(
        "dt_train: rank %d: drain signal during step %ld: the step is given up at this "
        "micro-batch boundary\n",
        comm_.rank(), static_cast<long>(step_ + 1));
  else if (drain_within_step_ && done + drain_lag_ < total)
    std::printf(
        "dt_train: rank %d: drain signal during step %ld: the step is given up when the "
        "pipeline's vote is read, after at most %ld of its micro-batches\n",
        comm_.rank(), static_cast<long>(step_ + 1), static_cast<long>(done + drain_lag_));
  else
    std::printf(
        "dt_train: rank %d: drain signal during step %ld: it finishes its %ld micro-batches left "
        "first%s, then drains\n",
        comm_.rank(), static_cast<long>(step_ + 1), static_cast<long>(total - done),
        // Another stage, behind this one, may have taken a vote for the drain in time.
        drain_within_step_ ? " unless a vote taken by a stage behind gives it up" : "");
  std::fflush(stdout);
}

void Trainer::log_given_up(std::int64_t done, std::int64_t total) {
  log("dt_train: step " + std::to_string(step_ + 1) + " given up after " + std::to_string(done) +
      " of its " + std::to_string(total) +
      " micro-batches, for a drain: nothing of it is kept, and the run drains as of step " +
      std::to_string(step_));
}

bool Trainer::give_up_step(std::int64_t done, std::int64_t total) {
  const bool asked = drain_requested();  // read once: what is said is what is voted
  note_drain_mid_step(asked, done, total);
  if (!drain_within_step_) return false;
  std::int32_t vote = asked ? 1 : 0;
  if (drain_vote_comm_) {
    watchdog::set_activity("drain vote", step_ + 1);
    drain_vote_comm_->all_reduce(view_of(&vote, 1), ReduceOp::max);
    ++votes_;
    watchdog::set_activity("forward and backward", step_ + 1);
  }
  if (vote > 0) log_given_up(done, total);
  return vote > 0;
}

bool Trainer::pipeline_drain_vote(int k, int m) {
  if (drain_lag_ == 0) return give_up_step(k, m);
  const bool asked = drain_requested();  // read once: what is said is what is voted
  note_drain_mid_step(asked, k, m);
  if (!drain_within_step_) return false;
  PipeVotes& v = *pipe_votes_;
  if (k - drain_lag_ >= 1) {  // every rank took it drain_lag_ micro-batches ago
    const std::size_t read = static_cast<std::size_t>(k - drain_lag_);
    // Watched from here: the vote ran in the background across the passes between (a rank stuck
    // in one of them is named through the stages waiting for its messages, or here).
    watchdog::set_activity("drain vote", step_ + 1);
    v.wait(read);
    watchdog::set_activity("forward and backward", step_ + 1);
    if (v.flag[read] > 0) {
      log_given_up(k, m);
      return true;
    }
  }
  v.taken = static_cast<std::size_t>(k) + 1;
  if (k + drain_lag_ < m) {  // read before a later forward of this step
    const std::size_t at = static_cast<std::size_t>(k);
    v.flag[at] = asked ? 1 : 0;
    const watchdog::BackgroundScope background;  // read (and watched) drain_lag_ passes later
    v.work[at] = drain_vote_comm_->iall_reduce(view_of(&v.flag[at], 1), ReduceOp::max);
    v.seq[at] = ++votes_;
  }
  return false;
}

double Trainer::pipeline_step(float scale, bool* given_up) {
  const MeshCoord& mc = mesh_->coord();
  const int m = plan_->microbatches, slots = plan_->in_flight(mc.pp);
  const std::int64_t first = mc.dp * local_batch_;
  double loss = 0;
  const auto t0 = std::chrono::steady_clock::now();
  engine_->take_wait_seconds();
  if (pipe_votes_) pipe_votes_->reset(m);
  std::vector<PipeAction> actions = one_f_one_b(mc.pp, plan_->layout.pp, m);
  for (std::size_t i = 0; i < actions.size(); ++i) {
    const PipeAction a = actions[i];
    const int slot = a.micro % slots;
    if (pipe_votes_) pipe_votes_->poll();
    if (a.kind == PipeAction::Kind::forward) {
      if (a.micro == 1) stall_at("micro-batch", "after the first micro-batch", step_ + 1);
      if (a.micro > 0 && !*given_up && pipeline_drain_vote(a.micro, m)) {
        // Given up before this forward: the schedule of a.micro micro-batches, the same as
        // this one's up to here, runs the backward passes of those begun.
        *given_up = true;
        actions = one_f_one_b(mc.pp, plan_->layout.pp, a.micro);
        DT_ASSERT(i <= actions.size() &&
                      (i == actions.size() || actions[i].kind == PipeAction::Kind::backward),
                  "the 1F1B schedule of ", a.micro, " micro-batches is not this one's prefix");
        --i;  // runs actions[i] again: now a backward pass, or the end
        continue;
      }
      if (a.micro == 1) stall_at("after-vote", "after taking a drain vote", step_ + 1);
      const trace::Scope f("forward", "pipeline", "micro-batch", a.micro);
      sampler_->fill(static_cast<std::uint64_t>(step_), first + a.micro * micro_, micro_,
                     inputs_.data(), targets_.data());
      loss += engine_->forward(slot, a.micro, inputs_.data(), targets_.data(),
                               static_cast<int>(micro_));
    } else {
      if (a.micro == 0) stall_at("backward", "before the first backward pass", step_ + 1);
      const trace::Scope b("backward", "pipeline", "micro-batch", a.micro);
      // The last micro-batch's backward hands each finished bucket to the progress thread
      // (from graphs: all of them after it, below).
      if (buckets_ && a.micro == m - 1 && !c_.cuda_graphs)
        engine_->backward(slot, a.micro, scale,
                          [&](std::size_t x, std::size_t y) { buckets_->ready(x, y); });
      else
        engine_->backward(slot, a.micro, scale);
    }
  }
  // Given up: the votes taken after the one read (every rank took them).
  if (pipe_votes_) pipe_votes_->finish();
  if (*given_up) {
    engine_->wait_sends();
    return 0.0;
  }
  if (buckets_ && c_.cuda_graphs) {
    dev_.call(&dt_hal_v1_t::synchronize, "synchronize");
    buckets_->ready(0, engine_->params().size());
  }
  // engine.cuda_graphs: nothing is captured before a whole step ran eagerly. Its passes at the
  // full micro-batch grow the device's scratch memory, which a live graph fixes in place (a CUDA
  // graph holds the pointers it was captured with).
  if (c_.cuda_graphs && !engine_->graphs()) engine_->set_graphs(true);
  engine_->wait_sends();
  // The first step also pays for first-touch page faults: the bubble figures leave it out.
  const double idle = engine_->take_wait_seconds();
  if (pipe_steps_++ > 0) {
    pipe_idle_s_ += idle;
    pipe_total_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  // Every tensor-parallel rank of the last stage computed the same loss: count it once.
  return engine_->last_stage() && mc.tp == 0 ? loss : 0.0;
}

double Trainer::loss_over(const std::vector<std::size_t>& starts) {
  const trace::Scope eval_scope("evaluate", "train");
  watchdog::set_activity("evaluation", step_);
  stall_at("evaluation", "before the evaluation", step_);
  const int T = c_.model.block;
  const std::int64_t total = static_cast<std::int64_t>(starts.size());
  // Windows are shared out over the data-parallel ranks; a pipeline runs them stage by stage.
  const std::int64_t n = engine_ ? plan_->layout.dp : comm_.size();
  const std::int64_t r = engine_ ? mesh_->coord().dp : comm_.rank();
  const std::int64_t begin = r * total / n, end = (r + 1) * total / n;
  double sums[2] = {0, 0};  // loss sum, tokens
  const TokenPtr val = data_.data(split_.val);
  int k = 0;
  // ZeRO-3 gathers parameters collectively in every forward: all ranks run as many forwards as
  // the largest share needs (the extra ones on this rank's first window, not counted).
  const bool lockstep = zero_ && zero_->stage() == 3 && n > 1;
  const std::int64_t rounds = (((total + n - 1) / n) + micro_ - 1) / micro_;
  for (std::int64_t j = 0; lockstep && j < rounds - (end - begin + micro_ - 1) / micro_; ++j) {
    fill_windows(data_.data(split_.val), split_.val.size(), T, starts.data(), 1, inputs_.data(),
                 targets_.data(), c_.model.vocab, "validation split of " + c_.data_path);
    if (engine_)
      engine_->forward(0, -1, inputs_.data(), targets_.data(), 1);
    else
      model_->forward(inputs_.data(), targets_.data(), 1, T);
  }
  for (std::int64_t i = begin; i < end; i += micro_, ++k) {
    const std::int64_t cnt = std::min(micro_, end - i);
    fill_windows(val, split_.val.size(), T, starts.data() + i, cnt, inputs_.data(), targets_.data(),
                 c_.model.vocab, "validation split of " + c_.data_path);
    if (engine_)
      sums[0] += engine_->forward(k % plan_->in_flight(mesh_->coord().pp), k, inputs_.data(),
                                  targets_.data(), static_cast<int>(cnt));
    else
      sums[0] += model_->forward(inputs_.data(), targets_.data(), static_cast<int>(cnt), T);
    sums[1] += static_cast<double>(cnt) * T;
  }
  if (engine_) {
    engine_->wait_sends();
    if (!engine_->last_stage() || mesh_->coord().tp != 0) sums[0] = sums[1] = 0;
  }
  if (comm_.size() > 1) coll().all_reduce(view_of(sums, 2), ReduceOp::sum);
  return sums[0] / sums[1];
}

double Trainer::evaluate() { return eval_starts_.empty() ? std::nan("") : loss_over(eval_starts_); }

std::vector<std::int32_t> Trainer::sample(const std::vector<std::int32_t>& prompt, std::int64_t n,
                                          double temperature, std::uint64_t seed) {
  watchdog::set_activity("sampling", step_);
  std::vector<std::int32_t> seq = prompt;
  if (seq.empty()) seq.push_back(0);
  std::uint64_t state = seed ^ 0x5851f42d4c957f2dULL;
  auto uniform = [&state] {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return static_cast<double>((z ^ (z >> 31)) >> 11) * 0x1.0p-53;
  };
  Gpt* model = model_.get();
  std::unique_ptr<Gpt> whole;
  if (model_sharded()) {  // global parameters in full_state_
    whole = std::make_unique<Gpt>(dev_, c_.model, 1);
    DT_CHECK(InvalidArgument, full_state_current_ && full_state_.size() >= whole->num_params(),
             "Trainer::sample: the global parameters are not assembled as of step ", step_,
             " (gather them with global_parameters() after the last step, as run() does before "
             "sampling)");
    dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(whole->param_data()),
              static_cast<const void*>(full_state_.data()), whole->num_params() * sizeof(float),
              DT_HAL_HOST_TO_DEVICE);
    model = whole.get();
  }
  const int V = c_.model.vocab;
  std::vector<double> p(static_cast<std::size_t>(V));
  std::vector<float> row(static_cast<std::size_t>(V));
  std::vector<std::int32_t> out;
  for (std::int64_t k = 0; k < n; ++k) {
    const std::size_t len =
        std::min<std::size_t>(seq.size(), static_cast<std::size_t>(c_.model.block));
    const std::int32_t* ctx = seq.data() + (seq.size() - len);
    model->forward(ctx, nullptr, 1, static_cast<int>(len));
    model->logits_row(0, static_cast<int>(len) - 1, row.data());
    const float* lg = row.data();
    double mx = lg[0];
    for (int v = 1; v < V; ++v) mx = std::max<double>(mx, lg[v]);
    double z = 0;
    for (int v = 0; v < V; ++v) z += (p[v] = std::exp((lg[v] - mx) / temperature));
    double u = uniform() * z;
    std::int32_t pick = V - 1;
    for (int v = 0; v < V; ++v) {
      u -= p[v];
      if (u <= 0) {
        pick = v;
        break;
      }
    }
    seq.push_back(pick);
    out.push_back(pick);
  }
  return out;
}

namespace {
std::string duration_str(double s) {
  char b[32];
  const long t = static_cast<long>(s + 0.5);
  if (t >= 3600)
    std::snprintf(b, sizeof b, "%ldh%02ldm", t / 3600, (t / 60) % 60);
  else if (t >= 60)
    std::snprintf(b, sizeof b, "%ldm%02lds", t / 60, t % 60);
  else
    std::snprintf(b, sizeof b, "%lds", t);
  return b;
}
}  // namespace

void Trainer::log(const std::string& line) const {
  if (comm_.rank() != 0) return;
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

namespace {
// Appends the pieces of the global tensor that local elements [lb, le) of shard `runs` are, the
// local element lb being at `data`: in each run, a cut row, whole rows and a cut row.
void add_pieces(const std::vector<graph::ShardRun>& runs, std::size_t lb, std::size_t le,
                float* data, std::vector<CkptPiece>& out) {
  for (const graph::ShardRun& r : runs) {
    const std::size_t a = std::max(lb, r.local);
    const std::size_t b = std::min(le, r.local + r.len * r.count);
    auto piece = [&](std::size_t j, std::size_t x, std::size_t len, std::size_t rows) {
      out.push_back(CkptPiece{r.begin + j * r.stride + x, len, r.stride, rows,
                              data + (r.local + j * r.len + x - lb)});
    };
    if (a >= b) continue;
    std::size_t j = (a - r.local) / r.len, x = (a - r.local) % r.len;
    const std::size_t j1 = (b - r.local) / r.len, x1 = (b - r.local) % r.len;
    if (j == j1) {
      piece(j, x, x1 - x, 1);
      continue;
    }
    if (x > 0) piece(j++, x, r.len - x, 1);
    if (j1 > j) piece(j, 0, r.len, j1 - j);
    if (x1 > 0) piece(j1, 0, x1, 1);
  }
}
}  // namespace

std::vector<CkptTensor> Trainer::state_tensors(bool save) {
  std::vector<CkptTensor> out;
  const std::vector<ParamInfo> global = gpt_params(c_.model);
  const char* prefix[3] = {"/model/", "/optim/exp_avg/", "/optim/exp_avg_sq/"};
  float* base[3] = {master_ptr(), opt_->m(), opt_->v()};
  if (!dev_.host_memory()) {
    // Device memory: through a host copy (a save copies the state down first; a load fills it
    // and state_to_device() copies it up).
    const std::size_t n = state_numel();
    host_state_.resize(3 * n);
    for (int g = 0; g < 3; ++g) {
      float* h = host_state_.data() + g * n;
      if (save)
        dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(h),
                  static_cast<const void*>(base[g]), n * sizeof(float), DT_HAL_DEVICE_TO_HOST);
      base[g] = h;
    }
  }
  if (!zero_ && !engine_) {  // every rank holds every tensor whole
    for (int g = 0; g < 3; ++g)
      for (const ParamInfo& p : global)
        out.push_back(CkptTensor{prefix[g] + p.name, p.shape, base[g] + p.offset});
    return out;
  }
  // Sharded: every tensor listed, each rank naming the parts it holds (none by default).
  for (int g = 0; g < 3; ++g)
    for (const ParamInfo& p : global)
      out.push_back(CkptTensor{prefix[g] + p.name, p.shape, base[g], 0, 0});
  auto at = [&](int g, std::size_t gi) -> CkptTensor& { return out[g * global.size() + gi]; };
  if (!engine_) {  // ZeRO on the fused model: at most one range of each tensor per rank
    for (const ZeroPiece& pc : zero_->pieces())
      for (int g = 0; g < 3; ++g) {
        CkptTensor& t = at(g, pc.param);
        t.data = base[g] + pc.local;
        t.begin = pc.begin;
        t.end = pc.end;
      }
    return out;
  }
  // The graph engine: tensor-parallel shards (strided pieces of the global tensors), ZeRO slices
  // of them. A save names each element once: the first stage's copy of a tied tensor, tp rank 0's
  // of a replicated one, and without ZeRO data-parallel rank 0's; a load fills every copy.
  const MeshCoord& mc = mesh_->coord();
  auto writes = [&](std::size_t i) { return !save || ((zero_ || mc.dp == 0) && unique_[i]); };
  auto add = [&](std::size_t i, std::size_t lb, std::size_t le, std::size_t local) {
    const auto runs = graph::shard_runs(engine_->param_tensor(i), mc.tp);
    for (int g = 0; g < 3; ++g)
      add_pieces(runs, lb, le, base[g] + local, at(g, engine_->global_index(i)).pieces);
  };
  if (zero_) {
    for (const ZeroPiece& pc : zero_->pieces())
      if (writes(pc.param)) add(pc.param, pc.begin, pc.end, pc.local);
  } else {
    for (std::size_t i = 0; i < engine_->params().size(); ++i)
      if (writes(i)) add(i, 0, engine_->params()[i].numel, engine_->params()[i].offset);
  }
  return out;
}

const std::vector<ParamInfo>& Trainer::param_list() const {
  return engine_ ? engine_->params() : model_->params();
}
float* Trainer::params_ptr() const {
  return engine_ ? engine_->param_data() : model_->param_data();
}
float* Trainer::master_ptr() const {
  if (zero_) return zero_->master();
  return low_precision() ? master_.as<float>() : params_ptr();
}

std::size_t Trainer::state_numel() const {
  if (zero_) return zero_->shard_numel();
  return param_list().back().offset + param_list().back().numel;
}

void Trainer::round_to_dtype(float* data, std::size_t n) {
  // A round trip through 16 bits with the device's cast (ABI version 2; dt_train refuses a device
  // without it for bf16/fp16 before anything is allocated), in pieces of at most kRoundChunk.
  constexpr std::size_t kRoundChunk = std::size_t{1} << 24;  // 32 MiB of 16-bit values
  const dt_hal_dtype lp = hal_dtype(c_.dtype == "bf16" ? DType::bf16 : DType::f16);
  const dt_hal_dtype f32 = hal_dtype(DType::f32);
  const std::size_t chunk = std::min(n, kRoundChunk);
  if (lp_buf_.bytes() < 2 * chunk) lp_buf_ = Device::Buffer(dev_, 2 * chunk);
  for (std::size_t at = 0; at < n; at += chunk) {
    const auto k = static_cast<std::int64_t>(std::min(chunk, n - at));
    dev_.call(&dt_hal_v2_t::cast, "cast", lp_buf_.get(), lp, static_cast<const void*>(data + at),
              f32, k);
    dev_.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(data + at), f32,
              static_cast<const void*>(lp_buf_.get()), lp, k);
  }
}

bool Trainer::unscale_found_inf(float* grads, std::size_t n, float loss_scale) {
  if (lp_flag_.bytes() == 0) lp_flag_ = Device::Buffer(dev_, sizeof(std::int32_t));
  dev_.call(&dt_hal_v1_t::fill_zero, "fill_zero", lp_flag_.get(), sizeof(std::int32_t));
  dev_.call(&dt_hal_v2_t::scale_check_finite, "scale_check_finite", grads,
            static_cast<std::int64_t>(n), 1.0f / loss_scale, lp_flag_.as<std::int32_t>());
  std::int32_t found = 0;
  dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(&found),
            static_cast<const void*>(lp_flag_.get()), sizeof found, DT_HAL_DEVICE_TO_HOST);
  return found != 0;
}

void Trainer::refresh_working_weights() {
  if (zero_) {
    zero_->publish(params_ptr());  // the (rounded) shards, gathered (stages 1-2)
    // fp32 needs no copy; stage 3 gathers the weights unit by unit, and the products cast them.
    if (!low_precision() || zero_->stage() >= 3) return;
  }
  const std::size_t n = zero_ ? zero_->padded_numel() : state_numel();
  // The master weights rounded into their 16-bit copy, which the matrix products read, and
  // widened from there into the working weights the other kernels read (ZeRO-1/2: the gathered
  // working weights, rounded already, into the copy).
  const dt_hal_dtype lp = hal_dtype(c_.dtype == "bf16" ? DType::bf16 : DType::f16);
  if (weights16_.bytes() < 2 * n) {
    graph_ = Device::Graph();  // a captured micro-batch reads the copy's address
    weights16_ = Device::Buffer(dev_, 2 * n);
    const void* w16 = c_.test_cast_weights ? nullptr : weights16_.get();
    if (model_) model_->set_weights16(w16, n);
    if (engine_) engine_->set_weights16(w16, n);
    if (w16)
      log("dt_train: the matrix products read a " + c_.dtype + " copy of the weights (" +
          format_bytes(static_cast<double>(weights16_.bytes())) +
          ", rounded from the master weights after every optimizer step)");
  }
  if (zero_) {
    dev_.call(&dt_hal_v2_t::cast, "cast", weights16_.get(), lp,
              static_cast<const void*>(params_ptr()), DT_HAL_F32, static_cast<std::int64_t>(n));
    return;
  }
  dev_.call(&dt_hal_v2_t::cast, "cast", weights16_.get(), lp,
            static_cast<const void*>(master_ptr()), DT_HAL_F32, static_cast<std::int64_t>(n));
  dev_.call(&dt_hal_v2_t::cast, "cast", static_cast<void*>(params_ptr()), DT_HAL_F32,
            static_cast<const void*>(weights16_.get()), lp, static_cast<std::int64_t>(n));
}

float* Trainer::grads_ptr() const {
  if (zero_) return zero_->grads();
  return engine_ ? engine_->grad_data() : model_->grad_data();
}

std::string Trainer::layout() const { return plan_->layout.str(); }

std::vector<float> Trainer::global_parameters() {
  const std::vector<ParamInfo> ps = gpt_params(c_.model);
  std::vector<float> out(ps.back().offset + ps.back().numel);
  if (assemble_whole()) {  // kept in full_state_, which sampling reads
    std::copy_n(full_state_.begin(), out.size(), out.begin());
  } else if (zero_) {
    out = zero_->gather_master();
  } else {
    dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(out.data()),
              static_cast<const void*>(master_ptr()), out.size() * sizeof(float),
              DT_HAL_DEVICE_TO_HOST);
  }
  return out;
}

bool Trainer::model_sharded() const noexcept {
  return engine_ || (zero_ && model_ && !model_->param_data());
}

bool Trainer::assemble_whole() {
  if (engine_) {
    gather_state();
  } else if (model_sharded()) {
    full_state_ = zero_->gather_master();
    full_state_current_ = true;
  }
  return model_sharded();
}

void Trainer::gather_state() {
  const std::vector<ParamInfo> global = gpt_params(c_.model);
  full_state_.assign(global.back().offset + global.back().numel, 0.0f);
  full_state_current_ = false;  // until assembled below
  std::vector<float> host(zero_ ? zero_->padded_numel() : engine_->num_params());
  if (zero_) {  // this stage's parameters from the data-parallel ranks' shards
    std::vector<float> shard(zero_->shard_numel());
    dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(shard.data()),
              static_cast<const void*>(master_ptr()), shard.size() * sizeof(float),
              DT_HAL_DEVICE_TO_HOST);
    zero_->gather(shard.data(), host.data());
  } else {
    dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(host.data()),
              static_cast<const void*>(master_ptr()), host.size() * sizeof(float),
              DT_HAL_DEVICE_TO_HOST);
  }
  for (std::size_t i = 0; i < engine_->params().size(); ++i)
    if (owner_[i])
      graph::put_shard(engine_->param_tensor(i), mesh_->coord().tp,
                       host.data() + engine_->params()[i].offset,
                       full_state_.data() + global[engine_->global_index(i)].offset);
  // Every element has exactly one owner and zeros elsewhere: the sum is exact.
  coll().all_reduce(view_of(full_state_), ReduceOp::sum);
  full_state_current_ = true;
}

void Trainer::state_to_device() {
  if (dev_.host_memory() || host_state_.empty()) return;
  const std::size_t n = state_numel();
  float* base[3] = {master_ptr(), opt_->m(), opt_->v()};
  for (int g = 0; g < 3; ++g)
    dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(base[g]),
              static_cast<const void*>(host_state_.data() + g * n), n * sizeof(float),
              DT_HAL_HOST_TO_DEVICE);
}

std::string Trainer::resume_from_checkpoint() {
  watchdog::set_activity("checkpoint load");
  if (c_.ckpt_resume == "none" || (c_.ckpt_resume == "auto" && c_.ckpt_dir.empty())) return "";
  std::string used;
  const watchdog::LimitScope limit(c_.ckpt_timeout_s);  // the reads wait for the slowest rank
  // The head count splits the same weights another way: a checkpoint of another one has every
  // tensor's shape and is another model (files without the setting are taken). Refused before
  // anything of it is read into this trainer's state.
  const CkptMeta m = resume(
      comm_, c_.ckpt_resume, c_.ckpt_dir, state_tensors(false), &used,
      [this](const std::string& line) { log("ckpt: " + line); },
      c_.ckpt_encrypt ? keys_.get() : nullptr,
      [this](const std::string& path, const CkptMeta& meta) {
        check_model_of(path, meta.config, c_.model);
      });
  if (used.empty()) {
    // No checkpoint in the folder (resume refuses when some exist and none loads): start from
    // clean weights all the same.
    host_state_.clear();
    init_weights();
    if (zero_) refresh_working_weights();  // the published weights into their 16-bit copy
    if (!c_.eval_only)  // (--eval-only is refused by its caller: nothing to evaluate)
      log("ckpt: no checkpoint in " + c_.ckpt_dir + ", starting from step 0");
    return "";
  }
  state_to_device();
  if (zero_) refresh_working_weights();  // the loaded shards into the compute parameters
  if (low_precision()) {
    if (!zero_) refresh_working_weights();
    // The scaler's schedule as it was (files before format version 3, and imported ones, lack
    // it: then the count of clean steps starts afresh, with the full tolerance), within this
    // run's settings.
    LossScaler::State st = scaler_->state();
    const LossScaleConfig& sc = scaler_->config();
    // Only an fp16 run scales its loss: a checkpoint of another dtype (its loss_scale is 1) gives
    // an fp16 run the initial scale. Files without the setting (imported) count as fp16 ones.
    const std::string saved_dtype = config_value(m.config, "train.dtype");
    const bool scaled = saved_dtype.empty() || saved_dtype == "fp16";
    if (c_.dtype == "fp16" && !scaled)
      log(detail::concat("ckpt: the checkpoint was trained in ", saved_dtype,
                         ": the fp16 loss scale starts at --loss-scale.initial=", sc.initial));
    if (c_.dtype == "fp16" && scaled && m.loss_scale > 0) {
      st.scale = std::clamp(m.loss_scale, sc.min_scale, sc.max_scale);
      st.growth_tracker =
          std::clamp<std::int64_t>(m.loss_scale_growth_tracker, 0, sc.growth_interval - 1);
      st.hysteresis_left = m.loss_scale_hysteresis_left < 0
                               ? sc.hysteresis
                               : static_cast<int>(std::min<std::int64_t>(
                                     m.loss_scale_hysteresis_left, sc.hysteresis));
    }
    if (m.steps_skipped >= 0) st.skipped = m.steps_skipped;
    scaler_->restore(st);
  }
  step_ = m.step;
  tokens_ = m.tokens;
  last_saved_ = m.step;
  full_state_current_ = false;
  if (c_.ckpt_resume == "auto") resumable_ = used;
  opt_->set_steps(m.optimizer_step);
  log("ckpt: resumed from " + used + " at step " + std::to_string(m.step) + " (written by " +
      m.layout + ", " + std::to_string(m.tokens) + " tokens seen)");
  if (m.rng_seed != c_.seed)
    log("ckpt: warning: the checkpoint was trained with seed " + std::to_string(m.rng_seed) +
        ", this run uses " + std::to_string(c_.seed) + ": the data order differs");
  // Settings that decide the data order, the learning rate schedule and the optimizer's update: a
  // run that changes them does not continue the one it resumes (allowed: extending a run, say,
  // but said). The data is compared by what it holds where the checkpoint recorded it (format
  // version 4): a copy at another path continues the run, other data at the same path does not;
  // by its path otherwise.
  std::string changed;
  const std::string now = c_.config_text;
  if (!m.data.empty() && m.data != data_id_) changed = "data " + m.data + " -> " + data_id_;
  for (const char* k :
       {"train.batch", "model.seq-len", "data.path", "data.val-fraction", "train.steps", "optim.lr",
        "optim.min-lr", "optim.warmup", "optim.decay-steps", "optim.beta1", "optim.beta2",
        "optim.eps", "optim.weight-decay", "optim.grad-clip", "train.dtype"}) {
    if (!m.data.empty() && std::strcmp(k, "data.path") == 0) continue;
    // An evaluation continues nothing: only what decides the data it evaluates on is compared.
    if (c_.eval_only && std::strncmp(k, "data.", 5) != 0) continue;
    const std::string was = config_value(m.config, k), is = config_value(now, k);
    if (!was.empty() && !is.empty() && was != is)
      changed += std::string(changed.empty() ? "" : ", ") + k + " " + was + " -> " + is;
  }
  if (!changed.empty())
    log("ckpt: warning: settings differ from the checkpoint's (" + changed +
        (c_.eval_only ? "): the evaluation is not on the data the checkpoint was trained on"
                      : "): the run does not continue it exactly"));
  return used;
}

void Trainer::log_save_notes(const SaveStats& st) {
  for (const std::string& moved : st.set_aside)
    log("ckpt: set aside " + moved + ": its step is not below that of " + st.path +
        " (another line of training in this folder)");
  for (const std::string& w : st.warnings) log("ckpt: warning: " + w);
}

void Trainer::finish_checkpoints() {
  if (!async_) return;
  const SaveStats prev = async_->wait();
  log_save_notes(prev);
  if (!prev.path.empty()) {
    resumable_ = prev.path;
    obs_->on_checkpoint_written(prev.write_seconds, prev.bytes);
    char line[256];
    std::snprintf(line, sizeof line, "ckpt: %s written in the background in %.3f s (%.0f MB/s)",
                  prev.path.c_str(), prev.write_seconds,
                  static_cast<double>(prev.bytes) / prev.write_seconds / 1e6);
    log(line);
  }
}

void Trainer::save_checkpoint_now(bool sync) {
  if (c_.ckpt_dir.empty()) return;
  last_saved_ = step_;
  CkptMeta meta;
  meta.step = step_;
  meta.tokens = tokens_;  // (a resumed run may have another batch or sequence length)
  meta.optimizer_step = opt_->steps();
  meta.data_position = step_;
  meta.rng_seed = c_.seed;
  meta.loss_scale = scaler_ ? scaler_->scale() : 1.0;
  if (scaler_) {
    const LossScaler::State st = scaler_->state();
    meta.loss_scale_growth_tracker = st.growth_tracker;
    meta.loss_scale_hysteresis_left = st.hysteresis_left;
    meta.steps_skipped = st.skipped;
  }
  meta.config = c_.config_text;
  // The model's settings, which a resume checks (the head count splits the same weights another
  // way), also where the options were not recorded (a trainer made through the library).
  for (const auto& [name, value] : model_settings(c_.model))
    if (config_value(meta.config, name).empty())
      meta.config += name + " = " + std::to_string(value) + "\n";
  meta.layout = plan_->layout.str();
  meta.data = data_id_;
  char line[256];
  // test.fail-save-at-step: every rank fails the first save of this step the same way, before
  // the commit (a second save of it, a drain's, succeeds).
  const bool fail =
      c_.test_fail_save_at_step > 0 && step_ == c_.test_fail_save_at_step && !test_save_failed_;
  test_save_failed_ = test_save_failed_ || fail;
  auto fail_here = [step = step_, fail] {
    if (fail)
      DT_THROW(CheckpointError, "test.fail-save-at-step: the save of step ", step,
               " fails here (testing only)");
  };
  if (async_ && !sync) {
    const auto t0 = std::chrono::steady_clock::now();
    // A background save that failed ends the run, but not before this step is saved (here,
    // synchronously): the steps since the last checkpoint are not lost with it.
    std::string earlier;
    try {
      finish_checkpoints();
    } catch (const CheckpointError& e) {
      earlier = e.message();
    }
    if (!earlier.empty()) {
      log("ckpt: error: an earlier background save failed: " + earlier + "; saving step " +
          std::to_string(step_) + " now, before the run ends");
      save_checkpoint_now(true);
      DT_THROW(CheckpointError, "an earlier background save failed: ", earlier, " (step ", step_,
               " was saved: ", resumable_, ")");
    }
    const double blocked =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() +
        async_->save(state_tensors(), meta, fail_here);
    obs_->on_checkpoint_blocked(blocked);
    std::snprintf(line, sizeof line, "ckpt: step %ld: snapshot taken, blocked %.1f ms",
                  static_cast<long>(step_), blocked * 1e3);
    log(line);
    return;
  }
  if (async_) {
    // Draining (sync: the job is about to end): a background save that failed earlier must not
    // cost the checkpoint of this step as well.
    try {
      finish_checkpoints();
    } catch (const std::exception& e) {
      log("ckpt: warning: an earlier background save failed: " + message_of(e) + "; saving step " +
          std::to_string(step_) + " now");
    }
  }
  const bool die = c_.test_kill_during_save == comm_.rank();
  const bool stall = c_.test_stall_during_save == comm_.rank();
  // The save runs HDF5's own collectives: the watchdog sees it as one collective, so a save that
  // hangs inside HDF5 (an I/O error on some ranks only) ends the job instead of hanging it.
  watchdog::set_activity("checkpoint save", step_);
  // Its collectives, and those inside it, wait for the slowest rank's writes: ckpt.timeout-s.
  const watchdog::LimitScope save_limit(c_.ckpt_timeout_s);
  // Watched for hangs like a collective (ckpt.timeout-s), counted in dt_ckpt_* (not dt_comm_*).
  const watchdog::OpRecord save_record("checkpoint", ++saves_, "save", "hdf5", DType::u8, 0, -1, -1,
                                       false);
  const SaveStats st = save_checkpoint(
      comm_, c_.ckpt_dir, state_tensors(), meta, static_cast<int>(c_.ckpt_keep),
      [die, stall, this, &fail_here] {
        if (die) std::raise(SIGKILL);
        if (stall) stall_for_test("in the checkpoint save", step_);
        if (c_.test_save_delay_s > 0 && comm_.rank() == comm_.size() - 1)
          std::this_thread::sleep_for(std::chrono::duration<double>(c_.test_save_delay_s));
        fail_here();
      },
      c_.ckpt_encrypt ? keys_.get() : nullptr);
  log_save_notes(st);
  resumable_ = st.path;
  obs_->on_checkpoint_blocked(st.write_seconds);
  obs_->on_checkpoint_written(st.write_seconds, st.bytes);
  std::snprintf(line, sizeof line, "ckpt: saved %s (%.1f MB) in %.3f s, blocking (%.0f MB/s)",
                st.path.c_str(), static_cast<double>(st.bytes) / 1e6, st.write_seconds,
                static_cast<double>(st.bytes) / st.write_seconds / 1e6);
  log(line);
}

double Trainer::evaluate_in_order(std::int64_t count) {
  std::vector<std::size_t> starts(static_cast<std::size_t>(count));
  for (std::size_t i = 0; i < starts.size(); ++i)
    starts[i] = i * static_cast<std::size_t>(c_.model.block);
  return loss_over(starts);
}

int Trainer::run() {
  const bool lead = comm_.rank() == 0;
  const int T = c_.model.block;
  if (lead) {
    const std::vector<ParamInfo> ps = gpt_params(c_.model);
    const std::int64_t vp = padded_vocab(c_.model);
    const std::string head =
        vp > c_.model.vocab ? " (the head over " + std::to_string(vp) +
                                  ", model.pad-vocab=" + std::to_string(c_.model.pad_vocab) + ")"
                            : "";
    std::printf("dt_train: %zu parameters, %d layers, %d heads, embd %d, seq %d, vocab %d%s\n",
                ps.back().offset + ps.back().numel, c_.model.layers, c_.model.heads, c_.model.embd,
                T, c_.model.vocab, head.c_str());
    std::printf(
        "dt_train: %d ranks, global batch %ld x %d tokens, micro-batch %ld, %ld steps, "
        "device %s (%s), layout %s\n",
        comm_.size(), static_cast<long>(c_.batch), T, static_cast<long>(micro_),
        static_cast<long>(c_.steps), dev_.name().c_str(), dev_.origin().c_str(),
        plan_->layout.str().c_str());
    std::printf("dt_train: data %s (%s, %zu tokens: %zu train, %zu val)\n", c_.data_path.c_str(),
                data_.format.c_str(), data_.size(), split_.train.size(), split_.val.size());
    if (!plan_->why.empty()) std::printf("dt_train: %s\n", plan_->why.c_str());
    if (!data_.note.empty()) std::printf("dt_train: warning: %s\n", data_.note.c_str());
    if (c_.sample_tokens > 0 && data_.format != "bytes" && c_.sample_prompt != "\n" &&
        c_.sample_prompt_ids.empty())
      std::printf(
          "dt_train: warning: --sample.prompt is text, which only byte data reads: the "
          "sample of this %s data starts from token %d (--sample.prompt-ids takes token ids)\n",
          data_.format.c_str(), sample_prompt_tokens(c_, data_.format).front());
    if (!c_.key_file.empty() && c_.seal == "off" && !c_.ckpt_encrypt)
      std::printf(
          "dt_train: warning: --security.key_file is given, but neither --security.seal nor "
          "--ckpt.encrypt=true uses it: traffic and checkpoints are plain\n");
    if (!c_.eval_only && c_.optim.warmup >= c_.steps)
      std::printf(
          "dt_train: warning: --optim.warmup=%ld is not below --train.steps=%ld: the learning "
          "rate never reaches --optim.lr=%g (at most %g)\n",
          static_cast<long>(c_.optim.warmup), static_cast<long>(c_.steps), c_.optim.lr,
          lr_at(c_.optim, c_.steps - 1));
    std::fflush(stdout);
  }
  report_memory();
  if (c_.eval_only) {
    char line[256];
    const double loss = evaluate_in_order(c_.eval_sequences);
    std::snprintf(
        line, sizeof line,
        "dt_train: eval-only: step %ld, first %ld validation sequences in order, loss %.6f",
        static_cast<long>(step_), static_cast<long>(c_.eval_sequences), loss);
    log(line);
    obs_->on_eval(loss);
    obs_->finish();  // the timeline and the last metrics export, as at the end of training
    return 0;
  }
  const std::int64_t first_step = step_;
  // Preemption: a signal on any rank drains all of them at a step boundary, before the next
  // step (so also one that came during start-up or during the save of the step before: that
  // save is the drained checkpoint, not a second one a step later). With test.hold-at-step the
  // ranks ask again every 20 ms after that step until one has it (the same count of polls
  // everywhere ends the wait after about 300 s). Returns the exit code of a drain, or -1 (also
  // for a signal after the last step: `done`, the run ends as done).
  auto drain_point = [&](bool done) -> int {
    const bool hold = step_ == c_.test_hold_at_step && step_ > first_step;
    if (hold) {
      log("dt_train: test.hold-at-step: step " + std::to_string(step_) +
          " done, waiting for a drain signal");
      watchdog::set_activity("test.hold-at-step", step_);
    } else {
      watchdog::set_activity("drain check", step_);
    }
    int drain = 0;
    for (int poll = 0;; ++poll) {
      drain = drain_requested() ? 1 : 0;
      if (comm_.size() > 1) coll().all_reduce(view_of(&drain, 1), ReduceOp::max);
      if (drain || !hold || poll == 15000) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!drain || done) return -1;
    // Nothing trained in this run yet, and it started where a requeued run (--ckpt.resume=auto)
    // starts too: at the folder's newest checkpoint, or at step 0 in an empty folder. Nothing is
    // written. A start from elsewhere (a named checkpoint, resume=none) is saved, so that the
    // requeued run goes on from it.
    const bool from_folder = step_ == first_step && c_.ckpt_resume == "auto";
    // The drain's own save may fail (a full disk). Where this run committed a checkpoint to the
    // folder, or resumed from one there, the run still ends as drained, to be requeued and resume
    // there: the steps since are lost, not the job. (A folder's checkpoint of another run is no
    // such place: the failure ends the run. Every rank fails a save alike: see save_checkpoint.)
    std::string older;
    try {
      if (!from_folder && (step_ != last_saved_ || step_ == first_step)) {
        save_checkpoint_now(true);
      } else if (!from_folder && async_) {
        // This step's save runs in the background: if it failed, the step is saved now.
        try {
          finish_checkpoints();
        } catch (const std::exception& e) {
          log("ckpt: warning: the background save of step " + std::to_string(step_) +
              " failed: " + message_of(e) + "; saving it now");
          save_checkpoint_now(true);
        }
      }
      finish_checkpoints();
    } catch (const CheckpointError& e) {
      if (c_.ckpt_dir.empty() || resumable_.empty()) throw;
      log("ckpt: warning: the drain's checkpoint of step " + std::to_string(step_) +
          " could not be saved: " + e.message() + "; a requeued run resumes from " + resumable_ +
          " (this run's latest checkpoint in " + c_.ckpt_dir + ")");
      older = resumable_;
    }
    const int code = c_.ckpt_dir.empty() ? kExitDrainedUnsaved : kExitDrained;
    log("dt_train: drained at step " + std::to_string(step_) +
        (c_.ckpt_dir.empty() ? " (no ckpt.dir: nothing saved)"
         : !older.empty()    ? " (its checkpoint not saved: " + older + " is where it resumes)"
         : from_folder       ? " (before its first step: the checkpoints in " + c_.ckpt_dir +
                             " are where it resumes)"
                       : " (checkpoint in " + c_.ckpt_dir + ")") +
        ", exit code " + std::to_string(code));
    obs_->finish();
    comm_.barrier();
    return code;
  };
  // A drain signal during start-up: before the first evaluation, which it need not wait for.
  if (const int code = drain_point(false); code >= 0) return code;
  // Without a validation split (data.val-fraction=0) there is nothing to evaluate: no validation
  // loss is printed, logged or exported.
  const bool validating = !eval_starts_.empty();
  const double val0 = validating ? evaluate() : std::nan("");
  if (validating) obs_->on_eval(val0);
  if (lead && validating) {
    std::printf("step %6ld | val loss %.4f\n", static_cast<long>(step_), val0);
    std::fflush(stdout);
  }
  std::FILE* jsonl = nullptr;
  if (lead && !c_.log_file.empty()) {
    const int fd = open_step_log(c_.log_file, c_.data_path);
    jsonl = ::fdopen(fd, "a");
    if (jsonl == nullptr) ::close(fd);
    DT_CHECK(ConfigError, jsonl != nullptr, "option --train.log-file: cannot open ", c_.log_file,
             " for appending");
  }
  struct Closer {
    std::FILE* f;
    ~Closer() {
      if (f) std::fclose(f);
    }
  } closer{jsonl};
  double val = val0, window_secs = 0, total_secs = 0, all_secs = 0, loss = 0;
  std::int64_t window_steps = 0;
  while (step_ < c_.steps) {
    if (const int code = drain_point(false); code >= 0) return code;
    const StepStats s = step();
    if (s.given_up) {  // a drain every rank voted for: the drain check ends the run
      if (const int code = drain_point(false); code >= 0) return code;
      continue;
    }
    obs_->on_step(s);
    loss = s.loss;

    window_secs += s.seconds;
    all_secs += s.seconds;
    // The summary rate leaves out the first step, which also pays for first-touch page faults.
    if (s.step > first_step || c_.steps - first_step == 1) total_secs += s.seconds;
    ++window_steps;
    const bool last = step_ == c_.steps;
    const bool do_eval = validating && (last || (c_.eval_every > 0 && step_ % c_.eval_every == 0));
    std::string val_text;
    if (do_eval) {
      val = evaluate();
      obs_->on_eval(val);
      char b[32];
      std::snprintf(b, sizeof b, " | val %.4f", val);
      val_text = b;
    }
    if (jsonl) {
      char norm[32] = "null";  // a skipped step has no norm
      if (!s.skipped) std::snprintf(norm, sizeof norm, "%.9g", s.grad_norm);
      std::fprintf(
          jsonl,
          "{\"step\": %ld, \"loss\": %.9g, \"lr\": %.9g, \"grad_norm\": %s, \"seconds\": %.6f",
          static_cast<long>(step_), s.loss, s.lr, norm, s.seconds);
      if (scaler_)
        std::fprintf(jsonl, ", \"loss_scale\": %.9g, \"skipped\": %s", s.loss_scale,
                     s.skipped ? "true" : "false");
      if (do_eval) std::fprintf(jsonl, ", \"val_loss\": %.9g", val);
      std::fprintf(jsonl, "}\n");
      // A line that cannot be written (a full disk, a quota) ends the log where it is, said
      // once: later lines after a lost or partial one would make it read as whole when it is not.
      if (std::fflush(jsonl) != 0 || std::ferror(jsonl)) {
        const int err = errno;
        std::fprintf(stderr,
                     "dt_train: warning: --train.log-file: cannot write to %s at step %ld (%s): "
                     "the step log ends before this step; training goes on\n",
                     c_.log_file.c_str(), static_cast<long>(step_), std::strerror(err));
        std::fclose(jsonl);
        jsonl = closer.f = nullptr;
      }
    }
    if (lead && s.skipped) {
      std::printf("step %6ld: skipped: gradients overflowed at loss scale %g, now %g\n",
                  static_cast<long>(step_), s.loss_scale, static_cast<double>(scaler_->scale()));
      std::fflush(stdout);
    }
    if (lead && (step_ % c_.log_every == 0 || last || do_eval)) {
      const double ms = window_secs / static_cast<double>(window_steps) * 1e3;
      const double tps = static_cast<double>(c_.batch) * T * window_steps / window_secs;
      const double eta = ms / 1e3 * static_cast<double>(c_.steps - step_);
      std::printf(
          "step %6ld/%ld | loss %.4f%s | lr %.2e | norm %.3f | %.0f tok/s | %.1f ms | "
          "eta %s\n",
          static_cast<long>(step_), static_cast<long>(c_.steps), s.loss, val_text.c_str(), s.lr,
          s.grad_norm, tps, ms, duration_str(eta).c_str());
      std::fflush(stdout);
      window_secs = 0;
      window_steps = 0;
    }
    if (c_.ckpt_every > 0 && step_ % c_.ckpt_every == 0 && step_ < c_.steps)
      save_checkpoint_now(false);
  }
  // A signal during the last step: the run is done, so it ends as done (exit 0, final save and
  // summary), not as drained (which asks the scheduler to requeue it).
  if (step_ == c_.test_hold_at_step) drain_point(true);
  if (step_ != last_saved_) save_checkpoint_now(false);
  finish_checkpoints();
  if (engine_ && plan_->layout.pp > 1) report_bubble();
  if (weights16_.bytes() > 0 && !c_.test_cast_weights) {
    const std::int64_t reads = engine_  ? engine_->weight_copy_reads()
                               : model_ ? model_->weight_copy_reads()
                                        : 0;
    log("dt_train: " + std::to_string(reads) + " matrix product operands read from the " +
        c_.dtype + " copy of the weights (rank 0, from the host; graph replays not counted)");
  }
  if (c_.cuda_graphs) {
    report_graphs();
    // Sampling and the device memory the run gives back need no graphs holding scratch memory.
    graph_ = Device::Graph();
    if (engine_) engine_->set_graphs(false);
  }
  // Sampling runs the whole model on rank 0: the graph engine's shards are assembled first.
  // (Also when nothing was left to train: sampling from a finished run's checkpoint.)
  if (c_.sample_tokens > 0) assemble_whole();
  report_peak_memory();
  // Rank 0 samples alone while the others wait in the barrier below, as long as it takes (a long
  // sample is no hang).
  const watchdog::LimitScope sampling(0);
  if (lead && first_step >= c_.steps) {
    std::printf("dt_train: nothing to train: the checkpoint is at step %ld, --train.steps is %ld\n",
                static_cast<long>(first_step), static_cast<long>(c_.steps));
  } else if (lead) {
    const std::int64_t ran = c_.steps - first_step;
    const double timed = static_cast<double>(ran > 1 ? ran - 1 : 1);
    const double tps = static_cast<double>(c_.batch) * T * timed / total_secs;
    char val_text[96] = "no validation split";
    if (validating && val0 != 0)
      std::snprintf(val_text, sizeof val_text, "val loss %.4f -> %.4f (%+.1f%%)", val0, val,
                    (val - val0) / val0 * 100.0);
    else if (validating)  // (a change relative to 0 is no number)
      std::snprintf(val_text, sizeof val_text, "val loss %.4f -> %.4f", val0, val);
    const std::string resumed = first_step > 0
                                    ? " (" + std::to_string(ran) + " in this run, from step " +
                                          std::to_string(first_step) + ")"
                                    : "";
    std::printf(
        "dt_train: done: %ld steps%s in %s, %.0f tok/s (steady state), %.2f GFLOP/s per rank; "
        "train loss %.4f, %s\n",
        static_cast<long>(c_.steps), resumed.c_str(), duration_str(all_secs).c_str(), tps,
        tps * gpt_flops_per_token(c_.model, T) / comm_.size() / 1e9, loss, val_text);
    // Skipped steps change no weight: said, so that a run that skipped them all does not pass
    // for one that trained.
    if (scaler_ && scaler_->steps_skipped() > 0) {
      const std::int64_t skipped = scaler_->steps_skipped();
      char scale[64] = "";
      if (scaler_->config().dynamic)
        std::snprintf(scale, sizeof scale, "; the loss scale is now %g",
                      static_cast<double>(scaler_->scale()));
      std::printf(
          "dt_train: %s%lld of %ld steps skipped: their gradients were not finite "
          "(train.dtype=%s)%s\n",
          skipped >= c_.steps ? "warning: nothing was trained: " : "",
          static_cast<long long>(skipped), static_cast<long>(c_.steps), c_.dtype.c_str(), scale);
    }
  }
  if (lead) {
    if (c_.sample_tokens > 0) {
      // What the ids mean is the data's format, not the model's vocabulary (a byte file may
      // train a model of more than 256 ids; those print as "\{N}").
      const bool bytes = data_.format == "bytes";
      const std::vector<std::int32_t> prompt = sample_prompt_tokens(c_, data_.format);
      auto out = sample(prompt, c_.sample_tokens, c_.sample_temperature,
                        static_cast<std::uint64_t>(c_.seed));
      if (bytes) {
        std::printf("dt_train: sample:\n%s%s\n", decode_bytes(prompt.data(), prompt.size()).c_str(),
                    decode_bytes(out.data(), out.size()).c_str());
      } else {
        std::printf("dt_train: sample prompt (token ids):");
        for (auto t : prompt) std::printf(" %d", t);
        std::printf("\ndt_train: sample (token ids):");
        for (auto t : out) std::printf(" %d", t);
        std::printf("\n");
      }
    }
    std::fflush(stdout);
  }
  obs_->finish();
  comm_.barrier();
  return 0;
}

void Trainer::publish_metrics() noexcept {
  if (obs_) obs_->publish_now();
}

std::string Trainer::node_memory_problem(int ranks_here) const {
  // The smallest stage's estimate for every rank of the node: a lower bound, so that a refusal is
  // certain, never a guess (the ranks also hold buffers the estimate leaves out).
  double least = -1;
  for (const auto& m : plan_->memory)
    if (least < 0 || m.total() < least) least = m.total();
  const double need = least * ranks_here;
  std::string where;
  const std::uint64_t room = qos::memory_available(&where);
  std::string problem;
  if (!where.empty() && need > static_cast<double>(room))
    problem = "the " + std::to_string(ranks_here) + " rank(s) on node " + host_name() +
              " need at least " + format_bytes(need) + " (" + format_bytes(least) +
              " each: parameters, gradients, optimizer state and activations as planned for "
              "layout " +
              plan_->layout.str() + "), but the node has " +
              format_bytes(static_cast<double>(room)) + " left (" + where +
              "): use more nodes or fewer ranks a node, a larger --parallel.tp or --parallel.pp, "
              "--parallel.zero, or a smaller --train.micro-batch";
  return problem;
}

void Trainer::report_memory() {
  const std::size_t f = sizeof(float);
  ZeroMemory m;
  if (zero_) {
    m = zero_->memory();
  } else {
    const std::size_t n = engine_ ? engine_->num_params() : model_->num_params();
    m.params = n * f + (low_precision() ? 2 * n : 0);  // and their 16-bit copy
    m.grads = n * f + (buckets_ ? buckets_->wire_bytes() : 0);
    m.optimizer = (2 + (low_precision() ? 1 : 0)) * n * f;
  }
  const std::size_t act = engine_ ? engine_->activation_bytes() : model_->activation_bytes();
  char line[320];
  std::snprintf(line, sizeof line,
                "dt_train: memory per rank (parallel.zero=%d, rank 0): parameters %s, gradients "
                "%s, optimizer state %s, model state %s; activations %s",
                c_.par_zero, format_bytes(static_cast<double>(m.params)).c_str(),
                format_bytes(static_cast<double>(m.grads)).c_str(),
                format_bytes(static_cast<double>(m.optimizer)).c_str(),
                format_bytes(static_cast<double>(m.params + m.grads + m.optimizer)).c_str(),
                format_bytes(static_cast<double>(act)).c_str());
  log(line);
}

void Trainer::report_peak_memory() {
  std::vector<double> mine{metrics::resident_memory().peak};
  std::vector<double> all(static_cast<std::size_t>(comm_.size()));
  comm_.all_gather(view_of(mine), view_of(all));
  if (comm_.rank() != 0) return;
  std::string line = "dt_train: peak resident memory per rank:";
  double top = 0;
  for (std::size_t r = 0; r < all.size(); ++r) {
    line += (r ? ", " : " ") + format_bytes(all[r]) + " (rank " + std::to_string(r) + ")";
    top = std::max(top, all[r]);
  }
  log(line + "; max " + format_bytes(top));
}

void Trainer::report_bubble() {
  const int p = plan_->layout.pp, m = plan_->microbatches;
  std::vector<double> mine{pipe_idle_s_, pipe_total_s_},
      all(2 * static_cast<std::size_t>(comm_.size()));
  comm_.all_gather(view_of(mine), view_of(all));
  if (comm_.rank() != 0 || all[1] <= 0) return;
  std::vector<double> idle(static_cast<std::size_t>(p), 0), total(static_cast<std::size_t>(p), 0);
  for (std::size_t r = 0; r < mesh_->coords().size(); ++r) {
    const std::size_t s = static_cast<std::size_t>(mesh_->coords()[r].pp);
    idle[s] += all[2 * r];
    total[s] += all[2 * r + 1];
  }
  double sum = 0;
  std::string per;
  for (int s = 0; s < p; ++s) {
    const double f = idle[static_cast<std::size_t>(s)] / total[static_cast<std::size_t>(s)];
    sum += f;
    char b[48];
    std::snprintf(b, sizeof b, "%s stage %d %.1f%%", s ? "," : "", s, 100 * f);
    per += b;
  }
  std::printf(
      "dt_train: pipeline bubble: %.1f%% of the 1F1B schedule idle, mean of %d stages "
      "(theory (p-1)/(m+p-1) = %.1f%% for p=%d, m=%d);%s\n",
      100 * sum / p, p, 100.0 * (p - 1) / (m + p - 1), p, m, per.c_str());
  std::fflush(stdout);
}

void Trainer::print_plan() {
  const Layout& L = plan_->layout;
  if (comm_.rank() == 0) {
    std::printf(
        "dt_train: plan: %s on %d ranks; %d micro-batches of %ld sequences per step and "
        "data-parallel rank\n",
        L.str().c_str(), comm_.size(), plan_->microbatches, static_cast<long>(micro_));
    if (!plan_->why.empty()) std::printf("dt_train: %s\n", plan_->why.c_str());
    std::printf("dt_train: placement (tensor-parallel groups):\n%s",
                describe_placement(L, mesh_->coords(), mesh_->sites()).c_str());
    for (int s = 0; s < L.pp; ++s) {
      const int last = s + 1 < L.pp ? plan_->first_layer[static_cast<std::size_t>(s) + 1] - 1
                                    : c_.model.layers - 1;
      const graph::MemoryEstimate& m = plan_->memory[static_cast<std::size_t>(s)];
      std::printf(
          "dt_train: stage %d: layers %d-%d; estimated memory per rank %s (parameters %s, "
          "gradients %s, optimizer state %s, activations of %d micro-batches %s)\n",
          s, plan_->first_layer[static_cast<std::size_t>(s)], last, format_bytes(m.total()).c_str(),
          format_bytes(m.params).c_str(), format_bytes(m.grads).c_str(),
          format_bytes(m.optim).c_str(), plan_->in_flight(s), format_bytes(m.activations).c_str());
      for (std::size_t r = 0; r < mesh_->coords().size(); ++r) {
        const MeshCoord& mc = mesh_->coords()[r];
        if (mc.pp != s) continue;
        std::printf("rank %zu (dp %d, stage %d, tp %d of %d) on %s:\n", r, mc.dp, mc.pp, mc.tp,
                    L.tp, mesh_->sites()[r].host.c_str());
        std::printf("%s", graph::to_text(plan_->stage(s)).c_str());
      }
    }
    try {
      metrics::write_file_atomically(c_.plan_dot, graph::to_dot(plan_->full, "dt plan " + L.str()));
    } catch (const Error& e) {
      DT_THROW(ConfigError, "option --plan.dot: ", e.message());
    }
    std::printf("dt_train: plan graph written to %s (Graphviz DOT)\n", c_.plan_dot.c_str());
    std::fflush(stdout);
  }
}

}  // namespace dt
