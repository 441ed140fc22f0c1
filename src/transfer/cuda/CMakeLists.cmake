#The device KV transfer backend(CUDA IPC within a host), its test and benchmark.Included
#from the top - level CMakeLists.txt(CUDA only).
#tandem_transfer_cuda make_cuda_ipc_backend(), the kv_copy kernel
#test_transfer_cuda kv_copy vs its CPU reference; sender->receiver across two
#processes on one GPU(skips without a GPU)
#bench_kv_transfer a 6000 - token Qwen3 - 235B - shaped KV : GB / s beside cudaMemcpy D2D
if (TANDEM_HAS_CUDA)
  file(GLOB TANDEM_TRANSFER_CUDA_SRCS CONFIGURE_DEPENDS
    ${CMAKE_SOURCE_DIR}/src/transfer/cuda/*.cpp ${CMAKE_SOURCE_DIR}/src/transfer/cuda/*.cu)
  add_library(tandem_transfer_cuda STATIC ${TANDEM_TRANSFER_CUDA_SRCS})
  target_include_directories(tandem_transfer_cuda PUBLIC ${CMAKE_SOURCE_DIR}/src)
  target_link_libraries(tandem_transfer_cuda PUBLIC tandem_transfer CUDA::cudart)
  target_compile_options(tandem_transfer_cuda PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${TANDEM_WARNINGS}>)
  if(NOT CMAKE_CUDA_ARCHITECTURES)
    set_target_properties(tandem_transfer_cuda PROPERTIES CUDA_ARCHITECTURES 90a)
  endif()
  target_link_libraries(tandem_server PUBLIC tandem_transfer_cuda)

  if(TANDEM_TESTS AND TARGET GTest::gtest)
    add_executable(test_transfer_cuda ${CMAKE_SOURCE_DIR}/tests/transfer/cuda/test_cuda_transfer.cpp)
    target_link_libraries(test_transfer_cuda PRIVATE tandem_transfer_cuda tandem_comm_base
                                                     GTest::gtest GTest::gtest_main)
    target_include_directories(test_transfer_cuda PRIVATE ${CMAKE_SOURCE_DIR}/tests)
    target_compile_options(test_transfer_cuda PRIVATE ${TANDEM_WARNINGS})
    gtest_discover_tests(test_transfer_cuda DISCOVERY_TIMEOUT 60)
  endif()
  if(TANDEM_BENCH)
    add_executable(bench_kv_transfer ${CMAKE_SOURCE_DIR}/bench/transfer/bench_kv_transfer.cu)
    set_target_properties(bench_kv_transfer PROPERTIES CUDA_ARCHITECTURES 90a)
    target_link_libraries(bench_kv_transfer PRIVATE tandem_transfer_cuda)
    target_compile_options(bench_kv_transfer PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${TANDEM_WARNINGS}>)
  endif()
endif()
