// `tandem bench serve` and `tandem bench latency`: their flags (vLLM's names) and dispatch, kept
// out of server/cli.cpp, which only registers them:
//
//   bench::BenchCli bench(app, load_model, demo_model_dir());   // adds the subcommands
//   ...app.parse(argc, argv)...
//   if (bench.parsed()) return bench.run();
#pragma once

#include <memory>
#include <string>

#include "server/bench/bench_latency.h"

namespace CLI {
class App;
}

namespace tandem::bench {

class BenchCli {
 public:
  /// Adds `bench` with `serve` and `latency` to `app`; `load` loads a model for `bench latency`,
  /// `default_model` is its default --model.
  BenchCli(CLI::App& app, ModelLoader load, std::string default_model);
  ~BenchCli();
  /// True when `bench` was on the command line (after app.parse).
  bool parsed() const;
  /// Runs the parsed subcommand; returns the exit code (throws Error on bad flags).
  int run();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::bench
