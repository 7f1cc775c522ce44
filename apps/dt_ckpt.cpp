// dt_ckpt: look at, verify and convert dt checkpoints.
//
//   dt_ckpt list DIR          checkpoints of DIR, newest first, each verified; interrupted saves
//   dt_ckpt inspect FILE      root attributes and every dataset (shape, dtype, size), file order
//   dt_ckpt verify FILE       every chunk digest (collective: mpiexec -n N shares the hashing);
//                             with --security.key_file KEY an encrypted checkpoint (ckpt.encrypt)
//                             is also decrypted and authenticated, and a wrong key is reported
//   dt_ckpt export FILE --format safetensors --output OUT.safetensors
//   dt_ckpt import IN.safetensors --output DIR --heads H [--step 0] [--lock-wait-s 10]
//                             [--security.key_file KEY]
//
// export writes the /model tensors under their nanoGPT names (plus lm_head.weight, tied to
// transformer.wte.weight) after verifying the checkpoint; import reads a nanoGPT-named
// safetensors file (F32, F16 or BF16), infers the model from the shapes and writes DIR/step-S.h5
// with zero optimiser moments, from which dt_train --ckpt.resume=DIR/step-S.h5 starts; with a
// key file the checkpoint is encrypted, as dt_train --ckpt.encrypt writes it.
//
// Exit codes: 0 success; 1 a checkpoint failed verification (every problem is printed, naming the
// dataset and chunk); 2 bad usage or input (the message names the input and what is wrong); 3 a
// rank could not start (dt::start_runtime).
// Under mpiexec every rank takes part in the verification and only rank 0 prints.
#include <fcntl.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "ckpt/h5.hpp"
#include "dt/checkpoint.hpp"
#include "dt/config.hpp"
#include "dt/dtype.hpp"
#include "dt/error.hpp"
#include "dt/gpt.hpp"
#include "dt/runtime.hpp"
#include "dt/security.hpp"
#include "dt/train.hpp"

namespace {

using dt::ConfigError;
using dt::H5;
using dt::h5_message;
using dt::Shape;

constexpr const char* kUsage =
    "usage: dt_ckpt list DIR [--security.key_file KEY]\n"
    "       dt_ckpt inspect FILE\n"
    "       dt_ckpt verify FILE [--security.key_file KEY]\n"
    "       dt_ckpt export FILE --format safetensors --output OUT.safetensors "
    "[--security.key_file KEY]\n"
    "       dt_ckpt import IN.safetensors --output DIR --heads H [--step 0] "
    "[--lock-wait-s 10] [--security.key_file KEY]\n"
    "Looks at, verifies and converts dt checkpoints (DIR/step-N.h5).\n"
    "Exit codes: 0 ok, 1 a verification failed, 2 bad usage or input, 3 an internal error (a "
    "rank could not start, say).\n"
    "'dt_ckpt SUBCOMMAND --help' lists the options of a subcommand.\n";

/// Largest safetensors header accepted (the reference implementation's limit).
constexpr std::uint64_t kMaxHeader = 100u << 20;

bool host_is_little_endian() {
  const std::uint16_t one = 1;
  unsigned char b = 0;
  std::memcpy(&b, &one, 1);
  return b == 1;
}

// ---- HDF5 handles -------------------------------------------------------------------------------

hid_t h5_check(hid_t id, const char* call, const std::string& file) {
  if (id < 0) DT_THROW(ConfigError, file, ": ", call, " failed: ", h5_message());
  return id;
}

std::string dtype_label(hid_t type) {
  const std::size_t size = H5Tget_size(type);
  switch (H5Tget_class(type)) {
    case H5T_FLOAT:
      return "float" + std::to_string(size * 8);
    case H5T_INTEGER:
      return std::string(H5Tget_sign(type) == H5T_SGN_NONE ? "uint" : "int") +
             std::to_string(size * 8);
    case H5T_STRING:
      return "string";
    default:
      return "other(" + std::to_string(size) + " bytes)";
  }
}

Shape space_shape(hid_t space) {
  const int nd = H5Sget_simple_extent_ndims(space);
  std::vector<hsize_t> dims(static_cast<std::size_t>(std::max(nd, 0)));
  if (nd > 0) H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  return Shape(dims.begin(), dims.end());
}

std::size_t chunks_of(std::size_t numel) {
  return (numel + dt::kChunkElements - 1) / dt::kChunkElements;
}

struct DatasetInfo {
  std::string path;  ///< "/model/transformer.wte.weight"
  Shape shape;
  std::string dtype;  ///< "float32"
  bool is_f32 = false;
  std::uint64_t bytes = 0;
  haddr_t address = HADDR_UNDEF;  ///< file offset of contiguous data
};

struct Attribute {
  std::string name;
  std::string value;  ///< printable; strings as they are
};

/// Sorts datasets into the order of the training state, which is the order their checksum chunks
/// are numbered in: /model, /optim/exp_avg, /optim/exp_avg_sq, each in nanoGPT parameter order;
/// anything else after them, by name.
void sort_state_order(std::vector<DatasetInfo>& ds) {
  static const char* const kGroups[] = {"/model/", "/optim/exp_avg/", "/optim/exp_avg_sq/"};
  int layers = 0;
  for (const auto& d : ds) {
    const auto p = d.path.find("transformer.h.");
    if (p == std::string::npos) continue;
    const std::string rest = d.path.substr(p + 14);
    const std::string num = rest.substr(0, rest.find('.'));
    if (!num.empty() && num.size() < 7 && num.find_first_not_of("0123456789") == std::string::npos)
      layers = std::max(layers, std::stoi(num) + 1);
  }
  dt::GptConfig c;
  c.layers = std::max(layers, 1);
  std::map<std::string, std::size_t> rank;
  for (const auto& p : dt::gpt_params(c)) rank.emplace(p.name, rank.size());
  auto key = [&](const DatasetInfo& d) {
    for (std::size_t g = 0; g < 3; ++g) {
      const std::string pre = kGroups[g];
      if (d.path.rfind(pre, 0) != 0) continue;
      const auto it = rank.find(d.path.substr(pre.size()));
      if (it != rank.end()) return std::make_pair(g, it->second);
    }
    return std::make_pair(std::size_t{3}, std::size_t{0});
  };
  std::sort(ds.begin(), ds.end(), [&](const DatasetInfo& a, const DatasetInfo& b) {
    const auto ka = key(a), kb = key(b);
    return ka != kb ? ka < kb : a.path < b.path;
  });
}

/// A checkpoint file opened read-only by this process alone (serial HDF5), for reading
/// attributes and datasets. Opening checks that the file is a dt checkpoint; every failure throws
/// ConfigError naming the file.
class CheckpointFile {
 public:
  explicit CheckpointFile(const std::string& path) : path_(path) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    file_ = H5(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    if (!file_.ok())
      DT_THROW(ConfigError, path,
               ": cannot be opened as HDF5 (truncated or damaged): ", h5_message());
    const std::string fmt = string_attr("format");
    DT_CHECK(
        ConfigError, fmt == dt::kCheckpointFormat, path, ": not a dt checkpoint (",
        fmt.empty() ? std::string("no 'format' attribute") : "format '" + dt::printable(fmt) + "'",
        ")");
  }

  /// Root attributes in the order the file lists them.
  std::vector<Attribute> attributes() const {
    H5 root(h5_check(H5Gopen2(file_.get(), "/", H5P_DEFAULT), "H5Gopen2", path_), H5Gclose);
    struct Ctx {
      std::vector<Attribute>* out;
      const std::string* path;
    };
    std::vector<Attribute> out;
    Ctx ctx{&out, &path_};
    hsize_t idx = 0;
    const herr_t rc = H5Aiterate2(
        root.get(), H5_INDEX_NAME, H5_ITER_NATIVE, &idx,
        [](hid_t loc, const char* name, const H5A_info_t*, void* data) -> herr_t {
          auto* c = static_cast<Ctx*>(data);
          c->out->push_back({name, attribute_text(loc, name)});
          return 0;
        },
        &ctx);
    h5_check(rc, "H5Aiterate2", path_);
    return out;
  }

