# Intel's ipsec-mb (Multi-Buffer Crypto) for AES-256-GCM with VAES and AVX-512 where the CPU has
# them (OpenSSL before 3.2 has no such code path; src/security/keys.cpp, option security.aes).
# Included from DtDependencies.cmake. Sets DT_HAVE_IPSEC_MB and, when ON, the target dt_ipsec_mb.
#   DT_WITH_IPSEC_MB=AUTO  use it when found (default)
#   DT_WITH_IPSEC_MB=ON    require it: configuration stops when it is missing
#   DT_WITH_IPSEC_MB=OFF   never; sealing runs through OpenSSL's EVP alone
include(DtAutoOption)
dt_auto_option(DT_WITH_IPSEC_MB "Use Intel ipsec-mb for AES-256-GCM")
set(DT_HAVE_IPSEC_MB OFF)
if(NOT DT_WITH_IPSEC_MB_MODE STREQUAL "OFF")
  find_path(IPSEC_MB_INCLUDE intel-ipsec-mb.h)
  find_library(IPSEC_MB_LIBRARY IPSec_MB)
  if(IPSEC_MB_INCLUDE AND IPSEC_MB_LIBRARY)
    set(DT_HAVE_IPSEC_MB ON)
    add_library(dt_ipsec_mb INTERFACE)
    target_include_directories(dt_ipsec_mb SYSTEM INTERFACE ${IPSEC_MB_INCLUDE})
    target_link_libraries(dt_ipsec_mb INTERFACE ${IPSEC_MB_LIBRARY})
    target_compile_definitions(dt_ipsec_mb INTERFACE DT_HAVE_IPSEC_MB=1)
  elseif(DT_WITH_IPSEC_MB_MODE STREQUAL "ON")
    message(FATAL_ERROR "dt: DT_WITH_IPSEC_MB=ON but intel-ipsec-mb.h or libIPSec_MB was not found (Debian package: libipsec-mb-dev). Run scripts/bootstrap.")
  endif()
endif()
if(DT_HAVE_IPSEC_MB)
  message(STATUS "dt: AES-256-GCM through OpenSSL EVP and Intel ipsec-mb (${IPSEC_MB_LIBRARY})")
else()
  message(STATUS "dt: AES-256-GCM through OpenSSL EVP (Intel ipsec-mb not used)")
endif()
