// The CPU models' lm_head: the whole vocabulary on one rank, or vocab-parallel over a prefill
// TP group (each rank its rows of the logits, padded to ShardPlan::vocab_rows, all-gathered).
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/shard.h"

namespace tandem {

namespace comm {
class Communicator;
}

/// logits [rows, vocab] of the final hidden states `last` [rows, hidden]. `head` holds this
/// rank's lm_head rows ([plan.vocab.size(), hidden]; every row unless TP), `comm` the TP group.
void cpu_lm_head(const ModelConfig& c, const ShardPlan& plan, comm::Communicator* comm,
                 const float* head, const float* last, int64_t rows, std::vector<float>& logits);

}  // namespace tandem
