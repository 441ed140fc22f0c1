# Communication layer (src/comm), its tests and benchmark. Included from the top-level
# CMakeLists.txt after the tests block:
#   include(${CMAKE_SOURCE_DIR}/src/comm/CMakeLists.cmake)
# Relies on: tandem_core, TANDEM_WARNINGS, TANDEM_HAS_CUDA (+ CUDAToolkit found, CUDA enabled),
# TANDEM_TESTS (+ GTest found).
#
# Targets:
#   tandem_comm_base   CPU: TCP store bootstrap, local fork launcher (no Gloo: the GPU-side
#                      binaries link only this, libgloo is not on the GPU machines)
#   tandem_comm        CPU: tandem_comm_base + the rest of src/comm/*.cpp (the top level links Gloo)
#   tandem_comm_cuda   CUDA: IPC communicator, one-/two-shot all-reduce, MoE dispatch/combine
#                      kernels (prefill EP, decode DP-EP), NCCL (CUDA only)
#   test_comm          CPU tests (TCP store, launcher, kernels emulated on CPU threads): CI
#   test_comm_emulated only the kernels emulated on CPU threads (no Gloo): CI and GPU machine
#   test_comm_tsan     the emulation under ThreadSanitizer (option TANDEM_COMM_TSAN): CI
#   test_comm_cuda     multi-GPU tests (skip cleanly without 2 GPUs)
#   bench_allreduce    ours vs NCCL (option TANDEM_COMM_BENCH, default ON, CUDA only)
#   bench_moe          MoE dispatch/combine, ours vs NCCL send/recv and all-reduce (same option)

