# How dt's programs find libdt, a shared library. Programs run from the build tree find it through
# the RUNPATH CMake writes there (the build folder); installed ones through $ORIGIN/../lib, so an
# installation can be moved or copied (the Lmod module, modulefiles/, finds its prefix the same
# way). Included before any target is made.
set(CMAKE_INSTALL_RPATH "$ORIGIN/../lib")
