// bench_seal: the cost of AES-256-GCM sealing in dt's tensor traffic, side by side in one run.
//
//   mpiexec -n 2 bench_seal [--iters N] [--window W] [--record-bytes B] [--segment-bytes S]
//                           [--shm-ring-bytes M] [--cases LIST]
// prints, on rank 0:
//   memcpy      one core copying 256 KiB (in cache) and 16 MiB (memory): what a transport's own
//               copy costs on this machine
//   seal/open   one core sealing, resp. opening in place, 256 KiB and 1 MiB in memory
//               (dt::security::Aead; the ceiling for sealed traffic on one core, as openssl speed)
//   reduce      one core adding two 8 MiB f32 buffers into one of them (memory): the reduction
//               of a 2-rank all_reduce of 16 MiB
//               memcpy, seal, open and reduce run on rank 0 while rank 1 waits in a barrier
//               (spinning, as MPI's waits do), so on a shared machine they get the share one of
//               two ranks gets
//   streamed    both ranks at once sealing W buffers of 16 MiB record by record into a ring of
//               the mailboxes' size, and opening a ring's records into them: what each side of a
//               16 MiB stream through the mailboxes can do while both cores stream memory (the
//               slower rank's figure)
//   p2p         rank 0 streams messages of 1/4/16 MiB to rank 1 (W in flight, W distinct buffers
//               on each side), over plain MPI point-to-point and over seal_p2p(MPI), the latter
//               twice: with same-node peers in shared-memory mailboxes ("shared memory"; on two
//               nodes there are none and it takes the transport too) and through the transport
//               alone (SealOptions::shm = false, "transport"): GB/s of payload
//   all_reduce  16 MiB of f32 (sum) over MPI_Allreduce (dt::MpiComm), over dt's sealed
//               communicator (again with and without the mailboxes), and over the same algorithm
//               with every peer unsealed: GB/s algorithm bandwidth (bytes / time)
// --aes auto|openssl|ipsec-mb picks the AES-GCM code of every seal and open (default auto; dt
// before security.aes has OpenSSL alone and takes no --aes).
// --cases picks some of local,p2p,all_reduce (default: all). Each figure is the median of --iters
// timed repetitions after one warm-up. The ranks may sit on
// one node or on two (srun): the unsealed dt communicator exempts every peer either way.
// The source also builds against dt before sealing had records (no SealOptions::record_bytes)
// or mailboxes (no SealOptions::shm; it then prints the transport figures only), so that a
// previous implementation can be measured in the same run.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "comm/mpi_comm.hpp"
#include "comm/reduce.hpp"
#include "dt/p2p.hpp"
#include "dt/security.hpp"

