# CUDA Toolkit, cuBLAS and NCCL for the CUDA device plugin (hal/cuda) and the NCCL communicator
# (src/comm/nccl_comm.cpp).
#   DT_WITH_CUDA=AUTO  build them when nvcc, the toolkit and NCCL are all found (default)
#   DT_WITH_CUDA=ON    require them: configuration stops, naming what is missing
#   DT_WITH_CUDA=OFF   never
# Included from hal/CMakeLists.txt (the directory above every target that compiles CUDA). Sets
# the cache variable DT_HAVE_CUDA, read by tests/gpu; the toolkit's imported targets (CUDA::*) and
# dt_nccl_lib are global. The toolkit is looked for where CUDAToolkit_ROOT, CUDACXX or PATH point, then
# in /usr/local/cuda. Code is built for sm_90 (H100/H200) plus compute_90 PTX, which newer GPUs
# compile at load time; set CMAKE_CUDA_ARCHITECTURES to change that.
#
# The sanitizer build leaves CUDA out under AUTO: ASan cannot see device memory, nvcc would double
# CI's CUDA compile time for no added check, and the release build already builds and tests the
# plugin. DT_WITH_CUDA=ON builds it there too.
include(DtAutoOption)
dt_auto_option(DT_WITH_CUDA "Build the CUDA device plugin and NCCL communicator")
set(_dt_cuda_mode ${DT_WITH_CUDA_MODE})  # turned OFF below for the sanitizer build
set(DT_HAVE_CUDA OFF CACHE INTERNAL "CUDA plugin and NCCL communicator are built")
if(_dt_cuda_mode STREQUAL "AUTO" AND DT_SANITIZE)
  message(STATUS "dt: CUDA plugin left out of the sanitizer build (DT_WITH_CUDA=AUTO; ON forces it)")
  set(_dt_cuda_mode OFF)
endif()

if(NOT _dt_cuda_mode STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    find_program(_dt_nvcc nvcc)
    if(NOT _dt_nvcc)
      set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
    endif()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  set(_dt_cuda_missing "")
  set(_dt_cuda_where "")
  if(NOT CMAKE_CUDA_COMPILER OR NOT EXISTS "${CMAKE_CUDA_COMPILER}")
    list(APPEND _dt_cuda_missing "nvcc (the CUDA compiler)")
    if(CMAKE_CUDA_COMPILER)
      set(_dt_cuda_where " (CMAKE_CUDA_COMPILER=${CMAKE_CUDA_COMPILER} does not exist)")
    endif()
  else()
    get_filename_component(_dt_cuda_bin "${CMAKE_CUDA_COMPILER}" DIRECTORY)
    if(NOT CUDAToolkit_ROOT)
      get_filename_component(CUDAToolkit_ROOT "${_dt_cuda_bin}" DIRECTORY)
    endif()
    find_package(CUDAToolkit QUIET GLOBAL)
    if(NOT CUDAToolkit_FOUND)
      list(APPEND _dt_cuda_missing "the CUDA Toolkit (cudart)")
    elseif(NOT TARGET CUDA::cublas)
      list(APPEND _dt_cuda_missing "cuBLAS")
    endif()
  endif()
  find_path(DT_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  find_library(DT_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
  if(NOT DT_NCCL_INCLUDE_DIR OR NOT DT_NCCL_LIBRARY)
    list(APPEND _dt_cuda_missing "NCCL (nccl.h and libnccl)")
  endif()
  if(_dt_cuda_missing)
    string(JOIN ", " _dt_cuda_missing_text ${_dt_cuda_missing})
    if(_dt_cuda_mode STREQUAL "ON")
      message(FATAL_ERROR "dt: DT_WITH_CUDA=ON but ${_dt_cuda_missing_text} not found${_dt_cuda_where}. Install "
                          "the CUDA Toolkit with cuBLAS and NCCL, point CUDAToolkit_ROOT or "
                          "CMAKE_CUDA_COMPILER at it, or configure with -DDT_WITH_CUDA=OFF.")
    endif()
    message(STATUS "dt: CUDA plugin not built (DT_WITH_CUDA=AUTO): ${_dt_cuda_missing_text} not found")
  else()
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90-real 90-virtual)
    endif()
    enable_language(CUDA)
    add_library(dt_nccl_lib UNKNOWN IMPORTED GLOBAL)
    set_target_properties(dt_nccl_lib PROPERTIES IMPORTED_LOCATION ${DT_NCCL_LIBRARY}
                          INTERFACE_INCLUDE_DIRECTORIES ${DT_NCCL_INCLUDE_DIR})
    set(DT_HAVE_CUDA ON CACHE INTERNAL "CUDA plugin and NCCL communicator are built")
    message(STATUS "dt: CUDA plugin and NCCL communicator: CUDA ${CUDAToolkit_VERSION}, "
                   "architectures ${CMAKE_CUDA_ARCHITECTURES}, NCCL ${DT_NCCL_LIBRARY}")
  endif()
endif()
