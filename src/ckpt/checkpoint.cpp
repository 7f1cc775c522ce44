#include "dt/checkpoint.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <hdf5.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <fstream>
#include <new>
#include <optional>
#include <queue>
#include <sstream>
#include <thread>
#include <tuple>

#include "../comm/mpi_comm.hpp"
#include "../engine/plan.hpp"  // format_bytes
#include "dt/config.hpp"
#include "dt/metrics.hpp"
#include "dt/qos.hpp"
#include "dt/security.hpp"
#include "dt/trace.hpp"
#include "dt/watchdog.hpp"
#include "h5.hpp"

#ifndef DT_VERSION
#define DT_VERSION "0.1.0"
#endif

namespace dt {

namespace {

using Clock = std::chrono::steady_clock;

// ---- small RAII and error helpers ---------------------------------------------------------------

struct Quiet {  // HDF5 prints nothing; dt reports errors itself
  Quiet() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }
};

hid_t h5(hid_t id, const char* call, const std::string& file) {
  if (id < 0) DT_THROW(CheckpointError, file, ": ", call, " failed: ", h5_message());
  return id;
}
void h5(herr_t rc, const char* call, const std::string& file, int) {
  if (rc < 0) DT_THROW(CheckpointError, file, ": ", call, " failed: ", h5_message());
}

MpiComm& mpi_of(Comm& c) {
  auto* m = dynamic_cast<MpiComm*>(&c);
  DT_CHECK(CheckpointError, m != nullptr, "checkpoints need an MPI communicator, got '", c.name(),
           "'");
  return *m;
}

// Every rank passes its local flag; returns true if all passed true.
bool all_ok(Comm& c, bool ok) {
  int v = ok ? 1 : 0;
  c.all_reduce(view_of(&v, 1), ReduceOp::min);
  return v == 1;
}

std::string errno_text() { return std::strerror(errno); }

// Fault-injection seams for tests, for failures on one rank only that cannot be provoked on one
// machine (an I/O error on one node): the environment variable `var` set to RANK:TEXT says that
// the call fails on rank RANK for a file whose path contains TEXT.
//   DT_TEST_CKPT_READ_FAIL    every read of a tensor's data (load and verify)
//   DT_TEST_CKPT_CREATE_FAIL  the creation of the file a save writes
//   DT_TEST_CKPT_LATEST_FAIL  the write of `latest` that commits a save (rank 0 writes it), as
//                             a file system out of inodes would fail it
//   DT_TEST_CKPT_PRUNE_FAIL   the retention after a commit (rank 0 prunes), as a folder that can
//                             no longer be listed would fail it
// A malformed value (no RANK:TEXT) injects nothing.
// The names in `dir` (none where it does not exist; CheckpointError where it cannot be read);
// whether `name` is step-N<suffix> (N in *step). Defined with the listing functions below.
std::vector<std::string> dir_entries(const std::string& dir);
bool parse_step(const std::string& name, const std::string& suffix, std::int64_t* step);

struct InjectedFault {
  int rank = -1;
  std::string text;
  explicit InjectedFault(const char* var) {
    const char* v = std::getenv(var);
    const char* colon = v != nullptr ? std::strchr(v, ':') : nullptr;
    char* end = nullptr;
    const long r = colon != nullptr ? std::strtol(v, &end, 10) : -1;
    if (colon == nullptr || end != colon || r < 0 || colon[1] == '\0') return;
    rank = static_cast<int>(r);
    text = colon + 1;
  }
  bool at(const Comm& comm, const std::string& path) const {
    return rank == comm.rank() && path.find(text) != std::string::npos;
  }
};
bool injected_fault(const char* var, const Comm& comm, const std::string& path) {
  static const InjectedFault read("DT_TEST_CKPT_READ_FAIL"), create("DT_TEST_CKPT_CREATE_FAIL"),
      latest("DT_TEST_CKPT_LATEST_FAIL"), prune("DT_TEST_CKPT_PRUNE_FAIL");
  const InjectedFault& f = std::strcmp(var, "DT_TEST_CKPT_READ_FAIL") == 0     ? read
                           : std::strcmp(var, "DT_TEST_CKPT_CREATE_FAIL") == 0 ? create
                           : std::strcmp(var, "DT_TEST_CKPT_LATEST_FAIL") == 0 ? latest
                                                                               : prune;
  return f.at(comm, path);
}
void injected_read_failure(const Comm& comm, const std::string& path) {
  if (injected_fault("DT_TEST_CKPT_READ_FAIL", comm, path))
    DT_THROW(CheckpointError, path, ": H5Dread failed (DT_TEST_CKPT_READ_FAIL on rank ",
             comm.rank(), ")");
}

// Renames checkpoint `path` out of its folder's checkpoints, to path.superseded (or
// .superseded.N when that is taken), and returns the new name; where the rename fails the file
// stays as it is, and the text says so. With `link_only` the file is linked there and stays at
// `path` too (a commit then renames over it, so that `path` never goes missing).
std::string move_aside(const std::string& path, bool link_only = false) {
  // A name taken (also one made by another writer meanwhile) is passed over: the link, and the
  // rename where the file system offers RENAME_NOREPLACE, fail on it instead of replacing it.
  for (int n = 1; n < 1000; ++n) {
    const std::string to =
        path + ".superseded" + (n == 1 ? std::string() : "." + std::to_string(n));
    int rc;
    if (link_only) {
      rc = ::link(path.c_str(), to.c_str());
    } else {
      rc = ::renameat2(AT_FDCWD, path.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE);
      if (rc != 0 && (errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP ||
                      errno == EPERM))  // no RENAME_NOREPLACE there (or renameat2 refused)
        rc = ::access(to.c_str(), F_OK) == 0 ? (errno = EEXIST, -1)
                                             : ::rename(path.c_str(), to.c_str());
    }
    if (rc == 0) return to;
    if (errno != EEXIST)
      return path + " (kept as it is: " + (link_only ? "link" : "rename") +
             " failed: " + errno_text() + ")";
  }
  return path + " (kept as it is: no free name " + path + ".superseded.N)";
}

void fsync_path(const std::string& p, bool dir) {
  const int fd = ::open(p.c_str(), (dir ? O_DIRECTORY : 0) | O_RDONLY);
  DT_CHECK(CheckpointError, fd >= 0, "cannot open ", p, " to fsync: ", errno_text());
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  DT_CHECK(CheckpointError, rc == 0, "fsync of ", p, " failed: ", std::strerror(err));
}

void mkdirs(const std::string& dir) {
  std::string cur;
  std::istringstream is(dir);
  std::string part;
  if (!dir.empty() && dir[0] == '/') cur = "/";
  while (std::getline(is, part, '/')) {
    if (part.empty()) continue;
    const std::string parent = cur.empty() ? "." : cur;
    cur += part + "/";
    if (::mkdir(cur.c_str(), 0755) == 0) {
      try {  // the new directory's entry made durable before anything in it, where it can be
        fsync_path(parent, true);
      } catch (const CheckpointError&) {  // a parent this process may not open: as before
      }
    } else if (errno != EEXIST) {
      DT_THROW(CheckpointError, "cannot create checkpoint directory ", cur, ": ", errno_text());
    }
  }
}

// ---- chunks and digests -------------------------------------------------------------------------

using Digest = std::array<unsigned char, 32>;

Digest sha256(const void* p, std::size_t n) {
  Digest d{};
  unsigned int len = 0;
  DT_CHECK(CheckpointError, EVP_Digest(p, n, d.data(), &len, EVP_sha256(), nullptr) == 1,
           "SHA-256 failed");
  return d;
}

std::size_t chunks_of(std::size_t numel) { return (numel + kChunkElements - 1) / kChunkElements; }

// This rank's share of the chunks of all tensors, numbered in tensor order: per tensor, the
// chunk range [first, last).
std::vector<std::pair<std::size_t, std::size_t>> my_chunks(const std::vector<std::size_t>& numels,
                                                           int rank, int size) {
  std::size_t total = 0;
  for (auto n : numels) total += chunks_of(n);
  const std::size_t lo = total * static_cast<std::size_t>(rank) / static_cast<std::size_t>(size);
  const std::size_t hi =
      total * static_cast<std::size_t>(rank + 1) / static_cast<std::size_t>(size);
  std::vector<std::pair<std::size_t, std::size_t>> out;
  std::size_t base = 0;
  for (auto n : numels) {
    const std::size_t k = chunks_of(n);
    const std::size_t a = std::clamp(lo, base, base + k) - base;
    const std::size_t b = std::clamp(hi, base, base + k) - base;
    out.emplace_back(a, b);
    base += k;
  }
  return out;
}

// ---- pieces of sharded tensors ------------------------------------------------------------------

std::string piece_str(const CkptPiece& p) {
  std::ostringstream os;
  os << "{begin " << p.begin << ", len " << p.len << ", stride " << p.stride << ", count "
     << p.count << "}";
  return os.str();
}

// Where element e of a tensor lies: " (row 1, column 6)" for a 2-D one, " (index [1, 0, 6])" for
// more dimensions; "" for 0-D and 1-D ones. `from` for the first of several.
std::string where(const Shape& shape, std::size_t e, const char* from = "") {
  if (shape.size() < 2) return "";
  std::vector<std::size_t> idx(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    if (shape[d] <= 0) return "";
    const auto ext = static_cast<std::size_t>(shape[d]);
    idx[d] = e % ext;
    e /= ext;
  }
  std::string s = std::string(" (") + from;
  if (shape.size() == 2)
    return s + "row " + std::to_string(idx[0]) + ", column " + std::to_string(idx[1]) + ")";
  s += "index [";
  for (std::size_t d = 0; d < idx.size(); ++d) s += (d ? ", " : "") + std::to_string(idx[d]);
  return s + "])";
}

// "" when the part of `t` this rank declares (CkptTensor's forms) lies inside the tensor, else
// why not.
std::string held_problem(const CkptTensor& t) {
  const std::size_t n = t.numel();
  if (t.pieces.empty()) {
    if (t.whole() || (t.begin <= t.end && t.end <= n)) return "";
    return "the range [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
           ") is not inside its " + std::to_string(n) + " elements";
  }
  for (std::size_t q = 0; q < t.pieces.size(); ++q) {
    const CkptPiece& p = t.pieces[q];
    if (p.len == 0 || p.count == 0) continue;
    const std::size_t rest = p.begin <= n ? n - p.begin : 0;
    const bool inside = p.begin <= n && p.len <= rest &&
                        (p.count == 1 || p.stride <= (rest - p.len) / (p.count - 1));
    std::string why;
    if (p.count > 1 && p.stride < p.len)
      why = "has overlapping rows (stride < len)";
    else if (!inside)
      why = "reaches past its " + std::to_string(n) + " elements";
    else if (!p.data)
      why = "has no data";
    if (!why.empty()) return "piece " + std::to_string(q) + " " + piece_str(p) + " " + why;
  }
  return "";
}

// The pieces this rank holds of `t` (valid: held_problem(t) is ""), in normal form: len >= 1,
// count >= 1, stride == len when count == 1. A range or the whole tensor is one piece, an empty
// range none.
std::vector<CkptPiece> held_pieces(const CkptTensor& t) {
  std::vector<CkptPiece> out;
  if (!t.pieces.empty()) {
    for (CkptPiece p : t.pieces) {
      if (p.len == 0 || p.count == 0) continue;
      if (p.count == 1) p.stride = p.len;
      out.push_back(p);
    }
    return out;
  }
  const std::size_t a = t.whole() ? 0 : t.begin, b = t.held_end();
  if (b > a) out.push_back(CkptPiece{a, b - a, b - a, 1, t.data});
  return out;
}

// One past the last element of a normal piece.
std::size_t piece_end(const CkptPiece& p) { return p.begin + (p.count - 1) * p.stride + p.len; }

// The elements of a normal piece before element x.
std::size_t below(const CkptPiece& p, std::size_t x) {
  if (x <= p.begin) return 0;
  const std::size_t d = x - p.begin, j = d / p.stride;
  if (j >= p.count) return p.numel();
  return j * p.len + std::min(p.len, d - j * p.stride);
}

// A run of a piece's rows cut to a range: m rows of n elements, the first at element e of the
// tensor (rows p.stride apart) and at `off` in the piece's data (rows p.len apart).
struct Seg {
  std::size_t e, off, n, m;
};

// Calls f(Seg) for the rows of normal piece `p` that meet the elements [a, b), cut to them: at
// most three runs (a cut first row, whole rows, a cut last row), in element order.
template <class F>
void for_each_seg(const CkptPiece& p, std::size_t a, std::size_t b, F&& f) {
  if (a >= b) return;
  // Rows [j0, j1) meet [a, b): row j ends after a and starts before b.
  const std::size_t j0 = a < p.begin + p.len ? 0 : (a - p.begin - p.len) / p.stride + 1;
  const std::size_t j1 =
      b <= p.begin ? 0 : std::min(p.count, (b - p.begin + p.stride - 1) / p.stride);
  if (j0 >= j1) return;
  auto start = [&](std::size_t j) { return p.begin + j * p.stride; };
  auto full = [&](std::size_t j) { return start(j) >= a && start(j) + p.len <= b; };
  auto cut = [&](std::size_t j) {
    const std::size_t s = std::max(a, start(j)), e = std::min(b, start(j) + p.len);
    f(Seg{s, j * p.len + (s - start(j)), e - s, 1});
  };
  std::size_t j = j0;
  if (!full(j)) cut(j++);
  if (j >= j1) return;
  const bool tail = !full(j1 - 1);
  const std::size_t jend = tail ? j1 - 1 : j1;
  if (jend > j) f(Seg{start(j), j * p.len, p.len, jend - j});
  if (tail) cut(j1 - 1);
}

// A piece of some rank (data unknown on the other ranks).
struct Held {
  int rank;
  CkptPiece p;
};

// "" when `held` (every rank's normal pieces of a tensor) covers its elements exactly once, else
// the first gap or overlap in element order. One sweep over the pieces' rows in element order.
std::string cover_problem(const CkptTensor& t, const std::vector<Held>& held) {
  const std::size_t n = t.numel();
  const std::string head = t.path + ": the ranks' pieces do not cover its " + std::to_string(n) +
                           " elements exactly once: ";
  for (const Held& h : held)
    if (piece_end(h.p) > n)
      return head + "rank " + std::to_string(h.rank) + "'s piece " + piece_str(h.p) +
             " reaches past the end";
  using Row = std::tuple<std::size_t, std::size_t, std::size_t>;  // start, piece, row
  std::priority_queue<Row, std::vector<Row>, std::greater<Row>> next;
  for (std::size_t q = 0; q < held.size(); ++q) next.emplace(held[q].p.begin, q, 0);
  std::size_t at = 0;  // elements [0, at) are covered once
  int last = -1;       // the rank holding element at - 1
  while (!next.empty()) {
    const auto [s, q, j] = next.top();
    next.pop();
    const Held& h = held[q];
    if (s > at)
      return head + "elements [" + std::to_string(at) + ", " + std::to_string(s) + ")" +
             where(t.shape, at, "from ") + " are held by no rank";
    if (s < at)
      return head + "element " + std::to_string(s) + where(t.shape, s) + " is held by rank " +
             std::to_string(last) + " and by rank " + std::to_string(h.rank);
    at = s + h.p.len;
    last = h.rank;
    if (j + 1 < h.p.count) next.emplace(s + h.p.stride, q, j + 1);
  }
  if (at < n)
    return head + "elements [" + std::to_string(at) + ", " + std::to_string(n) + ")" +
           where(t.shape, at, "from ") + " are held by no rank";
  return "";
}

// The chunks of one tensor this rank writes, and where their elements are.
struct Share {
  std::vector<std::pair<std::size_t, std::size_t>> runs;  // chunk ranges [c0, c1), ascending
  const float* whole = nullptr;  // the elements are the tensor's own (a replicated tensor), or
  std::vector<float> packed;     // the runs' elements, one run after the other
  std::size_t chunks() const {
    std::size_t k = 0;
    for (const auto& [a, b] : runs) k += b - a;
    return k;
  }
};

// One chunk of a Share: chunk c, elements [e0, e1), the q-th chunk of the share, at element
// `at` of its packed order.
struct ShareChunk {
  std::size_t c, e0, e1, q, at;
};
template <class F>
void for_each_chunk(const Share& s, std::size_t numel, F&& f) {
  std::size_t q = 0, at = 0;
  for (const auto& [c0, c1] : s.runs)
    for (std::size_t c = c0; c < c1; ++c, ++q) {
      const std::size_t e0 = c * kChunkElements, e1 = std::min(e0 + kChunkElements, numel);
      f(ShareChunk{c, e0, e1, q, at});
      at += e1 - e0;
    }
}

// Replicated tensors: this rank's share of all chunks (my_chunks), read in place.
std::vector<Share> replicated_shares(const std::vector<CkptTensor>& tensors, int rank, int size) {
  std::vector<std::size_t> numels;
  for (const auto& t : tensors) numels.push_back(t.numel());
  const auto mine = my_chunks(numels, rank, size);
  std::vector<Share> out(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (mine[i].first < mine[i].second) out[i].runs.push_back(mine[i]);
    out[i].whole = tensors[i].data;
  }
  return out;
}

// Move-only owner of an MPI datatype.
class MpiType {
 public:
  MpiType() = default;
  explicit MpiType(MPI_Datatype t) : t_(t) {}
  ~MpiType() {
    if (t_ != MPI_DATATYPE_NULL) MPI_Type_free(&t_);
  }
  MpiType(MpiType&& o) noexcept : t_(o.t_) { o.t_ = MPI_DATATYPE_NULL; }
  MpiType& operator=(MpiType&& o) noexcept {
    std::swap(t_, o.t_);
    return *this;
  }
  MpiType(const MpiType&) = delete;
  MpiType& operator=(const MpiType&) = delete;
  MPI_Datatype get() const noexcept { return t_; }

