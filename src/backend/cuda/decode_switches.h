// Process-wide switches for the batch-1 / small-batch decode kernels of issue 15 item 1, so that
// a benchmark (profile_decode_cuda --variants) or a test can time or check the step with and
// without each change in one process (a new KV cache makes the model capture its graphs again).
// Read when a launch is enqueued (a captured graph keeps what it was captured with). Defaults:
// the members' initialisers, the faster ones on the H200 (docs/perf.md): the PDL changes with
// the MoE GEMVs for one-token steps; the MoE GEMVs are slower at 8 tokens than the grouped
// GEMMs, hence moe_gemv_max_tokens = 1. (The router's top-k inside the one-token expert kernels
// measured no faster and was removed.)
#pragma once

namespace tandem::cuda {

struct DecodeSwitches {
  /// MoE decode path (<= 8 tokens, bf16 experts): moe_decode.h's two GEMV kernels instead of
  /// the grouped GEMMs + unpermute.
  bool moe_gemv = true;
  /// GemmLt's small-m gemv (gemv.h) as a programmatic dependent launch that streams its first
  /// weight rows before waiting for the previous kernel.
  bool gemv_pdl = true;
  /// The decode MoE router kernel as a programmatic dependent launch (weights loaded before
  /// it waits for the norm that produces its input).
  bool router_pdl = true;
  /// The RMSNorm, qkv-prep and decode-attention (+ split merge) kernels let the next kernel
  /// launch right after their own griddepcontrol.wait (common.cuh pdl_trigger), so that a PDL
  /// linear after them streams its weights while they run.
  bool pdl_trigger = true;
  /// Largest batch (tokens) the moe_gemv kernels take (when moe_gemv is on).
  int moe_gemv_max_tokens = 1;

  /// Every switch off (the kernels before issue 15 item 1).
  static DecodeSwitches all_off() { return {false, false, false, false, 0}; }
  /// Every switch on (moe_gemv up to 8 tokens).
  static DecodeSwitches all_on() { return {true, true, true, true, 8}; }
};

/// The process's switches (not synchronised: set them between steps, from one thread).
DecodeSwitches& decode_switches();

}  // namespace tandem::cuda
