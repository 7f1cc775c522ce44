// dt_bench: collective and point-to-point bandwidth of dt's transports, in the table format of
// nccl-tests.
//
//   mpiexec -n 2 ./dt_bench --ops=all_reduce --backends=mpi,shm,shm-copy --max-bytes=64M
//   mpiexec -n 2 ./dt_bench --grad-set=configs/gpt-tiny.ini --backends=mpi,shm
//
// Backends: mpi (dt::MpiComm), shm (dt::ShmComm with the buffers in its arena, as dt's gradient
// buckets use it), shm-copy (dt::ShmComm with ordinary buffers, through its staging area), ucx
// (dt::UcxP2p; sendrecv only). For every size the backends run one after the other, so that
// machine noise hits them alike.
//
// Figures follow nccl-tests: time is the average of `iters` back-to-back calls after `warmup`
// calls (no barrier inside the timed loop), the maximum over ranks; algbw = size / time;
// busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter), 1 (broadcast,
// sendrecv). With --check every call of every iteration (warm-up included) gets fresh inputs from a
// hash of (rank, index, iteration), small integers whose sums are exact in every dtype, and every
// output element is compared with an independently computed value; #wrong counts the wrong
// elements over all ranks and iterations. With --check the time sums each call's own duration
// (inputs are written and results verified outside the clock).
//
// --grad-set=INI: all-reduce of the gradient set of the GPT model described by the [model] section
// of INI (dt::gpt_params), one call per tensor in reverse parameter order against buckets of
// --grad-set.bucket-mb MiB (contiguous ranges of the flat gradient buffer in reverse parameter
// order), per backend, with the speed-up of the bucketed form.
//
// Exit codes: 0 good, 1 a wrong result (--check), 2 bad options, 3 a rank hit an error.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "comm/mpi_comm.hpp"
#include "comm/shm_comm.hpp"
#include "comm/ucx_p2p.hpp"
#include "dt/comm.hpp"
#include "dt/config.hpp"
#include "dt/gpt.hpp"
#include "dt/runtime.hpp"
#include "dt/train.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using dt::ConfigError;
using dt::DType;
using dt::ReduceOp;

enum class Op { all_reduce, all_gather, reduce_scatter, broadcast, sendrecv };
enum class Backend { mpi, shm, shm_copy, ucx };

constexpr Op kOps[] = {Op::all_reduce, Op::all_gather, Op::reduce_scatter, Op::broadcast,
                       Op::sendrecv};
constexpr Backend kBackends[] = {Backend::mpi, Backend::shm, Backend::shm_copy, Backend::ucx};

const char* op_name(Op o) {
  switch (o) {
    case Op::all_reduce:
      return "all_reduce";
    case Op::all_gather:
      return "all_gather";
    case Op::reduce_scatter:
      return "reduce_scatter";
    case Op::broadcast:
      return "broadcast";
    case Op::sendrecv:
      return "sendrecv";
  }
  return "?";
}

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::mpi:
      return "mpi";
    case Backend::shm:
      return "shm";
    case Backend::shm_copy:
      return "shm-copy";
    case Backend::ucx:
      return "ucx";
  }
  return "?";
}

// The operations measured when --ops is not given.
constexpr const char* kDefaultOps = "all_reduce,all_gather,reduce_scatter,broadcast,sendrecv";

struct Settings {
  std::string ops, backends, min_bytes_s, max_bytes_s, dtype_s, op_s;
  std::string shm_chunk_s, shm_staging_s, shm_min_s, grad_set;
  long step_factor = 2, iters = 20, warmup = 5, root = 0, corrupt_rank = -1;
  long simulated_nodes = 0;
  double bucket_mb = 25;
  bool check = false;
  // parsed
  std::vector<Op> op_list;
  std::vector<Backend> backend_list;
  std::size_t min_bytes = 0, max_bytes = 0, shm_chunk = 0, shm_staging = 0, shm_min = 0;
  DType dtype = DType::f32;
  ReduceOp rop = ReduceOp::sum;
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream is(s);
  while (std::getline(is, cur, ','))
    if (!cur.empty()) out.push_back(cur);
  return out;
}

// A size option: dt::parse_size, at most 16G.
std::size_t parse_size(const std::string& option, const std::string& text) {
  const std::uint64_t v = dt::parse_size(option, text);
  DT_CHECK(ConfigError, v <= (std::uint64_t{16} << 30), "option --", option, ": ", text,
           " is above the maximum of 16G");
  return static_cast<std::size_t>(v);
}