 private:
  MPI_Datatype t_ = MPI_DATATYPE_NULL;
};

// m rows of n floats, `stride` floats apart, from `addr`.
struct Block {
  float* addr;
  std::size_t n, m, stride;
};

// The committed MPI datatype of `blocks`, in order, at their absolute addresses (for
// MPI_BOTTOM): one entry per block (a vector for strided rows), so its size is that of the
// block list, not of the data.
MpiType block_type(const std::vector<Block>& blocks) {
  constexpr std::size_t kMax = std::size_t{1} << 30;  // floats per entry (int counts)
  std::vector<int> lens;
  std::vector<MPI_Aint> disps;
  std::vector<MPI_Datatype> types;
  std::vector<MpiType> vectors;  // freed once the struct is made (it keeps what it needs)
  auto address = [](const float* p) {
    MPI_Aint a = 0;
    MPI_Get_address(p, &a);
    return a;
  };
  auto add = [&](const float* p, std::size_t n) {
    for (std::size_t at = 0; at < n; at += kMax) {
      lens.push_back(static_cast<int>(std::min(kMax, n - at)));
      disps.push_back(address(p + at));
      types.push_back(MPI_FLOAT);
    }
  };
  for (const Block& b : blocks) {
    if (b.m == 1 || b.stride == b.n) {
      add(b.addr, b.n * b.m);
    } else if (b.n <= kMax && b.m <= kMax) {
      MPI_Datatype v = MPI_DATATYPE_NULL;
      DT_CHECK(CheckpointError,
               MPI_Type_create_hvector(static_cast<int>(b.m), static_cast<int>(b.n),
                                       static_cast<MPI_Aint>(b.stride * sizeof(float)), MPI_FLOAT,
                                       &v) == MPI_SUCCESS,
               "MPI_Type_create_hvector failed");
      vectors.emplace_back(v);
      lens.push_back(1);
      disps.push_back(address(b.addr));
      types.push_back(v);
    } else {
      for (std::size_t r = 0; r < b.m; ++r) add(b.addr + r * b.stride, b.n);
    }
  }
  DT_CHECK(CheckpointError, lens.size() < (std::size_t{1} << 31),
           "too many pieces to exchange in one sharded save");
  MPI_Datatype t = MPI_DATATYPE_NULL;
  DT_CHECK(CheckpointError,
           MPI_Type_create_struct(static_cast<int>(lens.size()), lens.data(), disps.data(),
                                  types.data(), &t) == MPI_SUCCESS,
           "MPI_Type_create_struct failed");
  MpiType out(t);
  DT_CHECK(CheckpointError, MPI_Type_commit(&t) == MPI_SUCCESS, "MPI_Type_commit failed");
  return out;
}

// Sharded saves (CkptTensor ranges and pieces). Gathers what every rank holds (4 numbers per
// piece) and checks that the ranks' parts cover each sharded tensor exactly once (the same
// verdict, naming the first gap or overlap, on every rank). A tensor whole on every rank is
// replicated and written in place from this rank's share (my_chunks). A chunk of a sharded tensor
// is written by the rank holding more than half of it, if any (so ranges move less than a chunk
// per rank boundary), else by the rank whose share (my_chunks) it falls in; every other holder of
// its elements sends them there, all in one MPI_Alltoallw whose datatypes point at the pieces and
// into the writers' packed buffers (no staging copies). Returns this rank's shares.
std::vector<Share> sharded_shares(Comm& comm, const std::vector<CkptTensor>& tensors) {
  const trace::Scope plan_scope("ckpt.shard", "ckpt");
  const int P = comm.size(), me = comm.rank();
  const std::size_t T = tensors.size(), K = kChunkElements;
  const MPI_Comm mc = mpi_of(comm).handle();
  constexpr std::uint64_t kWhole = ~std::uint64_t{0};
  // Runs `f`, this rank's work before the next collective call: a failure on any rank (out of
  // memory, say) is thrown on every rank, naming the first rank that failed, so that none waits
  // in a collective for a rank that gave up.
  auto on_every_rank = [&](auto&& f) {
    std::string problem;
    try {
      problem = f();
    } catch (const std::bad_alloc&) {
      problem = "out of memory while planning the save";
    } catch (const std::exception& e) {
      problem = message_of(e);
    }
    const auto [bad_rank, bad] = first_problem(comm, problem);
    if (bad_rank < P) DT_THROW(CheckpointError, "rank ", bad_rank, ": ", bad);
  };
  // What this rank holds: per tensor kWhole, or its count of pieces and 4 numbers per piece.
  std::vector<std::vector<CkptPiece>> own(T);
  std::vector<std::uint64_t> desc;
  on_every_rank([&] {
    std::string problem;
    for (std::size_t i = 0; i < T; ++i) {
      const CkptTensor& t = tensors[i];
      const std::string why = held_problem(t);
      if (!why.empty() && problem.empty()) problem = t.path + ": " + why;
      if (t.whole()) {
        desc.push_back(kWhole);
        continue;
      }
      if (why.empty()) own[i] = held_pieces(t);
      desc.push_back(own[i].size());
      for (const CkptPiece& p : own[i])
        desc.insert(desc.end(), {p.begin, p.len, p.stride, p.count});
    }
    if (desc.size() >= (std::size_t{1} << 31) && problem.empty())
      problem = "too many pieces (" + std::to_string(desc.size() / 4) + ") for one sharded save";
    return problem;
  });
  std::vector<int> sizes(static_cast<std::size_t>(P)), displs(sizes);
  int mine = static_cast<int>(desc.size());
  DT_CHECK(CheckpointError,
           MPI_Allgather(&mine, 1, MPI_INT, sizes.data(), 1, MPI_INT, mc) == MPI_SUCCESS,
           "MPI_Allgather of the pieces' sizes failed");
  std::size_t total_desc = 0;
  for (int r = 0; r < P; ++r) {
    displs[static_cast<std::size_t>(r)] = static_cast<int>(total_desc);
    total_desc += static_cast<std::size_t>(sizes[static_cast<std::size_t>(r)]);
  }
  DT_CHECK(CheckpointError, total_desc < (std::size_t{1} << 31),
           "too many pieces to describe in one sharded save");
  std::vector<std::uint64_t> all;
  on_every_rank([&] {
    all.resize(total_desc);
    return std::string();
  });
  DT_CHECK(CheckpointError,
           MPI_Allgatherv(desc.data(), mine, MPI_UINT64_T, all.data(), sizes.data(), displs.data(),
                          MPI_UINT64_T, mc) == MPI_SUCCESS,
           "MPI_Allgatherv of the pieces failed");
  // Every rank's pieces per tensor, in rank order, each rank's in its own order.
  std::vector<std::vector<Held>> held(T);
  std::vector<int> whole_ranks(T, 0);
  on_every_rank([&] {
    for (int r = 0; r < P; ++r) {
      const std::uint64_t* d = all.data() + displs[static_cast<std::size_t>(r)];
      for (std::size_t i = 0; i < T; ++i) {
        const std::uint64_t h = *d++;
        if (h == kWhole) {
          ++whole_ranks[i];
          continue;
        }
        for (std::uint64_t q = 0; q < h; ++q, d += 4)
          held[i].push_back(Held{r, CkptPiece{d[0], d[1], d[2], d[3], nullptr}});
      }
    }
    all = {};
    return std::string();
  });
  // The checks: each rank sweeps every P-th tensor; all ranks then name the first failing one.
  auto tensor_problem = [&](std::size_t i) -> std::string {
    if (whole_ranks[i] == P) return "";
    if (whole_ranks[i] > 0)
      return tensors[i].path + ": held whole by " + std::to_string(whole_ranks[i]) + " of the " +
             std::to_string(P) +
             " ranks and in ranges or pieces by the others (a whole tensor is replicated: whole "
             "on every rank)";
    return cover_problem(tensors[i], held[i]);
  };
  // (-1: a rank failed to check, out of memory; the one reduction tells every rank either way.)
  std::int64_t first_bad = static_cast<std::int64_t>(T);
  try {
    for (std::size_t i = static_cast<std::size_t>(me); i < T; i += static_cast<std::size_t>(P))
      if (!tensor_problem(i).empty()) {
        first_bad = static_cast<std::int64_t>(i);
        break;
      }
  } catch (const std::exception&) {
    first_bad = -1;
  }
  comm.all_reduce(view_of(&first_bad, 1), ReduceOp::min);
  DT_CHECK(CheckpointError, first_bad >= 0,
           "a rank ran out of memory while checking the pieces of a sharded save");
  if (first_bad < static_cast<std::int64_t>(T))
    DT_THROW(CheckpointError, tensor_problem(static_cast<std::size_t>(first_bad)));

  // The writers: rank r's share of all chunks is [lo[r], lo[r + 1]) (as in my_chunks).
  std::vector<std::size_t> numels;
  std::size_t total = 0;
  for (const auto& t : tensors) {
    numels.push_back(t.numel());
    total += chunks_of(t.numel());
  }
  std::vector<std::size_t> lo(static_cast<std::size_t>(P) + 1);
  for (int r = 0; r <= P; ++r)
    lo[static_cast<std::size_t>(r)] =
        total * static_cast<std::size_t>(r) / static_cast<std::size_t>(P);
  std::vector<Share> shares(T);
  struct Run {
    std::size_t c0, c1;
    int writer;
    std::size_t off;  // in the writer's packed buffer (this rank's runs only)
  };
  std::vector<std::vector<Run>> runs(T);
  std::vector<std::vector<Block>> send(static_cast<std::size_t>(P)), recv(send);
  std::vector<MpiType> types(2 * static_cast<std::size_t>(P));
  std::vector<int> scount(static_cast<std::size_t>(P), 0), rcount(scount), zero(scount);
  std::vector<MPI_Datatype> stype(static_cast<std::size_t>(P), MPI_FLOAT), rtype(stype);
  // The plan, this rank's packed buffers (its share of the data: where an out-of-memory is most
  // likely) and the datatypes of the exchange.
  on_every_rank([&] {
    const auto mine_replicated = my_chunks(numels, me, P);
    std::size_t base = 0;
    for (std::size_t i = 0; i < T; ++i) {
      const std::size_t n = numels[i], k = chunks_of(n);
      Share& s = shares[i];
      if (whole_ranks[i] == P) {
        if (mine_replicated[i].first < mine_replicated[i].second)
          s.runs.push_back(mine_replicated[i]);
        s.whole = tensors[i].data;
        base += k;
        continue;
      }
      std::vector<int> writer(k);
      {
        auto r =
            static_cast<std::size_t>(std::upper_bound(lo.begin(), lo.end(), base) - lo.begin() - 1);
        for (std::size_t c = 0; c < k; ++c) {
          while (lo[r + 1] <= base + c) ++r;
          writer[c] = static_cast<int>(r);
        }
      }
      std::vector<std::size_t> acc(k, 0), touched;
      for (std::size_t q = 0; q < held[i].size();) {
        const int r = held[i][q].rank;
        for (; q < held[i].size() && held[i][q].rank == r; ++q) {
          const CkptPiece& p = held[i][q].p;
          for (std::size_t c = p.begin / K; c * K < piece_end(p); ++c) {
            const std::size_t m = below(p, std::min(n, (c + 1) * K)) - below(p, c * K);
            if (m == 0) continue;
            if (acc[c] == 0) touched.push_back(c);
            acc[c] += m;
          }
        }
        for (std::size_t c : touched) {
          if (2 * acc[c] > std::min(n, (c + 1) * K) - c * K) writer[c] = r;
          acc[c] = 0;
        }
        touched.clear();
      }
      std::size_t packed = 0;
      for (std::size_t c = 0; c < k;) {
        std::size_t c1 = c + 1;
        while (c1 < k && writer[c1] == writer[c]) ++c1;
        runs[i].push_back(Run{c, c1, writer[c], writer[c] == me ? packed : 0});
        if (writer[c] == me) {
          s.runs.emplace_back(c, c1);
          packed += std::min(n, c1 * K) - c * K;
        }
        c = c1;
      }
      s.packed.resize(packed);
      // The runs that meet piece p: from the one holding its first element to its last one.
      auto first_run = [&](const CkptPiece& p) {
        const std::size_t c = p.begin / K;
        return std::upper_bound(runs[i].begin(), runs[i].end(), c,
                                [](std::size_t x, const Run& u) { return x < u.c0; }) -
               1;
      };
      // This rank's pieces go to the writers of the chunks they meet (copied here for its own).
      for (const CkptPiece& p : own[i])
        for (auto u = first_run(p); u != runs[i].end() && u->c0 * K < piece_end(p); ++u) {
          const std::size_t a = u->c0 * K, b = std::min(n, u->c1 * K);
          for_each_seg(p, a, b, [&](const Seg& g) {
            if (u->writer != me) {
              send[static_cast<std::size_t>(u->writer)].push_back(
                  Block{p.data + g.off, g.n, g.m, p.len});
              return;
            }
            for (std::size_t j = 0; j < g.m; ++j)
              std::memcpy(s.packed.data() + u->off + (g.e + j * p.stride - a),
                          p.data + g.off + j * p.len, g.n * sizeof(float));
          });
        }
      // The other ranks' pieces that meet this rank's chunks, in the order their holders send them.
      for (const Held& h : held[i]) {
        if (h.rank == me) continue;
        for (auto u = first_run(h.p); u != runs[i].end() && u->c0 * K < piece_end(h.p); ++u) {
          if (u->writer != me) continue;
          const std::size_t a = u->c0 * K, b = std::min(n, u->c1 * K);
          for_each_seg(h.p, a, b, [&](const Seg& g) {
            recv[static_cast<std::size_t>(h.rank)].push_back(
                Block{s.packed.data() + u->off + (g.e - a), g.n, g.m, h.p.stride});
          });
        }
      }
      base += k;
    }
    held = {};
    for (std::size_t d = 0; d < static_cast<std::size_t>(P); ++d) {
      if (!send[d].empty()) {
        types[2 * d] = block_type(send[d]);
        stype[d] = types[2 * d].get();
        scount[d] = 1;
      }
      if (!recv[d].empty()) {
        types[2 * d + 1] = block_type(recv[d]);
        rtype[d] = types[2 * d + 1].get();
        rcount[d] = 1;
      }
    }
    return std::string();
  });
  const trace::Scope exchange_scope("ckpt.exchange", "ckpt");
  DT_CHECK(CheckpointError,
           MPI_Alltoallw(MPI_BOTTOM, scount.data(), zero.data(), stype.data(), MPI_BOTTOM,
                         rcount.data(), zero.data(), rtype.data(), mc) == MPI_SUCCESS,
           "MPI_Alltoallw of the pieces of a sharded save failed");
  return shares;
}

// Selects the row-major element range [a, b) of a dataspace of `shape` (any rank; 0-D as [1]):
// replaces the selection (none when a == b), or with H5S_SELECT_OR adds to it. The range splits
// into at most 2 * rank - 1 hyperslabs: a partial head and tail, recursively, around whole blocks
// of the outermost dimension.
void select_range(hid_t space, const Shape& shape, std::size_t a, std::size_t b,
                  const std::string& file, H5S_seloper_t op = H5S_SELECT_SET) {
  if (a >= b) {
    if (op == H5S_SELECT_SET) h5(H5Sselect_none(space), "H5Sselect_none", file, 0);
    return;
  }
  const std::size_t nd = std::max<std::size_t>(shape.size(), 1);
  std::vector<hsize_t> extent(nd, 1);
  for (std::size_t d = 0; d < shape.size(); ++d) extent[d] = static_cast<hsize_t>(shape[d]);
  std::vector<hsize_t> start(nd, 0), count(nd, 1);
  bool first = true;
  // Elements [a, b) of the sub-block at dimension d (the dimensions before d fixed in `start`),
  // with `inner` elements per index of d; 0 <= a < b <= extent[d] * inner.
  auto select = [&](auto&& self, std::size_t d, std::size_t a0, std::size_t b0) -> void {
    std::size_t inner = 1;
    for (std::size_t e = d + 1; e < nd; ++e) inner *= static_cast<std::size_t>(extent[e]);
    const std::size_t i0 = a0 / inner, i1 = b0 / inner;
    auto block = [&](std::size_t from, std::size_t to) {  // indices [from, to) of d, whole
      if (from >= to) return;
      start[d] = from;
      count[d] = to - from;
      for (std::size_t e = d + 1; e < nd; ++e) {
        start[e] = 0;
        count[e] = extent[e];
      }
      h5(H5Sselect_hyperslab(space, first ? op : H5S_SELECT_OR, start.data(), nullptr, count.data(),
                             nullptr),
         "H5Sselect_hyperslab", file, 0);
      first = false;
    };
    auto part = [&](std::size_t i, std::size_t x0, std::size_t x1) {  // [x0, x1) inside index i
      start[d] = i;
      count[d] = 1;
      self(self, d + 1, x0, x1);
    };
    if (a0 % inner == 0 && b0 % inner == 0) return block(i0, i1);
    if (i0 == i1) return part(i0, a0 % inner, b0 % inner);
    std::size_t from = i0;
    if (a0 % inner != 0) {
      part(i0, a0 % inner, inner);
      ++from;
    }
    block(from, i1);
    if (b0 % inner != 0) part(i1, 0, b0 % inner);
  };
  select(select, 0, a, b);
}

// Selects the row-major element ranges `ranges` (ascending, disjoint) of a dataspace of `shape`;
// none if empty.
void select_ranges(hid_t space, const Shape& shape,
                   const std::vector<std::pair<std::size_t, std::size_t>>& ranges,
                   const std::string& file) {
  h5(H5Sselect_none(space), "H5Sselect_none", file, 0);
  for (const auto& [a, b] : ranges) select_range(space, shape, a, b, file, H5S_SELECT_OR);
}

H5 file_access(MPI_Comm comm, const std::string& file) {
  H5 fapl(h5(H5Pcreate(H5P_FILE_ACCESS), "H5Pcreate", file), H5Pclose);
  h5(H5Pset_fapl_mpio(fapl, comm, MPI_INFO_NULL), "H5Pset_fapl_mpio", file, 0);
  h5(H5Pset_all_coll_metadata_ops(fapl, true), "H5Pset_all_coll_metadata_ops", file, 0);
  h5(H5Pset_coll_metadata_write(fapl, true), "H5Pset_coll_metadata_write", file, 0);
  h5(H5Pset_alignment(fapl, 64 * 1024, 1024 * 1024), "H5Pset_alignment", file, 0);
  return fapl;
}

// Data transfers are independent: each rank's selection is one large contiguous run of the file
// per dataset, so collective buffering would only add a copy through the aggregators (measured
// here: 1.2-1.8x slower saves and loads, perf/RESULTS.md). Metadata stays collective (fapl).
H5 data_xfer(const std::string& file) {
  H5 dxpl(h5(H5Pcreate(H5P_DATASET_XFER), "H5Pcreate", file), H5Pclose);
  h5(H5Pset_dxpl_mpio(dxpl, H5FD_MPIO_INDEPENDENT), "H5Pset_dxpl_mpio", file, 0);
  return dxpl;
}

void write_attr(hid_t obj, const char* name, std::int64_t v, const std::string& file) {
  H5 sp(h5(H5Screate(H5S_SCALAR), "H5Screate", file), H5Sclose);
  H5 a(h5(H5Acreate2(obj, name, H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT), "H5Acreate2", file),
       H5Aclose);
  h5(H5Awrite(a, H5T_NATIVE_INT64, &v), "H5Awrite", file, 0);
}
void write_attr(hid_t obj, const char* name, double v, const std::string& file) {
  H5 sp(h5(H5Screate(H5S_SCALAR), "H5Screate", file), H5Sclose);
  H5 a(h5(H5Acreate2(obj, name, H5T_IEEE_F64LE, sp, H5P_DEFAULT, H5P_DEFAULT), "H5Acreate2", file),
       H5Aclose);
  h5(H5Awrite(a, H5T_NATIVE_DOUBLE, &v), "H5Awrite", file, 0);
}
void write_attr(hid_t obj, const char* name, const std::string& v, const std::string& file) {
  H5 t(h5(H5Tcopy(H5T_C_S1), "H5Tcopy", file), H5Tclose);
  h5(H5Tset_size(t, std::max<std::size_t>(1, v.size())), "H5Tset_size", file, 0);
  H5 sp(h5(H5Screate(H5S_SCALAR), "H5Screate", file), H5Sclose);
  H5 a(h5(H5Acreate2(obj, name, t, sp, H5P_DEFAULT, H5P_DEFAULT), "H5Acreate2", file), H5Aclose);
  std::string buf = v.empty() ? std::string(1, '\0') : v;
  h5(H5Awrite(a, t, buf.data()), "H5Awrite", file, 0);
}

bool has_attr(hid_t obj, const char* name) { return H5Aexists(obj, name) > 0; }

// Attribute `name` of `obj`, which must hold one value: a read fills a buffer of one, which an
// array (a damaged or hostile file's) would overrun.
H5 open_one_attr(hid_t obj, const char* name, const std::string& file) {
  DT_CHECK(CheckpointError, has_attr(obj, name), file, ": attribute '", name, "' is missing");
  H5 a(h5(H5Aopen(obj, name, H5P_DEFAULT), "H5Aopen", file), H5Aclose);
  H5 sp(h5(H5Aget_space(a), "H5Aget_space", file), H5Sclose);
  const hssize_t n = H5Sget_simple_extent_npoints(sp);
  DT_CHECK(CheckpointError, n == 1, file, ": attribute '", name, "' holds ", n, " values, not one");
  return a;
}
std::int64_t read_int_attr(hid_t obj, const char* name, const std::string& file) {
  const H5 a = open_one_attr(obj, name, file);
  std::int64_t v = 0;
  h5(H5Aread(a, H5T_NATIVE_INT64, &v), "H5Aread", file, 0);
  return v;
}
double read_double_attr(hid_t obj, const char* name, const std::string& file) {
  const H5 a = open_one_attr(obj, name, file);
  double v = 0;
  h5(H5Aread(a, H5T_NATIVE_DOUBLE, &v), "H5Aread", file, 0);
  return v;
}
std::string read_string_attr(hid_t obj, const char* name, const std::string& file) {
  const H5 a = open_one_attr(obj, name, file);
  H5 t(h5(H5Aget_type(a), "H5Aget_type", file), H5Tclose);
  DT_CHECK(CheckpointError, H5Tget_class(t) == H5T_STRING, file, ": attribute '", name,
           "' is not a string");
  if (H5Tis_variable_str(t) > 0) {  // as h5py writes a str
    H5 mt(h5(H5Tcopy(H5T_C_S1), "H5Tcopy", file), H5Tclose);
    h5(H5Tset_size(mt, H5T_VARIABLE), "H5Tset_size", file, 0);
    char* p = nullptr;
    h5(H5Aread(a, mt, &p), "H5Aread", file, 0);
    std::string v = p != nullptr ? p : "";
    H5free_memory(p);
    return v;
  }
  const std::size_t n = H5Tget_size(t);
  std::string v(n, '\0');
  h5(H5Aread(a, t, v.data()), "H5Aread", file, 0);
  v.resize(std::strlen(v.c_str()));
  return v;
}
/// Attribute `name` of `obj`, "" when it has none.
std::string string_attr_or_empty(hid_t obj, const char* name, const std::string& file) {
  return has_attr(obj, name) ? read_string_attr(obj, name, file) : "";
}

std::string checksum_path(const std::string& p) { return "/checksums" + p; }

// ---- encryption at rest -------------------------------------------------------------------------

constexpr const char* kEncryption = "aes-256-gcm";
constexpr std::size_t kCryptoRow = security::kNonceBytes + security::kTagBytes;  // nonce, tag

std::string crypto_path(const std::string& p) { return "/crypto" + p; }

std::array<std::uint8_t, security::kNonceBytes> chunk_nonce(std::uint32_t ordinal,
                                                            std::uint64_t chunk) {
  std::array<std::uint8_t, security::kNonceBytes> n{};
  for (int b = 0; b < 4; ++b) n[static_cast<std::size_t>(b)] = (ordinal >> (8 * b)) & 0xFF;
  for (int b = 0; b < 8; ++b) n[static_cast<std::size_t>(4 + b)] = (chunk >> (8 * b)) & 0xFF;
  return n;
}

void put_u64(std::string& a, std::uint64_t v) {
  for (int b = 0; b < 8; ++b) a.push_back(static_cast<char>((v >> (8 * b)) & 0xFF));
}

// The extent a tensor's dataset has in the file: its shape, and {1} for a 0-D tensor (a scalar).
Shape stored_shape(const Shape& shape) { return shape.empty() ? Shape{1} : shape; }

// Binds a chunk to its dataset (path and stored extent), its place and its size.
std::string chunk_aad(const std::string& path, const Shape& shape, std::uint64_t chunk,
                      std::uint64_t bytes) {
  std::string a = "dt-ckpt-v1";
  a.push_back('\0');
  a += path;
  a.push_back('\0');
  const Shape stored = stored_shape(shape);
  put_u64(a, stored.size());
  for (auto d : stored) put_u64(a, static_cast<std::uint64_t>(d));
  for (int b = 0; b < 8; ++b) a.push_back(static_cast<char>((chunk >> (8 * b)) & 0xFF));
  for (int b = 0; b < 8; ++b) a.push_back(static_cast<char>((bytes >> (8 * b)) & 0xFF));
  return a;
}

constexpr const char* kKeyCheckAad = "dt-ckpt-key-check";

// The root attributes a checkpoint's meta data is read from, serialised for authentication, as
// format `version` has them (version 3 added the loss scaler's schedule, version 4 the data).
std::string meta_aad(const CkptMeta& m, std::int64_t version) {
  std::string a = version >= 4   ? "dt-ckpt-meta-v4"
                  : version >= 3 ? "dt-ckpt-meta-v3"
                                 : "dt-ckpt-meta-v1";
  a.push_back('\0');
  for (std::int64_t v : {m.step, m.tokens, m.optimizer_step, m.data_position, m.rng_seed})
    put_u64(a, static_cast<std::uint64_t>(v));
  std::uint64_t ls = 0;
  static_assert(sizeof ls == sizeof m.loss_scale, "double is 64 bits");
  std::memcpy(&ls, &m.loss_scale, sizeof ls);
  put_u64(a, ls);
  if (version >= 3)
    for (std::int64_t v :
         {m.loss_scale_growth_tracker, m.loss_scale_hysteresis_left, m.steps_skipped})
      put_u64(a, static_cast<std::uint64_t>(v));
  put_u64(a, m.config.size());
  a += m.config;
  put_u64(a, m.layout.size());
  a += m.layout;
  if (version >= 4) {
    put_u64(a, m.data.size());
    a += m.data;
  }
  return a;
}

// The tag that authenticates the meta data under the file key.
std::array<std::uint8_t, security::kTagBytes> meta_tag(security::Aead& enc, const CkptMeta& m,
                                                       std::int64_t version) {
  std::array<std::uint8_t, security::kTagBytes> tag{};
  const auto nonce = chunk_nonce(0xFFFFFFFEu, ~std::uint64_t{0});
  const std::string aad = meta_aad(m, version);
  enc.seal(nonce.data(), reinterpret_cast<const std::uint8_t*>(aad.data()), aad.size(), nullptr, 0,
           nullptr, tag.data());
  return tag;
}

// The tag of an empty message under the file key: tells a wrong key apart from damage.
std::array<std::uint8_t, security::kTagBytes> key_check(security::Aead& enc) {
  std::array<std::uint8_t, security::kTagBytes> tag{};
  const auto nonce = chunk_nonce(0xFFFFFFFFu, ~std::uint64_t{0});
  enc.seal(nonce.data(), reinterpret_cast<const std::uint8_t*>(kKeyCheckAad),
           std::strlen(kKeyCheckAad), nullptr, 0, nullptr, tag.data());
  return tag;
}

using security::to_hex;

// The hex SHA-256 of `s` (root attributes meta_sha256, of meta_aad, and manifest_sha256).
std::string hex_sha256(const std::string& s) {
  const Digest d = sha256(s.data(), s.size());
  return to_hex(d.data(), d.size());
}

// "PATH D0xD1...\n" for every tensor (its stored extent), in path order: what manifest_sha256
// digests (the list itself could outgrow an attribute).
std::string manifest_text(const std::vector<CkptTensor>& tensors) {
  std::vector<std::string> lines;
  for (const auto& t : tensors) {
    std::string l = t.path + " ";
    const Shape s = stored_shape(t.shape);
    for (std::size_t k = 0; k < s.size(); ++k) l += (k ? "x" : "") + std::to_string(s[k]);
    lines.push_back(l + "\n");
  }
  std::sort(lines.begin(), lines.end());
  std::string out;
  for (const auto& l : lines) out += l;
  return out;
}

// What root attribute crypto_sha256 digests: the key attributes of an encrypted file (key_salt,
// key_check, meta_tag), which no other digest covers. With it a damaged tag is told from one
// rewritten by someone without the key.
std::string crypto_text(const std::string& salt_hex, const std::string& check_hex,
                        const std::string& meta_hex) {
  return salt_hex + "\n" + check_hex + "\n" + meta_hex + "\n";
}

// Parses exactly n bytes of hex; false for anything else.
bool from_hex(const std::string& s, std::uint8_t* out, std::size_t n) {
  if (s.size() != 2 * n) return false;
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (std::size_t i = 0; i < n; ++i) {
    const int hi = nib(s[2 * i]), lo = nib(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<std::uint8_t>(hi * 16 + lo);
  }
  return true;
}

std::string step_name(std::int64_t step) { return "step-" + std::to_string(step) + ".h5"; }

}  // namespace

// ---- save ---------------------------------------------------------------------------------------

// Why `tensors` cannot be datasets of one file ("" if they can): every path absolute, with no
// empty component, outside /checksums and /crypto, unique, and none inside another's (a dataset
// is no group).
std::string paths_problem(const std::vector<CkptTensor>& tensors) {
  std::vector<std::string> paths;
  for (const auto& t : tensors) {
    const std::string& p = t.path;
    if (p.size() < 2 || p[0] != '/' || p.back() == '/' || p.find("//") != std::string::npos)
      return "tensor path '" + p + "' is not of the form /name or /group/name";
    for (const char* reserved : {"/checksums", "/crypto"})
      if (p == reserved || p.rfind(std::string(reserved) + "/", 0) == 0)
        return "tensor path '" + p + "' lies under " + reserved + ", which the checkpoint reserves";
    paths.push_back(p);
  }
  std::sort(paths.begin(), paths.end());
  for (std::size_t i = 1; i < paths.size(); ++i) {
    if (paths[i] == paths[i - 1]) return "tensor path '" + paths[i] + "' is given twice";
    if (paths[i].rfind(paths[i - 1] + "/", 0) == 0)
      return "tensor path '" + paths[i] + "' lies inside tensor '" + paths[i - 1] + "'";
  }
  return "";
}

SaveStats save_checkpoint(Comm& comm, const std::string& dir,
                          const std::vector<CkptTensor>& tensors, const CkptMeta& meta, int keep,
                          const std::function<void()>& after_write, const security::Keys* keys) {
  static const Quiet quiet;
  DT_CHECK(CheckpointError, keep >= 1, "ckpt.keep must be at least 1, got ", keep);
  const trace::Scope save_scope("ckpt.save", "ckpt", "step", meta.step);
  const auto t0 = Clock::now();
  MpiComm& mc = mpi_of(comm);
  const std::string final_path = dir + "/" + step_name(meta.step);
  const std::string partial = final_path + ".partial";
  SaveStats stats;
  stats.path = final_path;

  // Checked before the file exists (its datasets are created under an abort guard), and agreed
  // on with rank 0's preparation.
  std::string err = paths_problem(tensors);
  if (!err.empty()) err = "cannot save " + final_path + ": " + err;
  bool ok = err.empty();
  if (ok && comm.rank() == 0) {
    try {
      mkdirs(dir);
      ::unlink(partial.c_str());
      // Interrupted saves (a failed one, say, which left its partial file) take room the space
      // check below would count as used, and temporary files of `latest` that a run ended
      // before renaming are of no use: they go now, in one listing (this folder's writer holds
      // the claim, so none is another's under way). A folder that cannot be listed keeps them.
      std::vector<std::string> names;
      try {
        names = dir_entries(dir);
      } catch (const CheckpointError&) {
      }
      const std::string left = metrics::temporary_prefix("latest");
      for (const auto& name : names) {
        std::int64_t step = 0;
        if (parse_step(name, ".h5.partial", &step) || name.compare(0, left.size(), left) == 0)
          ::unlink((dir + "/" + name).c_str());
      }
    } catch (const Error& e) {
      ok = false;
      err = e.message();
    }
  }
  if (!all_ok(comm, ok))
    DT_THROW(CheckpointError, err.empty() ? "rank 0 cannot prepare " + dir : err);

  for (const auto& t : tensors) stats.bytes += t.numel() * sizeof(float);
  // Room for the whole file on its file system, as each rank sees it (statvfs; a file system
  // that reports no size is not checked): a save that cannot fit is refused on every rank before
  // the file exists, instead of failing part-way on some ranks (which ends the job; see the
  // writes below). A disk that fills up during the save is still caught there.
  {
    std::uint64_t need = 256 << 10;  // the superblock, groups and heaps, with room to spare
    for (const auto& t : tensors) {
      const std::uint64_t chunks = chunks_of(t.numel());
      // data and digests, and up to 2 KiB of object header for each of its (up to 4) datasets
      need += t.numel() * sizeof(float) + chunks * 32 + (keys ? 4 : 2) * 2048;
      if (keys) need += chunks * (kCryptoRow + 32);
    }
    struct statvfs fs {};
    std::string short_of;
    if (::statvfs(dir.c_str(), &fs) == 0 && fs.f_blocks > 0) {
      const std::uint64_t avail = static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize;
      if (avail < need)
        short_of = "not enough space in " + dir + " on rank " + std::to_string(comm.rank()) +
                   ": the file needs about " + format_bytes(static_cast<double>(need)) + ", " +
                   format_bytes(static_cast<double>(avail)) + " are free";
    }
    if (!all_ok(comm, short_of.empty()))
      DT_THROW(CheckpointError, "cannot save ", final_path, ": ",
               short_of.empty() ? "not enough space in " + dir + " on another rank" : short_of);
  }
  // The chunks this rank writes and digests: a share of all chunks read in place when every
  // tensor is replicated, else as sharded_shares assigns them.
  int sharded = 0;
  for (const auto& t : tensors) sharded |= t.whole() ? 0 : 1;
  comm.all_reduce(view_of(&sharded, 1), ReduceOp::max);
  std::vector<Share> shares;
  try {
    shares = sharded ? sharded_shares(comm, tensors)
                     : replicated_shares(tensors, comm.rank(), comm.size());
  } catch (const CheckpointError& e) {  // the same on every rank
    DT_THROW(CheckpointError, "cannot save ", final_path, ": ", e.message());
  }
  // ckpt.encrypt: this rank's chunks are sealed first; the digests and the file get the
  // ciphertext. A packed share is sealed in place; sealed[i] holds a sealed copy of a share read
  // in place (packed like a packed share).
  std::vector<std::vector<float>> sealed(keys ? tensors.size() : 0);
  std::vector<std::vector<unsigned char>> crypto_rows(keys ? tensors.size() : 0);
  std::vector<std::vector<unsigned char>> crypto_sums(keys ? tensors.size() : 0);
  // Chunk x of tensor i in plain text.
  auto plain = [&](std::size_t i, const ShareChunk& x) -> const float* {
    return shares[i].whole ? shares[i].whole + x.e0 : shares[i].packed.data() + x.at;
  };
  std::string salt_hex, check_hex, meta_hex;
  if (keys) {
    // The file's salt is the SHA-256 (first 16 bytes) of a salt each rank draws, all gathered:
    // every rank's key depends on randomness it drew itself, so no salt altered or replayed in
    // transit (an older file's key_salt, say) can make it encrypt under an earlier key with the
    // same chunk nonces. An altered salt only leaves a file that fails authentication.
    security::Salt salt{}, mine{};
    try {
      mine = security::random_salt();
    } catch (const Error& e) {
      ok = false;
      err = e.message();
    }
    if (!all_ok(comm, ok))
      DT_THROW(CheckpointError, "encrypting ", partial, " failed",
               err.empty() ? std::string(" on another rank") : ": " + err);
    std::vector<std::uint8_t> all(mine.size() * static_cast<std::size_t>(comm.size()));
    comm.all_gather(ConstTensorView{mine.data(), mine.size(), DType::u8},
                    TensorView{all.data(), all.size(), DType::u8});
    const Digest combined = sha256(all.data(), all.size());
    std::copy_n(combined.begin(), salt.size(), salt.begin());
    try {
      const trace::Scope seal_scope("ckpt.seal", "ckpt");
      DT_CHECK(CheckpointError, tensors.size() < 0xFFFFFFFFu, "too many tensors to encrypt");
      security::Aead enc(keys->checkpoint_key(salt), true, keys->aes());
      for (std::size_t i = 0; i < tensors.size(); ++i) {
        Share& sh = shares[i];
        if (sh.whole) {
          std::size_t n = 0;
          for (const auto& [c0, c1] : sh.runs)
            n += std::min(c1 * kChunkElements, tensors[i].numel()) - c0 * kChunkElements;
          sealed[i].resize(n);
        }
        crypto_rows[i].resize(sh.chunks() * kCryptoRow + kCryptoRow);
        for_each_chunk(sh, tensors[i].numel(), [&](const ShareChunk& x) {
          const auto nonce = chunk_nonce(static_cast<std::uint32_t>(i), x.c);
          const std::string aad =
              chunk_aad(tensors[i].path, tensors[i].shape, x.c, (x.e1 - x.e0) * sizeof(float));
          unsigned char* row = crypto_rows[i].data() + x.q * kCryptoRow;
          std::copy(nonce.begin(), nonce.end(), row);
          float* out = sh.whole ? sealed[i].data() + x.at : sh.packed.data() + x.at;
          enc.seal(nonce.data(), reinterpret_cast<const std::uint8_t*>(aad.data()), aad.size(),
                   plain(i, x), (x.e1 - x.e0) * sizeof(float), out, row + security::kNonceBytes);
        });
        // Each row's digest beside the chunks' (a damaged row is told from a forged one).
        crypto_sums[i].resize(sh.chunks() * 32 + 32);
        for (std::size_t q = 0; q < sh.chunks(); ++q) {
          const Digest dg = sha256(crypto_rows[i].data() + q * kCryptoRow, kCryptoRow);
          std::copy(dg.begin(), dg.end(),
                    crypto_sums[i].begin() + static_cast<std::ptrdiff_t>(q * 32));
        }
      }
      const auto check = key_check(enc);
      const auto mtag = meta_tag(enc, meta, kCheckpointVersion);
      salt_hex = to_hex(salt.data(), salt.size());
      check_hex = to_hex(check.data(), check.size());
      meta_hex = to_hex(mtag.data(), mtag.size());
    } catch (const Error& e) {
      ok = false;
      err = e.message();
    } catch (const std::exception& e) {  // out of memory on this rank: the others must hear
      ok = false;
      err = e.what();
    }
    if (!all_ok(comm, ok))
      DT_THROW(CheckpointError, "encrypting ", partial, " failed",
               err.empty() ? std::string(" on another rank") : ": " + err);
  }
  // Chunk x of tensor i as this rank writes it (plain, or sealed).
  auto source = [&](std::size_t i, const ShareChunk& x) -> const float* {
    if (keys && shares[i].whole) return sealed[i].data() + x.at;
    return plain(i, x);
  };
  try {
    H5 fapl = file_access(mc.handle(), partial);
    // From the file's creation on, an error on some ranks only cannot be unwound safely: closing
    // the file and its datasets is collective, and the other ranks are elsewhere. Unless the ranks
    // agreed on the failure (agreed = true), this guard, destroyed before any of them, aborts the
    // job with the reason instead of letting it hang. Nothing is committed, so the previous
    // checkpoint stays the latest.
    bool agreed = false;
    struct AbortUnlessAgreed {
      const bool& agreed;
      const std::string& file;
      int rank;
      ~AbortUnlessAgreed() {
        if (std::uncaught_exceptions() == 0 || agreed) return;
        std::fprintf(stderr,
                     "dt: rank %d: saving %s failed on some ranks only; aborting the job so that "
                     "no rank waits forever in a collective HDF5 call (the previous checkpoint is "
                     "intact)\n",
                     rank, file.c_str());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 3);
      }
    };
    // The creation itself is agreed on: where it failed on every rank, each unwinds (nothing to
    // close); where on some only, the others (which hold the file) abort through the guard.
    // A new file (EXCL): rank 0 removed any partial above, so a name taken meanwhile (a link
    // another writer of the folder put there) fails the save instead of being written through.
    H5 f(H5Fcreate(partial.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, fapl), H5Fclose);
    bool created = f.get() >= 0;
    std::string create_err = created ? "" : h5_message();
    if (created && injected_fault("DT_TEST_CKPT_CREATE_FAIL", comm, partial)) {
      created = false;  // as if this rank had no file (it still holds one, closed on unwinding)
      create_err = "DT_TEST_CKPT_CREATE_FAIL on rank " + std::to_string(comm.rank());
    }
    if (!all_ok(comm, created)) {
      agreed = !created;
      const AbortUnlessAgreed guard{agreed, partial, comm.rank()};
      DT_THROW(CheckpointError, "H5Fcreate(", partial, ") failed",
               create_err.empty() ? std::string(" on another rank") : ": " + create_err);
    }
    {  // every object in the file is closed at the end of this block, before the file
      H5 lcpl(h5(H5Pcreate(H5P_LINK_CREATE), "H5Pcreate", partial), H5Pclose);
      h5(H5Pset_create_intermediate_group(lcpl, 1), "H5Pset_create_intermediate_group", partial, 0);
      H5 dxpl = data_xfer(partial);

      // Create every dataset first (collective metadata), then one write per dataset. The guard
      // comes after the sets' handles, so it is destroyed before they are closed.
      std::vector<H5> data_sets, sum_sets, crypto_sets, crypto_sum_sets;
      const AbortUnlessAgreed guard{agreed, partial, comm.rank()};
      try {
        for (const auto& t : tensors) {
          const Shape stored = stored_shape(t.shape);
          std::vector<hsize_t> dims(stored.begin(), stored.end());
          H5 sp(h5(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                   "H5Screate_simple", partial),
                H5Sclose);
          data_sets.emplace_back(
              h5(H5Dcreate2(f, t.path.c_str(), H5T_IEEE_F32LE, sp, lcpl, H5P_DEFAULT, H5P_DEFAULT),
                 "H5Dcreate2", partial),
              H5Dclose);
          hsize_t cdims[2] = {chunks_of(t.numel()), 32};
          H5 csp(h5(H5Screate_simple(2, cdims, nullptr), "H5Screate_simple", partial), H5Sclose);
          sum_sets.emplace_back(h5(H5Dcreate2(f, checksum_path(t.path).c_str(), H5T_STD_U8LE, csp,
                                              lcpl, H5P_DEFAULT, H5P_DEFAULT),
                                   "H5Dcreate2", partial),
                                H5Dclose);
          if (keys) {
            hsize_t rdims[2] = {chunks_of(t.numel()), kCryptoRow};
            H5 rsp(h5(H5Screate_simple(2, rdims, nullptr), "H5Screate_simple", partial), H5Sclose);
            crypto_sets.emplace_back(h5(H5Dcreate2(f, crypto_path(t.path).c_str(), H5T_STD_U8LE,
                                                   rsp, lcpl, H5P_DEFAULT, H5P_DEFAULT),
                                        "H5Dcreate2", partial),
                                     H5Dclose);
            crypto_sum_sets.emplace_back(
                h5(H5Dcreate2(f, checksum_path(crypto_path(t.path)).c_str(), H5T_STD_U8LE, csp,
                              lcpl, H5P_DEFAULT, H5P_DEFAULT),
                   "H5Dcreate2", partial),
                H5Dclose);
          }
        }
      } catch (const std::exception& e) {  // the guard aborts: say why first
        std::fprintf(stderr, "dt: rank %d: %s\n", comm.rank(), e.what());
        throw;
      }
      // Writes `count` elements of `type` from `buf` (packed in file order) to the selection `fsp`.
      auto write_packed = [&](hid_t set, hid_t fsp, hid_t type, const void* buf,
                              std::size_t count) {
        hsize_t m = std::max<std::size_t>(count, 1);
        H5 msp(h5(H5Screate_simple(1, &m, nullptr), "H5Screate_simple", partial), H5Sclose);
        if (count == 0) h5(H5Sselect_none(msp), "H5Sselect_none", partial, 0);
        const float none = 0.0f;
        h5(H5Dwrite(set, type, msp, fsp, dxpl, count ? buf : &none), "H5Dwrite", partial, 0);
      };
      // The digests of this rank's chunks are computed in a second thread while this one writes.
      std::vector<std::vector<unsigned char>> all_sums(tensors.size());
      std::exception_ptr hash_error;
      std::thread hasher([&] {
        try {
          trace::set_thread_name("ckpt-hash");
          const trace::Scope hash_scope("ckpt.hash", "ckpt");
          for (std::size_t i = 0; i < tensors.size(); ++i) {
            all_sums[i].resize(shares[i].chunks() * 32 + 32);
            for_each_chunk(shares[i], tensors[i].numel(), [&](const ShareChunk& x) {
              const Digest d = sha256(source(i, x), (x.e1 - x.e0) * sizeof(float));
              std::copy(d.begin(), d.end(),
                        all_sums[i].begin() + static_cast<std::ptrdiff_t>(x.q * 32));
            });
          }
        } catch (...) {
          hash_error = std::current_exception();
        }
      });
      struct Join {
        std::thread& t;
        ~Join() {
          if (t.joinable()) t.join();
        }
      } join{hasher};
      // Independent transfers can fail on one rank only (a full or failing disk): each rank
      // records its failure, and all ranks agree before the next collective call.
      bool wrote = true;
      std::string write_err;
      try {
        const trace::Scope write_scope("ckpt.write", "ckpt");
        for (std::size_t i = 0; i < tensors.size(); ++i) {
          const CkptTensor& t = tensors[i];
          std::vector<std::pair<std::size_t, std::size_t>> ranges;
          for (const auto& [c0, c1] : shares[i].runs)
            ranges.emplace_back(c0 * kChunkElements, std::min(c1 * kChunkElements, t.numel()));
          H5 fsp(h5(H5Dget_space(data_sets[i]), "H5Dget_space", partial), H5Sclose);
          select_ranges(fsp, t.shape, ranges, partial);
          if (shares[i].whole && !keys) {  // from the tensor in place
            hsize_t n = std::max<std::size_t>(t.numel(), 1);
            H5 msp(h5(H5Screate_simple(1, &n, nullptr), "H5Screate_simple", partial), H5Sclose);
            select_ranges(msp, Shape{static_cast<std::int64_t>(n)}, ranges, partial);
            h5(H5Dwrite(data_sets[i], H5T_NATIVE_FLOAT, msp, fsp, dxpl, t.data), "H5Dwrite",
               partial, 0);
            continue;
          }
          const bool copy = keys && shares[i].whole;  // the sealed copy of a share read in place
          write_packed(data_sets[i], fsp, H5T_NATIVE_FLOAT,
                       copy ? sealed[i].data() : shares[i].packed.data(),
                       copy ? sealed[i].size() : shares[i].packed.size());
        }
      } catch (const std::exception& e) {
        wrote = false;
        write_err = e.what();
      }
      hasher.join();
      if (hash_error) {
        try {
          std::rethrow_exception(hash_error);
        } catch (const std::exception& e) {
          wrote = false;
          write_err = e.what();
        }
      }
      try {
        if (wrote)
          for (std::size_t i = 0; i < tensors.size(); ++i) {
            const std::size_t k = chunks_of(tensors[i].numel());
            std::vector<std::pair<std::size_t, std::size_t>> rows;
            for (const auto& [c0, c1] : shares[i].runs) rows.emplace_back(c0, c1);
            // Rows [c0, c1) of a [k, width] dataset, from a buffer of this rank's rows in order.
            auto write_rows = [&](hid_t set, std::size_t width, const unsigned char* buf) {
              std::vector<std::pair<std::size_t, std::size_t>> elems;
              for (const auto& [c0, c1] : rows) elems.emplace_back(c0 * width, c1 * width);
              H5 fsp(h5(H5Dget_space(set), "H5Dget_space", partial), H5Sclose);
              select_ranges(fsp,
                            Shape{static_cast<std::int64_t>(k), static_cast<std::int64_t>(width)},
                            elems, partial);
              write_packed(set, fsp, H5T_NATIVE_UCHAR, buf, shares[i].chunks() * width);
            };
            write_rows(sum_sets[i], 32, all_sums[i].data());
            if (keys) {
              write_rows(crypto_sets[i], kCryptoRow, crypto_rows[i].data());
              write_rows(crypto_sum_sets[i], 32, crypto_sums[i].data());
            }
          }
      } catch (const std::exception& e) {
        wrote = false;
        write_err = e.what();
      }
      if (!all_ok(comm, wrote)) {
        // Where the writes failed on every rank, each unwinds, closing the file on all of them.
        // Where on some only (a disk or quota that filled up under one rank's writes), HDF5's
        // state differs between the ranks: a rank whose write failed skips the flush that the
        // others enter when the file closes, and the close would hang. The guard then aborts the
        // job, each failing rank saying why first.
        agreed = all_ok(comm, !wrote);
        if (!agreed && !wrote) {
          std::fprintf(stderr,
                       "dt: rank %d: writing %s failed: %s; the writes failed on some ranks only\n",
                       comm.rank(), partial.c_str(), write_err.c_str());
          std::fflush(stderr);
        }
        DT_THROW(CheckpointError, "writing ", partial, " failed",
                 write_err.empty() ? std::string(" on another rank") : ": " + write_err);
      }
      H5 root(h5(H5Gopen2(f, "/", H5P_DEFAULT), "H5Gopen2", partial), H5Gclose);
      write_attr(root, "format", std::string(kCheckpointFormat), partial);
      write_attr(root, "format_version", std::int64_t{kCheckpointVersion}, partial);
      write_attr(root, "step", meta.step, partial);
      write_attr(root, "tokens", meta.tokens, partial);
      write_attr(root, "optimizer_step", meta.optimizer_step, partial);
      write_attr(root, "data_position", meta.data_position, partial);
      write_attr(root, "rng_seed", meta.rng_seed, partial);
      write_attr(root, "loss_scale", meta.loss_scale, partial);
      write_attr(root, "loss_scale_growth_tracker", meta.loss_scale_growth_tracker, partial);
      write_attr(root, "loss_scale_hysteresis_left", meta.loss_scale_hysteresis_left, partial);
      write_attr(root, "steps_skipped", meta.steps_skipped, partial);
      write_attr(root, "config", meta.config, partial);
      write_attr(root, "layout", meta.layout, partial);
      write_attr(root, "data", meta.data, partial);
      write_attr(root, "dt_version", std::string(DT_VERSION), partial);
      write_attr(root, "chunk_elements", static_cast<std::int64_t>(kChunkElements), partial);
      write_attr(root, "datasets", static_cast<std::int64_t>(tensors.size()), partial);
      write_attr(root, "manifest_sha256", hex_sha256(manifest_text(tensors)), partial);
      write_attr(root, "meta_sha256", hex_sha256(meta_aad(meta, kCheckpointVersion)), partial);
      if (keys) {
        write_attr(root, "encryption", std::string(kEncryption), partial);
        write_attr(root, "key_salt", salt_hex, partial);
        write_attr(root, "key_check", check_hex, partial);
        write_attr(root, "meta_tag", meta_hex, partial);
        write_attr(root, "crypto_sha256", hex_sha256(crypto_text(salt_hex, check_hex, meta_hex)),
                   partial);
      }
      h5(H5Fflush(f, H5F_SCOPE_GLOBAL), "H5Fflush", partial, 0);
    }
    // Collective, like the calls above, but past them: a rank that fails here meets the others
    // in the agreement below.
    h5(f.close(), "H5Fclose", partial, 0);
  } catch (const std::exception& e) {
    ok = false;
    err = e.what();
  }
  if (ok && after_write) {
    try {
      after_write();
    } catch (const std::exception& e) {  // a test's injected failure: the ranks agree on it below
      ok = false;
      err = message_of(e);
    }
  }
  // Each rank makes what it wrote durable on its node before anything is committed.
  if (ok) {
    try {
      const trace::Scope fsync_scope("ckpt.fsync", "ckpt");
      fsync_path(partial, false);
    } catch (const Error& e) {
      ok = false;
      err = e.message();
    }
  }
  if (!all_ok(comm, ok))
    DT_THROW(CheckpointError, "saving ", partial, " failed",
             err.empty() ? std::string(" on another rank") : ": " + err);