namespace {

namespace sec = dt::security;
using Clock = std::chrono::steady_clock;

#ifdef DT_SECURITY_HAS_AES_IMPL
sec::AesImpl g_aes = sec::AesImpl::automatic;
sec::Aead make_aead(const sec::Key& k, bool encrypt) {
  return sec::Aead(sec::SecretKey(k), encrypt, g_aes);
}
sec::Keys make_keys(const sec::Key& k) {
  return sec::Keys(sec::SecretKey(k), sec::slurm_job_id(), g_aes);
}
#else
sec::Aead make_aead(const sec::Key& k, bool encrypt) {
  return sec::Aead(sec::SecretKey(k), encrypt);
}
sec::Keys make_keys(const sec::Key& k) { return sec::Keys(sec::SecretKey(k), sec::slurm_job_id()); }
#endif

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class F>
double timed(int iters, dt::Comm& world, F&& f) {
  std::vector<double> t;
  for (int i = 0; i <= iters; ++i) {
    world.barrier();
    const auto t0 = Clock::now();
    f();
    world.barrier();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (i > 0) t.push_back(s);  // the first run warms up
  }
  return median(t);
}

// Median GB/s of `f` processing `bytes`, repeated until at least 64 MiB went through per sample.
template <class F>
double local_rate(std::size_t bytes, int iters, F&& f) {
  const int reps = static_cast<int>(std::max<std::size_t>(1, (std::size_t{64} << 20) / bytes));
  std::vector<double> t;
  for (int i = 0; i <= iters; ++i) {
    const auto t0 = Clock::now();
    for (int r = 0; r < reps; ++r) f(r);
    if (i > 0) t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return static_cast<double>(bytes) * reps / median(t) / 1e9;
}

double memcpy_rate(std::size_t bytes, int iters) {
  std::vector<std::uint8_t> a(bytes, 1), b(bytes, 2);
  return local_rate(bytes, iters, [&](int r) {
    std::memcpy(r % 2 ? a.data() : b.data(), r % 2 ? b.data() : a.data(), bytes);
  });
}

double reduce_rate(std::size_t bytes, int iters) {
  std::vector<float> a(bytes / sizeof(float), 1.0f), b(a.size(), 2.0f);
  return local_rate(bytes, iters, [&](int) {
    const void* in[2] = {a.data(), b.data()};
    dt::reduce_elements(dt::DType::f32, dt::ReduceOp::sum, a.data(), in, 2, a.size(), 1);
  });
}

double seal_rate(std::size_t bytes, int iters, bool open) {
  sec::Key k{};
  k.fill(7);
  sec::Aead enc = make_aead(k, true), dec = make_aead(k, false);
  std::vector<std::uint8_t> in(bytes, 1), out(bytes + 16);
  std::uint8_t nonce[12] = {0}, aad[56] = {0}, tag[16];
  enc.seal(nonce, aad, sizeof aad, in.data(), bytes, out.data(), tag);
  return local_rate(bytes, iters, [&](int) {
    if (open)  // fails authentication after the first pass (in place): same work either way
      (void)dec.open(nonce, aad, sizeof aad, out.data(), bytes, out.data(), tag);
    else
      enc.seal(nonce, aad, sizeof aad, in.data(), bytes, out.data(), tag);
  });
}

// GB/s of the slower of the two ranks, both at once sealing `window` buffers of `bytes` each
// record by record (256 KiB, as the mailboxes do) into a ring of `ring` bytes, or opening the
// ring's records into the buffers: what one side of a stream of such messages through the
// mailboxes can do when both cores stream memory, as they do then.
double streamed_rate(dt::Comm& world, std::size_t bytes, int window, std::size_t ring, int iters,
                     bool open) {
  constexpr std::size_t kRecord = std::size_t{256} << 10;
  sec::Key k{};
  k.fill(7);
  sec::Aead enc = make_aead(k, true), dec = make_aead(k, false);
  std::vector<std::vector<std::uint8_t>> bufs(static_cast<std::size_t>(window),
                                              std::vector<std::uint8_t>(bytes, 1));
  ring = std::max(ring, kRecord) / kRecord * kRecord;
  std::vector<std::uint8_t> slots(ring, 0);
  std::uint8_t nonce[12] = {0}, aad[56] = {0}, tag[16] = {0};
  const double t = timed(iters, world, [&] {
    std::size_t at = 0;
    for (auto& b : bufs)
      for (std::size_t off = 0; off < bytes; off += kRecord, at = (at + kRecord) % ring) {
        const std::size_t len = std::min(kRecord, bytes - off);
        if (open)  // fails authentication (never sealed under this nonce): the same work
          (void)dec.open(nonce, aad, sizeof aad, slots.data() + at, len, b.data() + off, tag);
        else
          enc.seal(nonce, aad, sizeof aad, b.data() + off, len, slots.data() + at, tag);
      }
  });
  double rate = static_cast<double>(bytes) * static_cast<double>(window) / t / 1e9;
  world.all_reduce(dt::view_of(&rate, 1), dt::ReduceOp::min);
  return rate;
}

// Rank 0 sends `msgs` messages to rank 1 with `window` in flight, from and into `bufs` in turn.
void stream(dt::P2p& p, std::vector<std::vector<float>>& bufs, int msgs) {
  const std::size_t window = bufs.size();
  std::vector<dt::Work> ws(window);
  for (int m = 0; m < msgs; ++m) {
    const std::size_t slot = static_cast<std::size_t>(m) % window;
    if (ws[slot].valid()) ws[slot].wait();
    const auto view = dt::view_of(bufs[slot]);
    ws[slot] = p.rank() == 0 ? p.isend(view, 1, 3) : p.irecv(view, 0, 3);
  }
  for (auto& w : ws)
    if (w.valid()) w.wait();
}

// SealOptions::record_bytes where it exists.
template <class O, class = void>
struct has_records : std::false_type {};
template <class O>
struct has_records<O, std::void_t<decltype(O::record_bytes)>> : std::true_type {};
template <class O>
void set_record_bytes(O& o, std::size_t b) {
  if constexpr (has_records<O>::value) {
    if (b > 0) o.record_bytes = b;
  }
}
// SealOptions::shm / SealedCommOptions::shm where they exist; false when they do not.
template <class O, class = void>
struct has_shm : std::false_type {};
template <class O>
struct has_shm<O, std::void_t<decltype(O::shm)>> : std::true_type {};
template <class O>
bool set_shm(O& o, bool on, std::size_t ring_bytes = 0) {
  if constexpr (has_shm<O>::value) {
    o.shm = on;
    if constexpr (std::is_same_v<O, sec::SealOptions>) {
      if (ring_bytes > 0) o.shm_ring_bytes = ring_bytes;
    }
    return true;
  } else {
    return !on;  // the transport only
  }
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int iters = 5, window = 4;
  std::size_t record_bytes = 0, segment_bytes = 0, ring_bytes = 0;
  std::string cases = "local,p2p,all_reduce";
  for (int i = 1; i + 1 < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--cases") cases = argv[i + 1];
    if (a == "--iters") iters = std::max(1, std::atoi(argv[i + 1]));
    if (a == "--window") window = std::max(1, std::atoi(argv[i + 1]));
    if (a == "--record-bytes") record_bytes = std::strtoull(argv[i + 1], nullptr, 10);
    if (a == "--segment-bytes") segment_bytes = std::strtoull(argv[i + 1], nullptr, 10);
    if (a == "--shm-ring-bytes") ring_bytes = std::strtoull(argv[i + 1], nullptr, 10);
#ifdef DT_SECURITY_HAS_AES_IMPL
    if (a == "--aes") g_aes = sec::parse_aes_impl(argv[i + 1], "--aes");
#endif
  }
  {
    auto world = dt::MpiComm::dup(MPI_COMM_WORLD, "world");
    const bool lead = world->rank() == 0;
    if (world->size() != 2) {
      if (lead) std::fprintf(stderr, "bench_seal: run with 2 ranks\n");
      MPI_Finalize();
      return 2;
    }
    sec::Key k{};
    k.fill(42);
    const sec::Keys keys = make_keys(k);
    auto want = [&](const char* c) {
      return ("," + cases + ",").find(std::string(",") + c + ",") != std::string::npos;
    };
#ifdef DT_SECURITY_HAS_AES_IMPL
    if (lead)
      std::printf("AES-256-GCM code: %s%s\n", sec::aes_impl_name(keys.aes()),
                  keys.aes() == sec::AesImpl::ipsec_mb
                      ? (", " + sec::ipsec_mb_arch() + " code").c_str()
                      : "");
#endif
    if (lead) std::printf("%-46s %8s\n", "case", "GB/s");
    if (lead && want("local")) {
      std::printf("memcpy 256 KiB (in cache, one core)            %8.2f\n",
                  memcpy_rate(256 << 10, iters));
      std::printf("memcpy  16 MiB (memory, one core)              %8.2f\n",
                  memcpy_rate(16 << 20, iters));
      for (std::size_t s : {std::size_t{256} << 10, std::size_t{1} << 20}) {
        std::printf("seal %4zu KiB (one core)                       %8.2f\n", s >> 10,
                    seal_rate(s, iters, false));
        std::printf("open %4zu KiB in place (one core)              %8.2f\n", s >> 10,
                    seal_rate(s, iters, true));
      }
      std::printf("reduce 8 MiB f32, two inputs (one core)        %8.2f\n",
                  reduce_rate(std::size_t{8} << 20, iters));
    }
    if (want("local")) {  // both ranks at once
      const std::size_t ring = ring_bytes > 0 ? ring_bytes : sec::SealOptions{}.shm_ring_bytes;
      const double s = streamed_rate(*world, std::size_t{16} << 20, window, ring, iters, false);
      const double o = streamed_rate(*world, std::size_t{16} << 20, window, ring, iters, true);
      if (lead) {
        std::printf("seal 16 MiB x %d streamed, both ranks (each)     %8.2f\n", window, s);
        std::printf("open 16 MiB x %d streamed, both ranks (each)     %8.2f\n", window, o);
      }
    }
    world->barrier();
    const std::size_t sizes[] = {std::size_t{1} << 20, std::size_t{4} << 20, std::size_t{16} << 20};
    // The sealed variants: through mailboxes where peers share a node, and the transport alone.
    struct Variant {
      const char* label;
      bool shm;
    };
    std::vector<Variant> variants;
    {
      sec::SealOptions o;
      if (set_shm(o, true)) variants.push_back({"shared memory", true});
      variants.push_back({"transport", false});
    }
    auto plain = dt::make_p2p("mpi", *world);
    std::vector<std::unique_ptr<dt::P2p>> sealed;
    for (const Variant& v : variants) {
      sec::SealOptions po;
      set_record_bytes(po, record_bytes);
      set_shm(po, v.shm, ring_bytes);
      sealed.push_back(sec::seal_p2p(dt::make_p2p("mpi", *world), keys, po));
    }
    for (std::size_t s : sizes) {
      if (!want("p2p")) break;
      const int msgs = static_cast<int>(std::max<std::size_t>(8, (std::size_t{256} << 20) / s));
      std::vector<std::vector<float>> bufs(static_cast<std::size_t>(window),
                                           std::vector<float>(s / sizeof(float), 1.0f));
      const double gb = static_cast<double>(s) * msgs / 1e9;
      const double tp = timed(iters, *world, [&] { stream(*plain, bufs, msgs); });
      if (lead)
        std::printf("p2p %5zu MiB plain MPI                         %8.2f\n", s >> 20, gb / tp);
      for (std::size_t v = 0; v < variants.size(); ++v) {
        const double ts = timed(iters, *world, [&] { stream(*sealed[v], bufs, msgs); });
        if (lead)
          std::printf("p2p %5zu MiB sealed, %-25s %8.2f  (%.0f%% of plain)\n", s >> 20,
                      variants[v].label, gb / ts, 100.0 * tp / ts);
      }
    }
    if (want("all_reduce")) {
      const std::size_t n = (std::size_t{16} << 20) / sizeof(float);
      std::vector<float> buf(n, 1.0f);
      std::vector<std::unique_ptr<dt::Comm>> scs;
      for (const Variant& v : variants) {
        sec::SealedCommOptions so;
        if (segment_bytes > 0) so.segment_bytes = segment_bytes;
        set_shm(so, v.shm);
        scs.push_back(sec::make_sealed_comm(*world, keys, so));
      }
      sec::SealedCommOptions xo;
      if (segment_bytes > 0) xo.segment_bytes = segment_bytes;
      xo.exempt_node_local = true;  // all ranks on one (simulated) node: every peer unsealed
      xo.simulated_nodes = 1;
      auto xc = sec::make_sealed_comm(*world, keys, xo);
      const double gb = static_cast<double>(n * sizeof(float)) / 1e9;
      const double tm =
          timed(iters, *world, [&] { world->all_reduce(dt::view_of(buf), dt::ReduceOp::sum); });
      const double tx =
          timed(iters, *world, [&] { xc->all_reduce(dt::view_of(buf), dt::ReduceOp::sum); });
      if (lead) {
        std::printf("all_reduce 16 MiB f32 MPI_Allreduce             %8.2f\n", gb / tm);
        std::printf("all_reduce 16 MiB f32 dt, unsealed              %8.2f\n", gb / tx);
      }
      for (std::size_t v = 0; v < variants.size(); ++v) {
        const double ts =
            timed(iters, *world, [&] { scs[v]->all_reduce(dt::view_of(buf), dt::ReduceOp::sum); });
        if (lead)
          std::printf(
              "all_reduce 16 MiB f32 dt sealed, %-14s %8.2f  (%.0f%% of MPI, %.0f%% of dt "
              "unsealed)\n",
              variants[v].label, gb / ts, 100.0 * tm / ts, 100.0 * tx / ts);
      }
    }
  }
  MPI_Finalize();
  return 0;
}
