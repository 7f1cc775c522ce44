// test_ckpt_crypto DIR: encrypted checkpoints (ckpt.encrypt) under mpiexec.
//
// Saves an encrypted checkpoint on every rank of the world, then checks: the file holds no
// plaintext chunk; a load with the key gives the saved values bit for bit, also on smaller
// sub-communicators (resharding); verify passes with and without the key; a load without the key,
// with a wrong key, or with a key on a plain file fails with "checkpoint key:" and leaves the
// tensors untouched; resume("auto") rethrows a wrong key instead of starting afresh, after trying
// older files (a key error may be one file's damage); chunks swapped
// together with their digests (an attacker who rewrites the checksums) and an altered step
// attribute fail authentication as tampered (SecurityError), where damage (a flipped bit in a
// tag) is a CheckpointError; resume("auto") stops at a tampered file and goes past a damaged
// one; the asynchronous checkpointer encrypts too.
// Leaves DIR/enc/step-3.h5 and the key files DIR/good.key, DIR/wrong.key (0600) and
// DIR/open.key (0644) for the dt_ckpt tests.
#include <hdf5.h>
#include <mpi.h>
#include <sys/stat.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
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
namespace sec = dt::security;
constexpr std::size_t kC = dt::kChunkElements;

struct State {
  std::vector<std::vector<float>> bufs;
  std::vector<dt::CkptTensor> tensors;
};

// Odd sizes: several chunks with a short last one, a 2-D tensor cut mid-row, a tiny one, a
// scalar (0-D).
State make_state(float salt) {
  State s;
  const std::vector<std::pair<std::string, dt::Shape>> specs = {
      {"/model/a.weight", {3, static_cast<std::int64_t>(kC) + 7}},
      {"/model/b.bias", {7}},
      {"/optim/exp_avg/a.weight", {static_cast<std::int64_t>(2 * kC + 1)}},
      {"/optim/scale", {}},
  };
  s.bufs.reserve(specs.size());
  for (const auto& [path, shape] : specs) {
    const std::size_t n = dt::shape_numel(shape);
    s.bufs.emplace_back(n);
    for (std::size_t i = 0; i < n; ++i)
      s.bufs.back()[i] = std::sin(static_cast<float>(i) * 0.001f + salt) * 3.0f;
    s.tensors.push_back(dt::CkptTensor{path, shape, s.bufs.back().data()});
  }
  return s;
}

void fill(State& s, float v) {
  for (auto& b : s.bufs) std::fill(b.begin(), b.end(), v);
}

bool same_bits(const State& a, const State& b) {
  for (std::size_t i = 0; i < a.bufs.size(); ++i)
    if (a.bufs[i].size() != b.bufs[i].size() ||
        std::memcmp(a.bufs[i].data(), b.bufs[i].data(), a.bufs[i].size() * sizeof(float)) != 0)
      return false;
  return true;
}

bool all_equal(const State& s, float v) {
  for (const auto& b : s.bufs)
    for (float x : b)
      if (x != v) return false;
  return true;
}

sec::Keys keys_from(char fill_byte, const std::string& job) {
  sec::Key k{};
  std::memset(k.data(), fill_byte, k.size());
  return sec::Keys(sec::SecretKey(k), job);
}

void write_key(const std::string& path, char fill_byte, mode_t mode) {
  std::ofstream(path, std::ios::binary) << std::string(sec::kKeyBytes, fill_byte);
  ::chmod(path.c_str(), mode);
}

// Raw dataset bytes through serial HDF5 (rank 0 only).
std::vector<float> raw(const std::string& file, const std::string& ds, std::size_t n) {
  std::vector<float> v(n);
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  hid_t d = H5Dopen2(f, ds.c_str(), H5P_DEFAULT);
  H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
  H5Dclose(d);
  H5Fclose(f);
  return v;
}

