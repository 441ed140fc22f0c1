// The tokenizer over arbitrary bytes (the demo model's Qwen-style byte-level BPE and its
// special tokens): encode with and without special-token parsing, decode and the incremental
// detokenizer over arbitrary ids, token lookups. Valid UTF-8 (special-token text included, as
// plain text) decodes back to itself as NFC leaves it (the demo tokenizer's normalizer).
#include <utf8proc.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "fuzz_input.h"
#include "server/tokenizer/detokenizer.h"
#include "server/tokenizer/tokenizer.h"

using namespace tandem;

namespace {
const Tokenizer& tokenizer() {
  static const std::unique_ptr<Tokenizer> tok =
      Tokenizer::from_dir(std::string(TANDEM_SOURCE_DIR) + "/models/demo");
  return *tok;
}

std::string nfc(const std::string& s) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(
      reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
      &out, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) return s;
  std::string r(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return r;
}

bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t k = 1; k < n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d >> 6) != 2) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += n;
  }
  return true;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Tokenizer& tok = tokenizer();
  fuzz::Input in(data, size);
  const uint8_t which = in.byte();
  try {
    if (which % 3 == 0) {
      const std::string text(in.rest());
      const auto ids = tok.encode(text, /*parse_special=*/false);
      const std::string back = tok.decode(ids);
      // The BPE must give back the text as its normalizer (NFC) leaves it.
      if (valid_utf8(text) && back != nfc(text)) std::abort();
      tok.encode(text, /*parse_special=*/true);
      tok.token_to_id(text);
    } else {
      std::vector<int32_t> ids;
      while (in.left() >= 2) {
        ids.push_back(which % 3 == 1 ? in.take<int32_t>() : in.take<uint16_t>() % 8200);
      }
      tok.decode(ids, /*skip_special=*/which & 8);
      IncrementalDetokenizer detok(tok, /*skip_special_tokens=*/which & 16);
      std::string streamed;
      for (int32_t id : ids) streamed += detok.add(id);
      streamed += detok.flush();
      for (int32_t id : ids) {
        tok.id_to_token(id);
        tok.token_bytes(id);
        tok.is_special(id);
      }
    }
  } catch (const Error&) {
  }
  return 0;
}
