// Scheduler state slots (hybrid models): one per running sequence, taken at admission, given
// back on preemption and removal, passed to the forward batch; none without num_state_slots.
#include <gtest/gtest.h>

#include <set>

#include "engine/scheduler.h"

namespace tandem {
namespace {

std::unique_ptr<Sequence> make_seq(const std::string& id, int n) {
  auto s = std::make_unique<Sequence>();
  s->req.id = id;
  for (int i = 0; i < n; ++i) s->tokens.push_back(i + 1);
  s->req.prompt_ids = s->tokens;
  s->prompt_len = n;
  return s;
}

void commit_all(Scheduler& sch, const ScheduledBatch& b) { sch.commit(b); }

TEST(SchedulerStates, SlotsGateAdmissionAndTravelWithTheBatch) {
  BlockManager blocks(64, 4, false);
  Scheduler sch(blocks, /*max_num_seqs=*/8, /*max_batched_tokens=*/100, /*num_state_slots=*/2);
  sch.add(make_seq("a", 5));
  sch.add(make_seq("b", 6));
  sch.add(make_seq("c", 7));
  ScheduledBatch b = sch.schedule();
  ASSERT_EQ(b.seqs.size(), 2u);  // two slots: the third waits
  EXPECT_EQ(sch.num_waiting(), 1);
  EXPECT_EQ(sch.num_free_state_slots(), 0);
  std::set<int32_t> slots;
  for (size_t i = 0; i < b.seqs.size(); ++i) {
    EXPECT_EQ(b.forward.seqs[i].state_slot, b.seqs[i].seq->state_slot);
    slots.insert(b.seqs[i].seq->state_slot);
  }
  EXPECT_EQ(slots, (std::set<int32_t>{0, 1}));
  commit_all(sch, b);
  const int32_t a_slot = sch.find("a")->state_slot;
  sch.remove("a");  // frees its slot at once
  EXPECT_EQ(sch.num_free_state_slots(), 1);
  b = sch.schedule();
  ASSERT_EQ(b.seqs.size(), 2u);
  EXPECT_EQ(sch.find("c")->state_slot, a_slot);
  EXPECT_EQ(b.seqs.back().seq->req.id, "c");
  EXPECT_EQ(b.forward.seqs.back().state_slot, a_slot);
  EXPECT_EQ(b.forward.seqs.back().start_pos, 0);
  commit_all(sch, b);
  sch.remove("b");
  sch.remove("c");
  EXPECT_EQ(sch.num_free_state_slots(), 2);
  EXPECT_EQ(blocks.num_free(), 64);
}

TEST(SchedulerStates, PreemptionGivesTheSlotBack) {
  // 4 pages of 4 tokens: two 6-token prompts fit, growing them forces a preemption.
  BlockManager blocks(4, 4, false);
  Scheduler sch(blocks, 8, 100, 2);
  sch.add(make_seq("a", 8));
  sch.add(make_seq("b", 8));
  ScheduledBatch b = sch.schedule();
  ASSERT_EQ(b.seqs.size(), 2u);
  commit_all(sch, b);
  for (auto& ss : b.seqs) ss.seq->tokens.push_back(9);  // each sampled a token: needs a 3rd page
  b = sch.schedule();
  EXPECT_EQ(sch.preemptions(), 1);
  ASSERT_EQ(b.seqs.size(), 1u);
  Sequence* waiting = sch.find("b");
  EXPECT_EQ(waiting->state_slot, -1);  // preempted: slot released, recomputed from zero
  EXPECT_EQ(waiting->num_computed, 0);
  EXPECT_EQ(sch.num_free_state_slots(), 1);
}

TEST(SchedulerStates, NoSlotsWithoutStates) {
  BlockManager blocks(16, 4, false);
  Scheduler sch(blocks, 8, 100);
  sch.add(make_seq("a", 5));
  ScheduledBatch b = sch.schedule();
  ASSERT_EQ(b.seqs.size(), 1u);
  EXPECT_EQ(b.forward.seqs[0].state_slot, -1);
  EXPECT_EQ(b.seqs[0].seq->state_slot, -1);
}

TEST(SchedulerStates, CheckpointsAtIntervalsAndResumeFromTheDeepest) {
  BlockManager blocks(64, 4, /*enable_prefix_cache=*/true);
  Scheduler sch(blocks, 8, /*max_batched_tokens=*/100, /*num_state_slots=*/2);
  sch.enable_state_checkpoints(/*first_slot=*/2, /*capacity=*/4, /*interval=*/8);
  sch.add(make_seq("a", 21));
  // Prefill chunks stop at 8 and 16 (checkpoints), then run to the end of the prompt.
  std::vector<int64_t> chunks;
  std::vector<StateCopy> saves;
  int32_t a_slot = -1;
  while (sch.find("a")->num_computed < 21) {
    ScheduledBatch b = sch.schedule();
    ASSERT_EQ(b.seqs.size(), 1u);
    EXPECT_TRUE(b.state_restores.empty());
    chunks.push_back(b.seqs[0].num_tokens);
    a_slot = b.seqs[0].seq->state_slot;
    sch.commit(b);
    for (const auto& c : sch.take_state_saves()) saves.push_back(c);
  }
  EXPECT_EQ(chunks, (std::vector<int64_t>{8, 8, 5}));
  ASSERT_EQ(saves.size(), 2u);  // at 8 and 16
  EXPECT_EQ(saves[0].src, a_slot);
  EXPECT_EQ(saves[1].src, a_slot);
  EXPECT_NE(saves[0].dst, saves[1].dst);
  EXPECT_GE(std::min(saves[0].dst, saves[1].dst), 2);
  EXPECT_EQ(sch.state_checkpoints()->size(), 2);
  sch.remove("a");

  // Same first 19 tokens: 4 cached pages (16 tokens) match, the checkpoint at 16 is there.
  auto b_seq = make_seq("b", 30);
  for (int i = 19; i < 30; ++i) b_seq->tokens[i] = 100 + i;
  b_seq->req.prompt_ids = b_seq->tokens;
  sch.add(std::move(b_seq));
  ScheduledBatch b = sch.schedule();
  ASSERT_EQ(b.seqs.size(), 1u);
  Sequence* bs = b.seqs[0].seq;
  EXPECT_EQ(b.forward.seqs[0].start_pos, 16);
  EXPECT_EQ(bs->num_cached_prompt, 16);
  ASSERT_EQ(b.state_restores.size(), 1u);
  EXPECT_EQ(b.state_restores[0].src, saves[1].dst);
  EXPECT_EQ(b.state_restores[0].dst, bs->state_slot);
  EXPECT_EQ(b.seqs[0].num_tokens, 8);  // to the next checkpoint at 24
  sch.commit(b);
  sch.remove("b");

  // Only the first 10 tokens shared: 2 pages match, the checkpoint at 8 serves (page 3's
  // match is dropped).
  auto c_seq = make_seq("c", 14);
  for (int i = 10; i < 14; ++i) c_seq->tokens[i] = 500 + i;
  c_seq->req.prompt_ids = c_seq->tokens;
  sch.add(std::move(c_seq));
  b = sch.schedule();
  ASSERT_EQ(b.seqs.size(), 1u);
  EXPECT_EQ(b.forward.seqs[0].start_pos, 8);
  ASSERT_EQ(b.state_restores.size(), 1u);
  EXPECT_EQ(b.state_restores[0].src, saves[0].dst);
  sch.commit(b);
  sch.remove("c");

  // A prompt whose cached pages reach no checkpoint starts from zero, holding no pages.
  auto d_seq = make_seq("d", 7);
  sch.add(std::move(d_seq));
  b = sch.schedule();
  ASSERT_EQ(b.seqs.size(), 1u);
  EXPECT_EQ(b.forward.seqs[0].start_pos, 0);
  EXPECT_TRUE(b.state_restores.empty());
  sch.commit(b);
  sch.remove("d");
  EXPECT_EQ(blocks.num_available(), 64);
}

}  // namespace
}  // namespace tandem
