// Internal: one CUTLASS sm90 blockwise-scaled FP8 grouped GEMM instantiation behind
// MoeGemmW8A8 (moe_gemm_w8a8.h), templated on its tile and schedules; included by exactly one
// .cu per instantiation.
//
// Operands (CUTLASS terms): A = the activations x [M_g, K] row-major (K-major), B = the expert's
// weights [N, K] (K-major, CUTLASS "column-major B"), D = y [M_g, N] row-major bf16, no C.
// Scales: SFA granularity 1 x 128 (per token, 128 columns), SFB 1 x 128 (per weight row, 128
// columns: fp8_linear.h's row scales), both K-major, so the activation scales are plain
// [rows, K / 128] row-major (any group's block starts at its first row) and the weight scales
// [N, K / 128] per expert (a checkpoint's 128 x 128 blocks repeated per row, or MXFP8's
// power-of-two scales, mxfp8_w8a8.h).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "backend/cuda/check.h"
#include "backend/cuda/cutlass/w8a8_runner.h"
#include "core/error.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/util/packed_stride.hpp"

namespace tandem::cuda::w8a8_detail {

template <class TileShape_, class KernelSchedule, class EpilogueSchedule>
struct Sm90Config {
  using TileShape = TileShape_;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128, cute::GMMA::Major::K,
                                                                cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, 8, ElementD,
      LayoutD*, 8, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<LayoutA*, LayoutSFA*>, 16, ElementB, cute::tuple<LayoutB*, LayoutSFB*>, 16, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

// The per-group argument arrays, in one device allocation.
template <class Cfg>
struct GroupArrays {
  typename Cfg::Shape3* shapes;
  typename Cfg::ElementA const** a;
  typename Cfg::ElementB const** b;
  typename Cfg::ElementD** d;
  float const** sfa;
  float const** sfb;
  typename Cfg::StrideA* stride_a;
  typename Cfg::StrideB* stride_b;
  typename Cfg::StrideD* stride_d;
  typename Cfg::LayoutSFA* layout_sfa;
  typename Cfg::LayoutSFB* layout_sfb;
};

// One block; thread g fills group g from the device offsets (null: one dense group).
template <class Cfg>
__global__ void w8a8_setup_kernel(GroupArrays<Cfg> arr, uint8_t const* x, float const* x_scale,
                                  uint8_t const* w, float const* w_scale, __nv_bfloat16* y,
                                  int32_t const* offsets, int64_t max_rows, int n, int k,
                                  int groups) {
  const int kb = k / 128;
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    int64_t r0 = 0, r1 = max_rows;
    if (offsets != nullptr) {
      r0 = min(static_cast<int64_t>(offsets[g]), max_rows);
      r1 = min(static_cast<int64_t>(offsets[g + 1]), max_rows);
      if (r1 < r0) r1 = r0;
    }
    const int m = static_cast<int>(r1 - r0);
    arr.shapes[g] = typename Cfg::Shape3(m, n, k);
    arr.a[g] = reinterpret_cast<typename Cfg::ElementA const*>(x + r0 * k);
    arr.b[g] = reinterpret_cast<typename Cfg::ElementB const*>(w + static_cast<int64_t>(g) * n * k);
    arr.d[g] = reinterpret_cast<typename Cfg::ElementD*>(y + r0 * n);
    arr.sfa[g] = x_scale + r0 * kb;
    arr.sfb[g] = w_scale + static_cast<int64_t>(g) * n * kb;
    arr.stride_a[g] = cutlass::make_cute_packed_stride(typename Cfg::StrideA{}, {m, k, 1});
    arr.stride_b[g] = cutlass::make_cute_packed_stride(typename Cfg::StrideB{}, {n, k, 1});
    arr.stride_d[g] = cutlass::make_cute_packed_stride(typename Cfg::StrideD{}, {m, n, 1});
    arr.layout_sfa[g] = Cfg::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
    arr.layout_sfb[g] = Cfg::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
  }
}

inline size_t align_up(size_t v) { return (v + 255) / 256 * 256; }

template <class Cfg>
class Sm90Runner final : public Runner {
 public:
  ~Sm90Runner() override {
    if (buf_ != nullptr) (void)cudaFree(buf_);
    if (workspace_ != nullptr) (void)cudaFree(workspace_);
  }

