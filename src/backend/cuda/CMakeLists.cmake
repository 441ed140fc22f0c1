# CUDA backend ops (src/backend/cuda), their tests and benchmark. Included from the top-level
# CMakeLists.txt after the tests block (needs tandem_backend, TANDEM_WARNINGS, TANDEM_HAS_CUDA,
# TANDEM_TESTS + GTest):
#   include(${CMAKE_SOURCE_DIR}/src/backend/cuda/CMakeLists.cmake)
#
# Targets (CUDA only; nothing is built without nvcc):
#   tandem_backend_cuda   kernels + cuBLASLt GEMM wrapper (static library)
#   test_backend_cuda     each kernel vs the CPU reference (GTEST_SKIP without a GPU)
#   bench_ops_cuda        per-kernel timings beside the copy-bandwidth / GEMM-rate bound
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
  target_link_libraries(tandem_backend_cuda PUBLIC tandem_backend CUDA::cudart CUDA::cublasLt)
  target_compile_options(tandem_backend_cuda PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:${TANDEM_WARNINGS}>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-unused-parameter -lineinfo>)
  if(NOT CMAKE_CUDA_ARCHITECTURES)
    set_target_properties(tandem_backend_cuda PROPERTIES CUDA_ARCHITECTURES 90a)
  endif()

  if(TANDEM_TESTS AND TARGET GTest::gtest)
    include(GoogleTest)
    file(GLOB TANDEM_BACKEND_CUDA_TEST_SRCS CONFIGURE_DEPENDS
      ${TANDEM_BACKEND_CUDA_ROOT}/tests/backend/cuda/*.cpp)
    add_executable(test_backend_cuda ${TANDEM_BACKEND_CUDA_TEST_SRCS})
    target_link_libraries(test_backend_cuda PRIVATE tandem_backend_cuda GTest::gtest
                                                    GTest::gtest_main)
    target_compile_options(test_backend_cuda PRIVATE ${TANDEM_WARNINGS})
    # Without a GPU every test skips (GTEST_SKIP), so CI stays green.
    gtest_discover_tests(test_backend_cuda DISCOVERY_TIMEOUT 60)
  endif()

  option(TANDEM_BACKEND_CUDA_BENCH "Build bench_ops_cuda (CUDA only)" ON)
  if(TANDEM_BACKEND_CUDA_BENCH)
    add_executable(bench_ops_cuda ${TANDEM_BACKEND_CUDA_ROOT}/bench/cuda/bench_ops_cuda.cpp)
    target_link_libraries(bench_ops_cuda PRIVATE tandem_backend_cuda)
    target_compile_options(bench_ops_cuda PRIVATE ${TANDEM_WARNINGS})
  endif()
endif()
