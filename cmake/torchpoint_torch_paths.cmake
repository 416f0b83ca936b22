# Keeps every LibTorch library from the one LibTorch that Torch_DIR names. Included before
# find_package(Torch) by torchpoint's build and by the installed torchpointConfig.cmake.
#
# TorchConfig.cmake finds its Caffe2 package and its libraries (libtorch.so, libc10.so, ...) with
# find_package/find_library calls that look in the default places before its own folder. With
# Debian's libtorch-dev (1.13) installed, a Torch_DIR pointing at another LibTorch (the torch
# wheel's 2.x) would then link LibTorch 1.13's libc10.so beside 2.x's libtorch_cpu.so and name
# /usr/lib as the LibTorch directory (run path, Debian package Depends). Every LibTorch layout
# (wheel, pytorch.org zip, source install) has Caffe2 beside Torch and the libraries in
# PREFIX/lib, three folders above TorchConfig.cmake, so they are looked up there first; a
# library that is not there (Debian's own layout, or kineto in a build without it) is left to
# TorchConfig.cmake.
if(DEFINED Torch_DIR AND NOT DEFINED Caffe2_DIR AND EXISTS "${Torch_DIR}/../Caffe2")
  get_filename_component(Caffe2_DIR "${Torch_DIR}/../Caffe2" ABSOLUTE)
endif()
if(DEFINED Torch_DIR AND EXISTS "${Torch_DIR}/../../../lib")
  get_filename_component(_tp_torch_lib_dir "${Torch_DIR}/../../../lib" ABSOLUTE)
  # The cache variables TorchConfig.cmake fills: TORCH_LIBRARY, then <name>_LIBRARY.
  foreach(_tp_var TORCH c10 kineto)
    string(REPLACE TORCH torch _tp_name ${_tp_var})
    if(EXISTS "${_tp_torch_lib_dir}/${CMAKE_SHARED_LIBRARY_PREFIX}${_tp_name}${CMAKE_SHARED_LIBRARY_SUFFIX}")
      get_filename_component(_tp_cached_dir "${${_tp_var}_LIBRARY}" DIRECTORY)
      if(${_tp_var}_LIBRARY AND NOT _tp_cached_dir STREQUAL _tp_torch_lib_dir)
        # Cached by a configure before this file existed: another LibTorch's library.
        message(STATUS "torchpoint: ${_tp_var}_LIBRARY was ${${_tp_var}_LIBRARY}, not from "
                       "Torch_DIR's LibTorch; looking again in ${_tp_torch_lib_dir}")
        unset(${_tp_var}_LIBRARY CACHE)
      endif()
      find_library(${_tp_var}_LIBRARY ${_tp_name} PATHS "${_tp_torch_lib_dir}" NO_DEFAULT_PATH)
    endif()
  endforeach()
endif()
