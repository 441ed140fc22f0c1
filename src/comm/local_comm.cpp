#include "comm/local_comm.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "core/error.h"

namespace tandem::comm {

namespace {

enum class Op : uint8_t { kAllReduce, kAllGather, kAllGatherV, kAllToAllV, kBroadcast, kBarrier };

const char* op_name(Op op) {
  switch (op) {
    case Op::kAllReduce: return "all_reduce_sum";
    case Op::kAllGather: return "all_gather";
    case Op::kAllGatherV: return "all_gather_v";
    case Op::kAllToAllV: return "all_to_all_v";
    case Op::kBroadcast: return "broadcast";
    case Op::kBarrier: return "barrier";
  }
  return "?";
}

// What one rank brings to a collective; valid between the two syncs of that collective.
struct Post {
  Op op = Op::kBarrier;
  const void* in = nullptr;
  int64_t count = 0;                     // elements of in (all_gather*: this rank's part)
  const int64_t* send_counts = nullptr;  // all_to_all_v: [world_size]
  DType dtype = DType::kF32;
  int root = 0;
};

// A synchronous point-to-point message: the receiver copies straight from the sender.
struct Message {
  const void* data = nullptr;
  int64_t bytes = 0;
  bool taken = false;
  bool size_mismatch = false;
};

char* at(void* base, int64_t elems, DType dtype) {
  return static_cast<char*>(base) + elems * static_cast<int64_t>(dtype_size(dtype));
}
const char* at(const void* base, int64_t elems, DType dtype) {
  return static_cast<const char*>(base) + elems * static_cast<int64_t>(dtype_size(dtype));
}
size_t nbytes(int64_t elems, DType dtype) { return static_cast<size_t>(elems) * dtype_size(dtype); }

}  // namespace

/// The state the ranks of one local group share.
class LocalGroup {
 public:
  LocalGroup(int world_size, std::chrono::milliseconds timeout)
      : world_size_(world_size), timeout_(timeout), posts_(static_cast<size_t>(world_size)) {}

  int world_size() const { return world_size_; }

  // Phase 1 of a collective: publish this rank's post and wait for all ranks; checks that
  // every rank is in the same collective.
  void enter(int rank, const Post& post) {
    posts_[static_cast<size_t>(rank)] = post;
    sync(op_name(post.op));
    for (int r = 0; r < world_size_; ++r) {
      const Post& p = posts_[static_cast<size_t>(r)];
      if (p.op != post.op || p.dtype != post.dtype) {
        abort();
        TANDEM_THROW(kInternal, "collective mismatch: rank ", rank, " is in ", op_name(post.op),
                     " (", dtype_name(post.dtype), ") while rank ", r, " is in ", op_name(p.op),
                     " (", dtype_name(p.dtype), ")");
      }
    }
  }
  // Phase 2: wait until every rank has read what it needs from the posts.
  void leave(Op op) { sync(op_name(op)); }

  const Post& post(int rank) const { return posts_[static_cast<size_t>(rank)]; }

  void abort() {
    std::lock_guard<std::mutex> lk(mu_);
    aborted_ = true;
    cv_.notify_all();
  }

  void send(int src, int dst, uint32_t tag, const void* data, int64_t bytes) {
    Message msg{data, bytes};
    std::unique_lock<std::mutex> lk(mu_);
    auto& box = mailboxes_[{src, dst, tag}];
    box.push_back(&msg);
    cv_.notify_all();
    const bool done = cv_.wait_for(lk, timeout_, [&] { return msg.taken || aborted_; });
    if (!msg.taken) {
      // Withdraw the message so no receiver reads it after we return.
      for (auto it = box.begin(); it != box.end(); ++it) {
        if (*it == &msg) {
          box.erase(it);
          break;
        }
      }
      check_alive_locked("send");
      TANDEM_CHECK_KIND(kIo, done, "local group: rank ", src, " timed out after ", timeout_.count(),
                        " ms sending to rank ", dst, " (tag ", tag, ")");
    }
    TANDEM_CHECK_KIND(kInvalidArgument, !msg.size_mismatch, "send of ", bytes, " bytes from rank ",
                      src, " to rank ", dst, " (tag ", tag, ") met a recv of a different size");
  }

  void recv(int src, int dst, uint32_t tag, void* data, int64_t bytes) {
    std::unique_lock<std::mutex> lk(mu_);
    auto& box = mailboxes_[{src, dst, tag}];
    const bool ready = cv_.wait_for(lk, timeout_, [&] { return !box.empty() || aborted_; });
    check_alive_locked("recv");
    TANDEM_CHECK_KIND(kIo, ready, "local group: rank ", dst, " timed out after ", timeout_.count(),
                      " ms receiving from rank ", src, " (tag ", tag, ")");
    Message* msg = box.front();
    box.pop_front();
    if (msg->bytes != bytes) {
      msg->size_mismatch = true;
      msg->taken = true;
      cv_.notify_all();
      TANDEM_THROW(kInvalidArgument, "recv of ", bytes, " bytes on rank ", dst, " from rank ", src,
                   " (tag ", tag, ") met a send of ", msg->bytes, " bytes");
    }
    if (bytes > 0) std::memcpy(data, msg->data, static_cast<size_t>(bytes));
    msg->taken = true;
    cv_.notify_all();
  }

