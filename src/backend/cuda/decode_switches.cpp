// See decode_switches.h.
#include "backend/cuda/decode_switches.h"

namespace tandem::cuda {

DecodeSwitches& decode_switches() {
  static DecodeSwitches s;
  return s;
}

}  // namespace tandem::cuda
