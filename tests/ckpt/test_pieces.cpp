// test_ckpt_pieces DIR MODE: checkpoint tensors held as strided pieces (CkptPiece), under mpiexec.
//
// Every rank holds its part of ten tensors in a mixed decomposition: tensor-parallel column
// shards (one strided piece), q|k|v column blocks (three pieces), ZeRO slices of column shards
// (partial row, full rows, partial row), row blocks with one rank holding none, a tensor on one
// rank, ZeRO element ranges, a tiny tensor and a replicated whole one. MODE:
//   mixed    the file's datasets and digests are byte-identical to those one rank writes from
//            whole tensors; it verifies; it loads exactly into another decomposition, into the
//            writers' own, on one rank whole; the one-rank file loads into the pieces
//   refuse   an overlap, a gap, a piece past the end and a tensor whole on one rank only are
//            refused on every rank, naming the tensor and the place; the previous checkpoint
//            stays the latest and nothing else is left in the directory
//   encrypt  the same with ckpt.encrypt: ciphertext on disk, verifies with the key, loads
//            exactly into another decomposition and on one rank, refused without the key
//   async    AsyncCheckpointer::reserve/save with pieces: the caller's buffers change right after
//            save() returns and the files still hold the state at save(); encrypted too
// Values are a function of (tensor, element), so every check is exact.
#include <hdf5.h>
#include <malloc.h>
#include <mpi.h>
#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "../mpi/check_harness.hpp"
#include "comm/mpi_comm.hpp"
#include "dt/checkpoint.hpp"
#include "dt/error.hpp"
#include "dt/security.hpp"

