# How dt's installed programs and libraries find theirs: one RUNPATH that serves both the build
# tree and an installation, written at link time (BUILD_WITH_INSTALL_RPATH), so that installing
# copies the files unchanged. CMake's other way, editing the RUNPATH at install time, pads the
# build tree's with empty entries, which the dynamic loader reads as the working directory: a
# library planted where a job runs would be loaded into it.
#   dt_runpath(ORIGIN_PATH TARGET...): the targets' RUNPATH is ORIGIN_PATH (relative to the
#   file, the same in both trees; empty for none), then the folders of the libraries they link
#   from outside the project (MPI, OpenBLAS, HDF5, CUDA), which the installed files need as much.
# Programs live in bin/ and apps/, libdt in lib/ in both trees, so $ORIGIN/../lib finds it; the
# programs that are not installed (tests, benchmarks) keep CMake's build-tree RUNPATH.
function(dt_runpath origin_path)
  set_target_properties(${ARGN} PROPERTIES BUILD_WITH_INSTALL_RPATH ON
                        INSTALL_RPATH "${origin_path}" INSTALL_RPATH_USE_LINK_PATH ON)
endfunction()