  std::string string_attr(const char* name) const {
    H5 root(h5_check(H5Gopen2(file_.get(), "/", H5P_DEFAULT), "H5Gopen2", path_), H5Gclose);
    if (H5Aexists(root.get(), name) <= 0) return "";
    return attribute_text(root.get(), name);
  }

  /// Every dataset outside /checksums, in the order of the training state (see sort_state_order).
  std::vector<DatasetInfo> datasets() const {
    std::vector<std::string> names;
    h5_check(
        H5Lvisit(
            file_.get(), H5_INDEX_NAME, H5_ITER_INC,
            [](hid_t g, const char* name, const H5L_info_t* info, void* data) -> herr_t {
              if (info->type != H5L_TYPE_HARD) return 0;
              H5 obj(H5Oopen(g, name, H5P_DEFAULT), H5Oclose);
              if (obj.ok() && H5Iget_type(obj.get()) == H5I_DATASET)
                static_cast<std::vector<std::string>*>(data)->push_back("/" + std::string(name));
              return 0;
            },
            &names),
        "H5Lvisit", path_);
    std::vector<DatasetInfo> out;
    for (const auto& n : names) {
      if (n.rfind("/checksums/", 0) == 0 || n.rfind("/crypto/", 0) == 0) continue;
      H5 d(h5_check(H5Dopen2(file_.get(), n.c_str(), H5P_DEFAULT), "H5Dopen2", path_), H5Dclose);
      H5 t(h5_check(H5Dget_type(d.get()), "H5Dget_type", path_), H5Tclose);
      H5 s(h5_check(H5Dget_space(d.get()), "H5Dget_space", path_), H5Sclose);
      DatasetInfo i;
      i.path = n;
      i.shape = space_shape(s.get());
      i.dtype = dtype_label(t.get());
      i.is_f32 = H5Tget_class(t.get()) == H5T_FLOAT && H5Tget_size(t.get()) == 4;
      i.bytes = static_cast<std::uint64_t>(dt::shape_numel(i.shape)) * H5Tget_size(t.get());
      i.address = H5Dget_offset(d.get());
      H5Eclear2(H5E_DEFAULT);
      out.push_back(std::move(i));
    }
    sort_state_order(out);
    return out;
  }

  /// The float32 data of `dataset` as little-endian bytes.
  std::vector<unsigned char> read_f32_le(const DatasetInfo& dataset) const {
    DT_CHECK(ConfigError, dataset.is_f32, path_, ": dataset ", dataset.path, " is ", dataset.dtype,
             ", not float32");
    H5 d(h5_check(H5Dopen2(file_.get(), dataset.path.c_str(), H5P_DEFAULT), "H5Dopen2", path_),
         H5Dclose);
    std::vector<unsigned char> buf(static_cast<std::size_t>(dataset.bytes) + 1);
    if (H5Dread(d.get(), H5T_IEEE_F32LE, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()) < 0)
      DT_THROW(ConfigError, path_, ": reading ", dataset.path, " failed: ", h5_message());
    buf.pop_back();
    return buf;
  }

 private:
  static std::string attribute_text(hid_t loc, const char* name) {
    H5 a(H5Aopen(loc, name, H5P_DEFAULT), H5Aclose);
    if (!a.ok()) return "<unreadable: " + h5_message() + ">";
    H5 t(H5Aget_type(a.get()), H5Tclose);
    H5 s(H5Aget_space(a.get()), H5Sclose);
    if (!t.ok() || !s.ok()) return "<unreadable: " + h5_message() + ">";
    const hssize_t n = H5Sget_simple_extent_npoints(s.get());
    const H5T_class_t cls = H5Tget_class(t.get());
    std::ostringstream os;
    if (cls == H5T_STRING && n == 1) {
      if (H5Tis_variable_str(t.get()) > 0) {
        char* p = nullptr;
        H5 mt(H5Tcopy(H5T_C_S1), H5Tclose);
        H5Tset_size(mt.get(), H5T_VARIABLE);
        if (H5Aread(a.get(), mt.get(), &p) < 0) return "<unreadable: " + h5_message() + ">";
        std::string v = p ? p : "";
        H5free_memory(p);
        return v;
      }
      std::string v(H5Tget_size(t.get()) + 1, '\0');
      if (H5Aread(a.get(), t.get(), v.data()) < 0) return "<unreadable: " + h5_message() + ">";
      v.resize(std::strlen(v.c_str()));
      return v;
    }
    if ((cls == H5T_INTEGER || cls == H5T_FLOAT) && n >= 1 && n <= 64) {
      const bool is_float = cls == H5T_FLOAT;
      const bool is_unsigned = cls == H5T_INTEGER && H5Tget_sign(t.get()) == H5T_SGN_NONE;
      std::vector<double> f(static_cast<std::size_t>(n));
      std::vector<std::int64_t> i(static_cast<std::size_t>(n));
      std::vector<std::uint64_t> u(static_cast<std::size_t>(n));
      herr_t rc;
      if (is_float)
        rc = H5Aread(a.get(), H5T_NATIVE_DOUBLE, f.data());
      else if (is_unsigned)
        rc = H5Aread(a.get(), H5T_NATIVE_UINT64, u.data());
      else
        rc = H5Aread(a.get(), H5T_NATIVE_INT64, i.data());
      if (rc < 0) return "<unreadable: " + h5_message() + ">";
      if (n > 1) os << "[";
      for (hssize_t k = 0; k < n; ++k) {
        const auto idx = static_cast<std::size_t>(k);
        if (k) os << ", ";
        if (is_float) {
          char b[32];
          std::snprintf(b, sizeof b, "%.17g", f[idx]);
          os << b;
        } else if (is_unsigned) {
          os << u[idx];
        } else {
          os << i[idx];
        }
      }
      if (n > 1) os << "]";
      return os.str();
    }
    os << "<" << dtype_label(t.get()) << ", " << n << " elements>";
    return os.str();
  }

