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
    if (env != nullptr && std::strcmp(env, "topk") == 0) d.moe_topk = true;  // defaults + moe_topk
    return d;
  }();
  return s;
}

}  // namespace tandem::cuda