 private:
  void check_alive_locked(const char* what) {
    TANDEM_CHECK_KIND(kIo, !aborted_, "local group aborted (another rank failed) during ", what);
  }

  // A reusable barrier: the generation counter tells one round from the next.
  void sync(const char* what) {
    std::unique_lock<std::mutex> lk(mu_);
    check_alive_locked(what);
    const int64_t gen = generation_;
    if (++arrived_ == world_size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    const bool done = cv_.wait_for(lk, timeout_, [&] { return generation_ != gen || aborted_; });
    if (generation_ != gen) return;
    check_alive_locked(what);
    if (!done) {
      aborted_ = true;  // the group is broken: release everyone
      cv_.notify_all();
      TANDEM_THROW(kIo, "local group: ", what, " timed out after ", timeout_.count(),
                   " ms waiting for the other ranks");
    }
  }

  const int world_size_;
  const std::chrono::milliseconds timeout_;
  std::vector<Post> posts_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int64_t generation_ = 0;
  bool aborted_ = false;
  std::map<std::tuple<int, int, uint32_t>, std::deque<Message*>> mailboxes_;
};

namespace {

// One collective: publish, read the peers' posts with `read` (a failure there aborts the group
// so no peer waits for this rank), then wait for every rank to finish reading.
template <typename Read>
void collective(LocalGroup& group, int rank, const Post& post, Read&& read) {
  group.enter(rank, post);
  try {
    read();
  } catch (...) {
    group.abort();
    throw;
  }
  group.leave(post.op);
}

}  // namespace

std::vector<std::unique_ptr<LocalCommunicator>> LocalCommunicator::create_group(
    int world_size, std::chrono::milliseconds timeout) {
  TANDEM_CHECK_KIND(kInvalidArgument, world_size >= 1, "world_size must be >= 1, got ", world_size);
  auto group = std::make_shared<LocalGroup>(world_size, timeout);
  std::vector<std::unique_ptr<LocalCommunicator>> comms;
  for (int r = 0; r < world_size; ++r) {
    comms.push_back(std::unique_ptr<LocalCommunicator>(new LocalCommunicator(group, r)));
  }
  return comms;
}

int LocalCommunicator::world_size() const { return group_->world_size(); }

void LocalCommunicator::abort_group() { group_->abort(); }

void LocalCommunicator::all_reduce_sum(void* data, int64_t count, DType dtype) {
  Post p;
  p.op = Op::kAllReduce;
  p.in = data;
  p.count = count;
  p.dtype = dtype;
  // Rank order: acc = x0; acc += x1; ...  (the peers' buffers stay intact until all have read).
  std::vector<char> acc(nbytes(count, dtype));
  collective(*group_, rank_, p, [&] {
    for (int r = 0; r < world_size(); ++r) {
      TANDEM_CHECK(group_->post(r).count == count, "all_reduce_sum: rank ", r, " has ",
                   group_->post(r).count, " elements, rank ", rank_, " has ", count);
    }
    if (count == 0) return;
    std::memcpy(acc.data(), group_->post(0).in, acc.size());
    for (int r = 1; r < world_size(); ++r) add_into(acc.data(), group_->post(r).in, count, dtype);
  });
  if (count > 0) std::memcpy(data, acc.data(), acc.size());
}

void LocalCommunicator::all_gather(const void* in, void* out, int64_t count, DType dtype) {
  Post p;
  p.op = Op::kAllGather;
  p.in = in;
  p.count = count;
  p.dtype = dtype;
  collective(*group_, rank_, p, [&] {
    for (int r = 0; r < world_size(); ++r) {
      const Post& q = group_->post(r);
      TANDEM_CHECK(q.count == count, "all_gather: rank ", r, " has ", q.count, " elements, rank ",
                   rank_, " has ", count);
      if (count > 0) std::memcpy(at(out, r * count, dtype), q.in, nbytes(count, dtype));
    }
  });
}

void LocalCommunicator::all_gather_v(const void* in, void* out, std::span<const int64_t> counts,
                                     DType dtype) {
  const int n = world_size();
  TANDEM_CHECK(static_cast<int>(counts.size()) == n, "all_gather_v: ", counts.size(),
               " counts for ", n, " ranks");
  Post p;
  p.op = Op::kAllGatherV;
  p.in = in;
  p.count = counts[static_cast<size_t>(rank_)];
  p.dtype = dtype;
  collective(*group_, rank_, p, [&] {
    int64_t offset = 0;
    for (int r = 0; r < n; ++r) {
      const Post& q = group_->post(r);
      const int64_t c = counts[static_cast<size_t>(r)];
      TANDEM_CHECK(q.count == c, "all_gather_v: rank ", r, " contributes ", q.count,
                   " elements, rank ", rank_, " expects ", c);
      if (c > 0) std::memcpy(at(out, offset, dtype), q.in, nbytes(c, dtype));
      offset += c;
    }
  });
}

void LocalCommunicator::all_to_all_v(const void* in, std::span<const int64_t> send_counts,
                                     void* out, std::span<const int64_t> recv_counts, DType dtype) {
  const int n = world_size();
  TANDEM_CHECK(
      static_cast<int>(send_counts.size()) == n && static_cast<int>(recv_counts.size()) == n,
      "all_to_all_v: counts must have one entry per rank (", n, ")");
  Post p;
  p.op = Op::kAllToAllV;
  p.in = in;
  p.send_counts = send_counts.data();
  p.dtype = dtype;
  collective(*group_, rank_, p, [&] {
    int64_t out_offset = 0;
    for (int r = 0; r < n; ++r) {
      const Post& q = group_->post(r);
      int64_t in_offset = 0;
      for (int i = 0; i < rank_; ++i) in_offset += q.send_counts[i];
      const int64_t c = q.send_counts[rank_];
      TANDEM_CHECK(c == recv_counts[static_cast<size_t>(r)], "all_to_all_v: rank ", r, " sends ", c,
                   " elements to rank ", rank_, ", which expects ",
                   recv_counts[static_cast<size_t>(r)]);
      if (c > 0) {
        std::memcpy(at(out, out_offset, dtype), at(q.in, in_offset, dtype), nbytes(c, dtype));
      }
      out_offset += c;
    }
  });
}

void LocalCommunicator::broadcast(void* data, int64_t count, DType dtype, int root) {
  TANDEM_CHECK(root >= 0 && root < world_size(), "broadcast: bad root ", root);
  Post p;
  p.op = Op::kBroadcast;
  p.in = data;
  p.count = count;
  p.dtype = dtype;
  p.root = root;
  collective(*group_, rank_, p, [&] {
    const Post& src = group_->post(root);
    TANDEM_CHECK(src.root == root && src.count == count, "broadcast: rank ", rank_,
                 " disagrees with the root on root or count");
    if (rank_ != root && count > 0) std::memcpy(data, src.in, nbytes(count, dtype));
  });
}

void LocalCommunicator::barrier() {
  Post p;
  p.op = Op::kBarrier;
  collective(*group_, rank_, p, [] {});
}

void LocalCommunicator::send(const void* data, int64_t bytes, int peer, uint32_t tag) {
  TANDEM_CHECK(peer >= 0 && peer < world_size() && peer != rank_, "send: bad peer ", peer);
  TANDEM_CHECK(tag < (1u << 24), "send: tag ", tag, " out of range");
  if (bytes == 0) return;
  group_->send(rank_, peer, tag, data, bytes);
}

void LocalCommunicator::recv(void* data, int64_t bytes, int peer, uint32_t tag) {
  TANDEM_CHECK(peer >= 0 && peer < world_size() && peer != rank_, "recv: bad peer ", peer);
  TANDEM_CHECK(tag < (1u << 24), "recv: tag ", tag, " out of range");
  if (bytes == 0) return;
  group_->recv(peer, rank_, tag, data, bytes);
}

void run_local_group(int world_size, const std::function<void(Communicator& comm)>& body,
                     std::chrono::milliseconds timeout) {
  auto comms = LocalCommunicator::create_group(world_size, timeout);
  std::mutex mu;
  std::exception_ptr first;
  int first_rank = -1;
  auto run_rank = [&](int r) {
    try {
      body(*comms[static_cast<size_t>(r)]);
    } catch (...) {
      {
        std::lock_guard<std::mutex> lk(mu);
        if (!first) {
          first = std::current_exception();
          first_rank = r;
        }
      }
      comms[static_cast<size_t>(r)]->abort_group();
    }
  };
  std::vector<std::thread> threads;
  for (int r = 1; r < world_size; ++r) threads.emplace_back(run_rank, r);
  run_rank(0);
  for (auto& t : threads) t.join();
  if (!first) return;
  try {
    std::rethrow_exception(first);
  } catch (const Error& e) {
    throw Error(e.kind(), "rank " + std::to_string(first_rank) + ": " + e.what());
  } catch (const std::exception& e) {
    TANDEM_THROW(kInternal, "rank ", first_rank, ": ", e.what());
  }
}

}  // namespace tandem::comm
