// NcclComm on real ranks, one GPU each, made through libdt_nccl.so as dt_train makes it
// (dt::NcclModule): every collective against values computed on the host,
// point-to-point around a ring, split, stream order (a kernel-free check: a copy enqueued after
// the all_reduce on the same stream sees its result), and argument errors before any traffic.
// Without one GPU per local rank every rank exits 77 after rank 0 prints one SKIP line, once the
// module has loaded (it needs no GPU): a build or payload without a loadable libdt_nccl.so fails.
// The module is looked for in the build's lib/dt/plugins/ folder, then in $DT_PLUGIN_PATH and
// dt's default plugin path (next to libdt: where a payload or an installation holds it).
#include <cuda_runtime.h>
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "../mpi/check_harness.hpp"
#include "comm/mpi_comm.hpp"
#include "comm/nccl_module.hpp"
#include "dt/device.hpp"
#include "dt/error.hpp"

namespace {

template <class T>
struct DevVec {
  T* p = nullptr;
  std::size_t n = 0;
  explicit DevVec(std::size_t count) : n(count) {
    if (cudaMalloc(&p, std::max<std::size_t>(1, n) * sizeof(T)) != cudaSuccess)
      throw std::runtime_error("cudaMalloc failed");
  }
  ~DevVec() { cudaFree(p); }
  DevVec(const DevVec&) = delete;
  DevVec& operator=(const DevVec&) = delete;
  void put(const std::vector<T>& v) {
    cudaMemcpy(p, v.data(), n * sizeof(T), cudaMemcpyHostToDevice);
    // From pageable memory cudaMemcpy may return before the data lands, and NCCL's stream does
    // not wait for the legacy one.
    cudaDeviceSynchronize();
  }
  std::vector<T> get() const {
    std::vector<T> v(n);
    cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
  dt::TensorView view() { return {p, n, dt::dtype_v<T>}; }
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  const auto t0 = std::chrono::steady_clock::now();
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const char* env = std::getenv("DT_PLUGIN_PATH");
  const std::string plugin_path = std::string(DT_PLUGIN_DIR) +
                                  (env && *env ? ":" + std::string(env) : "") + ":" +
                                  dt::default_plugin_path();
  const dt::NcclModule* module = nullptr;
  try {
    module = &dt::NcclModule::load(plugin_path);
  } catch (const dt::Error& e) {
    std::fprintf(stderr, "FAIL nccl: rank %d: %s\n", rank, e.what());
    MPI_Finalize();
    return 1;
  }
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
  int local_rank = 0, local_size = 1;
  MPI_Comm_rank(local, &local_rank);
  MPI_Comm_size(local, &local_size);
  int gpus = 0;
  const cudaError_t ce = cudaGetDeviceCount(&gpus);
  if (ce != cudaSuccess) gpus = 0;
  int ok = gpus >= local_size ? 1 : 0, all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all_ok) {
    if (rank == 0)
      std::printf("SKIP nccl tests: %d ranks per node need one CUDA GPU each, found %d (%s)\n",
                  local_size, gpus, ce == cudaSuccess ? "ok" : cudaGetErrorString(ce));
    MPI_Comm_free(&local);
    MPI_Finalize();
    return 77;
  }
  dt_test::Harness h;
  h.rank = rank;
  h.prefix = "nccl";
  try {
    cudaSetDevice(local_rank);
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    auto world = dt::MpiComm::dup(MPI_COMM_WORLD, "world");
    auto nc = module->create(*world, local_rank, stream, "world-nccl");
    h.expect(nc->rank() == rank && nc->size() == size, "rank and size", "");
    const std::size_t n = 1 << 16;
    // all_reduce in every op, f32; sum in bf16 and i32.
    {
      std::vector<float> x(n);
      for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<float>((rank + 1) * (i % 7));
      DevVec<float> d(n);
      const float tri = static_cast<float>(size * (size + 1) / 2);
      for (auto [op, name] : {std::pair{dt::ReduceOp::sum, "sum"},
                              {dt::ReduceOp::avg, "avg"},
                              {dt::ReduceOp::max, "max"},
                              {dt::ReduceOp::min, "min"}}) {
        d.put(x);
        nc->all_reduce(d.view(), op);
        const auto got = d.get();
        std::size_t bad = 0;
        for (std::size_t i = 0; i < n; ++i) {
          const float k = static_cast<float>(i % 7);
          const float want = op == dt::ReduceOp::sum   ? tri * k
                             : op == dt::ReduceOp::avg ? tri * k / size
                             : op == dt::ReduceOp::max ? size * k
                                                       : k;
          if (got[i] != want) ++bad;
        }
        h.expect(bad == 0, std::string("all_reduce f32 ") + name, std::to_string(bad) + " wrong");
      }
      std::vector<std::int32_t> xi(n, rank + 1);
      DevVec<std::int32_t> di(n);
      di.put(xi);
      nc->all_reduce(di.view(), dt::ReduceOp::sum);
      h.expect(di.get()[n - 1] == size * (size + 1) / 2, "all_reduce i32 sum", "");
      std::vector<dt::bf16> xb(n, dt::bf16(1.0f));
      DevVec<dt::bf16> db(n);
      db.put(xb);
      nc->all_reduce(db.view(), dt::ReduceOp::sum);
      h.expect(static_cast<float>(db.get()[7]) == static_cast<float>(size), "all_reduce bf16 sum",
               "");
    }
    // Stream order: the all_reduce runs after the work its caller's stream held when it was
    // issued (a copy still queued behind a slow kernel's worth of copies), with no host wait.
    {
      DevVec<float> d(n), e(n), big(n * 64), big2(n * 64);
      d.put(std::vector<float>(n, 0.0f));
      e.put(std::vector<float>(n, 1.0f));
      for (int k = 0; k < 8; ++k)
        cudaMemcpyAsync(big2.p, big.p, n * 64 * sizeof(float), cudaMemcpyDeviceToDevice, stream);
      cudaMemcpyAsync(d.p, e.p, n * sizeof(float), cudaMemcpyDeviceToDevice, stream);
      dt::Work w = nc->iall_reduce(d.view(), dt::ReduceOp::sum);
      w.wait(dt::Millis(60000));
      h.expect(d.get()[n / 2] == static_cast<float>(size),
               "iall_reduce runs after the caller's stream's earlier work", "");
    }
    // Two communicators issued in opposite orders on different ranks (as the tensor-parallel
    // collectives of the training thread and the gradient buckets of the progress thread can
    // be) complete: each has its own stream. The order, not the thread, is what could hang.
    {
      auto other = nc->split(0, rank);
      DevVec<float> a(n), b(n);
      a.put(std::vector<float>(n, 1.0f));
      b.put(std::vector<float>(n, 2.0f));
      dt::Work wa, wb;
      if (rank % 2 == 0) {
        wa = nc->iall_reduce(a.view(), dt::ReduceOp::sum);
        wb = other->iall_reduce(b.view(), dt::ReduceOp::sum);
      } else {
        wb = other->iall_reduce(b.view(), dt::ReduceOp::sum);
        wa = nc->iall_reduce(a.view(), dt::ReduceOp::sum);
      }
      wa.wait(dt::Millis(60000));
      wb.wait(dt::Millis(60000));
      h.expect(a.get()[1] == static_cast<float>(size) && b.get()[1] == 2.0f * size,
               "two communicators issued in opposite orders on different ranks", "");
    }
    // broadcast, all_gather, reduce_scatter.
    {
      DevVec<float> d(n);
      d.put(std::vector<float>(n, static_cast<float>(rank == size - 1 ? 42 : rank)));
      nc->broadcast(d.view(), size - 1);
      h.expect(d.get()[3] == 42.0f, "broadcast from the last rank", "");
      const std::size_t m = 1000;
      DevVec<float> in(m), out(m * size);
      in.put(std::vector<float>(m, static_cast<float>(rank)));
      nc->all_gather(in.view(), out.view());
      const auto g = out.get();
      bool ok_ag = true;
      for (int r = 0; r < size; ++r) ok_ag = ok_ag && g[r * m + 5] == static_cast<float>(r);
      h.expect(ok_ag, "all_gather", "");
      DevVec<float> rin(m * size), rout(m);
      rin.put(std::vector<float>(m * size, 1.0f));
      nc->reduce_scatter(rin.view(), rout.view(), dt::ReduceOp::sum);
      h.expect(rout.get()[m - 1] == static_cast<float>(size), "reduce_scatter", "");
      // Mismatched sizes are refused before any traffic.
      bool threw = false;
      try {
        DevVec<float> bad(m * size + 1);
        nc->all_gather(in.view(), bad.view());
      } catch (const dt::InvalidArgument& e) {
        threw = std::string(e.what()).find("needs") != std::string::npos;
      }
      h.expect(threw, "all_gather with a wrong output size throws InvalidArgument", "");
    }
    // Ring send/recv.
    if (size > 1) {
      DevVec<float> s(256), r(256);
      s.put(std::vector<float>(256, static_cast<float>(rank)));
      const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
      // Each rank sends first, then receives: only works when both go to NCCL in one group.
      dt::Work ws = nc->isend(s.view(), next, 0);
      dt::Work wr = nc->irecv(r.view(), prev, 0);
      ws.wait(dt::Millis(60000));
      wr.wait(dt::Millis(60000));
      h.expect(r.get()[9] == static_cast<float>(prev), "ring send/recv", "");
      // Blocking send then receive on a ring would deadlock in any transport; the non-blocking
      // pair again after a collective, so the group is flushed by the collective's order.
      DevVec<float> r2(256);
      dt::Work ws2 = nc->isend(s.view(), next, 1);
      dt::Work wr2 = nc->irecv(r2.view(), prev, 1);
      nc->barrier();
      ws2.wait(dt::Millis(60000));
      wr2.wait(dt::Millis(60000));
      h.expect(r2.get()[9] == static_cast<float>(prev), "send/recv flushed by a collective", "");
    }
    nc->barrier();
    // split by parity.
    {
      auto sub = nc->split(rank % 2, rank);
      h.expect(sub != nullptr && sub->size() == (size + 1 - rank % 2) / 2, "split size", "");
      if (sub) {
        DevVec<float> d(16);
        d.put(std::vector<float>(16, 1.0f));
        sub->all_reduce(d.view(), dt::ReduceOp::sum);
        h.expect(d.get()[0] == static_cast<float>(sub->size()), "all_reduce on a split", "");
      }
      auto none = nc->split(-1, 0);
      h.expect(none == nullptr, "negative color gets nullptr", "");
    }
    nc.reset();
    cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    h.fail("exception", e.what());
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int rc = h.finish("nccl", s);
  MPI_Comm_free(&local);
  MPI_Finalize();
  return rc;
}
