// dt::Runtime refuses an MPI that was initialised without MPI_THREAD_MULTIPLE, with a message
// that names the level it got and the level it needs.
#include <mpi.h>

#include <cstdio>
#include <string>

#include "dt/runtime.hpp"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int rc = 1;
  if (provided >= MPI_THREAD_MULTIPLE) {
    std::printf("MPI provided MPI_THREAD_MULTIPLE for a SERIALIZED request; cannot test refusal\n");
  } else {
    try {
      dt::Runtime rt(&argc, &argv);
      std::printf("FAIL: Runtime accepted thread level %d\n", provided);
    } catch (const dt::CommError& e) {
      const std::string m = e.what();
      const bool ok = m.find("MPI_THREAD_SERIALIZED") != std::string::npos &&
                      m.find("needs MPI_THREAD_MULTIPLE") != std::string::npos;
      std::printf("%s: %s\n", ok ? "refused as expected" : "FAIL: unclear message", m.c_str());
      rc = ok ? 0 : 1;
    }
  }
  MPI_Finalize();
  return rc;
}
