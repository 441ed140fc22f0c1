// Model's default methods and the host references of speculative decoding (model/model.h).
#include "model/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"

namespace tandem {

void Model::forward_sample(const ForwardBatch&, KvCache&, const std::vector<DeviceSampling>&,
                           std::vector<SampledToken>&, const std::function<void()>&) {
  TANDEM_THROW(kUnsupported, "this model samples on the host only");
}

void Model::load_mtp(const std::string&) {
  TANDEM_THROW(kUnsupported, "model_type '", config().model_type,
               "': MTP speculative decoding is not supported by this model yet");
}

KvGeometry Model::mtp_kv_geometry(int64_t, int64_t) const {
  TANDEM_THROW(kUnsupported, "this model has no MTP layer");
}

KvCache Model::make_mtp_kv_cache(int64_t num_pages, int64_t page_size) {
  KvCache kv(mtp_kv_geometry(num_pages, page_size));
  const KvGeometry& g = kv.geometry();
  for (int64_t l = 0; l < g.num_layers; ++l) {
    std::memset(kv.layer(l), 0, static_cast<size_t>(g.page_elems() * g.num_pages) * sizeof(float));
  }
  return kv;
}

void Model::mtp_forward(const ForwardBatch&, const float*, KvCache&, std::vector<float>&,
                        std::vector<float>&) {
  TANDEM_THROW(kUnsupported, "this model has no MTP layer");
}

void Model::mtp_forward_sample(const ForwardBatch&, const float*, KvCache&,
                               const std::vector<DeviceSampling>&, std::vector<SampledToken>&,
                               std::vector<float>&) {
  TANDEM_THROW(kUnsupported, "this model samples the MTP drafts on the host only");
}

void Model::mtp_draft_chain(const ForwardBatch&, std::span<const int64_t>,
                            const std::vector<MtpChainPass>&, KvCache&,
                            std::vector<std::vector<int32_t>>&) {
  TANDEM_THROW(kUnsupported, "this model drafts on the host only (mtp_forward)");
}

namespace {

// Row r's argmax of logits [rows, vocab]; ties and NaN as the device's greedy rows (lowest id,
// NaN never wins).
int32_t argmax_row(const std::vector<float>& logits, int64_t r, int64_t vocab) {
  const float* row = logits.data() + r * vocab;
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    if (row[i] > row[best] || (std::isnan(row[best]) && !std::isnan(row[i]))) best = i;
  }
  return static_cast<int32_t>(best);
}

}  // namespace

void mtp_draft_chain_on_host(Model& model, std::span<const float> target_hidden,
                             const ForwardBatch& first, std::span<const int64_t> hidden_rows,
                             const std::vector<MtpChainPass>& chain, KvCache& mtp_kv,
                             std::vector<std::vector<int32_t>>& drafts) {
  const int64_t h = model.config().hidden_size, vocab = model.config().vocab_size;
  TANDEM_CHECK(static_cast<int64_t>(hidden_rows.size()) == first.num_tokens(),
               "mtp_draft_chain: ", hidden_rows.size(), " hidden rows for ", first.num_tokens(),
               " tokens");
  std::vector<float> hin, logits, hout, next_hout;
  for (const int64_t r : hidden_rows) {
    TANDEM_CHECK(r >= 0 && (r + 1) * h <= static_cast<int64_t>(target_hidden.size()),
                 "mtp_draft_chain: hidden row ", r, " outside the target's last forward");
    hin.insert(hin.end(), target_hidden.begin() + r * h, target_hidden.begin() + (r + 1) * h);
  }
  model.mtp_forward(first, hin.data(), mtp_kv, logits, hout);
  const int64_t rows = first.num_logit_rows();
  drafts.assign(chain.size() + 1, {});
  for (int64_t r = 0; r < rows; ++r) drafts[0].push_back(argmax_row(logits, r, vocab));
  for (size_t p = 0; p < chain.size(); ++p) {
    const MtpChainPass& c = chain[p];
    TANDEM_CHECK(static_cast<int64_t>(c.batch.seqs.size()) == rows &&
                     static_cast<int64_t>(c.writes.size()) == rows,
                 "mtp_draft_chain: pass ", p + 1, " has ", c.batch.seqs.size(), " rows for ", rows);
    drafts[p + 1] = drafts[p];  // rows past their drafts keep theirs
    ForwardBatch live;
    std::vector<size_t> index;
    hin.clear();
    for (size_t i = 0; i < c.writes.size(); ++i) {
      if (c.writes[i] == 0) continue;
      ForwardSeq f = c.batch.seqs[i];
      f.tokens = &drafts[p][i];
      live.seqs.push_back(f);
      index.push_back(i);
      hin.insert(hin.end(), hout.begin() + static_cast<int64_t>(i) * h,
                 hout.begin() + static_cast<int64_t>(i + 1) * h);
    }
    if (live.seqs.empty()) {
      // A collective layer (decode EP) runs the pass anyway: its peers' rows need this rank's
      // experts, and every rank runs the same passes.
      if (model.mtp_collective()) model.mtp_forward(live, nullptr, mtp_kv, logits, next_hout);
      continue;
    }
    model.mtp_forward(live, hin.data(), mtp_kv, logits, next_hout);
    for (size_t j = 0; j < index.size(); ++j) {
      drafts[p + 1][index[j]] = argmax_row(logits, static_cast<int64_t>(j), vocab);
      std::copy(next_hout.begin() + static_cast<int64_t>(j) * h,
                next_hout.begin() + static_cast<int64_t>(j + 1) * h,
                hout.begin() + static_cast<int64_t>(index[j]) * h);
    }
  }
}

