// Loading model files: config.json (model/config.h) from arbitrary text, and a safetensors
// file (model/safetensors.h) from arbitrary bytes; every tensor a file declares is read at both
// ends, so a range outside the mapping shows as a crash.
#include <unistd.h>

#include <cstdio>
#include <string>

#include "core/error.h"
#include "fuzz_input.h"
#include "model/config.h"
#include "model/safetensors.h"

using namespace tandem;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  const uint8_t which = in.byte();
  try {
    if (which % 2 == 0) {
      ModelConfig::from_json(std::string(in.rest()), "fuzz/config.json");
    } else {
      static const std::string path =
          "/tmp/tandem_fuzz_" + std::to_string(::getpid()) + ".safetensors";
      const auto bytes = in.rest();
      FILE* f = std::fopen(path.c_str(), "wb");
      if (f == nullptr) return 0;
      std::fwrite(bytes.data(), 1, bytes.size(), f);
      std::fclose(f);
      SafetensorsFile file(path);
      volatile uint8_t sink = 0;
      for (const auto& name : file.names()) {
        const TensorView t = file.get(name);
        const size_t n = t.nbytes();
        if (n > 0) {
          const auto* p = static_cast<const uint8_t*>(t.data);
          sink = sink + p[0] + p[n - 1];
        }
      }
      (void)sink;
    }
  } catch (const Error&) {
  }
  return 0;
}
