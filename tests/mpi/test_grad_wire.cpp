// dt::GradBuckets with a bf16 wire (train.grad-reduce=bf16), on every rank count, over MPI and
// over shared memory with the gradients in the arena, on the CPU device and on a device whose
// memory faults on host access (test-plugins/libdt_hal_devmem.so, staged through the host).
//
// Each rank's gradient element is k + d: k a small nonzero integer that depends on the rank and
// the element, d a fraction far below half a bf16 ulp of k. Rounded to bf16 every value is k
// exactly, and every partial sum of the k is an integer below 256, so bf16 arithmetic is exact:
// after the reduction each element must be exactly the integer sum of the k over the ranks. An
// fp32 reduction leaves the sum of the d on top (so a wire that was not applied fails), and an
// element that was never widened back keeps its own k + d. Over MPI a recording communicator in
// between checks what travels: every all_reduce carries bf16, and the buckets' elements add up
// to the gradients' once per step (so rounding in place and reducing in fp32 fails too).
//
// With one rank per (simulated) node the buckets' waits over shared memory are MPI waits across
// nodes: a rank whose buckets wait 0.8 s for rank 0 must spend well under half of it on a CPU
// (the buckets' thread is SCHED_FIFO under a QoS tier, where a wait spinning inside MPI keeps the
// training thread of its core from running).
//
//   mpiexec -n N test_grad_wire TEST_PLUGIN_DIR
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "check_harness.hpp"
#include "comm/mpi_comm.hpp"
#include "comm/shm_comm.hpp"
#include "comm/staged_comm.hpp"
#include "dt/device.hpp"
#include "dt/gpt.hpp"
#include "engine/grad_buckets.hpp"

namespace {

using dt_test::H;
using dt_test::str;

// Passes everything to `inner`, recording the dtype and size of each all_reduce; the next `fail`
// all_reduces throw dt::CommError instead (on every rank alike: nothing travels).
class Recording final : public dt::Comm {
 public:
  explicit Recording(dt::Comm& inner) : inner_(inner) {}
  int rank() const noexcept override { return inner_.rank(); }
  int size() const noexcept override { return inner_.size(); }
  const std::string& name() const noexcept override { return inner_.name(); }
  dt::Work iall_reduce(dt::TensorView buf, dt::ReduceOp op) override {
    if (fail.load() > 0) {
      fail.fetch_sub(1);
      DT_THROW(dt::CommError, "injected failure of all_reduce on ", name());
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      seen_.push_back({buf.dtype, buf.numel});
    }
    return inner_.iall_reduce(buf, op);
  }
  std::atomic<int> fail{0};
  dt::Work ibroadcast(dt::TensorView buf, int root) override {
    return inner_.ibroadcast(buf, root);
  }
  dt::Work iall_gather(dt::ConstTensorView in, dt::TensorView out) override {
    return inner_.iall_gather(in, out);
  }
  dt::Work ireduce_scatter(dt::ConstTensorView in, dt::TensorView out, dt::ReduceOp op) override {
    return inner_.ireduce_scatter(in, out, op);
  }
  dt::Work ibarrier() override { return inner_.ibarrier(); }
  dt::Work isend(dt::ConstTensorView buf, int dst, int tag) override {
    return inner_.isend(buf, dst, tag);
  }
  dt::Work irecv(dt::TensorView buf, int src, int tag) override {
    return inner_.irecv(buf, src, tag);
  }
  std::unique_ptr<dt::Comm> split(int color, int key) override { return inner_.split(color, key); }
  /// What was all-reduced since the last call.
  std::vector<std::pair<dt::DType, std::size_t>> take() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(seen_, {});
  }

 private:
  dt::Comm& inner_;
  std::mutex mu_;
  std::vector<std::pair<dt::DType, std::size_t>> seen_;
};

int k_of(int rank, std::size_t i) {
  const int k = 1 + static_cast<int>((i * 7 + static_cast<std::size_t>(rank) * 5) % 20);
  return (i + static_cast<std::size_t>(rank)) % 3 == 0 ? -k : k;
}
float value_of(int rank, std::size_t i) {
  // |d| < 0.002, under half the bf16 ulp of any |k| >= 1 (2^-8 at 1).
  const float d = 0.0019f * static_cast<float>(static_cast<int>((i * 13 + 3) % 17) - 8) / 8.0f;
  return static_cast<float>(k_of(rank, i)) + (d == 0.0f ? 0.0015f : d);
}

// A parameter table of mixed sizes (several buckets at 4 KiB, one larger than a bucket).
std::vector<dt::ParamInfo> table() {
  std::vector<dt::ParamInfo> t;
  std::size_t off = 0;
  for (std::size_t n : {std::size_t{300}, std::size_t{7}, std::size_t{2500}, std::size_t{1},
                        std::size_t{1024}, std::size_t{999}}) {
    dt::ParamInfo p;
    p.name = "p" + std::to_string(t.size());
    p.shape = {static_cast<std::int64_t>(n)};
    p.offset = off;
    p.numel = n;
    t.push_back(p);
    off += n;
  }
  return t;
}

