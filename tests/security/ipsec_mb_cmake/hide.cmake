# Initial cache (cmake -C) of security.cmake_ipsec_mb_on_missing: CMake looks nowhere ipsec-mb is.
set(CMAKE_IGNORE_PATH "/usr/include;/usr/local/include;/usr/lib;/usr/lib64;/usr/local/lib;/lib;/lib64;/usr/lib/x86_64-linux-gnu;/lib/x86_64-linux-gnu;/usr/lib/aarch64-linux-gnu"
    CACHE STRING "")
