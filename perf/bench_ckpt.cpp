// Checkpoint I/O: synchronous save, load (with verification) and the blocking time of an
// asynchronous save, for a state of SIZE_MIB MiB: held by every rank (LAYOUT replicated, the
// default: data-parallel replicas), or split by columns over the ranks (LAYOUT columns: each rank
// holds one strided piece of every tensor, as tensor-parallel shards).
//   mpiexec -n R bench_ckpt DIR [SIZE_MIB [LAYOUT]]
// Prints one line: "ranks R bytes B save_s S load_s L async_block_s A peak_rss_mib M held_mib H"
// (rank 0; M: the largest resident peak of any rank; H: the state one rank holds).
#include <mpi.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "dt/checkpoint.hpp"
#include "dt/runtime.hpp"

int main(int argc, char** argv) {
  dt::Runtime rt(&argc, &argv);
  if (argc < 2) {
    std::fprintf(stderr, "usage: bench_ckpt DIR [SIZE_MIB [replicated|columns]]\n");
    return 2;
  }
  const std::string dir = argv[1];
  const long mib = argc > 2 ? std::atol(argv[2]) : 1024;
  const std::string layout = argc > 3 ? argv[3] : "replicated";
  if (layout != "replicated" && layout != "columns") {
    std::fprintf(stderr, "bench_ckpt: layout '%s' is not replicated or columns\n", layout.c_str());
    return 2;
  }
  // 16 tensors of [rows, 4096] floats (the shape of large weight matrices).
  const std::int64_t cols = 4096;
  const std::int64_t rows = mib * 1024 * 1024 / 4 / cols / 16;
  const auto P = static_cast<std::size_t>(rt.size()), r = static_cast<std::size_t>(rt.rank());
  const std::size_t c0 = layout == "columns" ? cols * r / P : 0;
  const std::size_t c1 = layout == "columns" ? cols * (r + 1) / P : cols;
  std::vector<std::vector<float>> bufs(
      16, std::vector<float>(static_cast<std::size_t>(rows) * (c1 - c0)));
  std::vector<dt::CkptTensor> ts;
  for (int i = 0; i < 16; ++i) {
    for (std::size_t k = 0; k < bufs[i].size(); ++k)
      bufs[i][k] = static_cast<float>((k * 31 + i) % 1000) * 1e-3f;
    ts.push_back({"/model/w" + std::to_string(i), {rows, cols}, bufs[i].data()});
    if (layout == "columns")
      ts.back().pieces = {{c0, c1 - c0, static_cast<std::size_t>(cols),
                           static_cast<std::size_t>(rows), bufs[i].data()}};
  }
  auto now = [] { return std::chrono::steady_clock::now(); };
  auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  dt::CkptMeta meta;
  meta.step = 1;
  meta.layout = "dp=" + std::to_string(rt.size());
  rt.world().barrier();
  auto t0 = now();
  const auto st = dt::save_checkpoint(rt.world(), dir, ts, meta, 1);
  rt.world().barrier();
  const double save_s = secs(t0, now());
  if (rt.rank() == 0 && std::getenv("DT_BENCH_DROP_CACHES")) {
    std::FILE* f = std::fopen("/proc/sys/vm/drop_caches", "w");
    if (f) {
      std::fputs("3\n", f);
      std::fclose(f);
    }
  }
  rt.world().barrier();
  t0 = now();
  dt::load_checkpoint(rt.world(), st.path, ts);
  rt.world().barrier();
  const double load_s = secs(t0, now());
  // Asynchronous: the time the caller is blocked, then wait for the write to finish.
  meta.step = 2;
  dt::AsyncCheckpointer async(rt.world(), dir, 1);
  async.reserve(ts);  // as dt_train does at start-up
  rt.world().barrier();
  const double blocked = async.save(ts, meta);
  double block_max = blocked;
  MPI_Allreduce(MPI_IN_PLACE, &block_max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  async.wait();
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  long peak_kib = ru.ru_maxrss;
  MPI_Allreduce(MPI_IN_PLACE, &peak_kib, 1, MPI_LONG, MPI_MAX, MPI_COMM_WORLD);
  if (rt.rank() == 0)
    std::printf(
        "ranks %d bytes %llu save_s %.3f load_s %.3f async_block_s %.4f peak_rss_mib %ld "
        "held_mib %zu\n",
        rt.size(), static_cast<unsigned long long>(st.bytes), save_s, load_s, block_max,
        peak_kib / 1024, 16 * bufs[0].size() * sizeof(float) >> 20);
  return 0;
}
