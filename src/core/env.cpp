// See env.h.
#include "core/env.h"

#include <array>
#include <charconv>
#include <cstdlib>
#include <sstream>

#include "core/error.h"

namespace tandem::env {

namespace {

#define TANDEM_ENV_ISSUE_29 \
  " Under evaluation (issue 29): the FP8 kernels in use are being decided."

// Keep sorted by area; docs/operations.md "Environment variables" mirrors this table.
constexpr std::array kVars = {
    // CPU.
    Var{"TANDEM_NUM_THREADS", Type::kInt, "the hardware threads", "",
        "Threads of the CPU backend's pool (a value <= 0 means the default)."},
    // Multi-GPU ranks (set by a launcher: torchrun, `tandem ... --nprocs N`, Kubernetes).
    Var{"RANK", Type::kInt, "(required in a group; 0 for a lone process)", "",
        "This process's rank in its group."},
    Var{"WORLD_SIZE", Type::kInt, "(required in a group; 1 for a lone process)", "",
        "The number of ranks in the group."},
    Var{"LOCAL_RANK", Type::kInt, "RANK", "", "This rank's index on its host (picks its GPU)."},
    Var{"MASTER_ADDR", Type::kString, "127.0.0.1", "", "Host of rank 0's rendezvous store."},
    Var{"MASTER_PORT", Type::kInt, "29500", "", "Port of rank 0's rendezvous store."},
    Var{"TANDEM_ALLOW_SHARED_GPU", Type::kFlag, "0", "",
        "1: ranks may share one GPU (tests and emulation only; no NCCL between them)."},
    // Custom all-reduce (comm/cuda/cuda_comm.h CudaAllReduceConfig): tuning knobs; every rank
    // must set the same values.
    Var{"TANDEM_AR_MAX_BYTES", Type::kBytes, "64M", "",
        "Largest all-reduce the custom kernels take (the registered buffer's size)."},
    Var{"TANDEM_AR_ONE_SHOT_MAX_BYTES", Type::kBytes, "by world size (16M for 2 ranks .. 128K)", "",
        "Automatic choice: one-shot all-reduce up to this size."},
    Var{"TANDEM_AR_TWO_SHOT_MAX_BYTES", Type::kBytes, "by world size (16M for 2 ranks .. 4M)", "",
        "Automatic choice: two-shot all-reduce up to this size, NCCL above."},
    Var{"TANDEM_AR_MAX_BLOCKS", Type::kInt, "0 (two per multiprocessor)", "",
        "CTAs of the custom all-reduce kernels."},
    Var{"TANDEM_AR_SPIN_TIMEOUT_MS", Type::kInt, "20000", "",
        "How long a custom all-reduce waits for a peer before it reports a hang."},
    // FP8 kernels: which ones run is being decided (issue 29).
    Var{"TANDEM_CUDA_FP8", Type::kChoice, "on", "on|1|off|0|dequant",
        "Block-FP8 checkpoints on the GPU: FP8 weights (on) or dequantized to bf16 at load (off, "
        "dequant)." TANDEM_ENV_ISSUE_29},
    Var{"TANDEM_CUDA_FP8_ACT", Type::kFlag, "1", "",
        "Block-FP8 checkpoints on the GPU: FP8 activations quantized per token and 128 columns "
        "(W8A8 on the FP8 tensor cores, the dynamic activation scheme of Qwen's FP8 checkpoints, "
        "the default) or 0: bf16 activations against dequantized weights "
        "(W8A16)." TANDEM_ENV_ISSUE_29},
    Var{"TANDEM_CUDA_FP8_WGMMA", Type::kFlag, "1", "",
        "0: the W8A8 experts without the wgmma grouped GEMM (the mma "
        "kernels)." TANDEM_ENV_ISSUE_29},
    Var{"TANDEM_CUDA_MXFP8", Type::kChoice, "dequant", "dequant|native|block",
        "MXFP8 checkpoints on the GPU: bf16 at load (dequant), the native MXFP8 kernels, or "
        "requantized to block FP8 (block)." TANDEM_ENV_ISSUE_29},
    Var{"TANDEM_FP8_SPLITK", Type::kFlag, "1", "",
        "The FP8 grouped GEMM's small tile with two warps per warp tile along K (0: "
        "one)." TANDEM_ENV_ISSUE_29},
    // Benchmark client (tandem bench serve).
    Var{"OPENAI_API_KEY", Type::kString, "(none)", "",
        "Bearer token `tandem bench serve` sends (as vLLM's benchmark client)."},
};

Error bad(const Var& v, std::string_view value, std::string_view expected) {
  return Error(ErrorKind::kInvalidArgument, "environment variable " + std::string(v.name) + "='" +
                                                std::string(value) + "': expected " +
                                                std::string(expected));
}

const Var& typed(std::string_view name, Type type) {
  const Var& v = find(name);
  TANDEM_CHECK_KIND(kInternal, v.type == type, "environment variable ", name,
                    " read with the wrong type");
  return v;
}

bool parse_flag(const Var& v, std::string_view s) {
  if (s == "1" || s == "on" || s == "true" || s == "yes") return true;
  if (s == "0" || s == "off" || s == "false" || s == "no") return false;
  throw bad(v, s, "1 or 0 (on / off)");
}

int64_t parse_int(const Var& v, std::string_view s) {
  int64_t out = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  if (ec != std::errc() || p != s.data() + s.size()) throw bad(v, s, "an integer");
  return out;
}

uint64_t parse_bytes(const Var& v, std::string_view s) {
  uint64_t mult = 1;
  std::string_view digits = s;
  if (!digits.empty()) {
    switch (digits.back()) {
      case 'K':
      case 'k': mult = uint64_t{1} << 10; break;
      case 'M':
      case 'm': mult = uint64_t{1} << 20; break;
      case 'G':
      case 'g': mult = uint64_t{1} << 30; break;
      default: break;
    }
    if (mult != 1) digits.remove_suffix(1);
  }
  uint64_t out = 0;
  auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), out);
  if (digits.empty() || ec != std::errc() || p != digits.data() + digits.size()) {
    throw bad(v, s, "a byte count (e.g. 524288, 512K, 16M)");
  }
  return out * mult;
}