void parse_settings(Settings& s, bool ops_given) {
  for (const auto& o : split_list(s.ops)) {
    auto it = std::find_if(std::begin(kOps), std::end(kOps), [&](Op x) { return o == op_name(x); });
    DT_CHECK(ConfigError, it != std::end(kOps), "option --ops: '", o,
             "' is not one of all_reduce, all_gather, reduce_scatter, broadcast, sendrecv");
    if (std::find(s.op_list.begin(), s.op_list.end(), *it) == s.op_list.end())
      s.op_list.push_back(*it);
  }
  DT_CHECK(ConfigError, !s.op_list.empty(), "option --ops: no operation given");
  for (const auto& b : split_list(s.backends)) {
    auto it = std::find_if(std::begin(kBackends), std::end(kBackends),
                           [&](Backend x) { return b == backend_name(x); });
    DT_CHECK(ConfigError, it != std::end(kBackends), "option --backends: '", b,
             "' is not one of mpi, shm, shm-copy, ucx");
    if (std::find(s.backend_list.begin(), s.backend_list.end(), *it) == s.backend_list.end())
      s.backend_list.push_back(*it);
  }
  DT_CHECK(ConfigError, !s.backend_list.empty(), "option --backends: no backend given");
  // ucx is point-to-point: a collective named in --ops (or the gradient set's all_reduce) that no
  // other backend runs would measure nothing. --ops not given keeps what the backends run.
  const bool only_ucx = s.backend_list == std::vector<Backend>{Backend::ucx};
  if (only_ucx && !s.grad_set.empty())
    DT_THROW(ConfigError, "option --backends: ucx is point-to-point only, and --grad-set ",
             "measures all_reduce: choose mpi, shm or shm-copy");
  if (only_ucx) {
    std::vector<Op> kept;
    std::string refused;
    for (Op o : s.op_list) {
      if (o == Op::sendrecv)
        kept.push_back(o);
      else
        refused += std::string(refused.empty() ? "" : ", ") + op_name(o);
    }
    DT_CHECK(ConfigError, refused.empty() || !ops_given, "option --ops: ", refused,
             " cannot run on --backends=ucx (UCX is point-to-point only: sendrecv); add mpi, shm "
             "or shm-copy to --backends, or leave ",
             refused, " out of --ops");
    s.op_list = kept;
  }
  s.min_bytes = parse_size("min-bytes", s.min_bytes_s);
  s.max_bytes = parse_size("max-bytes", s.max_bytes_s);
  DT_CHECK(ConfigError, s.min_bytes <= s.max_bytes, "option --min-bytes: ", s.min_bytes_s,
           " is larger than --max-bytes=", s.max_bytes_s);
  s.shm_chunk = parse_size("shm.chunk-bytes", s.shm_chunk_s);
  DT_CHECK(ConfigError, s.shm_chunk >= 1, "option --shm.chunk-bytes: must be at least 1");
  s.shm_staging = parse_size("shm.staging-bytes", s.shm_staging_s);
  DT_CHECK(ConfigError, s.shm_staging >= 64, "option --shm.staging-bytes: ", s.shm_staging_s,
           " is below the minimum of 64");
  s.shm_min = parse_size("shm.min-bytes", s.shm_min_s);
  s.dtype = dt::parse_dtype(s.dtype_s);  // the choice list has already checked the name
  s.rop = s.op_s == "sum"   ? ReduceOp::sum
          : s.op_s == "avg" ? ReduceOp::avg
          : s.op_s == "max" ? ReduceOp::max
                            : ReduceOp::min;
}

// --- reference values --------------------------------------------------------------------------

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Integers exact in `t`; for a reduction (`sums`), such that their sum over `nranks` ranks is
// exact too (partial sums included): each contributing rank's within limit / contributors, and
// with more ranks than the limit allows one each, every stride-th rank contributes (the others
// give 0), so that no value range shrinks to nothing.
class Values {
 public:
  Values(DType t, int nranks, bool sums) {
    long limit = 1L << 16;
    if (t == DType::u8) limit = 255;
    if (t == DType::bf16) limit = 256;
    if (t == DType::f16) limit = 2048;
    const long n = std::max(1, nranks);
    if (sums) stride_ = static_cast<int>((n + limit - 1) / limit);
    const long contributors = sums ? (n + stride_ - 1) / stride_ : 1;
    const long m = limit / contributors;
    hi_ = m;
    lo_ = t == DType::u8 ? 0 : -m;
  }
  // `salt` separates inputs (0) from the filler written into outputs before a call (1).
  long operator()(int rank, std::size_t i, long iter, unsigned salt = 0) const {
    if (salt == 0 && rank % stride_ != 0) return 0;
    const std::uint64_t h = mix(mix(mix((static_cast<std::uint64_t>(rank) << 8) ^ salt) ^
                                    static_cast<std::uint64_t>(iter)) ^
                                i);
    return lo_ + static_cast<long>(h % static_cast<std::uint64_t>(hi_ - lo_ + 1));
  }

 private:
  long lo_ = 0, hi_ = 0;
  int stride_ = 1;
};

bool sums(Op op) { return op == Op::all_reduce || op == Op::reduce_scatter; }

template <class T>
T make(double x) {
  if constexpr (std::is_same_v<T, dt::bf16> || std::is_same_v<T, dt::f16>)
    return T(static_cast<float>(x));
  else
    return static_cast<T>(x);
}

template <class T>
double to_d(T v) {
  if constexpr (std::is_same_v<T, dt::bf16> || std::is_same_v<T, dt::f16>)
    return static_cast<double>(static_cast<float>(v));
  else
    return static_cast<double>(v);
}

// op over ranks 0..n-1 of v(r), as comm.hpp defines it (avg: exact sum, one division).
template <class T, class V>
T reduce_ref(ReduceOp op, int n, V v) {
  long acc = v(0);
  for (int r = 1; r < n; ++r) {
    const long x = v(r);
    acc = op == ReduceOp::max ? std::max(acc, x) : op == ReduceOp::min ? std::min(acc, x) : acc + x;
  }
  if (op != ReduceOp::avg) return make<T>(static_cast<double>(acc));
  if constexpr (std::is_integral_v<T>)
    return static_cast<T>(acc / n);
  else if constexpr (std::is_same_v<T, double>)
    return static_cast<double>(acc) / static_cast<double>(n);
  else
    return make<T>(static_cast<float>(acc) / static_cast<float>(n));
}