  std::string path_;
  H5 file_;
};

// ---- probing and verifying ----------------------------------------------------------------------

/// What a quick look at a file says before the collective verification.
struct Probe {
  bool opens = false;        ///< a dt checkpoint that HDF5 opens
  std::size_t datasets = 0;  ///< outside /checksums
  std::size_t chunks = 0;    ///< digest chunks of those datasets
};

/// Throws ConfigError (exit 2) for a file that is missing, unreadable, not HDF5 or not a dt
/// checkpoint; returns opens=false for an HDF5 file that HDF5 cannot open, or whose datasets it
/// cannot list (a damaged checkpoint: the verification reports it).
Probe probe(const std::string& path) {
  struct stat st;
  DT_CHECK(ConfigError, ::stat(path.c_str(), &st) == 0, path, ": ", std::strerror(errno));
  DT_CHECK(ConfigError, S_ISREG(st.st_mode), path, ": not a regular file");
  std::ifstream in(path, std::ios::binary);
  DT_CHECK(ConfigError, in.good(), path, ": cannot be read: ", std::strerror(errno));
  static const unsigned char kSignature[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
  unsigned char head[8] = {0};
  in.read(reinterpret_cast<char*>(head), 8);
  DT_CHECK(ConfigError, in.gcount() == 8 && std::memcmp(head, kSignature, 8) == 0, path,
           ": not a dt checkpoint (no HDF5 signature)");
  in.close();
  Probe p;
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  {
    H5 f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    H5Eclear2(H5E_DEFAULT);
    if (!f.ok()) return p;
    // A root group that does not open is damage too (the verification reports it), not a file
    // of another kind.
    const hid_t root = H5Gopen2(f.get(), "/", H5P_DEFAULT);
    H5Eclear2(H5E_DEFAULT);
    if (root < 0) return p;
    H5Gclose(root);
  }
  CheckpointFile cf(path);  // throws when not a dt checkpoint
  try {
    for (const auto& d : cf.datasets()) {
      ++p.datasets;
      p.chunks += chunks_of(dt::shape_numel(d.shape));
    }
  } catch (const dt::Error&) {  // damaged groups or object headers: the verification reports it
    return Probe{};
  }
  p.opens = true;
  return p;
}

// ---- printing -----------------------------------------------------------------------------------

std::string mb(std::uint64_t bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f", static_cast<double>(bytes) / 1e6);
  return b;
}

std::string base_name(const std::string& p) {
  const auto s = p.find_last_of('/');
  return s == std::string::npos ? p : p.substr(s + 1);
}

// ---- subcommands --------------------------------------------------------------------------------

struct Args {
  std::string sub;
  std::string input;  ///< the positional FILE or DIR
  std::string format = "safetensors";
  std::string output;
  int heads = 0;
  long step = 0;
  double lock_wait_s = 10;  ///< import: waiting for another claim on --output (FolderLock)
  std::string key_file;     ///< --security.key_file: job key of encrypted checkpoints
  /// The keys of key_file (loaded on demand; nullptr without a key file).
  const dt::security::Keys* keys() const {
    if (key_file.empty()) return nullptr;
    if (!keys_)
      keys_ = std::make_shared<dt::security::Keys>(dt::security::load_key_file(key_file),
                                                   dt::security::slurm_job_id());
    return keys_.get();
  }

 private:
  mutable std::shared_ptr<dt::security::Keys> keys_;
};

// One line of the list table (no trailing blanks).
void row(const std::string& step, const std::string& file, const std::string& size,
         const std::string& verified, const std::string& note) {
  char line[512];
  std::snprintf(line, sizeof line, "%8s  %-28s %10s  %-8s %s", step.c_str(), file.c_str(),
                size.c_str(), verified.c_str(), note.c_str());
  std::string s = line;
  s.erase(s.find_last_not_of(' ') + 1);
  std::printf("%s\n", s.c_str());
}

// Why a checkpoint named for step `named` is not that step's ("" when it holds it): a file
// renamed or copied by hand would be taken for the step its name says.
std::string name_disagrees(const std::string& path, std::int64_t named) {
  const std::string stored = CheckpointFile(path).string_attr("step");
  if (stored == std::to_string(named)) return "";
  return (stored.empty() ? std::string("holds no step") : "holds step " + stored) +
         ", its name says step " + std::to_string(named) + " (renamed or copied by hand?)";
}

// Runs `body`, which reads what each rank's node holds (a file, a folder, the key file), on every
// rank. Where it throws on any rank, every rank throws the first such rank's error (bad input,
// naming the rank in a job of several), so that none goes on into the collective work that the
// others left (a hang).
void on_every_rank(dt::Runtime& rt, const std::function<void()>& body) {
  const auto [who, first] = dt::first_failure(rt.world(), body);
  DT_CHECK(ConfigError, who == rt.size(), first,
           rt.size() > 1 ? " (on rank " + std::to_string(who) + ")" : std::string());
}

int cmd_list(dt::Runtime& rt, const Args& a) {
  const bool lead = rt.rank() == 0;
  // Refused on every rank where any rank cannot see the folder (the listing below is collective),
  // or read the key file.
  on_every_rank(rt, [&] {
    struct stat st;
    DT_CHECK(ConfigError, ::stat(a.input.c_str(), &st) == 0, a.input, ": ", std::strerror(errno));
    DT_CHECK(ConfigError, S_ISDIR(st.st_mode), a.input, ": not a directory");
    static_cast<void>(a.keys());
  });
  // Every rank verifies the files rank 0 lists (the verification is collective); the rest of
  // the folder is only printed, by rank 0.
  const auto entries = dt::list_checkpoints(rt.world(), a.input);
  std::vector<std::string> partials, set_aside;
  std::string latest, holder, problem;
  if (lead) {
    try {
      partials = dt::list_partials(a.input);
      set_aside = dt::list_set_aside(a.input);
      latest = dt::read_latest(a.input);
      holder = dt::folder_holder(a.input);
    } catch (const dt::CheckpointError& e) {
      problem = e.message();
    }
  }
  problem = dt::broadcast_text(rt.world(), problem, 0);
  DT_CHECK(dt::CheckpointError, problem.empty(), problem);
  if (lead) {
    std::printf("%s: %zu checkpoint%s, %zu interrupted save%s, %zu set aside\n", a.input.c_str(),
                entries.size(), entries.size() == 1 ? "" : "s", partials.size(),
                partials.size() == 1 ? "" : "s", set_aside.size());
    if (!holder.empty()) std::printf("in use by %s\n", holder.c_str());
    row("step", "file", "size(MB)", "verified", "");
  }
  int rc = 0;
  std::vector<std::string> notes;
  for (const auto& e : entries) {
    std::vector<std::string> problems;
    try {
      // Not a dt checkpoint at all (on any rank: a file pruned while it is listed may be gone
      // for some): reported like a failed verification, which is collective.
      on_every_rank(rt, [&] { probe(e.path); });
      problems = dt::verify_file(rt.world(), e.path, a.keys());
      // The step comes from the name; a file renamed or copied by hand holds another, and would
      // be taken for the step its name says (by dt_train --ckpt.resume=auto too).
      if (problems.empty()) {
        const std::string named = name_disagrees(e.path, e.step);
        if (!named.empty()) problems.push_back(named);
      }
    } catch (const ConfigError& err) {
      problems = {err.message()};
    }
    if (!problems.empty()) rc = 1;
    const bool is_latest = !latest.empty() && latest == e.path;
    if (lead) {
      row(std::to_string(e.step), base_name(e.path), mb(e.bytes), problems.empty() ? "yes" : "NO",
          is_latest ? "latest" : "");
      for (const auto& p : problems) notes.push_back(base_name(e.path) + ": " + p);
    }
  }
  // Files that are not checkpoints of the folder: their size, and what they are.
  auto other = [&](const std::string& p, const char* what) {
    struct stat ps;
    const std::uint64_t bytes =
        ::stat(p.c_str(), &ps) == 0 ? static_cast<std::uint64_t>(ps.st_size) : 0;
    if (lead) row("-", base_name(p), mb(bytes), "-", what);
    return bytes;
  };
  for (const auto& p : partials) other(p, "interrupted");
  std::uint64_t aside_bytes = 0;
  for (const auto& p : set_aside) aside_bytes += other(p, "set aside");
  if (lead) {
    struct stat ls;
    const std::string latest_file = a.input + "/latest";
    const bool latest_dir = ::stat(latest_file.c_str(), &ls) == 0 && S_ISDIR(ls.st_mode);
    if (latest_dir)
      std::printf(
          "note: %s is a directory, not the file naming the newest checkpoint; dt_train cannot "
          "write it there: remove it\n",
          latest_file.c_str());
    else if (latest.empty() && !entries.empty())
      std::printf("note: %s/latest is missing or unreadable\n", a.input.c_str());
    else if (!latest.empty() &&
             std::none_of(entries.begin(), entries.end(),
                          [&](const dt::CkptEntry& e) { return e.path == latest; }))
      std::printf("note: %s, which does not exist\n",
                  dt::latest_described(a.input, latest).c_str());
    for (const auto& n : notes) std::printf("  %s\n", n.c_str());
    if (!set_aside.empty())
      std::printf(
          "note: the %zu set-aside file%s (%s MB) %s of another line of training in this folder "
          "(a run resumed from an older step, or started afresh); dt never deletes them\n",
          set_aside.size(), set_aside.size() == 1 ? "" : "s", mb(aside_bytes).c_str(),
          set_aside.size() == 1 ? "is" : "are");
  }
  return rc;
}

int cmd_inspect(dt::Runtime& rt, const Args& a) {
  // A file whose datasets HDF5 cannot list is damaged: reading its attributes on may crash
  // inside HDF5 (a damaged attribute table), so it is reported as verify reports it (exit 1).
  if (!probe(a.input).opens) {
    if (rt.rank() == 0)
      std::fprintf(stderr,
                   "dt_ckpt inspect: %s is damaged: HDF5's default (serial) driver cannot open it "
                   "or list its datasets; run dt_ckpt verify %s for what it can tell\n",
                   a.input.c_str(), a.input.c_str());
    return 1;
  }
  CheckpointFile f(a.input);
  if (rt.rank() != 0) return 0;
  struct stat st;
  ::stat(a.input.c_str(), &st);
  std::printf("file: %s (%" PRIu64 " bytes)\n", a.input.c_str(),
              static_cast<std::uint64_t>(st.st_size));
  std::printf("attributes:\n");
  // Names and values as the file holds them, but for control bytes (a damaged or planted
  // attribute must not drive the terminal): those are shown as \xHH.
  for (const auto& at : f.attributes()) {
    const std::string name = dt::printable(at.name);
    if (at.value.find('\n') == std::string::npos) {
      std::printf("  %s = %s\n", name.c_str(), dt::printable(at.value).c_str());
      continue;
    }
    std::printf("  %s:\n", name.c_str());
    std::istringstream is(at.value);
    std::string line;
    while (std::getline(is, line)) std::printf("    %s\n", dt::printable(line).c_str());
  }
  const auto ds = f.datasets();
  std::uint64_t total = 0;
  std::size_t width = 0;
  for (const auto& d : ds) {
    total += d.bytes;
    width = std::max(width, dt::printable(d.path).size());
  }
  std::printf(
      "datasets: %zu, %s MB (model, then optimiser moments, each in nanoGPT parameter order; "
      "their digests under /checksums not listed)\n",
      ds.size(), mb(total).c_str());
  std::printf("  %-*s %-14s %-8s %12s %12s\n", static_cast<int>(width), "name", "shape", "dtype",
              "bytes", "file offset");
  for (const auto& d : ds) {
    const std::string at = d.address == HADDR_UNDEF ? "-" : std::to_string(d.address);
    std::printf("  %-*s %-14s %-8s %12" PRIu64 " %12s\n", static_cast<int>(width),
                dt::printable(d.path).c_str(), dt::shape_str(d.shape).c_str(), d.dtype.c_str(),
                d.bytes, at.c_str());
  }
  return 0;
}

// Verifies `path` (collective). Prints the outcome on rank 0; returns 0 or 1. A file named
// step-N.h5 must hold step N, as dt_train --ckpt.resume=auto takes it for that step.

int verify_and_report(dt::Runtime& rt, const Args& a, const std::string& path,
                      const char* refusing) {
  Probe p;
  const dt::security::Keys* keys = nullptr;
  std::string enc;
  on_every_rank(rt, [&] {
    p = probe(path);
    keys = a.keys();
    enc = p.opens ? dt::checkpoint_encryption(path) : "";
  });
  auto problems = dt::verify_file(rt.world(), path, keys);
  if (problems.empty() && p.opens) {
    const std::int64_t named = dt::checkpoint_step_of_name(path);
    if (named >= 0) {
      const std::string wrong = name_disagrees(path, named);
      if (!wrong.empty()) problems.push_back(wrong);
    }
  }
  // The checks above read through MPI-IO; a file that HDF5's default driver cannot open (as
  // h5py, h5dump, inspect and export open it: a damaged superblock field MPI-IO does not use,
  // say) is damaged all the same.
  if (!p.opens)
    problems.push_back(
        "HDF5's default (serial) driver cannot open the file or list its datasets (a damaged "
        "superblock or metadata; or a file system that refused it, as h5ls would show)");
  if (rt.rank() != 0) return problems.empty() ? 0 : 1;
  if (problems.empty()) {
    const std::string how =
        enc.empty() ? (keys ? ", not encrypted: the key was not used" : "")
        : keys      ? "; encrypted (" + enc + "), every chunk authenticated with the key"
                    : "; encrypted (" + enc +
                     "), digests only: give --security.key_file to authenticate the contents";
    if (!refusing)
      std::printf("ok: %s (%zu datasets, %zu chunks%s)\n", path.c_str(), p.datasets, p.chunks,
                  how.c_str());
    return 0;
  }
  if (refusing)
    std::printf("dt_ckpt: refusing to %s %s: it fails verification\n", refusing, path.c_str());
  std::printf("FAILED: %s (%zu problem%s)\n", path.c_str(), problems.size(),
              problems.size() == 1 ? "" : "s");
  for (const auto& pr : problems) std::printf("  %s\n", pr.c_str());
  return 1;
}

int cmd_verify(dt::Runtime& rt, const Args& a) {
  return verify_and_report(rt, a, a.input, nullptr);
}

void write_all(std::FILE* f, const void* p, std::size_t n, const std::string& path) {
  DT_CHECK(ConfigError, n == 0 || std::fwrite(p, 1, n, f) == n, path,
           ": write failed: ", std::strerror(errno));
}

// Why `path`, an existing file, is not a safetensors file ("" when it is one): an 8-byte
// little-endian header length, then that many bytes of a JSON object.
std::string not_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) return std::string("cannot be read: ") + std::strerror(errno);
  unsigned char len[8];
  in.read(reinterpret_cast<char*>(len), 8);
  if (in.gcount() != 8) return "shorter than the 8-byte header length";
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  if (n < 2 || n > kMaxHeader) return "no safetensors header length";
  std::string text(static_cast<std::size_t>(n), '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  if (static_cast<std::uint64_t>(in.gcount()) != n) return "the header runs past the end";
  const auto h = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  return h.is_object() ? "" : "the header is not a JSON object";
}

// An existing --output is replaced only when it is a safetensors file (an earlier export, say);
// anything else (a checkpoint, a directory, any other file) is refused and left as it is.
void check_export_output(const std::string& out) {
  struct stat st;
  if (::stat(out.c_str(), &st) != 0) {
    DT_CHECK(ConfigError, errno == ENOENT, "option --output: ", out, ": ", std::strerror(errno));
    return;
  }
  DT_CHECK(ConfigError, !S_ISDIR(st.st_mode), "option --output: ", out,
           " is a directory; name the file to write (OUT.safetensors)");
  const std::string why =
      S_ISREG(st.st_mode) ? not_safetensors(out) : std::string("not a regular file");
  DT_CHECK(ConfigError, why.empty(), "option --output: ", out,
           " exists and is not a safetensors file (", why,
           "); nothing was written: remove it or name another --output");
}

int cmd_export(dt::Runtime& rt, const Args& a) {
  struct stat src = {}, dst = {};
  DT_CHECK(ConfigError,
           !(::stat(a.input.c_str(), &src) == 0 && ::stat(a.output.c_str(), &dst) == 0 &&
             src.st_dev == dst.st_dev && src.st_ino == dst.st_ino),
           "option --output: ", a.output, " is the checkpoint being exported (", a.input,
           "); nothing was written");
  bool encrypted = false;
  on_every_rank(rt, [&] {
    check_export_output(a.output);
    // A file HDF5 cannot open is for the verification to report (exit 1, like verify).
    encrypted = probe(a.input).opens && !dt::checkpoint_encryption(a.input).empty();
    DT_CHECK(ConfigError, !encrypted || a.keys(), a.input,
             " is encrypted: export needs its job key (--security.key_file KEY)");
  });
  if (verify_and_report(rt, a, a.input, "export") != 0) return 1;
  std::map<std::string, std::pair<Shape, std::vector<unsigned char>>> tensors;  // sorted by name
  if (encrypted) {
    // Decrypted and authenticated by the library's loader (collective), then kept on rank 0.
    CheckpointFile ef(a.input);
    std::vector<dt::CkptTensor> all;
    std::vector<std::vector<float>> bufs;
    const auto infos = ef.datasets();
    bufs.reserve(infos.size());
    for (const auto& d : infos) {
      bufs.emplace_back(dt::shape_numel(d.shape));
      all.push_back(dt::CkptTensor{d.path, d.shape, bufs.back().data()});
    }
    dt::load_checkpoint(rt.world(), a.input, all, a.keys());
    if (rt.rank() != 0) return 0;
    for (std::size_t i = 0; i < infos.size(); ++i) {
      if (infos[i].path.rfind("/model/", 0) != 0) continue;
      std::vector<unsigned char> bytes(bufs[i].size() * sizeof(float));
      if (!bytes.empty()) std::memcpy(bytes.data(), bufs[i].data(), bytes.size());
      tensors[infos[i].path.substr(7)] = {infos[i].shape, std::move(bytes)};
    }
  }
  if (rt.rank() != 0) return 0;
  CheckpointFile f(a.input);
  if (!encrypted)
    for (const auto& d : f.datasets()) {
      if (d.path.rfind("/model/", 0) != 0) continue;
      tensors[d.path.substr(7)] = {d.shape, f.read_f32_le(d)};
    }
  DT_CHECK(ConfigError, !tensors.empty(), a.input, ": no /model datasets to export");
  const auto wte = tensors.find("transformer.wte.weight");
  if (wte != tensors.end() && !tensors.count("lm_head.weight"))
    tensors["lm_head.weight"] = wte->second;  // nanoGPT's state_dict holds the tied head too

  nlohmann::json header = nlohmann::json::object();
  nlohmann::json meta = {{"format", "pt"}, {"source", "dt-checkpoint"}};
  // The export is plain: what the file's encryption recorded (its key salt and check, tags and
  // their digest, the algorithm) says nothing true of it, and is left out.
  for (const auto& at : f.attributes())
    if (at.name != "format" && at.name != "chunk_elements" && at.name != "encryption" &&
        at.name != "key_salt" && at.name != "key_check" && at.name != "meta_tag" &&
        at.name != "crypto_sha256")
      meta[at.name] = at.value;
  header["__metadata__"] = meta;
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const std::uint64_t end = offset + t.second.size();
    header[name] = {{"dtype", "F32"}, {"shape", t.first}, {"data_offsets", {offset, end}}};
    offset = end;
  }
  // Attributes are bytes (a config may hold any path or prompt); JSON is UTF-8, so a byte that
  // is not becomes U+FFFD in the metadata rather than ending the export.
  std::string text = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<unsigned char>(static_cast<std::uint64_t>(text.size()) >> (8 * i));

