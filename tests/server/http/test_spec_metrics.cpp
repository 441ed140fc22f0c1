// /metrics: the speculative-decoding counters under our prefix and vLLM's names, only when
// speculation is on.
#include <gtest/gtest.h>

#include "server/http/metrics.h"

namespace tandem {
namespace {

TEST(SpecMetrics, ExportedUnderBothNamesWhenSpeculating) {
  ServerMetrics m;
  m.set_model_name("demo");
  EngineStats st;
  std::string off = m.render(st);
  EXPECT_EQ(off.find("spec_decode"), std::string::npos);

  st.spec_num_drafts = 10;
  st.spec_num_draft_tokens = 30;
  st.spec_num_accepted_tokens = 17;
  st.spec_accepted_per_pos = {9, 5, 3};
  const std::string t = m.render(st);
  for (const std::string line : {
           "tandem_spec_decode_num_drafts_total 10\n",
           "tandem_spec_decode_num_draft_tokens_total 30\n",
           "tandem_spec_decode_num_accepted_tokens_total 17\n",
           "tandem_spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"} 9\n",
           "tandem_spec_decode_num_accepted_tokens_per_pos_total{position=\"2\"} 3\n",
           "vllm:spec_decode_num_drafts_total{model_name=\"demo\"} 10\n",
           "vllm:spec_decode_num_draft_tokens_total{model_name=\"demo\"} 30\n",
           "vllm:spec_decode_num_accepted_tokens_total{model_name=\"demo\"} 17\n",
           "vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=\"demo\",position=\"1\"} "
           "5\n",
       }) {
    EXPECT_NE(t.find(line), std::string::npos) << line << "\n" << t;
  }
  EXPECT_NE(t.find("# TYPE vllm:spec_decode_num_drafts_total counter"), std::string::npos);
}

}  // namespace
}  // namespace tandem