// --- buffers -----------------------------------------------------------------------------------

std::size_t round_up(std::size_t v, std::size_t a) { return (v + a - 1) / a * a; }

// Element counts and buffer layout of one call of `op` at nominal `bytes`, as nccl-tests counts
// them: `size` is the larger of the send and receive bytes, `count` the per-rank parameter count.
// Counts are rounded down to whole elements (all_gather, reduce_scatter: whole elements per
// rank), or up with `up`.
struct Shape {
  std::size_t in = 0, out = 0;  // elements
  bool in_place = false;
  std::size_t size_bytes = 0, count = 0;
  std::size_t out_off = 0, total = 0;  // byte layout in one buffer (in at 0)
  double bus_factor = 1;
};

Shape shape_of(Op op, std::size_t bytes, std::size_t es, int n, bool up = false) {
  Shape s;
  const std::size_t un = static_cast<std::size_t>(n);
  const bool per_rank = op == Op::all_gather || op == Op::reduce_scatter;
  const std::size_t unit = per_rank ? es * un : es;
  const std::size_t c = (up ? bytes + unit - 1 : bytes) / unit;  // per rank when per_rank
  switch (op) {
    case Op::all_reduce:
    case Op::broadcast:
      s.in = s.out = c;
      s.in_place = true;
      s.size_bytes = c * es;
      s.count = c;
      s.bus_factor = op == Op::all_reduce ? 2.0 * (n - 1) / n : 1.0;
      break;
    case Op::all_gather:
      s.in = c;
      s.out = s.in * un;
      s.size_bytes = s.out * es;
      s.count = s.in;
      s.bus_factor = static_cast<double>(n - 1) / n;
      break;
    case Op::reduce_scatter:
      s.out = c;
      s.in = s.out * un;
      s.size_bytes = s.in * es;
      s.count = s.out;
      s.bus_factor = static_cast<double>(n - 1) / n;
      break;
    case Op::sendrecv:
      s.in = s.out = c;
      s.size_bytes = c * es;
      s.count = c;
      s.bus_factor = 1.0;
      break;
  }
  s.out_off = s.in_place ? 0 : round_up(s.in * es, 64);
  s.total = s.in_place ? s.in * es : s.out_off + s.out * es;
  return s;
}

// The shape measured at sweep size `bytes`: rounded down to whole elements, unless that falls
// below --min-bytes (3 bytes of f32 would be 0): then the smallest whole count at or above it,
// which smallest_over_max() keeps within --max-bytes.
Shape measured_shape(Op op, std::size_t bytes, std::size_t es, int n, std::size_t min_bytes) {
  const Shape down = shape_of(op, bytes, es, n);
  return down.size_bytes >= min_bytes ? down : shape_of(op, bytes, es, n, true);
}

// The first of the operations of `s` for which no whole count lies between --min-bytes and
// --max-bytes on `n` ranks (all_gather and reduce_scatter count per rank), with the smallest size
// it could measure: so that no size measured passes --max-bytes. {"", 0} when each has one.
std::pair<std::string, std::size_t> smallest_over_max(const Settings& s, int n) {
  const std::size_t es = dt::dtype_size(s.dtype);
  for (Op op : s.op_list) {
    const std::size_t least = shape_of(op, s.min_bytes, es, n, true).size_bytes;
    if (least > s.max_bytes) return {op_name(op), least};
  }
  return {"", 0};
}

std::vector<std::size_t> sizes_of(const Settings& s) {
  std::vector<std::size_t> v;
  for (std::size_t b = s.min_bytes;;) {
    v.push_back(b);
    if (b >= s.max_bytes) break;
    const std::size_t next = b == 0 ? 1 : b * static_cast<std::size_t>(s.step_factor);
    b = std::min(next, s.max_bytes);
  }
  return v;
}

// The gradient set of --grad-set: parameter table, flat size and buckets. Read before MPI starts.
struct GradSet {
  std::vector<dt::ParamInfo> params;
  std::size_t numel = 0;
  std::vector<std::pair<std::size_t, std::size_t>> buckets;  // (offset, elements)
};

