#include <gtest/gtest.h>

#include "core/error.h"
#include "server/planner.h"

namespace tandem {
namespace {

TEST(Planner, PrefillFollowsInputRateAndQueue) {
  PlannerInputs in;
  in.prefill_capacity_tps = 10000;
  in.target_utilisation = 1.0;
  in.input_tokens_per_s = 25000;
  EXPECT_EQ(plan_replicas(in).prefill_instances, 3);
  in.input_tokens_per_s = 20000;
  EXPECT_EQ(plan_replicas(in).prefill_instances, 2);  // exactly full, no rounding up
  in.queued_input_tokens = 300000;                    // + 10000 tok/s to drain in 30 s
  EXPECT_EQ(plan_replicas(in).prefill_instances, 3);
  in.target_utilisation = 0.5;
  EXPECT_EQ(plan_replicas(in).prefill_instances, 6);
  in = {};
  in.prefill_capacity_tps = 1;
  EXPECT_EQ(plan_replicas(in).prefill_instances, 1);  // at least the minimum
}

TEST(Planner, DecodeKeepsBatchPerRankUnderThreshold) {
  PlannerInputs in;
  in.prefill_capacity_tps = 1;
  in.decode_dp = 16;
  in.max_decode_batch = 64;
  in.target_utilisation = 1.0;
  in.concurrent_sequences = 1024;
  EXPECT_EQ(plan_replicas(in).decode_instances, 1);
  in.concurrent_sequences = 1025;
  EXPECT_EQ(plan_replicas(in).decode_instances, 2);
  in.target_utilisation = 0.8;
  in.concurrent_sequences = 1024;
  EXPECT_EQ(plan_replicas(in).decode_instances, 2);
  EXPECT_NE(plan_replicas(in).explanation.find("1024 sequences"), std::string::npos);
}

TEST(Planner, RejectsNonsense) {
  PlannerInputs in;
  EXPECT_THROW(plan_replicas(in), Error);  // no capacity
  in.prefill_capacity_tps = 100;
  in.decode_dp = 0;
  EXPECT_THROW(plan_replicas(in), Error);
  in.decode_dp = 1;
  in.input_tokens_per_s = -1;
  EXPECT_THROW(plan_replicas(in), Error);
}

}  // namespace
}  // namespace tandem
