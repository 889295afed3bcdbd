// The worker's metrics alone (metrics.h): where an observation lands among the buckets, the steps and tokens
// counted by kind, the recent step times kept and their median and 90th percentile (what the descriptor
// reports), and the Prometheus text a scrape gets (numbers as prometheus_client writes them, so a dashboard's
// le="0.1" finds its bucket; escaped labels; cumulative buckets). No sockets, no gRPC: `bazel test
// //worker/server:metrics_test`, or the CMake target dgr-worker-unit-tests (tests/worker/test_worker_units.py).
#include "unit_check.h"
#include "metrics/metrics.h"

#include <string>
#include <thread>
#include <vector>

namespace {

using dgr::Histogram;
using dgr::LATENCY_BUCKETS;
using dgr::Metrics;

bool has(const std::string & text, const std::string & line) { return text.find(line + "\n") != std::string::npos; }

void observations_land_in_their_bucket() {
    Histogram h;
    h.observe(0.0);                                  // below the first bound: the first bucket
    h.observe(1e-4);                                 // on a bound: that bucket (le is "less or equal")
    h.observe(1.5e-4);
    h.observe(0.1);
    h.observe(60.0);                                 // past the last bound: only +Inf, the count
    CHECK(h.count == 5 && h.buckets[0] == 2 && h.buckets[1] == 1 && h.buckets[9] == 1);
    uint64_t in_buckets = 0;
    for (auto b : h.buckets) in_buckets += b;
    CHECK(in_buckets == 4);
    CHECK(h.sum > 60.1 && h.sum < 60.1003);
}

void steps_are_counted_by_kind_and_their_times_kept() {
    Metrics m;
    m.step(1, 2'000'000, 10'000'000);                // decode: one position
    m.step(1, 4'000'000, 30'000'000);
    m.step(1, 0, 20'000'000);
    m.step(7, 1'000'000, 70'000'000);                // prefill
    CHECK(m.steps[0] == 3 && m.steps[1] == 1 && m.tokens[0] == 3 && m.tokens[1] == 7);
    CHECK(m.queue.count == 4 && m.compute.count == 4);
    Metrics::Times d = m.times(0);
    CHECK(d.steps == 3 && d.compute_median == 20.0 && d.queue_median == 2.0);   // ms: the middle of three
    CHECK(d.compute_p90 == 30.0 && d.queue_p90 == 4.0);                         // nearest rank
    m.step(1, 6'000'000, 40'000'000);
    d = m.times(0);
    CHECK(d.compute_median == 25.0 && d.queue_median == 3.0);                   // the mean of the middle two
    CHECK(m.times(1).steps == 1 && m.times(1).compute_median == 70.0);
    Metrics ten;                                     // nearest rank: the 9th of 10, as dgr.app.bench.pipeline.pct
    for (int k = 1; k <= 10; ++k) ten.step(1, 0, int64_t(k) * 1'000'000);
    CHECK(ten.times(0).compute_p90 == 9.0 && ten.times(0).compute_median == 5.5);
    Metrics none;
    CHECK(none.times(0).steps == 0 && none.times(0).compute_median == 0);
    for (size_t k = 0; k < Metrics::STEP_TIMES_KEPT + 10; ++k) none.step(1, 0, int64_t(k));
    CHECK(none.times(0).steps == Metrics::STEP_TIMES_KEPT && none.steps[0] == Metrics::STEP_TIMES_KEPT + 10);
    none.forward(1);
    none.forward(3);
    none.forward(2);
    CHECK(none.forwards[0] == 1 && none.forwards[1] == 2);
}

void the_text_is_prometheus_clients() {
    std::string out;
    dgr::prom_family(out, "dgr_worker_steps", "counter", "engine steps");
    dgr::prom_sample(out, "dgr_worker_steps_total", "kind=\"decode\"", 3);
    dgr::prom_family(out, "dgr_worker_sessions_open", "gauge", "open sessions");
    dgr::prom_sample(out, "dgr_worker_sessions_open", "", 0.25);
    dgr::prom_sample(out, "dgr_worker_big", "", 1e20);
    dgr::prom_sample(out, "dgr_worker_tiny", "", 1e-5);
    // a counter's family carries _total (else a parser types its samples as unknown); numbers as Python's repr
    CHECK(has(out, "# HELP dgr_worker_steps_total engine steps") && has(out, "# TYPE dgr_worker_steps_total counter"));
    CHECK(has(out, "dgr_worker_steps_total{kind=\"decode\"} 3.0"));
    CHECK(has(out, "# TYPE dgr_worker_sessions_open gauge") && has(out, "dgr_worker_sessions_open 0.25"));
    CHECK(has(out, "dgr_worker_big 1e+20") && has(out, "dgr_worker_tiny 1e-05"));
    CHECK(dgr::prom_escape("a\"b\\c\nd") == "a\\\"b\\\\c\\nd");

    Histogram a, b;
    a.observe(0.0002);
    a.observe(0.2);
    b.observe(20.0);
    std::string h;
    dgr::prom_histogram(h, "dgr_worker_transit_seconds", "transit", "hop", {{"stage \"1\"", &a}, {"2", &b}});
    CHECK(has(h, "# TYPE dgr_worker_transit_seconds histogram"));
    CHECK(has(h, "dgr_worker_transit_seconds_bucket{hop=\"stage \\\"1\\\"\",le=\"0.0001\"} 0.0"));
    CHECK(has(h, "dgr_worker_transit_seconds_bucket{hop=\"stage \\\"1\\\"\",le=\"0.00025\"} 1.0"));
    CHECK(has(h, "dgr_worker_transit_seconds_bucket{hop=\"stage \\\"1\\\"\",le=\"0.1\"} 1.0"));
    CHECK(has(h, "dgr_worker_transit_seconds_bucket{hop=\"stage \\\"1\\\"\",le=\"0.25\"} 2.0"));   // cumulative
    CHECK(has(h, "dgr_worker_transit_seconds_bucket{hop=\"stage \\\"1\\\"\",le=\"10.0\"} 2.0"));
    CHECK(has(h, "dgr_worker_transit_seconds_bucket{hop=\"2\",le=\"10.0\"} 0.0"));
    CHECK(has(h, "dgr_worker_transit_seconds_bucket{hop=\"2\",le=\"+Inf\"} 1.0"));
    CHECK(has(h, "dgr_worker_transit_seconds_count{hop=\"2\"} 1.0") && has(h, "dgr_worker_transit_seconds_sum{hop=\"2\"} 20.0"));
    std::string u;
    dgr::prom_histogram(u, "dgr_worker_queue_seconds", "queue", "", {{"", &b}});
    CHECK(has(u, "dgr_worker_queue_seconds_bucket{le=\"5.0\"} 0.0") && has(u, "dgr_worker_queue_seconds_count 1.0"));
    // every bound is written as it reads back
    for (double bound : LATENCY_BUCKETS) {
        std::string one;
        dgr::prom_sample(one, "x", "", bound);
        CHECK(std::stod(one.substr(2)) == bound);
    }
}

void threads_count_alike() {
    Metrics m;
    std::vector<std::thread> ts;
    for (int t = 0; t < 4; ++t) ts.emplace_back([&] { for (int k = 0; k < 1000; ++k) m.step(1 + (k % 2), 1000, 1000); });
    for (auto & t : ts) t.join();
    CHECK(m.steps[0] == 2000 && m.steps[1] == 2000 && m.tokens[1] == 4000 && m.compute.count == 4000);
}

}  // namespace

