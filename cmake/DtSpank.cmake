# Slurm's SPANK header for spank_dt_qos.so, the plugin of slurmstepd that puts a job's tasks into
# its QoS groups (src/qos/spank_dt_qos.cpp). Sets DT_HAVE_SPANK and SPANK_INCLUDE.
#   DT_WITH_SPANK=AUTO  build the plugin when slurm/spank.h is found (default), except in the
#                       sanitizer build: slurmstepd, built without ASan, could not load it
#   DT_WITH_SPANK=ON    require it: configuration stops when the header is missing
#   DT_WITH_SPANK=OFF   never
# The plugin links no Slurm library: slurmstepd, which loads it, provides the spank_* functions.
include(DtAutoOption)
dt_auto_option(DT_WITH_SPANK "Build the SPANK plugin spank_dt_qos.so")
set(DT_HAVE_SPANK OFF)
if(DT_WITH_SPANK_MODE STREQUAL "AUTO" AND DT_SANITIZE)
  message(STATUS "dt: no SPANK plugin in the sanitizer build (DT_WITH_SPANK=AUTO; ON forces it)")
elseif(NOT DT_WITH_SPANK_MODE STREQUAL "OFF")
  find_path(SPANK_INCLUDE slurm/spank.h)
  if(SPANK_INCLUDE)
    set(DT_HAVE_SPANK ON)
  elseif(DT_WITH_SPANK_MODE STREQUAL "ON")
    message(FATAL_ERROR "dt: DT_WITH_SPANK=ON but slurm/spank.h was not found (Debian package: libslurm-dev). Run scripts/bootstrap.")
  endif()
endif()
if(DT_HAVE_SPANK)
  message(STATUS "dt: SPANK plugin spank_dt_qos.so (${SPANK_INCLUDE}/slurm/spank.h)")
elseif(NOT DT_SANITIZE)
  message(STATUS "dt: no SPANK plugin (slurm/spank.h not found or DT_WITH_SPANK=OFF)")
endif()
