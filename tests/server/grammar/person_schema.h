// The JSON schema the structured-output HTTP suites (colocated and through the router) request,
// and the check of a reply against it.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace tandem::testing {

inline const nlohmann::json& person_schema() {
  static const nlohmann::json schema = nlohmann::json::parse(R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "member": {"type": "boolean"},
    "color": {"enum": ["red", "green", "blue"]}
  },
  "required": ["name", "age", "member", "color"],
  "additionalProperties": false
})");
  return schema;
}

inline void expect_person(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << "not JSON: " << text;
  ASSERT_TRUE(j.is_object()) << text;
  EXPECT_EQ(j.size(), 4u) << text;
  ASSERT_TRUE(j.contains("name") && j["name"].is_string()) << text;
  EXPECT_LE(j["name"].get<std::string>().size(), 8u) << text;
  ASSERT_TRUE(j.contains("age") && j["age"].is_number_integer()) << text;
  EXPECT_GE(j["age"].get<int64_t>(), 0);
  EXPECT_LE(j["age"].get<int64_t>(), 120);
  ASSERT_TRUE(j.contains("member") && j["member"].is_boolean()) << text;
  ASSERT_TRUE(j.contains("color") && j["color"].is_string()) << text;
  const std::string c = j["color"];
  EXPECT_TRUE(c == "red" || c == "green" || c == "blue") << text;
}

}  // namespace tandem::testing