  // Checked again: the verification took a while. The temporary file is this process's own
  // (O_EXCL), so that no file of the user's is truncated on the way.
  check_export_output(a.output);
  struct stat before;
  const bool replacing = ::stat(a.output.c_str(), &before) == 0;
  const std::string tmp = a.output + ".tmp." + std::to_string(::getpid());
  // The weights of an encrypted checkpoint, decrypted, are for the job's user only (0600).
  const int fd =
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, encrypted ? 0600 : 0666);
  DT_CHECK(ConfigError, fd >= 0, "option --output: cannot create ", tmp, ": ",
           std::strerror(errno));
  std::FILE* out = ::fdopen(fd, "wb");
  if (!out) {
    const std::string err = std::strerror(errno);
    ::close(fd);
    ::unlink(tmp.c_str());
    DT_THROW(ConfigError, "option --output: cannot write ", tmp, ": ", err);
  }
  try {
    write_all(out, len, 8, tmp);
    write_all(out, text.data(), text.size(), tmp);
    for (const auto& [name, t] : tensors) write_all(out, t.second.data(), t.second.size(), tmp);
    DT_CHECK(ConfigError, std::fflush(out) == 0 && ::fsync(::fileno(out)) == 0, tmp,
             ": flush failed: ", std::strerror(errno));
  } catch (...) {
    std::fclose(out);
    ::unlink(tmp.c_str());
    throw;
  }
  const bool closed = std::fclose(out) == 0;
  if (!closed || ::rename(tmp.c_str(), a.output.c_str()) != 0) {
    const std::string err = std::strerror(errno);
    ::unlink(tmp.c_str());
    DT_THROW(ConfigError, "option --output: cannot write ", a.output, ": ", err);
  }
  std::printf("exported %zu tensors (%s MB of F32) from %s to %s%s\n", tensors.size(),
              mb(offset).c_str(), a.input.c_str(), a.output.c_str(),
              replacing ? " (replacing the safetensors file there)" : "");
  return 0;
}