// Swaps rows r0 and r1 of a 2-D uint8 dataset, or the element ranges of two chunks of a float one.
// Chunks 0 and 1 of `data_ds` swapped, with their digests and nonces and tags; with
// `row_digests` also the digests of those (everything an attacker without the key can rewrite).
void swap_chunks(const std::string& file, const std::string& data_ds, std::size_t numel,
                 bool row_digests) {
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  std::vector<float> v(numel);
  hid_t d = H5Dopen2(f, data_ds.c_str(), H5P_DEFAULT);
  H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
  std::swap_ranges(v.begin(), v.begin() + kC, v.begin() + kC);
  H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
  H5Dclose(d);
  for (const std::string prefix : {"/checksums", "/crypto", "/checksums/crypto"}) {
    if (prefix == "/checksums/crypto" && !row_digests) continue;
    hid_t c = H5Dopen2(f, (prefix + data_ds).c_str(), H5P_DEFAULT);
    hid_t sp = H5Dget_space(c);
    hsize_t dims[2] = {0, 0};
    H5Sget_simple_extent_dims(sp, dims, nullptr);
    std::vector<unsigned char> rows(dims[0] * dims[1]);
    H5Dread(c, H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, H5P_DEFAULT, rows.data());
    std::swap_ranges(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(dims[1]),
                     rows.begin() + static_cast<std::ptrdiff_t>(dims[1]));
    H5Dwrite(c, H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, H5P_DEFAULT, rows.data());
    H5Sclose(sp);
    H5Dclose(c);
  }
  H5Fclose(f);
}

// Byte `at` of row `row` of dataset `ds` (a [rows, width] byte table) flipped.
void flip_row_byte(const std::string& file, const std::string& ds, std::size_t row,
                   std::size_t at) {
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  hid_t c = H5Dopen2(f, ds.c_str(), H5P_DEFAULT);
  hid_t sp = H5Dget_space(c);
  hsize_t dims[2] = {0, 0};
  H5Sget_simple_extent_dims(sp, dims, nullptr);
  std::vector<unsigned char> rows(dims[0] * dims[1]);
  H5Dread(c, H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, H5P_DEFAULT, rows.data());
  rows[row * dims[1] + at] ^= 0x10;
  H5Dwrite(c, H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, H5P_DEFAULT, rows.data());
  H5Sclose(sp);
  H5Dclose(c);
  H5Fclose(f);
}

void set_int_attr(const std::string& file, const char* name, std::int64_t v) {
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  hid_t a = H5Aopen_by_name(f, "/", name, H5P_DEFAULT, H5P_DEFAULT);
  H5Awrite(a, H5T_NATIVE_INT64, &v);
  H5Aclose(a);
  H5Fclose(f);
}
void set_step_attr(const std::string& file, std::int64_t step) { set_int_attr(file, "step", step); }

