// dt_train: train a GPT on a text or token file over all ranks of the job.
//
//   srun ./dt_train --config configs/gpt-tiny.ini [--train.steps=500 ...]
//
// Exit codes: 0 done; 2 bad options, config, data or checkpoint (refused before training starts);
// 3 a rank failed during training (the job is aborted so that no rank hangs); 4 the hang watchdog
// found a collective stuck longer than comm.timeout-s (it names the missing ranks); 75 drained on
// SIGUSR1/SIGTERM after writing a checkpoint, or with an older one where that save failed (requeue
// the job; it resumes from the checkpoint);
// 76 drained without ckpt.dir, nothing saved (not to be requeued);
// 5 a sealed message failed authentication (security.seal: the rank names the peer and sequence).
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "comm/mpi_comm.hpp"
#include "comm/nccl_module.hpp"
#include "dt/config.hpp"
#include "dt/device.hpp"
#include "dt/qos.hpp"
#include "dt/runtime.hpp"
#include "dt/security.hpp"
#include "dt/trace.hpp"
#include "dt/train.hpp"
#include "dt/watchdog.hpp"

int main(int argc, char** argv) {
  // A drain signal (preemption) from the first moment on: during start-up (options, data, MPI, a
  // resume's load) it is kept and drains the run before its first step, instead of killing it.
  dt::install_drain_signals();
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--version") {
      std::printf("dt_train (dt) %s\n", DT_VERSION);
      return 0;
    }
  dt::TrainConfig cfg;
  dt::Options opts(
      "dt_train",
      "Train a GPT-2-style model over MPI ranks with data, tensor and pipeline parallelism.\n"
      "dt_train --version prints the version of dt.");
  dt::add_train_options(opts, cfg);
  dt::qos::Settings qos_settings;
  dt::qos::add_options(opts, qos_settings);
  dt::TokenFile data;
  dt::qos::Tier tier;
  // The command line is the same on every rank: without --config, an error in it ends every rank
  // here, before MPI starts. What a rank reads from its node (the data, the key file, the QoS
  // record) can fail on one node only: that failure is kept and agreed on once MPI has started, so
  // that every rank exits 2 with it instead of the others waiting for the missing rank.
  std::string local_error;
  // A config file is read on each node, and its copies (or a node-local path) may differ: an
  // error in its options may be one node's. With --config, option errors are therefore kept and
  // agreed on once MPI has started, as the data's are, so that no rank waits in MPI's start-up
  // for ranks that ended before it.
  const bool config_given = dt::config_file_given(argc, argv);
  std::string option_error;
  // Option errors: reported once (dt::quiet_option_errors).
  int rc = dt::run_with_config_errors(
      "dt_train",
      [&] {
        try {
          if (!opts.parse(argc, argv)) return 0;
          dt::check_layout_options(opts, cfg);
        } catch (const dt::ConfigError& e) {
          if (!config_given) throw;  // the command line alone: the same on every rank
          option_error = e.message();
          return -1;
        }
        if (cfg.test_start_delay_s > 0)
          std::this_thread::sleep_for(std::chrono::duration<double>(cfg.test_start_delay_s));
        try {
          data = dt::validate_and_load(cfg);
          const std::string record = dt::qos::record_path(qos_settings);
          if (!record.empty()) tier = dt::qos::read_record(record);
        } catch (const std::exception& e) {
          local_error = dt::message_of(e);
        }
        return -1;
      },
      dt::quiet_option_errors(argc, argv));
  if (rc >= 0) return rc;
  // Into the job's cgroup before MPI starts its threads; this (compute) thread gets its policy.
  dt::qos::configure(tier);

  dt::RuntimeOptions ro;  // the defaults where the options were refused
  if (option_error.empty()) {
    ro.bind = dt::parse_bind_mode(cfg.bind);
    ro.use_pmix = cfg.pmix;
  }
  const auto runtime = dt::start_runtime(&argc, &argv, ro, "dt_train");
  dt::Runtime& rt = *runtime;
  const bool lead = rt.rank() == 0;
  // Set-up runs in phases; after each, all ranks agree whether every rank succeeded before any
  // of them enters the next phase's collectives (communicator dup, checkpoint reads). A rank that
  // failed (a plugin missing on one node, say) reports it, and every rank exits 2; none hangs.
  auto phase = [&](const std::function<void()>& body) {
    return dt::agree_on_errors(rt.world(), "dt_train", body);
  };
  // Options a rank refused (its config file): before anything else uses them.
  if (!phase([&] {
        if (!option_error.empty()) throw dt::ConfigError(option_error, __FILE__, __LINE__);
      }))
    return 2;
  cfg.config_text = opts.dump();
  cfg.local_rank = rt.topology().placement.local_rank;
  cfg.site.node = rt.topology().placement.node_id;
  cfg.site.local_rank = rt.topology().placement.local_rank;
  cfg.site.host = rt.topology().machine.host;
  cfg.site.numa = std::atoi(rt.topology().binding.numa.c_str());  // first NUMA node of the binding
  if (cfg.print_config && lead) std::printf("%s", cfg.config_text.c_str());
  if (lead && !tier.name.empty())
    std::printf("dt_train: qos: %s\n", dt::qos::describe(dt::qos::current()).c_str());
  // The hang watchdog (destroyed before the runtime finalises MPI).
  dt::watchdog::Settings wds;
  wds.timeout_s = cfg.comm_timeout_s;
  wds.scoped_limits = cfg.ckpt_timeout_s > 0;  // checkpoint saves and loads (watchdog::LimitScope)
  wds.dump_dir = cfg.comm_dump_dir;
  wds.exit_code = 4;
  dt::watchdog::Watchdog watchdog(MPI_COMM_WORLD, wds);
  dt::install_drain_signals();  // again, over any handler MPI's start-up installed
  std::unique_ptr<dt::Device> dev;
  std::unique_ptr<dt::Trainer> trainer;
  // What each rank validated on its own node, then whether all read the same data.
  if (!phase([&] {
        if (!local_error.empty()) throw dt::ConfigError(local_error, __FILE__, __LINE__);
      }))
    return 2;
  if (!phase([&] { dt::check_same_data(rt.world(), data, cfg.data_path); })) return 2;
  if (!phase(
          [&] { dt::check_same_options(rt.world(), cfg.config_text, opts.node_local_options()); }))
    return 2;
  // The same job key everywhere (after the options: whether there is one is an option).
  if (!phase([&] { dt::check_same_key(rt.world(), cfg); })) return 2;
  // This run's claim on its checkpoint folder (rank 0 writes the commits there), before anything
  // is allocated: a second run pointed at the same folder is refused, naming the first.
  // The other ranks wait for rank 0's claim (up to ckpt.lock-wait-s), watching for a drain.
  std::unique_ptr<dt::FolderLock> ckpt_lock;
  const bool claim = !cfg.ckpt_dir.empty() && !cfg.eval_only && !cfg.print_plan;
  {
    int stopped = 0;  // rank 0's wait for the folder ended by a drain signal
    const dt::watchdog::LimitScope claim_limit(
        cfg.comm_timeout_s > 0 ? std::max(cfg.comm_timeout_s, cfg.ckpt_lock_wait_s + 60) : 0);
    // While rank 0 waits for the folder, the other ranks watch for a drain signal of their own
    // and tell rank 0, whose wait it ends as one of its own does ("to any rank": Slurm's
    // scancel --signal may reach only some). They meet rank 0 in a barrier of a communicator of
    // their own, polled, when its wait is over (a collective the watchdog sees).
    std::unique_ptr<dt::MpiComm> claim_comm;
    if (claim) claim_comm = dt::MpiComm::dup(MPI_COMM_WORLD, "world/claim");
    constexpr int kTagDrain = 75;
    int told = 0;  // this rank told rank 0 of a drain signal
    auto meet = [&] {
      int one = 1;
      MPI_Request note = MPI_REQUEST_NULL;
      dt::Work end = claim_comm->ibarrier();
      while (!end.test()) {
        if (rt.rank() != 0 && !told && dt::drain_requested()) {
          MPI_Isend(&one, 1, MPI_INT, 0, kTagDrain, claim_comm->handle(), &note);
          told = 1;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      // Rank 0 takes the notes sent, however many came after its wait.
      int sent = told;
      claim_comm->all_reduce(dt::view_of(&sent, 1), dt::ReduceOp::sum);
      for (int k = 0; rt.rank() == 0 && k < sent; ++k)
        MPI_Recv(&one, 1, MPI_INT, MPI_ANY_SOURCE, kTagDrain, claim_comm->handle(),
                 MPI_STATUS_IGNORE);
      MPI_Wait(&note, MPI_STATUS_IGNORE);
    };
    // Rank 0's part: the step log's check and the claim.
    auto claim_folder = [&] {
      // Rank 0 writes the step log: one it cannot open is refused here, before anything is
      // allocated (opening it for appending creates it, as the run would).
      if (!cfg.log_file.empty()) {
        std::FILE* f = std::fopen(cfg.log_file.c_str(), "a");
        const int err = errno;
        DT_CHECK(dt::ConfigError, f != nullptr, "option --train.log-file: cannot open ",
                 cfg.log_file, " for appending: ", std::strerror(err));
        std::fclose(f);
      }
      if (!claim) return;
      ckpt_lock = std::make_unique<dt::FolderLock>(
          cfg.ckpt_dir, "dt_train", cfg.ckpt_lock_wait_s,
          [](const std::string& line) {
            std::printf("dt_train: %s\n", line.c_str());
            std::fflush(stdout);
          },
          [&] {
            int asked = 0;  // a drain signal another rank got
            MPI_Iprobe(MPI_ANY_SOURCE, kTagDrain, claim_comm->handle(), &asked, MPI_STATUS_IGNORE);
            return dt::drain_requested() || asked != 0;
          });
      if (!ckpt_lock->stopped().empty()) {  // a drain signal ended the wait: see below
        std::printf("dt_train: %s: a drain signal came\n", ckpt_lock->stopped().c_str());
        ckpt_lock.reset();
        stopped = 1;
        return;
      }
      if (!ckpt_lock->warning().empty())
        std::fprintf(stderr, "dt_train: warning: %s\n", ckpt_lock->warning().c_str());
    };
    if (!phase([&] {
          if (rt.rank() == 0) {
            try {
              claim_folder();
            } catch (...) {  // the others wait to meet rank 0 however its part ends
              if (claim) meet();
              throw;
            }
          }
          if (claim) meet();
        }))
      return 2;
    // A drain signal while rank 0 waited for the folder: nothing new to save, so the run ends as
    // drained (exit 75: requeued, the next run resumes from the folder's checkpoints).
    rt.world().all_reduce(dt::view_of(&stopped, 1), dt::ReduceOp::max);
    if (stopped) {
      if (lead)
        std::printf("dt_train: drained before step 0 (nothing new saved), exit code %d\n",
                    dt::kExitDrained);
      return dt::kExitDrained;
    }
  }
  // Rank 0 alone writes the step log: one given on other nodes only would be ignored unsaid.
  int log_elsewhere = rt.rank() != 0 && !cfg.log_file.empty() ? 1 : 0;
  rt.world().all_reduce(dt::view_of(&log_elsewhere, 1), dt::ReduceOp::max);
  if (lead && log_elsewhere && cfg.log_file.empty())
    std::fprintf(stderr,
                 "dt_train: warning: --train.log-file is given on other ranks but not on rank 0, "
                 "which alone writes the step log: no step log is written\n");
  // A checkpoint of another model is refused before the device is opened and the model allocated (a
  // typo in its size would otherwise allocate that model first, on every rank).
  if (!phase([&] {
        if (rt.rank() == 0) dt::check_resume_model(cfg);
      }))
    return 2;
  const std::string plugin_path =
      cfg.plugin_path.empty() ? dt::default_plugin_path() : cfg.plugin_path;
  // Collectives of CUDA tensors go through NCCL, bootstrapped over MPI on the trainer's stream.
  dt::Trainer::DeviceCommFactory device_comm;
  if (!phase([&] {
        dev = std::make_unique<dt::Device>(dt::Device::open(
            cfg.device, plugin_path, static_cast<int>(cfg.device_index), cfg.local_rank));
        // A device without every kernel training needs is refused here, naming what it lacks.
        dt::require_training_kernels(*dev,
                                     cfg.dtype == "bf16"   ? dt::DType::bf16
                                     : cfg.dtype == "fp16" ? dt::DType::f16
                                                           : dt::DType::f32,
                                     cfg.cuda_graphs);
        if (!dev->host_memory() && dev->name() == "cuda") {
          // The communicator belongs to the installation: also looked for in its own folders
          // when --runtime.plugin-path names others (a vendor's plugins, say).
          const dt::NcclModule& nccl = dt::NcclModule::load(
              cfg.plugin_path.empty() ? plugin_path
                                      : plugin_path + ":" + dt::default_plugin_path());
          device_comm = [&nccl, &dev](dt::Comm& group, const std::string& name) {
            void* stream = nullptr;
            dev->call(&dt_hal_v2_t::native_stream, "native_stream", &stream);
            return nccl.create(group, dev->index(), stream, name);
          };
        }
      }))
    return 2;
  if (!phase([&] { dt::check_same_device_kind(rt.world(), *dev); })) return 2;
  if (!phase([&] {
        trainer = std::make_unique<dt::Trainer>(rt.world(), *dev, cfg, data, device_comm);
      }))
    return 2;
  if (cfg.print_plan) return phase([&] { trainer->print_plan(); }) ? 0 : 2;
  if (!phase([&] {
        if (trainer->resume_from_checkpoint().empty() && cfg.eval_only)
          throw dt::ConfigError(
              "option --eval-only: no checkpoint to evaluate in '" + cfg.ckpt_dir + "'", __FILE__,
              __LINE__);
      }))
    return 2;
  try {
    return trainer->run();
  } catch (const dt::SecurityError& e) {
    // A message failed authentication: no rank goes on (exit 5). First the metrics (the failure
    // counted), this rank's timeline and the other ranks'.
    trainer->publish_metrics();
    dt::trace::write_noexcept();
    dt::watchdog::collect_timelines("rank " + std::to_string(rt.rank()) +
                                    " rejected a sealed message");
    dt::security::abort_job(e);
  } catch (const dt::Error& e) {
    std::fprintf(stderr, "dt_train: rank %d: %s\n", rt.rank(), e.what());
    trainer->publish_metrics();
    dt::trace::write_noexcept();  // the timeline up to the failure, and the other ranks' too
    dt::watchdog::collect_timelines("rank " + std::to_string(rt.rank()) + " failed");
    rt.abort(3);
  } catch (const std::exception& e) {  // out of memory on one rank, say: the others must not wait
    std::fprintf(stderr, "dt_train: rank %d: %s\n", rt.rank(), e.what());
    trainer->publish_metrics();
    dt::trace::write_noexcept();
    dt::watchdog::collect_timelines("rank " + std::to_string(rt.rank()) + " failed");
    rt.abort(3);
  }
}
