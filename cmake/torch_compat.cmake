# What differs between the LibTorch versions torchpoint builds against, on the CMake side. (The
# C++ side lives in src/compat/.) Included after find_package(Torch).
#
# The torch wheel ships fmt's headers (fmt 12 in torch 2.13) inside its include folder, which
# the torch target adds to every compile line ahead of /usr/include. torchpoint uses and links
# Debian's libfmt, so its headers must win: a folder holding only a link to them goes first.
# (GCC ignores -I for /usr/include itself, a system folder.)
if(EXISTS "${TORCH_INSTALL_PREFIX}/include/fmt")
  get_target_property(_tp_fmt_includes fmt::fmt INTERFACE_INCLUDE_DIRECTORIES)
  list(GET _tp_fmt_includes 0 _tp_fmt_include)
  set(_tp_fmt_first "${CMAKE_BINARY_DIR}/fmt-first")
  file(MAKE_DIRECTORY "${_tp_fmt_first}")
  file(CREATE_LINK "${_tp_fmt_include}/fmt" "${_tp_fmt_first}/fmt" SYMBOLIC)
  include_directories(BEFORE SYSTEM "${_tp_fmt_first}")
endif()

# LibTorch 1.13's headers fail to compile with clang in C++20 mode (libstdc++'s constexpr
# std::vector<c10::IValue> is instantiated in ATen/core/List.h while IValue is incomplete)
# unless ivalue.h comes first, so every translation unit starts with it: ours, and through the
# installed target those of a consumer (torchpoint makes them C++20).
if(Torch_VERSION VERSION_LESS 2)
  if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    add_compile_options("SHELL:-include ATen/core/ivalue.h")
  endif()
  set(TORCHPOINT_CONSUMER_OPTIONS "$<$<CXX_COMPILER_ID:Clang>:-includeATen/core/ivalue.h>")
endif()
message(STATUS "torchpoint: LibTorch ${Torch_VERSION} from ${TORCH_INSTALL_PREFIX}")
