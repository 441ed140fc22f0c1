#include "comm/local_launcher.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <sstream>
#include <thread>

#include "core/error.h"

namespace tandem::comm {

namespace {

using Clock = std::chrono::steady_clock;

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t k = ::write(fd, s.data() + off, s.size() - off);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return;
    off += static_cast<size_t>(k);
  }
}

// Runs fn in the current (child) process and ends it: never returns.
[[noreturn]] void child_main(int pipe_fd, const std::function<std::string()>& fn) {
  std::string out;
  int code = 0;
  try {
    out = fn();
  } catch (const std::exception& e) {
    out = e.what();
    code = 1;
  } catch (...) {
    out = "unknown exception";
    code = 1;
  }
  write_all(pipe_fd, out);
  ::close(pipe_fd);
  std::fflush(nullptr);
  ::_exit(code);  // no atexit handlers: they belong to the parent (gtest, CUDA)
}

}  // namespace

void disable_nvlink_multicast_env() {
  // NOTE: NVLink multicast (NVLS / SHARP) can take the shared GPU host down: always off.
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  ::setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 1);
  ::setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
}

int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TANDEM_CHECK_KIND(kIo, fd >= 0, "socket() failed: ", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  if (rc == 0) rc = ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  TANDEM_CHECK_KIND(kIo, rc == 0, "could not find a free port: ", std::strerror(errno));
  return ntohs(a.sin_port);
}

std::vector<LocalRankResult> run_local_ranks(int world_size,
                                             const std::function<void(int rank)>& body,
                                             std::chrono::seconds timeout,
                                             std::chrono::seconds grace) {
  TANDEM_CHECK_KIND(kInvalidArgument, world_size >= 1, "world_size must be >= 1");
  const int port = pick_free_port();
  std::vector<LocalRankResult> results(world_size);
  std::vector<pid_t> pids(world_size, -1);
  std::vector<int> fds(world_size, -1);
  std::fflush(nullptr);  // children must not inherit (and print again) buffered output
  for (int r = 0; r < world_size; ++r) {
    results[r].rank = r;
    int p[2];
    TANDEM_CHECK_KIND(kIo, ::pipe(p) == 0, "pipe() failed: ", std::strerror(errno));
    pid_t pid = ::fork();
    TANDEM_CHECK_KIND(kIo, pid >= 0, "fork() failed: ", std::strerror(errno));
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher (e.g. killed by timeout)
      ::close(p[0]);
      for (int q = 0; q < r; ++q) ::close(fds[q]);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world_size).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      disable_nvlink_multicast_env();
      child_main(p[1], [&] {
        body(r);
        return std::string();
      });
    }
    ::close(p[1]);
    ::fcntl(p[0], F_SETFL, O_NONBLOCK);
    pids[r] = pid;
    fds[r] = p[0];
  }

  const auto start = Clock::now();
  auto kill_deadline = start + timeout;
  int running = world_size;
  while (running > 0) {
    // Drain messages so a child never blocks on a full pipe.
    for (int r = 0; r < world_size; ++r) {
      if (fds[r] < 0) continue;
      char buf[4096];
      while (true) {
        ssize_t k = ::read(fds[r], buf, sizeof(buf));
        if (k > 0) {
          results[r].message.append(buf, static_cast<size_t>(k));
          continue;
        }
        if (k == 0) {
          ::close(fds[r]);
          fds[r] = -1;
        }
        break;
      }
    }
    for (int r = 0; r < world_size; ++r) {
      if (pids[r] < 0) continue;
      int status = 0;
      pid_t w = ::waitpid(pids[r], &status, WNOHANG);
      if (w != pids[r]) continue;
      pids[r] = -1;
      --running;
      if (WIFEXITED(status)) {
        results[r].exit_code = WEXITSTATUS(status);
        results[r].ok = results[r].exit_code == 0 && !results[r].timed_out;
      } else if (WIFSIGNALED(status)) {
        results[r].term_signal = WTERMSIG(status);
      }
      if (!results[r].ok) {  // first failure: the others get a grace period
        kill_deadline = std::min(kill_deadline, Clock::now() + grace);
      }
    }
    if (running > 0 && Clock::now() >= kill_deadline) {
      for (int r = 0; r < world_size; ++r) {
        if (pids[r] > 0) {
          results[r].timed_out = true;
          ::kill(pids[r], SIGKILL);  // our own child, by pid
        }
      }
      kill_deadline = Clock::now() + std::chrono::hours(1);
    }
    if (running > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < world_size; ++r) {
    if (fds[r] >= 0) {
      char buf[4096];
      ssize_t k;
      while ((k = ::read(fds[r], buf, sizeof(buf))) > 0)
        results[r].message.append(buf, static_cast<size_t>(k));
      ::close(fds[r]);
    }
  }
  return results;
}

int run_in_child(const std::function<int()>& fn, int fallback) {
  int p[2];
  if (::pipe(p) != 0) return fallback;
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) {
    ::close(p[0]);
    ::close(p[1]);
    return fallback;
  }
  if (pid == 0) {
    ::close(p[0]);
    child_main(p[1], [&] { return std::to_string(fn()); });
  }
  ::close(p[1]);
  std::string out;
  char buf[256];
  ssize_t k;
  while ((k = ::read(p[0], buf, sizeof(buf))) != 0) {
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) break;
    out.append(buf, static_cast<size_t>(k));
  }
  ::close(p[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return fallback;
  try {
    return std::stoi(out);
  } catch (...) {
    return fallback;
  }
}

std::string describe_failures(const std::vector<LocalRankResult>& results) {
  std::ostringstream os;
  for (const auto& r : results) {
    if (r.ok) continue;
    os << "rank " << r.rank << ": ";
    if (r.timed_out) os << "killed after timeout; ";
    if (r.term_signal != 0)
      os << "signal " << r.term_signal << " (" << strsignal(r.term_signal) << "); ";
    if (r.exit_code >= 0) os << "exit " << r.exit_code << "; ";
    os << (r.message.empty() ? "(no message)" : r.message) << "\n";
  }
  return os.str();
}

}  // namespace tandem::comm