namespace {

using namespace dt_test;
namespace fs = std::filesystem;
constexpr std::size_t kC = dt::kChunkElements;

struct Spec {
  std::string path;
  dt::Shape shape;
};

const std::vector<Spec>& specs() {
  static const std::vector<Spec> s = {
      {"/model/col.weight", {600, 1000}},          // column shards
      {"/model/qkv.weight", {300, 1800}},          // q|k|v blocks of 600 columns
      {"/model/row.weight", {900, 500}},           // row blocks, one rank without any
      {"/model/rep.bias", {300001}},               // replicated
      {"/model/tiny", {3, 5}},                     // one or two columns per rank
      {"/optim/exp_avg/zero.weight", {700, 777}},  // ZeRO slices of two column shards
      {"/optim/exp_avg/one.bias", {5000}},         // on the last rank only
      {"/optim/exp_avg_sq/flat", {static_cast<std::int64_t>(2 * kC + 1000)}},  // ZeRO ranges
      {"/model/conv.weight", {7, 300, 613}},  // 3-D: ranges across all dimensions, dim-1 blocks
      {"/model/tiny4", {2, 3, 4, 5}},         // 4-D: last-dimension columns, ranges
  };
  return s;
}
std::size_t numel(std::size_t i) { return dt::shape_numel(specs()[i].shape); }

// The value of element e of tensor i (a second state: salt != 0).
float value(std::size_t i, std::size_t e, float salt = 0.0f) {
  const std::uint32_t h =
      static_cast<std::uint32_t>(e * 2654435761u) ^ static_cast<std::uint32_t>(i * 40503u + 7u);
  return static_cast<float>(h % 1000003u) * 0.001f + static_cast<float>(i) + salt;
}

// What one rank holds of one tensor.
struct Part {
  enum Kind { whole, range, pieces } kind = whole;
  std::size_t a = 0, b = 0;         // range
  std::vector<dt::CkptPiece> list;  // pieces (data set by make_state)
};
Part whole_part() { return Part{}; }
Part range_part(std::size_t a, std::size_t b) { return Part{Part::range, a, b, {}}; }
Part pieces_part(std::vector<dt::CkptPiece> l) { return Part{Part::pieces, 0, 0, std::move(l)}; }
using Layout = std::vector<Part>;  // per tensor

// Uneven cut r of [0, n) into p parts (monotonic when n / p > 4).
std::size_t cut(std::size_t n, int p, int r) {
  if (r <= 0) return 0;
  if (r >= p) return n;
  return n * static_cast<std::size_t>(r) / static_cast<std::size_t>(p) +
         static_cast<std::size_t>(r % 3);
}

// The pieces of the local flat range [la, lb) of a column shard (columns [c0, c0 + w) of a
// tensor with C columns): partial row, full rows, partial row.
std::vector<dt::CkptPiece> zero_slice(std::size_t C, std::size_t c0, std::size_t w, std::size_t la,
                                      std::size_t lb) {
  std::vector<dt::CkptPiece> out;
  if (la >= lb) return out;
  std::size_t row = la / w, col = la % w;
  if (col != 0) {
    const std::size_t len = std::min(w - col, lb - la);
    out.push_back(dt::CkptPiece{row * C + c0 + col, len, 0, 1, nullptr});
    la += len;
    ++row;
  }
  const std::size_t full = (lb - la) / w;
  if (full) out.push_back(dt::CkptPiece{row * C + c0, w, C, full, nullptr});
  la += full * w;
  row += full;
  if (la < lb) out.push_back(dt::CkptPiece{row * C + c0, lb - la, 0, 1, nullptr});
  return out;
}

// The decomposition the pieces are written with, on rank r of p.
Layout mixed(int p, int r) {
  Layout l(specs().size());
  {  // col.weight: columns [c0, c1)
    const std::size_t c0 = cut(1000, p, r), c1 = cut(1000, p, r + 1);
    l[0] = pieces_part({{c0, c1 - c0, 1000, 600, nullptr}});
  }
  {  // qkv.weight: columns [h0, h1) of each of the q, k, v blocks
    const std::size_t h0 = cut(600, p, r), h1 = cut(600, p, r + 1);
    std::vector<dt::CkptPiece> v;
    for (std::size_t blk = 0; blk < 3; ++blk) v.push_back({blk * 600 + h0, h1 - h0, 1800, 300});
    l[1] = pieces_part(v);
  }
  {  // row.weight: rows split over all ranks but rank p - 2, which holds none (empty range)
    const int skip = p >= 2 ? p - 2 : -1, holders = p >= 2 ? p - 1 : 1;
    const int h = r < skip || skip < 0 ? r : r - 1;
    if (r == skip) {
      l[2] = range_part(0, 0);
    } else {
      const std::size_t r0 = 900 * static_cast<std::size_t>(h) / static_cast<std::size_t>(holders);
      const std::size_t r1 =
          900 * static_cast<std::size_t>(h + 1) / static_cast<std::size_t>(holders);
      l[2] = pieces_part({{r0 * 500, 500, 500, r1 - r0, nullptr}});
    }
  }
  l[3] = whole_part();
  {  // tiny: column r, the last rank the rest
    const std::size_t c0 = std::min<std::size_t>(static_cast<std::size_t>(r), 4);
    const std::size_t c1 = r == p - 1 ? 5 : c0 + 1;
    l[4] = pieces_part({{c0, c1 - c0, 5, 3, nullptr}});
  }
  {  // zero.weight: shard 0 (columns [0, 400)) over ranks [0, g), shard 1 over [g, p)
    const int g = std::max(1, p / 2);
    std::vector<dt::CkptPiece> v;
    auto slice = [&](std::size_t c0, std::size_t w, int d, int dn) {
      const std::size_t W = 700 * w;
      for (auto& pc : zero_slice(777, c0, w, cut(W, dn, d) + (d ? 5 : 0),
                                 cut(W, dn, d + 1) + (d + 1 < dn ? 5 : 0)))
        v.push_back(pc);
    };
    if (r < g) slice(0, 400, r, g);
    if (r >= g || p == 1) slice(400, 377, p == 1 ? 0 : r - g, p == 1 ? 1 : p - g);
    // No pieces at all is the empty range (an empty list would be the whole tensor).
    l[5] = v.empty() ? range_part(0, 0) : pieces_part(v);
  }
  l[6] = r == p - 1 ? range_part(0, 5000) : range_part(0, 0);
  {
    const std::size_t n = numel(7);
    const auto at = [&](int q) { return q <= 0 ? 0 : q >= p ? n : cut(n, p, q) + 1001 * (q % 2); };
    l[7] = range_part(at(r), at(r + 1));
  }
  {  // conv.weight: uneven flat ranges (ZeRO of a 3-D tensor), ending inside rows
    const std::size_t n = numel(8);
    const auto at = [&](int q) { return q <= 0 ? 0 : q >= p ? n : cut(n, p, q) + 611 * q; };
    l[8] = range_part(at(r), at(r + 1));
  }
  {  // tiny4: last-dimension column r, the last rank the rest
    const std::size_t c0 = std::min<std::size_t>(static_cast<std::size_t>(r), 4);
    const std::size_t c1 = r == p - 1 ? 5 : c0 + 1;
    l[9] = pieces_part({{c0, c1 - c0, 5, 24, nullptr}});
  }
  return l;
}

// Another decomposition, to load with (parts may overlap or leave elements out).
Layout other(int p, int r) {
  const auto P = static_cast<std::size_t>(p), R = static_cast<std::size_t>(r);
  Layout l(specs().size());
  const auto bound = [&](std::size_t q) {
    return q == 0 ? 0 : q == P ? std::size_t{600000} : 600000 * q / P + 17 * (q % 2);
  };
  l[0] = range_part(bound(R), bound(R + 1));
  l[1] = pieces_part({{1800 * R / P, 1800 * (R + 1) / P - 1800 * R / P, 1800, 300, nullptr}});
  l[2] = pieces_part({{500 * R / P, 500 * (R + 1) / P - 500 * R / P, 500, 900, nullptr}});
  l[3] = pieces_part({{R * 1000, 1000, P * 1000, 300001 / (P * 1000), nullptr}});
  l[4] = whole_part();
  l[5] = whole_part();
  l[6] = range_part(100 * R, 100 * R + 2000);
  l[7] = pieces_part(
      {{R * 7, 7, P * 7, numel(7) / (P * 7) - 1, nullptr}, {numel(7) - 3, 3, 0, 1, nullptr}});
  {  // conv.weight: rows [r0, r1) of dimension 1 under each index of dimension 0
    const std::size_t r0 = 300 * R / P, r1 = 300 * (R + 1) / P;
    std::vector<dt::CkptPiece> v;
    for (std::size_t d0 = 0; d0 < 7; ++d0)
      v.push_back({(d0 * 300 + r0) * 613, (r1 - r0) * 613, 0, 1, nullptr});
    l[8] = pieces_part(v);
  }
  l[9] = range_part(7 * R, std::min<std::size_t>(120, 7 * R + 61));
  return l;
}

Layout all_whole() { return Layout(specs().size(), whole_part()); }

struct State {
  Layout layout;
  std::vector<std::vector<float>> bufs;
  std::vector<dt::CkptTensor> tensors;
};

// Buffers for `layout`, filled with value(i, e, salt) (or `fill` when not NaN).
State make_state(const Layout& layout, float salt = 0.0f, float fill = NAN) {
  State s;
  s.layout = layout;
  s.bufs.resize(specs().size());
  for (std::size_t i = 0; i < specs().size(); ++i) {
    const Part& part = layout[i];
    dt::CkptTensor t{specs()[i].path, specs()[i].shape};
    std::vector<float>& b = s.bufs[i];
    auto put = [&](std::size_t at, std::size_t e) {
      b[at] = std::isnan(fill) ? value(i, e, salt) : fill;
    };
    if (part.kind == Part::whole) {
      b.resize(numel(i));
      for (std::size_t e = 0; e < b.size(); ++e) put(e, e);
      t.data = b.data();
    } else if (part.kind == Part::range) {
      b.resize(part.b - part.a);
      for (std::size_t e = part.a; e < part.b; ++e) put(e - part.a, e);
      t.data = b.data();
      t.begin = part.a;
      t.end = part.b;
    } else {
      std::size_t total = 0;
      for (const auto& p : part.list) total += p.len * p.count;
      b.resize(total);
      std::size_t at = 0;
      for (dt::CkptPiece p : part.list) {
        p.data = b.data() + at;
        for (std::size_t j = 0; j < p.count; ++j)
          for (std::size_t x = 0; x < p.len; ++x) put(at++, p.begin + j * p.stride + x);
        t.pieces.push_back(p);
      }
    }
    s.tensors.push_back(t);
  }
  return s;
}

// Every element s holds equals value(i, e, salt); else a failure naming the first wrong one.
void expect_values(const std::string& what, const State& s, float salt = 0.0f) {
  const State want = make_state(s.layout, salt);
  for (std::size_t i = 0; i < specs().size(); ++i) {
    const auto& a = s.bufs[i];
    const auto& b = want.bufs[i];
    std::size_t bad = 0, first = 0;
    for (std::size_t k = 0; k < a.size(); ++k)
      if (std::memcmp(&a[k], &b[k], sizeof(float)) != 0 && bad++ == 0) first = k;
    H.expect(bad == 0, what + ": " + specs()[i].path,
             str(bad, " of ", a.size(), " held elements differ; first at ", first, ": ",
                 bad ? a[first] : 0.0f, " instead of ", bad ? b[first] : 0.0f));
  }
}

// The raw bytes of dataset `ds` of `file` (serial HDF5), with its dimensions.
std::vector<unsigned char> raw(const std::string& file, const std::string& ds,
                               std::vector<hsize_t>* dims) {
  std::vector<unsigned char> v;
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) return v;
  hid_t d = H5Dopen2(f, ds.c_str(), H5P_DEFAULT);
  if (d >= 0) {
    hid_t sp = H5Dget_space(d), type = H5Dget_type(d);
    const int nd = H5Sget_simple_extent_ndims(sp);
    dims->assign(static_cast<std::size_t>(std::max(nd, 0)), 0);
    H5Sget_simple_extent_dims(sp, dims->data(), nullptr);
    v.resize(static_cast<std::size_t>(H5Sget_simple_extent_npoints(sp)) * H5Tget_size(type));
    H5Dread(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
    H5Tclose(type);
    H5Sclose(sp);
    H5Dclose(d);
  }
  H5Fclose(f);
  return v;
}

dt::security::Keys keys_from(char fill_byte) {
  dt::security::Key k{};
  std::memset(k.data(), fill_byte, k.size());
  return dt::security::Keys(dt::security::SecretKey(k), "job-pieces");
}

dt::CkptMeta meta_at(std::int64_t step) {
  dt::CkptMeta m;
  m.step = step;
  m.tokens = 100 * step;
  m.config = "test = pieces";
  return m;
}

// Loads `file` into `layout` on `comm` and checks every held element.
void load_and_check(const std::string& what, dt::Comm& comm, const std::string& file,
                    const Layout& layout, const dt::security::Keys* keys = nullptr,
                    float salt = 0.0f) {
  guarded(what, [&] {
    State got = make_state(layout, 0.0f, -1.0f);
    const dt::CkptMeta m = dt::load_checkpoint(comm, file, got.tensors, keys);
    H.expect(m.step >= 1 && m.config == "test = pieces", what + ": meta", str("step ", m.step));
    expect_values(what, got, salt);
  });
}

// The file on one rank (the last one of the world, on its own), loaded whole.
void load_alone(const std::string& what, dt::MpiComm& world, const std::string& file,
                const dt::security::Keys* keys = nullptr, float salt = 0.0f) {
  const int me = world.rank(), n = world.size();
  std::unique_ptr<dt::MpiComm> one = world.split_mpi(me == n - 1 ? 0 : 1, me);
  if (me == n - 1) load_and_check(what, *one, file, all_whole(), keys, salt);
  world.barrier();
}

void mode_mixed(dt::MpiComm& world, const std::string& dir) {
  const int me = world.rank(), n = world.size();
  const std::string ref = dir + "/ref/step-1.h5", pcs = dir + "/pieces/step-1.h5";
  {  // the reference: one rank, whole tensors
    std::unique_ptr<dt::MpiComm> one = world.split_mpi(me == 0 ? 0 : 1, me);
    if (me == 0)
      guarded("one-rank save", [&] {
        const State s = make_state(all_whole());
        dt::save_checkpoint(*one, dir + "/ref", s.tensors, meta_at(1), 1);
      });
    world.barrier();
  }
  const State mine = make_state(mixed(n, me));
  guarded("pieces save",
          [&] { dt::save_checkpoint(world, dir + "/pieces", mine.tensors, meta_at(1), 1); });
  if (me == 0) {
    for (const Spec& s : specs())
      for (const std::string& ds : {s.path, "/checksums" + s.path}) {
        std::vector<hsize_t> da, db;
        const auto a = raw(pcs, ds, &da), b = raw(ref, ds, &db);
        H.expect(!a.empty() && a.size() == b.size() && da == db &&
                     std::memcmp(a.data(), b.data(), a.size()) == 0,
                 "dataset " + ds,
                 str("differs from the one-rank file (", a.size(), " vs ", b.size(), " bytes)"));
      }
  }
  const auto problems = dt::verify_file(world, pcs);
  H.expect(problems.empty(), "verify", problems.empty() ? "" : problems[0]);
  load_and_check("load into another decomposition", world, pcs, other(n, me));
  load_and_check("load into the writers' decomposition", world, pcs, mixed(n, me));
  load_alone("load on one rank", world, pcs);
  load_and_check("one-rank file into the pieces", world, ref, mixed(n, me));
}

#if !defined(__SANITIZE_ADDRESS__)  // (used only where malloc may fail: see mode_refuse)
// Undoes squeeze_memory when destroyed.
struct Unsqueeze {
  bool on = false;
  rlimit old{};
  ~Unsqueeze() {
    if (on) setrlimit(RLIMIT_AS, &old);
  }
};

// Limits this process's address space to its present size plus `headroom` bytes, with every
// allocation of 64 KiB or more mapped on its own (so that one fails at once instead of coming
// from memory freed earlier).
Unsqueeze squeeze_memory(std::size_t headroom) {
  Unsqueeze u;
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return u;
  char line[256];
  unsigned long kb = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "VmSize: %lu kB", &kb) == 1) break;
  std::fclose(f);
  if (kb == 0 || getrlimit(RLIMIT_AS, &u.old) != 0) return u;
  mallopt(M_MMAP_MAX, 1 << 16);  // (MPI libraries may have turned mapping off)
  mallopt(M_MMAP_THRESHOLD, 64 << 10);
  malloc_trim(0);
  rlimit lim = u.old;
  lim.rlim_cur = kb * 1024 + headroom;
  u.on = setrlimit(RLIMIT_AS, &lim) == 0;
  return u;
}
#endif

