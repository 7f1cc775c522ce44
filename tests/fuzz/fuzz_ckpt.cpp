// Fuzz target: the checkpoint reader (src/ckpt/checkpoint.cpp: load_checkpoint, verify_file,
// checkpoint_encryption), plain and encrypted.
//
// HDF5's own file-format parser is not the subject (it is a dependency with its own fuzzing): each
// input is a list of structural edits applied through the HDF5 API to a valid checkpoint that dt
// wrote (plain or encrypted): attributes deleted or rewritten with other types and values,
// datasets deleted, replaced by others of any shape and type, added, or with bytes altered,
// digests and per-chunk nonces/tags altered. Contract checked: every reader call either succeeds
// or throws dt::CheckpointError, and a load that succeeds with the key of an encrypted file gives
// exactly the saved values unless only unauthenticated parts changed.
#include <hdf5.h>
#include <mpi.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "comm/mpi_comm.hpp"
#include "dt/checkpoint.hpp"
#include "dt/error.hpp"
#include "dt/security.hpp"
#include "fuzz_util.hpp"

namespace sec = dt::security;

namespace {

struct Model {
  std::vector<std::vector<float>> bufs;
  std::vector<dt::CkptTensor> tensors;
  explicit Model(float v) {
    const std::vector<std::pair<std::string, dt::Shape>> specs = {
        {"/model/w", {5, 7}},
        {"/model/b", {7}},
        {"/model/big", {static_cast<std::int64_t>(dt::kChunkElements + 3)}},
        {"/optim/exp_avg/w", {5, 7}},
    };
    bufs.reserve(specs.size());
    for (const auto& [p, s] : specs) {
      bufs.emplace_back(dt::shape_numel(s));
      for (std::size_t i = 0; i < bufs.back().size(); ++i)
        bufs.back()[i] = v + static_cast<float>(i % 97) * 0.25f;
      tensors.push_back(dt::CkptTensor{p, s, bufs.back().data()});
    }
  }
};

struct Env {
  std::unique_ptr<dt::MpiComm> world;
  std::unique_ptr<sec::Keys> keys;
  std::string plain, encrypted;  // file bytes
};

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

Env& env() {
  static Env e = [] {
    int init = 0, provided = 0;
    MPI_Initialized(&init);
    if (!init) MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    Env v;
    v.world = dt::MpiComm::dup(MPI_COMM_WORLD, "fuzz");
    sec::Key k{};
    k.fill(0x5a);
    v.keys = std::make_unique<sec::Keys>(sec::SecretKey(k), "fuzz");
    const std::string dir = dt_fuzz::scratch("ckpt_seed", "");
    Model m(1.0f);
    dt::CkptMeta meta;
    meta.step = 7;
    meta.config = "a = 1";
    dt::save_checkpoint(*v.world, dir + "/p", m.tensors, meta, 1);
    dt::save_checkpoint(*v.world, dir + "/e", m.tensors, meta, 1, {}, v.keys.get());
    v.plain = slurp(dir + "/p/step-7.h5");
    v.encrypted = slurp(dir + "/e/step-7.h5");
    std::filesystem::remove_all(dir);
    return v;
  }();
  return e;
}

const char* kAttrs[] = {"format",     "format_version", "step",
                        "tokens",     "optimizer_step", "data_position",
                        "rng_seed",   "loss_scale",     "config",
                        "layout",     "dt_version",     "chunk_elements",
                        "encryption", "key_salt",       "key_check",
                        "meta_tag",   "meta_sha256",    "manifest_sha256",
                        "datasets",   "steps_skipped",  "loss_scale_growth_tracker",
                        "data"};
const char* kSets[] = {"/model/w",           "/model/b",           "/model/big",
                       "/optim/exp_avg/w",   "/checksums/model/w", "/checksums/model/big",
                       "/crypto/model/w",    "/crypto/model/big",  "/model/extra",
                       "/checksums/model/b", "/crypto/model/b",    "/model"};

template <class T, std::size_t N>
const T& pick(const T (&a)[N], std::uint8_t b) {
  return a[b % N];
}

void rewrite_attr(hid_t root, const char* name, hid_t type, const void* value) {
  if (H5Aexists(root, name) > 0) H5Adelete(root, name);
  hid_t sp = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(root, name, type, sp, H5P_DEFAULT, H5P_DEFAULT);
  if (a >= 0) {
    H5Awrite(a, type, value);
    H5Aclose(a);
  }
  H5Sclose(sp);
}

// Applies the edits the input describes; returns true when any edit touched something the
// encryption authenticates (data, tags, nonces, meta data, key attributes).
bool edit(const std::string& path, dt_fuzz::Reader& in) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  if (f < 0) return true;
  hid_t root = H5Gopen2(f, "/", H5P_DEFAULT);
  hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
  H5Pset_create_intermediate_group(lcpl, 1);
  bool touched = false;
  const int n = in.byte() % 8;
  for (int k = 0; k < n && in.left() > 0; ++k) {
    const std::uint8_t op = in.byte() % 7;
    const char* attr = pick(kAttrs, in.byte());
    const char* set = pick(kSets, in.byte());
    touched = true;
    switch (op) {
      case 0:
        if (H5Aexists(root, attr) > 0) H5Adelete(root, attr);
        break;
      case 1: {
        const std::int64_t v = static_cast<std::int64_t>(in.u64());
        rewrite_attr(root, attr, H5T_NATIVE_INT64, &v);
        break;
      }
      case 2: {
        std::string s = in.bytes(in.byte() % 40);
        hid_t t = H5Tcopy(H5T_C_S1);
        H5Tset_size(t, std::max<std::size_t>(1, s.size()));
        s.resize(std::max<std::size_t>(1, s.size()));
        rewrite_attr(root, attr, t, s.data());
        H5Tclose(t);
        break;
      }
      case 3: {
        double v = 0;
        const std::uint64_t bits = in.u64();
        std::memcpy(&v, &bits, sizeof v);
        rewrite_attr(root, attr, H5T_NATIVE_DOUBLE, &v);
        break;
      }
      case 4:
        H5Ldelete(f, set, H5P_DEFAULT);
        break;
      case 5: {  // replace or add a dataset of any rank, extent and type
        H5Ldelete(f, set, H5P_DEFAULT);
        const int rank = in.byte() % 4;
        hsize_t dims[3] = {1, 1, 1};
        for (int d = 0; d < rank; ++d) {
          const std::uint8_t b = in.byte();
          dims[d] = (b & 0x80) ? (hsize_t{1} << (b % 36)) : (b % 40);
        }
        static const hid_t* kTypes[] = {&H5T_NATIVE_FLOAT_g, &H5T_NATIVE_DOUBLE_g,
                                        &H5T_NATIVE_UCHAR_g, &H5T_NATIVE_INT_g};
        const hid_t type = *kTypes[in.byte() % 4];
        hid_t sp = rank == 0 ? H5Screate(H5S_SCALAR) : H5Screate_simple(rank, dims, nullptr);
        hid_t d = sp >= 0 ? H5Dcreate2(f, set, type, sp, lcpl, H5P_DEFAULT, H5P_DEFAULT) : -1;
        if (d >= 0) H5Dclose(d);
        if (sp >= 0) H5Sclose(sp);
        break;
      }
      case 6: {  // alter bytes of a dataset in place (small datasets only)
        hid_t d = H5Dopen2(f, set, H5P_DEFAULT);
        if (d < 0) break;
        hid_t t = H5Dget_type(d);
        hid_t sp = H5Dget_space(d);
        const hssize_t np = H5Sget_simple_extent_npoints(sp);
        const std::size_t bytes = np > 0 ? static_cast<std::size_t>(np) * H5Tget_size(t) : 0;
        if (bytes > 0 && bytes <= (std::size_t{8} << 20)) {
          std::vector<unsigned char> v(bytes);
          if (H5Dread(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()) >= 0) {
            const int flips = 1 + in.byte() % 4;
            for (int i = 0; i < flips; ++i) v[in.u64(3) % bytes] ^= (in.byte() | 1);
            H5Dwrite(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
          }
        }
        H5Sclose(sp);
        H5Tclose(t);
        H5Dclose(d);
        break;
      }
    }
  }
  H5Pclose(lcpl);
  H5Gclose(root);
  H5Fclose(f);
  H5Eclear2(H5E_DEFAULT);
  return touched;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Env& e = env();
  dt_fuzz::Reader in(data, size);
  const std::uint8_t mode = in.byte();
  const bool encrypted = mode & 1;
  static const std::string path = dt_fuzz::scratch("ckpt", ".h5");
  const std::string& seed = encrypted ? e.encrypted : e.plain;
  dt_fuzz::write_file(path, seed.data(), seed.size());
  const bool touched = edit(path, in);
  const sec::Keys* keys = (mode & 2) ? e.keys.get() : nullptr;
  try {
    (void)dt::checkpoint_encryption(path);
  } catch (const dt::CheckpointError&) {
  }
  try {
    (void)dt::verify_file(*e.world, path, keys);
  } catch (const dt::CheckpointError&) {
  }
  Model m(-5.0f);
  try {
    dt::load_checkpoint(*e.world, path, m.tensors, keys);
  } catch (const dt::CheckpointError&) {
    return 0;
  }
  // Loaded: with the key of an encrypted file, the data is authentic.
  if (encrypted && keys) {
    const Model want(1.0f);
    for (std::size_t i = 0; i < want.bufs.size(); ++i)
      if (std::memcmp(want.bufs[i].data(), m.bufs[i].data(), want.bufs[i].size() * 4) != 0)
        std::abort();
  }
  (void)touched;
  return 0;
}
