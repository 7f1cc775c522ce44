// h5_edit FILE unlink PATH: removes the link PATH (a dataset) from an HDF5 file, as damage to a
// group's index would lose it. A test tool for tests/ckpt/corrupt.sh (mode lost_dataset).
#include <hdf5.h>

#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  if (argc != 4 || std::strcmp(argv[2], "unlink") != 0) {
    std::fprintf(stderr, "usage: h5_edit FILE unlink PATH\n");
    return 2;
  }
  const hid_t f = H5Fopen(argv[1], H5F_ACC_RDWR, H5P_DEFAULT);
  if (f < 0) {
    std::fprintf(stderr, "h5_edit: cannot open %s\n", argv[1]);
    return 1;
  }
  const herr_t rc = H5Ldelete(f, argv[3], H5P_DEFAULT);
  H5Fclose(f);
  if (rc < 0) {
    std::fprintf(stderr, "h5_edit: cannot unlink %s in %s\n", argv[3], argv[1]);
    return 1;
  }
  return 0;
}