GradSet load_grad_set(const std::string& path, double bucket_mb, std::size_t es) {
  GradSet g;
  // The file is read as dt_train reads its config (a config of dt_train's serves as it is):
  // unknown keys and sections, repeated keys and values out of range are refused alike.
  dt::TrainConfig tc;
  dt::Options o("dt_bench --grad-set", "the model of a gradient set");
  dt::add_train_options(o, tc);
  const std::string arg = "--config=" + path;
  const char* argv[] = {"dt_bench", arg.c_str()};
  try {
    o.parse(2, argv);
    DT_CHECK(ConfigError, tc.model.embd % tc.model.heads == 0, "model.heads: ", tc.model.heads,
             " does not divide model.embd=", tc.model.embd);
  } catch (const dt::ConfigError& e) {
    DT_THROW(ConfigError, "option --grad-set: ", path, ": ", e.message());
  }
  dt::GptConfig c = tc.model;
  if (c.vocab == 0) c.vocab = 256;  // byte tokens, as dt_train reads plain text
  g.params = dt::gpt_params(c);
  for (const auto& p : g.params) g.numel = std::max(g.numel, p.offset + p.numel);
  // One buffer of the set (two with the shared-memory arena): refused where a node cannot hold
  // it, instead of failing to allocate it.
  const double bytes = static_cast<double>(g.numel) * static_cast<double>(es);
  const double memory =
      static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  DT_CHECK(ConfigError, memory <= 0 || 2 * bytes <= memory, "option --grad-set: ", path,
           ": the model's gradients take ", bytes / (1 << 30), " GiB, and this node has ",
           memory / (1 << 30), " GiB of memory for them and their copy");
  // Buckets: reverse parameter order, closed before they would exceed the bucket size.
  const std::size_t cap =
      std::max<std::size_t>(1, static_cast<std::size_t>(bucket_mb * (1 << 20)) / es);
  std::size_t hi = g.numel, lo = g.numel;
  for (auto it = g.params.rbegin(); it != g.params.rend(); ++it) {
    if (hi > lo && hi - it->offset > cap) {
      g.buckets.emplace_back(lo, hi - lo);
      hi = lo;
    }
    lo = it->offset;
  }
  if (hi > lo) g.buckets.emplace_back(lo, hi - lo);
  return g;
}

// One rank's view of a benchmark run.
class Bench {
 public:
  Bench(dt::Runtime& rt, const Settings& s, GradSet g) : s_(s), g_(std::move(g)) {
    world_ = &dynamic_cast<dt::MpiComm&>(rt.world());
    n_ = world_->size();
    me_ = world_->rank();
    es_ = dt::dtype_size(s.dtype);
  }

  int run() {
    setup();
    if (!s_.grad_set.empty())
      run_grad_set();
    else
      run_ops();
    return finish();
  }

 private:
  bool wants(Backend b) const {
    return std::find(s_.backend_list.begin(), s_.backend_list.end(), b) != s_.backend_list.end();
  }
  bool wants(Op o) const {
    return std::find(s_.op_list.begin(), s_.op_list.end(), o) != s_.op_list.end();
  }

  std::size_t buffer_bytes() const {
    if (!s_.grad_set.empty()) return g_.numel * es_;
    std::size_t need = 0;
    for (Op o : s_.op_list)
      for (std::size_t bytes : sizes_of(s_))
        need = std::max(need, measured_shape(o, bytes, es_, n_, s_.min_bytes).total);
    return need;
  }

  void setup() {
    const std::size_t bytes = std::max<std::size_t>(buffer_bytes(), 64);
    user_ = dt::Tensor({static_cast<std::int64_t>(bytes)}, DType::u8);
    if (wants(Backend::shm) || wants(Backend::shm_copy)) {
      dt::ShmConfig cfg;
      cfg.arena_bytes = wants(Backend::shm) ? bytes : 0;
      cfg.chunk_bytes = s_.shm_chunk;
      cfg.staging_bytes = s_.shm_staging;
      cfg.min_bytes = s_.shm_min;
      cfg.simulated_nodes = static_cast<int>(s_.simulated_nodes);
      shm_ = dt::ShmComm::create(*world_, "bench-shm", cfg);
    }
    if (wants(Backend::ucx) && s_.grad_set.empty() && wants(Op::sendrecv))
      ucx_ = dt::UcxP2p::create(world_->handle(), "bench-ucx");
    print_header();
  }

  void print_header() {
    if (me_ != 0) return;
    std::printf(
        "# dt_bench: %d rank%s, dtype %s, op %s, root %ld, iters %ld, warmup %ld, check %s\n", n_,
        n_ == 1 ? "" : "s", dt::dtype_name(s_.dtype), dt::reduce_op_name(s_.rop), s_.root, s_.iters,
        s_.warmup, s_.check ? "on" : "off");
    std::printf("# backends:");
    for (Backend b : s_.backend_list) {
      const char* what = b == Backend::mpi        ? "dt::MpiComm"
                         : b == Backend::shm      ? "dt::ShmComm, buffers in its arena"
                         : b == Backend::shm_copy ? "dt::ShmComm, user buffers via staging"
                                                  : "dt::UcxP2p, point-to-point only";
      std::printf(" %s (%s);", backend_name(b), what);
    }
    std::printf("\n");
    if (shm_) {
      char ranks[96];
      if (shm_->min_local_size() == shm_->max_local_size())
        std::snprintf(ranks, sizeof ranks, "%d node(s) x %d local ranks", shm_->num_nodes(),
                      shm_->max_local_size());
      else
        std::snprintf(ranks, sizeof ranks,
                      "%d node(s) of %d to %d local ranks (uneven: MPI across nodes)",
                      shm_->num_nodes(), shm_->min_local_size(), shm_->max_local_size());
      std::printf("# shm: %s%s, chunk %zu B, staging %zu B, min %zu B, arena %zu B per rank\n",
                  ranks, s_.simulated_nodes > 0 ? " (simulated)" : "", s_.shm_chunk, s_.shm_staging,
                  s_.shm_min, shm_->arena_bytes());
    }
    if (shm_ && s_.grad_set.empty())
      std::printf(
          "# shm: only all_reduce reads arena buffers in place; all_gather, reduce_scatter and "
          "broadcast copy through the staging area on shm and shm-copy alike, sendrecv is MPI's\n");
    std::printf(
        "# time: max over ranks of the mean of %ld back-to-back calls after %ld warm-up calls%s\n",
        s_.iters, s_.warmup,
        s_.check ? " (with --check: sum of each call's own time; inputs and checks off the clock)"
                 : " (no barrier in the loop)");
    std::printf(
        "# path: what each call took: shm, hier (shm inside nodes, MPI across), mpi, ucx\n");
    std::fflush(stdout);
  }

