// dgr-worker: one stage of a bundle served over gRPC (dgr.v1.Stage and grpc.health.v1.Health), with no
// Python at run time. Its flags are `dgr worker serve`'s (tools/dgr/cli/commands/worker.py); docs/worker.md
// says what it serves (phases 1 and 2) and what is still to come.
//
//   dgr-worker --bundle DIR --stage N [--listen HOST:PORT] [--n-ctx N] [--max-sessions N] ...
//   dgr-worker --fake-engine SPEC --stage N ...        (the fake engine, worker/fake: tests)
//   dgr-worker --blake3 FILE [--blake3 FILE ...]       (hidden: the BLAKE3 of each file, as `b3sum` prints it)
//
// Before anything loads it, the bundle's stage file is checked against the manifest chunk by chunk
// (dgr.toolchain.bundle.verify_bundle's check and messages; docs/worker.md "Stage file check"); --no-verify skips the
// hashing (not the size check) when `dgr worker serve` has just verified the bundle itself.
//
// Errors (bad flags, missing files, a stage out of range, a taken port) are one line on stderr and a
// non-zero exit: 2 for the command line, 1 for everything else.
//
// This file holds the flags; serving is main.cpp's parse, then stage_open.cpp (the bundle or the fake, with
// stage_check.cpp), listen.cpp (the addresses, the gRPC server) and drain.cpp (SIGTERM), over serve.h.
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "blake3.h"
#include "probe.h"
#include "serve.h"

