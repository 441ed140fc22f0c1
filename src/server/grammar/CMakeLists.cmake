# Structured outputs: xgrammar's C++ core (DESIGN.md section 5), built from its PyPI source
# distribution, which tools/fetch_xgrammar.sh downloads into a cache folder at configure time
# (or -DTANDEM_XGRAMMAR_DIR=<unpacked source> on a machine without PyPI). Only the static
# library is built (no Python bindings, no tests), with the project's ccache, without LTO.
set(TANDEM_XGRAMMAR_DIR "" CACHE PATH "xgrammar 0.2.8 source folder (empty: fetch it)")
if(NOT TANDEM_XGRAMMAR_DIR)
  execute_process(COMMAND ${CMAKE_SOURCE_DIR}/tools/fetch_xgrammar.sh
                  OUTPUT_VARIABLE xgrammar_dir OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE xgrammar_rc)
  if(NOT xgrammar_rc EQUAL 0 OR NOT EXISTS "${xgrammar_dir}/CMakeLists.txt")
    message(FATAL_ERROR "tools/fetch_xgrammar.sh failed (needs python3 -m pip and PyPI); "
                        "or pass -DTANDEM_XGRAMMAR_DIR=<xgrammar-0.2.8 source folder>")
  endif()
  set(TANDEM_XGRAMMAR_DIR "${xgrammar_dir}" CACHE PATH
      "xgrammar 0.2.8 source folder (empty: fetch it)" FORCE)
endif()
message(STATUS "xgrammar: ${TANDEM_XGRAMMAR_DIR}")
# xgrammar reads its options from a config.cmake in the top build folder first (its own
# cmake/config.cmake would turn the Python bindings on).
file(WRITE ${CMAKE_BINARY_DIR}/config.cmake
     "set(XGRAMMAR_BUILD_PYTHON_BINDINGS OFF)\nset(XGRAMMAR_BUILD_CXX_TESTS OFF)\n"
     "set(XGRAMMAR_ENABLE_CPPTRACE OFF)\nset(XGRAMMAR_ENABLE_INTERNAL_CHECK OFF)\n")
# Its CMakeLists puts -Werror -flto=auto in front of CMAKE_CXX_FLAGS: the flags after them win.
set(tandem_saved_cxx_flags "${CMAKE_CXX_FLAGS}")
set(CMAKE_CXX_FLAGS "${CMAKE_CXX_FLAGS} -fno-lto -Wno-error -w")
add_subdirectory(${TANDEM_XGRAMMAR_DIR} ${CMAKE_BINARY_DIR}/xgrammar EXCLUDE_FROM_ALL SYSTEM)
set(CMAKE_CXX_FLAGS "${tandem_saved_cxx_flags}")

tandem_layer(tandem_grammar "server/grammar" tandem_engine tandem_tokenizer)
target_link_libraries(tandem_grammar PRIVATE xgrammar)