std::string parse_choice(const Var& v, std::string_view s) {
  std::string_view rest = v.choices;
  while (!rest.empty()) {
    const size_t bar = rest.find('|');
    if (rest.substr(0, bar) == s) return std::string(s);
    if (bar == std::string_view::npos) break;
    rest.remove_prefix(bar + 1);
  }
  std::string expected = "one of ";
  for (char c : v.choices) expected += c == '|' ? std::string(", ") : std::string(1, c);
  throw bad(v, s, expected);
}

const char* type_name(Type t) {
  switch (t) {
    case Type::kFlag: return "flag";
    case Type::kInt: return "integer";
    case Type::kBytes: return "bytes";
    case Type::kChoice: return "choice";
    case Type::kString: return "text";
  }
  return "?";
}

}  // namespace

std::span<const Var> all() { return kVars; }

const Var& find(std::string_view name) {
  for (const Var& v : kVars) {
    if (v.name == name) return v;
  }
  TANDEM_THROW(kInternal, "environment variable ", name, " is not declared in core/env.cpp");
}

std::optional<std::string> text(std::string_view name) {
  const Var& v = find(name);
  const char* e = std::getenv(std::string(v.name).c_str());
  if (e == nullptr || *e == '\0') return std::nullopt;
  return std::string(e);
}

bool flag(std::string_view name, bool fallback) {
  const Var& v = typed(name, Type::kFlag);
  const std::optional<std::string> s = text(name);
  return s ? parse_flag(v, *s) : fallback;
}

std::optional<int64_t> integer(std::string_view name) {
  const Var& v = typed(name, Type::kInt);
  const std::optional<std::string> s = text(name);
  if (!s) return std::nullopt;
  return parse_int(v, *s);
}

std::optional<uint64_t> bytes(std::string_view name) {
  const Var& v = typed(name, Type::kBytes);
  const std::optional<std::string> s = text(name);
  if (!s) return std::nullopt;
  return parse_bytes(v, *s);
}

std::optional<std::string> choice(std::string_view name) {
  const Var& v = typed(name, Type::kChoice);
  const std::optional<std::string> s = text(name);
  if (!s) return std::nullopt;
  return parse_choice(v, *s);
}

void validate() {
  for (const Var& v : kVars) {
    const std::optional<std::string> s = text(v.name);
    if (!s) continue;
    switch (v.type) {
      case Type::kFlag: (void)parse_flag(v, *s); break;
      case Type::kInt: (void)parse_int(v, *s); break;
      case Type::kBytes: (void)parse_bytes(v, *s); break;
      case Type::kChoice: (void)parse_choice(v, *s); break;
      case Type::kString: break;
    }
  }
}

std::string help() {
  std::ostringstream os;
  os << "Environment variables (core/env.cpp; a value that does not parse is an error):\n";
  for (const Var& v : kVars) {
    os << "\n  " << v.name << "  (" << type_name(v.type);
    if (v.type == Type::kChoice) os << ": " << v.choices;
    os << "; default " << v.default_text << ")\n      " << v.description << "\n";
  }
  return os.str();
}

}  // namespace tandem::env
