// dt::StagedComm on a device whose memory faults on host access (test-plugins/libdt_hal_devmem.so):
// every collective and point-to-point operation, blocking and non-blocking, gives exactly what the
// host communicator gives on host copies of the same data, and never touches device memory from
// the host (that would kill the rank).
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "check_harness.hpp"
#include "comm/mpi_comm.hpp"
#include "comm/staged_comm.hpp"
#include "dt/device.hpp"

namespace {

using dt_test::H;
using dt_test::str;

struct Dev {
  const dt::Device& d;
  template <class T>
  dt::Device::Buffer up(const std::vector<T>& h) const {
    dt::Device::Buffer b(d, h.size() * sizeof(T));
    d.call(&dt_hal_v1_t::copy, "copy", b.get(), static_cast<const void*>(h.data()),
           h.size() * sizeof(T), DT_HAL_HOST_TO_DEVICE);
    return b;
  }
  template <class T>
  std::vector<T> down(const dt::Device::Buffer& b, std::size_t n) const {
    std::vector<T> h(n);
    d.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(h.data()),
           static_cast<const void*>(b.get()), n * sizeof(T), DT_HAL_DEVICE_TO_HOST);
    return h;
  }
};

// Bitwise equality (bf16 has no operator==).
template <class T>
bool same(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class T>
std::vector<T> values(std::size_t n, int rank, int salt) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<T>(static_cast<float>((i * 7 + rank * 13 + salt) % 23) * 0.25f - 2.0f);
  return v;
}

template <class T>
void run_all(dt::Comm& staged, dt::Comm& host, const Dev& dev, const std::string& tag) {
  const int r = host.rank(), p = host.size();
  const dt::DType t = dt::dtype_v<T>;
  for (std::size_t n : {std::size_t{1}, std::size_t{1000}, std::size_t{70001}}) {
    const std::string what = str(tag, " ", dt::dtype_name(t), " x ", n);
    {  // all_reduce, blocking and non-blocking
      for (dt::ReduceOp op : {dt::ReduceOp::sum, dt::ReduceOp::max}) {
        auto h = values<T>(n, r, 1);
        auto b = dev.up(h);
        host.all_reduce(dt::TensorView{h.data(), n, t}, op);
        staged.iall_reduce(dt::TensorView{b.get(), n, t}, op).wait();
        H.expect(same(dev.down<T>(b, n), h), what + " all_reduce " + dt::reduce_op_name(op),
                 "differs");
      }
    }
    {  // broadcast from the last rank
      auto h = values<T>(n, r, 2);
      auto b = dev.up(h);
      host.broadcast(dt::TensorView{h.data(), n, t}, p - 1);
      staged.broadcast(dt::TensorView{b.get(), n, t}, p - 1);
      H.expect(same(dev.down<T>(b, n), h), what + " broadcast", "differs");
    }
    {  // all_gather and reduce_scatter
      auto in = values<T>(n, r, 3);
      std::vector<T> out(n * p);
      auto bi = dev.up(in);
      dt::Device::Buffer bo(dev.d, n * p * sizeof(T));
      host.all_gather(dt::ConstTensorView{in.data(), n, t}, dt::TensorView{out.data(), n * p, t});
      staged.all_gather(dt::ConstTensorView{bi.get(), n, t}, dt::TensorView{bo.get(), n * p, t});
      H.expect(same(dev.down<T>(bo, n * p), out), what + " all_gather", "differs");
      auto big = values<T>(n * p, r, 4);
      std::vector<T> part(n);
      auto bb = dev.up(big);
      dt::Device::Buffer bp(dev.d, n * sizeof(T));
      host.reduce_scatter(dt::ConstTensorView{big.data(), n * p, t},
                          dt::TensorView{part.data(), n, t}, dt::ReduceOp::sum);
      staged
          .ireduce_scatter(dt::ConstTensorView{bb.get(), n * p, t}, dt::TensorView{bp.get(), n, t},
                           dt::ReduceOp::sum)
          .wait();
      H.expect(same(dev.down<T>(bp, n), part), what + " reduce_scatter", "differs");
    }
    if (p > 1) {  // a ring: every rank posts its receive and its send before waiting for either
      const int next = (r + 1) % p, prev = (r + p - 1) % p;
      auto mine = values<T>(n, r, 5);
      auto bs = dev.up(mine);
      dt::Device::Buffer br(dev.d, n * sizeof(T));
      dt::Work rw = staged.irecv(dt::TensorView{br.get(), n, t}, prev, 9);
      dt::Work sw = staged.isend(dt::ConstTensorView{bs.get(), n, t}, next, 9);
      sw.wait();
      rw.wait();
      H.expect(same(dev.down<T>(br, n), values<T>(n, prev, 5)), what + " isend/irecv ring",
               "differs");
      // Blocking, both directions with distinct tags.
      dt::Device::Buffer br2(dev.d, n * sizeof(T));
      if (r % 2 == 0) {
        staged.send(dt::ConstTensorView{bs.get(), n, t}, next, 10);
        staged.recv(dt::TensorView{br2.get(), n, t}, prev, 10);
      } else {
        staged.recv(dt::TensorView{br2.get(), n, t}, prev, 10);
        staged.send(dt::ConstTensorView{bs.get(), n, t}, next, 10);
      }
      H.expect(same(dev.down<T>(br2, n), values<T>(n, prev, 5)), what + " send/recv", "differs");
    }
    staged.barrier();
  }
}