// Root attribute `name` of file `from` written over that of `to` (fixed-size types only).
void copy_root_attr(const std::string& from, const std::string& to, const char* name) {
  hid_t f = H5Fopen(from.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  hid_t a = H5Aopen_by_name(f, "/", name, H5P_DEFAULT, H5P_DEFAULT);
  hid_t type = H5Aget_type(a);
  std::vector<unsigned char> raw(H5Aget_storage_size(a));
  H5Aread(a, type, raw.data());
  H5Aclose(a);
  H5Fclose(f);
  hid_t g = H5Fopen(to.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  hid_t root = H5Gopen2(g, "/", H5P_DEFAULT);
  H5Adelete(root, name);
  hid_t sp = H5Screate(H5S_SCALAR);
  hid_t b = H5Acreate2(root, name, type, sp, H5P_DEFAULT, H5P_DEFAULT);
  H5Awrite(b, type, raw.data());
  H5Aclose(b);
  H5Sclose(sp);
  H5Tclose(type);
  H5Gclose(root);
  H5Fclose(g);
}

// The first character of root string attribute `name` of `file` changed to another hex digit
// (one damaged byte).
void flip_hex_attr(const std::string& file, const char* name) {
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  hid_t a = H5Aopen_by_name(f, "/", name, H5P_DEFAULT, H5P_DEFAULT);
  hid_t type = H5Aget_type(a);
  std::string v(H5Tget_size(type), '\0');
  H5Aread(a, type, v.data());
  v[0] = v[0] == '0' ? '1' : '0';
  H5Awrite(a, type, v.data());
  H5Tclose(type);
  H5Aclose(a);
  H5Fclose(f);
}

// `file` as a format-version-1 writer left it: version 1, no meta_sha256, manifest_sha256,
// datasets or loss scaler schedule.
void make_version1(const std::string& file) {
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  for (const char* a : {"meta_sha256", "manifest_sha256", "datasets", "loss_scale_growth_tracker",
                        "loss_scale_hysteresis_left", "steps_skipped", "data"})
    H5Adelete_by_name(f, "/", a, H5P_DEFAULT);
  H5Fclose(f);
  set_int_attr(file, "format_version", 1);
}

// The string attribute `name` of the root of `file`.
std::string string_attr(const std::string& file, const char* name) {
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  hid_t a = H5Aopen_by_name(f, "/", name, H5P_DEFAULT, H5P_DEFAULT);
  hid_t type = H5Aget_type(a);
  std::string v(H5Tget_size(type), '\0');
  H5Aread(a, type, v.data());
  H5Tclose(type);
  H5Aclose(a);
  H5Fclose(f);
  return v;
}

void copy_file(const std::string& from, const std::string& to) {
  std::filesystem::copy_file(from, to, std::filesystem::copy_options::overwrite_existing);
}

int run(const std::string& dir, int world_rank) {
  std::unique_ptr<dt::MpiComm> world = dt::MpiComm::dup(MPI_COMM_WORLD, "world");
  const int me = world->rank(), n = world->size();
  const std::string enc_dir = dir + "/enc", plain_dir = dir + "/plain", bad_dir = dir + "/bad";
  if (me == 0) {
    std::filesystem::remove_all(enc_dir);
    std::filesystem::remove_all(plain_dir);
    std::filesystem::remove_all(bad_dir);
    std::filesystem::create_directories(bad_dir);
    write_key(dir + "/good.key", 'g', 0600);
    write_key(dir + "/wrong.key", 'w', 0600);
    write_key(dir + "/open.key", 'g', 0644);
  }
  world->barrier();
  const sec::Keys good = keys_from('g', "job-1");
  const sec::Keys good_other_job = keys_from('g', "job-2");  // a later job with the same key
  const sec::Keys wrong = keys_from('w', "job-1");
  H.expect(sec::load_key_file(dir + "/good.key").bytes()[0] == 'g', "key file", "wrong bytes");

  const State saved = make_state(0.5f);
  dt::CkptMeta meta;
  meta.step = 3;
  meta.tokens = 300;
  meta.config = "ckpt.encrypt = true";
  meta.layout = "dp=" + std::to_string(n);
  guarded("encrypted save",
          [&] { dt::save_checkpoint(*world, enc_dir, saved.tensors, meta, 2, {}, &good); });
  const std::string file = enc_dir + "/step-3.h5";

  // No one rank's salt decides the file key: with rank 0's salt replayed (the same salt in two
  // saves), the other ranks' fresh salts still give the two files different keys, so that no
  // chunk is sealed twice under one key and nonce. (One rank alone has only its own salt.)
  {
    const sec::Salt replayed = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    if (me == 0) sec::detail::salt_for_test = &replayed;
    guarded("two saves with rank 0's salt replayed", [&] {
      dt::save_checkpoint(*world, dir + "/replay-a", saved.tensors, meta, 2, {}, &good);
      dt::save_checkpoint(*world, dir + "/replay-b", saved.tensors, meta, 2, {}, &good);
    });
    sec::detail::salt_for_test = nullptr;
    if (me == 0) {
      const std::string a = string_attr(dir + "/replay-a/step-3.h5", "key_salt");
      const std::string b = string_attr(dir + "/replay-b/step-3.h5", "key_salt");
      H.expect(!a.empty() && (n > 1 ? a != b : a == b),
               n > 1 ? "the file key depends on every rank's salt" : "one rank: its salt alone",
               "key_salt " + a + " and " + b);
    }
  }

  if (me == 0) {
    guarded("no plaintext in the file", [&] {
      H.expect(dt::checkpoint_encryption(file) == "aes-256-gcm", "encryption attribute",
               dt::checkpoint_encryption(file));
      for (std::size_t i = 0; i < saved.tensors.size(); ++i) {
        const std::size_t numel = saved.tensors[i].numel();
        const auto r = raw(file, saved.tensors[i].path, numel);
        std::size_t same = 0;
        for (std::size_t k = 0; k < numel; ++k) same += r[k] == saved.bufs[i][k];
        H.expect(same < numel / 100 + 2, "ciphertext on disk: " + saved.tensors[i].path,
                 str(same, " of ", numel, " elements stored in the clear"));
      }
    });
  }
  world->barrier();

  // Load with the key, on the world and on smaller sub-communicators (a new layout), in a later
  // job: bit-exact.
  for (int part = 0; part < 2; ++part) {
    std::unique_ptr<dt::MpiComm> sub =
        part == 0 ? world->split_mpi(0, me) : world->split_mpi(me == 0 ? 0 : 1, me);
    State got = make_state(9.0f);
    fill(got, -1.0f);
    guarded(str("load with key on ", sub->size(), " of ", n, " ranks"), [&] {
      const dt::CkptMeta m = dt::load_checkpoint(*sub, file, got.tensors, &good_other_job);
      H.expect(m.step == 3 && m.tokens == 300 && m.config == meta.config, "meta", "wrong meta");
      H.expect(same_bits(got, saved), str("load on ", sub->size(), " ranks"),
               "values differ from the saved ones");
    });
  }
  {
    const auto p_key = dt::verify_file(*world, file, &good);
    H.expect(p_key.empty(), "verify with key", p_key.empty() ? "" : p_key[0]);
    const auto p_nokey = dt::verify_file(*world, file);
    H.expect(p_nokey.empty(), "verify without key (digests)", p_nokey.empty() ? "" : p_nokey[0]);
    const auto p_wrong = dt::verify_file(*world, file, &wrong);
    H.expect(p_wrong.size() == 1 && contains(p_wrong[0], "checkpoint key: wrong key"),
             "verify with a wrong key", p_wrong.empty() ? "no problem reported" : p_wrong[0]);
  }
  // Refusals leave the tensors untouched.
  {
    State got = make_state(9.0f);
    fill(got, -1.0f);
    expect_throw<dt::CheckpointError>(
        "load with a wrong key", [&] { dt::load_checkpoint(*world, file, got.tensors, &wrong); },
        {"checkpoint key: wrong key", "step-3.h5"});
    expect_throw<dt::CheckpointError>("load without a key",
                                      [&] { dt::load_checkpoint(*world, file, got.tensors); },
                                      {"checkpoint key:", "is encrypted"});
    H.expect(all_equal(got, -1.0f), "a refused load", "wrote into the tensors");
    std::string used;
    expect_throw<dt::CheckpointError>("resume auto with a wrong key",
                                      [&] {
                                        dt::resume(
                                            *world, "auto", enc_dir, got.tensors, &used,
                                            [](const std::string&) {}, &wrong);
                                      },
                                      {"wrong key"});
    H.expect(all_equal(got, -1.0f) && used.empty(), "resume with a wrong key", "loaded something");
    guarded("resume auto with the key", [&] {
      dt::resume(
          *world, "auto", enc_dir, got.tensors, &used, [](const std::string&) {}, &good);
      H.expect(same_bits(got, saved) && used == file, "resume auto with the key", used);
    });
  }
  // A key error may be one file's damage: resume("auto") then loads an older file that
  // authenticates, and throws the first key error only when none does. Here the newest file,
  // step-6.h5, was encrypted under another key: to this job its key check fails as a damaged one
  // would.
  {
    const std::string fall = bad_dir + "/fall";
    guarded("saves under two keys", [&] {
      dt::save_checkpoint(*world, fall, saved.tensors, meta, 2, {}, &good);
      dt::CkptMeta m6 = meta;
      m6.step = 6;
      dt::save_checkpoint(*world, fall, make_state(0.25f).tensors, m6, 2, {}, &wrong);
    });
    State got = make_state(9.0f);
    std::string used;
    std::vector<std::string> lines;
    guarded("resume auto past a file that fails its key check", [&] {
      const dt::CkptMeta m = dt::resume(
          *world, "auto", fall, got.tensors, &used,
          [&](const std::string& l) { lines.push_back(l); }, &good);
      H.expect(used == fall + "/step-3.h5" && m.step == 3 && same_bits(got, saved),
               "resume auto past a key error", "used '" + used + "'");
      bool named = false;
      for (const auto& l : lines)
        named = named || (contains(l, "skipping " + fall + "/step-6.h5") &&
                          contains(l, "checkpoint key: wrong key"));
      H.expect(named, "the skipped file is named with its key error",
               lines.empty() ? "no line" : lines[0]);
    });
    const sec::Keys third = keys_from('t', "job-1");
    expect_throw<dt::CheckpointError>(
        "resume auto when no file takes the key: the newest file's key error",
        [&] {
          dt::resume(
              *world, "auto", fall, got.tensors, &used, [](const std::string&) {}, &third);
        },
        {"checkpoint key: wrong key", "step-6.h5"});
  }
  // A key error that comes from this run's settings is no damage: resume("auto") stops at the
  // newest file and never rolls the run back to an older file of the other kind. A plain step-6
  // over an encrypted step-3, resumed with ckpt.encrypt (a key); then an encrypted step-6 over a
  // plain step-3, resumed without a key.
  for (const bool encrypt : {true, false}) {
    const std::string mixed =
        bad_dir + (encrypt ? "/plain-over-encrypted" : "/encrypted-over-plain");
    guarded("saves of both kinds", [&] {
      dt::save_checkpoint(*world, mixed, saved.tensors, meta, 2, {}, encrypt ? &good : nullptr);
      dt::CkptMeta m6 = meta;
      m6.step = 6;
      dt::save_checkpoint(*world, mixed, make_state(0.25f).tensors, m6, 2, {},
                          encrypt ? nullptr : &good);
    });
    State got = make_state(9.0f);
    fill(got, -1.0f);
    std::string used;
    expect_throw<dt::CheckpointError>(
        encrypt ? "resume auto with a key over a newer plain file"
                : "resume auto without a key over a newer encrypted file",
        [&] {
          dt::resume(
              *world, "auto", mixed, got.tensors, &used, [](const std::string&) {},
              encrypt ? &good : nullptr);
        },
        {"checkpoint key:", "step-6.h5",
         encrypt ? "is not encrypted, and ckpt.encrypt is on" : "loading it needs the job key"});
    H.expect(all_equal(got, -1.0f) && used.empty(), "nothing loaded after a settings key error",
             "used '" + used + "'");
  }
  // A plain checkpoint: loads without a key, refused with one (ckpt.encrypt is on).
  guarded("plain checkpoint", [&] {
    dt::save_checkpoint(*world, plain_dir, saved.tensors, meta, 1);
    State got = make_state(9.0f);
    dt::load_checkpoint(*world, plain_dir + "/step-3.h5", got.tensors);
    H.expect(same_bits(got, saved), "plain load", "values differ");
    H.expect(dt::checkpoint_encryption(plain_dir + "/step-3.h5").empty(), "plain attribute", "");
    expect_throw<dt::CheckpointError>(
        "plain checkpoint with ckpt.encrypt",
        [&] { dt::load_checkpoint(*world, plain_dir + "/step-3.h5", got.tensors, &good); },
        {"checkpoint key:", "not encrypted"});
  });
  // A plain checkpoint's root attributes carry a digest (meta_sha256): an altered step is refused
  // by a load and reported by verify, as a damaged chunk is.
  {
    const std::string altered = bad_dir + "/plain-step.h5";
    if (me == 0) {
      copy_file(plain_dir + "/step-3.h5", altered);
      set_step_attr(altered, 4);
    }
    world->barrier();
    State got = make_state(9.0f);
    expect_throw<dt::CheckpointError>(
        "plain checkpoint with an altered step",
        [&] { dt::load_checkpoint(*world, altered, got.tensors); },
        {"plain-step.h5", "checksum mismatch in the root attributes", "meta_sha256"});
    const auto p = dt::verify_file(*world, altered);  // problems are returned, not thrown
    H.expect(p.size() == 1 && contains(p[0], "checksum mismatch in the root attributes"),
             "verify reports an altered step", p.empty() ? "no problem reported" : p[0]);
    // The count of datasets the save wrote, altered: damage that load and verify name (it was
    // read for the message only).
    const std::string count = bad_dir + "/plain-count.h5";
    if (me == 0) {
      copy_file(plain_dir + "/step-3.h5", count);
      set_int_attr(count, "datasets", static_cast<std::int64_t>(saved.tensors.size()) - 1);
    }
    world->barrier();
    expect_throw<dt::CheckpointError>(
        "plain checkpoint with an altered dataset count",
        [&] { dt::load_checkpoint(*world, count, got.tensors); },
        {"plain-count.h5", "attribute datasets says", "the attribute is damaged"});
    const auto pc = dt::verify_file(*world, count);
    H.expect(pc.size() == 1 && contains(pc[0], "attribute datasets says"),
             "verify reports an altered dataset count", pc.empty() ? "no problem reported" : pc[0]);
    // A version-1 file has no digest of its root attributes and still loads; a version-2 file
    // without one is refused.
    const std::string v1 = bad_dir + "/plain-v1.h5", v2 = bad_dir + "/plain-v2-nodigest.h5";
    if (me == 0) {
      copy_file(plain_dir + "/step-3.h5", v1);
      make_version1(v1);
      copy_file(plain_dir + "/step-3.h5", v2);
      make_version1(v2);
      set_int_attr(v2, "format_version", 2);
    }
    world->barrier();
    guarded("a version-1 file loads", [&] {
      const dt::CkptMeta m = dt::load_checkpoint(*world, v1, got.tensors);
      H.expect(m.step == 3 && same_bits(got, saved), "version-1 load", "values differ");
      H.expect(m.loss_scale_growth_tracker == -1 && m.loss_scale_hysteresis_left == -1 &&
                   m.steps_skipped == -1,
               "version-1 load", "a loss scaler schedule read from a file without one");
      H.expect(m.data.empty(), "version-1 load", "a data identity read from a file without one");
      const auto pv = dt::verify_file(*world, v1);
      H.expect(pv.empty(), "a version-1 file verifies", pv.empty() ? "" : pv[0]);
    });
    expect_throw<dt::CheckpointError>("a version-2 file without meta_sha256",
                                      [&] { dt::load_checkpoint(*world, v2, got.tensors); },
                                      {"meta_sha256 (missing)"});
    // The version number is covered by no digest, and it decides which digests are checked: a
    // lowered one (with the attributes of its real version still there) is refused, also when
    // the meta data it would have let through was altered.
    const std::string low1 = bad_dir + "/plain-lowered-1.h5",
                      low2 = bad_dir + "/plain-lowered-2.h5",
                      low3 = bad_dir + "/plain-lowered-3.h5";
    if (me == 0) {
      copy_file(plain_dir + "/step-3.h5", low1);
      set_int_attr(low1, "format_version", 1);
      set_int_attr(low1, "tokens", 999);
      copy_file(plain_dir + "/step-3.h5", low2);
      set_int_attr(low2, "format_version", 2);
      copy_file(plain_dir + "/step-3.h5", low3);
      set_int_attr(low3, "format_version", 3);
    }
    world->barrier();
    expect_throw<dt::CheckpointError>(
        "a file whose format_version was lowered to 1",
        [&] { dt::load_checkpoint(*world, low1, got.tensors); },
        {"format_version 1 is lower than its attributes say", "meta_sha256", "damaged"});
    expect_throw<dt::CheckpointError>(
        "a file whose format_version was lowered to 2",
        [&] { dt::load_checkpoint(*world, low2, got.tensors); },
        {"format_version 2 is lower than its attributes say", "loss_scale_growth_tracker"});
    expect_throw<dt::CheckpointError>(
        "a file whose format_version was lowered to 3",
        [&] { dt::load_checkpoint(*world, low3, got.tensors); },
        {"format_version 3 is lower than its attributes say", "(data is written from version 4)"});
    const auto plow = dt::verify_file(*world, low1);
    H.expect(plow.size() == 1 && contains(plow[0], "lower than its attributes say"),
             "verify of a lowered format_version", plow.empty() ? "no problem" : plow[0]);
    // A tensor lost with its digests: verify compares the datasets present with the digest of
    // those the save wrote (manifest_sha256).
    const std::string lost = bad_dir + "/plain-lost.h5";
    if (me == 0) {
      copy_file(plain_dir + "/step-3.h5", lost);
      hid_t f = H5Fopen(lost.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
      H5Ldelete(f, "/optim/exp_avg/a.weight", H5P_DEFAULT);
      H5Ldelete(f, "/checksums/optim/exp_avg/a.weight", H5P_DEFAULT);
      H5Fclose(f);
    }
    world->barrier();
    const auto pl = dt::verify_file(*world, lost);
    H.expect(pl.size() == 1 && contains(pl[0], "datasets present (names and shapes) are not the") &&
                 contains(pl[0], "a tensor was lost, added or reshaped"),
             "verify reports a tensor lost with its digests", pl.empty() ? "no problem" : pl[0]);
  }
  // Tampering by someone who can rewrite the digests: two chunks swapped with their digests,
  // nonces and tags and the digests of those; the step attribute changed together with its digest
  // (meta_sha256 taken from a file whose meta data is the same but for step 4). Data that passes
  // its digests and fails authentication is no damage: a SecurityError. Damage for comparison:
  // the same swap leaving the digests of the nonces and tags, and one flipped bit in a tag, each
  // fail a digest: a CheckpointError, as any damaged file.
  const std::string swapped = bad_dir + "/swapped.h5", stepped = bad_dir + "/stepped.h5",
                    moved = bad_dir + "/moved.h5", tag_flip = bad_dir + "/tag-flip.h5";
  const std::string ds = "/optim/exp_avg/a.weight";
  {
    dt::CkptMeta m4 = meta;
    m4.step = 4;
    guarded("a plain file of step 4",
            [&] { dt::save_checkpoint(*world, bad_dir + "/four", saved.tensors, m4, 1); });
  }
  if (me == 0) {
    copy_file(file, swapped);
    swap_chunks(swapped, ds, 2 * kC + 1, true);
    copy_file(file, moved);
    swap_chunks(moved, ds, 2 * kC + 1, false);
    copy_file(file, tag_flip);
    flip_row_byte(tag_flip, "/crypto" + ds, 1, sec::kNonceBytes + 3);
    copy_file(file, stepped);
    set_step_attr(stepped, 4);
    copy_root_attr(bad_dir + "/four/step-4.h5", stepped, "meta_sha256");
  }
  world->barrier();
  {
    State got = make_state(9.0f);
    const auto p_nokey = dt::verify_file(*world, swapped);
    H.expect(p_nokey.empty(), "swapped chunks pass the digests", p_nokey.empty() ? "" : p_nokey[0]);
    const auto p = dt::verify_file(*world, swapped, &good);
    H.expect(p.size() == 1 &&
                 contains(p[0], ds + ": authentication failed in chunks 0,1 (of 3) although they "
                                     "match their checksums") &&
                 contains(p[0], "(tampering)"),
             "swapped chunks fail authentication as tampered", p.empty() ? "no problem" : p[0]);
    fill(got, -1.0f);
    expect_throw<dt::SecurityError>(
        "load of swapped chunks", [&] { dt::load_checkpoint(*world, swapped, got.tensors, &good); },
        {"swapped.h5: tampered:", "authentication failed in chunks 0,1", "(tampering)"});
    for (const auto& [f, what, chunks] :
         {std::tuple<std::string, const char*, const char*>{moved,
                                                            "chunks swapped without the "
                                                            "digests of their tags",
                                                            "chunks 0,1 (of 3)"},
          {tag_flip, "a flipped bit in a tag", "chunk 1 (of 3)"}}) {
      const auto pd = dt::verify_file(*world, f, &good);
      H.expect(pd.size() == 1 &&
                   contains(pd[0], ds + ": authentication failed in " + chunks +
                                       ": altered, moved or from another file") &&
                   !contains(pd[0], "tampering"),
               str(what, ": damage, not tampering"), pd.empty() ? "no problem" : pd[0]);
      // Without the key, the nonces' and tags' digests still tell the damage (a verify without
      // the key said ok).
      const auto pk = dt::verify_file(*world, f);
      H.expect(pk.size() == 1 &&
                   contains(pk[0], ds + ": checksum mismatch in the nonce and tag of " + chunks),
               str(what, ": found without the key"), pk.empty() ? "no problem" : pk[0]);
      expect_throw<dt::CheckpointError>(str("load with ", what),
                                        [&] { dt::load_checkpoint(*world, f, got.tensors, &good); },
                                        {"corrupt:", "authentication failed in"});
    }
    const auto p_step = dt::verify_file(*world, stepped);
    H.expect(p_step.empty(), "an altered step with its digest passes the digests",
             p_step.empty() ? "" : p_step[0]);
    expect_throw<dt::SecurityError>(
        "load with an altered step",
        [&] { dt::load_checkpoint(*world, stepped, got.tensors, &good); },
        {"fail authentication although they match their checksum (meta_sha256)", "(tampering)"});
  }
  // A damaged key attribute (one byte of meta_tag, key_check or key_salt) is damage, not
  // tampering: its digest (crypto_sha256) fails first, so resume goes on to an older file. The
  // same damage in a file without that digest (written before it) is damage too: nothing there
  // tells it from tampering.
  {
    State got = make_state(9.0f);
    for (const char* a : {"meta_tag", "key_check", "key_salt"}) {
      const std::string f = bad_dir + "/damaged-" + a + ".h5";
      if (me == 0) {
        copy_file(file, f);
        flip_hex_attr(f, a);
      }
      world->barrier();
      expect_throw<dt::CheckpointError>(
          str("load with a damaged ", a),
          [&] { dt::load_checkpoint(*world, f, got.tensors, &good); },
          {"checksum mismatch in the key attributes", "crypto_sha256: damaged"});
      const auto p = dt::verify_file(*world, f, &good);
      H.expect(
          p.size() == 1 && contains(p[0], "crypto_sha256: damaged") && !contains(p[0], "tampering"),
          str("verify of a damaged ", a), p.empty() ? "no problem" : p[0]);
      const auto pk = dt::verify_file(*world, f);
      H.expect(pk.size() == 1 && contains(pk[0], "crypto_sha256: damaged"),
               str("verify without the key of a damaged ", a), pk.empty() ? "no problem" : pk[0]);
    }
    // The attribute that says the file is encrypted, deleted: damaged, not a plain file (whose
    // ciphertext would load as weights), with the key or without.
    const std::string unmarked = bad_dir + "/no-encryption-attribute.h5";
    if (me == 0) {
      copy_file(file, unmarked);
      hid_t g = H5Fopen(unmarked.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
      H5Adelete_by_name(g, "/", "encryption", H5P_DEFAULT);
      H5Fclose(g);
    }
    world->barrier();
    for (const dt::security::Keys* k : {&good, static_cast<const dt::security::Keys*>(nullptr)}) {
      const auto pu = dt::verify_file(*world, unmarked, k);
      H.expect(pu.size() == 1 && contains(pu[0],
                                          "the attribute 'encryption' is missing, but the "
                                          "file holds what encryption writes (key_salt, "
                                          "key_check, meta_tag, crypto_sha256, /crypto)"),
               str("verify of a file without 'encryption', ", k ? "with" : "without", " the key"),
               pu.empty() ? "no problem" : pu[0]);
      expect_throw<dt::CheckpointError>(
          str("load of a file without 'encryption', ", k ? "with" : "without", " the key"),
          [&] { dt::load_checkpoint(*world, unmarked, got.tensors, k); },
          {"the attribute 'encryption' is missing", "damaged"});
    }
    const std::string old_tag = bad_dir + "/damaged-meta_tag-undigested.h5";
    if (me == 0) {
      copy_file(file, old_tag);
      flip_hex_attr(old_tag, "meta_tag");
      hid_t g = H5Fopen(old_tag.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
      H5Adelete_by_name(g, "/", "crypto_sha256", H5P_DEFAULT);
      H5Fclose(g);
    }
    world->barrier();
    expect_throw<dt::CheckpointError>(
        "load with a damaged meta_tag and no crypto_sha256",
        [&] { dt::load_checkpoint(*world, old_tag, got.tensors, &good); },
        {"fail authentication: altered"});
  }
  // resume("auto") stops at a tampered file instead of rolling the run back to an older one, and
  // loads nothing; past a damaged one it loads the older file. Folders of a good step-3 and a
  // step-6, tampered (its chunks swapped with every digest) or damaged (a flipped bit in a tag).
  {
    dt::CkptMeta m6 = meta;
    m6.step = 6;
    const std::string tdir = bad_dir + "/resume-tampered", ddir = bad_dir + "/resume-damaged";
    for (const auto& d : {tdir, ddir})
      guarded("saves of steps 3 and 6", [&] {
        dt::save_checkpoint(*world, d, saved.tensors, meta, 2, {}, &good);
        dt::save_checkpoint(*world, d, make_state(0.25f).tensors, m6, 2, {}, &good);
      });
    if (me == 0) {
      swap_chunks(tdir + "/step-6.h5", ds, 2 * kC + 1, true);
      flip_row_byte(ddir + "/step-6.h5", "/crypto" + ds, 1, sec::kNonceBytes + 3);
    }
    world->barrier();
    State got = make_state(9.0f);
    fill(got, -1.0f);
    std::string used;
    expect_throw<dt::SecurityError>("resume auto at a tampered newest file",
                                    [&] {
                                      dt::resume(
                                          *world, "auto", tdir, got.tensors, &used,
                                          [](const std::string&) {}, &good);
                                    },
                                    {"step-6.h5: tampered:", "(tampering)"});
    H.expect(used.empty(), "resume at a tampered file uses no file", used);
    guarded("resume auto past a damaged newest file", [&] {
      std::vector<std::string> lines;
      const dt::CkptMeta m = dt::resume(
          *world, "auto", ddir, got.tensors, &used,
          [&](const std::string& l) { lines.push_back(l); }, &good);
      H.expect(used == ddir + "/step-3.h5" && m.step == 3 && same_bits(got, saved),
               "resume auto past a damaged file", "used '" + used + "'");
      bool named = false;
      for (const auto& l : lines)
        named = named || (contains(l, "skipping " + ddir + "/step-6.h5") &&
                          contains(l, "altered, moved or from another file"));
      H.expect(named, "the skipped damaged file is named", lines.empty() ? "no line" : lines[0]);
    });
  }
  // The asynchronous checkpointer encrypts too.
  guarded("async encrypted save", [&] {
    dt::AsyncCheckpointer ac(*world, bad_dir + "/async", 1, &good);
    dt::CkptMeta m2 = meta;
    m2.step = 5;
    ac.save(saved.tensors, m2);
    ac.wait();
    const std::string f5 = bad_dir + "/async/step-5.h5";
    H.expect(dt::checkpoint_encryption(f5) == "aes-256-gcm", "async encryption", "plain file");
    State got = make_state(9.0f);
    dt::load_checkpoint(*world, f5, got.tensors, &good);
    H.expect(same_bits(got, saved), "async encrypted load", "values differ");
  });
  world->barrier();
  (void)world_rank;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return mpi_test_main(argc, argv, "test_ckpt_crypto", 1, "DIR",
                       [](char** a) { run(a[1], H.rank); });
}