  if (comm.rank() == 0) {
    try {
      const trace::Scope commit_scope("ckpt.commit", "ckpt");
      // A checkpoint of this step already here is of another line of training: set aside too
      // (linked, so that the rename below replaces it in one step and `latest` never names a
      // missing file).
      std::string aside;
      if (::access(final_path.c_str(), F_OK) == 0) {
        aside = move_aside(final_path, true);
        DT_CHECK(CheckpointError, aside.rfind(final_path + ".superseded", 0) == 0,
                 "cannot set aside ", final_path,
                 " (another line of training) before committing over it: ", aside);
        stats.set_aside.push_back(final_path + " -> " + aside);
      }
      DT_CHECK(CheckpointError, ::rename(partial.c_str(), final_path.c_str()) == 0, "rename ",
               partial, " -> ", final_path, ": ", errno_text());
      try {
        fsync_path(dir, true);
        if (injected_fault("DT_TEST_CKPT_LATEST_FAIL", comm, final_path))
          DT_THROW(Error, "cannot write ", dir, "/latest: DT_TEST_CKPT_LATEST_FAIL");
        metrics::write_file_atomically(dir + "/latest", step_name(meta.step) + "\n", true);
      } catch (const Error& e) {
        // `latest` still names the previous checkpoint: the new file goes, and a file of this
        // step it replaced comes back, so that the folder is as it was (a complete file newer
        // than `latest` would be taken for another line of training by the next resume).
        std::string undo = "; " + final_path + " removed";
        if (::unlink(final_path.c_str()) != 0)
          undo = "; " + final_path + " not removed: " + errno_text();
        if (!aside.empty()) {
          undo += ::rename(aside.c_str(), final_path.c_str()) == 0
                      ? ", " + aside + " put back"
                      : ", " + aside + " not put back: " + errno_text();
          stats.set_aside.pop_back();
        }
        try {
          fsync_path(dir, true);
        } catch (const Error&) {  // the message is the failure above
        }
        DT_THROW(CheckpointError, e.message(), undo,
                 " (latest still names the previous checkpoint)");
      }
    } catch (const std::exception& e) {
      ok = false;
      err = e.what();
    }
  }
  if (!all_ok(comm, ok))
    DT_THROW(CheckpointError, "committing ", final_path, " failed",
             err.empty() ? std::string(" on rank 0") : ": " + err);
  if (comm.rank() == 0) {
    // Committed: `latest` names the new file. What fails from here on (making the rename of
    // `latest` durable, the retention's pruning) leaves it committed, and is a warning.
    try {
      fsync_path(dir, true);
      if (injected_fault("DT_TEST_CKPT_PRUNE_FAIL", comm, final_path))
        DT_THROW(CheckpointError, "cannot list the checkpoint folder ", dir,
                 ": DT_TEST_CKPT_PRUNE_FAIL");
      // Retention: the file just written is the newest, then the other newest by step, `keep`
      // in all (partials went before the save). Files of a step not below the new one belong to
      // another line of training (a run that resumed from an older step, or started afresh, in this
      // folder): they are set aside (renamed, no longer checkpoints of the folder), never deleted.
      std::size_t kept = 1;
      for (const auto& e : list_checkpoints(dir)) {
        if (e.path == final_path) continue;
        if (e.step >= meta.step) {
          stats.set_aside.push_back(e.path + " -> " + move_aside(e.path));
        } else if (kept < static_cast<std::size_t>(keep)) {
          ++kept;
        } else if (::unlink(e.path.c_str()) != 0 && errno != ENOENT) {
          // Kept past --ckpt.keep: said, so that a folder that keeps growing is no surprise.
          stats.warnings.push_back("cannot remove " + e.path + " (ckpt.keep = " +
                                   std::to_string(keep) + "): " + std::strerror(errno));
        }
      }
      if (!stats.set_aside.empty()) fsync_path(dir, true);
    } catch (const std::exception& e) {
      stats.warnings.push_back(final_path +
                               " is committed, but after its commit: " + std::string(e.what()));
    }
  }
  stats.write_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return stats;
}