// Typed errors by code name, first seen first, each counted; refusals and reaped sessions counted; a copy taken
// under the lock carries them (Describe's and the scrape's error counts come from it).
static void errors_are_counted_by_name_in_first_seen_order() {
    dgr::Metrics m;
    m.count_error("OVERLOADED");
    m.count_error("CACHE_MISS");
    m.count_error("OVERLOADED");
    m.count_overloaded();
    m.count_overloaded();
    m.count_reaped();
    const dgr::MetricCounts c = m.counts();
    CHECK(c.errors.size() == 2);
    CHECK(c.errors.size() == 2 && c.errors[0].first == "OVERLOADED" && c.errors[0].second == 2);
    CHECK(c.errors.size() == 2 && c.errors[1].first == "CACHE_MISS" && c.errors[1].second == 1);
    CHECK(c.overloaded == 2 && c.reaped == 1);
    m.count_error("CACHE_MISS");
    CHECK(c.errors.size() == 2 && c.errors[1].second == 1);   // a copy: later counts are not in it
    CHECK(m.counts().errors[1].second == 2);
}

int main() {
    errors_are_counted_by_name_in_first_seen_order();
    observations_land_in_their_bucket();
    steps_are_counted_by_kind_and_their_times_kept();
    the_text_is_prometheus_clients();
    threads_count_alike();
    return dgr::unit::finish("metrics_test");
}
