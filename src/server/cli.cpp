#include "server/cli.h"

#include <CLI/CLI.hpp>
#include <iostream>

#include "core/error.h"

namespace tandem {

int cli_main(int argc, char** argv) {
  CLI::App app{"Tandem: a disaggregated MoE inference server"};
  app.require_subcommand(1);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const Error& e) {
    std::cerr << "error: " << e.message() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace tandem
