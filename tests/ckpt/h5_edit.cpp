// A test tool that damages an HDF5 file as a fault or a hostile writer would:
//   h5_edit FILE unlink PATH            removes the link PATH (a dataset), as damage to a group's
//                                       index would lose it (tests/ckpt/corrupt.sh, lost_dataset)
//   h5_edit FILE set-attr NAME VALUE    sets the root's string attribute NAME to VALUE (bytes as
//                                       given, control bytes included), replacing any it has
//                                       (tests/ckpt_tool/inspect.sh)
#include <hdf5.h>

#include <cstdio>
#include <cstring>

namespace {

int set_attr(hid_t f, const char* name, const char* value) {
  if (H5Aexists(f, name) > 0 && H5Adelete(f, name) < 0) return -1;
  const hid_t type = H5Tcopy(H5T_C_S1);
  H5Tset_size(type, std::strlen(value) > 0 ? std::strlen(value) : 1);
  const hid_t space = H5Screate(H5S_SCALAR);
  const hid_t a = H5Acreate2(f, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
  const herr_t rc = a < 0 ? -1 : H5Awrite(a, type, value);
  if (a >= 0) H5Aclose(a);
  H5Sclose(space);
  H5Tclose(type);
  return rc < 0 ? -1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool unlink = argc == 4 && std::strcmp(argv[2], "unlink") == 0;
  const bool attr = argc == 5 && std::strcmp(argv[2], "set-attr") == 0;
  if (!unlink && !attr) {
    std::fprintf(stderr, "usage: h5_edit FILE unlink PATH | h5_edit FILE set-attr NAME VALUE\n");
    return 2;
  }
  const hid_t f = H5Fopen(argv[1], H5F_ACC_RDWR, H5P_DEFAULT);
  if (f < 0) {
    std::fprintf(stderr, "h5_edit: cannot open %s\n", argv[1]);
    return 1;
  }
  const int rc =
      unlink ? (H5Ldelete(f, argv[3], H5P_DEFAULT) < 0 ? -1 : 0) : set_attr(f, argv[3], argv[4]);
  H5Fclose(f);
  if (rc < 0) {
    std::fprintf(stderr, "h5_edit: cannot %s %s in %s\n", argv[2], argv[3], argv[1]);
    return 1;
  }
  return 0;
}