  // --- one benchmark cell --------------------------------------------------------------------

  // Pointers for `backend`: in the shm arena for "shm", in ordinary memory otherwise.
  char* base(Backend b) const {
    return b == Backend::shm ? static_cast<char*>(shm_->arena())
                             : static_cast<char*>(const_cast<void*>(user_.raw()));
  }

  const char* path_of(Backend b, Op op, const Shape& sh) const {
    if (b == Backend::mpi) return "mpi";
    if (b == Backend::ucx) return "ucx";
    switch (op) {
      case Op::all_reduce:
      case Op::broadcast:
        return shm_->path(op_name(op), sh.in * es_);
      case Op::all_gather:
        return shm_->path(op_name(op), sh.in * es_);
      case Op::reduce_scatter:
        // ShmComm sends reduce_scatter to MPI when one element per rank does not fit its staging.
        if (s_.shm_staging / (es_ * static_cast<std::size_t>(shm_->local_size())) == 0)
          return "mpi";
        return shm_->path(op_name(op), sh.out * es_);
      case Op::sendrecv:
        return "mpi";  // ShmComm's point-to-point is MPI's
    }
    return "?";
  }

  dt::Comm& comm(Backend b) {
    if (b == Backend::mpi) return *world_;
    return *shm_;
  }

  // The call being measured.
  std::function<void()> call_of(Backend b, Op op, dt::TensorView in, dt::TensorView out) {
    const int next = (me_ + 1) % n_, prev = (me_ + n_ - 1) % n_;
    if (op == Op::sendrecv) {
      dt::P2p* p = b == Backend::ucx ? static_cast<dt::P2p*>(ucx_.get()) : &comm(b);
      return [=] {
        dt::Work r = p->irecv(out, prev, 7);
        dt::Work w = p->isend(in, next, 7);
        w.wait();
        r.wait();
      };
    }
    dt::Comm* c = &comm(b);
    const ReduceOp rop = s_.rop;
    const int root = static_cast<int>(s_.root);
    switch (op) {
      case Op::all_reduce:
        return [=] { c->all_reduce(in, rop); };
      case Op::broadcast:
        return [=] { c->broadcast(in, root); };
      case Op::all_gather:
        return [=] { c->all_gather(in, out); };
      case Op::reduce_scatter:
        return [=] { c->reduce_scatter(in, out, rop); };
      case Op::sendrecv:
        break;
    }
    return [] {};
  }

  // Writes this iteration's inputs (and a filler into separate outputs).
  template <class T>
  void fill(Op op, const Shape& sh, T* in, T* out, long it) const {
    const Values v(s_.dtype, n_, sums(op));
    const bool bcast_receiver = op == Op::broadcast && me_ != s_.root;
    for (std::size_t i = 0; i < sh.in; ++i)
      in[i] = make<T>(static_cast<double>(v(me_, i, it, bcast_receiver ? 1 : 0)));
    if (!sh.in_place)
      for (std::size_t i = 0; i < sh.out; ++i)
        out[i] = make<T>(static_cast<double>(v(me_, i, it, 1)));
  }

  // Wrong output elements of this rank for iteration `it`.
  template <class T>
  long verify(Op op, const Shape& sh, const T* out, long it) const {
    const Values v(s_.dtype, n_, sums(op));
    const int n = n_;
    long wrong = 0;
    auto cmp = [&](std::size_t i, T want) {
      if (to_d(out[i]) != to_d(want)) ++wrong;
    };
    switch (op) {
      case Op::all_reduce:
        for (std::size_t i = 0; i < sh.out; ++i)
          cmp(i, reduce_ref<T>(s_.rop, n, [&](int r) { return v(r, i, it); }));
        break;
      case Op::reduce_scatter: {
        const std::size_t off = static_cast<std::size_t>(me_) * sh.out;
        for (std::size_t i = 0; i < sh.out; ++i)
          cmp(i, reduce_ref<T>(s_.rop, n, [&](int r) { return v(r, off + i, it); }));
        break;
      }
      case Op::all_gather:
        for (std::size_t i = 0; i < sh.out; ++i) {
          const int r = static_cast<int>(i / std::max<std::size_t>(sh.in, 1));
          cmp(i, make<T>(static_cast<double>(v(r, i % sh.in, it))));
        }
        break;
      case Op::broadcast:
        for (std::size_t i = 0; i < sh.out; ++i)
          cmp(i, make<T>(static_cast<double>(v(static_cast<int>(s_.root), i, it))));
        break;
      case Op::sendrecv: {
        const int prev = (me_ + n_ - 1) % n_;
        for (std::size_t i = 0; i < sh.out; ++i)
          cmp(i, make<T>(static_cast<double>(v(prev, i, it))));
        break;
      }
    }
    return wrong;
  }

  // Test-only: perturbs one element of this rank's result.
  void corrupt(void* out, std::size_t numel) const {
    if (s_.corrupt_rank != me_ || numel == 0) return;
    static_cast<unsigned char*>(out)[numel / 2 * es_] ^= 1;
  }