// ---- safetensors input --------------------------------------------------------------------------

struct StEntry {
  std::string name;
  std::string dtype;  ///< "F32", "F16", "BF16"
  dt::DType dt = dt::DType::f32;
  Shape shape;
  std::uint64_t begin = 0, end = 0;  ///< byte offsets in the data section
};

struct StFile {
  std::string path;
  std::uint64_t data_start = 0;  ///< 8 + header length
  std::map<std::string, StEntry> tensors;
};

/// Parses and validates a safetensors header; every problem throws ConfigError naming the file.
StFile read_safetensors(const std::string& path) {
  struct stat st;
  DT_CHECK(ConfigError, ::stat(path.c_str(), &st) == 0, path, ": ", std::strerror(errno));
  DT_CHECK(ConfigError, S_ISREG(st.st_mode), path, ": not a regular file");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  std::ifstream in(path, std::ios::binary);
  DT_CHECK(ConfigError, in.good(), path, ": cannot be read: ", std::strerror(errno));
  DT_CHECK(ConfigError, size >= 8, path, ": not a safetensors file (", size,
           " bytes, shorter than the 8-byte header length)");
  unsigned char len[8];
  in.read(reinterpret_cast<char*>(len), 8);
  DT_CHECK(ConfigError, in.gcount() == 8, path, ": cannot read the header length");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  DT_CHECK(ConfigError, n <= size - 8, path, ": header length ", n, " is larger than the file (",
           size, " bytes)");
  DT_CHECK(ConfigError, n <= kMaxHeader, path, ": header length ", n, " exceeds the limit of ",
           kMaxHeader, " bytes");
  DT_CHECK(ConfigError, n >= 2, path, ": header length ", n, " is too small for a JSON object");
  std::string text(static_cast<std::size_t>(n), '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  DT_CHECK(ConfigError, static_cast<std::uint64_t>(in.gcount()) == n, path,
           ": cannot read the header");

  StFile f;
  f.path = path;
  f.data_start = 8 + n;
  const std::uint64_t data_size = size - 8 - n;
  std::string duplicate;
  std::set<std::string> keys;
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(
        text, [&](int depth, nlohmann::json::parse_event_t ev, nlohmann::json& v) {
          if (depth == 1 && ev == nlohmann::json::parse_event_t::key && v.is_string() &&
              !keys.insert(v.get<std::string>()).second && duplicate.empty())
            duplicate = v.get<std::string>();
          return true;
        });
  } catch (const nlohmann::json::exception& e) {
    DT_THROW(ConfigError, path, ": the header is not valid JSON: ", e.what());
  }
  DT_CHECK(ConfigError, h.is_object(), path, ": the header is not a JSON object");
  DT_CHECK(ConfigError, duplicate.empty(), path, ": tensor '", duplicate,
           "' appears twice in the header");
  for (const auto& [name, v] : h.items()) {
    if (name == "__metadata__") {
      DT_CHECK(ConfigError, v.is_object(), path, ": __metadata__ is not an object");
      for (const auto& [k, mv] : v.items())
        DT_CHECK(ConfigError, mv.is_string(), path, ": __metadata__ entry '", k,
                 "' is not a string");
      continue;
    }
    const std::string what = path + ": tensor '" + name + "': ";
    DT_CHECK(ConfigError, v.is_object(), what, "not an object");
    DT_CHECK(ConfigError, v.contains("dtype") && v["dtype"].is_string(), what,
             "'dtype' is missing or not a string");
    DT_CHECK(ConfigError, v.contains("shape") && v["shape"].is_array(), what,
             "'shape' is missing or not an array");
    DT_CHECK(ConfigError,
             v.contains("data_offsets") && v["data_offsets"].is_array() &&
                 v["data_offsets"].size() == 2 && v["data_offsets"][0].is_number_unsigned() &&
                 v["data_offsets"][1].is_number_unsigned(),
             what, "'data_offsets' must be two non-negative integers");
    StEntry e;
    e.name = name;
    e.dtype = v["dtype"].get<std::string>();
    if (e.dtype == "F32")
      e.dt = dt::DType::f32;
    else if (e.dtype == "F16")
      e.dt = dt::DType::f16;
    else if (e.dtype == "BF16")
      e.dt = dt::DType::bf16;
    else {
      static const std::set<std::string> other = {"F64", "F8_E4M3", "F8_E5M2", "I64",
                                                  "I32", "I16",     "I8",      "U64",
                                                  "U32", "U16",     "U8",      "BOOL"};
      DT_THROW(ConfigError, what, other.count(e.dtype) ? "dtype " : "unknown dtype '", e.dtype,
               other.count(e.dtype) ? " is not supported" : "'", " (dt imports F32, F16 and BF16)");
    }
    std::uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      DT_CHECK(ConfigError, d.is_number_unsigned(), what, "shape ", v["shape"].dump(),
               " has an entry that is not a non-negative integer");
      const auto x = d.get<std::uint64_t>();
      DT_CHECK(ConfigError,
               x <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) &&
                   !__builtin_mul_overflow(numel, x, &numel),
               what, "shape ", v["shape"].dump(), " is too large");
      e.shape.push_back(static_cast<std::int64_t>(x));
    }
    e.begin = v["data_offsets"][0].get<std::uint64_t>();
    e.end = v["data_offsets"][1].get<std::uint64_t>();
    DT_CHECK(ConfigError, e.begin <= e.end, what, "data_offsets [", e.begin, ", ", e.end,
             "] end before they begin");
    DT_CHECK(ConfigError, e.end <= data_size, what, "data_offsets [", e.begin, ", ", e.end,
             "] run past the end of the data (", data_size, " bytes after the header)");
    std::uint64_t want = 0;
    DT_CHECK(ConfigError,
             !__builtin_mul_overflow(numel, dt::dtype_size(e.dt), &want) && want == e.end - e.begin,
             what, "data_offsets [", e.begin, ", ", e.end, "] hold ", e.end - e.begin,
             " bytes, shape ", v["shape"].dump(), " of ", e.dtype, " needs ", want);
    f.tensors[name] = e;
  }
  std::vector<const StEntry*> by_offset;
  for (const auto& [name, e] : f.tensors) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const StEntry* x, const StEntry* y) {
    return x->begin != y->begin ? x->begin < y->begin : x->end < y->end;
  });
  for (std::size_t i = 1; i < by_offset.size(); ++i)
    DT_CHECK(ConfigError, by_offset[i]->begin >= by_offset[i - 1]->end, path, ": tensors '",
             by_offset[i - 1]->name, "' and '", by_offset[i]->name, "' overlap (data_offsets [",
             by_offset[i - 1]->begin, ", ", by_offset[i - 1]->end, "] and [", by_offset[i]->begin,
             ", ", by_offset[i]->end, "])");
  return f;
}

