# tools/ executables (C++). Included from the top-level CMakeLists.txt after the tests block and
# the tandem target:
#   include(${CMAKE_SOURCE_DIR}/tools/CMakeLists.cmake)
#
# Targets:
#   make_random_checkpoint   random bf16 / block-FP8 Qwen3-MoE and Qwen3.5 checkpoints at real
#                            shapes (tools/README.md); links tandem_model for convert's rules
# Tests (ctest): Tools.RandomCheckpoint writes a 2-layer tiny checkpoint and generates from it
# with `tandem generate`; Tools.RandomCheckpointFp8 compares --format fp8 with `tandem convert
# --format fp8` of the bf16 checkpoint and generates from it; Tools.AiperfRows checks bench/aiperf_rows.py on a hand-made aiperf
# artifact directory; Tools.PredictEp and Tools.GpuEpPredictDry check tools/predict_ep.py and
# tools/gpu_ep_predict.sh.

add_executable(make_random_checkpoint ${CMAKE_CURRENT_LIST_DIR}/make_random_checkpoint.cpp)
target_link_libraries(make_random_checkpoint PRIVATE tandem_model Threads::Threads)
target_compile_options(make_random_checkpoint PRIVATE ${TANDEM_WARNINGS})

if(TANDEM_TESTS AND TARGET tandem)
  # Tools.RandomCheckpoint: the bf16 checkpoint loads and generates; Tools.RandomCheckpointFp8:
  # --format fp8 against `tandem convert --format fp8` of the bf16 one.
  foreach(check IN ITEMS "RandomCheckpoint;random_checkpoint;120"
                         "RandomCheckpointFp8;random_checkpoint_fp8;300")
    list(GET check 0 name)
    list(GET check 1 script)
    list(GET check 2 timeout)
    add_test(NAME Tools.${name}
             COMMAND ${CMAKE_CURRENT_LIST_DIR}/../tests/tools/test_${script}.sh
                     $<TARGET_FILE:make_random_checkpoint> $<TARGET_FILE:tandem>)
    set_tests_properties(Tools.${name} PROPERTIES TIMEOUT ${timeout})
  endforeach()
endif()
if(TANDEM_TESTS AND TARGET tandem)
  # make_random_checkpoint --mtp + --speculative-config, and tools/train_mtp.py (skips without
  # a python that has torch).
  add_test(NAME Tools.MtpTools
           COMMAND ${CMAKE_CURRENT_LIST_DIR}/../tests/tools/test_mtp_tools.sh
                   $<TARGET_FILE:make_random_checkpoint> $<TARGET_FILE:tandem> ${CMAKE_SOURCE_DIR})
  set_tests_properties(Tools.MtpTools PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77)
endif()
if(TANDEM_TESTS)
  # bench/aiperf_rows.py (the aiperf rows of tools/gpu_aiperf_bench.sh) on a hand-made artifact.
  add_test(NAME Tools.AiperfRows
           COMMAND ${CMAKE_CURRENT_LIST_DIR}/../tests/tools/test_aiperf_rows.sh ${CMAKE_SOURCE_DIR})
  set_tests_properties(Tools.AiperfRows PROPERTIES TIMEOUT 60)
  # tools/predict_ep.py (issue #28: multi-GPU layouts predicted from one GPU) against values
  # worked out by hand; tools/gpu_ep_predict.sh end to end with a stand-in bench_qwen35_cuda and
  # make_random_checkpoint --config-only (every slice's flags valid, every table row found).
  add_test(NAME Tools.PredictEp COMMAND python3
                                        ${CMAKE_CURRENT_LIST_DIR}/../tests/tools/test_predict_ep.py
                                        ${CMAKE_SOURCE_DIR})
  set_tests_properties(Tools.PredictEp PROPERTIES TIMEOUT 60)
  add_test(NAME Tools.GpuEpPredictDry
           COMMAND ${CMAKE_CURRENT_LIST_DIR}/../tests/tools/test_gpu_ep_predict.sh
                   ${CMAKE_SOURCE_DIR} $<TARGET_FILE:make_random_checkpoint>)
  set_tests_properties(Tools.GpuEpPredictDry PROPERTIES TIMEOUT 120)
endif()
