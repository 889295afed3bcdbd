// dgr-worker's Prometheus metrics (--metrics-listen): what the worker counts as it goes (steps, tokens,
// forwards, histograms of queue, compute and transit times, the recent step times the descriptor's medians come
// from) and the Prometheus text format they are written in (docs/wire.md "Metrics and the descriptor").
// Events are counted where they happen; at scrape time a copy of them and of the counts the worker already keeps
// is written out (metrics/description.h), and metrics_server.h serves the text over HTTP(S).
//
// A part with its own lock (Metrics::mu, a leaf) and nothing of gRPC, sockets or TLS: metrics_test.cpp tests it
// alone.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

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

// The counters and histograms, as plain data: what Metrics holds under its lock, and a copy of them
// (Metrics::counts) is what a scrape writes out (metrics/description.h).
struct MetricCounts {
    uint64_t steps[2] = {0, 0}, tokens[2] = {0, 0};   // [decode, prefill]
    uint64_t sampled = 0, opened = 0, seam_in = 0, seam_out = 0;
    uint64_t mtp_drafted = 0;                        // tokens the MTP block drafted (the last stage)
    Histogram queue, compute, transit_step, transit_token;
    uint64_t forwards[2] = {0, 0};                   // engine forwards of [one session's steps, several sessions']
    uint64_t reaped = 0;                             // sessions closed idle (--session-ttl)
    uint64_t overloaded = 0;                         // refusals for a bound: sessions, queued steps, connections
    std::vector<std::pair<std::string, uint64_t>> errors;   // typed errors answered, by code name, first seen first
};

// What the worker counts as it goes (one mutex: a few increments per step).
struct Metrics : MetricCounts {
    std::mutex mu;
    // the last STEP_TIMES_KEPT steps of each kind, (compute_ns, queue_ns): the descriptor's medians
    static constexpr size_t STEP_TIMES_KEPT = 1024;
    std::deque<std::pair<int64_t, int64_t>> recent[2];
    void step(int64_t n_tokens, int64_t queue_ns, int64_t compute_ns);
    void forward(size_t n_steps) {
        std::lock_guard<std::mutex> g(mu);
        ++forwards[n_steps > 1 ? 1 : 0];
    }
    void count_error(const std::string & code_name);
    void count_reaped() {
        std::lock_guard<std::mutex> g(mu);
        ++reaped;
    }
    void count_overloaded() {
        std::lock_guard<std::mutex> g(mu);
        ++overloaded;
    }
    // the counters and histograms at one moment (under the lock)
    MetricCounts counts() {
        std::lock_guard<std::mutex> g(mu);
        return *this;
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

}  // namespace dgr