  struct Cell {
    double us = 0;
    long wrong = 0;
  };

  // Runs warm-up and timed iterations of one call; returns time per call (max over ranks) and
  // wrong elements (sum over ranks).
  Cell measure(Backend b, Op op, const Shape& sh) {
    char* p = base(b);
    dt::TensorView in{p, sh.in, s_.dtype};
    dt::TensorView out{p + sh.out_off, sh.out, s_.dtype};
    auto call = call_of(b, op, in, out);
    double secs = 0;
    long wrong = 0;
    dt::visit_dtype(s_.dtype, [&](auto z) {
      using T = decltype(z);
      T* tin = static_cast<T*>(in.data);
      T* tout = static_cast<T*>(out.data);
      if (!s_.check) {
        // Integer sums would overflow over many in-place calls: zeros cost the same.
        if (std::is_integral_v<T>)
          std::memset(p, 0, sh.total);
        else
          fill(op, sh, tin, tout, 0);
        for (long it = 0; it < s_.warmup; ++it) call();
        MPI_Barrier(world_->handle());
        const auto t0 = Clock::now();
        for (long it = 0; it < s_.iters; ++it) call();
        secs = std::chrono::duration<double>(Clock::now() - t0).count();
        return;
      }
      for (long it = 0; it < s_.warmup + s_.iters; ++it) {
        fill(op, sh, tin, tout, it);
        if (it == s_.warmup) MPI_Barrier(world_->handle());
        const auto t0 = Clock::now();
        call();
        if (it >= s_.warmup) secs += std::chrono::duration<double>(Clock::now() - t0).count();
        corrupt(out.data, sh.out);
        wrong += verify(op, sh, tout, it);
      }
    });
    Cell c;
    c.us = secs / static_cast<double>(std::max(1L, s_.iters)) * 1e6;
    MPI_Allreduce(MPI_IN_PLACE, &c.us, 1, MPI_DOUBLE, MPI_MAX, world_->handle());
    MPI_Allreduce(&wrong, &c.wrong, 1, MPI_LONG, MPI_SUM, world_->handle());
    return c;
  }

  // --- the size sweep ------------------------------------------------------------------------

  void run_ops() {
    const auto sizes = sizes_of(s_);
    for (Op op : s_.op_list) {
      std::vector<Backend> bs;
      for (Backend b : s_.backend_list) {
        if (b == Backend::ucx && op != Op::sendrecv) {
          if (me_ == 0)
            std::printf("#\n# %s: backend ucx has no %s (UCX is point-to-point only); no figures\n",
                        op_name(op), op_name(op));
          continue;
        }
        bs.push_back(b);
      }
      if (bs.empty()) continue;
      if (me_ == 0) {
        std::printf("#\n# %s\n", op_name(op));
        std::printf("# %10s %12s %8s %6s %6s %9s %8s %8s %6s  %-8s %s\n", "size", "count", "type",
                    "redop", "root", "time", "algbw", "busbw", "#wrong", "backend", "path");
        std::printf("# %10s %12s %8s %6s %6s %9s %8s %8s %6s\n", "(B)", "(elements)", "", "", "",
                    "(us)", "(GB/s)", "(GB/s)", "");
      }
      const bool reduces = op == Op::all_reduce || op == Op::reduce_scatter;
      std::size_t last = SIZE_MAX;
      for (std::size_t bytes : sizes) {
        const Shape sh = measured_shape(op, bytes, es_, n_, s_.min_bytes);
        if (sh.size_bytes == last) continue;  // rounded to the same element counts
        last = sh.size_bytes;
        for (Backend b : bs) {
          const Cell c = measure(b, op, sh);
          const double algbw = c.us > 0 ? static_cast<double>(sh.size_bytes) / c.us / 1e3 : 0;
          const double busbw = algbw * sh.bus_factor;
          wrong_ += c.wrong;
          busbw_[std::string(op_name(op)) + " " + backend_name(b)].push_back(busbw);
          all_busbw_.push_back(busbw);
          if (me_ == 0) {
            std::printf("  %10zu %12zu %8s %6s %6ld %9.2f %8.3f %8.3f %6ld  %-8s %s\n",
                        sh.size_bytes, sh.count, dt::dtype_name(s_.dtype),
                        reduces ? dt::reduce_op_name(s_.rop) : "none",
                        op == Op::broadcast ? s_.root : -1L, c.us, algbw, busbw,
                        s_.check ? c.wrong : 0L, backend_name(b), path_of(b, op, sh));
            std::fflush(stdout);
          }
        }
      }
    }
  }

  // --- the gradient set ----------------------------------------------------------------------

