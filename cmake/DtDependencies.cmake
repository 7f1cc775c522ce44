# Finds every dependency of dt. A missing one stops configuration with the Debian package that
# provides it; scripts/bootstrap installs them all.
find_package(PkgConfig)
if(NOT PkgConfig_FOUND)
  message(FATAL_ERROR "dt: pkg-config not found (Debian package: pkg-config). Run scripts/bootstrap.")
endif()

macro(dt_require_package name debian)
  find_package(${name} ${ARGN} QUIET)
  if(NOT ${name}_FOUND)
    message(FATAL_ERROR "dt: ${name} not found (Debian package: ${debian}). Run scripts/bootstrap.")
  endif()
endmacro()

macro(dt_require_pkgconfig var module debian)
  pkg_check_modules(${var} QUIET IMPORTED_TARGET ${module})
  if(NOT ${var}_FOUND)
    message(FATAL_ERROR "dt: pkg-config module '${module}' not found (Debian package: ${debian}). Run scripts/bootstrap.")
  endif()
endmacro()

dt_require_package(MPI "libopenmpi-dev openmpi-bin" COMPONENTS C CXX)
dt_require_package(Boost "libboost-program-options-dev" 1.74 COMPONENTS program_options)
dt_require_package(OpenSSL "libssl-dev")
dt_require_pkgconfig(OPENBLAS openblas "libopenblas-dev")
dt_require_package(nlohmann_json "nlohmann-json3-dev")
dt_require_pkgconfig(HWLOC hwloc "libhwloc-dev")
dt_require_pkgconfig(PMIX pmix "libpmix-dev")
dt_require_pkgconfig(UCX ucx "libucx-dev")
dt_require_pkgconfig(HDF5 hdf5-openmpi "libhdf5-openmpi-dev")
if(NOT EXISTS /usr/include/httplib.h AND NOT EXISTS ${CMAKE_INSTALL_PREFIX}/include/httplib.h)
  find_path(HTTPLIB_INCLUDE httplib.h)
  if(NOT HTTPLIB_INCLUDE)
    message(FATAL_ERROR "dt: cpp-httplib (httplib.h) not found (Debian package: libcpp-httplib-dev). Run scripts/bootstrap.")
  endif()
endif()
# Debian builds cpp-httplib as a library (declarations in httplib.h, code in libcpp-httplib.so,
# with compile definitions that must match); a plain header-only httplib.h needs only threads.
pkg_check_modules(HTTPLIB QUIET IMPORTED_TARGET cpp-httplib)
find_package(Threads REQUIRED)
add_library(dt_httplib INTERFACE)
target_link_libraries(dt_httplib INTERFACE Threads::Threads
                      $<$<BOOL:${HTTPLIB_FOUND}>:PkgConfig::HTTPLIB>)
if(DT_BUILD_TESTS)
  dt_require_package(doctest "doctest-dev")
endif()

find_program(MPIEXEC_EXECUTABLE NAMES mpiexec mpirun)

include(DtIpsecMb)