void verify_draft_on_host(Model& model, std::span<const float> target_hidden,
                          const ForwardBatch& batch, const std::vector<SampledToken>& sampled,
                          KvCache& mtp_kv, VerifyDraftStep& step) {
  const size_t n = batch.seqs.size();
  const int64_t ps = mtp_kv.geometry().page_size, K = step.num_drafts;
  TANDEM_CHECK(step.forced.size() == n && K >= 1 &&
                   static_cast<int64_t>(sampled.size()) == batch.num_tokens() &&
                   batch.num_logit_rows() == batch.num_tokens(),
               "forward_verify_draft: ", n, " sequences, ", step.forced.size(), " forced counts, ",
               sampled.size(), " sampled rows for ", batch.num_tokens(), " tokens (one row each)");
  // Pass 0 over positions start .. start + a of each sequence (the token at t + 1: the accepted
  // drafts, then the target's token of row a), its last row drafting; chained pass p at
  // start + a + p, writing MTP KV inside the block table only.
  step.accepted.assign(n, 0);
  std::vector<std::vector<int32_t>> next(n);  // pass 0's tokens per sequence
  ForwardBatch first;
  std::vector<int64_t> hidden_rows;
  std::vector<MtpChainPass> chain(static_cast<size_t>(K - 1));
  int64_t t = 0;
  for (size_t i = 0; i < n; ++i) {
    const ForwardSeq& f = batch.seqs[i];
    const int64_t k = f.num_tokens - 1;
    int64_t a = 0;
    if (step.forced[i] >= 0) {
      a = std::min<int64_t>(step.forced[i], k);
    } else {
      while (a < k && sampled[static_cast<size_t>(t + a)].token == f.tokens[a + 1]) ++a;
    }
    step.accepted[i] = static_cast<int32_t>(a);
    next[i].assign(f.tokens + 1, f.tokens + 1 + a);
    next[i].push_back(sampled[static_cast<size_t>(t + a)].token);
    first.seqs.push_back(
        {next[i].data(), a + 1, f.start_pos, f.block_table, f.num_pages, LogitsMode::kLast, -1});
    for (int64_t j = 0; j <= a; ++j) hidden_rows.push_back(t + j);
    const int64_t cap = f.num_pages * ps;
    for (int64_t p = 1; p < K; ++p) {
      const int64_t at = f.start_pos + a + p;
      MtpChainPass& c = chain[static_cast<size_t>(p - 1)];
      c.batch.seqs.push_back(
          {f.tokens, 1, std::min(at, cap - 1), f.block_table, f.num_pages, LogitsMode::kLast, -1});
      c.writes.push_back(at < cap ? 1 : 0);
    }
    t += f.num_tokens;
  }
  std::vector<std::vector<int32_t>> drafts;  // [pass][sequence]
  mtp_draft_chain_on_host(model, target_hidden, first, hidden_rows, chain, mtp_kv, drafts);
  step.drafts.assign(n, std::vector<int32_t>(static_cast<size_t>(K)));
  for (size_t i = 0; i < n; ++i) {
    for (int64_t p = 0; p < K; ++p) {
      step.drafts[i][static_cast<size_t>(p)] = drafts[static_cast<size_t>(p)][i];
    }
  }
}

void snapshot_verify_states(Model& model, const ForwardBatch& batch, const VerifyDraftStep& step,
                            KvCache& kv) {
  if (model.state_slot_elems() <= 0) return;
  TANDEM_CHECK(step.spare_slots.size() == batch.seqs.size(),
               "forward_verify_draft: ", step.spare_slots.size(), " spare slots for ",
               batch.seqs.size(), " sequences");
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const ForwardSeq& f = batch.seqs[i];
    if (f.num_tokens > 1 && f.state_slot >= 0 && step.spare_slots[i] >= 0) {
      kv.copy_state(f.state_slot, step.spare_slots[i]);
    }
  }
}

void rollback_verify_states(Model& model, const ForwardBatch& batch, const VerifyDraftStep& step,
                            KvCache& kv) {
  if (model.state_slot_elems() <= 0) return;
  const size_t n = batch.seqs.size();
  TANDEM_CHECK(step.spare_slots.size() == n && step.accepted.size() == n,
               "forward_verify_draft: ", step.spare_slots.size(), " spare slots and ",
               step.accepted.size(), " accepted counts for ", n, " sequences");
  std::vector<StateReplay> replays;
  int64_t row = 0;
  for (size_t i = 0; i < n; ++i) {
    const ForwardSeq& f = batch.seqs[i];
    const int32_t a = step.accepted[i];
    if (a < f.num_tokens - 1 && f.state_slot >= 0) {
      TANDEM_CHECK(step.spare_slots[i] >= 0, "forward_verify_draft: sequence ", i,
                   " rejected a draft but has no snapshot slot");
      kv.copy_state(step.spare_slots[i], f.state_slot);
      replays.push_back({f.state_slot, row, a + 1});
    }
    row += f.num_tokens;
  }
  TANDEM_CHECK(replays.empty() || model.replay_states(replays, kv),
               "forward_verify_draft: the verify kept no recurrence inputs to roll states back");
}

void Model::forward_verify_draft(const ForwardBatch& batch, KvCache& kv,
                                 const std::vector<DeviceSampling>& rows, KvCache& mtp_kv,
                                 VerifyDraftStep& step, std::vector<SampledToken>& out) {
  ForwardBatch fb = batch;
  std::vector<float> hidden;
  fb.hidden_out = &hidden;
  fb.keep_recurrent_inputs = state_slot_elems() > 0;
  snapshot_verify_states(*this, batch, step, kv);
  forward_sample(fb, kv, rows, out);
  verify_draft_on_host(*this, hidden, batch, out, mtp_kv, step);
  rollback_verify_states(*this, batch, step, kv);
}

}  // namespace tandem
