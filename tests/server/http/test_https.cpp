// TLS on the HTTP front (--ssl-certfile / --ssl-keyfile): a self-signed certificate made here
// with the OpenSSL API, libcurl verifying it: JSON requests, keep-alive (one connection for
// several requests), SSE streaming, a plain-HTTP client refused without harm, and clear errors
// for a missing or mismatched certificate / key.
#include <curl/curl.h>
#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "core/error.h"
#include "server/http/fake_engine.h"
#include "server/http/http_client.h"
#include "server/http/http_server.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;

// A self-signed certificate for 127.0.0.1 / localhost and its key, as PEM files in `dir`.
struct SelfSigned {
  std::string cert, key;
};

bool write_pem(const std::string& path, EVP_PKEY* pkey, X509* x509) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return false;
  const bool ok = pkey ? PEM_write_PrivateKey(f, pkey, nullptr, nullptr, 0, nullptr, nullptr) == 1
                       : PEM_write_X509(f, x509) == 1;
  std::fclose(f);
  return ok;
}

SelfSigned make_self_signed(const fs::path& dir, const std::string& name) {
  fs::create_directories(dir);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> pkey(EVP_EC_gen("P-256"), EVP_PKEY_free);
  EXPECT_NE(pkey, nullptr);
  std::unique_ptr<X509, decltype(&X509_free)> x(X509_new(), X509_free);
  X509_set_version(x.get(), 2);
  ASN1_INTEGER_set(X509_get_serialNumber(x.get()), 1);
  X509_gmtime_adj(X509_getm_notBefore(x.get()), -60);
  X509_gmtime_adj(X509_getm_notAfter(x.get()), 3600);
  X509_set_pubkey(x.get(), pkey.get());
  X509_NAME* subject = X509_get_subject_name(x.get());
  X509_NAME_add_entry_by_txt(subject, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("localhost"), -1, -1, 0);
  X509_set_issuer_name(x.get(), subject);
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, x.get(), x.get(), nullptr, nullptr, 0);
  for (auto [nid, value] : {std::pair{NID_subject_alt_name, "IP:127.0.0.1,DNS:localhost"},
                            std::pair{NID_basic_constraints, "critical,CA:TRUE"}}) {
    X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
    EXPECT_NE(ext, nullptr);
    X509_add_ext(x.get(), ext, -1);
    X509_EXTENSION_free(ext);
  }
  EXPECT_GT(X509_sign(x.get(), pkey.get(), EVP_sha256()), 0);
  SelfSigned s{(dir / (name + ".crt")).string(), (dir / (name + ".key")).string()};
  EXPECT_TRUE(write_pem(s.cert, nullptr, x.get()));
  EXPECT_TRUE(write_pem(s.key, pkey.get(), nullptr));
  return s;
}

// One curl handle trusting `ca`: requests on it reuse the connection.
class TlsClient {
 public:
  explicit TlsClient(std::string ca) : ca_(std::move(ca)) {
    static const bool init = curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK;
    (void)init;
    curl_ = curl_easy_init();
  }
  ~TlsClient() { curl_easy_cleanup(curl_); }

  HttpResult request(const std::string& url, const std::string& body = "",
                     long* connects = nullptr) {
    HttpResult r;
    curl_easy_reset(curl_);
    curl_easy_setopt(curl_, CURLOPT_URL, url.c_str());
    curl_easy_setopt(curl_, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl_, CURLOPT_TIMEOUT_MS, 20000L);
    curl_easy_setopt(curl_, CURLOPT_CAINFO, ca_.c_str());
    curl_easy_setopt(curl_, CURLOPT_WRITEFUNCTION, &write_cb);
    curl_easy_setopt(curl_, CURLOPT_WRITEDATA, &r.body);
    curl_slist* list = curl_slist_append(nullptr, "Content-Type: application/json");
    curl_easy_setopt(curl_, CURLOPT_HTTPHEADER, list);
    if (!body.empty()) {
      curl_easy_setopt(curl_, CURLOPT_POSTFIELDS, body.data());
      curl_easy_setopt(curl_, CURLOPT_POSTFIELDSIZE_LARGE, curl_off_t(body.size()));
    }
    r.code = curl_easy_perform(curl_);
    curl_easy_getinfo(curl_, CURLINFO_RESPONSE_CODE, &r.status);
    if (connects) curl_easy_getinfo(curl_, CURLINFO_NUM_CONNECTS, connects);
    curl_slist_free_all(list);
    return r;
  }

 private:
  static size_t write_cb(char* p, size_t size, size_t n, void* ud) {
    static_cast<std::string*>(ud)->append(p, size * n);
    return size * n;
  }
  std::string ca_;
  CURL* curl_ = nullptr;
};

class HttpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("tandem_tls_" + std::to_string(::getpid()));
    cert_ = make_self_signed(dir_, "server");
  }
  void TearDown() override {
    server_.reset();
    engine_.reset();
    fs::remove_all(dir_);
  }
  void start(HttpServerConfig cfg) {
    engine_ = std::make_unique<FakeEngine>();
    cfg.host = "127.0.0.1";
    cfg.port = 0;
    server_ = std::make_unique<HttpServer>(cfg, *engine_, nullptr, nullptr);
    server_->start();
  }
  std::string url(const std::string& scheme, const std::string& path) const {
    return scheme + "://127.0.0.1:" + std::to_string(server_->port()) + path;
  }

  fs::path dir_;
  SelfSigned cert_;
  std::unique_ptr<FakeEngine> engine_;
  std::unique_ptr<HttpServer> server_;
};

TEST_F(HttpsTest, ServesJsonKeepAliveAndSseOverTls) {
  HttpServerConfig cfg;
  cfg.ssl_certfile = cert_.cert;
  cfg.ssl_keyfile = cert_.key;
  start(cfg);
  TlsClient client(cert_.cert);
  long connects = -1;
  const HttpResult models = client.request(url("https", "/v1/models"), "", &connects);
  ASSERT_EQ(models.code, CURLE_OK) << curl_easy_strerror(models.code);
  EXPECT_EQ(models.status, 200);
  EXPECT_EQ(models.json()["data"][0]["id"], "tandem");
  EXPECT_EQ(connects, 1);
  // A completion, then a stream, then another completion: one TLS connection for all.
  const nlohmann::json comp = {
      {"model", "tandem"}, {"prompt", std::vector<int>{5, 6}}, {"max_tokens", 4}};
  const HttpResult a = client.request(url("https", "/v1/completions"), comp.dump(), &connects);
  ASSERT_EQ(a.code, CURLE_OK);
  EXPECT_EQ(a.status, 200) << a.body;
  EXPECT_EQ(connects, 0) << "keep-alive: the connection is reused";
  nlohmann::json stream = comp;
  stream["stream"] = true;
  stream["max_tokens"] = 6;
  const HttpResult s = client.request(url("https", "/v1/completions"), stream.dump(), &connects);
  ASSERT_EQ(s.code, CURLE_OK);
  EXPECT_EQ(connects, 0);
  const auto events = sse_events(s.body);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events.back(), "[DONE]");
  int chunks = 0;
  for (const auto& e : events) chunks += e.is_object() ? 1 : 0;
  EXPECT_GE(chunks, 6);
  const HttpResult b = client.request(url("https", "/v1/completions"), comp.dump(), &connects);
  ASSERT_EQ(b.code, CURLE_OK);
  EXPECT_EQ(connects, 0);
  EXPECT_EQ(b.json()["choices"][0]["text"], a.json()["choices"][0]["text"]);
}

TEST_F(HttpsTest, PlainHttpAndUntrustedClientsAreRefusedAndTheServerServesOn) {
  HttpServerConfig cfg;
  cfg.ssl_certfile = cert_.cert;
  cfg.ssl_keyfile = cert_.key;
  start(cfg);
  HttpClient plain;
  const HttpResult r = plain.get(url("http", "/health"));
  EXPECT_NE(r.code, CURLE_OK);  // plain bytes are not a TLS handshake: closed
  EXPECT_EQ(r.status, 0);
  const SelfSigned other = make_self_signed(dir_, "other");
  TlsClient untrusting(other.cert);  // trusts another certificate only
  EXPECT_NE(untrusting.request(url("https", "/health")).code, CURLE_OK);
  TlsClient client(cert_.cert);
  const HttpResult ok = client.request(url("https", "/health"));
  ASSERT_EQ(ok.code, CURLE_OK);
  EXPECT_EQ(ok.status, 200);
}

TEST_F(HttpsTest, BadCertificateOrKeyFilesAreRefusedByName) {
  auto error_of = [&](const std::string& crt, const std::string& key) -> std::string {
    HttpServerConfig cfg;
    cfg.ssl_certfile = crt;
    cfg.ssl_keyfile = key;
    cfg.host = "127.0.0.1";
    cfg.port = 0;
    FakeEngine engine;
    HttpServer server(cfg, engine, nullptr, nullptr);
    try {
      server.start();
    } catch (const Error& e) {
      return e.message();
    }
    return "";
  };
  const SelfSigned other = make_self_signed(dir_, "other");
  EXPECT_NE(error_of((dir_ / "missing.crt").string(), cert_.key).find("missing.crt"),
            std::string::npos);
  EXPECT_NE(error_of(cert_.cert, (dir_ / "missing.key").string()).find("missing.key"),
            std::string::npos);
  const std::string mismatch = error_of(cert_.cert, other.key);
  EXPECT_NE(mismatch.find("matches --ssl-certfile"), std::string::npos) << mismatch;
  EXPECT_NE(error_of(cert_.cert, "").find("go together"), std::string::npos);
  EXPECT_EQ(error_of(cert_.cert, cert_.key), "");
}

}  // namespace
}  // namespace tandem::testing