namespace {

using dgr::serve::Listen;
using dgr::serve::Options;
using dgr::serve::Serving;
using dgr::serve::Stage;

struct UsageError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

const char * USAGE =
    "usage: dgr-worker [serve] --bundle DIR --stage N [--listen HOST:PORT] [--lane LANE] [--wire-dtype " DGR_WIRE_DTYPE_CHOICES "]\n"
    "                  [--n-ctx N] [--max-sessions N] [--threads N] [--max-message-bytes N] [--max-batch-tokens N]\n"
    "                  [--max-batch-sessions N] [--hold-batch N] [--session-ttl S] [--max-queued-steps N]\n"
    "                  [--max-session-steps N] [--rpc-timeout S] [--link-keepalive-timeout S] [--drain-timeout S]\n"
    "                  [--tls-cert PEM --tls-key PEM [--tls-ca PEM]] [--insecure]\n"
    "                  [--advertise HOST[:PORT]] [--max-connections N] [--max-rpc-threads N] [--max-rpc-per-member N]\n"
    "                  [--send-timeout S] [--max-send-queue-bytes N] [--handshake-timeout S] [--metrics-listen HOST:PORT]\n"
    "                  [--certs DIR [--contract FILE]] [--check-config]\n"
    "       dgr-worker --probe HOST:PORT [--tls-cert PEM --tls-key PEM --tls-ca PEM] [--rpc-timeout S]\n"
    "                  [--prefix-cache-mib N] [--prefix-cache-shared] [--draft-max N]\n"
    "                  [--max-grammar-bytes N] [--max-grammar-depth N] [--peer-allow CIDR,...] [--max-rpc-memory-mib N]\n"
    "                  [--max-sessions-per-member N] [--max-queued-steps-per-member N] [--fast-kernels]\n"
    "                  [--kernels reference|invariant|fast] [--poll N]\n"
    "Serves one stage of a bundle (dgr.v1.Stage over gRPC, grpc.health.v1) as `dgr worker serve` does.\n"
    "TLS with --tls-cert/--tls-key (`dgr certs issue`); with --tls-ca, mutual TLS: peers need a certificate the CA\n"
    "signed, and a session's frames are taken only from the members that opened it (docs/worker.md).\n"
    "Bounds: --max-connections (256) connections with a Frames stream, --max-rpc-threads (256) unary calls at once,\n"
    "--max-rpc-per-member (64) one member's unary calls running or waiting,\n"
    "--max-message-bytes both ways, --max-queued-steps/--max-session-steps, --max-send-queue-bytes (64 MiB) per\n"
    "reply stream and link, --send-timeout (10 s) for one write: a peer that stops reading fails its own stream;\n"
    "--handshake-timeout (10 s): a connection that has not finished its TLS handshake and HTTP/2 preface is closed.\n"
    "--max-rpc-memory-mib (1024): gRPC's buffers, all connections together; 100 calls per connection, 16 KiB of headers.\n"
    "--peer-allow CIDR,... (10.0.0.0/8,fd00::/8): the networks a route's hops and origins may be in; a name must resolve\n"
    "only to addresses inside them. Peers are always TCP HOST:PORT (no unix: or other gRPC target schemes).\n"
    "The open-files limit's soft value is raised to its hard one at start; --max-connections must leave room below it.\n"
    "--prefix-cache-mib (256): what closed sessions' KV held, kept for later sessions that start with the same\n"
    "tokens (docs/worker.md \"Prefix cache\"; 0: off). Under mutual TLS each member finds only the prefixes its own\n"
    "sessions left; --prefix-cache-shared lets any member's session at stage 0 start from them (a hit then tells a\n"
    "member that someone sent that prefix: docs/security.md).\n"
    "--max-grammar-bytes (262144), --max-grammar-depth (64): the largest Sampling.grammar or json_schema a session\n"
    "may ask for, and how deeply it may nest, checked before it is parsed. --max-sessions-per-member (0: off): the\n"
    "sessions one member (the certificate that opened them here, under mutual TLS) may hold at once.\n"
    "--max-queued-steps-per-member (0: off): the steps one member's sessions may have queued here at once.\n"
    "--draft-max (8): the drafts one step may carry and still roll back where the cache keeps per-step snapshots\n"
    "(DeepSeek V4 and other hybrids llama.cpp rolls back; each is one more copy of the recurrent state): speculation\n"
    "and MTP drafts (docs/speculation.md). 0: such a stage cannot roll back.\n"
    "--kernels: the CPU kernel set. reference (the default): ggml's reference kernels, each row alone. invariant:\n"
    "ggml's batch-invariant dispatch (flash attention's tiled kernel for every number of queries; repacked Q4_K's\n"
    "gemm and Q6_K's tiled GEMM, each with a one-row path that rounds as it does; vec_dot for other types; also\n"
    "exact under any batching, as fast as stock llama.cpp on K-quant models; docs/batching.md). fast: what\n"
    "--fast-kernels gives.\n"
    "--poll N (0): with --threads above 1, ggml's polling level (0-100): how long the compute threads spin waiting\n"
    "for the next step before they sleep. 0 sleeps at once (a stage sharing its cores); 50, llama.cpp's default,\n"
    "keeps a dedicated host's threads hot between decode steps (about 2% faster decode at 2 threads here).\n"
    "--fast-kernels: llama.cpp's shape-dependent fast CPU kernels instead of the batch-invariant reference ones\n"
    "(faster prefill; a session's results then depend on the batch). Its numerics say so (Describe's\n"
    "identity.numerics, docs/numerics.md): clients refuse a route that mixes it with reference-kernel stages.\n"
    "--certs DIR: advertise the certificates (`dgr certify`, DIR/*.json) for exactly this worker's identity, whose\n"
    "contract (--contract FILE, else the path each records) is unchanged and whose figures all passed; others are\n"
    "logged with the reason and ignored. --metrics-listen: Prometheus text at http(s)://HOST:PORT/metrics (https,\n"
    "and client certificates under --tls-ca, with TLS).\n"
    "The stage file is checked against the bundle manifest, chunk by chunk (BLAKE3), before the engine loads it;\n"
    "--no-verify checks only its size (for `dgr worker serve`, which has just verified the bundle).\n"
    "--probe HOST:PORT: ask that worker's health service (exit 0 and SERVING, else 1), presenting the TLS files\n"
    "given and checking its certificate under the first host theirs names (a pod's exec probe of itself).\n"
    "--check-config: check everything a start checks (the flags, the address and its trust, the TLS files, the\n"
    "bundle's stage file against its manifest, the engine opening the stage), print one line and exit 0, serving\n"
    "nothing; else exit 1 (2 for a flag) saying what is wrong.\n"
    "The engine library is $DGR_ENGINE_LIB, else libdgr_engine.so beside this program.\n"
    "--fake-engine SPEC --stage N (instead of --bundle): stage N of the fake model SPEC (tests; docs/worker.md \"The\n"
    "fake engine\") on $DGR_FAKE_ENGINE_LIB, else libdgr_fake_engine.so beside this program.\n";

int64_t to_int(const std::string & flag, const std::string & v) {
    try {
        size_t used = 0;
        long long x = std::stoll(v, &used);
        if (used != v.size()) throw std::invalid_argument(v);
        return x;
    } catch (const std::exception &) {
        throw UsageError("argument " + flag + ": invalid int value: '" + v + "'");
    }
}

double to_float(const std::string & flag, const std::string & v) {
    try {
        size_t used = 0;
        double x = std::stod(v, &used);
        if (used != v.size()) throw std::invalid_argument(v);
        return x;
    } catch (const std::exception &) {
        throw UsageError("argument " + flag + ": invalid float value: '" + v + "'");
    }
}

// SESSION:EPOCH:POSITION, a step of the tests' hooks (--test-die-at ...; tools/dgr/cli/commands/worker.py _die_at)
std::tuple<std::string, uint64_t, int64_t> step_at(const std::string & flag, const std::string & v) {
    auto a = v.find(':'), b = a == std::string::npos ? a : v.find(':', a + 1);
    auto digits = [](const std::string & t) { return !t.empty() && t.find_first_not_of("0123456789") == std::string::npos; };
    std::string sid = v.substr(0, a), ep = a == std::string::npos ? "" : v.substr(a + 1, b - a - 1),
                pos = b == std::string::npos ? "" : v.substr(b + 1);
    if (sid.empty() || !digits(ep) || !digits(pos)) throw UsageError(flag + " '" + v + "': give SESSION:EPOCH:POSITION");
    try {
        return {sid, std::stoull(ep), std::stoll(pos)};
    } catch (const std::exception &) {
        throw UsageError(flag + " '" + v + "': give SESSION:EPOCH:POSITION");
    }
}

// --test-peer-address ADDR (hidden, tests; repeatable): the verdict of refuse_peer_address under the
// --peer-allow given, one line each in order, "ok" or "refused: WHY", then exit
std::vector<std::string> peer_addresses;

Options parse(int argc, char ** argv) {
    Options o;
    std::map<std::string, std::function<void(const std::string &)>> takes = {
        {"--bundle", [&](auto & v) { o.bundle = v; }},
        {"--blake3", [&](auto & v) { o.blake3_files.push_back(v); }},
        {"--test-peer-address", [&](auto & v) { peer_addresses.push_back(v); }},
        {"--probe", [&](auto & v) { o.probe = v; }},
        {"--fake-engine", [&](auto & v) { o.fake_engine = v; }},
        {"--stage", [&](auto & v) { o.stage = int(to_int("--stage", v)); o.stage_given = true; }},
        {"--listen", [&](auto & v) { o.listen = v; }},
        {"--lane", [&](auto & v) { o.lane = v; }},
        {"--wire-dtype", [&](auto & v) { o.wire_dtype = v; }},
        {"--max-message-bytes", [&](auto & v) {
             int64_t x = to_int("--max-message-bytes", v);
             if (x <= int64_t(dgr::FRAME_OVERHEAD)) throw UsageError("--max-message-bytes must be more than " + std::to_string(dgr::FRAME_OVERHEAD));
             o.max_message_bytes = uint64_t(x); }},
        {"--max-batch-tokens", [&](auto & v) { o.limits.max_batch_tokens = to_int("--max-batch-tokens", v); }},
        {"--max-batch-sessions", [&](auto & v) { o.limits.max_batch_sessions = to_int("--max-batch-sessions", v); }},
        {"--hold-batch", [&](auto & v) { o.limits.hold_batch = std::max<int64_t>(0, to_int("--hold-batch", v)); }},
        {"--test-die-at", [&](auto & v) { o.limits.die_at.insert(step_at("--test-die-at", v)); }},
        {"--test-stop-at", [&](auto & v) { o.limits.stop_at.insert(step_at("--test-stop-at", v)); }},
        {"--test-evict-at", [&](auto & v) { o.limits.evict_at.insert(step_at("--test-evict-at", v)); }},
        {"--test-break-origin-link-at", [&](auto & v) {
             o.limits.break_origin_link_at.insert(step_at("--test-break-origin-link-at", v)); }},
        {"--n-ctx", [&](auto & v) { o.n_ctx = to_int("--n-ctx", v); }},
        {"--max-sessions", [&](auto & v) { o.max_sessions = to_int("--max-sessions", v); }},
        {"--threads", [&](auto & v) { o.threads = to_int("--threads", v); }},
        {"--poll", [&](auto & v) {
             o.poll = to_int("--poll", v);
             if (o.poll < 0 || o.poll > 100) throw UsageError("argument --poll: must be 0-100, got " + v);
         }},
        {"--kernels", [&](auto & v) {
             if (v != "reference" && v != "invariant" && v != "fast") {
                 throw UsageError("argument --kernels: invalid choice: '" + v + "' (choose from 'reference', 'invariant', 'fast')");
             }
             o.kernels = v;
         }},
        {"--session-ttl", [&](auto & v) { o.limits.session_ttl_s = std::max(0.0, to_float("--session-ttl", v)); }},
        {"--max-queued-steps", [&](auto & v) { o.limits.max_queued_steps = to_int("--max-queued-steps", v); }},
        {"--max-session-steps", [&](auto & v) { o.limits.max_session_steps = to_int("--max-session-steps", v); }},
        {"--max-queued-steps-per-member", [&](auto & v) {
             o.limits.max_queued_steps_per_member = std::max<int64_t>(0, to_int("--max-queued-steps-per-member", v)); }},
        {"--rpc-timeout", [&](auto & v) { o.limits.rpc_timeout_s = to_float("--rpc-timeout", v); }},
        {"--link-keepalive-timeout", [&](auto & v) { o.limits.link_keepalive_timeout_s = to_float("--link-keepalive-timeout", v); }},
        {"--drain-timeout", [&](auto & v) { o.limits.drain_timeout_s = to_float("--drain-timeout", v); }},
        {"--tls-cert", [&](auto & v) { o.tls_cert = v; }},
        {"--tls-key", [&](auto & v) { o.tls_key = v; }},
        {"--tls-ca", [&](auto & v) { o.tls_ca = v; }},
        {"--metrics-listen", [&](auto & v) { o.metrics_listen = v; }},
        {"--certs", [&](auto & v) { o.certs = v; }},
        {"--contract", [&](auto & v) { o.contract = v; }},
        {"--advertise", [&](auto & v) { o.advertise = v; }},
        {"--max-connections", [&](auto & v) { o.limits.max_connections = to_int("--max-connections", v); }},
        {"--max-rpc-threads", [&](auto & v) { o.limits.max_rpc_threads = to_int("--max-rpc-threads", v); }},
        {"--max-rpc-per-member", [&](auto & v) { o.limits.max_rpc_per_member = to_int("--max-rpc-per-member", v); }},
        {"--send-timeout", [&](auto & v) { o.limits.send_timeout_s = to_float("--send-timeout", v); }},
        {"--handshake-timeout", [&](auto & v) { o.handshake_timeout_s = to_float("--handshake-timeout", v); }},
        {"--max-send-queue-bytes", [&](auto & v) { o.limits.max_send_queue_bytes = to_int("--max-send-queue-bytes", v); }},
        {"--draft-max", [&](auto & v) { o.draft_max = std::clamp<int64_t>(to_int("--draft-max", v), 0, 64); }},
        {"--peer-allow", [&](auto & v) {
             try {
                 o.net = dgr::parse_peer_allow(v);
             } catch (const std::invalid_argument & e) {
                 throw UsageError(e.what());
             } }},
        {"--max-rpc-memory-mib", [&](auto & v) { o.max_rpc_memory_mib = to_int("--max-rpc-memory-mib", v); }},
        {"--prefix-cache-mib", [&](auto & v) { o.limits.prefix_cache_mib = std::max<int64_t>(0, to_int("--prefix-cache-mib", v)); }},
        {"--max-grammar-bytes", [&](auto & v) { o.limits.max_grammar_bytes = to_int("--max-grammar-bytes", v); }},
        {"--max-grammar-depth", [&](auto & v) { o.limits.max_grammar_depth = to_int("--max-grammar-depth", v); }},
        {"--max-sessions-per-member", [&](auto & v) { o.limits.max_sessions_per_member = std::max<int64_t>(0, to_int("--max-sessions-per-member", v)); }},
    };
    // `dgr-worker serve ...` is `dgr-worker ...`: the words of `dgr worker serve`, and of the units and
    // scripts written for a release's bin/dgr-worker when it was a launcher of it
    const int first = argc > 1 && std::string(argv[1]) == "serve" ? 2 : 1;
    for (int i = first; i < argc; ++i) {
        std::string a = argv[i];
        if (a == "-h" || a == "--help") {
            std::fputs(USAGE, stdout);
            std::exit(0);
        }
        if (a == "--insecure") { o.insecure = true; continue; }
        if (a == "--no-verify") { o.no_verify = true; continue; }
        if (a == "--check-config") { o.check_config = true; continue; }
        if (a == "--prefix-cache-shared") { o.limits.prefix_cache_shared = true; continue; }
        if (a == "--fast-kernels") { o.fast_kernels = true; continue; }
        std::string flag = a, value;
        bool inline_value = false;
        if (auto eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
            flag = a.substr(0, eq), value = a.substr(eq + 1), inline_value = true;
        }
        auto it = takes.find(flag);
        if (it == takes.end()) throw UsageError("unrecognized argument: " + a);
        if (!inline_value) {
            if (i + 1 >= argc) throw UsageError("argument " + flag + ": expected one argument");
            value = argv[++i];
        }
        it->second(value);
    }
    if (!o.blake3_files.empty() || !peer_addresses.empty() || !o.probe.empty()) return o;
    if (!o.stage_given) throw UsageError("the following arguments are required: --stage");
    return o;
}

int run(int argc, char ** argv) {
    Options o = parse(argc, argv);
    if (!o.blake3_files.empty()) {                   // --blake3 FILE: the digest of each, `b3sum`'s format
        for (auto & f : o.blake3_files) std::printf("%s  %s\n", dgr::blake3_file(f).c_str(), f.c_str());
        return 0;
    }
    if (!o.probe.empty()) return dgr::probe_health(o.probe, dgr::TlsFiles{o.tls_cert, o.tls_key, o.tls_ca}, o.limits.rpc_timeout_s);
    if (!peer_addresses.empty()) {
        for (auto & a : peer_addresses) {
            const std::string why = dgr::refuse_peer_address(a, o.net);
            std::printf("%s\n", why.empty() ? "ok" : ("refused: " + why).c_str());
        }
        return 0;
    }
    if (o.bundle.empty() == o.fake_engine.empty()) throw UsageError("give exactly one of --bundle BUNDLE or --fake-engine SPEC");
    if (o.fast_kernels && !o.kernels.empty() && o.kernels != "fast") {
        throw UsageError("--fast-kernels and --kernels " + o.kernels + " ask for two kernel sets; give one");
    }
    for (auto & [flag, v] : {std::pair<const char *, int64_t>{"--max-queued-steps", o.limits.max_queued_steps},
                             {"--max-session-steps", o.limits.max_session_steps},
                             {"--max-batch-sessions", o.limits.max_batch_sessions},
                             {"--max-connections", o.limits.max_connections},
                             {"--max-grammar-bytes", o.limits.max_grammar_bytes},
                             {"--max-grammar-depth", o.limits.max_grammar_depth},
                             {"--max-rpc-threads", o.limits.max_rpc_threads},
                             {"--max-rpc-per-member", o.limits.max_rpc_per_member}}) {
        if (v < 1) throw std::runtime_error(std::string(flag) + " must be at least 1");
    }
    if (o.max_rpc_memory_mib < 16 || o.max_rpc_memory_mib > 1048576) {
        throw std::runtime_error("--max-rpc-memory-mib must be at least 16 and at most 1048576");
    }
    if (o.max_sessions < 1) throw std::runtime_error("--max-sessions must be at least 1");
    if (o.limits.send_timeout_s <= 0) throw std::runtime_error("--send-timeout must be more than 0 seconds");
    if (!(o.handshake_timeout_s > 0 && o.handshake_timeout_s <= 3600)) {
        throw std::runtime_error("--handshake-timeout must be more than 0 and at most 3600 seconds");
    }
    if (o.limits.max_send_queue_bytes < int64_t(o.max_message_bytes + dgr::FRAME_OVERHEAD)) {
        throw std::runtime_error("--max-send-queue-bytes must hold one message: at least --max-message-bytes + " +
                                 std::to_string(dgr::FRAME_OVERHEAD) + " (" + std::to_string(o.max_message_bytes + dgr::FRAME_OVERHEAD) + ")");
    }
    if (o.n_ctx < 0) throw std::runtime_error("--n-ctx must not be negative");
    // what dgr-worker does not do yet is refused, never silently ignored (docs/worker.md)
    const dgr::Trust trust = dgr::tls_trust(dgr::TlsFiles{o.tls_cert, o.tls_key, o.tls_ca});
    const Listen l = check_listen(o, trust);
    dgr::serve::raise_open_files(o);

    Stage s;
    struct Closer {                                  // before the open: a refusal after the engine opened closes it
        Stage & s;
        ~Closer() { if (s.eng) s.lib.close(s.eng); }
    } closer{s};
    if (o.fake_engine.empty()) open_stage(o, s);
    else open_fake_stage(o, s);
    // this program's own bytes (docs/certification.md): a certificate names the worker binary it measured
    s.id.worker_blake3 = dgr::blake3_file("/proc/self/exe");
    if (o.check_config) {                            // everything a start checks has passed: say so, serve nothing
        dgr_stage_info info{};
        if (int32_t st = s.lib.describe(s.eng, &info); st != DGR_OK) throw std::runtime_error(s.lib.error(st));
        std::printf("ok: stage %d [%d, %d) of %s (bundle %.12s), %s lane, numerics '%s'; would serve on %s (%s); "
                    "every flag parses, %s\n", s.id.stage_index, info.layer_begin, info.layer_end,
                    o.fake_engine.empty() ? o.bundle.c_str() : ("fake model " + o.fake_engine).c_str(), s.id.bundle_id.c_str(),
                    s.id.lane.c_str(), s.id.numerics.c_str(), o.listen.c_str(),
                    trust.mutual ? "mutual TLS" : trust.tls ? "TLS" : "plaintext",
                    o.fake_engine.empty() ? (o.no_verify ? "the stage file's size matches the manifest (--no-verify)"
                                                         : "the stage file matches the manifest")
                                          : "the fake engine opened");
        return 0;
    }

    Serving sv = serve(o, trust, l, s);
    serve_until_signal(o, s, sv);                    // drains, then leaves the process
}

}  // namespace

int main(int argc, char ** argv) {
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
    try {
        return run(argc, argv);
    } catch (const UsageError & e) {
        std::fprintf(stderr, "dgr-worker: error: %s (dgr-worker --help lists the flags)\n", e.what());
        return 2;
    } catch (const std::exception & e) {
        std::fprintf(stderr, "dgr-worker: error: %s\n", e.what());
        return 1;
    } catch (...) {
        std::fprintf(stderr, "dgr-worker: error: unknown exception\n");
        return 1;
    }
}
