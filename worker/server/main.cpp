// dgr-worker: one stage of a bundle served over gRPC (dgr.v1.Stage and grpc.health.v1.Health), with no
// Python at run time. Its flags are `dgr worker serve`'s (tools/dgr/commands/worker.py); docs/worker.md
// says what it serves (phases 1 and 2) and what is still to come.
//
//   dgr-worker --bundle DIR --stage N [--listen HOST:PORT] [--n-ctx N] [--max-sessions N] ...
//   dgr-worker --fake-engine SPEC --stage N ...        (the fake engine, worker/fake: tests)
//   dgr-worker --blake3 FILE [--blake3 FILE ...]       (hidden: the BLAKE3 of each file, as `b3sum` prints it)
//
// Before anything loads it, the bundle's stage file is checked against the manifest chunk by chunk
// (dgr.bundle.verify_bundle's check and messages; docs/worker.md "Stage file check"); --no-verify skips the
// hashing (not the size check) when `dgr worker serve` has just verified the bundle itself.
//
// Errors (bad flags, missing files, a stage out of range, a taken port) are one line on stderr and a
// non-zero exit: 2 for the command line, 1 for everything else.
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <pthread.h>
#include <limits.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <openssl/sha.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "blake3.h"
#include "gguf_header.h"
#include "nlohmann/json.hpp"
#include "worker.h"

