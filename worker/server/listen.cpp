// Where the worker listens: the addresses checked before the engine loads (a taken port fails fast), then
// the gRPC server with the worker, the metrics endpoint and health, and the line that says it serves. The descriptor
// guard every accepted connection passes is listen_guard.{h,cpp}.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "listen_guard.h"
#include "serve.h"

namespace dgr::serve {

namespace {

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


}  // namespace

int64_t raise_open_files(const Options & o) {
    rlimit r{};
    if (getrlimit(RLIMIT_NOFILE, &r) != 0) throw std::runtime_error(std::string("getrlimit(RLIMIT_NOFILE): ") + std::strerror(errno));
    if (r.rlim_cur < r.rlim_max) {
        rlimit up = r;
        up.rlim_cur = r.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &up) == 0) r = up;
    }
    const int64_t limit = r.rlim_cur == RLIM_INFINITY ? int64_t(1) << 30 : int64_t(r.rlim_cur);
    // each connection is a descriptor; the guard's margin twice (it stops accepting at one, resumes below two);
    // 32 for the worker's own (the engine, links to the next hop and the origin, gRPC's, the metrics port)
    const int64_t need = o.limits.max_connections + 2 * guard_margin_for(limit) + 32;
    if (limit < need) {
        throw std::runtime_error("--max-connections " + std::to_string(o.limits.max_connections) + " needs an open-files limit "
                                 "(RLIMIT_NOFILE) of at least " + std::to_string(need) + ", and this process may open " +
                                 std::to_string(limit) + ": raise it (ulimit -n; LimitNOFILE= in a systemd unit) or lower "
                                 "--max-connections");
    }
    guard_set_limit(limit);
    std::printf("dgr worker: open-files limit %lld (RLIMIT_NOFILE)\n", static_cast<long long>(limit));
    std::fflush(stdout);                             // before anything that fails later says why (on stderr)
    return limit;
}

Listen check_listen(const Options & o, const Trust & trust) {
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
    if (trust.tls && !trust.mutual && !o.insecure && !is_loopback(host)) {
        throw std::runtime_error("refusing to listen on " + o.listen + " with server-only TLS: anyone who reaches it could open "
                                 "sessions, and no peer could be told apart (docs/security.md). Give --tls-ca (the mesh's "
                                 "CA) for mutual TLS, or --insecure to serve anyone on a network you trust");
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
    return Listen{host, port, mhost, mport, adv_host, adv_port};
}

Serving serve(const Options & o, const Trust & trust, const Listen & l, Stage & s) {
    const std::string & host = l.host, & port = l.port, & mhost = l.mhost, & mport = l.mport;
    const std::string & adv_host = l.adv_host, & adv_port = l.adv_port;
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder b;
    int bound = 0;
    b.AddListeningPort(o.listen, trust.tls ? trust.server : grpc::InsecureServerCredentials(), &bound);
    // bounds (docs/worker.md): calls per connection; connections with calls in progress are counted by the
    // worker (--max-connections); idle connections are closed after 10 minutes. Every RPC is a callback one:
    // the unary calls' threads are UnaryCalls' (--max-rpc-threads); the quota's thread bound covers what gRPC
    // still serves synchronously (nothing of dgr's; kept at the same number)
    grpc::ResourceQuota quota("dgr-worker");
    quota.SetMaxThreads(int(o.limits.max_rpc_threads));
    // gRPC's buffers, every connection together (--max-rpc-memory-mib): under pressure gRPC shrinks its reads
    // and drops idle connections, so a flood of connections or of streams (the rapid reset class) cannot grow
    // the process without bound
    quota.Resize(size_t(o.max_rpc_memory_mib) << 20);
    b.SetResourceQuota(quota);
    // HTTP/2 abuse by a peer: at most 100 calls at once on a connection (a peer that opens and resets streams
    // as fast as it can holds at most 100), and 16 KiB of headers per call
    b.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 100);
    b.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, 16 * 1024);
    // every accepted connection passes the descriptor guard first (ListenGuard: gRPC 1.51 stops accepting for
    // good on EMFILE)
    b.SetOption(guard_option());
    b.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, 600000);
    // a connection that never finishes its handshake (a stranger without a certificate, a scanner, a flood of
    // bare TCP connections) is closed after --handshake-timeout, not gRPC's 120 s
    b.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, int(o.handshake_timeout_s * 1000));
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
    Serving sv;                                      // after the builder: on a refusal it goes first
    // the port is known only once bound (port 0): the worker is told its address right after
    auto & worker = sv.worker;
    worker = std::make_unique<dgr::StageWorker>(s.lib, s.eng, s.id, name + ":" + port, o.max_message_bytes, o.limits);
    worker->set_trust(trust);
    worker->set_net_policy(o.net);
    if (!o.certs.empty()) {                          // certification.h
        const dgr_stage_info & si = worker->info();
        dgr::CertIdentity me{s.id.model, s.id.bundle_id, s.id.lane, s.id.upstream_commit, s.id.patch_series,
                             s.id.engine_blake3, s.id.worker_blake3, s.id.numerics, s.id.stage_index, si.layer_begin,
                             si.layer_end};
        auto held = dgr::held_certificates(o.certs, me, o.contract);
        std::printf("dgr worker: %zu certificate(s) advertised from %s\n", held.size(), o.certs.c_str());
        worker->set_certificates(std::move(held));
    }
    sv.calls = std::make_unique<dgr::UnaryCalls>(dgr::UnaryCalls::Bounds{
        size_t(o.limits.max_rpc_threads), size_t(o.limits.max_rpc_threads), size_t(o.limits.max_rpc_per_member)});
    worker->count_calls(sv.calls.get());
    dgr::StageWorker * w = worker.get();
    sv.service = std::make_unique<dgr::StageService>(dgr::StageService::Parts{
        *sv.calls, w->card(), [w] { return w->load(); }, w->vocabulary(), w->session_calls(), w->frame_streams(), [w] { return w->hop(); }});
    b.RegisterService(sv.service.get());
    auto & server = sv.server;
    server = b.BuildAndStart();
    if (!server || bound == 0) {
        throw std::runtime_error("cannot listen on " + o.listen + ": the address is taken or not this machine's; give "
                                 "HOST:PORT with a free port (port 0 picks one)");
    }
    guard_arm(bound);
    sv.address = name + ":" + (adv_port.empty() ? std::to_string(bound) : adv_port);
    const std::string & address = sv.address;
    worker->set_address(address);
    auto & metrics = sv.metrics;
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
    return sv;
}

}  // namespace dgr::serve