// grads: host-visible when `dev` is host memory, else a device pointer reached through copies.
// rec: when given, the recording communicator `comm` is.
void run(dt::Comm& comm, const dt::Device& dev, float* grads, const std::string& what,
         Recording* rec = nullptr) {
  const auto params = table();
  const std::size_t n = params.back().offset + params.back().numel;
  const int r = comm.rank(), p = comm.size();
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = value_of(r, i);
  auto put = [&] {
    dev.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(grads),
             static_cast<const void*>(host.data()), n * sizeof(float), DT_HAL_HOST_TO_DEVICE);
  };
  auto get = [&] {
    std::vector<float> out(n);
    dev.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(out.data()),
             static_cast<const void*>(grads), n * sizeof(float), DT_HAL_DEVICE_TO_HOST);
    return out;
  };
  auto expect_wire = [&](const std::string& label) {
    if (!rec) return;
    std::size_t total = 0, other = 0;
    for (const auto& [type, count] : rec->take()) {
      total += count;
      if (type != dt::DType::bf16) ++other;
    }
    H.expect(other == 0 && total == n, str(what, ": ", label, ": every all_reduce carries bf16"),
             str(other, " of them another dtype; ", total, " of ", n, " elements"));
  };
  auto expect_sums = [&](const std::vector<float>& got, const std::string& label) {
    expect_wire(label);
    std::size_t bad = 0, first = 0;
    for (std::size_t i = 0; i < n; ++i) {
      int want = 0;
      for (int q = 0; q < p; ++q) want += k_of(q, i);
      if (got[i] != static_cast<float>(want) && bad++ == 0) first = i;
    }
    H.expect(bad == 0, str(what, ": ", label),
             str(bad, " of ", n, " elements differ; first [", first, "] = ", got[first]));
  };
  dt::GradWire wire;
  wire.type = dt::DType::bf16;
  wire.dev = &dev;
  dt::GradBuckets buckets(comm, grads, params, 4096, wire);
  H.expect(buckets.plan().size() > 2, str(what, ": several buckets"), "");
  H.expect(buckets.wire_bytes() == n * 2, str(what, ": the 16-bit copy holds every gradient"),
           str(buckets.wire_bytes(), " bytes"));
  // Two steps: parameters reported in backward order in two halves, then all at once.
  put();
  buckets.ready(params.size() / 2, params.size());
  buckets.ready(0, params.size() / 2);
  buckets.finish(dt::Millis(120000));
  expect_sums(get(), "bf16 sums of every bucket, parameters ready in two halves");
  put();
  buckets.finish(dt::Millis(120000));  // finish queues whatever was not reported ready
  expect_sums(get(), "bf16 sums again in the next step, queued by finish");
  // The same reduction in fp32 keeps the fractions: the wire above did round.
  if (p > 1) {
    dt::GradBuckets plain(comm, grads, params, 4096);
    put();
    plain.finish(dt::Millis(120000));
    const std::vector<float> got = get();
    int want0 = 0;
    for (int q = 0; q < p; ++q) want0 += k_of(q, 0);
    H.expect(got[0] != static_cast<float>(want0),
             str(what, ": an fp32 reduction of the same values is not an integer"), str(got[0]));
  }
}

// A step whose first bucket fails throws from finish (that error), starts none of its other
// buckets (they would reduce into a step that is over), and the next step over the same buckets
// runs whole and gives the right sums: the failed step left nothing behind.
void check_failed_step(Recording& rec, float* grads, const std::string& what) {
  const auto& params = table();
  const std::size_t n = params.back().offset + params.back().numel;
  const int me = rec.rank(), p = rec.size();
  dt::GradBuckets buckets(rec, grads, params, 4096);
  H.expect(buckets.plan().size() > 2, str(what, ": several buckets to skip"), "");
  for (std::size_t i = 0; i < n; ++i) grads[i] = static_cast<float>(me + 1);
  rec.take();
  rec.fail = 1;
  buckets.ready(params.size() / 2, params.size());
  dt_test::expect_throw<dt::CommError>(str(what, ": finish of a step whose first bucket fails"),
                                       [&] { buckets.finish(dt::Millis(60000)); },
                                       {"injected failure"});
  std::size_t reduced = 0;
  for (const auto& [type, count] : rec.take()) reduced += count;
  H.expect(reduced == 0, str(what, ": no other bucket of the failed step is all-reduced"),
           str(reduced, " elements were"));
  for (std::size_t i = 0; i < n; ++i) grads[i] = static_cast<float>(me + 1);
  buckets.ready(params.size() / 2, params.size());
  buckets.ready(0, params.size() / 2);
  bool ok = true;
  try {
    buckets.finish(dt::Millis(60000));
  } catch (const std::exception& e) {
    ok = false;
    H.fail(str(what, ": the step after a failed one"), e.what());
  }
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += grads[i] != static_cast<float>(p * (p + 1) / 2);
  std::size_t total = 0;
  for (const auto& [type, count] : rec.take()) total += count;
  if (ok)
    H.expect(bad == 0 && total == n,
             str(what, ": the step after a failed one sums every bucket once"),
             str(bad, " of ", n, " wrong; ", total, " elements all-reduced"));
}

