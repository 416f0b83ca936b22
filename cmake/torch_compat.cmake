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
message(STATUS "torchpoint: LibTorch ${Torch_VERSION} from ${TORCH_INSTALL_PREFIX}")
