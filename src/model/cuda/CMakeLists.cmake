# The Qwen3-MoE model on one GPU (src/model/cuda), its tests and the whole-model benchmark.
# Included from the top-level CMakeLists.txt after src/backend/cuda/CMakeLists.cmake.
#   tandem_model_cuda   Qwen3MoeCuda (static library; links the CUDA ops and the CPU model layer)
#   test_model_cuda     golden fixtures through the engine on the GPU (GTEST_SKIP without one)
#   bench_model_cuda    decode step / prefill at real shapes with random weights vs the roofline
#   bench_qwen35_cuda   the same for Qwen3.5 (Qwen35MoeCuda) from a checkpoint on disk
#   bench_expert_load   the host side of loading MoE experts: grouped vs expert by expert (CPU)
#   profile_decode_cuda per-kernel time of a decode step's graph (CUPTI activity records)
#   bench_spec_cuda     MTP speculative decoding: verify-step cost, end-to-end decode
if(TANDEM_HAS_CUDA)
  file(GLOB TANDEM_MODEL_CUDA_SRCS CONFIGURE_DEPENDS
    ${CMAKE_SOURCE_DIR}/src/model/cuda/*.cpp ${CMAKE_SOURCE_DIR}/src/model/cuda/*.cu)
  add_library(tandem_model_cuda STATIC ${TANDEM_MODEL_CUDA_SRCS})
  target_include_directories(tandem_model_cuda PUBLIC ${CMAKE_SOURCE_DIR}/src)
  target_link_libraries(tandem_model_cuda PUBLIC tandem_model tandem_backend_cuda tandem_comm_cuda)
  target_compile_options(tandem_model_cuda PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${TANDEM_WARNINGS}>)
  if(NOT CMAKE_CUDA_ARCHITECTURES)
    set_target_properties(tandem_model_cuda PROPERTIES CUDA_ARCHITECTURES 90a)
  endif()
  # `tandem serve|generate --device cuda`
  target_link_libraries(tandem_server PUBLIC tandem_model_cuda)
  target_compile_definitions(tandem_server PUBLIC TANDEM_WITH_CUDA=1)

  if(TANDEM_TESTS AND TARGET GTest::gtest)
    file(GLOB TANDEM_MODEL_CUDA_TEST_SRCS CONFIGURE_DEPENDS
      ${CMAKE_SOURCE_DIR}/tests/model/cuda/*.cpp)
    add_executable(test_model_cuda ${TANDEM_MODEL_CUDA_TEST_SRCS})
    target_link_libraries(test_model_cuda PRIVATE tandem_model_cuda tandem_engine GTest::gtest
                                                  GTest::gtest_main)
    target_include_directories(test_model_cuda PRIVATE ${CMAKE_SOURCE_DIR}/tests)
    target_compile_definitions(test_model_cuda PRIVATE TANDEM_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
    target_compile_options(test_model_cuda PRIVATE ${TANDEM_WARNINGS})
    gtest_discover_tests(test_model_cuda DISCOVERY_TIMEOUT 60
      PROPERTIES ENVIRONMENT "TANDEM_SOURCE_DIR=${CMAKE_SOURCE_DIR}")
  endif()

  if(TANDEM_TESTS AND TARGET GTest::gtest)
    # The sharded model, ranks as forked processes (its own binary: nothing here may touch CUDA
    # before the fork).
    add_executable(test_model_cuda_sharded
                   ${CMAKE_SOURCE_DIR}/tests/model/cuda_sharded/test_sharded_cuda.cpp)
    target_link_libraries(test_model_cuda_sharded PRIVATE tandem_model_cuda tandem_engine
                                                          GTest::gtest GTest::gtest_main)
    target_include_directories(test_model_cuda_sharded PRIVATE ${CMAKE_SOURCE_DIR}/tests)
    target_compile_definitions(test_model_cuda_sharded PRIVATE TANDEM_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
    target_compile_options(test_model_cuda_sharded PRIVATE ${TANDEM_WARNINGS})
    gtest_discover_tests(test_model_cuda_sharded DISCOVERY_TIMEOUT 60
      PROPERTIES ENVIRONMENT "TANDEM_SOURCE_DIR=${CMAKE_SOURCE_DIR};NCCL_NVLS_ENABLE=0")
  endif()

  if(TANDEM_BENCH)
    add_executable(bench_model_cuda ${CMAKE_SOURCE_DIR}/bench/cuda/bench_model_cuda.cpp)
    target_link_libraries(bench_model_cuda PRIVATE tandem_model_cuda)
    target_compile_options(bench_model_cuda PRIVATE ${TANDEM_WARNINGS})
    # The host side of loading MoE experts (CPU only): grouped preparation vs expert by expert.
    add_executable(bench_expert_load ${CMAKE_SOURCE_DIR}/bench/cuda/bench_expert_load.cpp)
    target_link_libraries(bench_expert_load PRIVATE tandem_model_cuda)
    target_compile_options(bench_expert_load PRIVATE ${TANDEM_WARNINGS})
    # Qwen3.5 (Qwen35MoeCuda) from a checkpoint on disk: decode steps and prefill vs the bounds.
    add_executable(bench_qwen35_cuda ${CMAKE_SOURCE_DIR}/bench/cuda/bench_qwen35_cuda.cpp)
    target_link_libraries(bench_qwen35_cuda PRIVATE tandem_model_cuda)
    target_compile_options(bench_qwen35_cuda PRIVATE ${TANDEM_WARNINGS})
    if(TARGET CUDA::cupti)  # --profile-prefill (bench/cuda/cupti_kernels.h)
      target_link_libraries(bench_qwen35_cuda PRIVATE CUDA::cupti)
      target_compile_definitions(bench_qwen35_cuda PRIVATE TANDEM_BENCH_CUPTI=1)
    endif()
    # Per-kernel profile of a decode step's graph through CUPTI's activity API (no nsys on the
    # GPU image): issue 15 item 1.
    if(TARGET CUDA::cupti)
      add_executable(profile_decode_cuda ${CMAKE_SOURCE_DIR}/bench/cuda/profile_decode_cuda.cpp)
      target_link_libraries(profile_decode_cuda PRIVATE tandem_model_cuda CUDA::cupti)
      target_compile_options(profile_decode_cuda PRIVATE ${TANDEM_WARNINGS})
    endif()
    # MTP speculative decoding: verify-step cost and end-to-end decode with forced acceptance.
    add_executable(bench_spec_cuda ${CMAKE_SOURCE_DIR}/bench/cuda/bench_spec_cuda.cpp)
    target_link_libraries(bench_spec_cuda PRIVATE tandem_model_cuda tandem_engine)
    target_compile_options(bench_spec_cuda PRIVATE ${TANDEM_WARNINGS})
  endif()
endif()