/// Reads tensor `e` of `f` as float32 into dst (numel elements).
void read_tensor(std::ifstream& in, const StFile& f, const StEntry& e, float* dst) {
  const std::uint64_t n = e.end - e.begin;
  std::vector<unsigned char> raw(static_cast<std::size_t>(n) + 1);
  in.clear();
  in.seekg(static_cast<std::streamoff>(f.data_start + e.begin));
  in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(n));
  DT_CHECK(ConfigError, in.good() && static_cast<std::uint64_t>(in.gcount()) == n, f.path,
           ": cannot read the data of tensor '", e.name, "'");
  const std::size_t numel = static_cast<std::size_t>(n / dt::dtype_size(e.dt));
  if (e.dt == dt::DType::f32)
    std::memcpy(dst, raw.data(), static_cast<std::size_t>(n));
  else
    dt::convert(raw.data(), e.dt, dst, dt::DType::f32, numel);
}

// What dt_ckpt import writes: read from the input and checked, on each rank.
struct ImportPlan {
  dt::GptConfig cfg;
  std::vector<dt::ParamInfo> params;
  std::string model_text;
  std::vector<float> weights, moments;
  dt::CkptMeta meta;
  const dt::security::Keys* keys = nullptr;
};

ImportPlan plan_import(const Args& a) {
  StFile f = read_safetensors(a.input);
  // torch.compile'd nanoGPT models save their state under "_orig_mod.".
  {
    std::map<std::string, StEntry> renamed;
    for (auto& [name, e] : f.tensors) {
      std::string n = name.rfind("_orig_mod.", 0) == 0 ? name.substr(10) : name;
      e.name = n;
      DT_CHECK(ConfigError, renamed.emplace(n, e).second, a.input, ": tensor '", n,
               "' appears with and without the _orig_mod. prefix");
    }
    f.tensors.swap(renamed);
  }
  auto need_2d = [&](const char* name) -> const StEntry& {
    const auto it = f.tensors.find(name);
    DT_CHECK(ConfigError, it != f.tensors.end(), a.input, ": tensor '", name,
             "' is missing (the model sizes are read from it)");
    DT_CHECK(ConfigError, it->second.shape.size() == 2, a.input, ": tensor '", name, "' has shape ",
             dt::shape_str(it->second.shape), ", expected 2 dimensions");
    return it->second;
  };
  const StEntry& wte = need_2d("transformer.wte.weight");
  const StEntry& wpe = need_2d("transformer.wpe.weight");
  DT_CHECK(ConfigError, wte.shape[1] == wpe.shape[1], a.input, ": transformer.wte.weight ",
           dt::shape_str(wte.shape), " and transformer.wpe.weight ", dt::shape_str(wpe.shape),
           " disagree on the embedding width");
  std::set<long> numbered;  // the N of transformer.h.N tensors
  for (const auto& [name, e] : f.tensors) {
    const std::string pre = "transformer.h.";
    if (name.rfind(pre, 0) != 0) continue;
    const auto dot = name.find('.', pre.size());
    const std::string num =
        name.substr(pre.size(), dot == std::string::npos ? dot : dot - pre.size());
    if (num.empty() || num.size() > 6 || num.find_first_not_of("0123456789") != std::string::npos)
      continue;
    numbered.insert(std::stol(num));
  }
  DT_CHECK(ConfigError, !numbered.empty(), a.input, ": no transformer.h.N tensors (no layers)");
  const long layers = *numbered.rbegin() + 1;
  // Layers numbered with gaps (one stray transformer.h.999999 would make a model of a million
  // layers to compare against): refused before any model is made.
  if (static_cast<long>(numbered.size()) != layers) {
    long gap = 0;
    while (numbered.count(gap)) ++gap;
    DT_THROW(ConfigError, a.input, ": its layers are numbered with gaps (transformer.h.N for ",
             numbered.size(), " values of N up to ", layers - 1, ", none for N = ", gap,
             "): a dt GPT's are numbered 0 to layers - 1");
  }
  const auto fits_int = [](std::int64_t v) {
    return v >= 1 && v <= std::numeric_limits<int>::max();
  };
  DT_CHECK(ConfigError, fits_int(wte.shape[0]) && fits_int(wte.shape[1]) && fits_int(wpe.shape[0]),
           a.input, ": model sizes out of range (wte ", dt::shape_str(wte.shape), ", wpe ",
           dt::shape_str(wpe.shape), ")");
  dt::GptConfig cfg;
  cfg.vocab = static_cast<int>(wte.shape[0]);
  cfg.embd = static_cast<int>(wte.shape[1]);
  cfg.block = static_cast<int>(wpe.shape[0]);
  cfg.layers = static_cast<int>(layers);
  cfg.heads = a.heads;
  DT_CHECK(ConfigError, cfg.embd % cfg.heads == 0, "option --heads: ", cfg.heads,
           " does not divide the embedding width ", cfg.embd, " of ", a.input);
  const std::vector<dt::ParamInfo> params = dt::gpt_params(cfg);
  const std::string model_text = "vocab " + std::to_string(cfg.vocab) + ", seq-len " +
                                 std::to_string(cfg.block) + ", layers " +
                                 std::to_string(cfg.layers) + ", heads " +
                                 std::to_string(cfg.heads) + ", embd " + std::to_string(cfg.embd);

  std::vector<std::string> issues;
  std::set<std::string> expected;
  for (const auto& p : params) {
    expected.insert(p.name);
    const auto it = f.tensors.find(p.name);
    if (it == f.tensors.end())
      issues.push_back("missing tensor " + p.name + " " + dt::shape_str(p.shape));
    else if (it->second.shape != p.shape)
      issues.push_back("tensor " + p.name + " has shape " + dt::shape_str(it->second.shape) +
                       ", the model needs " + dt::shape_str(p.shape));
  }
  const StEntry* lm_head = nullptr;
  for (const auto& [name, e] : f.tensors) {
    if (expected.count(name)) continue;
    if (name == "lm_head.weight") {
      if (e.shape == wte.shape)
        lm_head = &e;
      else
        issues.push_back("tensor lm_head.weight has shape " + dt::shape_str(e.shape) +
                         ", dt ties it to transformer.wte.weight " + dt::shape_str(wte.shape));
      continue;
    }
    // nanoGPT without flash attention keeps its causal mask as a buffer: not a parameter.
    const bool mask = name.size() > 10 && name.compare(name.size() - 10, 10, ".attn.bias") == 0 &&
                      e.shape.size() == 4;
    if (!mask) issues.push_back("unexpected tensor " + name + " " + dt::shape_str(e.shape));
  }
  if (!issues.empty()) {
    constexpr std::size_t kShown = 20;
    std::string msg;
    for (std::size_t k = 0; k < issues.size() && k < kShown; ++k) msg += "\n  " + issues[k];
    if (issues.size() > kShown)
      msg += "\n  ... and " + std::to_string(issues.size() - kShown) + " more";
    DT_THROW(ConfigError, a.input, ": does not hold the tensors of a dt GPT (", model_text,
             "; inferred from transformer.wte.weight, transformer.wpe.weight and the highest "
             "transformer.h.N, with --heads):",
             msg);
  }

  const std::string target = a.output + "/step-" + std::to_string(a.step) + ".h5";
  struct stat st;
  DT_CHECK(ConfigError, ::stat(target.c_str(), &st) != 0, "option --output: ", target,
           " exists already; remove it or choose another --output or --step");

  const std::size_t total = params.back().offset + params.back().numel;
  std::vector<float> weights(total), moments(2 * total, 0.0f);
  std::ifstream in(a.input, std::ios::binary);
  DT_CHECK(ConfigError, in.good(), a.input, ": cannot be read: ", std::strerror(errno));
  for (const auto& p : params) read_tensor(in, f, f.tensors.at(p.name), weights.data() + p.offset);
  // A weight that is Inf or NaN would only show as a NaN loss once training starts, far from its
  // cause: refused here, naming the tensor and the element.
  for (const auto& p : params) {
    const float* w = weights.data() + p.offset;
    const auto bad = std::find_if(w, w + p.numel, [](float x) { return !std::isfinite(x); });
    DT_CHECK(ConfigError, bad == w + p.numel, a.input, ": ", p.name, " holds ", *bad,
             " at element ", bad - w, ": dt imports finite weights only");
  }
  if (lm_head) {
    std::vector<float> head(dt::shape_numel(lm_head->shape));
    read_tensor(in, f, *lm_head, head.data());
    const auto& w = params.front();  // transformer.wte.weight
    DT_CHECK(ConfigError,
             std::memcmp(head.data(), weights.data() + w.offset, w.numel * sizeof(float)) == 0,
             a.input,
             ": lm_head.weight differs from transformer.wte.weight; dt ties the two, so "
             "this model cannot be imported");
  }

  dt::CkptMeta meta;
  meta.step = a.step;
  meta.tokens = 0;
  meta.optimizer_step = 0;
  meta.data_position = a.step;
  meta.rng_seed = dt::kDefaultSeed;
  meta.loss_scale = 1.0;
  for (const auto& [name, value] : dt::model_settings(cfg))
    meta.config += name + " = " + std::to_string(value) + "\n";
  meta.layout = "imported";
  // A key file that is refused is bad input, before the folder is claimed (or made).
  return ImportPlan{cfg,  params,  model_text, std::move(weights), std::move(moments),
                    meta, a.keys()};
}

