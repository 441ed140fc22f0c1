// MoeGemmW8A8's prefill tile: 128 x 128 x 128, two consumer warpgroups on one tile
// (cooperative), persistent (w8a8_sm90.cuh).
#include "backend/cuda/cutlass/w8a8_sm90.cuh"

namespace tandem::cuda::w8a8_detail {

std::unique_ptr<Runner> make_prefill_runner() {
  using Cfg =
      Sm90Config<cute::Shape<cute::_128, cute::_128, cute::_128>,
                 cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum,
                 cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  return std::make_unique<Sm90Runner<Cfg>>();
}

}  // namespace tandem::cuda::w8a8_detail
