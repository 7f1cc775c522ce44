// A second dt::Runtime after the first has finalised MPI is refused with a dt::CommError that
// says why, on every rank; it must not reach MPI (Open MPI aborts the process on any call after
// MPI_Finalize but a few).
#include <cstdio>
#include <string>

#include "dt/runtime.hpp"

int main(int argc, char** argv) {
  int rank = -1;
  {
    dt::Runtime first(&argc, &argv, {dt::BindMode::none, false});
    rank = first.rank();
    first.world().barrier();
  }
  try {
    dt::Runtime second(&argc, &argv, {dt::BindMode::none, false});
    std::printf("rank %d: FAIL: a second Runtime started after MPI_Finalize\n", rank);
  } catch (const dt::CommError& e) {
    const std::string m = e.what();
    const bool ok = m.find("already been finalised") != std::string::npos;
    std::printf("rank %d: %s: %s\n", rank, ok ? "refused as expected" : "FAIL: unclear message",
                m.c_str());
    return ok ? 0 : 1;
  }
  return 1;
}
