// Accuracy of statically quantized checkpoints against their source, on the CPU: the source
// (default: the embedded demo model) is converted (model/convert.h) to block FP8, to MXFP8,
// and to MXFP8 from that block FP8; teacher-forced over the source model's own greedy text
// (from the prompts of its golden.json, or --prompt-ids), every position's top-1 agreement
// with the source and the mean / max KL(P_source || P_quantized) in nats.
// With --text FILE, also every checkpoint's perplexity on that text (tokenized with the
// source's tokenizer, windows of 256 tokens, every token but each window's first predicted).
//   build/bench_quant_accuracy [--model DIR] [--gen N] [--also DIR ...] [--text FILE]
// A source that is itself quantized (a block-FP8 fixture) skips the block-FP8 row.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/convert.h"
#include "model/qwen3_moe.h"
#include "server/tokenizer/tokenizer.h"

#ifndef TANDEM_DEMO_MODEL_DIR
#define TANDEM_DEMO_MODEL_DIR "models/demo"
#endif

using namespace tandem;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kPage = 16;

// Logits [tokens.size(), vocab] of one full forward (teacher forcing).
std::vector<float> all_logits(Model& m, const std::vector<int32_t>& tokens) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t pages = (n + kPage - 1) / kPage;
  KvCache kv(m.kv_geometry(pages, kPage));
  std::vector<int32_t> table(static_cast<size_t>(pages));
  for (int64_t i = 0; i < pages; ++i) table[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  ForwardBatch b;
  ForwardSeq s;
  s.tokens = tokens.data();
  s.num_tokens = n;
  s.start_pos = 0;
  s.block_table = table.data();
  s.num_pages = pages;
  s.logits = LogitsMode::kAll;
  b.seqs.push_back(s);
  std::vector<float> logits;
  m.forward(b, kv, logits);
  return logits;
}

