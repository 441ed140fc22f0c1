// MoeGemmW8A8's decode tile: 64 x 128 x 128, two consumer warpgroups on alternate tiles
// (ping-pong: one's epilogue under the other's main loop), persistent (w8a8_sm90.cuh).
#include "backend/cuda/cutlass/w8a8_sm90.cuh"

namespace tandem::cuda::w8a8_detail {

std::unique_ptr<Runner> make_decode_runner() {
  using Cfg = Sm90Config<cute::Shape<cute::_64, cute::_128, cute::_128>,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8BlockScaledAccum,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
  return std::make_unique<Sm90Runner<Cfg>>();
}

}  // namespace tandem::cuda::w8a8_detail