get_filename_component(TANDEM_COMM_ROOT "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)

set(TANDEM_COMM_BASE_SRCS ${TANDEM_COMM_ROOT}/src/comm/tcp_store.cpp
                          ${TANDEM_COMM_ROOT}/src/comm/group_watchdog.cpp
                          ${TANDEM_COMM_ROOT}/src/comm/local_launcher.cpp)
add_library(tandem_comm_base STATIC ${TANDEM_COMM_BASE_SRCS})
target_include_directories(tandem_comm_base PUBLIC ${TANDEM_COMM_ROOT}/src)
target_compile_options(tandem_comm_base PRIVATE ${TANDEM_WARNINGS})
target_link_libraries(tandem_comm_base PUBLIC tandem_core tandem_net Threads::Threads)

file(GLOB TANDEM_COMM_SRCS CONFIGURE_DEPENDS ${TANDEM_COMM_ROOT}/src/comm/*.cpp)
list(REMOVE_ITEM TANDEM_COMM_SRCS ${TANDEM_COMM_BASE_SRCS})
add_library(tandem_comm STATIC ${TANDEM_COMM_SRCS})
target_include_directories(tandem_comm PUBLIC ${TANDEM_COMM_ROOT}/src)
target_compile_options(tandem_comm PRIVATE ${TANDEM_WARNINGS})
target_link_libraries(tandem_comm PUBLIC tandem_comm_base tandem_core Threads::Threads)

if(TANDEM_HAS_CUDA)
  # NOTE: CMake 3.25 knows nvcc's dialect flags only up to C++17, so CMAKE_CUDA_STANDARD 20
  # fails at generate time ("requires the language dialect CUDA20"); nvcc 12+ takes -std=c++20.
  if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()

  # NCCL ships with the CUDA toolkit here; a system install works too.
  find_path(TANDEM_NCCL_INCLUDE_DIR nccl.h
    HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/include /usr/local/include)
  find_library(TANDEM_NCCL_LIBRARY NAMES nccl
    HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib ${CUDAToolkit_LIBRARY_ROOT}/lib64
          /usr/lib/x86_64-linux-gnu /usr/local/lib)
  if(NOT TANDEM_NCCL_INCLUDE_DIR OR NOT TANDEM_NCCL_LIBRARY)
    message(FATAL_ERROR "NCCL not found (nccl.h / libnccl): set TANDEM_NCCL_INCLUDE_DIR and "
                        "TANDEM_NCCL_LIBRARY")
  endif()
  message(STATUS "Tandem NCCL: ${TANDEM_NCCL_LIBRARY}")

  file(GLOB TANDEM_COMM_CUDA_SRCS CONFIGURE_DEPENDS
    ${TANDEM_COMM_ROOT}/src/comm/cuda/*.cpp ${TANDEM_COMM_ROOT}/src/comm/cuda/*.cu)
  add_library(tandem_comm_cuda STATIC ${TANDEM_COMM_CUDA_SRCS})
  target_include_directories(tandem_comm_cuda PUBLIC ${TANDEM_COMM_ROOT}/src
                                                     ${TANDEM_NCCL_INCLUDE_DIR})
  target_link_libraries(tandem_comm_cuda PUBLIC tandem_comm_base CUDA::cudart ${TANDEM_NCCL_LIBRARY})
  target_compile_options(tandem_comm_cuda PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:${TANDEM_WARNINGS}>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-unused-parameter -lineinfo>)
  if(NOT CMAKE_CUDA_ARCHITECTURES)
    set_target_properties(tandem_comm_cuda PROPERTIES CUDA_ARCHITECTURES 90a)
  endif()

endif()

if(TANDEM_TESTS AND TARGET GTest::gtest)
  include(GoogleTest)
  file(GLOB TANDEM_COMM_TEST_SRCS CONFIGURE_DEPENDS ${TANDEM_COMM_ROOT}/tests/comm/*.cpp)
  add_executable(test_comm ${TANDEM_COMM_TEST_SRCS})
  target_link_libraries(test_comm PRIVATE tandem_comm GTest::gtest GTest::gtest_main)
  target_compile_options(test_comm PRIVATE ${TANDEM_WARNINGS})
  gtest_discover_tests(test_comm DISCOVERY_TIMEOUT 60)

  # The emulated kernels alone (no Gloo), for the GPU machine's run script and CI.
  file(GLOB TANDEM_COMM_EMU_SRCS CONFIGURE_DEPENDS ${TANDEM_COMM_ROOT}/tests/comm/test_*emulated*.cpp)
  add_executable(test_comm_emulated ${TANDEM_COMM_EMU_SRCS})
  target_link_libraries(test_comm_emulated PRIVATE tandem_core GTest::gtest GTest::gtest_main
                                                   Threads::Threads)
  target_include_directories(test_comm_emulated PRIVATE ${TANDEM_COMM_ROOT}/src)
  target_compile_options(test_comm_emulated PRIVATE ${TANDEM_WARNINGS})

  # The kernels' device code emulated on CPU threads under ThreadSanitizer: finds protocol
  # races (missing barriers, staging reuse) without a GPU. Only the emulation tests and core.
  option(TANDEM_COMM_TSAN "Build test_comm_tsan (all-reduce and MoE emulation under TSAN)" ON)
  if(TANDEM_COMM_TSAN)
    include(CheckCXXSourceCompiles)
    set(CMAKE_REQUIRED_FLAGS -fsanitize=thread)
    set(CMAKE_REQUIRED_LINK_OPTIONS -fsanitize=thread)
    check_cxx_source_compiles("int main() { return 0; }" TANDEM_HAS_TSAN)
    unset(CMAKE_REQUIRED_FLAGS)
    unset(CMAKE_REQUIRED_LINK_OPTIONS)
    if(TANDEM_HAS_TSAN)
      file(GLOB TANDEM_CORE_SRCS_FOR_TSAN CONFIGURE_DEPENDS ${TANDEM_COMM_ROOT}/src/core/*.cpp)
      add_executable(test_comm_tsan ${TANDEM_COMM_EMU_SRCS} ${TANDEM_CORE_SRCS_FOR_TSAN})
      target_include_directories(test_comm_tsan PRIVATE ${TANDEM_COMM_ROOT}/src)
      target_compile_options(test_comm_tsan PRIVATE ${TANDEM_WARNINGS} -fsanitize=thread -O1 -g)
      target_link_options(test_comm_tsan PRIVATE -fsanitize=thread)
      target_link_libraries(test_comm_tsan PRIVATE GTest::gtest GTest::gtest_main Threads::Threads)
      # One ctest entry (no build-time discovery): a kernel whose address layout TSAN cannot
      # handle makes it skip, not fail.
      add_test(NAME test_comm_tsan COMMAND test_comm_tsan)
      set_tests_properties(test_comm_tsan PROPERTIES
        ENVIRONMENT "TSAN_OPTIONS=halt_on_error=1" TIMEOUT 300
        SKIP_REGULAR_EXPRESSION "ThreadSanitizer: unexpected memory mapping")
    endif()
  endif()

  if(TANDEM_HAS_CUDA)
    file(GLOB TANDEM_COMM_CUDA_TEST_SRCS CONFIGURE_DEPENDS
      ${TANDEM_COMM_ROOT}/tests/comm/cuda/*.cpp)
    add_executable(test_comm_cuda ${TANDEM_COMM_CUDA_TEST_SRCS})
    target_link_libraries(test_comm_cuda PRIVATE tandem_comm_cuda GTest::gtest GTest::gtest_main)
    target_compile_options(test_comm_cuda PRIVATE ${TANDEM_WARNINGS})
    # NOTE: NVLink multicast stays off everywhere (it can take the shared GPU host down).
    gtest_discover_tests(test_comm_cuda DISCOVERY_TIMEOUT 60
      PROPERTIES ENVIRONMENT "NCCL_NVLS_ENABLE=0" TIMEOUT 900)
  endif()
endif()

option(TANDEM_COMM_BENCH "Build the communication benchmarks (CUDA only)" ON)
if(TANDEM_HAS_CUDA AND TANDEM_COMM_BENCH)
  add_executable(bench_allreduce ${TANDEM_COMM_ROOT}/bench/comm/bench_allreduce.cpp)
  target_link_libraries(bench_allreduce PRIVATE tandem_comm_cuda)
  target_compile_options(bench_allreduce PRIVATE ${TANDEM_WARNINGS})
  add_executable(bench_moe ${TANDEM_COMM_ROOT}/bench/comm/bench_moe.cpp)
  target_link_libraries(bench_moe PRIVATE tandem_comm_cuda)
  target_include_directories(bench_moe PRIVATE ${TANDEM_COMM_ROOT}/tests/comm/cuda)
  target_compile_options(bench_moe PRIVATE ${TANDEM_WARNINGS})
endif()
