# Sanitizer and fuzzing builds (scripts/sanitize.sh configures one build tree with both).
#
# TORCHPOINT_SANITIZE compiles and links everything in the tree with AddressSanitizer and
# UndefinedBehaviorSanitizer; any undefined behaviour aborts, so a test that hits it fails.
# TORCHPOINT_BUILD_FUZZ (clang only) adds the libFuzzer targets of fuzz/ and compiles all code
# with libFuzzer's coverage instrumentation, so that the fuzzer is guided by the library's
# branches; the sanitizer runtime supplies the hooks when a test binary is linked instead.
# LibTorch itself stays uninstrumented: errors inside it are not seen.
option(TORCHPOINT_SANITIZE "Build with AddressSanitizer and UndefinedBehaviorSanitizer" OFF)
option(TORCHPOINT_BUILD_FUZZ "Build the libFuzzer targets in fuzz/ (clang only)" OFF)

if(TORCHPOINT_SANITIZE)
  add_compile_options(-fsanitize=address,undefined -fno-sanitize-recover=undefined
                      -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address,undefined)
endif()

if(TORCHPOINT_BUILD_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "TORCHPOINT_BUILD_FUZZ needs clang (libFuzzer): "
                        "configure with -DCMAKE_CXX_COMPILER=clang++")
  endif()
  add_compile_options(-fsanitize=fuzzer-no-link)
endif()

