# Writes OUT: one CTest test per GoogleTest suite of EXE, named EXE_NAME:Suite and running
# `EXE --gtest_filter=Suite.*`, with TORCHPOINT_SOURCE_DIR=SOURCE_DIR and the PROPERTIES list
# (key value ...). Run after each build of EXE (see torchpoint_test's PER_SUITE).
execute_process(COMMAND ${EXE} --gtest_list_tests
  OUTPUT_VARIABLE listing ERROR_VARIABLE errors RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "${EXE} --gtest_list_tests failed (${status}):\n${listing}${errors}")
endif()
set(properties "")
foreach(item IN LISTS PROPERTIES)
  string(APPEND properties " [==[${item}]==]")
endforeach()
get_filename_component(exe_name ${EXE} NAME)
string(REPLACE "\n" ";" lines "${listing}")
set(script "")
set(suites 0)
foreach(line IN LISTS lines)
  # A suite's line: its name (no space, no dot) and a dot; a test's line starts with spaces.
  if(line MATCHES "^([^ .#]+)\\.")
    set(name "${exe_name}:${CMAKE_MATCH_1}")
    string(APPEND script
      "add_test([==[${name}]==] [==[${EXE}]==] [==[--gtest_filter=${CMAKE_MATCH_1}.*]==])\n"
      "set_tests_properties([==[${name}]==] PROPERTIES ENVIRONMENT "
      "[==[TORCHPOINT_SOURCE_DIR=${SOURCE_DIR}]==]${properties})\n")
    math(EXPR suites "${suites} + 1")
  endif()
endforeach()
if(suites EQUAL 0)
  message(FATAL_ERROR "${EXE} lists no test suite:\n${listing}")
endif()
file(WRITE ${OUT} "${script}")