// Greedy continuation of `prompt` by `m`, one token per step over its KV cache.
std::vector<int32_t> greedy_text(Model& m, std::vector<int32_t> tokens, int gen) {
  const int64_t v = m.config().vocab_size;
  const int64_t total = static_cast<int64_t>(tokens.size()) + gen;
  const int64_t pages = (total + kPage - 1) / kPage;
  KvCache kv(m.kv_geometry(pages, kPage));
  std::vector<int32_t> table(static_cast<size_t>(pages));
  for (int64_t i = 0; i < pages; ++i) table[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  tokens.reserve(static_cast<size_t>(total));
  int64_t cached = 0;
  for (int i = 0; i < gen; ++i) {
    ForwardBatch b;
    ForwardSeq s;
    s.tokens = tokens.data() + cached;
    s.num_tokens = static_cast<int64_t>(tokens.size()) - cached;
    s.start_pos = cached;
    s.block_table = table.data();
    s.num_pages = pages;
    s.logits = LogitsMode::kLast;
    b.seqs.push_back(s);
    std::vector<float> lg;
    m.forward(b, kv, lg);
    cached = static_cast<int64_t>(tokens.size());
    tokens.push_back(
        static_cast<int32_t>(std::max_element(lg.begin(), lg.begin() + v) - lg.begin()));
  }
  return tokens;
}

std::vector<double> log_softmax(const float* x, int64_t v) {
  double mx = *std::max_element(x, x + v), sum = 0;
  for (int64_t i = 0; i < v; ++i) sum += std::exp(double(x[i]) - mx);
  const double lse = mx + std::log(sum);
  std::vector<double> out(static_cast<size_t>(v));
  for (int64_t i = 0; i < v; ++i) out[static_cast<size_t>(i)] = double(x[i]) - lse;
  return out;
}

// Sum of -log p(token t | tokens < t) over a window, and the number of tokens predicted.
std::pair<double, int64_t> window_nll(Model& m, const std::vector<int32_t>& w) {
  const int64_t v = m.config().vocab_size;
  std::vector<float> lg = all_logits(m, w);
  double nll = 0;
  for (size_t t = 1; t < w.size(); ++t) {
    std::vector<double> lp = log_softmax(lg.data() + static_cast<int64_t>(t - 1) * v, v);
    nll -= lp[static_cast<size_t>(w[t])];
  }
  return {nll, static_cast<int64_t>(w.size()) - 1};
}

struct Accuracy {
  int64_t positions = 0, agree = 0;
  double kl_sum = 0, kl_max = 0;
};

void compare(const std::vector<float>& ref, const std::vector<float>& q, int64_t v, Accuracy& a) {
  const int64_t n = static_cast<int64_t>(ref.size()) / v;
  for (int64_t p = 0; p < n; ++p) {
    const float* r = ref.data() + p * v;
    const float* x = q.data() + p * v;
    a.agree += (std::max_element(r, r + v) - r) == (std::max_element(x, x + v) - x);
    std::vector<double> lr = log_softmax(r, v), lq = log_softmax(x, v);
    double kl = 0;
    for (int64_t i = 0; i < v; ++i) {
      kl += std::exp(lr[static_cast<size_t>(i)]) *
            (lr[static_cast<size_t>(i)] - lq[static_cast<size_t>(i)]);
    }
    a.kl_sum += kl;
    a.kl_max = std::max(a.kl_max, kl);
    ++a.positions;
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = TANDEM_DEMO_MODEL_DIR;
  int gen = 200;
  std::vector<std::string> also;
  std::string text_file;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model" && i + 1 < argc) {
      model = argv[++i];
    } else if (a == "--gen" && i + 1 < argc) {
      gen = std::atoi(argv[++i]);
    } else if (a == "--text" && i + 1 < argc) {
      text_file = argv[++i];
    } else if (a == "--also" && i + 1 < argc) {
      also.push_back(argv[++i]);
    } else {
      std::cerr
          << "usage: bench_quant_accuracy [--model DIR] [--gen N] [--also DIR ...] [--text FILE]\n";
      return 2;
    }
  }
  try {
    const fs::path tmp =
        fs::temp_directory_path() / ("tandem_quant_acc_" + std::to_string(::getpid()));
    fs::remove_all(tmp);
    const ModelConfig src = ModelConfig::from_dir(model);
    std::vector<std::pair<std::string, std::string>> variants;  // (label, dir)
    auto convert = [&](const std::string& in, WeightQuant f, const std::string& name) {
      ConvertOptions o;
      o.in_dir = in;
      o.out_dir = (tmp / name).string();
      o.format = f;
      ConvertReport r = convert_checkpoint(o);
      std::cout << "# " << name << " (from " << in << ")\n" << format_report(r);
      return o.out_dir;
    };
    const std::string src_label = src.quant.quantized()
                                      ? std::string(weight_quant_name(src.quant.method))
                                      : std::string(dtype_name(src.dtype));
    if (!src.quant.quantized()) {
      const std::string fp8 = convert(model, WeightQuant::kFp8Block, "fp8");
      variants.push_back({"block FP8 (128x128)", fp8});
      variants.push_back({"MXFP8 (1x32)", convert(model, WeightQuant::kMxfp8, "mxfp8")});
      variants.push_back(
          {"MXFP8 from block FP8", convert(fp8, WeightQuant::kMxfp8, "mxfp8_from_fp8")});
    } else {
      variants.push_back({"MXFP8 (1x32)", convert(model, WeightQuant::kMxfp8, "mxfp8")});
    }
    for (const std::string& d : also) variants.push_back({d, d});

    // Prompts: golden.json's, continued greedily by the source model.
    std::vector<std::vector<int32_t>> prompts;
    std::ifstream gin(model + "/golden.json");
    TANDEM_CHECK_KIND(kNotFound, gin.good(), model, "/golden.json: needed for its prompts");
    const nlohmann::json golden = nlohmann::json::parse(gin);
    for (const auto& c : golden.at("cases")) {
      prompts.push_back(c.at("prompt_ids").get<std::vector<int32_t>>());
    }
    auto ref = Qwen3MoeCpu::load(model);
    const int64_t v = ref->config().vocab_size;
    std::vector<std::vector<int32_t>> texts;
    std::vector<std::vector<float>> ref_logits;
    for (const auto& p : prompts) {
      texts.push_back(greedy_text(*ref, p, gen));
      ref_logits.push_back(all_logits(*ref, texts.back()));
    }
    std::printf("\nsource %s (%s), %zu sequences, %d generated tokens each, teacher-forced\n",
                model.c_str(), src_label.c_str(), texts.size(), gen);
    // Held-out text in windows of 256 tokens.
    std::vector<std::vector<int32_t>> windows;
    if (!text_file.empty()) {
      std::ifstream tin(text_file, std::ios::binary);
      TANDEM_CHECK_KIND(kNotFound, tin.good(), text_file, ": cannot open");
      const std::string text((std::istreambuf_iterator<char>(tin)),
                             std::istreambuf_iterator<char>());
      const std::vector<int32_t> ids = Tokenizer::from_dir(model)->encode(text, false);
      for (size_t b = 0; b + 1 < ids.size(); b += 256) {
        windows.emplace_back(ids.begin() + static_cast<int64_t>(b),
                             ids.begin() + static_cast<int64_t>(std::min(ids.size(), b + 256)));
      }
      std::printf("held-out text %s: %zu tokens in %zu windows\n", text_file.c_str(), ids.size(),
                  windows.size());
    }
    auto perplexity = [&](Model& m) {
      double nll = 0;
      int64_t n = 0;
      for (const auto& w : windows) {
        auto [a, b] = window_nll(m, w);
        nll += a;
        n += b;
      }
      return n > 0 ? std::exp(nll / double(n)) : 0.0;
    };
    std::printf("| checkpoint | positions | top-1 agreement | mean KL (nats) | max KL |%s\n",
                windows.empty() ? "" : " perplexity |");
    std::printf("| --- | --- | --- | --- | --- |%s\n", windows.empty() ? "" : " --- |");
    if (!windows.empty()) {
      std::printf("| %s (source) | | 1 | 0 | 0 | %.3f |\n", src_label.c_str(), perplexity(*ref));
    }
    for (const auto& [label, dir] : variants) {
      auto q = Qwen3MoeCpu::load(dir);
      Accuracy a;
      for (size_t i = 0; i < texts.size(); ++i)
        compare(ref_logits[i], all_logits(*q, texts[i]), v, a);
      std::printf("| %s | %lld | %.4f | %.3e | %.3e |", label.c_str(),
                  static_cast<long long>(a.positions), double(a.agree) / double(a.positions),
                  a.kl_sum / double(a.positions), a.kl_max);
      if (!windows.empty()) std::printf(" %.3f |", perplexity(*q));
      std::printf("\n");
    }
    fs::remove_all(tmp);
  } catch (const Error& e) {
    std::cerr << "error: " << e.message() << "\n";
    return 1;
  }
  return 0;
}