int cmd_import(dt::Runtime& rt, const Args& a) {
  const bool lead = rt.rank() == 0;
  // The input and the key file are read on each rank's node: where a rank cannot read them, every
  // rank stops with its error before the collective work below.
  ImportPlan plan;
  on_every_rank(rt, [&] { plan = plan_import(a); });
  const dt::GptConfig& cfg = plan.cfg;
  const std::vector<dt::ParamInfo>& params = plan.params;
  const std::string& model_text = plan.model_text;
  const dt::CkptMeta& meta = plan.meta;
  const dt::security::Keys* keys = plan.keys;
  const std::size_t total = params.back().offset + params.back().numel;
  std::vector<dt::CkptTensor> tensors;
  const struct {
    const char* prefix;
    float* base;
  } groups[] = {{"/model/", plan.weights.data()},
                {"/optim/exp_avg/", plan.moments.data()},
                {"/optim/exp_avg_sq/", plan.moments.data() + total}};
  for (const auto& g : groups)
    for (const auto& p : params)
      tensors.push_back(dt::CkptTensor{g.prefix + p.name, p.shape, g.base + p.offset});
  // The folder is claimed as a training run claims it: never written while a run writes it, and
  // read below while no run commits or prunes checkpoints in it.
  std::unique_ptr<dt::FolderLock> lock;
  std::string busy;
  if (lead) {
    try {
      lock = std::make_unique<dt::FolderLock>(a.output, "dt_ckpt import", a.lock_wait_s,
                                              [](const std::string& line) {
                                                std::printf("dt_ckpt: %s\n", line.c_str());
                                                std::fflush(stdout);
                                              });
      if (!lock->warning().empty())
        std::fprintf(stderr, "dt_ckpt: warning: %s\n", lock->warning().c_str());
    } catch (const dt::CheckpointError& e) {
      busy = e.message();
    }
  }
  int refused = busy.empty() ? 0 : 1;
  rt.world().all_reduce(dt::view_of(&refused, 1), dt::ReduceOp::max);
  DT_CHECK(ConfigError, refused == 0,
           "option --output: ", lead ? busy : std::string("the folder is in use (see rank 0)"));
  // The import is encrypted with a key file and plain without, as the folder's checkpoints are,
  // and under their key: otherwise the folder's run would refuse to resume from it, and its newer
  // checkpoints would be set aside for it.
  for (const auto& e : dt::list_checkpoints(rt.world(), a.output)) {
    // Rank 0's reading of the file's encryption, on every rank (the key check below is
    // collective): "\x01" for a damaged file, which has no say in what the folder holds.
    std::string enc;
    if (lead) {
      try {
        enc = dt::checkpoint_encryption(e.path);
      } catch (const dt::Error&) {
        enc = "\x01";
      }
    }
    enc = dt::broadcast_text(rt.world(), enc, 0);
    if (enc == "\x01") continue;
    DT_CHECK(ConfigError, keys || enc.empty(), "option --output: ", a.output,
             " holds encrypted checkpoints (", e.path, ": ", enc,
             "); without --security.key_file dt_ckpt import writes plain ones, which a run with "
             "--ckpt.encrypt refuses to resume from: give the folder's key, or import into "
             "another folder");
    DT_CHECK(ConfigError, !keys || !enc.empty(), "option --output: ", a.output,
             " holds plain checkpoints (", e.path,
             "); with --security.key_file dt_ckpt import writes an encrypted one, which a run "
             "without --ckpt.encrypt refuses to resume from: import into another folder");
    if (!keys) continue;
    std::string wrong;
    try {
      dt::check_checkpoint_key(rt.world(), e.path, *keys);
    } catch (const dt::SecurityError& err) {  // the right key, attributes rewritten without it
      DT_THROW(ConfigError, "option --output: ", a.output, " holds a tampered checkpoint (",
               err.message(), "); import into another folder, or remove it first");
    } catch (const dt::CheckpointError& err) {
      if (err.message().rfind("checkpoint key:", 0) == 0) wrong = err.message();
    }
    DT_CHECK(ConfigError, wrong.empty(), "option --output: ", a.output,
             " holds checkpoints of another key (", wrong,
             "); the folder's run could not "
             "resume from the import: give its key, or import into another folder");
  }
  dt::SaveStats stats;
  try {
    stats = dt::save_checkpoint(rt.world(), a.output, tensors, meta,
                                std::numeric_limits<int>::max(), {}, keys);
  } catch (const dt::CheckpointError& e) {
    DT_THROW(ConfigError, "option --output: ", e.message());
  }
  if (lead) {
    for (const std::string& moved : stats.set_aside)
      std::printf("set aside %s: its step is not below that of the import\n", moved.c_str());
    for (const std::string& w : stats.warnings)
      std::fprintf(stderr, "dt_ckpt import: warning: %s\n", w.c_str());
    std::printf("imported %zu tensors (%s) from %s into %s%s\n", params.size(), model_text.c_str(),
                a.input.c_str(), stats.path.c_str(), keys ? " (encrypted)" : "");
    const std::string key_args =
        keys ? " --ckpt.encrypt=true --security.key_file=" + a.key_file : "";
    std::printf(
        "resume with: dt_train --model.vocab=%d --model.seq-len=%d --model.layers=%d "
        "--model.heads=%d --model.embd=%d --ckpt.resume=%s%s ...\n",
        cfg.vocab, cfg.block, cfg.layers, cfg.heads, cfg.embd, stats.path.c_str(),
        key_args.c_str());
  }
  return 0;
}

