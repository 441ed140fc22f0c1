// The tandem binary: subcommands generate, serve (and later prefill, decode, router).
#include "server/cli.h"

int main(int argc, char** argv) { return tandem::cli_main(argc, argv); }