  // One pass over the gradient set: per tensor (reverse order) or per bucket.
  Cell grad_pass(Backend b, bool bucketed) {
    char* p = base(b);
    std::vector<std::pair<std::size_t, std::size_t>> calls;
    if (bucketed) {
      calls = g_.buckets;
    } else {
      for (auto it = g_.params.rbegin(); it != g_.params.rend(); ++it)
        calls.emplace_back(it->offset, it->numel);
    }
    dt::Comm& c = comm(b);
    auto pass = [&] {
      for (const auto& [off, cnt] : calls)
        c.all_reduce(dt::TensorView{p + off * es_, cnt, s_.dtype}, s_.rop);
    };
    Shape sh;
    sh.in = sh.out = g_.numel;
    sh.in_place = true;
    sh.total = g_.numel * es_;
    double secs = 0;
    long wrong = 0;
    dt::visit_dtype(s_.dtype, [&](auto z) {
      using T = decltype(z);
      T* t = reinterpret_cast<T*>(p);
      if (!s_.check) {
        if (std::is_integral_v<T>)
          std::memset(p, 0, sh.total);
        else
          fill(Op::all_reduce, sh, t, t, 0);
      }
      for (long it = 0; it < s_.warmup + s_.iters; ++it) {
        if (s_.check) fill(Op::all_reduce, sh, t, t, it);
        if (it == s_.warmup) MPI_Barrier(world_->handle());
        const auto t0 = Clock::now();
        pass();
        if (it >= s_.warmup) secs += std::chrono::duration<double>(Clock::now() - t0).count();
        if (s_.check) {
          corrupt(p, g_.numel);
          wrong += verify(Op::all_reduce, sh, t, it);
        }
      }
    });
    Cell r;
    r.us = secs / static_cast<double>(std::max(1L, s_.iters)) * 1e6;
    MPI_Allreduce(MPI_IN_PLACE, &r.us, 1, MPI_DOUBLE, MPI_MAX, world_->handle());
    MPI_Allreduce(&wrong, &r.wrong, 1, MPI_LONG, MPI_SUM, world_->handle());
    return r;
  }

  void run_grad_set() {
    if (me_ == 0) {
      std::printf(
          "#\n# gradient set of %s: %zu tensors, %zu %s elements (%.2f MiB); %zu bucket(s) "
          "of at most %g MiB in reverse parameter order\n",
          s_.grad_set.c_str(), g_.params.size(), g_.numel, dt::dtype_name(s_.dtype),
          static_cast<double>(g_.numel * es_) / (1 << 20), g_.buckets.size(), s_.bucket_mb);
      std::printf("# %-8s %9s %9s %16s %14s %8s %6s  %s\n", "backend", "calls", "buckets",
                  "per-tensor (us)", "bucketed (us)", "speedup", "#wrong", "path (largest call)");
    }
    for (Backend b : s_.backend_list) {
      if (b == Backend::ucx) {
        if (me_ == 0)
          std::printf("# ucx: no all_reduce (UCX is point-to-point only); no figures\n");
        continue;
      }
      const Cell per = grad_pass(b, false);
      const Cell buck = grad_pass(b, true);
      wrong_ += per.wrong + buck.wrong;
      std::size_t largest = 0;
      for (const auto& bk : g_.buckets) largest = std::max(largest, bk.second);
      Shape sh;
      sh.in = largest;
      const double busbw =
          buck.us > 0 ? static_cast<double>(g_.numel * es_) / buck.us / 1e3 * 2.0 * (n_ - 1) / n_
                      : 0;
      all_busbw_.push_back(busbw);
      if (me_ == 0) {
        std::printf("  %-8s %9zu %9zu %16.1f %14.1f %8.2f %6ld  %s\n", backend_name(b),
                    g_.params.size(), g_.buckets.size(), per.us, buck.us,
                    buck.us > 0 ? per.us / buck.us : 0.0, s_.check ? per.wrong + buck.wrong : 0L,
                    path_of(b, Op::all_reduce, sh));
        std::fflush(stdout);
      }
    }
  }

  int finish() {
    if (me_ == 0) {
      std::printf("#\n");
      for (const auto& [k, v] : busbw_) {
        double sum = 0;
        for (double x : v) sum += x;
        std::printf("# Avg bus bandwidth %-24s: %.4f\n", k.c_str(),
                    sum / static_cast<double>(v.size()));
      }
      if (s_.check)
        std::printf("# Out of bounds values : %ld %s\n", wrong_, wrong_ ? "FAILED" : "OK");
      double sum = 0;
      for (double x : all_busbw_) sum += x;
      std::printf("# Avg bus bandwidth    : %.4f\n",
                  all_busbw_.empty() ? 0.0 : sum / static_cast<double>(all_busbw_.size()));
      std::printf("#\n");
      std::fflush(stdout);
    }
    return wrong_ ? 1 : 0;
  }