// ---- command line -------------------------------------------------------------------------------

const std::set<std::string> kSubcommands = {"list", "inspect", "verify", "export", "import"};
const std::set<std::string> kValueOptions = {
    "--format", "--output",           "--heads", "--step", "--lock-wait-s",
    "--config", "--security.key_file"};

// Parses argv into `a`; returns false when help was printed. Throws ConfigError on bad usage.
bool parse_args(int argc, char** argv, Args& a) {
  DT_CHECK(ConfigError, argc >= 2,
           "a subcommand is required (list, inspect, verify, export, import)");
  a.sub = argv[1];
  if (a.sub == "--help" || a.sub == "-h" || a.sub == "help") {
    std::printf("%s", kUsage);
    return false;
  }
  DT_CHECK(ConfigError, kSubcommands.count(a.sub), "unknown subcommand '", a.sub,
           "' (expected list, inspect, verify, export or import)");
  // Positional words go to `positional`, the rest (with the values of --name VALUE) to Options.
  std::vector<std::string> positional;
  std::vector<std::string> opt_args = {std::string("dt_ckpt ") + a.sub};
  for (int i = 2; i < argc; ++i) {
    const std::string s = argv[i];
    if (s.size() > 1 && s[0] == '-') {
      opt_args.push_back(s);
      if (kValueOptions.count(s) && i + 1 < argc) opt_args.push_back(argv[++i]);
    } else {
      positional.push_back(s);
    }
  }
  std::string summary;
  const std::string what = a.sub == "list" ? "DIR" : a.sub == "import" ? "IN.safetensors" : "FILE";
  if (a.sub == "list")
    summary = "dt_ckpt list DIR: the checkpoints of DIR, newest first, verified.";
  if (a.sub == "inspect")
    summary = "dt_ckpt inspect FILE: root attributes and datasets of a checkpoint.";
  if (a.sub == "verify")
    summary = "dt_ckpt verify FILE: checks every chunk digest of a checkpoint.";
  if (a.sub == "export")
    summary =
        "dt_ckpt export FILE --format safetensors --output OUT: the model weights of a "
        "verified checkpoint as safetensors.";
  if (a.sub == "import")
    summary =
        "dt_ckpt import IN.safetensors --output DIR --heads H: a nanoGPT-named safetensors "
        "file as the dt checkpoint DIR/step-S.h5.";
  dt::Options opts("dt_ckpt " + a.sub, summary);
  opts.usage("dt_ckpt " + a.sub + " " + what + " [--config FILE] [--option=value ...]");
  if (a.sub == "export")
    opts.add("format", &a.format, "safetensors", "output format", {"safetensors"})
        .add("output", &a.output, "",
             "output file (required); written as OUT.tmp.PID, then renamed; an existing OUT is "
             "replaced only when it is a safetensors file");
  if (a.sub != "inspect")
    opts.add("security.key_file", &a.key_file, "",
             std::string("job key of encrypted checkpoints (ckpt.encrypt): 32 bytes, mode 0600, "
                         "owned by you; ") +
                 (a.sub == "import" ? "the checkpoint is written encrypted with it"
                                    : "with it every chunk is decrypted and authenticated"));
  if (a.sub == "import")
    opts.add("output", &a.output, "", "checkpoint directory (required); created if missing")
        .add("heads", &a.heads, 0, "attention heads (required: not visible in the weights)", 0,
             1 << 20)
        .add("step", &a.step, 0, "step stored in the checkpoint (dt_train resumes there)", 0L,
             1L << 40)
        .add("lock-wait-s", &a.lock_wait_s, 10.0,
             "how long to wait for another run's claim on the --output folder (DIR/.dt-lock) to "
             "end before refusing the import",
             0.0, 86400.0);
  std::vector<const char*> cargs;
  for (const auto& s : opt_args) cargs.push_back(s.c_str());
  if (!opts.parse(static_cast<int>(cargs.size()), cargs.data())) return false;
  DT_CHECK(ConfigError, !positional.empty(), "dt_ckpt ", a.sub, ": ", what, " is required");
  DT_CHECK(ConfigError, positional.size() == 1, "dt_ckpt ", a.sub, ": expected one ", what,
           ", got also '", positional[1], "'");
  a.input = positional[0];
  DT_CHECK(ConfigError, !a.input.empty(), "dt_ckpt ", a.sub, ": ", what, " is empty");
  if (a.sub == "export" || a.sub == "import")
    DT_CHECK(ConfigError, !a.output.empty(), "option --output is required for dt_ckpt ", a.sub);
  if (a.sub == "import")
    DT_CHECK(ConfigError, a.heads >= 1,
             "option --heads is required for dt_ckpt import (the number "
             "of attention heads cannot be read from the weights)");
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  bool help = false;
  // Option errors of the command line alone end every rank here, before MPI starts, reported
  // once (dt::quiet_option_errors). A config file is read on each rank's node, and its copies may
  // differ: with --config, option errors are kept and agreed on once MPI has started, so that
  // every rank exits 2 with them instead of the others waiting for the missing rank.
  const bool config_given = dt::config_file_given(argc, argv);
  std::string option_error;
  int rc = dt::run_with_config_errors(
      "dt_ckpt",
      [&] {
        try {
          help = !parse_args(argc, argv, a);
        } catch (const dt::ConfigError& e) {
          if (!config_given) throw;
          option_error = e.message();
        }
        return help ? 0 : -1;
      },
      dt::quiet_option_errors(argc, argv));
  if (rc >= 0) return rc;
  DT_ASSERT(host_is_little_endian(), "dt_ckpt assumes a little-endian host");

  const auto runtime = dt::start_runtime(&argc, &argv, {}, "dt_ckpt");
  dt::Runtime& rt = *runtime;
  const bool lead = rt.rank() == 0;
  if (!dt::agree_on_errors(rt.world(), "dt_ckpt", [&] {
        if (!option_error.empty()) throw dt::ConfigError(option_error, __FILE__, __LINE__);
      }))
    return 2;
  try {
    if (a.sub == "list") rc = cmd_list(rt, a);
    if (a.sub == "inspect") rc = cmd_inspect(rt, a);
    if (a.sub == "verify") rc = cmd_verify(rt, a);
    if (a.sub == "export") rc = cmd_export(rt, a);
    if (a.sub == "import") rc = cmd_import(rt, a);
  } catch (const dt::ConfigError& e) {
    // Inputs are the same files on every rank, so every rank fails alike; rank 0 reports.
    if (lead) std::fprintf(stderr, "dt_ckpt %s: error: %s\n", a.sub.c_str(), e.message().c_str());
    rc = 2;
  } catch (const dt::CheckpointError& e) {
    if (lead) std::fprintf(stderr, "dt_ckpt %s: error: %s\n", a.sub.c_str(), e.message().c_str());
    rc = 2;
  } catch (const std::exception& e) {  // dt::Error and anything else: an internal failure
    std::fprintf(stderr, "dt_ckpt %s: rank %d: %s\n", a.sub.c_str(), rt.rank(), e.what());
    rc = 3;
  }
  std::fflush(stdout);
  rt.world().all_reduce(dt::view_of(&rc, 1), dt::ReduceOp::max);
  return rc;
}
