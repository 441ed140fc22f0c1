// MXFP8 on the W8A8 kernels: the error of the two load-time conversions to 128-column weight
// scales (mxfp8_w8a8.h), on the CPU, against the MXFP8 values themselves:
//   row128: mxfp8_to_row128 (per-row power-of-two scale per 128 columns, codes shifted);
//   block:  quantize_fp8_block of the dequantized MXFP8 values (128 x 128, the model's
//           TANDEM_CUDA_MXFP8=block path).
// For every 2-D weight of a checkpoint (bf16/f32, both dims multiples of 128) quantized to MXFP8
// first (model/quant.h quantize_mxfp8, what `tandem convert --format mxfp8` writes), per tensor
// kind (the name's last two components): relative RMS error ||conv - mx|| / ||mx||, the share
// of codes row128 changed, and MXFP8's own error against the source for scale. Then the same on
// Gaussian and heavy-tailed (Student t, 3 dof) synthetic 2048 x 2048 matrices.
//   bench_mxfp8_w8a8 [--model DIR]   (default models/demo)
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/mxfp8_w8a8.h"
#include "core/dtype.h"
#include "model/quant.h"
#include "model/safetensors.h"

using namespace tandem;

namespace {

struct Acc {
  double mx_err2 = 0, src2 = 0, row_err2 = 0, blk_err2 = 0, mx2 = 0;
  int64_t changed = 0, codes = 0, tensors = 0;
  void add(Acc const& o) {
    mx_err2 += o.mx_err2;
    src2 += o.src2;
    row_err2 += o.row_err2;
    blk_err2 += o.blk_err2;
    mx2 += o.mx2;
    changed += o.changed;
    codes += o.codes;
    tensors += o.tensors;
  }
};

Acc measure(std::vector<float> const& w, int64_t n, int64_t k) {
  Acc a;
  a.tensors = 1;
  a.codes = n * k;
  std::vector<uint8_t> q(n * k), e(n * (k / 32)), qr(n * k), qb(n * k);
  quantize_mxfp8(w.data(), n, k, q.data(), e.data());
  std::vector<float> mx(n * k);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < k; ++j)
      mx[r * k + j] =
          f8e4m3_to_f32(q[r * k + j]) * std::ldexp(1.0f, e[r * (k / 32) + j / 32] - 127);
  std::vector<float> rs(n * (k / 128)), bs((n / 128) * (k / 128));
  a.changed = cuda::mxfp8_to_row128(q.data(), e.data(), n, k, qr.data(), rs.data());
  quantize_fp8_block(mx.data(), n, k, qb.data(), bs.data());
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < k; ++j) {
      const size_t i = static_cast<size_t>(r * k + j);
      const double m = mx[i];
      const double vr = f8e4m3_to_f32(qr[i]) * rs[r * (k / 128) + j / 128];
      const double vb = f8e4m3_to_f32(qb[i]) * bs[(r / 128) * (k / 128) + j / 128];
      a.mx_err2 += (m - w[i]) * (m - w[i]);
      a.src2 += double(w[i]) * w[i];
      a.row_err2 += (vr - m) * (vr - m);
      a.blk_err2 += (vb - m) * (vb - m);
      a.mx2 += m * m;
    }
  }
  return a;
}

void print(std::string const& name, Acc const& a) {
  std::printf("%-28s %3lld %10lld | %9.2e | %9.2e %9.2e%% | %9.2e\n", name.c_str(),
              static_cast<long long>(a.tensors), static_cast<long long>(a.codes),
              std::sqrt(a.mx_err2 / std::max(a.src2, 1e-30)),
              std::sqrt(a.row_err2 / std::max(a.mx2, 1e-30)),
              100.0 * static_cast<double>(a.changed) / std::max<int64_t>(a.codes, 1),
              std::sqrt(a.blk_err2 / std::max(a.mx2, 1e-30)));
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "models/demo";
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--model") == 0) dir = argv[i + 1];
  std::printf("%-28s %3s %10s | %9s | %9s %10s | %9s\n", "tensor kind", "n", "codes", "mx vs src",
              "row128", "changed", "block128");
  std::map<std::string, Acc> kinds;
  Acc all;
  try {
    Checkpoint ck(dir);
    for (std::string const& name : ck.names()) {
      TensorView v = ck.get(name);
      if (v.shape.ndim() != 2 || v.shape[0] % 128 != 0 || v.shape[1] % 128 != 0) continue;
      if (v.dtype != DType::kBF16 && v.dtype != DType::kF32) continue;
      const int64_t n = v.shape[0], k = v.shape[1];
      std::vector<float> w(n * k);
      Checkpoint::to_f32(v, w.data());
      const Acc a = measure(w, n, k);
      const size_t dot = name.rfind('.', name.rfind('.') - 1);
      const std::string kind = dot == std::string::npos ? name : name.substr(dot + 1);
      kinds[kind].add(a);
      all.add(a);
    }
  } catch (std::exception const& e) {
    std::printf("(checkpoint %s: %s)\n", dir.c_str(), e.what());
  }
  for (auto const& [kind, a] : kinds) print(kind, a);
  if (all.tensors) print("all of " + dir, all);
  std::mt19937 rng(20261207);
  const int64_t n = 2048, k = 2048;
  std::vector<float> w(n * k);
  std::normal_distribution<float> nd(0.f, 0.02f);
  for (auto& x : w) x = nd(rng);
  print("synthetic normal(0, 0.02)", measure(w, n, k));
  std::student_t_distribution<float> td(3.0f);
  for (auto& x : w) x = 0.01f * td(rng);
  print("synthetic student-t(3)", measure(w, n, k));
  return 0;
}
