// The environment variables Tandem reads, declared once: name, type, default and meaning.
// Nothing else in src/ calls getenv; a site reads its variable through the typed accessors
// below, which check that the name is declared and parse the value the one way the table says.
// A value that does not parse is a kInvalidArgument error naming the variable. `tandem
// --help-env` prints the table (help()); docs/operations.md lists it too.
//
// Values are read when a site asks (not cached here): tests set some of them in-process, and the
// sites that must not change mid-run keep what they read (e.g. in a function-local static).
// validate() parses every declared variable that is set, so that a server fails at start-up, not
// at the first request that reaches the site.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace tandem::env {

enum class Type {
  kFlag,    // 1 / 0 (also on / off, true / false, yes / no)
  kInt,     // a decimal integer
  kBytes,   // a byte count: an integer with an optional K, M or G suffix (KiB, MiB, GiB)
  kChoice,  // one of Var::choices
  kString,  // any text
};

struct Var {
  std::string_view name;
  Type type;
  std::string_view default_text;  // what applies when unset (for help())
  std::string_view choices;       // kChoice: the accepted values, separated by '|'
  std::string_view description;
};

/// Every declared variable, in help() order.
std::span<const Var> all();
/// The declared variable NAME (kInternal error when it is not declared: a bug at the call site).
const Var& find(std::string_view name);

/// The raw value: nullopt when unset or empty. NAME must be declared.
std::optional<std::string> text(std::string_view name);
/// A kFlag: FALLBACK when unset.
bool flag(std::string_view name, bool fallback);
/// A kInt: nullopt when unset.
std::optional<int64_t> integer(std::string_view name);
/// A kBytes: nullopt when unset.
std::optional<uint64_t> bytes(std::string_view name);
/// A kChoice: one of its choices, or nullopt when unset.
std::optional<std::string> choice(std::string_view name);

/// Parses every declared variable that is set (the first bad one throws).
void validate();
/// The table `tandem --help-env` prints.
std::string help();

}  // namespace tandem::env