// A collective that timed out on one rank stays pending in the host communicator and completes
// when the others arrive, into the staging buffer it was given: later collectives must not stage
// there. Rank 0 gives up on an all_reduce that the others join 0.5 s late; the all_reduces after it
// (the same size, then a larger one, which would free a reused buffer) give the right results.
void check_timed_out_staging(dt::StagedComm& c, dt::Comm& world, const Dev& dev) {
  const int r = world.rank(), p = world.size();
  const std::size_t n = 100000;
  const dt::CommOptions patient{dt::Millis(60000)};  // the same call form on every rank
  auto late = dev.up(values<float>(n, r, 100));
  world.barrier();
  if (r == 0) {
    dt_test::expect_throw<dt::CommError>("a staged all_reduce that times out on rank 0",
                                         [&] {
                                           c.all_reduce(
                                               dt::TensorView{late.get(), n, dt::DType::f32},
                                               dt::ReduceOp::sum, dt::CommOptions{dt::Millis(100)});
                                         },
                                         {"100 ms"});
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    c.all_reduce(dt::TensorView{late.get(), n, dt::DType::f32}, dt::ReduceOp::sum, patient);
  }
  for (const std::size_t m : {n, 3 * n}) {
    auto b = dev.up(values<float>(m, r, 200));
    c.all_reduce(dt::TensorView{b.get(), m, dt::DType::f32}, dt::ReduceOp::sum, patient);
    std::vector<float> want(m, 0.0f);
    for (int q = 0; q < p; ++q) {
      const auto v = values<float>(m, q, 200);
      for (std::size_t i = 0; i < m; ++i) want[i] += v[i];
    }
    H.expect(same(dev.down<float>(b, m), want),
             str("a staged all_reduce of ", m, " after one that timed out on rank 0"), "differs");
  }
}

}  // namespace

int main(int argc, char** argv) {
  return dt_test::mpi_test_main(argc, argv, "staged", 1, "TEST_PLUGIN_DIR", [](char** args) {
    const dt::Device d = dt::Device::open("devmem", args[1]);
    H.expect(!d.host_memory(), "devmem is device memory", "host_memory() is true");
    const Dev dev{d};
    auto world = dt::MpiComm::dup(MPI_COMM_WORLD, "world");
    dt::StagedComm staged(d, dt::MpiComm::dup(MPI_COMM_WORLD, "staged-host"));
    H.expect(staged.rank() == world->rank() && staged.size() == world->size(), "rank and size", "");
    run_all<float>(staged, *world, dev, "world");
    run_all<std::int32_t>(staged, *world, dev, "world");
    run_all<dt::bf16>(staged, *world, dev, "world");
    // A split communicator stays staged: odd and even ranks apart.
    auto sub = staged.split(world->rank() % 2, world->rank());
    auto hsub = world->split(world->rank() % 2, world->rank());
    H.expect(dynamic_cast<dt::StagedComm*>(sub.get()) != nullptr, "split of a StagedComm",
             "is not staged");
    run_all<float>(*sub, *hsub, dev, "split");
    if (world->size() > 1) check_timed_out_staging(staged, *world, dev);
    if (world->size() > 1) {
      // Point-to-point host copies are reused: rounds of a ring (a receive and a send in flight
      // at once) and of blocking exchanges allocate the first round's two buffers and no more.
      dt::StagedComm fresh(d, dt::MpiComm::dup(MPI_COMM_WORLD, "fresh-host"));
      const int r = world->rank(), p = world->size(), next = (r + 1) % p, prev = (r + p - 1) % p;
      const std::size_t n = 70001;
      bool all_same = true;
      for (int round = 0; round < 10; ++round) {
        auto bs = dev.up(values<float>(n, r, round));
        dt::Device::Buffer br(d, n * sizeof(float));
        {
          dt::Work rw = fresh.irecv(dt::TensorView{br.get(), n, dt::DType::f32}, prev, 11);
          dt::Work sw = fresh.isend(dt::ConstTensorView{bs.get(), n, dt::DType::f32}, next, 11);
          sw.wait();
          rw.wait();
        }
        all_same = all_same && same(dev.down<float>(br, n), values<float>(n, prev, round));
        if (r % 2 == 0) {
          fresh.send(dt::ConstTensorView{bs.get(), n, dt::DType::f32}, next, 12);
          fresh.recv(dt::TensorView{br.get(), n, dt::DType::f32}, prev, 12);
        } else {
          fresh.recv(dt::TensorView{br.get(), n, dt::DType::f32}, prev, 12);
          fresh.send(dt::ConstTensorView{bs.get(), n, dt::DType::f32}, next, 12);
        }
        all_same = all_same && same(dev.down<float>(br, n), values<float>(n, prev, round));
      }
      H.expect(all_same, "10 rounds of ring and blocking exchanges on reused host copies",
               "a message differs");
      H.expect(fresh.p2p().host_allocations() == 2, "host copies reused over 10 rounds",
               str(fresh.p2p().host_allocations(), " allocated, not 2"));
    }
  });
}