double process_cpu_s() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// The buckets of `comm` (gradients `grads` of the table) wait for rank 0, which starts 0.8 s
// late, giving their CPU away: their progress thread, on one CPU with a thread that spins there,
// gets well under half of what that thread gets (a progress thread that spins inside MPI gets
// about as much); the sums are right.
void check_idle_wait(dt::Comm& comm, float* grads, const std::string& what) {
  const auto& params = table();
  const std::size_t n = params.back().offset + params.back().numel;
  const int me = comm.rank(), p = comm.size();
  for (std::size_t i = 0; i < n; ++i) grads[i] = static_cast<float>(me + 1);
  // The progress thread starts with the buckets and inherits the pin of this thread.
  std::unique_ptr<dt_test::SharedCore> core;
  if (me != 0) core = std::make_unique<dt_test::SharedCore>();
  dt::GradBuckets buckets(comm, grads, params, 4096);
  comm.barrier();
  if (me == 0) std::this_thread::sleep_for(std::chrono::milliseconds(800));
  const double cpu0 = process_cpu_s(), spin0 = core ? core->spinner_cpu_s() : 0;
  const auto t0 = std::chrono::steady_clock::now();
  buckets.finish(dt::Millis(120000));
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double spin = core ? core->spinner_cpu_s() - spin0 : 0;
  const double cpu = process_cpu_s() - cpu0 - spin;  // the rest of the process: the buckets
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += grads[i] != static_cast<float>(p * (p + 1) / 2);
  H.expect(bad == 0, str(what, ": sums after a late rank"), str(bad, " of ", n, " wrong"));
  if (me == 0) return;
  H.expect(wall > 0.5, str(what, ": the buckets wait for rank 0"), str(wall, " s"));
  H.expect(cpu < 0.5 * spin, str(what, ": the buckets give their CPU away while they wait"),
           str(cpu, " s of CPU against ", spin, " s of a thread spinning on CPU ", core->cpu(),
               " in ", wall, " s of waiting"));
}

}  // namespace

int main(int argc, char** argv) {
  return dt_test::mpi_test_main(argc, argv, "grad_wire", 1, "TEST_PLUGIN_DIR", [](char** args) {
    const std::size_t n = table().back().offset + table().back().numel;
    const dt::Device cpu = dt::Device::open("cpu", "");
    {  // MPI, host memory, recording what travels
      auto world = dt::MpiComm::dup(MPI_COMM_WORLD, "world");
      Recording rec(*world);
      std::vector<float> g(n);
      run(rec, cpu, g.data(), "cpu, MPI", &rec);
      check_failed_step(rec, g.data(), "cpu, MPI");
    }
    {  // shared memory with the gradients in its arena (as dt_train places them)
      auto world = dt::MpiComm::dup(MPI_COMM_WORLD, "world");
      dt::ShmConfig sc;
      sc.arena_bytes = n * sizeof(float);
      auto shm = dt::ShmComm::create(*world, "grads", sc);
      run(*shm, cpu, static_cast<float*>(shm->arena()), "cpu, shared memory arena");
    }
    auto nodes = dt::MpiComm::dup(MPI_COMM_WORLD, "world");
    if (nodes->size() > 1) {  // one rank per simulated node: all_reduce crosses nodes by MPI
      dt::ShmConfig sc;
      sc.arena_bytes = n * sizeof(float);
      sc.simulated_nodes = nodes->size();
      auto shm = dt::ShmComm::create(*nodes, "grads-nodes", sc);
      H.expect(shm->path("all_reduce", 4096 * sizeof(float)) == std::string("hier"),
               "one rank per simulated node: all_reduce is hierarchical",
               shm->path("all_reduce", 4096 * sizeof(float)));
      check_idle_wait(*shm, static_cast<float*>(shm->arena()), "cpu, one rank per node");
    }
    {  // device memory: the cast runs on the device, the reduction is staged through the host
      const dt::Device dev = dt::Device::open("devmem", args[1]);
      dt::StagedComm staged(dev, dt::MpiComm::dup(MPI_COMM_WORLD, "staged-host"));
      dt::Device::Buffer g(dev, n * sizeof(float));
      run(staged, dev, g.as<float>(), "devmem, staged");
    }
    // A wire the buckets cannot carry is refused, naming it.
    bool refused = false;
    try {
      auto world = dt::MpiComm::dup(MPI_COMM_WORLD, "world");
      std::vector<float> g(n);
      dt::GradWire w;
      w.type = dt::DType::bf16;  // no device to cast on
      dt::GradBuckets b(*world, g.data(), table(), 4096, w);
    } catch (const dt::InvalidArgument& e) {
      refused = dt_test::contains(e.what(), "without a device");
    }
    H.expect(refused, "a bf16 wire without a device is refused", "");
  });
}