namespace {

// The pin (toolchains/llama.cpp.pin.json) this binary was built with: its commit and patch series are
// the worker's identity, as dgr.buildinfo reads them from the checkout.
const char * PIN_JSON =
#include "dgr_pin.inc"
    ;

struct UsageError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct Options {
    std::string bundle, fake_engine, listen = "127.0.0.1:0", lane, wire_dtype;
    int stage = -1;
    bool stage_given = false, insecure = false, no_verify = false;
    std::vector<std::string> blake3_files;           // --blake3 FILE (hidden): print digests and exit
    uint64_t max_message_bytes = dgr::DEFAULT_MAX_MESSAGE_BYTES;
    int64_t n_ctx = 4096, max_sessions = 8, threads = 0;
    dgr::Limits limits;
    std::string tls_cert, tls_key, tls_ca, metrics_listen, certs, contract, advertise;
    int64_t max_rpc_threads = 256;
};

const char * USAGE =
    "usage: dgr-worker [serve] --bundle DIR --stage N [--listen HOST:PORT] [--lane LANE] [--wire-dtype f32|f16|bf16|q8_0]\n"
    "                  [--n-ctx N] [--max-sessions N] [--threads N] [--max-message-bytes N] [--max-batch-tokens N]\n"
    "                  [--max-batch-sessions N] [--hold-batch N] [--session-ttl S] [--max-queued-steps N]\n"
    "                  [--max-session-steps N] [--rpc-timeout S] [--link-keepalive-timeout S] [--drain-timeout S]\n"
    "                  [--tls-cert PEM --tls-key PEM [--tls-ca PEM]] [--insecure]\n"
    "                  [--advertise HOST[:PORT]] [--max-connections N] [--max-rpc-threads N] [--send-timeout S]\n"
    "                  [--max-send-queue-bytes N] [--metrics-listen HOST:PORT] [--certs DIR [--contract FILE]]\n"
    "                  [--prefix-cache-mib N]\n"
    "Serves one stage of a bundle (dgr.v1.Stage over gRPC, grpc.health.v1) as `dgr worker serve` does.\n"
    "TLS with --tls-cert/--tls-key (`dgr certs issue`); with --tls-ca, mutual TLS: peers need a certificate the CA\n"
    "signed, and a session's frames are taken only from the members that opened it (docs/worker.md).\n"
    "Bounds: --max-connections (256) connections with a Frames stream, --max-rpc-threads (256) gRPC threads,\n"
    "--max-message-bytes both ways, --max-queued-steps/--max-session-steps, --max-send-queue-bytes (64 MiB) per\n"
    "reply stream and link, --send-timeout (10 s) for one write: a peer that stops reading fails its own stream.\n"
    "--prefix-cache-mib (256): what closed sessions' KV held, kept for later sessions that start with the same\n"
    "tokens (docs/worker.md \"Prefix cache\"; 0: off).\n"
    "--certs DIR: advertise the certificates (`dgr certify`, DIR/*.json) for exactly this worker's identity, whose\n"
    "contract (--contract FILE, else the path each records) is unchanged and whose figures all passed; others are\n"
    "logged with the reason and ignored. --metrics-listen: Prometheus text at http(s)://HOST:PORT/metrics (https,\n"
    "and client certificates under --tls-ca, with TLS).\n"
    "The stage file is checked against the bundle manifest, chunk by chunk (BLAKE3), before the engine loads it;\n"
    "--no-verify checks only its size (for `dgr worker serve`, which has just verified the bundle).\n"
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

// SESSION:EPOCH:POSITION, a step of the tests' hooks (--test-die-at ...; tools/dgr/commands/worker.py _die_at)
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

Options parse(int argc, char ** argv) {
    Options o;
    std::map<std::string, std::function<void(const std::string &)>> takes = {
        {"--bundle", [&](auto & v) { o.bundle = v; }},
        {"--blake3", [&](auto & v) { o.blake3_files.push_back(v); }},
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
        {"--test-evict-at", [&](auto & v) { o.limits.evict_at.insert(step_at("--test-evict-at", v)); }},
        {"--test-break-origin-link-at", [&](auto & v) {
             o.limits.break_origin_link_at.insert(step_at("--test-break-origin-link-at", v)); }},
        {"--n-ctx", [&](auto & v) { o.n_ctx = to_int("--n-ctx", v); }},
        {"--max-sessions", [&](auto & v) { o.max_sessions = to_int("--max-sessions", v); }},
        {"--threads", [&](auto & v) { o.threads = to_int("--threads", v); }},
        {"--session-ttl", [&](auto & v) { o.limits.session_ttl_s = std::max(0.0, to_float("--session-ttl", v)); }},
        {"--max-queued-steps", [&](auto & v) { o.limits.max_queued_steps = to_int("--max-queued-steps", v); }},
        {"--max-session-steps", [&](auto & v) { o.limits.max_session_steps = to_int("--max-session-steps", v); }},
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
        {"--max-rpc-threads", [&](auto & v) { o.max_rpc_threads = to_int("--max-rpc-threads", v); }},
        {"--send-timeout", [&](auto & v) { o.limits.send_timeout_s = to_float("--send-timeout", v); }},
        {"--max-send-queue-bytes", [&](auto & v) { o.limits.max_send_queue_bytes = to_int("--max-send-queue-bytes", v); }},
        {"--prefix-cache-mib", [&](auto & v) { o.limits.prefix_cache_mib = std::max<int64_t>(0, to_int("--prefix-cache-mib", v)); }},
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
    if (!o.blake3_files.empty()) return o;
    if (!o.stage_given) throw UsageError("the following arguments are required: --stage");
    return o;
}

bool is_loopback(std::string host) {
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    if (host == "localhost" || host == "ip6-localhost") return true;
    in_addr a4;
    in6_addr a6;
    if (inet_pton(AF_INET, host.c_str(), &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, host.c_str(), &a6) == 1) return IN6_IS_ADDR_LOOPBACK(&a6);
    return false;
}

// Whether HOST:PORT can be bound now (as gRPC binds it, SO_REUSEADDR): checked before the engine loads, so
// a taken port fails fast and with one line (gRPC's own bind failure logs a page first).
std::string bind_error(const std::string & host, const std::string & port) {
    std::string h = host;
    if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
    addrinfo hints{}, * res = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    if (int rc = getaddrinfo(h.c_str(), port.c_str(), &hints, &res); rc != 0) return gai_strerror(rc);
    std::string why;
    for (addrinfo * a = res; a; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) { why = std::strerror(errno); continue; }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        bool ok = bind(fd, a->ai_addr, a->ai_addrlen) == 0;
        if (!ok) why = std::strerror(errno);
        close(fd);
        if (ok) { why.clear(); break; }
    }
    freeaddrinfo(res);
    return why;
}

std::string self_dir() {
    char buf[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
    if (n <= 0) return ".";
    std::string p(buf, size_t(n));
    return p.substr(0, p.rfind('/'));
}

// Where the engine library is looked for (unless $DGR_ENGINE_LIB names it): beside this program (a build
// folder), else ../lib (a release: bin/dgr-worker, lib/libdgr_engine.so).
std::string engine_dir() {
    const std::string here = self_dir();
    struct stat st;
    if (stat((here + "/libdgr_engine.so").c_str(), &st) != 0 && stat((here + "/../lib/libdgr_engine.so").c_str(), &st) == 0)
        return here + "/../lib";
    return here;
}

// The stage file against its manifest entry (dgr.bundle.verify_bundle's check, its messages): present, the
// manifest's size, and unless `hash` is false every chunk of `chunk` bytes with the blake3 the manifest lists,
// read in order; the first bad chunk is named. Runs before the engine library is loaded. Returns what it read.
struct StageCheck {
    uint64_t bytes = 0;
    size_t chunks = 0;
    double seconds = 0;
};

StageCheck check_stage_file(const std::string & file, const nlohmann::json & entry, uint64_t chunk, int stage,
                            const std::string & mpath, bool hash) {
    const auto t0 = std::chrono::steady_clock::now();
    struct stat st{};
    if (stat(file.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
        throw std::runtime_error(file + ": stage " + std::to_string(stage) + " file is missing; re-provision the bundle");
    }
    const uint64_t want = entry.at("size").get<uint64_t>(), have = uint64_t(st.st_size);
    if (have != want) {
        const uint64_t bad = std::min(have, want) / chunk;
        throw std::runtime_error(file + ": size " + std::to_string(have) + " bytes, manifest says " + std::to_string(want) +
                                 ": the file is " + (have < want ? "truncated" : "too long") + "; first bad chunk " +
                                 std::to_string(bad) + " (bytes " + std::to_string(bad * chunk) + "-); re-provision the bundle");
    }
    StageCheck out;
    if (!hash) return out;
    const nlohmann::json & chunks = entry.at("chunks");
    const uint64_t n = (want + chunk - 1) / chunk;
    if (!chunks.is_array() || chunks.size() != n) {
        throw std::runtime_error(mpath + ": stage " + std::to_string(stage) + " lists " + std::to_string(chunks.size()) +
                                 " chunk hashes for " + std::to_string(want) + " bytes in chunks of " + std::to_string(chunk) +
                                 " (" + std::to_string(n) + " expected): not a valid dgr manifest; rebuild the bundle");
    }
    int fd = open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::runtime_error(file + ": cannot read the stage file (" + std::strerror(errno) + ")");
    struct Fd {
        int fd;
        ~Fd() { close(fd); }
    } guard{fd};
    posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    std::vector<uint8_t> buf(static_cast<size_t>(chunk));
    dgr::Blake3 h;
    for (uint64_t k = 0; k < n; ++k) {
        const uint64_t begin = k * chunk, len = std::min(chunk, want - begin);
        uint64_t got = 0;
        while (got < len) {
            ssize_t r = read(fd, buf.data() + got, size_t(len - got));
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) throw std::runtime_error(file + ": read error at byte " + std::to_string(begin + got) + " (" + std::strerror(errno) + ")");
            if (r == 0) {
                throw std::runtime_error(file + ": the file is truncated (it shrank while being read); first bad chunk " +
                                         std::to_string(k) + " (bytes " + std::to_string(begin) + "-); re-provision the bundle");
            }
            got += uint64_t(r);
        }
        h.reset();
        h.update(buf.data(), size_t(len));
        if (h.hex() != chunks[size_t(k)].get<std::string>()) {
            throw std::runtime_error(file + ": chunk " + std::to_string(k) + " (bytes " + std::to_string(begin) + "-" +
                                     std::to_string(begin + len - 1) + ") does not match the manifest: the file is corrupt; "
                                     "re-provision the bundle");
        }
        out.bytes += len;
        out.chunks += 1;
    }
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return out;
}

struct Stage {
    dgr::EngineLib lib;
    dgr_engine * eng = nullptr;
    dgr::StageIdentity id;
};

void check_stage(Stage & s, const dgr_stage_info & info);

// The bundle's stage on the engine, and the identity the Python side builds (dgr.app.stages.bundle_stage).
void open_stage(const Options & o, Stage & s) {
    using json = nlohmann::json;
    std::string root = o.bundle;
    while (root.size() > 1 && root.back() == '/') root.pop_back();
    std::string mpath = root + "/manifest.json";
    std::string raw;
    {
        std::ifstream f(mpath, std::ios::binary);
        if (!f) throw std::runtime_error(mpath + ": cannot read the bundle manifest (" + std::strerror(errno) + "); is " +
                                         o.bundle + " a bundle folder?");
        std::ostringstream ss;
        ss << f.rdbuf();
        raw = ss.str();
    }
    json m;
    try {
        m = json::parse(raw);
        if (m.at("format_version").get<int>() != 1) {
            throw std::runtime_error(mpath + ": format_version " + m.at("format_version").dump() + ", this dgr-worker reads 1; use a matching dgr");
        }
    } catch (const json::exception & e) {
        throw std::runtime_error(mpath + ": not a valid dgr manifest: " + e.what());
    }
    // the manifest's bytes are canonical: its blake3 is the bundle id (dgr.bundle.manifest.bundle_id)
    s.id.bundle_id = dgr::blake3_hex(raw);
    const json & stages = m.at("stages");
    const int n = int(stages.size());
    if (o.stage < 0 || o.stage >= n) {
        throw std::runtime_error("bundle " + root + " has " + std::to_string(n) + " stages (0.." + std::to_string(n - 1) +
                                 "); there is no stage " + std::to_string(o.stage));
    }
    const json & entry = stages.at(size_t(o.stage));
    std::string fname = entry.at("file").get<std::string>();
    if (fname.empty() || fname == "." || fname == ".." || fname.find('/') != std::string::npos) {
        throw std::runtime_error(mpath + ": stage " + std::to_string(o.stage) + " file '" + fname + "' is not a plain file name");
    }
    std::string file = root + "/" + fname;
    // the stage file is what the manifest says, chunk by chunk, before anything of the engine is loaded
    uint64_t chunk = 0;
    try {
        chunk = m.at("chunk_size").get<uint64_t>();
    } catch (const json::exception & e) {
        throw std::runtime_error(mpath + ": not a valid dgr manifest: " + e.what());
    }
    if (chunk < 4096 || (chunk & (chunk - 1)) != 0 || chunk > (uint64_t(1) << 30)) {
        throw std::runtime_error(mpath + ": chunk_size " + std::to_string(chunk) + " is not a power of two in [4096, 1 GiB]: "
                                 "not a valid dgr manifest; rebuild the bundle");
    }
    const StageCheck checked = check_stage_file(file, entry, chunk, o.stage, mpath, !o.no_verify);
    if (!o.no_verify) {
        std::printf("dgr worker: %s: %zu chunk(s), %llu bytes match the manifest (%.3f s)\n", file.c_str(), checked.chunks,
                    (unsigned long long)checked.bytes, checked.seconds);
        std::fflush(stdout);
    }
    s.id.model = m.at("recipe").at("name").get<std::string>();
    s.id.stage_index = o.stage;
    s.id.stage_count = n;
    s.id.wire_dtype = o.wire_dtype.empty() ? m.at("boundary_dtype").get<std::string>() : o.wire_dtype;
    if (!dgr::find_dtype(s.id.wire_dtype)) {
        throw std::runtime_error("unknown wire dtype '" + s.id.wire_dtype + "'; use one of f32, f16, bf16, q8_0");
    }
    json pin = json::parse(PIN_JSON);
    s.id.upstream_commit = pin.at("commit").get<std::string>();
    std::string series;
    for (auto & p : pin.at("patches")) {
        series += p.at("file").get<std::string>() + '\0' + p.at("blake3").get<std::string>() + '\n';
    }
    s.id.patch_series = dgr::blake3_hex(series);

    s.lib = dgr::load_engine_lib(engine_dir());
    std::string lane = s.lib.lane();
    if (!o.lane.empty() && o.lane != lane) {
        throw std::runtime_error("--lane " + o.lane + ": the engine library was built for the " + lane +
                                 " lane, and a worker advertises its engine's lane; start it with the " + o.lane +
                                 " lane's engine ($DGR_ENGINE_LIB), or drop --lane");
    }
    s.id.lane = lane;
    s.id.engine_blake3 = dgr::blake3_file(s.lib.path);
    s.id.chat_template = dgr::gguf_string(file, "tokenizer.chat_template").value_or("");

    dgr_open_params p{};
    p.n_ctx = int32_t(o.n_ctx);
    p.max_sessions = int32_t(o.max_sessions);
    p.n_ubatch = 512;
    p.n_threads = int32_t(o.threads);
    p.n_gpu_layers = -1;
    int32_t st = s.lib.open(file.c_str(), &p, &s.eng);
    if (st != DGR_OK) throw std::runtime_error(s.lib.error(st));
    dgr_stage_info info{};
    st = s.lib.describe(s.eng, &info);
    if (st != DGR_OK) throw std::runtime_error(s.lib.error(st));
    int lb = entry.at("layer_begin").get<int>(), le = entry.at("layer_end").get<int>();
    if (info.layer_begin != lb || info.layer_end != le) {
        throw std::runtime_error(file + ": the engine opened layers [" + std::to_string(info.layer_begin) + ", " +
                                 std::to_string(info.layer_end) + ") but the manifest says [" + std::to_string(lb) + ", " +
                                 std::to_string(le) + "): rebuild the bundle");
    }
    const json & sch = entry.at("boundary_in");
    if (!sch.is_null()) {
        int ns = sch.at("n_streams").get<int>(), ne = sch.at("n_embd").get<int>();
        bool ti = sch.at("token_ids").get<bool>();
        if (ns != info.n_streams || ne != info.n_embd || ti != bool(info.needs_token_ids)) {
            throw std::runtime_error(file + ": the manifest says stage " + std::to_string(o.stage) + " takes [n, " + std::to_string(ns) +
                                     ", " + std::to_string(ne) + "]" + (ti ? " +token ids" : "") + " but the engine takes [n, " +
                                     std::to_string(info.n_streams) + ", " + std::to_string(info.n_embd) + "]" +
                                     (info.needs_token_ids ? " +token ids" : "") +
                                     ": rebuild the bundle with this dgr, or use the engine it was built for");
        }
    }
    check_stage(s, info);
}

// What every stage checks once open, bundle or fake: the wire dtype fits the boundary; the stop ids.
void check_stage(Stage & s, const dgr_stage_info & info) {
    // the boundary must fill the wire dtype's blocks (dgr.contract.StageContract.with_dtype)
    const dgr::WireDtype * d = dgr::find_dtype(s.id.wire_dtype);
    int width = info.n_streams * info.n_embd;
    if (width % d->block != 0) {
        std::string others;
        for (auto & x : dgr::wire_dtypes()) {
            if (width % x.block == 0) others += (others.empty() ? "" : ", ") + std::string(x.name);
        }
        throw std::runtime_error("--wire-dtype " + s.id.wire_dtype + ": wire dtype " + s.id.wire_dtype + " packs " +
                                 std::to_string(d->block) + " values per block, but this boundary has " + std::to_string(width) +
                                 " values per token (not a multiple of " + std::to_string(d->block) + "); use " + others);
    }
    // every id that ends a generation as llama.cpp sees it, the eos first (dgr.engine_api.VocabInfo.stop_ids)
    std::vector<int32_t> eog(64);
    dgr_vocab_info v{};
    while (true) {
        int32_t st = s.lib.vocab(s.eng, &v, eog.data(), int32_t(eog.size()));
        if (st != DGR_OK) throw std::runtime_error(s.lib.error(st));
        if (size_t(v.n_eog) <= eog.size()) break;
        eog.resize(size_t(v.n_eog));
    }
    if (v.eos >= 0) s.id.eos_token_ids.push_back(v.eos);
    for (int32_t k = 0; k < v.n_eog; ++k) {
        if (eog[size_t(k)] != v.eos) s.id.eos_token_ids.push_back(eog[size_t(k)]);
    }
}

std::string sha256_hex(const std::string & text) {
    unsigned char md[SHA256_DIGEST_LENGTH];
    SHA256(reinterpret_cast<const unsigned char *>(text.data()), text.size(), md);
    static const char * hex = "0123456789abcdef";
    std::string out;
    for (unsigned char c : md) out += hex[c >> 4], out += hex[c & 15];
    return out;
}

// Stage `--stage` of the fake model `--fake-engine SPEC` on the fake engine library (worker/fake), and the
// identity the Python side builds for it (dgr.app.stages.fake_stage): the model "fake:" + the canonical
// spec, the bundle id "fake-" + its sha256 (FakeModel.bundle_id), the cpu lane, the engine "fake". The
// spec's ctx= and sessions= are the stage's n_ctx and max_sessions (--n-ctx, --max-sessions and --threads
// are not the fake's, as in `dgr worker serve --fake-engine`).
void open_fake_stage(const Options & o, Stage & s) {
    s.lib = dgr::load_fake_engine_lib(self_dir());
    int32_t n_stages = 0;
    int32_t len = s.lib.fake_spec(o.fake_engine.c_str(), nullptr, 0, &n_stages);
    if (len < 0) throw std::runtime_error(s.lib.error(DGR_E_ENGINE));
    std::string spec(size_t(len) + 1, '\0');
    s.lib.fake_spec(o.fake_engine.c_str(), &spec[0], int32_t(spec.size()), &n_stages);
    spec.resize(size_t(len));
    if (o.stage < 0 || o.stage >= n_stages) {
        throw std::runtime_error("fake bundle has " + std::to_string(n_stages) + " stages; there is no stage " +
                                 std::to_string(o.stage));
    }
    std::string lane = s.lib.lane();
    if (!o.lane.empty() && o.lane != lane) {
        throw std::runtime_error("--lane " + o.lane + ": the fake engine serves the " + lane + " lane; drop --lane");
    }
    s.id.model = "fake:" + spec;
    s.id.bundle_id = "fake-" + sha256_hex(spec).substr(0, 16);
    s.id.stage_index = o.stage;
    s.id.stage_count = n_stages;
    s.id.lane = lane;
    s.id.engine = "fake";
    s.id.wire_dtype = o.wire_dtype.empty() ? "f32" : o.wire_dtype;     // dgr.contract.DEFAULT_WIRE_DTYPE
    if (!dgr::find_dtype(s.id.wire_dtype)) {
        throw std::runtime_error("unknown wire dtype '" + s.id.wire_dtype + "'; use one of f32, f16, bf16, q8_0");
    }
    s.id.engine_blake3 = dgr::blake3_file(s.lib.path);
    const std::string open = spec + ",stage=" + std::to_string(o.stage);
    dgr_open_params p{};
    int32_t st = s.lib.open(open.c_str(), &p, &s.eng);
    if (st != DGR_OK) throw std::runtime_error(s.lib.error(st));
    dgr_stage_info info{};
    st = s.lib.describe(s.eng, &info);
    if (st != DGR_OK) throw std::runtime_error(s.lib.error(st));
    check_stage(s, info);
}

int run(int argc, char ** argv) {
    Options o = parse(argc, argv);
    if (!o.blake3_files.empty()) {                   // --blake3 FILE: the digest of each, `b3sum`'s format
        for (auto & f : o.blake3_files) std::printf("%s  %s\n", dgr::blake3_file(f).c_str(), f.c_str());
        return 0;
    }
    if (o.bundle.empty() == o.fake_engine.empty()) throw UsageError("give exactly one of --bundle BUNDLE or --fake-engine SPEC");
    for (auto & [flag, v] : {std::pair<const char *, int64_t>{"--max-queued-steps", o.limits.max_queued_steps},
                             {"--max-session-steps", o.limits.max_session_steps},
                             {"--max-batch-sessions", o.limits.max_batch_sessions},
                             {"--max-connections", o.limits.max_connections},
                             {"--max-rpc-threads", o.max_rpc_threads}}) {
        if (v < 1) throw std::runtime_error(std::string(flag) + " must be at least 1");
    }
    if (o.max_sessions < 1) throw std::runtime_error("--max-sessions must be at least 1");
    if (o.limits.send_timeout_s <= 0) throw std::runtime_error("--send-timeout must be more than 0 seconds");
    if (o.limits.max_send_queue_bytes < int64_t(o.max_message_bytes + dgr::FRAME_OVERHEAD)) {
        throw std::runtime_error("--max-send-queue-bytes must hold one message: at least --max-message-bytes + " +
                                 std::to_string(dgr::FRAME_OVERHEAD) + " (" + std::to_string(o.max_message_bytes + dgr::FRAME_OVERHEAD) + ")");
    }
    if (o.n_ctx < 0) throw std::runtime_error("--n-ctx must not be negative");
    // what dgr-worker does not do yet is refused, never silently ignored (docs/worker.md)
    const dgr::Trust trust = dgr::tls_trust(dgr::TlsFiles{o.tls_cert, o.tls_key, o.tls_ca});
    std::string mhost, mport;                        // --metrics-listen HOST:PORT (the gRPC port's rules)
    if (!o.metrics_listen.empty()) {
        auto c = o.metrics_listen.rfind(':');
        mhost = c == std::string::npos ? "" : o.metrics_listen.substr(0, c);
        mport = c == std::string::npos ? "" : o.metrics_listen.substr(c + 1);
        if (mhost.empty() || mport.empty() || mport.find_first_not_of("0123456789") != std::string::npos) {
            throw std::runtime_error("--metrics-listen '" + o.metrics_listen + "': give HOST:PORT (port 0 picks a free one)");
        }
        if (!trust.tls && !o.insecure && !is_loopback(mhost)) {
            throw std::runtime_error("refusing to listen on " + o.metrics_listen + " without TLS: anyone who reaches it could "
                                     "read and forge boundaries. Give --tls-cert/--tls-key (and --tls-ca for mutual TLS; `dgr "
                                     "certs` makes them), or --insecure to accept plaintext on a network you trust");
        }
    }
    auto colon = o.listen.rfind(':');
    std::string host = colon == std::string::npos ? "" : o.listen.substr(0, colon);
    std::string port = colon == std::string::npos ? "" : o.listen.substr(colon + 1);
    if (host.empty() || port.empty() || port.find_first_not_of("0123456789") != std::string::npos) {
        throw std::runtime_error("cannot listen on '" + o.listen + "': give HOST:PORT with a free port (port 0 picks one)");
    }
    if (!trust.tls && !o.insecure && !is_loopback(host)) {
        throw std::runtime_error("refusing to listen on " + o.listen + " without TLS: anyone who reaches it could read and forge "
                                 "boundaries. Give --tls-cert/--tls-key (and --tls-ca for mutual TLS; `dgr certs` makes "
                                 "them), or --insecure to accept plaintext on a network you trust");
    }
    std::string adv_host, adv_port;                  // --advertise HOST[:PORT]: the address peers reach it at
    if (!o.advertise.empty()) {
        const std::string & a = o.advertise;
        auto c = a.rfind(':');
        const bool has_port = c != std::string::npos && a.find(']', c) == std::string::npos && (a.front() != '[' || a[c - 1] == ']');
        adv_host = has_port ? a.substr(0, c) : a;
        adv_port = has_port ? a.substr(c + 1) : "";
        if (adv_host.empty() || adv_host == "0.0.0.0" || adv_host == "[::]" || adv_host == "::" ||
            (has_port && (adv_port.empty() || adv_port.find_first_not_of("0123456789") != std::string::npos))) {
            throw std::runtime_error("--advertise " + a + ": give the HOST[:PORT] other machines reach this worker at "
                                     "(a name or an address, never a wildcard)");
        }
    }

    if (std::string why = bind_error(host, port); !why.empty()) {
        throw std::runtime_error("cannot listen on " + o.listen + ": " + why + ": give HOST:PORT with a free port (port 0 picks one)");
    }

    Stage s;
    struct Closer {                                  // before the open: a refusal after the engine opened closes it
        Stage & s;
        ~Closer() { if (s.eng) s.lib.close(s.eng); }
    } closer{s};
    if (o.fake_engine.empty()) open_stage(o, s);
    else open_fake_stage(o, s);
    // this program's own bytes (docs/certification.md): a certificate names the worker binary it measured
    s.id.worker_blake3 = dgr::blake3_file("/proc/self/exe");

    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder b;
    int bound = 0;
    b.AddListeningPort(o.listen, trust.tls ? trust.server : grpc::InsecureServerCredentials(), &bound);
    // bounds (docs/worker.md): gRPC's threads; calls per connection; connections with calls in progress are
    // counted by the worker (--max-connections); idle connections are closed after 10 minutes
    grpc::ResourceQuota quota("dgr-worker");
    quota.SetMaxThreads(int(o.max_rpc_threads));
    b.SetResourceQuota(quota);
    b.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 100);
    b.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, 600000);
    int limit = int(o.max_message_bytes + dgr::FRAME_OVERHEAD);
    b.SetMaxReceiveMessageSize(limit);
    b.SetMaxSendMessageSize(limit);
    // no SO_REUSEPORT: a second worker on a taken port must fail, not share its connections
    b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    b.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    b.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
    b.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
    b.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
    b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
    // errors name this hop by its address; a wildcard listen address names no machine, the host name does
    std::string name = adv_host.empty() ? host : adv_host;
    if (adv_host.empty() && (host == "0.0.0.0" || host == "[::]")) {
        char hn[256] = {0};
        gethostname(hn, sizeof hn - 1);
        name = hn;
    }
    // the port is known only once bound (port 0): the worker is told its address right after
    auto worker = std::make_unique<dgr::StageWorker>(s.lib, s.eng, s.id, name + ":" + port, o.max_message_bytes, o.limits);
    worker->set_trust(trust);
    if (!o.certs.empty()) {                          // dgr.app.stages.held_certificates
        const dgr_stage_info & si = worker->info();
        dgr::CertIdentity me{s.id.model, s.id.bundle_id, s.id.lane, s.id.upstream_commit, s.id.patch_series,
                             s.id.engine_blake3, s.id.worker_blake3, s.id.stage_index, si.layer_begin, si.layer_end};
        auto held = dgr::held_certificates(o.certs, me, o.contract);
        std::printf("dgr worker: %zu certificate(s) advertised from %s\n", held.size(), o.certs.c_str());
        worker->set_certificates(std::move(held));
    }
    b.RegisterService(worker.get());
    std::unique_ptr<grpc::Server> server = b.BuildAndStart();
    if (!server || bound == 0) {
        throw std::runtime_error("cannot listen on " + o.listen + ": the address is taken or not this machine's; give "
                                 "HOST:PORT with a free port (port 0 picks one)");
    }
    const std::string address = name + ":" + (adv_port.empty() ? std::to_string(bound) : adv_port);
    worker->set_address(address);
    std::unique_ptr<dgr::MetricsServer> metrics;
    if (!mhost.empty()) {
        try {
            // HTTPS under TLS, client certificates from the CA under mutual TLS
            metrics = std::make_unique<dgr::MetricsServer>(mhost, mport, [w = worker.get()] { return w->metrics_text(); },
                                                           o.tls_cert, o.tls_key, o.tls_ca);
        } catch (const std::exception & e) {
            throw std::runtime_error("cannot serve metrics on " + o.metrics_listen + ": " + e.what() +
                                     ": give a free HOST:PORT (port 0 picks one)");
        }
        std::string mname = mhost;
        if (mhost == "0.0.0.0" || mhost == "[::]") {
            char hn[256] = {0};
            gethostname(hn, sizeof hn - 1);
            mname = hn;
        }
        const std::string url = std::string(trust.tls ? "https" : "http") + "://" + mname + ":" + std::to_string(metrics->port()) + "/metrics";
        worker->set_metrics_url(url);
        std::printf("dgr worker: metrics on %s\n", url.c_str());
    }
    auto * health = server->GetHealthCheckService();
    health->SetServingStatus("", true);
    health->SetServingStatus("dgr.v1.Stage", true);
    const dgr_stage_info & i = worker->info();
    const char * mode = trust.mutual ? "mutual TLS" : trust.tls ? "TLS" : "plaintext";
    dgr_memory mem{};                                // where the weights are: the lane's device, or the host
    const bool on_device = s.lib.memory(s.eng, &mem) == DGR_OK && mem.device[0] != '\0';
    std::printf("dgr worker: stage %d [%d, %d) of bundle %s, %s lane, weights on %s, %s serving on %s\n",
                s.id.stage_index, i.layer_begin, i.layer_end, s.id.bundle_id.c_str(), s.id.lane.c_str(),
                on_device ? mem.device : "the host", mode, address.c_str());
    std::fflush(stdout);

