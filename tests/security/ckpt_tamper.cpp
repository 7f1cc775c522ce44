// ckpt_tamper FILE [--keep-tag-digests]: what someone who can write a checkpoint but lacks the
// job key can do to it, for the tests of resuming from encrypted checkpoints.
//
// Swaps the first two tensor datasets of FILE that have the same shape and type (in the order
// H5Ovisit gives, outside /checksums and /crypto), together with everything that describes them
// and that needs no key: their row digests (/checksums/PATH), their nonces and tags (/crypto/PATH)
// and the digests of those (/checksums/crypto/PATH). Every digest of the file still matches, and
// only authentication (the tensor's index is in each chunk's AAD) finds the change: tampering.
// With --keep-tag-digests the digests of the nonces and tags stay where they were, so the file
// fails its digests as a damaged file does.
// Prints "swapped A and B" and exits 0; exits 1 naming the problem when FILE has no such pair.
#include <hdf5.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Dataset {
  std::string path;
  std::vector<hsize_t> dims;
  hid_t type = -1;  // owned
};

struct Found {
  std::vector<Dataset> sets;
};

bool under(const std::string& path, const char* prefix) {
  const std::size_t n = std::strlen(prefix);
  return path.compare(0, n, prefix) == 0 && (path.size() == n || path[n] == '/');
}

herr_t visit(hid_t root, const char* name, const H5O_info_t* info, void* data) {
  if (info->type != H5O_TYPE_DATASET) return 0;
  const std::string path = std::string("/") + name;
  if (under(path, "/checksums") || under(path, "/crypto")) return 0;
  hid_t d = H5Dopen2(root, path.c_str(), H5P_DEFAULT);
  if (d < 0) return -1;
  hid_t sp = H5Dget_space(d);
  Dataset s;
  s.path = path;
  s.dims.resize(static_cast<std::size_t>(H5Sget_simple_extent_ndims(sp)));
  H5Sget_simple_extent_dims(sp, s.dims.data(), nullptr);
  s.type = H5Dget_type(d);
  H5Sclose(sp);
  H5Dclose(d);
  static_cast<Found*>(data)->sets.push_back(std::move(s));
  return 0;
}

bool exists(hid_t f, const std::string& path) {
  // Every group on the way must exist for H5Lexists to answer.
  for (std::size_t at = path.find('/', 1); at != std::string::npos; at = path.find('/', at + 1))
    if (H5Lexists(f, path.substr(0, at).c_str(), H5P_DEFAULT) <= 0) return false;
  return H5Lexists(f, path.c_str(), H5P_DEFAULT) > 0;
}

bool swap_links(hid_t f, const std::string& a, const std::string& b) {
  const std::string tmp = a + ".ckpt_tamper";
  return H5Lmove(f, a.c_str(), f, tmp.c_str(), H5P_DEFAULT, H5P_DEFAULT) >= 0 &&
         H5Lmove(f, b.c_str(), f, a.c_str(), H5P_DEFAULT, H5P_DEFAULT) >= 0 &&
         H5Lmove(f, tmp.c_str(), f, b.c_str(), H5P_DEFAULT, H5P_DEFAULT) >= 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3 || (argc == 3 && std::strcmp(argv[2], "--keep-tag-digests") != 0)) {
    std::fprintf(stderr, "usage: ckpt_tamper FILE [--keep-tag-digests]\n");
    return 2;
  }
  const std::string file = argv[1];
  const bool keep_tag_digests = argc == 3;
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  if (f < 0) {
    std::fprintf(stderr, "ckpt_tamper: cannot open %s as an HDF5 file for writing\n", file.c_str());
    return 1;
  }
  Found found;
  H5Ovisit2(f, H5_INDEX_NAME, H5_ITER_INC, visit, &found, H5O_INFO_BASIC);
  int rc = 1;
  const Dataset* pair[2] = {nullptr, nullptr};
  for (std::size_t i = 0; i < found.sets.size() && !pair[0]; ++i)
    for (std::size_t j = i + 1; j < found.sets.size() && !pair[0]; ++j)
      if (found.sets[i].dims == found.sets[j].dims &&
          H5Tequal(found.sets[i].type, found.sets[j].type) > 0) {
        pair[0] = &found.sets[i];
        pair[1] = &found.sets[j];
      }
  if (!pair[0]) {
    std::fprintf(stderr, "ckpt_tamper: %s has no two tensors of the same shape and type\n",
                 file.c_str());
  } else {
    rc = 0;
    std::vector<std::string> prefixes = {"", "/checksums", "/crypto"};
    if (!keep_tag_digests) prefixes.push_back("/checksums/crypto");
    for (const auto& p : prefixes) {
      const std::string a = p + pair[0]->path, b = p + pair[1]->path;
      if (!exists(f, a) || !exists(f, b)) {
        std::fprintf(stderr, "ckpt_tamper: %s lacks %s or %s (not an encrypted checkpoint?)\n",
                     file.c_str(), a.c_str(), b.c_str());
        rc = 1;
        break;
      }
      if (!swap_links(f, a, b)) {
        std::fprintf(stderr, "ckpt_tamper: could not swap %s and %s in %s\n", a.c_str(), b.c_str(),
                     file.c_str());
        rc = 1;
        break;
      }
    }
    if (rc == 0) std::printf("swapped %s and %s\n", pair[0]->path.c_str(), pair[1]->path.c_str());
  }
  for (auto& s : found.sets) H5Tclose(s.type);
  if (H5Fclose(f) < 0) {
    std::fprintf(stderr, "ckpt_tamper: closing %s failed\n", file.c_str());
    rc = 1;
  }
  return rc;
}
