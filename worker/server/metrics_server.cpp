// The /metrics HTTP(S) server (metrics_server.h).
#include "metrics_server.h"

#include <algorithm>
#include <vector>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/ssl.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace dgr {

namespace {

std::string ssl_error() {
    char b[256] = {0};
    unsigned long e = ERR_get_error();
    if (!e) return "unknown TLS error";
    ERR_error_string_n(e, b, sizeof b);
    ERR_clear_error();
    return b;
}

}  // namespace

MetricsServer::MetricsServer(const std::string & host, const std::string & port, std::function<std::string()> render,
                             const std::string & tls_cert, const std::string & tls_key, const std::string & tls_ca)
    : render_(std::move(render)) {
    if (!tls_cert.empty()) {
        // TLS 1.2+, the worker's own certificate; under --tls-ca the client's must verify against it
        ssl_ = SSL_CTX_new(TLS_server_method());
        if (!ssl_) throw std::runtime_error("TLS: " + ssl_error());
        SSL_CTX_set_min_proto_version(ssl_, TLS1_2_VERSION);
        auto fail = [&](const std::string & what) {
            std::string why = what + ": " + ssl_error();
            SSL_CTX_free(ssl_);
            ssl_ = nullptr;
            throw std::runtime_error(why);
        };
        if (SSL_CTX_use_certificate_chain_file(ssl_, tls_cert.c_str()) != 1) fail("--tls-cert " + tls_cert);
        if (SSL_CTX_use_PrivateKey_file(ssl_, tls_key.c_str(), SSL_FILETYPE_PEM) != 1) fail("--tls-key " + tls_key);
        if (SSL_CTX_check_private_key(ssl_) != 1) fail("--tls-key " + tls_key + " does not match --tls-cert");
        if (!tls_ca.empty()) {
            if (SSL_CTX_load_verify_locations(ssl_, tls_ca.c_str(), nullptr) != 1) fail("--tls-ca " + tls_ca);
            SSL_CTX_set_verify(ssl_, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
        }
    }
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    std::string h = host.size() > 1 && host.front() == '[' && host.back() == ']' ? host.substr(1, host.size() - 2) : host;
    if (int rc = getaddrinfo(h.c_str(), port.c_str(), &hints, &res); rc != 0) throw std::runtime_error(gai_strerror(rc));
    std::string why = "no address";
    for (addrinfo * a = res; a; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 64) == 0) {
            fd_ = fd;
            break;
        }
        why = std::strerror(errno);
        close(fd);
    }
    freeaddrinfo(res);
    if (fd_ < 0) throw std::runtime_error(why);
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    getsockname(fd_, reinterpret_cast<sockaddr *>(&ss), &len);
    port_ = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6 *>(&ss)->sin6_port)
                                     : ntohs(reinterpret_cast<sockaddr_in *>(&ss)->sin_port);
    thread_ = std::thread([this] {
        // OpenSSL writes without MSG_NOSIGNAL: a client gone mid-reply must not end the worker with SIGPIPE,
        // so this thread blocks it, and run() takes any it raised
        sigset_t pipe;
        sigemptyset(&pipe);
        sigaddset(&pipe, SIGPIPE);
        pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
        try {
            run();
        } catch (const std::exception & e) {
            std::fprintf(stderr, "dgr-worker: the metrics server stopped: %s\n", e.what());
        } catch (...) {
            std::fprintf(stderr, "dgr-worker: the metrics server stopped\n");
        }
    });
}

MetricsServer::~MetricsServer() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    if (fd_ >= 0) close(fd_);
    if (ssl_) SSL_CTX_free(ssl_);
}

// The connections, served together by one thread (poll), each bounded: 8 KiB of request and 5 s from accept to
// the last byte of the reply, TLS handshake included. A client that connects and then sends a byte now and
// then (or nothing) holds only its own connection, and only for 5 s: other scrapes are answered meanwhile.
// At most MAX_CONNS at once; more wait in the listen queue until one ends.
namespace {

constexpr size_t MAX_CONNS = 64, MAX_REQUEST = 8192;
constexpr auto CONN_BOUND = std::chrono::seconds(5);

struct Conn {
    int fd = -1;
    SSL * tls = nullptr;
    std::chrono::steady_clock::time_point deadline;
    enum Phase { HANDSHAKE, READ, WRITE, CLOSING } phase = READ;
    short want = POLLIN;
    std::string req, out;
    size_t off = 0;
};

void drop(Conn & c) {
    if (c.tls) SSL_free(c.tls);
    if (c.fd >= 0) close(c.fd);
    c.tls = nullptr;
    c.fd = -1;
}

void drain_sigpipe() {
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    timespec none{0, 0};
    while (sigtimedwait(&pipe, nullptr, &none) > 0) {
    }
}

}  // namespace

