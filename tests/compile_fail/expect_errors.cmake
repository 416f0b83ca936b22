# Compiles SOURCE (cmake -P, from a CTest) and passes only if the compiler refuses it and its
# messages hold every line of the file EXPECTED (plain text, not regular expressions).
# -D: COMPILER, SOURCE, EXPECTED, FLAGS (a list: -std, -I...).
execute_process(COMMAND ${COMPILER} ${FLAGS} -fsyntax-only ${SOURCE}
  RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(status EQUAL 0)
  message(FATAL_ERROR "${SOURCE} compiled, but must not")
endif()
file(STRINGS ${EXPECTED} messages)
foreach(message IN LISTS messages)
  string(FIND "${out}${err}" "${message}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "the compiler's messages on ${SOURCE} lack \"${message}\":\n${err}")
  endif()
  message(STATUS "found: ${message}")
endforeach()
