// The parts every multi-rank role loop is built from: agreeing on whether a step runs and
// broadcasting rank 0's decisions (the messages themselves: disagg/protocol.h).
//   decode DP:   work = agree_any(comm, engine.has_work()); if (work) step with forward().
//   prefill TP:  rank 0 schedules, broadcast_bytes(encoded batch), every rank forwards.
// NOTE: every call here is collective: every rank of the group makes it, in the same order.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "comm/communicator.h"
#include "disagg/protocol.h"

namespace tandem {

/// True on every rank when `mine` is true on any rank (an all-reduce of one flag).
bool agree_any(comm::Communicator& comm, bool mine);

/// Sums one counter over the ranks (every rank gets the total).
int64_t sum_over_ranks(comm::Communicator& comm, int64_t mine);

/// root's bytes become every rank's bytes (the size first, then the payload).
void broadcast_bytes(comm::Communicator& comm, std::vector<uint8_t>& bytes, int root);

}  // namespace tandem
