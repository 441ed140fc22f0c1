// See decode_switches.h.
#include "backend/cuda/decode_switches.h"

#include <cstdlib>
#include <cstring>

namespace tandem::cuda {

DecodeSwitches& decode_switches() {
  static DecodeSwitches s = [] {
    DecodeSwitches d;
    const char* env = std::getenv("TANDEM_DECODE_KERNELS");
    if (env != nullptr && std::strcmp(env, "base") == 0) d = DecodeSwitches::all_off();
    if (env != nullptr && std::strcmp(env, "all") == 0) d = DecodeSwitches::all_on();
    // The defaults with moe_topk (gate_up mode N for topkN).
    if (env != nullptr && std::strncmp(env, "topk", 4) == 0) {
      d.moe_topk = true;
      if (env[4] >= '0' && env[4] <= '3' && env[5] == '\0') d.moe_topk_gate_up = env[4] - '0';
    }
    return d;
  }();
  return s;
}

}  // namespace tandem::cuda
