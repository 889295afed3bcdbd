// The /metrics endpoint of dgr-worker (--metrics-listen): a tiny HTTP(S) server that answers every GET with
// the worker's Prometheus text (metrics/metrics.h writes it).
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <thread>

struct ssl_ctx_st;

namespace dgr {

// A tiny HTTP/1.1 server: any GET answers `render()` as Prometheus text. One thread, one request at a time,
// each bounded (8 KiB, 5 s), so a peer that stalls holds nothing else up for long.
// With TLS files (the worker's --tls-cert/--tls-key) it speaks HTTPS only; with a CA too (--tls-ca) a client
// must present a certificate that CA signed (as prometheus_client's TLS options do).
class MetricsServer {
  public:
    // binds HOST:PORT (port 0 picks one); throws std::runtime_error saying why it cannot
    MetricsServer(const std::string & host, const std::string & port, std::function<std::string()> render,
                  const std::string & tls_cert = "", const std::string & tls_key = "", const std::string & tls_ca = "");
    ~MetricsServer();
    int port() const { return port_; }

  private:
    void run();
    int fd_ = -1, port_ = 0;
    ssl_ctx_st * ssl_ = nullptr;                     // OpenSSL's SSL_CTX; null: plain HTTP
    std::atomic<bool> stop_{false};
    std::function<std::string()> render_;
    std::thread thread_;
};

}  // namespace dgr
