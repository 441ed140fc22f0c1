// Command-line entry: parses the subcommand and its flags, returns the exit code.
#pragma once

namespace tandem {
int cli_main(int argc, char** argv);
}