// ---- the writer's lock ------------------------------------------------------------------------

namespace {
// What the holder of a FolderLock wrote into its file `fd`.
std::string holder_text(int fd) {
  std::string text(512, '\0');
  const ssize_t n = ::pread(fd, text.data(), text.size(), 0);
  text.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\0')) text.pop_back();
  return text.empty() ? "a writer that did not say who it is" : text;
}
}  // namespace

FolderLock::FolderLock(const std::string& dir, const std::string& who, double wait_s,
                       const std::function<void(const std::string&)>& note,
                       const std::function<bool()>& stop) {
  mkdirs(dir);
  const std::string path = dir + "/.dt-lock";
  // Mode 0666 less the umask: in a folder shared by a group, the file made by one member's run
  // must not lock out another's. Where it is not writable, a read-only descriptor still takes a
  // flock on local file systems, Lustre and GPFS (NFS refuses: EBADF, handled as no flock).
  // The file is written (who holds it): never through a symbolic link, nor into a file with
  // other names (one planted by another writer of the folder would have its target overwritten).
  bool writable = true;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(wait_s));
  auto pause = std::chrono::milliseconds(50);
  bool told = false;
  // Until the file claimed is the one of that name: a lock file removed (to break a claim) while
  // this run opened or waited for it keeps no one out, as the next run makes a new one.
  for (;;) {
    writable = true;
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0666);
    std::string why = fd_ < 0 ? errno_text() : std::string();
    if (fd_ < 0 && errno == EACCES) {
      writable = false;
      fd_ = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
      // No lock file to open read-only either: the folder is what refuses (Permission denied),
      // not a missing file.
      if (fd_ < 0 && errno != ENOENT) why = errno_text();
    }
    if (fd_ < 0 && errno == ELOOP)
      why = "it is a symbolic link, which a lock file must not be (it is written): remove it";
    DT_CHECK(CheckpointError, fd_ >= 0, "cannot open ", path, " to claim checkpoint folder ", dir,
             " for this run: ", why);
    {
      struct stat st {};
      const bool stat_ok = ::fstat(fd_, &st) == 0;
      std::string what;
      if (!stat_ok || !S_ISREG(st.st_mode))
        what = " is not a plain file (a folder? a device?)";
      else if (st.st_nlink > 1)
        what =
            " has other names (hard links: a folder copied with cp -al or rsync --link-dest?), "
            "and the claim writes into it";
      // (st_nlink 0: removed meanwhile, to break a claim: opened again once locked, below)
      if (!what.empty()) {
        ::close(fd_);
        fd_ = -1;
        DT_THROW(CheckpointError, "cannot claim checkpoint folder ", dir, " for this run: ", path,
                 what, ": remove it (no run may hold it; a new one is made)");
      }
    }
    // Every commit renames a new file over `latest`: where that is a folder (or anything but a
    // file or a link), no save of this run could commit, so the claim is refused now.
    struct stat lst {};
    if (::lstat((dir + "/latest").c_str(), &lst) == 0 && !S_ISREG(lst.st_mode) &&
        !S_ISLNK(lst.st_mode)) {
      ::close(fd_);
      fd_ = -1;
      DT_THROW(CheckpointError, "checkpoint folder ", dir, ": ", dir,
               "/latest is not a file (a folder?); it must be the pointer file to the newest "
               "checkpoint (commits replace it): move it away");
    }
    // A folder this run cannot make files in (its owner's, read-only, a read-only mount) would
    // fail the first save, after the training up to it: refused now. (The lock file, made by
    // another member of a group, may be read-only while the folder is not.)
    if (const int err = file_creation_error(dir); err != 0) {
      ::close(fd_);
      fd_ = -1;
      const bool full = err == ENOSPC || err == EDQUOT;
      DT_THROW(CheckpointError, "checkpoint folder ", dir,
               full ? " has no room for a new file" : " is not writable by this run",
               " (making a file there: ", std::strerror(err),
               "): no checkpoint could be saved in it. ",
               full ? "Free space (or inodes) there, or use another folder"
                    : "Use a folder this user can write");
    }
    while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err == ENOLCK || err == EOPNOTSUPP || err == ENOTSUP || err == ENOSYS || err == EINVAL ||
          err == EBADF) {
        ::close(fd_);
        fd_ = -1;
        warning_ = "cannot lock " + path + " (" + std::strerror(err) +
                   "): this file system offers no flock, so nothing stops another run from "
                   "writing checkpoint folder " +
                   dir + " at the same time";
        return;
      }
      if (err != EWOULDBLOCK && err != EACCES) {
        ::close(fd_);
        fd_ = -1;
        DT_THROW(CheckpointError, "cannot lock ", path, " to claim checkpoint folder ", dir, ": ",
                 std::strerror(err));
      }
      const std::string holder = holder_text(fd_);
      if (std::chrono::steady_clock::now() >= deadline) {
        ::close(fd_);
        fd_ = -1;
        DT_THROW(CheckpointError, "checkpoint folder ", dir, " is in use by another run (", holder,
                 "): two writers of one folder would set aside each other's checkpoints. Use "
                 "another folder, or wait for that run to end. If it has ended (a node that "
                 "failed can keep its claim on a shared file system for a while), remove ",
                 path, " to break the claim");
      }
      if (stop && stop()) {
        ::close(fd_);
        fd_ = -1;
        stopped_ = "stopped waiting for checkpoint folder " + dir + " (in use by " + holder + ")";
        return;
      }
      if (!told && note) {
        std::ostringstream up_to;
        up_to << wait_s;
        note("checkpoint folder " + dir + " is in use by " + holder + "; waiting up to " +
             up_to.str() + " s for it");
        told = true;
      }
      const auto left = deadline - std::chrono::steady_clock::now();
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(pause, left));
      pause = std::min(pause * 2, std::chrono::milliseconds(2000));
    }
    struct stat held {
    }, named{};
    if (::fstat(fd_, &held) == 0 && ::stat(path.c_str(), &named) == 0 &&
        held.st_dev == named.st_dev && held.st_ino == named.st_ino)
      break;
    ::close(fd_);
    fd_ = -1;
  }
  if (!writable) return;  // (who holds it stays unsaid)
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  const char* job = std::getenv("SLURM_JOB_ID");
  char when[32] = {0};
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
  const std::string text = who + " on " + host + ", pid " + std::to_string(::getpid()) +
                           (job ? std::string(", Slurm job ") + job : std::string()) + ", since " +
                           when + "\n";
  // Who holds it is only for the message of a run refused: failing to write it changes nothing.
  // Written first and cut to length after, so that a reader never finds the file empty.
  const bool said =
      ::pwrite(fd_, text.data(), text.size(), 0) == static_cast<ssize_t>(text.size()) &&
      ::ftruncate(fd_, static_cast<off_t>(text.size())) == 0;
  (void)said;
}

