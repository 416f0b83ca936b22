# Installs the built torchpoint into a scratch prefix, moves the prefix elsewhere (the install
# must be relocatable), checks that its CMake files name no absolute path, then configures,
# builds and runs the consumer project against it with find_package(torchpoint), pointing it
# at the same LibTorch (Torch_DIR) as the README tells users to, and runs the installed CLI from
# the moved prefix. (A sanitized build passes the
# sanitizers' link flags, which its static library needs; nothing else.)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/installed)
file(RENAME ${WORK_DIR}/installed ${WORK_DIR}/moved)
file(GLOB_RECURSE package_files ${WORK_DIR}/moved/*.cmake)
foreach(f IN LISTS package_files)
  file(STRINGS ${f} lines REGEX "(${WORK_DIR}|${BUILD_DIR}|${SOURCE_DIR}|\"/usr/)")
  if(lines)
    message(FATAL_ERROR "${f} names an absolute path, so the install is not relocatable: ${lines}")
  endif()
endforeach()
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/moved -DTorch_DIR=${TORCH_DIR} -DCMAKE_BUILD_TYPE=Release
    -DCMAKE_CXX_COMPILER=${CXX_COMPILER} "-DCMAKE_EXE_LINKER_FLAGS=${LINK_FLAGS}")
# The moved prefix, never another torchpoint the system has (the deb_package test installs one
# into /usr while this test may run).
file(STRINGS ${WORK_DIR}/build/CMakeCache.txt found REGEX "^torchpoint_DIR:")
if(NOT found MATCHES "^torchpoint_DIR:PATH=${WORK_DIR}/moved/")
  message(FATAL_ERROR "find_package(torchpoint) did not find the moved prefix: ${found}")
endif()
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer ${WORK_DIR})
# The installed CLI, from the moved prefix, with no LD_LIBRARY_PATH: it finds LibTorch by its
# own run path and checks the file the consumer wrote.
if(EXISTS ${WORK_DIR}/moved/bin/torchpoint)
  # The LibTorch it loads is the one it was built against, not another one the system has.
  execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH
                          ldd ${WORK_DIR}/moved/bin/torchpoint
                  OUTPUT_VARIABLE libraries RESULT_VARIABLE rc)
  file(REAL_PATH ${TORCH_LIBRARY} expected)
  get_filename_component(expected ${expected} DIRECTORY)
  string(REGEX MATCH "libtorch_cpu\\.so[^ ]* => ([^ ]+)" found "${libraries}")
  if(NOT rc EQUAL 0 OR NOT CMAKE_MATCH_1)
    message(FATAL_ERROR "the installed torchpoint does not find libtorch_cpu.so:\n${libraries}")
  endif()
  file(REAL_PATH ${CMAKE_MATCH_1} loaded)
  get_filename_component(loaded ${loaded} DIRECTORY)
  if(NOT loaded STREQUAL expected)
    message(FATAL_ERROR "the installed torchpoint loads LibTorch from ${loaded}, not ${expected}")
  endif()
  run(${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH ${WORK_DIR}/moved/bin/torchpoint --help)
  run(${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH ${WORK_DIR}/moved/bin/torchpoint verify
      ${WORK_DIR}/consumer.safetensors)
endif()
