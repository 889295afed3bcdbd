// What the worker counts and the Prometheus text it is written in (metrics/metrics.h).
#include "metrics/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace dgr {

void Histogram::observe(double s) {
    size_t k = 0;
    while (k < LATENCY_BUCKETS.size() && s > LATENCY_BUCKETS[k]) ++k;
    if (k < LATENCY_BUCKETS.size()) ++buckets[k];
    ++count;
    sum += s;
}

void Metrics::count_error(const std::string & code_name) {
    std::lock_guard<std::mutex> g(mu);
    for (auto & e : errors) {
        if (e.first == code_name) {
            ++e.second;
            return;
        }
    }
    errors.emplace_back(code_name, 1);
}

void Metrics::step(int64_t n_tokens, int64_t queue_ns, int64_t compute_ns) {
    std::lock_guard<std::mutex> g(mu);
    const int kind = n_tokens == 1 ? 0 : 1;          // a decode step is one position
    ++steps[kind];
    tokens[kind] += uint64_t(n_tokens);
    queue.observe(double(queue_ns) / 1e9);
    compute.observe(double(compute_ns) / 1e9);
    recent[kind].emplace_back(compute_ns, queue_ns);
    if (recent[kind].size() > STEP_TIMES_KEPT) recent[kind].pop_front();
}

Metrics::Times Metrics::times(int kind) {
    std::vector<int64_t> c, q;
    {
        std::lock_guard<std::mutex> g(mu);
        for (auto & [cn, qn] : recent[kind]) c.push_back(cn), q.push_back(qn);
    }
    Times t;
    t.steps = c.size();
    if (c.empty()) return t;
    std::sort(c.begin(), c.end());
    std::sort(q.begin(), q.end());
    auto median = [](const std::vector<int64_t> & x) {     // statistics.median: the middle, or the mean of two
        size_t n = x.size();
        return (n % 2 ? double(x[n / 2]) : (double(x[n / 2 - 1]) + double(x[n / 2])) / 2) / 1e6;
    };
    auto p90 = [](const std::vector<int64_t> & x) {        // nearest rank, as dgr.app.bench.pipeline.pct
        const size_t rank = size_t(std::ceil(0.9 * double(x.size())));
        return double(x[std::min(x.size(), std::max<size_t>(rank, 1)) - 1]) / 1e6;
    };
    t.compute_median = median(c), t.compute_p90 = p90(c), t.queue_median = median(q), t.queue_p90 = p90(q);
    return t;
}

std::string prom_escape(const std::string & v) {
    std::string o;
    for (char c : v) {
        if (c == '\\') o += "\\\\";
        else if (c == '"') o += "\\\"";
        else if (c == '\n') o += "\\n";
        else o += c;
    }
    return o;
}

// A sample value or bucket bound as prometheus_client writes it (Python's repr: the shortest text that reads
// back exactly, "0.1", "100.0", "1e-05"), so a dashboard selecting le="0.1" finds it.
static std::string num(double v) {
    if (std::isnan(v)) return "NaN";
    if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
    char b[64];
    int p = 1;
    for (; p < 17; ++p) {
        std::snprintf(b, sizeof b, "%.*g", p, v);
        if (std::strtod(b, nullptr) == v) break;
    }
    const int e = v == 0 ? 0 : int(std::floor(std::log10(std::fabs(v))));
    std::snprintf(b, sizeof b, "%.*g", (e >= 0 && e < 16) ? std::max(p, e + 1) : p, v);   // repr: fixed below 1e16
    std::string s = b;
    if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
    return s;
}

// A counter's family is named with its _total suffix in the text format (prometheus_client's
// generate_latest), else a parser types its samples as unknown.
void prom_family(std::string & out, const std::string & name, const char * type, const std::string & help) {
    const std::string family = std::string(type) == "counter" ? name + "_total" : name;
    out += "# HELP " + family + " " + help + "\n# TYPE " + family + " " + type + "\n";
}

void prom_sample(std::string & out, const std::string & name, const std::string & labels, double v) {
    out += name + (labels.empty() ? "" : "{" + labels + "}") + " " + num(v) + "\n";
}

void prom_histogram(std::string & out, const std::string & name, const std::string & help, const std::string & label,
                    const std::vector<std::pair<std::string, const Histogram *>> & series) {
    prom_family(out, name, "histogram", help);
    for (auto & [lv, h] : series) {
        const std::string pre = label.empty() ? "" : label + "=\"" + prom_escape(lv) + "\",";
        uint64_t cum = 0;
        for (size_t k = 0; k < LATENCY_BUCKETS.size(); ++k) {
            cum += h->buckets[k];
            prom_sample(out, name + "_bucket", pre + "le=\"" + num(LATENCY_BUCKETS[k]) + "\"", double(cum));
        }
        prom_sample(out, name + "_bucket", pre + "le=\"+Inf\"", double(h->count));
        const std::string l = label.empty() ? "" : label + "=\"" + prom_escape(lv) + "\"";
        prom_sample(out, name + "_count", l, double(h->count));
        prom_sample(out, name + "_sum", l, h->sum);
    }
}

}  // namespace dgr