std::string folder_holder(const std::string& dir) {
  const std::string path = dir + "/.dt-lock";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::string holder;
  if (::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
    holder = holder_text(fd);
  }
  ::close(fd);  // (also releases a shared lock taken here)
  return holder;
}

FolderLock::~FolderLock() {
  if (fd_ >= 0) ::close(fd_);  // (closing releases the flock)
}

// ---- listing ------------------------------------------------------------------------------------

namespace {
std::vector<std::string> dir_entries(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) {
    // A folder that is not there holds nothing; one that cannot be read is not taken for empty
    // (a resume would start afresh, and its first save set aside every checkpoint there).
    DT_CHECK(CheckpointError, errno == ENOENT, "cannot list the checkpoint folder ", dir, ": ",
             errno_text());
    return out;
  }
  for (;;) {
    errno = 0;
    dirent* e = ::readdir(d);
    if (e == nullptr) break;
    out.emplace_back(e->d_name);
  }
  const int err = errno;
  ::closedir(d);
  DT_CHECK(CheckpointError, err == 0, "cannot list the checkpoint folder ", dir, ": ",
           std::strerror(err));
  return out;
}
bool parse_step(const std::string& name, const std::string& suffix, std::int64_t* step) {
  if (name.rfind("step-", 0) != 0 || name.size() <= 5 + suffix.size()) return false;
  if (name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) return false;
  const std::string num = name.substr(5, name.size() - 5 - suffix.size());
  if (num.empty() || num.size() > 18 || num.find_first_not_of("0123456789") != std::string::npos)
    return false;
  *step = std::stoll(num);
  return true;
}
}  // namespace

