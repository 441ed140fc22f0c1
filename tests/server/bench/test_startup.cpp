// Start-up that a person can watch: the monitor's phases, weights progress and /health body, the
// checkpoint's load observer, and the HTTP front answering 503 with the phase while starting,
// then serving through the deferred engine client.
#include <gtest/gtest.h>

#include <sstream>
#include <thread>

#include "model/load_progress.h"
#include "model/safetensors.h"
#include "server/http/fake_engine.h"
#include "server/http/http_client.h"
#include "server/http/http_server.h"
#include "server/startup.h"

namespace tandem {
namespace {

using json = nlohmann::json;

std::string demo_dir() { return std::string(TANDEM_SOURCE_DIR) + "/models/demo"; }

TEST(Startup, PhasesAndWeightsProgress) {
  std::ostringstream log;
  StartupMonitor mon(log, std::chrono::milliseconds(0));  // a progress line per tensor
  json s = json::parse(mon.status_json());
  EXPECT_EQ(s["status"], "starting");
  EXPECT_EQ(s["phase"], "init");
  mon.phase("weights");
  mon.on_checkpoint("/ck", 1000);
  mon.on_checkpoint("/ck", 1000);  // opened again (the MTP layer): not counted twice
  mon.on_tensor("/ck", "a", 300);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  mon.on_tensor("/ck", "a", 300);  // read again: once
  mon.on_tensor("/ck", "b", 200);
  s = json::parse(mon.status_json());
  EXPECT_EQ(s["phase"], "weights");
  EXPECT_EQ(s["weights"]["bytes_total"], 1000);
  EXPECT_EQ(s["weights"]["bytes_read"], 500);
  EXPECT_GT(s["weights"]["bytes_per_s"].get<double>(), 0.0);
  EXPECT_GT(s["weights"]["eta_s"].get<double>(), 0.0);
  mon.phase("kv_cache");
  mon.phase("graphs");
  mon.on_graph(8, 1, 3);
  mon.on_graph(16, 2, 3);
  s = json::parse(mon.status_json());
  EXPECT_EQ(s["phase"], "graphs");
  EXPECT_EQ(s["graphs"]["captured"], 2);
  EXPECT_EQ(s["graphs"]["total"], 3);
  ASSERT_EQ(s["phases"].size(), 2u);
  EXPECT_EQ(s["phases"][0]["name"], "weights");
  EXPECT_EQ(s["phases"][1]["name"], "kv_cache");
  EXPECT_FALSE(mon.is_ready());
  mon.ready();
  EXPECT_TRUE(mon.is_ready());
  EXPECT_EQ(mon.status_json(), "");
  EXPECT_EQ(mon.phases().size(), 3u);
  const std::string out = log.str();
  EXPECT_NE(out.find("tandem: weights 0.00 GB / 0.00 GB (50%)"), std::string::npos) << out;
  EXPECT_NE(out.find("tandem: weights 0.00 GB read in"), std::string::npos) << out;
  EXPECT_NE(out.find("tandem: startup: weights"), std::string::npos) << out;
  EXPECT_NE(out.find("tandem: startup: graphs"), std::string::npos) << out;
  EXPECT_NE(out.find("tandem: graphs 2 / 3 captured (batch 16)"), std::string::npos) << out;
  EXPECT_NE(out.find("tandem: startup: ready in"), std::string::npos) << out;
}

// The checkpoint reports its size and each tensor read through the shape-checked get().
TEST(Startup, CheckpointReportsToTheObserver) {
  struct Recorder final : LoadObserver {
    uint64_t total = 0, read = 0;
    int tensors = 0;
    void on_checkpoint(const std::string&, uint64_t t) override { total += t; }
    void on_tensor(const std::string&, const std::string&, uint64_t b) override {
      read += b;
      ++tensors;
    }
  } rec;
  {
    Checkpoint quiet(demo_dir());  // no observer: nothing reported
    (void)quiet;
  }
  EXPECT_EQ(rec.total, 0u);
  ScopedLoadObserver scope(&rec);
  Checkpoint ck(demo_dir());
  uint64_t expected = 0;
  for (const auto& n : ck.names()) expected += ck.get(n).nbytes();  // (unreported overload)
  EXPECT_EQ(rec.total, expected);
  EXPECT_EQ(rec.tensors, 0);
  const std::string name = ck.names().front();
  const TensorView v = ck.get(name);
  ck.get(name, v.shape);
  EXPECT_EQ(rec.tensors, 1);
  EXPECT_EQ(rec.read, v.nbytes());
}

TEST(Startup, HealthIsServiceUnavailableWithThePhaseUntilReady) {
  std::ostringstream log;
  StartupMonitor mon(log);
  DeferredEngineClient client;
  HttpServerConfig cfg;
  cfg.host = "127.0.0.1";
  cfg.port = 0;
  cfg.startup_status = [&mon] { return mon.status_json(); };
  HttpServer server(cfg, client, nullptr);
  server.start();
  const std::string base = "http://127.0.0.1:" + std::to_string(server.port());
  testing::HttpClient http;
  mon.phase("weights");
  auto h = http.get(base + "/health");
  EXPECT_EQ(h.status, 503);
  EXPECT_EQ(h.json()["phase"], "weights");
  EXPECT_NE(h.headers.find("Retry-After"), std::string::npos);
  auto r = http.get(base + "/ready");
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(r.json()["status"], "starting");
  auto c =
      http.post(base + "/v1/completions", json{{"prompt", json::array({1, 2})}, {"max_tokens", 2}});
  EXPECT_EQ(c.status, 503);
  EXPECT_EQ(c.json()["error"]["code"], "service_unavailable");
  EXPECT_EQ(http.get(base + "/metrics").status, 200);  // metrics stay open (empty counts)
  // Before set(), a submit that got past the front is refused, not crashed.
  EXPECT_THROW(client.submit(GenRequest{}, [](const StepOutput&) {}), Error);

  testing::FakeEngine engine;
  client.set(&engine);
  mon.ready();
  EXPECT_EQ(http.get(base + "/health").status, 200);
  EXPECT_EQ(http.get(base + "/ready").status, 200);
  auto ok =
      http.post(base + "/v1/completions", json{{"prompt", json::array({1, 2})}, {"max_tokens", 2}});
  EXPECT_EQ(ok.status, 200) << ok.body;
  server.stop();
}

}  // namespace
}  // namespace tandem