    // SIGTERM/SIGINT (blocked in every thread: main() blocked them before gRPC started any) end the wait
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    std::mutex reaper_mu;                            // the reaper wakes 5 times a second, and at once to stop
    std::condition_variable reaper_cv;
    bool done = false;
    std::thread reaper([&] {
        std::unique_lock<std::mutex> l(reaper_mu);
        while (!reaper_cv.wait_for(l, std::chrono::milliseconds(200), [&] { return done; })) {
            l.unlock();
            try {
                worker->reap();
                worker->check_stalls();
            } catch (const std::exception & e) {
                std::fprintf(stderr, "dgr-worker: reaper: %s\n", e.what());
            } catch (...) {
            }
            l.lock();
        }
    });
    int sig = 0;
    sigwait(&sigs, &sig);
    // --drain-timeout bounds the whole drain (a watchdog): a second signal, or the
    // bound passing while anything still hangs (an engine step, a peer that does not read), leaves at once
    const double bound_s = std::max(0.0, o.limits.drain_timeout_s);
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(bound_s * 1000));
    std::thread([sigs, bound_s] {
        const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(int64_t(bound_s * 1e9));
        int again;
        do {                                         // a stop and continue (SIGSTOP/SIGCONT) interrupts the wait
            const int64_t left = std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                          until - std::chrono::steady_clock::now()).count());
            timespec ts{time_t(left / 1000000000), long(left % 1000000000)};
            again = sigtimedwait(&sigs, nullptr, &ts);
        } while (again < 0 && errno == EINTR);
        if (again > 0) std::fprintf(stderr, "dgr-worker: second signal while draining: exiting now\n");
        else std::fprintf(stderr, "dgr-worker: draining took longer than --drain-timeout %g s: exiting now\n", bound_s);
        std::fflush(stdout);
        std::fflush(stderr);
        _exit(1);
    }).detach();
    health->SetServingStatus("", false);
    health->SetServingStatus("dgr.v1.Stage", false);
    worker->stop();
    // what is left of the bound, at most a second, for the calls still in flight (Python: grace=min(1, left))
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
    server->Shutdown(std::chrono::system_clock::now() +
                     std::clamp(left - std::chrono::milliseconds(100), std::chrono::milliseconds(0), std::chrono::milliseconds(1000)));
    {
        std::lock_guard<std::mutex> g(reaper_mu);
        done = true;
    }
    reaper_cv.notify_all();
    reaper.join();
    s.lib.close(s.eng);                              // the engine thread is joined (stop): nothing else calls it
    s.eng = nullptr;
    std::printf("dgr worker: stage %d on %s drained and stopped\n", s.id.stage_index, address.c_str());
    std::fflush(stdout);
    std::fflush(stderr);
    // leave now rather than wait in destructors for a handler still blocked on a dead peer (as the Python
    // worker's hard_exit(0)): the bound is the point of a drain
    _exit(0);
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
