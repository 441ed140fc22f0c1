# CUDA backend ops (src/backend/cuda), their tests and benchmark. Included from the top-level
# CMakeLists.txt after the tests block (needs tandem_backend, TANDEM_WARNINGS, TANDEM_HAS_CUDA,
# TANDEM_TESTS + GTest):
#   include(${CMAKE_SOURCE_DIR}/src/backend/cuda/CMakeLists.cmake)
#
# Targets (CUDA only; nothing is built without nvcc):
#   tandem_backend_cuda   kernels + cuBLASLt GEMM wrapper (static library)
#   tandem_backend_ops_cases  the kernel-test harness + every op's cases (tests/backend/cuda/ops)
#   test_backend_cuda     each kernel vs the CPU reference (GTEST_SKIP without a GPU)
#   bench_backend_ops     every harness case timed (--perf: GB/s, TFLOP/s) or checked (--check)
#   bench_ops_cuda        per-kernel timings beside the copy-bandwidth / GEMM-rate bound
#   bench_sampling        sample_launch timings beside the copy bound of reading the logits
#   bench_moe_layer       the MoE block and grouped expert GEMMs beside the same bounds
#   bench_fp8_gemm        cuBLASLt block-scaled FP8 GEMM beside the bf16 GEMM, real shapes
#   bench_fp8_linear      FP8-weight gemv / grouped GEMM beside the bf16 ones, decode shapes
#   bench_moe_w8a8        W8A8 wgmma grouped GEMM (CUTLASS) beside bf16, W8A16, cuBLASLt
#   bench_mxfp8_w8a8      MXFP8 -> 128-column scales: the conversions' error (CPU)
#   bench_deltanet        Qwen3.5 conv1d + gated delta rule (decode, prefill) beside the bounds
# None of them links Gloo or NCCL (the GPU machine has no libgloo).