  void prepare(int64_t groups) override {
    if (groups == groups_) return;
    TANDEM_CHECK_KIND(kInvalidArgument, groups >= 1 && groups <= (1 << 20),
                      "moe_gemm_w8a8: num_experts (", groups, ") out of range");
    if (buf_ != nullptr) TANDEM_CUDA_CHECK(cudaFree(buf_));
    if (workspace_ != nullptr) TANDEM_CUDA_CHECK(cudaFree(workspace_));
    buf_ = nullptr;
    workspace_ = nullptr;
    groups_ = 0;
    const size_t g = static_cast<size_t>(groups);
    size_t off = 0;
    size_t sizes[11] = {sizeof(typename Cfg::Shape3),
                        sizeof(void*),
                        sizeof(void*),
                        sizeof(void*),
                        sizeof(void*),
                        sizeof(void*),
                        sizeof(typename Cfg::StrideA),
                        sizeof(typename Cfg::StrideB),
                        sizeof(typename Cfg::StrideD),
                        sizeof(typename Cfg::LayoutSFA),
                        sizeof(typename Cfg::LayoutSFB)};
    size_t offs[11];
    for (int i = 0; i < 11; ++i) {
      offs[i] = off;
      off = align_up(off + sizes[i] * g);
    }
    TANDEM_CUDA_CHECK(cudaMalloc(&buf_, off));
    auto* base = static_cast<char*>(buf_);
    arr_.shapes = reinterpret_cast<typename Cfg::Shape3*>(base + offs[0]);
    arr_.a = reinterpret_cast<typename Cfg::ElementA const**>(base + offs[1]);
    arr_.b = reinterpret_cast<typename Cfg::ElementB const**>(base + offs[2]);
    arr_.d = reinterpret_cast<typename Cfg::ElementD**>(base + offs[3]);
    arr_.sfa = reinterpret_cast<float const**>(base + offs[4]);
    arr_.sfb = reinterpret_cast<float const**>(base + offs[5]);
    arr_.stride_a = reinterpret_cast<typename Cfg::StrideA*>(base + offs[6]);
    arr_.stride_b = reinterpret_cast<typename Cfg::StrideB*>(base + offs[7]);
    arr_.stride_d = reinterpret_cast<typename Cfg::StrideD*>(base + offs[8]);
    arr_.layout_sfa = reinterpret_cast<typename Cfg::LayoutSFA*>(base + offs[9]);
    arr_.layout_sfb = reinterpret_cast<typename Cfg::LayoutSFB*>(base + offs[10]);
    // The arrays are only read once a run's setup kernel has filled them; zero them so a
    // stray read sees empty groups.
    TANDEM_CUDA_CHECK(cudaMemset(buf_, 0, off));

    int device = 0;
    TANDEM_CUDA_CHECK(cudaGetDevice(&device));
    cutlass::KernelHardwareInfo hw =
        cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename Cfg::GemmKernel>(device);
    args_ = typename Cfg::Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                          {static_cast<int>(groups), arr_.shapes, nullptr},
                                          {arr_.a, arr_.stride_a, arr_.b, arr_.stride_b, arr_.sfa,
                                           arr_.layout_sfa, arr_.sfb, arr_.layout_sfb},
                                          {{}, nullptr, nullptr, arr_.d, arr_.stride_d},
                                          hw};
    auto& fusion = args_.epilogue.thread;
    fusion.alpha = 1.0f;
    fusion.beta = 0.0f;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = nullptr;
    fusion.beta_ptr_array = nullptr;
    fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
    fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
    const cutlass::Status can = gemm_.can_implement(args_);
    TANDEM_CHECK_KIND(kUnsupported, can == cutlass::Status::kSuccess,
                      "moe_gemm_w8a8: CUTLASS cannot implement the grouped GEMM (",
                      cutlass::cutlassGetStatusString(can), ")");
    const size_t ws = Cfg::Gemm::get_workspace_size(args_);
    if (ws > 0) TANDEM_CUDA_CHECK(cudaMalloc(&workspace_, ws));
    const cutlass::Status init = gemm_.initialize(args_, workspace_, nullptr);
    TANDEM_CHECK_KIND(kUnsupported, init == cutlass::Status::kSuccess,
                      "moe_gemm_w8a8: CUTLASS initialize failed (",
                      cutlass::cutlassGetStatusString(init), ")");
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
    groups_ = groups;
  }

  void run(MoeGemmW8A8Params const& p, cudaStream_t stream) override {
    prepare(p.num_experts);
    const int threads = static_cast<int>(std::min<int64_t>(1024, (p.num_experts + 31) / 32 * 32));
    w8a8_setup_kernel<Cfg><<<1, threads, 0, stream>>>(
        arr_, p.x, p.x_scale, p.w, p.w_scale, p.y, p.expert_offsets, p.max_rows,
        static_cast<int>(p.n), static_cast<int>(p.k), static_cast<int>(p.num_experts));
    TANDEM_CUDA_CHECK(cudaGetLastError());
    const cutlass::Status st = gemm_.run(stream);
    TANDEM_CHECK_KIND(kInternal, st == cutlass::Status::kSuccess, "moe_gemm_w8a8: launch failed (",
                      cutlass::cutlassGetStatusString(st), ")");
    TANDEM_CUDA_CHECK(cudaGetLastError());
  }

 private:
  typename Cfg::Gemm gemm_;
  typename Cfg::Gemm::Arguments args_{};
  GroupArrays<Cfg> arr_{};
  void* buf_ = nullptr;
  void* workspace_ = nullptr;
  int64_t groups_ = 0;
};

}  // namespace tandem::cuda::w8a8_detail