std::int64_t checkpoint_step_of_name(const std::string& path) {
  std::int64_t step = -1;
  return parse_step(path.substr(path.find_last_of('/') + 1), ".h5", &step) ? step : -1;
}

std::vector<CkptEntry> list_checkpoints(const std::string& dir) {
  std::vector<CkptEntry> out;
  for (const auto& name : dir_entries(dir)) {
    std::int64_t step = 0;
    if (!parse_step(name, ".h5", &step)) continue;
    CkptEntry e;
    e.path = dir + "/" + name;
    e.step = step;
    struct stat st;
    if (::stat(e.path.c_str(), &st) == 0) e.bytes = static_cast<std::uint64_t>(st.st_size);
    out.push_back(e);
  }
  std::sort(out.begin(), out.end(),
            [](const CkptEntry& a, const CkptEntry& b) { return a.step > b.step; });
  return out;
}

std::vector<CkptEntry> list_checkpoints(Comm& comm, const std::string& dir) {
  // Rank 0's listing as lines "NAME BYTES" (a checkpoint's name holds no space or newline), or
  // "\x01" and its error.
  std::string text;
  if (comm.rank() == 0) {
    try {
      for (const auto& e : list_checkpoints(dir))
        text += e.path.substr(dir.size() + 1) + " " + std::to_string(e.bytes) + "\n";
    } catch (const CheckpointError& e) {
      text = "\x01" + e.message();
    }
  }
  text = broadcast_text(comm, text, 0);
  if (!text.empty() && text[0] == '\x01') DT_THROW(CheckpointError, text.substr(1));
  std::vector<CkptEntry> out;
  std::istringstream in(text);
  for (std::string name, bytes; in >> name >> bytes;) {
    CkptEntry e;
    e.path = dir + "/" + name;
    e.step = checkpoint_step_of_name(name);
    e.bytes = std::stoull(bytes);
    out.push_back(e);
  }
  return out;
}

