#include "server/tokenizer/utf8.h"

namespace tandem::utf8 {

ScanResult scan(std::string_view bytes) {
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  const size_t n = bytes.size();
  const uint8_t b0 = p[0];
  if (b0 < 0x80) return {ScanStatus::kValid, 1};
  size_t need = 0;
  uint8_t lo = 0x80;
  uint8_t hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 == 0xE0) {
    need = 2;
    lo = 0xA0;
  } else if ((b0 >= 0xE1 && b0 <= 0xEC) || b0 == 0xEE || b0 == 0xEF) {
    need = 2;
  } else if (b0 == 0xED) {
    need = 2;
    hi = 0x9F;
  } else if (b0 == 0xF0) {
    need = 3;
    lo = 0x90;
  } else if (b0 >= 0xF1 && b0 <= 0xF3) {
    need = 3;
  } else if (b0 == 0xF4) {
    need = 3;
    hi = 0x8F;
  } else {
    return {ScanStatus::kInvalid, 1};
  }
  for (size_t k = 1; k <= need; ++k) {
    if (k >= n) return {ScanStatus::kIncomplete, k};
    const uint8_t c = p[k];
    const uint8_t klo = k == 1 ? lo : 0x80;
    const uint8_t khi = k == 1 ? hi : 0xBF;
    if (c < klo || c > khi) return {ScanStatus::kInvalid, k};
  }
  return {ScanStatus::kValid, need + 1};
}

bool is_ascii(std::string_view text) {
  for (char c : text) {
    if (static_cast<uint8_t>(c) >= 0x80) return false;
  }
  return true;
}

bool is_valid(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    if (static_cast<uint8_t>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const ScanResult r = scan(text.substr(pos));
    if (r.status != ScanStatus::kValid) return false;
    pos += r.length;
  }
  return true;
}

size_t sanitize_prefix(std::string_view bytes, std::string& out) {
  size_t pos = 0;
  size_t run = 0;  // start of the pending run of valid bytes
  while (pos < bytes.size()) {
    if (static_cast<uint8_t>(bytes[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const ScanResult r = scan(bytes.substr(pos));
    if (r.status == ScanStatus::kValid) {
      pos += r.length;
      continue;
    }
    out.append(bytes.substr(run, pos - run));
    if (r.status == ScanStatus::kIncomplete) return pos;
    out.append(kReplacement);
    pos += r.length;
    run = pos;
  }
  out.append(bytes.substr(run, pos - run));
  return pos;
}

std::string sanitize(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  const size_t used = sanitize_prefix(bytes, out);
  if (used < bytes.size()) out.append(kReplacement);  // a truncated character at the end
  return out;
}

char32_t next(std::string_view text, size_t* pos) {
  const auto* p = reinterpret_cast<const uint8_t*>(text.data()) + *pos;
  const uint8_t b0 = p[0];
  if (b0 < 0x80) {
    *pos += 1;
    return b0;
  }
  if (b0 < 0xE0) {
    *pos += 2;
    return (char32_t(b0 & 0x1F) << 6) | (p[1] & 0x3F);
  }
  if (b0 < 0xF0) {
    *pos += 3;
    return (char32_t(b0 & 0x0F) << 12) | (char32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
  }
  *pos += 4;
  return (char32_t(b0 & 0x07) << 18) | (char32_t(p[1] & 0x3F) << 12) |
         (char32_t(p[2] & 0x3F) << 6) | (p[3] & 0x3F);
}

void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::u32string to_u32(std::string_view text) {
  std::u32string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) out.push_back(next(text, &pos));
  return out;
}

std::string from_u32(std::u32string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char32_t cp : text) append(out, cp);
  return out;
}

size_t length(std::string_view text) {
  size_t n = 0;
  for (char c : text) {
    if ((static_cast<uint8_t>(c) & 0xC0) != 0x80) ++n;
  }
  return n;
}

bool is_python_space(char32_t cp) {
  switch (cp) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x1C:
    case 0x1D:
    case 0x1E:
    case 0x1F:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000: return true;
    default: return cp >= 0x2000 && cp <= 0x200A;
  }
}

bool is_white_space(char32_t cp) {
  switch (cp) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000: return true;
    default: return cp >= 0x2000 && cp <= 0x200A;
  }
}

}  // namespace tandem::utf8