void MetricsServer::run() {
    std::vector<Conn> conns;
    auto accept_paused_until = std::chrono::steady_clock::time_point{};
    auto reply = [&](Conn & c) {
        std::string body, status = "200 OK", type = "text/plain; version=0.0.4; charset=utf-8";
        const bool head = c.req.rfind("HEAD ", 0) == 0;
        if (c.req.rfind("GET ", 0) == 0 || head) {
            body = render_();
        } else {
            status = "405 Method Not Allowed";
            type = "text/plain; charset=utf-8";
            body = "GET /metrics\n";
        }
        c.out = "HTTP/1.1 " + status + "\r\nContent-Type: " + type + "\r\nContent-Length: " + std::to_string(body.size()) +
                "\r\nConnection: close\r\n\r\n" + (head ? "" : body);
        c.off = 0;
        c.phase = Conn::WRITE;
    };
    // one step of a connection as far as it goes without waiting; false: it is done (or failed)
    auto step = [&](Conn & c) -> bool {
        while (true) {
            if (c.phase == Conn::HANDSHAKE) {
                int r = SSL_accept(c.tls);
                if (r == 1) { c.phase = Conn::READ; continue; }
                int e = SSL_get_error(c.tls, r);
                ERR_clear_error();
                if (e == SSL_ERROR_WANT_READ) { c.want = POLLIN; return true; }
                if (e == SSL_ERROR_WANT_WRITE) { c.want = POLLOUT; return true; }
                return false;                        // a failed handshake (plain HTTP, no client certificate): nothing
            }
            if (c.phase == Conn::READ) {
                char buf[2048];
                const size_t room = std::min(sizeof buf, MAX_REQUEST - c.req.size());
                ssize_t n;
                if (c.tls) {
                    n = SSL_read(c.tls, buf, int(room));
                    if (n <= 0) {
                        int e = SSL_get_error(c.tls, int(n));
                        ERR_clear_error();
                        if (e == SSL_ERROR_WANT_READ) { c.want = POLLIN; return true; }
                        if (e == SSL_ERROR_WANT_WRITE) { c.want = POLLOUT; return true; }
                        n = 0;                       // closed or failed: answer what came
                    }
                } else {
                    n = recv(c.fd, buf, room, 0);
                    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) { c.want = POLLIN; return true; }
                    if (n < 0) return false;
                }
                if (n > 0) c.req.append(buf, size_t(n));
                if (n > 0 && c.req.size() < MAX_REQUEST && c.req.find("\r\n\r\n") == std::string::npos) continue;
                reply(c);
                continue;
            }
            if (c.phase == Conn::WRITE) {
                if (c.off >= c.out.size()) {
                    if (c.tls) SSL_shutdown(c.tls);  // best effort, once: the reply is complete
                    return false;
                }
                ssize_t n;
                if (c.tls) {
                    n = SSL_write(c.tls, c.out.data() + c.off, int(c.out.size() - c.off));
                    if (n <= 0) {
                        int e = SSL_get_error(c.tls, int(n));
                        ERR_clear_error();
                        if (e == SSL_ERROR_WANT_READ) { c.want = POLLIN; return true; }
                        if (e == SSL_ERROR_WANT_WRITE) { c.want = POLLOUT; return true; }
                        return false;
                    }
                } else {
                    n = send(c.fd, c.out.data() + c.off, c.out.size() - c.off, MSG_NOSIGNAL);
                    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) { c.want = POLLOUT; return true; }
                    if (n <= 0) return false;
                }
                c.off += size_t(n);
                continue;
            }
            return false;
        }
    };
    while (!stop_) {
        const auto now = std::chrono::steady_clock::now();
        std::vector<pollfd> p;
        const bool listening = conns.size() < MAX_CONNS && now >= accept_paused_until;
        p.push_back(pollfd{listening ? fd_ : -1, POLLIN, 0});
        int timeout_ms = 200;
        for (auto & c : conns) {
            p.push_back(pollfd{c.fd, c.want, 0});
            auto left = std::chrono::duration_cast<std::chrono::milliseconds>(c.deadline - now).count();
            timeout_ms = int(std::max<int64_t>(0, std::min<int64_t>(timeout_ms, left + 1)));
        }
        if (!listening && conns.size() < MAX_CONNS) timeout_ms = std::min(timeout_ms, 100);
        int r = poll(p.data(), nfds_t(p.size()), timeout_ms);
        if (r < 0 && errno != EINTR) throw std::runtime_error(std::string("poll: ") + std::strerror(errno));
        const auto after = std::chrono::steady_clock::now();
        std::vector<Conn> next;
        for (size_t i = 0; i < conns.size(); ++i) {
            Conn & c = conns[i];
            bool alive = true;
            if (r > 0 && p[i + 1].revents) alive = step(c);
            if (alive && after >= c.deadline) alive = false;     // the bound: 5 s in all
            if (alive) next.push_back(c);
            else drop(c);
        }
        conns.swap(next);
        if (r > 0 && listening && (p[0].revents & POLLIN)) {
            while (conns.size() < MAX_CONNS) {
                int fd = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
                if (fd < 0) {
                    // out of descriptors: the queue waits, and this thread does not spin on it
                    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                        accept_paused_until = after + std::chrono::milliseconds(100);
                    }
                    break;
                }
                Conn c;
                c.fd = fd;
                c.deadline = after + CONN_BOUND;
                if (ssl_) {
                    c.tls = SSL_new(ssl_);
                    if (!c.tls || SSL_set_fd(c.tls, fd) != 1) {
                        ERR_clear_error();
                        drop(c);
                        continue;
                    }
                    c.phase = Conn::HANDSHAKE;
                }
                if (step(c)) conns.push_back(c);
                else drop(c);
            }
        }
        drain_sigpipe();                             // any SIGPIPE OpenSSL's writes raised (blocked in this thread)
    }
    for (auto & c : conns) drop(c);
}

}  // namespace dgr
