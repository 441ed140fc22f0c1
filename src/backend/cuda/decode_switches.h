// Process-wide switches for the batch-1 / small-batch decode kernels of issue 15 item 1, so that
// a benchmark can time the step with and without each change in one process (a new KV cache
// makes the model capture its graphs again). Read when a launch is enqueued (a captured graph
// keeps what it was captured with). Defaults: all on; the environment variable
// TANDEM_DECODE_KERNELS=base turns them all off at start-up (the comparison path).
#pragma once

namespace tandem::cuda {

struct DecodeSwitches {
  /// MoE decode path (<= 8 tokens, bf16 experts): moe_decode.h's two GEMV kernels instead of
  /// the grouped GEMMs + unpermute.
  bool moe_gemv = true;
};

/// The process's switches (not synchronised: set them between steps, from one thread).
DecodeSwitches& decode_switches();

}  // namespace tandem::cuda
