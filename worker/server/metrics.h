// dgr-worker's Prometheus metrics (--metrics-listen): the names, labels, buckets and help texts users'
// dashboards read (docs/wire.md "Metrics and the descriptor"), served as Prometheus text over HTTP(S).
// Events are counted where they happen; gauges and the counts the worker already keeps are read from it at
// scrape time (StageWorker::metrics_text).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

struct ssl_ctx_st;

namespace dgr {

// the histograms' bucket bounds (seconds)
constexpr std::array<double, 16> LATENCY_BUCKETS = {1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                                                    5e-2, 0.1,    0.25,   0.5,  1.0,  2.5,    5.0,  10.0};

struct Histogram {
    std::array<uint64_t, LATENCY_BUCKETS.size()> buckets{};   // not cumulative; rendered cumulative
    uint64_t count = 0;
    double sum = 0;
    void observe(double seconds);
};

// What the worker counts as it goes (one mutex: a few increments per step).
struct Metrics {
    std::mutex mu;
    uint64_t steps[2] = {0, 0}, tokens[2] = {0, 0};   // [decode, prefill]
    uint64_t sampled = 0, opened = 0, seam_in = 0, seam_out = 0;
    uint64_t mtp_drafted = 0;                        // tokens the MTP block drafted (last stage, issue 22)
    Histogram queue, compute, transit_step, transit_token;
    // the last STEP_TIMES_KEPT steps of each kind, (compute_ns, queue_ns): the descriptor's medians
    static constexpr size_t STEP_TIMES_KEPT = 1024;
    std::deque<std::pair<int64_t, int64_t>> recent[2];
    void step(int64_t n_tokens, int64_t queue_ns, int64_t compute_ns);
    uint64_t forwards[2] = {0, 0};                   // engine forwards of [one session's steps, several sessions']
    void forward(size_t n_steps) {
        std::lock_guard<std::mutex> g(mu);
        ++forwards[n_steps > 1 ? 1 : 0];
    }
    // median and 90th percentile (nearest rank) of recent[kind] in ms
    struct Times { uint64_t steps = 0; double compute_median = 0, compute_p90 = 0, queue_median = 0, queue_p90 = 0; };
    Times times(int kind);
};

// Prometheus text helpers (the exposition format prometheus_client writes).
std::string prom_escape(const std::string & v);
void prom_family(std::string & out, const std::string & name, const char * type, const std::string & help);
void prom_sample(std::string & out, const std::string & name, const std::string & labels, double v);
void prom_histogram(std::string & out, const std::string & name, const std::string & help, const std::string & label,
                    const std::vector<std::pair<std::string, const Histogram *>> & series);

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
