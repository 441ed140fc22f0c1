// Kernel records through CUPTI's activity API (nsys is not on the GPU image), shared by the
// per-kernel profiles: profile_decode_cuda (a Qwen3MoeCuda decode step's graph) and
// bench_qwen35_cuda --profile-prefill (one eager Qwen35MoeCuda prefill). Header-only; the
// binary links CUDA::cupti.
//   cupti::Recorder rec;          // registers the buffer callbacks (once per process)
//   rec.start();  ... work ...  std::vector<cupti::KernelRec> r = rec.stop();  // sorted by start
#pragma once

#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/check.h"
#include "core/error.h"

#define CUPTI_CHECK(call)                                                                 \
  do {                                                                                    \
    CUptiResult r_ = (call);                                                              \
    if (r_ != CUPTI_SUCCESS) {                                                            \
      const char* s_ = nullptr;                                                           \
      cuptiGetResultString(r_, &s_);                                                      \
      TANDEM_CHECK(false, "CUPTI: ", #call, " failed: ", s_ != nullptr ? s_ : "unknown"); \
    }                                                                                     \
  } while (0)

namespace tandem::cupti {

/// One kernel (or "[memset]" / "[memcpy]") on the device timeline: ns timestamps.
struct KernelRec {
  std::string name;  // demangled
  uint64_t start, end;
  int grid, block;
};

/// Records of the activity buffers completed so far (filled by CUPTI's callback thread at
/// flush time; read after Recorder::stop()).
inline std::vector<KernelRec> g_recs;

inline void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t{8} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

inline std::string demangle(const char* n) {
  if (n == nullptr) return "?";
  int st = 0;
  char* d = abi::__cxa_demangle(n, nullptr, nullptr, &st);
  std::string s = (st == 0 && d != nullptr) ? d : n;
  std::free(d);
  return s;
}

inline void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL ||
        rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(rec);
      g_recs.push_back({demangle(k->name), k->start, k->end, k->gridX * k->gridY * k->gridZ,
                        k->blockX * k->blockY * k->blockZ});
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(rec);
      g_recs.push_back({"[memset]", m->start, m->end, 0, 0});
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(rec);
      g_recs.push_back({"[memcpy]", m->start, m->end, 0, 0});
    }
  }
  std::free(buffer);
}

/// Registers the callbacks once per process.
inline void register_callbacks() {
  static const bool done = [] {
    CUPTI_CHECK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
    return true;
  }();
  (void)done;
}

/// Kernels, memsets and memcpys between start() and stop().
class Recorder {
 public:
  Recorder() { register_callbacks(); }
  void start() {
    g_recs.clear();
    CUPTI_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
    CUPTI_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET));
    CUPTI_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY));
  }
  /// Waits for the device, flushes; the records sorted by start time.
  std::vector<KernelRec> stop() {
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
    CUPTI_CHECK(cuptiActivityFlushAll(1));
    CUPTI_CHECK(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
    CUPTI_CHECK(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMSET));
    CUPTI_CHECK(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMCPY));
    std::vector<KernelRec> r = std::move(g_recs);
    g_recs.clear();
    std::sort(r.begin(), r.end(),
              [](const KernelRec& a, const KernelRec& z) { return a.start < z.start; });
    return r;
  }
};

/// Short kernel name: the function name without namespaces, template arguments or parameters
/// (at most 48 characters).
inline std::string short_name(const std::string& full) {
  std::string s = full;
  const std::string anon = "(anonymous namespace)::";
  for (size_t at; (at = s.find(anon)) != std::string::npos;) s.erase(at, anon.size());
  // Drop template arguments (outermost <...>) and the parameter list.
  std::string out;
  int depth = 0;
  for (char ch : s) {
    if (ch == '<') ++depth;
    if (depth == 0 && ch == '(') break;
    if (depth == 0) out += ch;
    if (ch == '>') --depth;
  }
  const size_t sp = out.rfind(' ');
  if (sp != std::string::npos) out = out.substr(sp + 1);
  const size_t ns = out.rfind("::");
  if (ns != std::string::npos) out = out.substr(ns + 2);
  if (out.empty()) out = full.empty() ? "(no name)" : full;
  if (out.size() > 48) out = out.substr(0, 48);
  return out;
}

/// Busy time (the union of the records' intervals) and the idle gaps between them shorter than
/// max_gap_us (longer ones are taken as a pause between steps), both in us.
inline std::pair<double, double> busy_idle_us(const std::vector<KernelRec>& r, double max_gap_us) {
  double busy = 0, idle = 0;
  uint64_t cur_s = 0, cur_e = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    if (i == 0 || r[i].start > cur_e) {
      if (i > 0) {
        busy += 1e-3 * static_cast<double>(cur_e - cur_s);
        const double gap = 1e-3 * static_cast<double>(r[i].start - cur_e);
        if (gap < max_gap_us) idle += gap;
      }
      cur_s = r[i].start;
      cur_e = r[i].end;
    } else {
      cur_e = std::max(cur_e, r[i].end);
    }
  }
  if (!r.empty()) busy += 1e-3 * static_cast<double>(cur_e - cur_s);
  return {busy, idle};
}

}  // namespace tandem::cupti
