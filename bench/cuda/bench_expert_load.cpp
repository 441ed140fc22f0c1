// The host side of loading a block-FP8 checkpoint's MoE experts onto the GPU (no GPU needed):
// for each MoE layer (experts stored one tensor per expert), the experts' codes and scales read,
// expanded and packed as the kernels expect
//   ours      prepare_fp8_experts (model/cuda/mxfp8_weights.h): the layer's range on the CPU pool
//   baseline  the same call one expert at a time (count 1): the loaders' path before (the same
//             reads and packing, expert by expert)
// and the checkpoint bytes each consumed per second, with the ratio. The upload itself (pinned
// staging, H2D copies) is not included.
//   bench_expert_load --checkpoint DIR [--layers N]   (e.g. make_random_checkpoint --format fp8)
// (bf16 experts keep the expert-by-expert path: grouping them measured 0.60x here, their
// bytes need no conversion and the fresh group buffers cost more than they save.)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "core/thread_pool.h"
#include "model/config.h"
#include "model/cuda/mxfp8_weights.h"
#include "model/quant.h"
#include "model/safetensors.h"

namespace tandem {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int run(int argc, char** argv) {
  std::string dir;
  int64_t layers = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i];
    if (f == "--checkpoint")
      dir = argv[i + 1];
    else if (f == "--layers")
      layers = std::atoll(argv[i + 1]);
  }
  TANDEM_CHECK_KIND(kInvalidArgument, !dir.empty(),
                    "usage: bench_expert_load --checkpoint DIR "
                    "[--layers N]");
  const ModelConfig c = ModelConfig::from_dir(dir);
  const Checkpoint ck(dir);
  const WeightReader wr(ck, c.quant, dir + "/config.json");
  const int64_t inter = c.moe_intermediate_size, h = c.hidden_size, E = c.num_experts;
  TANDEM_CHECK_KIND(kInvalidArgument, c.quant.method == WeightQuant::kFp8Block, dir,
                    ": a block-FP8 checkpoint is needed (make_random_checkpoint --format fp8)");
  layers = std::min(layers, c.num_hidden_layers);
  std::printf("%s: %lld experts of %lld x %lld, block FP8, %lld layers, %d threads\n", dir.c_str(),
              static_cast<long long>(E), static_cast<long long>(inter), static_cast<long long>(h),
              static_cast<long long>(layers), ThreadPool::global().size());
  const double layer_bytes = double(E) * 3 * double(inter) * double(h);  // the codes read
  double ours = 0, base = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const std::string prefix = c.weight_prefix + "layers." + std::to_string(l) + ".mlp.experts.";
    if (!ck.has(prefix + "0.gate_proj.weight")) continue;
    cuda_model::Fp8ExpertsHost f8;
    // Baseline first (the pages then warm for both; run the layer twice to compare warm).
    for (int rep = 0; rep < 2; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      for (int64_t e = 0; e < E; ++e)
        cuda_model::prepare_fp8_experts(wr, prefix, e, 1, inter, h, f8);
      if (rep == 1) base += seconds_since(t0);
      t0 = std::chrono::steady_clock::now();
      cuda_model::prepare_fp8_experts(wr, prefix, 0, E, inter, h, f8);
      if (rep == 1) ours += seconds_since(t0);
    }
  }
  const double bytes = layer_bytes * double(layers);
  std::printf(
      "| case | GB/s | baseline (expert by expert) GB/s | ratio |\n| --- | --- | --- | --- |\n");
  std::printf("| FP8 experts, host preparation | %.2f | %.2f | %.2f |\n", bytes / ours / 1e9,
              bytes / base / 1e9, base / ours);
  return 0;
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) {
  try {
    return tandem::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_expert_load: %s\n", e.what());
    return 1;
  }
}