std::vector<std::string> list_partials(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& name : dir_entries(dir)) {
    std::int64_t step = 0;
    if (parse_step(name, ".h5.partial", &step)) out.push_back(dir + "/" + name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> list_set_aside(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& name : dir_entries(dir)) {
    const std::size_t at = name.find(".h5.superseded");
    std::int64_t step = 0;
    if (at != std::string::npos && parse_step(name.substr(0, at + 3), ".h5", &step))
      out.push_back(dir + "/" + name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string latest_described(const std::string& dir, const std::string& latest) {
  const std::string mark = dir + "/(latest ";
  if (latest.rfind(mark, 0) == 0 && latest.back() == ')')  // read_latest's description
    return "the pointer " + dir + "/latest " +
           latest.substr(mark.size(), latest.size() - mark.size() - 1);
  return "the pointer " + dir + "/latest names " + latest;
}

std::string read_latest(const std::string& dir) {
  std::ifstream in(dir + "/latest");
  std::string name;
  if (!in || !std::getline(in, name) || name.empty()) return "";
  // A pointer damaged into something that is no file name (binary bytes, a path) is described,
  // not echoed: it names no checkpoint either way.
  const bool printable = std::all_of(name.begin(), name.end(),
                                     [](char ch) { return ch > ' ' && ch < 127 && ch != '/'; });
  if (!printable || name.size() > 255) {
    const bool path = name.size() <= 255 && std::all_of(name.begin(), name.end(), [](char ch) {
                        return ch > ' ' && ch < 127;
                      });
    return dir + (path ? "/(latest holds the path " + name + ", not a file name of the folder)"
                       : "/(latest holds no file name: " + std::to_string(name.size()) + " bytes)");
  }
  return dir + "/" + name;
}

// ---- load and verify ----------------------------------------------------------------------------

namespace {

struct Opened {
  H5 fapl, file, dxpl;
  std::int64_t version = 0;  ///< format_version
};

// Why HDF5 could not open `path`, by its first bytes: a file with HDF5's signature is damaged; one
// without is no checkpoint at all (a safetensors file, named as such: dt_ckpt import brings it in).
std::string not_hdf5_why(const std::string& path) {
  static const unsigned char kSignature[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
  unsigned char head[9] = {};
  // One that cannot be read (its mode, a folder) is named as such, not as no checkpoint.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "cannot be read (" + errno_text() + ")";
  ssize_t got = 0;
  while (got < static_cast<ssize_t>(sizeof head)) {
    const ssize_t n = ::read(fd, head + got, sizeof head - static_cast<std::size_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = "cannot be read (" + errno_text() + ")";
      ::close(fd);
      return why;
    }
    if (n == 0) break;
    got += n;
  }
  ::close(fd);
  if (got >= 8 && std::memcmp(head, kSignature, 8) == 0)
    return "not a readable HDF5 file (truncated or damaged)";
  if (got == 9 && head[8] == '{')
    return "a safetensors file, not a dt checkpoint (dt_ckpt import makes one of it)";
  return "not a dt checkpoint (no HDF5 signature at its start)";
}

Opened open_read(MpiComm& mc, const std::string& path) {
  static const Quiet quiet;
  struct stat st;
  const bool here = ::stat(path.c_str(), &st) == 0;
  const bool file = here && S_ISREG(st.st_mode);
  std::string why;
  if (!here)
    why = errno_text();
  else if (S_ISDIR(st.st_mode))
    why =
        "it is a folder: name a step-N.h5 file in it, or use --ckpt.dir=FOLDER "
        "--ckpt.resume=auto";
  else if (!file)
    why = "not a regular file";
  if (!all_ok(mc, file))
    DT_THROW(CheckpointError, path, ": cannot read",
             file ? std::string(" on another rank") : ": " + why);
  Opened o;
  o.fapl = file_access(mc.handle(), path);
  o.file = H5(H5Fopen(path.c_str(), H5F_ACC_RDONLY, o.fapl), H5Fclose);
  if (o.file.get() < 0)
    DT_THROW(CheckpointError, path, ": ", not_hdf5_why(path), ": ", h5_message());
  o.dxpl = data_xfer(path);
  H5 root(h5(H5Gopen2(o.file, "/", H5P_DEFAULT), "H5Gopen2", path), H5Gclose);
  const std::string fmt = string_attr_or_empty(root, "format", path);
  DT_CHECK(CheckpointError, fmt == kCheckpointFormat, path, ": not a dt checkpoint (format '",
           printable(fmt), "')");
  o.version = read_int_attr(root, "format_version", path);
  DT_CHECK(CheckpointError, o.version >= 1 && o.version <= kCheckpointVersion, path,
           ": format version ", o.version, " is not supported (this dt reads up to ",
           kCheckpointVersion, ")");
  // The version decides which digests are checked, and no digest covers it: a file holding
  // attributes that only a later version writes claims too low a version (a damaged number, or
  // one lowered to get past the checks).
  static const std::pair<const char*, std::int64_t> kIntroduced[] = {
      {"meta_sha256", 2},
      {"manifest_sha256", 2},
      {"datasets", 2},
      {"loss_scale_growth_tracker", 3},
      {"loss_scale_hysteresis_left", 3},
      {"steps_skipped", 3},
      {"data", 4}};
  for (const auto& [name, since] : kIntroduced)
    DT_CHECK(CheckpointError, o.version >= since || !has_attr(root, name), path,
             ": format_version ", o.version, " is lower than its attributes say (", name,
             " is written from version ", since, "): damaged");
  return o;
}

CkptMeta read_meta(const Opened& o, const std::string& path) {
  H5 root(h5(H5Gopen2(o.file, "/", H5P_DEFAULT), "H5Gopen2", path), H5Gclose);
  CkptMeta m;
  m.step = read_int_attr(root, "step", path);
  m.tokens = read_int_attr(root, "tokens", path);
  m.optimizer_step = read_int_attr(root, "optimizer_step", path);
  m.data_position = read_int_attr(root, "data_position", path);
  m.rng_seed = read_int_attr(root, "rng_seed", path);
  m.loss_scale = read_double_attr(root, "loss_scale", path);
  if (o.version >= 3) {
    m.loss_scale_growth_tracker = read_int_attr(root, "loss_scale_growth_tracker", path);
    m.loss_scale_hysteresis_left = read_int_attr(root, "loss_scale_hysteresis_left", path);
    m.steps_skipped = read_int_attr(root, "steps_skipped", path);
  }
  m.config = read_string_attr(root, "config", path);
  m.layout = read_string_attr(root, "layout", path);
  if (o.version >= 4) m.data = read_string_attr(root, "data", path);
  const auto ce = read_int_attr(root, "chunk_elements", path);
  DT_CHECK(CheckpointError, ce == static_cast<std::int64_t>(kChunkElements), path, ": chunk size ",
           ce, " differs from this dt's ", kChunkElements);
  // Version 2 digests the meta data (version 1 wrote no digest).
  if (o.version >= 2) {
    const std::string want = string_attr_or_empty(root, "meta_sha256", path);
    DT_CHECK(CheckpointError, want == hex_sha256(meta_aad(m, o.version)), path,
             ": checksum mismatch in the root attributes (step, tokens, config, ...): they do not "
             "match meta_sha256",
             want.empty() ? " (missing)" : "", ": damaged");
  }
  return m;
}

Shape dataset_shape(hid_t d, const std::string& path) {
  H5 sp(h5(H5Dget_space(d), "H5Dget_space", path), H5Sclose);
  const int nd = H5Sget_simple_extent_ndims(sp);
  std::vector<hsize_t> dims(static_cast<std::size_t>(std::max(nd, 0)));
  H5Sget_simple_extent_dims(sp, dims.data(), nullptr);
  return Shape(dims.begin(), dims.end());
}

// The two key errors that come from this run's settings rather than from the file (resume stops
// at them: an older file of the other kind must not roll the run back).
constexpr const char* kPlainWithKeys = " is not encrypted, and ckpt.encrypt is on";
constexpr const char* kEncryptedWithoutKeys = "; loading it needs the job key";
// What a SecurityError of a load says of a file whose data passes its checksums and fails
// authentication: no damage does that (a damaged chunk fails its checksum, which is taken over
// what is stored), only someone who rewrote data and checksums alike. resume stops at it.
constexpr const char* kTampered =
    ": rewritten together with the checksums, by someone without the job key (tampering); "
    "refusing to load it or to fall back to an older checkpoint";

// The decryption context of an encrypted file (nullopt for a plain one, and for an encrypted one
// when `keys` is null and `require` is false). Throws CheckpointError "checkpoint key: ..." for an
// encrypted file without keys (when `require`), a plain file with keys (when `require`), a
// malformed key attribute, a wrong key, a damaged crypto_sha256 (also without keys) and a file
// that holds encryption's attributes without the one that says it is encrypted.
// `encrypted_out` (if given) says whether the file is encrypted.
std::optional<security::Aead> open_crypto(hid_t file, const std::string& path,
                                          const security::Keys* keys, bool require,
                                          const CkptMeta& meta, std::int64_t version,
                                          bool* encrypted_out = nullptr) {
  H5 root(h5(H5Gopen2(file, "/", H5P_DEFAULT), "H5Gopen2", path), H5Gclose);
  const bool encrypted = has_attr(root, "encryption");
  if (encrypted_out) *encrypted_out = encrypted;
  if (!encrypted) {
    // A file that holds what encryption writes, without the attribute that says so, is damaged:
    // read as plain, its ciphertext would load as weights.
    std::string left;
    for (const char* a : {"key_salt", "key_check", "meta_tag", "crypto_sha256"})
      if (has_attr(root, a)) left += std::string(left.empty() ? "" : ", ") + a;
    if (H5Lexists(file, "/crypto", H5P_DEFAULT) > 0)
      left += std::string(left.empty() ? "" : ", ") + "/crypto";
    DT_CHECK(CheckpointError, left.empty(), path,
             ": the attribute 'encryption' is missing, but the file holds what encryption writes (",
             left, "): damaged");
    DT_CHECK(CheckpointError, !(keys && require), "checkpoint key: ", path, kPlainWithKeys,
             ": refusing to load unauthenticated data (load it with ckpt.encrypt=false)");
    return std::nullopt;
  }
  const std::string alg = read_string_attr(root, "encryption", path);
  DT_CHECK(CheckpointError, alg == kEncryption, path, ": encryption '", printable(alg),
           "' is not supported (this dt reads ", kEncryption, ")");
  const std::string salt_hex = read_string_attr(root, "key_salt", path);
  const std::string check_hex = read_string_attr(root, "key_check", path);
  const std::string meta_hex = read_string_attr(root, "meta_tag", path);
  // Files from before crypto_sha256 cannot tell a damaged key attribute from a rewritten one.
  // (Checked with or without the key.)
  const bool digested = has_attr(root, "crypto_sha256");
  if (digested)
    DT_CHECK(CheckpointError,
             read_string_attr(root, "crypto_sha256", path) ==
                 hex_sha256(crypto_text(salt_hex, check_hex, meta_hex)),
             path,
             ": checksum mismatch in the key attributes (key_salt, key_check, meta_tag): they do "
             "not match crypto_sha256: damaged");
  if (!keys) {
    DT_CHECK(CheckpointError, !require, "checkpoint key: ", path, " is encrypted (", kEncryption,
             ")", kEncryptedWithoutKeys, " (ckpt.encrypt=true with security.key_file)");
    return std::nullopt;
  }
  security::Salt salt{};
  std::array<std::uint8_t, security::kTagBytes> want{};
  DT_CHECK(
      CheckpointError,
      from_hex(salt_hex, salt.data(), salt.size()) && from_hex(check_hex, want.data(), want.size()),
      "checkpoint key: ", path, ": attributes key_salt/key_check are malformed");
  const security::SecretKey k = keys->checkpoint_key(salt);
  security::Aead enc(k, true, keys->aes());
  const auto got = key_check(enc);
  // Tags are compared in constant time (a file's writer chooses what they are compared with).
  DT_CHECK(CheckpointError, CRYPTO_memcmp(got.data(), want.data(), want.size()) == 0,
           "checkpoint key: wrong key for ", path,
           ": it was encrypted with another job key (security.key_file); nothing was decrypted");
  std::array<std::uint8_t, security::kTagBytes> mwant{};
  const bool meta_ok =
      from_hex(meta_hex, mwant.data(), mwant.size()) &&
      CRYPTO_memcmp(meta_tag(enc, meta, version).data(), mwant.data(), mwant.size()) == 0;
  // From version 2 the root attributes passed their digest (read_meta) before this, and the tag
  // passed crypto_sha256: failing authentication too, they were rewritten together with both.
  if (!meta_ok && version >= 2 && digested)
    DT_THROW(SecurityError, path, ": the root attributes (step, tokens, config, ...) fail ",
             "authentication although they match their checksum (meta_sha256)", kTampered);
  DT_CHECK(CheckpointError, meta_ok, path,
           ": the root attributes (step, tokens, config, ...) fail authentication: altered");
  return security::Aead(k, false, keys->aes());
}

// A dataset's declared extent is believed only as far as the file backs it: float32 elements, and
// exactly numel * 4 bytes of storage (so a damaged or hostile file cannot make a reader allocate
// more than the file holds). Throws CheckpointError naming the dataset.
void check_stored(hid_t d, const std::string& name, const Shape& shape, const std::string& path) {
  H5 type(h5(H5Dget_type(d), "H5Dget_type", path), H5Tclose);
  DT_CHECK(CheckpointError, H5Tget_class(type) == H5T_FLOAT && H5Tget_size(type) == 4, path,
           ": dataset ", name, " is not float32");
  std::uint64_t n = 1;
  for (auto e : shape) {
    const auto u = static_cast<std::uint64_t>(e);
    DT_CHECK(CheckpointError, u == 0 || n <= (std::uint64_t{1} << 60) / u, path, ": dataset ", name,
             " declares an impossible extent ", shape_str(shape));
    n *= u;
  }
  const std::uint64_t stored = H5Dget_storage_size(d);
  DT_CHECK(CheckpointError, stored == n * sizeof(float), path, ": dataset ", name, " declares ",
           shape_str(shape), " (", n * sizeof(float), " bytes) but the file stores ", stored,
           " bytes of it");
}

// Reads the tensors of `path` into what each rank holds of them and checks the chunks. A whole
// tensor (CkptTensor) is read whole, and each rank checks its share of its chunks; a range or
// pieces read the chunks that meet them, kLoadBatch chunks at a time, check all of them and copy
// out what the rank holds. With `dec`, the chunks read are then decrypted and authenticated in
// place. Returns the problems, identical on every rank; `tampered` (where given) tells whether a
// chunk that passes its checksum fails authentication.
std::vector<std::string> read_and_check(Comm& comm, Opened& o, const std::string& path,
                                        const std::vector<CkptTensor>& tensors,
                                        security::Aead* dec = nullptr, bool* tampered = nullptr,
                                        bool encrypted = false) {
  // Without the key, an encrypted file's nonces and tags are checked against their digests.
  const bool rowed = dec != nullptr || encrypted;
  constexpr std::size_t K = kChunkElements, kLoadBatch = 16, kErrorText = 512;
  const std::size_t T = tensors.size();
  std::vector<std::size_t> numels;
  for (const auto& t : tensors) numels.push_back(t.numel());
  const auto mine = my_chunks(numels, comm.rank(), comm.size());
  std::size_t total = 0;
  std::vector<std::size_t> base;
  for (auto n : numels) {
    base.push_back(total);
    total += chunks_of(n);
  }
  // The batches of consecutive chunks each sharded tensor reads. Every rank makes as many reads
  // of a dataset as the rank with the most (the others select nothing), so that the HDF5 calls
  // are the same on every rank.
  std::vector<std::vector<CkptPiece>> pieces(T);
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> batches(T);
  // nbatch[T + 1 + i]: some rank holds tensor i sharded.
  std::vector<std::int64_t> nbatch(2 * T + 1, 0);  // + 1: never empty
  std::size_t most = 0;                            // elements of the largest batch
  for (std::size_t i = 0; i < T; ++i) {
    if (tensors[i].whole()) continue;
    nbatch[T + 1 + i] = 1;
    pieces[i] = held_pieces(tensors[i]);
    const std::size_t n = numels[i], k = chunks_of(n);
    std::vector<char> need(k, 0);
    for (const CkptPiece& p : pieces[i])
      for (std::size_t c = p.begin / K; c * K < piece_end(p); ++c)
        need[c] = need[c] || below(p, std::min(n, (c + 1) * K)) > below(p, c * K);
    for (std::size_t c = 0; c < k;) {
      if (!need[c]) {
        ++c;
        continue;
      }
      std::size_t c1 = c + 1;
      while (c1 < k && need[c1] && c1 - c < kLoadBatch) ++c1;
      batches[i].emplace_back(c, c1);
      most = std::max(most, std::min(n, c1 * K) - c * K);
      c = c1;
    }
    nbatch[i] = static_cast<std::int64_t>(batches[i].size());
  }
  comm.all_reduce(view_of(nbatch), ReduceOp::max);
  std::vector<float> part(most);
  // bad[c]: chunk c fails its digest; bad[total + 1 + c]: it does not authenticate;
  // bad[2 * (total + 1) + c]: its nonce and tag fail their digest, or have none (files before it).
  // bad[3 * (total + 1) + c]: a read of it failed (what bad[c] then says is not about the file).
  std::vector<std::uint8_t> bad(4 * (total + 1), 0);  // + 1: never empty
  std::uint8_t* unauth = bad.data() + total + 1;
  std::uint8_t* row_bad = bad.data() + 2 * (total + 1);
  std::uint8_t* unread = bad.data() + 3 * (total + 1);
  // failed[i]: 1 + the highest rank whose read of tensor i failed, 0 where none did; read_error[i]:
  // this rank's error.
  std::vector<std::int64_t> failed(T + 1, 0);
  std::vector<std::string> read_error(T);
  auto read_failed = [&](std::size_t i, const CheckpointError& e) {
    failed[i] = comm.rank() + 1;
    if (read_error[i].empty()) read_error[i] = e.what();
  };
  for (std::size_t i = 0; i < T; ++i) {
    const CkptTensor& t = tensors[i];
    const std::size_t n = numels[i], k = chunks_of(n);
    const bool whole = t.whole();
    // readable: the data set opens (and, for a whole tensor, reads); have: the digests read;
    // have_rows: the nonces and tags read.
    // Opening a dataset is collective (metadata) and reading is not: every rank makes every
    // open whatever its reads gave, so that a read failing on one rank only (an I/O error on its
    // node) leaves no rank waiting in an open.
    bool readable = false, have = false, have_rows = false;
    H5 d;
    std::vector<unsigned char> sums(k * 32 + 32);
    try {
      d = H5(h5(H5Dopen2(o.file, t.path.c_str(), H5P_DEFAULT), "H5Dopen2", path), H5Dclose);
      if (whole) {
        injected_read_failure(comm, path);
        h5(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, o.dxpl, t.data), "H5Dread", path, 0);
      }
      readable = true;
    } catch (const CheckpointError& e) {
      readable = false;  // unreadable here: every chunk this rank checks counts as bad
      read_failed(i, e);
    }
    try {
      H5 c(H5Dopen2(o.file, checksum_path(t.path).c_str(), H5P_DEFAULT), H5Dclose);
      have = c.get() >= 0 && dataset_shape(c, path) == Shape{static_cast<std::int64_t>(k), 32};
      if (have)
        h5(H5Dread(c, H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, o.dxpl, sums.data()), "H5Dread", path, 0);
    } catch (const CheckpointError&) {
      have = false;
    }
    std::vector<unsigned char> rows(rowed ? k * kCryptoRow + kCryptoRow : 0);
    std::vector<unsigned char> row_sums(rowed ? k * 32 + 32 : 0);
    bool have_row_sums = false;
    if (rowed) {
      try {
        H5 r(H5Dopen2(o.file, checksum_path(crypto_path(t.path)).c_str(), H5P_DEFAULT), H5Dclose);
        have_row_sums =
            r.get() >= 0 && dataset_shape(r, path) == Shape{static_cast<std::int64_t>(k), 32};
        if (have_row_sums)
          h5(H5Dread(r, H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, o.dxpl, row_sums.data()), "H5Dread",
             path, 0);
      } catch (const CheckpointError&) {
        have_row_sums = false;
      }
      try {
        H5 r(H5Dopen2(o.file, crypto_path(t.path).c_str(), H5P_DEFAULT), H5Dclose);
        have_rows = r.get() >= 0 &&
                    dataset_shape(r, path) ==
                        Shape{static_cast<std::int64_t>(k), static_cast<std::int64_t>(kCryptoRow)};
        if (have_rows)
          h5(H5Dread(r, H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, o.dxpl, rows.data()), "H5Dread", path,
             0);
      } catch (const CheckpointError&) {
        have_rows = false;
      }
    }
    // Chunk c, read into `data` (its first element), against its digest.
    auto check = [&](std::size_t c, const float* data, bool ok) {
      const std::size_t e0 = c * K, e1 = std::min(e0 + K, n);
      const Digest dg = sha256(data, (e1 - e0) * sizeof(float));
      if (!ok || !have ||
          !std::equal(dg.begin(), dg.end(), sums.begin() + static_cast<std::ptrdiff_t>(c * 32)))
        bad[base[i] + c] = 1;
      if (!ok) unread[base[i] + c] = 1;
    };
    // Chunk c decrypted and authenticated in place (without the key: its nonce and tag checked
    // against their digest only).
    auto open = [&](std::size_t c, float* data) {
      const std::size_t e0 = c * K, e1 = std::min(e0 + K, n);
      const unsigned char* row = rows.data() + c * kCryptoRow;
      const Digest rd = sha256(row, kCryptoRow);
      if (!have_rows || !have_row_sums ||
          !std::equal(rd.begin(), rd.end(), row_sums.begin() + static_cast<std::ptrdiff_t>(c * 32)))
        row_bad[base[i] + c] = 1;
      if (!dec) return;
      const std::string aad = chunk_aad(t.path, t.shape, c, (e1 - e0) * sizeof(float));
      if (!have_rows ||
          !dec->open(row, reinterpret_cast<const std::uint8_t*>(aad.data()), aad.size(), data,
                     (e1 - e0) * sizeof(float), data, row + security::kNonceBytes))
        unauth[base[i] + c] = 1;
    };
    if (whole) {
      // Every rank that holds the tensor whole read the same file, and checks its share of the
      // chunks; where some rank holds it sharded (checking only what it reads), the whole ones
      // check every chunk, and a rank whose read failed counts every chunk as bad (what it holds
      // is not the file's). Authentication only of what was read.
      const bool all = nbatch[T + 1 + i] != 0 || !readable;
      for (std::size_t c = all ? 0 : mine[i].first; c < (all ? k : mine[i].second); ++c)
        check(c, t.data + c * K, readable);
      if (rowed && readable)
        for (std::size_t c = 0; c < k; ++c) open(c, t.data + c * K);
      continue;
    }
    for (std::size_t b = 0; b < static_cast<std::size_t>(nbatch[i]); ++b) {
      const bool mine_b = b < batches[i].size();
      const std::size_t c0 = mine_b ? batches[i][b].first : 0,
                        c1 = mine_b ? batches[i][b].second : 0;
      const std::size_t x0 = std::min(c0 * K, n), x1 = std::min(c1 * K, n);
      bool ok = readable;
      if (readable) {
        try {
          H5 fsp(h5(H5Dget_space(d), "H5Dget_space", path), H5Sclose);
          select_range(fsp, t.shape, x0, x1, path);
          hsize_t m = std::max<std::size_t>(x1 - x0, 1);
          H5 msp(h5(H5Screate_simple(1, &m, nullptr), "H5Screate_simple", path), H5Sclose);
          if (x0 == x1) h5(H5Sselect_none(msp), "H5Sselect_none", path, 0);
          float none = 0.0f;
          injected_read_failure(comm, path);
          h5(H5Dread(d, H5T_NATIVE_FLOAT, msp, fsp, o.dxpl, x0 < x1 ? part.data() : &none),
             "H5Dread", path, 0);
        } catch (const CheckpointError& e) {
          ok = false;
          read_failed(i, e);
        }
      }
      for (std::size_t c = c0; c < c1; ++c) check(c, part.data() + (c * K - x0), ok);
      if (rowed)
        for (std::size_t c = c0; c < c1; ++c) open(c, part.data() + (c * K - x0));
      for (const CkptPiece& p : pieces[i]) {
        if (p.data == nullptr) continue;  // checked only (verify_file)
        for_each_seg(p, x0, x1, [&](const Seg& g) {
          for (std::size_t j = 0; j < g.m; ++j)
            std::memcpy(p.data + g.off + j * p.len, part.data() + (g.e + j * p.stride - x0),
                        g.n * sizeof(float));
        });
      }
    }
  }
  comm.all_reduce(view_of(bad), ReduceOp::max);
  comm.all_reduce(view_of(failed), ReduceOp::max);
  std::vector<std::string> problems;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::string of = " (of " + std::to_string(chunks_of(tensors[i].numel())) + ")";
    // A read that failed (an I/O error, on one node maybe) says nothing of the file: named as
    // such, with the error of the (highest) rank it failed on, which every rank then reports.
    for (const bool read : {false, true}) {
      std::string chunks;
      int nbad = 0;
      for (std::size_t ch = 0; ch < chunks_of(tensors[i].numel()); ++ch)
        if (bad[base[i] + ch] && (unread[base[i] + ch] != 0) == read)
          chunks += (nbad++ ? "," : "") + std::to_string(ch);
      if (!nbad) continue;
      const std::string which = std::string(nbad > 1 ? "chunks " : "chunk ") + chunks + of;
      if (!read) {
        problems.push_back(tensors[i].path + ": checksum mismatch in " + which);
        continue;
      }
      const int root = static_cast<int>(failed[i]) - 1;
      std::vector<std::uint8_t> text(kErrorText, 0);
      if (comm.rank() == root)
        std::memcpy(text.data(), read_error[i].data(),
                    std::min(read_error[i].size(), text.size() - 1));
      comm.broadcast(view_of(text), root);
      problems.push_back(tensors[i].path + ": " + which + " could not be read on rank " +
                         std::to_string(root) + ": " + reinterpret_cast<const char*>(text.data()));
    }
    // Without the key: nonces and tags that fail their checksum (files before them have none).
    if (!dec && encrypted) {
      std::string rchunks;
      int nr = 0;
      for (std::size_t ch = 0; ch < chunks_of(tensors[i].numel()); ++ch)
        if (row_bad[base[i] + ch]) rchunks += (nr++ ? "," : "") + std::to_string(ch);
      if (nr)
        problems.push_back(tensors[i].path + ": checksum mismatch in the nonce and tag of chunk" +
                           (nr > 1 ? "s " : " ") + rchunks + of);
    }
    // Failing authentication: chunks that fail a checksum too, theirs or their nonce and tag's
    // (damage, or data from another file), and chunks that pass both (rewritten with their
    // checksums). Without the nonce and tag's checksums (files before them) it cannot be told.
    for (const bool sum_ok : {false, true}) {
      std::string uchunks;
      int nun = 0;
      for (std::size_t ch = 0; ch < chunks_of(tensors[i].numel()); ++ch) {
        const std::size_t c = base[i] + ch;
        if (unauth[c] && (!bad[c] && !row_bad[c]) == sum_ok)
          uchunks += (nun++ ? "," : "") + std::to_string(ch);
      }
      if (!nun) continue;
      const std::string what = tensors[i].path + ": authentication failed in chunk" +
                               (nun > 1 ? "s " : " ") + uchunks + " (of " +
                               std::to_string(chunks_of(tensors[i].numel())) + ")";
      if (sum_ok && tampered) *tampered = true;
      problems.push_back(what + (sum_ok ? std::string(" although ") +
                                              (nun > 1 ? "they match their checksums"
                                                       : "it matches its checksum") +
                                              kTampered
                                        : std::string(": altered, moved or from another file")));
    }
  }
  return problems;
}

// Names of every dataset in the file outside /checksums.
std::vector<std::string> all_datasets(hid_t file, const std::string& path) {
  std::vector<std::string> names;
  struct Ctx {
    std::vector<std::string>* out;
  } ctx{&names};
  h5(H5Lvisit(
         file, H5_INDEX_NAME, H5_ITER_INC,
         [](hid_t g, const char* name, const H5L_info_t* info, void* data) -> herr_t {
           if (info->type != H5L_TYPE_HARD) return 0;
           hid_t obj = H5Oopen(g, name, H5P_DEFAULT);
           if (obj < 0) return 0;
           if (H5Iget_type(obj) == H5I_DATASET)
             static_cast<Ctx*>(data)->out->push_back("/" + std::string(name));
           H5Oclose(obj);
           return 0;
         },
         &ctx),
     "H5Lvisit", path, 0);
  std::vector<std::string> out;
  for (auto& n : names)
    if (n.rfind("/checksums/", 0) != 0 && n.rfind("/crypto/", 0) != 0) out.push_back(n);
  return out;
}

// The datasets present, with the shapes the file declares, each checked against what the file
// stores (check_stored); in a file of version 2 or later, also the list as a whole against the
// one the save wrote (manifest_sha256). Throws dt::CheckpointError naming the file: a file that
// fails here is damaged, whatever the model it is loaded into.
std::vector<CkptTensor> present_tensors(const Opened& o, const std::string& path) {
  std::vector<CkptTensor> ts;
  for (const auto& name : all_datasets(o.file, path)) {
    H5 d(h5(H5Dopen2(o.file, name.c_str(), H5P_DEFAULT), "H5Dopen2", path), H5Dclose);
    CkptTensor t;
    t.path = name;
    t.shape = dataset_shape(d, path);
    check_stored(d, name, t.shape, path);  // before reading what the file declares
    ts.push_back(t);
  }
  if (o.version >= 2) {
    H5 root(h5(H5Gopen2(o.file, "/", H5P_DEFAULT), "H5Gopen2", path), H5Gclose);
    const std::string want = string_attr_or_empty(root, "manifest_sha256", path);
    const std::int64_t saved =
        has_attr(root, "datasets") ? read_int_attr(root, "datasets", path) : -1;
    DT_CHECK(CheckpointError, want == hex_sha256(manifest_text(ts)), path, ": the ", ts.size(),
             " datasets present (names and shapes) are not the ", saved,
             " the save wrote (manifest_sha256", want.empty() ? " missing" : "",
             "): a tensor was lost, added or reshaped");
    // The count the save wrote: an attribute that lost it (or says another) is damage too.
    DT_CHECK(CheckpointError, saved == static_cast<std::int64_t>(ts.size()), path,
             ": attribute datasets says ",
             saved < 0 ? std::string("nothing (missing)") : std::to_string(saved),
             ", but the save's list (manifest_sha256) has the ", ts.size(),
             " datasets present: the attribute is damaged");
  }
  return ts;
}

}  // namespace

CkptMeta load_checkpoint(Comm& comm, const std::string& path,
                         const std::vector<CkptTensor>& tensors, const security::Keys* keys,
                         const CkptAccept& accept) {
  const trace::Scope load_scope("ckpt.load", "ckpt");
  MpiComm& mc = mpi_of(comm);
  std::string held;
  for (const auto& t : tensors) {
    const std::string why = held_problem(t);
    if (!why.empty()) {
      held = t.path + ": " + why;
      break;
    }
  }
  const auto [bad_rank, bad] = first_problem(comm, held);
  if (bad_rank < comm.size())
    DT_THROW(CheckpointError, "loading ", path, ": rank ", bad_rank, ": ", bad);
  Opened o = open_read(mc, path);
  CkptMeta meta = read_meta(o, path);
  std::optional<security::Aead> dec = open_crypto(o.file, path, keys, true, meta, o.version);
  // A file that lost, gained or reshaped a dataset is damaged (and skipped by resume), not a
  // checkpoint of another model: the datasets are checked against the save's list first.
  const std::vector<CkptTensor> present = present_tensors(o, path);
  // The model must match: name every tensor that is missing, extra or shaped differently.
  std::vector<std::string> diff;
  for (const auto& t : tensors) {
    const auto it = std::find_if(present.begin(), present.end(),
                                 [&](const CkptTensor& p) { return p.path == t.path; });
    if (it == present.end()) {
      diff.push_back(t.path + ": missing in the file (model " + shape_str(t.shape) + ")");
      continue;
    }
    if (it->shape != stored_shape(t.shape))
      diff.push_back(t.path + ": file " + shape_str(it->shape) + ", model " + shape_str(t.shape));
  }
  for (const auto& p : present)
    if (std::none_of(tensors.begin(), tensors.end(),
                     [&](const CkptTensor& t) { return t.path == p.path; }))
      diff.push_back(p.path + ": in the file, not in the model");
  if (!diff.empty()) {
    // The first tensors that differ, and the model settings the file was written with (a model
    // of another size differs in almost every tensor: hundreds of lines would say less).
    constexpr std::size_t kShown = 8;
    std::string msg;
    for (std::size_t k = 0; k < diff.size() && k < kShown; ++k) msg += "\n  " + diff[k];
    if (diff.size() > kShown)
      msg += "\n  ... and " + std::to_string(diff.size() - kShown) + " more";
    std::string model;
    std::istringstream lines(meta.config);
    for (std::string line; std::getline(lines, line);) {
      // "model.embd = 32" as the option is given: --model.embd=32
      const std::size_t eq = line.find(" = ");
      if (line.rfind("model.", 0) == 0 && eq != std::string::npos)
        model += (model.empty() ? "--" : ", --") + line.substr(0, eq) + "=" + line.substr(eq + 3);
    }
    if (!model.empty()) msg += "\n  the file's model: " + model;
    DT_THROW(CheckpointError, "checkpoint does not match the model: ", path, " (", diff.size(),
             " tensors differ):", msg);
  }
  if (accept) accept(path, meta);
  bool tampered = false;
  const auto problems = read_and_check(comm, o, path, tensors, dec ? &*dec : nullptr, &tampered);
  if (!problems.empty()) {
    std::string msg;
    for (const auto& p : problems) msg += "\n  " + p;
    if (tampered) DT_THROW(SecurityError, path, ": tampered:", msg);
    DT_THROW(CheckpointError, path, ": corrupt:", msg);
  }
  return meta;
}

std::vector<std::string> verify_file(Comm& comm, const std::string& path,
                                     const security::Keys* keys) {
  const trace::Scope verify_scope("ckpt.verify", "ckpt");
  MpiComm& mc = mpi_of(comm);
  try {
    Opened o = open_read(mc, path);
    const CkptMeta meta = read_meta(o, path);
    bool encrypted = false;
    std::optional<security::Aead> dec =
        open_crypto(o.file, path, keys, false, meta, o.version, &encrypted);
    std::vector<CkptTensor> ts = present_tensors(o, path);
    // Each rank reads and checks its share of every dataset's chunks, a batch at a time, into no
    // buffer of its own (read_and_check skips pieces without data): memory stays bounded by a
    // batch, whatever the file's size and however many ranks verify it.
    {
      std::vector<std::size_t> numels;
      for (const auto& t : ts) numels.push_back(t.numel());
      const auto mine = my_chunks(numels, comm.rank(), comm.size());
      for (std::size_t i = 0; i < ts.size(); ++i) {
        ts[i].begin = std::min(mine[i].first * kChunkElements, numels[i]);
        ts[i].end = std::min(mine[i].second * kChunkElements, numels[i]);
      }
    }
    return read_and_check(comm, o, path, ts, dec ? &*dec : nullptr, nullptr, encrypted);
  } catch (const CheckpointError& e) {
    return {e.message()};
  } catch (const SecurityError& e) {
    return {e.message()};
  }
}

std::string checkpoint_config(const std::string& path) {
  static const Quiet quiet;
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return "";
  try {
    H5 f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    if (f.get() < 0) return "";
    H5 root(h5(H5Gopen2(f, "/", H5P_DEFAULT), "H5Gopen2", path), H5Gclose);
    if (string_attr_or_empty(root, "format", path) != kCheckpointFormat) return "";
    return string_attr_or_empty(root, "config", path);
  } catch (const Error&) {
    return "";
  }
}

void check_checkpoint_key(Comm& comm, const std::string& path, const security::Keys& keys) {
  Opened o = open_read(mpi_of(comm), path);
  const CkptMeta meta = read_meta(o, path);
  open_crypto(o.file, path, &keys, true, meta, o.version);
}

std::string checkpoint_encryption(const std::string& path) {
  static const Quiet quiet;
  H5 f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (f.get() < 0) DT_THROW(CheckpointError, path, ": not a readable HDF5 file: ", h5_message());
  H5 root(h5(H5Gopen2(f, "/", H5P_DEFAULT), "H5Gopen2", path), H5Gclose);
  return string_attr_or_empty(root, "encryption", path);
}

CkptMeta resume(Comm& comm, const std::string& mode, const std::string& dir,
                const std::vector<CkptTensor>& tensors, std::string* used,
                const std::function<void(const std::string&)>& log, const security::Keys* keys,
                const CkptAccept& accept) {
  used->clear();
  if (mode == "none") return {};
  if (mode != "auto") {
    CkptMeta m = load_checkpoint(comm, mode, tensors, keys, accept);
    *used = mode;
    return m;
  }
  // Every rank tries the files rank 0 lists, in the same order (the loads are collective).
  // A folder rank 0 cannot list is refused on every rank.
  std::vector<CkptEntry> all;
  try {
    all = list_checkpoints(comm, dir);
  } catch (const CheckpointError& e) {
    DT_THROW(CheckpointError, "--ckpt.resume=auto: ", e.message(), "; nothing was changed");
  }
  std::string latest;
  if (comm.rank() == 0) {
    try {
      for (const auto& p : list_partials(dir)) log("ignoring interrupted save " + p);
    } catch (const CheckpointError& e) {  // listed a moment ago: only these notes are lost
      log(e.message());
    }
    latest = read_latest(dir);
    if (!all.empty() && latest.empty()) {
      struct stat st {};
      const std::string p = dir + "/latest";
      const char* what = ::stat(p.c_str(), &st) != 0 ? "is missing"
                         : S_ISDIR(st.st_mode)       ? "is a folder, not the pointer file"
                                                     : "names no checkpoint (it is empty)";
      log("the pointer " + p + " " + what + "; using the newest checkpoint that verifies");
    }
  }
  latest = broadcast_text(comm, latest, 0);
  std::vector<std::string> order;
  for (const auto& e : all)
    if (e.path == latest) order.push_back(e.path);  // what the last save committed first
  for (const auto& e : all)
    if (e.path != latest) order.push_back(e.path);
  // A key error may be one file's damage (a wrong or malformed key check): older files are tried,
  // and it is thrown if none loads. One that comes from the settings (a file encrypted and no
  // key, or plain with ckpt.encrypt on) is thrown at once.
  std::string key_error;
  for (const auto& path : order) {
    try {
      CkptMeta m = load_checkpoint(comm, path, tensors, keys, accept);
      DT_CHECK(CheckpointError, checkpoint_step_of_name(path) == m.step, path,
               ": its step attribute is ", m.step,
               ", not the step its name says (a file renamed or copied over another)");
      if (!latest.empty() && latest != path)
        log(latest_described(dir, latest) + ", which is not usable; using " + path);
      *used = path;
      return m;
    } catch (const CheckpointError& err) {
      if (err.message().rfind("checkpoint does not match the model", 0) == 0) throw;
      if (err.message().find(kPlainWithKeys) != std::string::npos ||
          err.message().find(kEncryptedWithoutKeys) != std::string::npos)
        throw;
      if (err.message().rfind("checkpoint key:", 0) == 0 && key_error.empty())
        key_error = err.message();
      log("skipping " + path + ": " + err.message());
    }
  }
  if (!key_error.empty()) DT_THROW(CheckpointError, key_error);
  DT_CHECK(CheckpointError, order.empty(), "--ckpt.resume=auto: none of the ", order.size(),
           " checkpoints in ", dir,
           " could be loaded (each is named above with the reason); nothing was changed. To "
           "start afresh, run with --ckpt.resume=none or another --ckpt.dir (checkpoints of "
           "later steps are then set aside as *.superseded, not deleted)");
  return {};
}

// ---- asynchronous saves -------------------------------------------------------------------------

struct AsyncCheckpointer::Impl {
  std::unique_ptr<MpiComm> comm;
  std::string dir;
  int keep;
  std::optional<security::Keys> keys;
  double timeout_s = -1;
  std::thread thread;
  // Uninitialised on purpose: pages outside this rank's share are never touched.
  std::vector<std::unique_ptr<float[]>> snapshot;
  std::vector<std::size_t> snapshot_size;
  void ensure(std::size_t i, std::size_t n) {
    if (snapshot_size[i] != n) {
      snapshot[i].reset(new float[n]);
      snapshot_size[i] = n;
    }
  }
  std::vector<CkptTensor> tensors;
  CkptMeta meta;
  SaveStats stats;
  std::exception_ptr error;

  SaveStats join() {
    if (thread.joinable()) thread.join();
    if (error) {
      auto e = error;
      error = nullptr;
      std::rethrow_exception(e);
    }
    SaveStats s = stats;
    stats = SaveStats{};
    return s;
  }
};

AsyncCheckpointer::AsyncCheckpointer(Comm& comm, std::string dir, int keep,
                                     const security::Keys* keys, double timeout_s)
    : impl_(std::make_unique<Impl>()) {
  impl_->timeout_s = timeout_s;
  if (keys) impl_->keys.emplace(*keys);
  impl_->comm = MpiComm::dup(mpi_of(comm).handle(), comm.name() + "/ckpt");
  impl_->dir = std::move(dir);
  impl_->keep = keep;
}

AsyncCheckpointer::~AsyncCheckpointer() {
  try {
    impl_->join();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dt: asynchronous checkpoint failed: %s\n", e.what());
  }
}

namespace {
// The elements this rank holds of a sharded tensor (0 for a declaration the save refuses).
std::size_t held_numel(const CkptTensor& t) {
  if (!held_problem(t).empty()) return 0;
  std::size_t n = 0;
  for (const CkptPiece& p : held_pieces(t)) n += p.numel();
  return n;
}

// The element ranges of each tensor this rank writes (its share of the chunks): the only part
// of the snapshot a save reads on this rank.
std::vector<std::pair<std::size_t, std::size_t>> my_ranges(const std::vector<CkptTensor>& tensors,
                                                           int rank, int size) {
  std::vector<std::size_t> numels;
  for (const auto& t : tensors) numels.push_back(t.numel());
  auto r = my_chunks(numels, rank, size);
  for (std::size_t i = 0; i < r.size(); ++i) {
    r[i].first = std::min(r[i].first * kChunkElements, numels[i]);
    r[i].second = std::min(r[i].second * kChunkElements, numels[i]);
  }
  return r;
}
}  // namespace

void AsyncCheckpointer::reserve(const std::vector<CkptTensor>& tensors) {
  impl_->join();
  impl_->snapshot.resize(tensors.size());
  impl_->snapshot_size.resize(tensors.size(), 0);
  const auto ranges = my_ranges(tensors, impl_->comm->rank(), impl_->comm->size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].whole()) {  // a sharded tensor: all this rank holds of it
      const std::size_t n = held_numel(tensors[i]);
      impl_->ensure(i, n);
      std::fill(impl_->snapshot[i].get(), impl_->snapshot[i].get() + n, 0.0f);
      continue;
    }
    impl_->ensure(i, tensors[i].numel());
    std::fill(impl_->snapshot[i].get() + ranges[i].first,
              impl_->snapshot[i].get() + ranges[i].second,
              0.0f);  // back this rank's share now
  }
}

double AsyncCheckpointer::save(const std::vector<CkptTensor>& tensors, const CkptMeta& meta,
                               std::function<void()> after_write) {
  const auto t0 = Clock::now();
  impl_->join();
  impl_->snapshot.resize(tensors.size());
  impl_->snapshot_size.resize(tensors.size(), 0);
  const trace::Scope snapshot_scope("ckpt.snapshot", "ckpt");
  impl_->tensors = tensors;
  // Only this rank's share is copied: the save reads nothing else on this rank.
  const auto ranges = my_ranges(tensors, impl_->comm->rank(), impl_->comm->size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const CkptTensor& t = tensors[i];
    if (!t.whole()) {  // a sharded tensor: all this rank holds of it, packed
      impl_->ensure(i, held_numel(t));
      float* at = impl_->snapshot[i].get();
      if (t.pieces.empty()) {
        if (held_numel(t)) std::copy(t.data, t.data + held_numel(t), at);
        impl_->tensors[i].data = at;
        continue;
      }
      if (held_numel(t) == 0) continue;  // nothing, or a declaration the save refuses
      for (std::size_t q = 0; q < t.pieces.size(); ++q) {
        const std::size_t m = t.pieces[q].len * t.pieces[q].count;
        if (m) std::copy(t.pieces[q].data, t.pieces[q].data + m, at);
        impl_->tensors[i].pieces[q].data = at;
        at += m;
      }
      continue;
    }
    impl_->ensure(i, tensors[i].numel());
    std::copy(tensors[i].data + ranges[i].first, tensors[i].data + ranges[i].second,
              impl_->snapshot[i].get() + ranges[i].first);
    impl_->tensors[i].data = impl_->snapshot[i].get();
  }
  impl_->meta = meta;
  Impl* s = impl_.get();
  s->thread = std::thread([s, after_write = std::move(after_write)] {
    trace::set_thread_name("ckpt-writer");
    pthread_setname_np(pthread_self(), "dt-ckpt");
    qos::apply_to_current_thread(qos::Role::io);
    const watchdog::LimitScope limit(s->timeout_s);
    try {
      s->stats = save_checkpoint(*s->comm, s->dir, s->tensors, s->meta, s->keep, after_write,
                                 s->keys ? &*s->keys : nullptr);
    } catch (...) {
      s->error = std::current_exception();
    }
  });
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

SaveStats AsyncCheckpointer::wait() { return impl_->join(); }

}  // namespace dt
