// A test tool that damages an HDF5 file as a fault or a hostile writer would:
//   h5_edit FILE unlink PATH            removes the link PATH (a dataset), as damage to a group's
//                                       index would lose it (tests/ckpt/corrupt.sh, lost_dataset)
//   h5_edit FILE set-attr NAME VALUE    sets the root's string attribute NAME to VALUE (bytes as
//                                       given, control bytes included), replacing any it has
//                                       (tests/ckpt_tool/inspect.sh)
//   h5_edit FILE set-attr-vlen NAME VALUE     the same as a variable-length string (as h5py
//                                             writes str attributes)
//   h5_edit FILE set-attr-array NAME VALUE N  the same as an array of N fixed-length strings
//                                             (tests/ckpt_tool/verify.sh)
#include <hdf5.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

// The root's attribute NAME: VALUE as a fixed-length string (n = 0: scalar; else an array of n),
// or as a variable-length string (vlen).
int set_attr(hid_t f, const char* name, const char* value, hsize_t n, bool vlen) {
  if (H5Aexists(f, name) > 0 && H5Adelete(f, name) < 0) return -1;
  const hid_t type = H5Tcopy(H5T_C_S1);
  const std::size_t len = std::strlen(value) > 0 ? std::strlen(value) : 1;
  H5Tset_size(type, vlen ? H5T_VARIABLE : len);
  const hid_t space = n == 0 ? H5Screate(H5S_SCALAR) : H5Screate_simple(1, &n, nullptr);
  const hid_t a = H5Acreate2(f, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
  herr_t rc = -1;
  if (a >= 0 && vlen) {
    rc = H5Awrite(a, type, &value);
  } else if (a >= 0) {
    std::vector<char> data(len * (n == 0 ? 1 : n), '\0');
    for (std::size_t i = 0; i < data.size(); i += len)
      std::memcpy(&data[i], value, std::strlen(value));
    rc = H5Awrite(a, type, data.data());
  }
  if (a >= 0) H5Aclose(a);
  H5Sclose(space);
  H5Tclose(type);
  return rc < 0 ? -1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const char* op = argc > 2 ? argv[2] : "";
  const bool unlink = argc == 4 && std::strcmp(op, "unlink") == 0;
  const bool attr = argc == 5 && std::strcmp(op, "set-attr") == 0;
  const bool vlen = argc == 5 && std::strcmp(op, "set-attr-vlen") == 0;
  const bool array = argc == 6 && std::strcmp(op, "set-attr-array") == 0 && std::atoi(argv[5]) > 0;
  if (!unlink && !attr && !vlen && !array) {
    std::fprintf(stderr,
                 "usage: h5_edit FILE unlink PATH | h5_edit FILE set-attr NAME VALUE | "
                 "h5_edit FILE set-attr-vlen NAME VALUE | h5_edit FILE set-attr-array NAME VALUE "
                 "N\n");
    return 2;
  }
  const hid_t f = H5Fopen(argv[1], H5F_ACC_RDWR, H5P_DEFAULT);
  if (f < 0) {
    std::fprintf(stderr, "h5_edit: cannot open %s\n", argv[1]);
    return 1;
  }
  const int rc = unlink ? (H5Ldelete(f, argv[3], H5P_DEFAULT) < 0 ? -1 : 0)
                        : set_attr(f, argv[3], argv[4],
                                   array ? static_cast<hsize_t>(std::atoi(argv[5])) : 0, vlen);
  H5Fclose(f);
  if (rc < 0) {
    std::fprintf(stderr, "h5_edit: cannot %s %s in %s\n", argv[2], argv[3], argv[1]);
    return 1;
  }
  return 0;
}