  const Settings& s_;
  GradSet g_;
  dt::MpiComm* world_ = nullptr;
  int n_ = 1, me_ = 0;
  std::size_t es_ = 4;
  dt::Tensor user_;
  std::unique_ptr<dt::ShmComm> shm_;
  std::unique_ptr<dt::UcxP2p> ucx_;
  std::map<std::string, std::vector<double>> busbw_;
  std::vector<double> all_busbw_;
  long wrong_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  GradSet grad;
  std::vector<std::string> dtypes;
  for (DType t : dt::kAllDTypes) dtypes.emplace_back(dt::dtype_name(t));
  dt::Options opts(
      "dt_bench",
      "Collective and point-to-point bandwidth of dt's transports (nccl-tests format).");
  opts.add("ops", &s.ops, kDefaultOps,
           "comma-separated operations: all_reduce, all_gather, reduce_scatter, broadcast, "
           "sendrecv (with --backends=ucx alone the default is sendrecv; a collective named here "
           "is refused)")
      .add("backends", &s.backends, "mpi,shm,shm-copy,ucx",
           "comma-separated backends: mpi, shm (buffers in the shared arena), shm-copy (user "
           "buffers through the staging area), ucx (sendrecv only)")
      .add("min-bytes", &s.min_bytes_s, "8", "smallest size (bytes; K, M, G suffixes)")
      .add("max-bytes", &s.max_bytes_s, "64M",
           "largest size (bytes; K, M, G suffixes; at most 16G)")
      .add("step-factor", &s.step_factor, 2, "each size is the previous one times this", 2L, 1024L)
      .add("iters", &s.iters, 20, "timed calls per size", 1L, 1000000L)
      .add("warmup", &s.warmup, 5, "untimed calls per size before the timed ones", 0L, 1000000L)
      .add("dtype", &s.dtype_s, "f32", "element type", dtypes)
      .add("op", &s.op_s, "sum", "reduction of all_reduce and reduce_scatter",
           {"sum", "avg", "max", "min"})
      .add("root", &s.root, 0, "root rank of broadcast", 0L, 1L << 30)
      .add("check", &s.check, false,
           "verify every result of every call against independently computed values; exit 1 on "
           "any wrong element")
      .add("shm.chunk-bytes", &s.shm_chunk_s, "128K", "shm: pipelining chunk (ShmConfig)")
      .add("shm.staging-bytes", &s.shm_staging_s, "8M",
           "shm: staging area per rank for buffers outside the arena (at least 64)")
      .add("shm.min-bytes", &s.shm_min_s, "0", "shm: messages below this size go to MPI")
      .add("simulated-nodes", &s.simulated_nodes, 0,
           "testing only: pretend the ranks sit on this many nodes (shm hierarchical path)", 0L,
           1L << 16)
      .add("grad-set", &s.grad_set, "",
           "model INI ([model] seq-len, layers, heads, embd, vocab): all-reduce its GPT gradient "
           "set per tensor and in buckets instead of the size sweep")
      .add("grad-set.bucket-mb", &s.bucket_mb, 25.0, "bucket size of --grad-set (MiB)", 0.001,
           65536.0)
      .add("test.corrupt-rank", &s.corrupt_rank, -1,
           "testing only: this rank perturbs one element of its result after every call", -1L,
           1L << 30);
  // Option errors of the command line alone end every rank here, before MPI starts, reported
  // once (dt::quiet_option_errors). A config file, and the gradient set's file, are read on each
  // rank's node, and their copies may differ: those errors are kept and agreed on once MPI has
  // started, so that every rank exits 2 with them instead of the others waiting for the missing
  // rank in MPI's start-up.
  const bool config_given = dt::config_file_given(argc, argv);
  std::string node_error;
  int rc = dt::run_with_config_errors(
      "dt_bench",
      [&] {
        try {
          if (!opts.parse(argc, argv)) return 0;
          parse_settings(s, opts.given("ops"));
        } catch (const dt::ConfigError& e) {
          if (!config_given) throw;
          node_error = e.message();
        }
        return -1;
      },
      dt::quiet_option_errors(argc, argv));
  if (rc >= 0) return rc;
  if (node_error.empty() && !s.grad_set.empty()) {
    try {
      grad = load_grad_set(s.grad_set, s.bucket_mb, dt::dtype_size(s.dtype));
    } catch (const dt::ConfigError& e) {
      node_error = e.message();
    }
  }

  const auto runtime = dt::start_runtime(&argc, &argv, {}, "dt_bench");
  dt::Runtime& rt = *runtime;
  if (!dt::agree_on_errors(rt.world(), "dt_bench", [&] {
        if (!node_error.empty()) throw dt::ConfigError(node_error, __FILE__, __LINE__);
      }))
    return 2;
  // Checks that need the job size: every rank decides alike, before any benchmark traffic.
  if (s.root >= rt.size()) {
    if (rt.rank() == 0)
      std::fprintf(stderr,
                   "dt_bench: error: option --root: %ld is not a rank of this %d-rank job\n",
                   s.root, rt.size());
    return 2;
  }
  if (s.grad_set.empty()) {
    if (const auto [op, least] = smallest_over_max(s, rt.size()); least > 0) {
      if (rt.rank() == 0)
        std::fprintf(stderr,
                     "dt_bench: error: option --max-bytes: %s of %s on %d ranks measures no size "
                     "from --min-bytes=%s to --max-bytes=%s: its smallest is %zu bytes\n",
                     op.c_str(), dt::dtype_name(s.dtype), rt.size(), s.min_bytes_s.c_str(),
                     s.max_bytes_s.c_str(), least);
      return 2;
    }
  }
  if (s.corrupt_rank >= rt.size() && rt.rank() == 0)
    std::fprintf(stderr, "dt_bench: warning: --test.corrupt-rank=%ld is not a rank of this job\n",
                 s.corrupt_rank);
  try {
    Bench b(rt, s, std::move(grad));
    return b.run();
  } catch (const std::bad_alloc&) {  // a size within the options' range that memory lacks
    std::fprintf(stderr,
                 "dt_bench: rank %d: out of memory for the buffers: give a smaller --max-bytes\n",
                 rt.rank());
    rt.abort(3);
  } catch (const std::exception& e) {  // dt::Error and any other: the other ranks must not wait
    std::fprintf(stderr, "dt_bench: rank %d: %s\n", rt.rank(), e.what());
    rt.abort(3);
  }
}
