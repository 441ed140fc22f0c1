# Fuzz harnesses (tests/fuzz/fuzz_<name>.cpp, one LLVMFuzzerTestOneInput each) over the parsers
# that read outside or peer bytes. Included from the top-level CMakeLists.txt.
#   normal build:     fuzz_replay_<name>: the harness + replay_main.cpp; ctest Fuzz.<name> feeds
#                     it the committed corpus tests/fuzz/corpus/<name>/ (part of `make test`).
#   -DTANDEM_FUZZ=ON  (clang, its own build folder, e.g. build-fuzz with -DTANDEM_CUDA=OFF):
#                     fuzz_<name> linked with libFuzzer; every target is compiled with ASan,
#                     UBSan and coverage (see TANDEM_FUZZ in CMakeLists.txt).
#                     `tools/ci_security.sh fuzz` runs them for a bounded time from the corpus.
set(TANDEM_FUZZ_HARNESSES
    http:tandem_server
    openai_request:tandem_server
    chat_template:tandem_server
    chat_parser:tandem_server
    tokenizer:tandem_tokenizer
    instance_protocol:tandem_disagg
    transfer_wire:tandem_transfer
    model_files:tandem_model)
foreach(entry ${TANDEM_FUZZ_HARNESSES})
  string(REPLACE ":" ";" parts ${entry})
  list(GET parts 0 name)
  list(GET parts 1 lib)
  set(src ${CMAKE_SOURCE_DIR}/tests/fuzz/fuzz_${name}.cpp)
  if(TANDEM_FUZZ)
    set(target fuzz_${name})
    add_executable(${target} ${src})
    target_link_options(${target} PRIVATE -fsanitize=fuzzer)
  elseif(TANDEM_TESTS)
    set(target fuzz_replay_${name})
    add_executable(${target} ${src} ${CMAKE_SOURCE_DIR}/tests/fuzz/replay_main.cpp)
    add_test(NAME Fuzz.${name}
             COMMAND ${target} ${CMAKE_SOURCE_DIR}/tests/fuzz/corpus/${name})
    set_tests_properties(Fuzz.${name} PROPERTIES TIMEOUT 300)
  else()
    continue()
  endif()
  target_link_libraries(${target} PRIVATE ${lib})
  target_include_directories(${target} PRIVATE ${CMAKE_SOURCE_DIR}/tests/fuzz
                                               ${CMAKE_SOURCE_DIR}/tests)
  target_compile_options(${target} PRIVATE ${TANDEM_WARNINGS})
  target_compile_definitions(${target} PRIVATE TANDEM_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
endforeach()