void mode_refuse(dt::MpiComm& world, const std::string& dir) {
  const int me = world.rank(), n = world.size();
  const std::string d = dir + "/refuse";
  const State good = make_state(mixed(n, me));
  guarded("good save", [&] { dt::save_checkpoint(world, d, good.tensors, meta_at(1), 1); });
  // `save` is refused on every rank, saying `needles`; step 1 stays the latest and only checkpoint.
  auto refused_save = [&](const std::string& what, const std::function<void()>& save,
                          std::initializer_list<std::string> needles) {
    const std::string msg = expect_throw<dt::CheckpointError>(what, save, needles);
    if (me == 0) std::printf("%s: refused: %s\n", what.c_str(), msg.c_str());
    world.barrier();
    if (me == 0) {
      std::vector<std::string> names;
      for (const auto& e : fs::directory_iterator(d)) names.push_back(e.path().filename());
      std::sort(names.begin(), names.end());
      H.expect(names == std::vector<std::string>{"latest", "step-1.h5"}, what + ": directory",
               str(names.size(), " entries, first ", names.empty() ? "" : names[0],
                   names.size() > 1 ? ", " + names[1] : "", names.size() > 2 ? ", ..." : ""));
      H.expect(dt::read_latest(d) == d + "/step-1.h5", what + ": latest", dt::read_latest(d));
    }
    load_and_check(what + ": previous checkpoint", world, d + "/step-1.h5", other(n, me));
  };
  auto refused = [&](const std::string& what, const Layout& l,
                     std::initializer_list<std::string> needles) {
    const State s = make_state(l);
    refused_save(
        what, [&] { dt::save_checkpoint(world, d, s.tensors, meta_at(2), 1); }, needles);
  };
  if (n >= 3) {  // rank 1's columns reach one into rank 2's
    Layout l = mixed(n, me);
    if (me == 1) l[0].list[0].len += 1;
    const std::string c = std::to_string(cut(1000, n, 2));
    refused("overlap", l,
            {"/model/col.weight", "element " + c + " (row 0, column " + c + ")",
             "is held by rank 1 and by rank 2"});
  }
  {  // the last rank leaves out its columns of the k block
    Layout l = mixed(n, me);
    if (me == n - 1) l[1].list.erase(l[1].list.begin() + 1);
    const std::string a = std::to_string(600 + cut(600, n, n - 1));
    refused("gap", l,
            {"cannot save " + d + "/step-2.h5: /model/qkv.weight",
             "elements [" + a + ", 1200) (from row 0, column " + a + ") are held by no rank"});
  }
  if (n >= 2) {  // rank 0's range of the 3-D tensor ends 3 elements short of rank 1's
    Layout l = mixed(n, me);
    if (me == 0) l[8].b -= 3;
    const std::size_t at = mixed(n, 0)[8].b - 3;
    const std::string idx = str("[", at / (300 * 613), ", ", at / 613 % 300, ", ", at % 613, "]");
    refused("gap in a 3-D tensor", l,
            {"/model/conv.weight", str("elements [", at, ", ", at + 3, ") (from index ", idx, ")"),
             "are held by no rank"});
  }
  {
    Layout l = mixed(n, me);
    if (me == n - 1) l[4].list[0].count = 4;
    refused("piece past the end", l,
            {"rank " + std::to_string(n - 1) + ": /model/tiny: piece 0", "reaches past its 15"});
  }
  if (n >= 2) {
    Layout l = mixed(n, me);
    if (me == 0) l[0] = whole_part();
    refused("whole on one rank only", l, {"/model/col.weight: held whole by 1 of the"});
  }
  {  // tensor paths that cannot be datasets of one file, refused before the file is created
    const State s = make_state(mixed(n, me));
    auto with_path = [&](std::size_t i, const std::string& path) {
      std::vector<dt::CkptTensor> ts = s.tensors;
      ts[i].path = path;
      return ts;
    };
    const std::string first = s.tensors[0].path;
    for (const auto& [what, ts, needle] :
         {std::tuple<std::string, std::vector<dt::CkptTensor>, std::string>{
              "a path given twice", with_path(1, first), "'" + first + "' is given twice"},
          {"a path inside another tensor", with_path(1, first + "/x"),
           "lies inside tensor '" + first + "'"},
          {"a reserved path", with_path(1, "/checksums/x"), "which the checkpoint reserves"},
          {"a relative path", with_path(1, "x"), "is not of the form /name"}})
      refused_save(what, [&] { dt::save_checkpoint(world, d, ts, meta_at(2), 1); },
                   {"cannot save " + d + "/step-2.h5: tensor path", needle});
  }
#if !defined(__SANITIZE_ADDRESS__)  // (AddressSanitizer's allocator does not fail, it ends the run)
  if (n >= 2) {
    // Rank 1 runs out of memory packing its share (96 MiB) of a 128 MiB tensor held in ranges:
    // refused on every rank, naming it, instead of the others waiting for it in the exchange;
    // nothing is left behind. (An allocation that large cannot come from memory the process
    // already has: malloc maps it, and the limit refuses that.)
    const std::size_t N = std::size_t{1} << 25, q = N / 4 * 3;
    const auto others = static_cast<std::size_t>(n - 1),
               k = static_cast<std::size_t>(me - (me > 1));
    const std::size_t a = me == 1 ? 0 : q + (N - q) * k / others,
                      b = me == 1 ? q : q + (N - q) * (k + 1) / others;
    std::vector<float> part(b - a, 1.0f);
    dt::CkptTensor big;
    big.path = "/model/big";
    big.shape = {static_cast<std::int64_t>(N)};
    big.data = part.data();
    big.begin = a;
    big.end = b;
    refused_save("out of memory on rank 1",
                 [&] {
                   const Unsqueeze undo = me == 1 ? squeeze_memory(1 << 20) : Unsqueeze{};
                   dt::save_checkpoint(world, d, {big}, meta_at(2), 1);
                 },
                 {"cannot save " + d + "/step-2.h5: rank 1: out of memory"});
  }
#endif
  {  // a rank holding none of a tensor as a list of empty pieces is fine, and so is this save
    Layout l = mixed(n, me);
    if (l[2].kind == Part::range) l[2] = pieces_part({{0, 0, 0, 0, nullptr}});
    const State s = make_state(l);
    guarded("empty pieces", [&] { dt::save_checkpoint(world, d, s.tensors, meta_at(3), 2); });
    load_and_check("empty pieces: load", world, d + "/step-3.h5", all_whole());
  }
  // A damaged chunk is found whoever holds it: rank 0 loads a two-chunk tensor whole, every
  // other rank an empty range of it (the chunks are shared out for checking among all ranks,
  // and a rank that reads nothing checks nothing). Refused on every rank.
  if (n >= 2) {
    const std::size_t N = 2 * dt::kChunkElements;
    std::vector<float> v(N);
    for (std::size_t i = 0; i < N; ++i) v[i] = static_cast<float>(i % 977);
    dt::CkptTensor t;
    t.path = "/model/two";
    t.shape = {static_cast<std::int64_t>(N)};
    t.data = v.data();
    const std::string dd = dir + "/damaged";
    guarded("two-chunk save", [&] { dt::save_checkpoint(world, dd, {t}, meta_at(1), 1); });
    const std::string f = dd + "/step-1.h5";
    if (me == 0) {  // one element of chunk 1 changed, its digest not
      hid_t h = H5Fopen(f.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
      hid_t ds = H5Dopen2(h, "/model/two", H5P_DEFAULT);
      hid_t fsp = H5Dget_space(ds);
      const hsize_t at = dt::kChunkElements + 5, one = 1;
      H5Sselect_hyperslab(fsp, H5S_SELECT_SET, &at, nullptr, &one, nullptr);
      hid_t msp = H5Screate_simple(1, &one, nullptr);
      const float x = -1.0f;
      H5Dwrite(ds, H5T_NATIVE_FLOAT, msp, fsp, H5P_DEFAULT, &x);
      H5Sclose(msp);
      H5Sclose(fsp);
      H5Dclose(ds);
      H5Fclose(h);
    }
    world.barrier();
    std::vector<float> got(N, 0.0f);
    dt::CkptTensor l = t;
    l.data = got.data();
    if (me != 0) l.begin = l.end = 0;
    expect_throw<dt::CheckpointError>(
        "a damaged chunk, whole on rank 0 and an empty range elsewhere",
        [&] { dt::load_checkpoint(world, f, {l}); },
        {"/model/two: checksum mismatch in chunk 1 (of 2)"});
  }
  // A checkpoint of another model: the first eight tensors that differ are named, then how many
  // more, then the model settings the file records.
  {
    std::vector<float> v(64, 1.0f);
    std::vector<dt::CkptTensor> saved, asked;
    for (int i = 0; i < 12; ++i) {
      const std::string name = "/model/t" + std::to_string(10 + i);
      saved.push_back(dt::CkptTensor{name, {8}, v.data()});
      asked.push_back(dt::CkptTensor{name, {4}, v.data()});
    }
    const std::string dm = dir + "/mismatch";
    dt::CkptMeta m = meta_at(1);
    m.config = "model.embd = 8\ntrain.steps = 3\nmodel.layers = 2\n";
    guarded("mismatch save", [&] { dt::save_checkpoint(world, dm, saved, m, 1); });
    const std::string msg = expect_throw<dt::CheckpointError>(
        "another model", [&] { dt::load_checkpoint(world, dm + "/step-1.h5", asked); },
        {"checkpoint does not match the model: " + dm + "/step-1.h5 (12 tensors differ):",
         "\n  /model/t17: file [8], model [4]\n  ... and 4 more\n",
         "\n  the file's model: --model.embd=8, --model.layers=2"});
    H.expect(!contains(msg, "/model/t18"), "another model: eight tensors named", msg);
  }
}

void mode_encrypt(dt::MpiComm& world, const std::string& dir) {
  const int me = world.rank(), n = world.size();
  const auto key = keys_from('k');
  const std::string file = dir + "/enc/step-1.h5";
  const State mine = make_state(mixed(n, me));
  guarded("encrypted pieces save",
          [&] { dt::save_checkpoint(world, dir + "/enc", mine.tensors, meta_at(1), 1, {}, &key); });
  if (me == 0) {
    H.expect(dt::checkpoint_encryption(file) == "aes-256-gcm", "encryption", "plain file");
    for (std::size_t i = 0; i < specs().size(); ++i) {
      std::vector<hsize_t> dims;
      const auto r = raw(file, specs()[i].path, &dims);
      std::size_t same = 0;
      for (std::size_t e = 0; e * 4 < r.size(); ++e) {
        const float v = value(i, e);
        same += std::memcmp(r.data() + 4 * e, &v, 4) == 0;
      }
      H.expect(r.size() == 4 * numel(i) && same < numel(i) / 100 + 2,
               "ciphertext on disk: " + specs()[i].path, str(same, " elements in the clear"));
    }
  }
  const auto p_key = dt::verify_file(world, file, &key);
  H.expect(p_key.empty(), "verify with the key", p_key.empty() ? "" : p_key[0]);
  load_and_check("encrypted: load into another decomposition", world, file, other(n, me), &key);
  load_alone("encrypted: load on one rank", world, file, &key);
  State got = make_state(other(n, me), 0.0f, -1.0f);
  expect_throw<dt::CheckpointError>("encrypted: load without the key",
                                    [&] { dt::load_checkpoint(world, file, got.tensors); },
                                    {"checkpoint key:"});
}

void mode_async(dt::MpiComm& world, const std::string& dir) {
  const int me = world.rank(), n = world.size();
  const auto key = keys_from('a');
  for (const bool encrypted : {false, true}) {
    const std::string d = dir + (encrypted ? "/async-enc" : "/async");
    const std::string what = encrypted ? "encrypted async" : "async";
    guarded(what, [&] {
      dt::AsyncCheckpointer ac(world, d, 2, encrypted ? &key : nullptr);
      State s = make_state(mixed(n, me));
      ac.reserve(s.tensors);
      for (int step = 1; step <= 2; ++step) {
        const float salt = static_cast<float>(step - 1);
        if (step == 2) s = make_state(mixed(n, me), salt);
        ac.save(s.tensors, meta_at(step));
        for (auto& b : s.bufs) std::fill(b.begin(), b.end(), -7.0f);  // the snapshot is taken
        const dt::SaveStats st = ac.wait();
        H.expect(st.path == d + "/step-" + std::to_string(step) + ".h5", what + ": saved", st.path);
      }
    });
    for (int step = 1; step <= 2; ++step) {
      const std::string file = d + "/step-" + std::to_string(step) + ".h5";
      load_and_check(what + ": step " + std::to_string(step), world, file, other(n, me),
                     encrypted ? &key : nullptr, static_cast<float>(step - 1));
    }
    load_alone(what + ": on one rank", world, d + "/step-2.h5", encrypted ? &key : nullptr, 1.0f);
  }
}

void run(const std::string& dir, const std::string& mode) {
  std::unique_ptr<dt::MpiComm> world = dt::MpiComm::dup(MPI_COMM_WORLD, "world");
  const std::string d = dir + "/" + mode;
  if (world->rank() == 0) {
    fs::remove_all(d);
    fs::create_directories(d);
  }
  world->barrier();
  if (mode == "mixed")
    mode_mixed(*world, d);
  else if (mode == "refuse")
    mode_refuse(*world, d);
  else if (mode == "encrypt")
    mode_encrypt(*world, d);
  else if (mode == "async")
    mode_async(*world, d);
  else
    H.fail("mode", "unknown mode '" + mode + "'");
  world->barrier();
  if (world->rank() == 0) fs::remove_all(d);
}

}  // namespace

int main(int argc, char** argv) {
  return mpi_test_main(argc, argv, "test_ckpt_pieces", 2, "DIR mixed|refuse|encrypt|async",
                       [](char** a) {
                         H.prefix = a[2];
                         run(a[1], a[2]);
                       });
}