if(TANDEM_HAS_CUDA)
  get_filename_component(TANDEM_BACKEND_CUDA_ROOT "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
  # NOTE: CMake 3.25 knows nvcc's dialect flags only up to C++17; nvcc 12+ takes -std=c++20.
  if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()

  file(GLOB TANDEM_BACKEND_CUDA_SRCS CONFIGURE_DEPENDS
    ${TANDEM_BACKEND_CUDA_ROOT}/src/backend/cuda/*.cu
    ${TANDEM_BACKEND_CUDA_ROOT}/src/backend/cuda/*.cpp)
  add_library(tandem_backend_cuda STATIC ${TANDEM_BACKEND_CUDA_SRCS})
  target_include_directories(tandem_backend_cuda PUBLIC ${TANDEM_BACKEND_CUDA_ROOT}/src)
  target_link_libraries(tandem_backend_cuda PUBLIC tandem_backend CUDA::cudart CUDA::cublas CUDA::cublasLt)
  target_compile_options(tandem_backend_cuda PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:${TANDEM_WARNINGS}>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-unused-parameter -lineinfo>)
  if(NOT CMAKE_CUDA_ARCHITECTURES)
    set_target_properties(tandem_backend_cuda PROPERTIES CUDA_ARCHITECTURES 90a)
  endif()

  # FlashInfer's Hopper (sm90, FA3-style) prefill attention behind PrefillAttentionPlan
  # (attention_sm90.h). AUTO: built when scripts/fetch_flashinfer.sh gets the headers (PyPI
  # wheels flashinfer-python and nvidia-cuda-cccl, downloaded, not installed, into the cache
  # dir; nothing committed), skipped with a message otherwise; ON: a failed fetch is an error;
  # OFF: not built (the FA2 kernel serves every prefill). TANDEM_FLASHINFER_DIR: an unpacked
  # tree of the script's layout to use instead of fetching. The kernel TUs take minutes and
  # ~3.5 GB each: one instantiation each (bf16, head_dim 128, causal), in a job pool of 1.
  set(TANDEM_FLASHINFER AUTO CACHE STRING "FlashInfer sm90 prefill attention (AUTO, ON, OFF)")
  set(TANDEM_FLASHINFER_DIR "" CACHE PATH "Unpacked FlashInfer headers (scripts/fetch_flashinfer.sh layout)")
  set(TANDEM_HAS_FLASHINFER OFF)
  if(NOT TANDEM_FLASHINFER STREQUAL "OFF")
    set(_fi_dir "${TANDEM_FLASHINFER_DIR}")
    if(NOT _fi_dir)
      execute_process(COMMAND ${TANDEM_BACKEND_CUDA_ROOT}/scripts/fetch_flashinfer.sh
                      OUTPUT_VARIABLE _fi_dir ERROR_VARIABLE _fi_err RESULT_VARIABLE _fi_rc
                      OUTPUT_STRIP_TRAILING_WHITESPACE)
      if(NOT _fi_rc EQUAL 0)
        set(_fi_dir "")
      endif()
    endif()
    if(_fi_dir AND EXISTS "${_fi_dir}/include/flashinfer/attention/hopper/prefill_sm90.cuh")
      set(TANDEM_HAS_FLASHINFER ON)
    elseif(TANDEM_FLASHINFER STREQUAL "ON")
      message(FATAL_ERROR "TANDEM_FLASHINFER=ON but the FlashInfer headers are missing: ${_fi_err}")
    else()
      message(STATUS "FlashInfer headers not fetched (${_fi_err}); prefill attention uses the FA2 kernel")
    endif()
  endif()
  message(STATUS "Tandem FlashInfer sm90 prefill attention: ${TANDEM_HAS_FLASHINFER}")
  if(TANDEM_HAS_FLASHINFER)
    file(GLOB TANDEM_FLASHINFER_SRCS CONFIGURE_DEPENDS
      ${TANDEM_BACKEND_CUDA_ROOT}/src/backend/cuda/flashinfer/*.cu)
    add_library(tandem_flashinfer_sm90 STATIC ${TANDEM_FLASHINFER_SRCS})
    # The newer CCCL goes before the toolkit's (cuda::fast_mod_div); FlashInfer's own tree last.
    target_include_directories(tandem_flashinfer_sm90 BEFORE PRIVATE ${_fi_dir}/cccl)
    target_include_directories(tandem_flashinfer_sm90 PRIVATE ${TANDEM_BACKEND_CUDA_ROOT}/src
      ${_fi_dir}/include ${_fi_dir}/cutlass/include ${_fi_dir}/cutlass/tools/util/include)
    # CUTLASS reaches cuTensorMapEncodeTiled through cudaGetDriverEntryPoint: no libcuda link.
    target_link_libraries(tandem_flashinfer_sm90 PRIVATE CUDA::cudart)
    # Third-party templates: their warnings are not ours to fix (-w).
    target_compile_options(tandem_flashinfer_sm90 PRIVATE
      $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr --expt-extended-lambda -w>)
    target_compile_definitions(tandem_flashinfer_sm90 PRIVATE NDEBUG)
    set_target_properties(tandem_flashinfer_sm90 PROPERTIES CUDA_ARCHITECTURES 90a
                          CUDA_STANDARD 20 JOB_POOL_COMPILE tandem_flashinfer_pool)
    set_property(GLOBAL APPEND PROPERTY JOB_POOLS tandem_flashinfer_pool=1)
    target_link_libraries(tandem_backend_cuda PRIVATE tandem_flashinfer_sm90)
    target_compile_definitions(tandem_backend_cuda PUBLIC TANDEM_HAS_FLASHINFER=1)

    # The W8A8 block-scaled grouped GEMM on wgmma (moe_gemm_w8a8.h) on the CUTLASS of the same
    # wheel (its sm90 pointer-array grouped GEMM with blockwise FP8 scaling): two instantiations
    # (prefill and decode tiles), one per TU, minutes and ~3 GB each, in the same pool of 1.
    file(GLOB TANDEM_CUTLASS_SRCS CONFIGURE_DEPENDS
      ${TANDEM_BACKEND_CUDA_ROOT}/src/backend/cuda/cutlass/*.cu)
    add_library(tandem_cutlass_sm90 STATIC ${TANDEM_CUTLASS_SRCS})
    target_include_directories(tandem_cutlass_sm90 BEFORE PRIVATE ${_fi_dir}/cccl)
    target_include_directories(tandem_cutlass_sm90 PRIVATE ${TANDEM_BACKEND_CUDA_ROOT}/src
      ${_fi_dir}/cutlass/include ${_fi_dir}/cutlass/tools/util/include)
    target_link_libraries(tandem_cutlass_sm90 PRIVATE tandem_backend CUDA::cudart)
    target_compile_options(tandem_cutlass_sm90 PRIVATE
      $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr --expt-extended-lambda -w>)
    target_compile_definitions(tandem_cutlass_sm90 PRIVATE NDEBUG)
    set_target_properties(tandem_cutlass_sm90 PROPERTIES CUDA_ARCHITECTURES 90a
                          CUDA_STANDARD 20 JOB_POOL_COMPILE tandem_flashinfer_pool)
    target_link_libraries(tandem_backend_cuda PRIVATE tandem_cutlass_sm90)
    target_compile_definitions(tandem_backend_cuda PRIVATE TANDEM_HAS_CUTLASS_W8A8=1)
  endif()

  option(TANDEM_BACKEND_CUDA_BENCH "Build bench_ops_cuda (CUDA only)" ON)

  # The kernel-test harness and every op's cases (tests/backend/cuda/ops/backend_ops.h), no
  # gtest: run as parameterised tests by test_backend_cuda, timed by bench_backend_ops.
  if((TANDEM_TESTS AND TARGET GTest::gtest) OR TANDEM_BACKEND_CUDA_BENCH)
    file(GLOB TANDEM_BACKEND_OPS_SRCS CONFIGURE_DEPENDS
      ${TANDEM_BACKEND_CUDA_ROOT}/tests/backend/cuda/ops/*.cpp)
    add_library(tandem_backend_ops_cases STATIC ${TANDEM_BACKEND_OPS_SRCS})
    target_include_directories(tandem_backend_ops_cases PUBLIC
                               ${TANDEM_BACKEND_CUDA_ROOT}/tests/backend/cuda/ops)
    target_link_libraries(tandem_backend_ops_cases PUBLIC tandem_backend_cuda)
    target_compile_options(tandem_backend_ops_cases PRIVATE ${TANDEM_WARNINGS})
  endif()

  if(TANDEM_TESTS AND TARGET GTest::gtest)
    include(GoogleTest)
    file(GLOB TANDEM_BACKEND_CUDA_TEST_SRCS CONFIGURE_DEPENDS
      ${TANDEM_BACKEND_CUDA_ROOT}/tests/backend/cuda/*.cpp)
    add_executable(test_backend_cuda ${TANDEM_BACKEND_CUDA_TEST_SRCS})
    target_link_libraries(test_backend_cuda PRIVATE tandem_backend_cuda tandem_backend_ops_cases
                                                    GTest::gtest GTest::gtest_main)
    target_compile_options(test_backend_cuda PRIVATE ${TANDEM_WARNINGS})
    # The CPU sampler is the reference of test_sampling_cuda.cpp; compiled in directly, as
    # tandem_engine would pull in Gloo.
    target_sources(test_backend_cuda PRIVATE ${TANDEM_BACKEND_CUDA_ROOT}/src/engine/sampling.cpp)
    # Without a GPU every test skips (GTEST_SKIP), so CI stays green. The kernel-test harness's
    # ~1,400 cases run as one ctest entry (one process, not one CUDA start-up per case).
    gtest_discover_tests(test_backend_cuda DISCOVERY_TIMEOUT 60 TEST_FILTER "-Cuda/BackendOps.*")
    add_test(NAME Cuda/BackendOps.AllCases
             COMMAND test_backend_cuda --gtest_filter=Cuda/BackendOps.*)
  endif()

  if(TANDEM_BACKEND_CUDA_BENCH)
    # Every harness case timed (--perf) or checked without gtest (--check).
    add_executable(bench_backend_ops
                   ${TANDEM_BACKEND_CUDA_ROOT}/bench/cuda/bench_backend_ops.cpp)
    target_link_libraries(bench_backend_ops PRIVATE tandem_backend_ops_cases)
    target_compile_options(bench_backend_ops PRIVATE ${TANDEM_WARNINGS})
    add_executable(bench_ops_cuda ${TANDEM_BACKEND_CUDA_ROOT}/bench/cuda/bench_ops_cuda.cpp)
    target_link_libraries(bench_ops_cuda PRIVATE tandem_backend_cuda)
    target_compile_options(bench_ops_cuda PRIVATE ${TANDEM_WARNINGS})
    add_executable(bench_sampling ${TANDEM_BACKEND_CUDA_ROOT}/bench/cuda/bench_sampling.cpp)
    target_link_libraries(bench_sampling PRIVATE tandem_backend_cuda)
    target_compile_options(bench_sampling PRIVATE ${TANDEM_WARNINGS})
    add_executable(bench_moe_layer ${TANDEM_BACKEND_CUDA_ROOT}/bench/cuda/bench_moe_layer.cpp)
    target_link_libraries(bench_moe_layer PRIVATE tandem_backend_cuda)
    target_compile_options(bench_moe_layer PRIVATE ${TANDEM_WARNINGS})
    # Qwen3.5 DeltaNet ops (conv1d, gated delta rule) at Qwen3.5-35B-A3B shapes.
    add_executable(bench_deltanet ${TANDEM_BACKEND_CUDA_ROOT}/bench/cuda/bench_deltanet.cpp)
    target_link_libraries(bench_deltanet PRIVATE tandem_backend_cuda)
    target_compile_options(bench_deltanet PRIVATE ${TANDEM_WARNINGS})
    # Block-scaled FP8 GEMM beside the bf16 one (bench/cuda/bench_fp8_gemm.cpp).
    add_executable(bench_fp8_gemm ${TANDEM_BACKEND_CUDA_ROOT}/bench/cuda/bench_fp8_gemm.cpp)
    target_link_libraries(bench_fp8_gemm PRIVATE tandem_backend_cuda)
    target_compile_options(bench_fp8_gemm PRIVATE ${TANDEM_WARNINGS})
    # FP8-weight gemv / grouped GEMM beside the bf16 ones (bench/cuda/bench_fp8_linear.cpp).
    add_executable(bench_fp8_linear ${TANDEM_BACKEND_CUDA_ROOT}/bench/cuda/bench_fp8_linear.cpp)
    target_link_libraries(bench_fp8_linear PRIVATE tandem_backend_cuda)
    target_compile_options(bench_fp8_linear PRIVATE ${TANDEM_WARNINGS})
    # W8A8 wgmma grouped GEMM beside bf16, W8A16 and cuBLASLt (bench/cuda/bench_moe_w8a8.cpp).
    add_executable(bench_moe_w8a8 ${TANDEM_BACKEND_CUDA_ROOT}/bench/cuda/bench_moe_w8a8.cpp)
    target_link_libraries(bench_moe_w8a8 PRIVATE tandem_backend_cuda)
    target_compile_options(bench_moe_w8a8 PRIVATE ${TANDEM_WARNINGS})
    # MXFP8 -> 128-column weight scales: the conversions' error, CPU (bench_mxfp8_w8a8.cpp).
    add_executable(bench_mxfp8_w8a8 ${TANDEM_BACKEND_CUDA_ROOT}/bench/cuda/bench_mxfp8_w8a8.cpp)
    target_link_libraries(bench_mxfp8_w8a8 PRIVATE tandem_backend_cuda tandem_model)
    target_compile_options(bench_mxfp8_w8a8 PRIVATE ${TANDEM_WARNINGS})
  endif()
endif()

# Paged attention kernels beside the simple one and their bounds (bench/cuda/bench_attention.cpp).
if(TANDEM_HAS_CUDA AND TANDEM_BACKEND_CUDA_BENCH)
  add_executable(bench_attention ${TANDEM_BACKEND_CUDA_ROOT}/bench/cuda/bench_attention.cpp)
  target_link_libraries(bench_attention PRIVATE tandem_backend_cuda)
  target_compile_options(bench_attention PRIVATE ${TANDEM_WARNINGS})
endif()

# Optional FlashInfer comparison (never part of the default build): headers of a
# flashinfer-python wheel; with CUDA 13.0 also a newer CCCL include (cuda::fast_mod_div).
set(TANDEM_FLASHINFER_INCLUDE "" CACHE PATH "flashinfer/data/include of a flashinfer-python wheel")
set(TANDEM_FLASHINFER_CCCL "" CACHE PATH "CCCL include newer than CUDA 13.0's, for FlashInfer")
if(TANDEM_HAS_CUDA AND TANDEM_FLASHINFER_INCLUDE)
  add_executable(bench_attention_flashinfer
                 ${TANDEM_BACKEND_CUDA_ROOT}/bench/cuda/bench_attention_flashinfer.cu)
  if(TANDEM_FLASHINFER_CCCL)
    target_include_directories(bench_attention_flashinfer BEFORE PRIVATE ${TANDEM_FLASHINFER_CCCL})
  endif()
  target_include_directories(bench_attention_flashinfer PRIVATE ${TANDEM_FLASHINFER_INCLUDE})
  target_link_libraries(bench_attention_flashinfer PRIVATE tandem_backend_cuda)
  set_target_properties(bench_attention_flashinfer PROPERTIES CUDA_ARCHITECTURES 90a)
endif()
