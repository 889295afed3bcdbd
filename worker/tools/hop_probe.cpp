// dgr-hop-probe: what one hop costs over hand-framed TCP and TLS, for issue 21's decision between gRPC
// streaming and a hand-framed decode path (docs/wire.md, "gRPC or hand-framed frames").
//
//   dgr-hop-probe --transport tcp|tls [--stages 3] [--bytes 2320] [--rounds 300] [--gap-us 2000]
//                 [--compute-us 800] [--handoff] [--cert C --key K --ca CA]
//
// S processes on 127.0.0.1 form a ring, as a route's stages do: stage 0 (the origin) waits --gap-us, spins
// --compute-us (its forward) and sends a frame of --bytes to stage 1; every other stage's reader takes the
// frame, spins --compute-us and sends it on; the last sends it back to stage 0. Each frame carries the
// sender's CLOCK_MONOTONIC time, so each receiver records the one-way time of its boundary (same machine,
// same clock). --handoff: the reader hands the frame to a second thread that runs the "forward" (two
// wake-ups per hop, as a worker with an engine thread has); without it the reader runs it (one wake-up).
// TLS is TLS 1.3 with mutual authentication: every stage presents --cert/--key and accepts only peers whose
// certificate --ca signed (the files `dgr certs` makes). Frames: a 16-byte header (magic, length, send
// time) then the payload, written as one write (one TLS record). This is a probe of the transport, not a
// data path: no sessions, checks or bounds. Output: one JSON object on stdout (medians and p90 in ms, per
// boundary and over all). Used by `dgr bench frames` (dgr.app.bench.frame_cost).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr uint32_t MAGIC = 0x64677266;   // "dgrf"
constexpr int WARMUP = 20;               // rounds not counted (connections and caches warm up)

struct Opts {
    std::string transport = "tcp", cert, key, ca;
    int stages = 3, rounds = 300;
    int64_t bytes = 2320, gap_us = 2000, compute_us = 800;
    bool handoff = false;
};

int64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void spin_us(int64_t us) {
    const int64_t end = now_ns() + us * 1000;
    while (now_ns() < end) {
    }
}

[[noreturn]] void die(const std::string & why) {
    fprintf(stderr, "dgr-hop-probe: %s\n", why.c_str());
    ERR_print_errors_fp(stderr);
    _exit(2);
}

// One connected end: plain TCP or TLS over it.
struct Conn {
    int fd = -1;
    SSL * ssl = nullptr;

    void write_all(const char * p, size_t n) {
        while (n > 0) {
            ssize_t k = ssl ? SSL_write(ssl, p, int(n)) : ::send(fd, p, n, MSG_NOSIGNAL);
            if (k <= 0) die("write failed");
            p += k;
            n -= size_t(k);
        }
    }
    bool read_all(char * p, size_t n) {   // false: the peer closed
        while (n > 0) {
            ssize_t k = ssl ? SSL_read(ssl, p, int(n)) : ::recv(fd, p, n, 0);
            if (k <= 0) return false;
            p += k;
            n -= size_t(k);
        }
        return true;
    }
};

SSL_CTX * tls_context(const Opts & o, bool server) {
    SSL_CTX * c = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
    if (!c) die("SSL_CTX_new");
    SSL_CTX_set_min_proto_version(c, TLS1_3_VERSION);
    if (SSL_CTX_use_certificate_chain_file(c, o.cert.c_str()) != 1) die("cannot load --cert " + o.cert);
    if (SSL_CTX_use_PrivateKey_file(c, o.key.c_str(), SSL_FILETYPE_PEM) != 1) die("cannot load --key " + o.key);
    if (SSL_CTX_load_verify_locations(c, o.ca.c_str(), nullptr) != 1) die("cannot load --ca " + o.ca);
    SSL_CTX_set_verify(c, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
    // no session tickets: the server would write them on a connection whose other end only ever writes
    // (its unread bytes would turn the peer's close into a reset); the probe never resumes a session
    if (server) SSL_CTX_set_num_tickets(c, 0);
    return c;
}

void nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Stage i: accept from stage i-1 on `lfd`, connect to stage i+1's `next_port`; record each frame's one-way time.
std::vector<int64_t> run_stage(const Opts & o, int i, int lfd, int next_port) {
    const bool tls = o.transport == "tls";
    SSL_CTX * sctx = tls ? tls_context(o, true) : nullptr;
    SSL_CTX * cctx = tls ? tls_context(o, false) : nullptr;
    Conn in, out;
    // connect (and its TLS handshake) on a thread of its own: every stage accepts and connects at once
    std::thread connector([&] {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(uint16_t(next_port));
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0) die("connect to the next stage failed");
        nodelay(fd);
        out.fd = fd;
        if (tls) {
            out.ssl = SSL_new(cctx);
            SSL_set_fd(out.ssl, fd);
            SSL_set1_host(out.ssl, "127.0.0.1");
            if (SSL_connect(out.ssl) != 1) die("TLS handshake with the next stage failed");
        }
    });
    int fd = accept(lfd, nullptr, nullptr);
    if (fd < 0) die("accept failed");
    nodelay(fd);
    in.fd = fd;
    if (tls) {
        in.ssl = SSL_new(sctx);
        SSL_set_fd(in.ssl, fd);
        if (SSL_accept(in.ssl) != 1) die("TLS handshake with the previous stage failed");
    }
    connector.join();

    const size_t total = 16 + size_t(o.bytes);
    std::vector<int64_t> samples;
    auto stamp_and_send = [&](std::vector<char> & f) {
        int64_t t = now_ns();
        memcpy(f.data() + 8, &t, 8);
        out.write_all(f.data(), f.size());
    };
    // record: the time from the sender's stamp to now goes in the samples (a handed-off frame is recorded
    // when the second thread picks it up, so the hand-off's wake-up counts in the hop)
    auto since_sent = [&](const std::vector<char> & f) {
        int64_t t;
        memcpy(&t, f.data() + 8, 8);
        samples.push_back(now_ns() - t);
    };
    auto take = [&](std::vector<char> & f, bool record) -> bool {
        if (!in.read_all(f.data(), total)) return false;
        uint32_t magic, len;
        memcpy(&magic, f.data(), 4);
        memcpy(&len, f.data() + 4, 4);
        if (magic != MAGIC || len != uint32_t(o.bytes)) die("a malformed frame arrived");
        if (record) since_sent(f);
        return true;
    };

    std::vector<char> f(total, 'x');
    const uint32_t len = uint32_t(o.bytes);
    memcpy(f.data(), &MAGIC, 4);
    memcpy(f.data() + 4, &len, 4);
    if (i == 0) {   // the origin: one frame round the ring at a time
        for (int r = 0; r < o.rounds + WARMUP; ++r) {
            usleep(useconds_t(o.gap_us));
            spin_us(o.compute_us);
            stamp_and_send(f);
            if (!take(f, true)) die("the ring broke");
        }
        shutdown(out.fd, SHUT_WR);
    } else if (!o.handoff) {   // the reader runs the forward
        while (take(f, true)) {
            spin_us(o.compute_us);
            stamp_and_send(f);
        }
        shutdown(out.fd, SHUT_WR);
    } else {   // the reader hands the frame to the "engine" thread
        std::mutex mu;
        std::condition_variable cv;
        std::deque<std::vector<char>> q;
        bool done = false;
        std::thread engine([&] {
            for (;;) {
                std::vector<char> g;
                {
                    std::unique_lock<std::mutex> l(mu);
                    cv.wait(l, [&] { return done || !q.empty(); });
                    if (q.empty()) break;
                    g = std::move(q.front());
                    q.pop_front();
                }
                since_sent(g);
                spin_us(o.compute_us);
                stamp_and_send(g);
            }
        });
        while (take(f, false)) {
            std::lock_guard<std::mutex> l(mu);
            q.push_back(f);
            cv.notify_one();
        }
        {
            std::lock_guard<std::mutex> l(mu);
            done = true;
        }
        cv.notify_one();
        engine.join();
        shutdown(out.fd, SHUT_WR);
    }
    if (samples.size() > size_t(WARMUP)) samples.erase(samples.begin(), samples.begin() + WARMUP);
    return samples;
}

double pct(std::vector<int64_t> v, double p) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return double(v[std::min(v.size() - 1, size_t(p * double(v.size() - 1) + 0.5))]) / 1e6;
}

int parse(int argc, char ** argv, Opts & o) {
    for (int k = 1; k < argc; ++k) {
        std::string a = argv[k];
        auto val = [&]() -> std::string {
            if (k + 1 >= argc) throw std::invalid_argument(a + " needs a value");
            return argv[++k];
        };
        if (a == "--transport") o.transport = val();
        else if (a == "--stages") o.stages = std::stoi(val());
        else if (a == "--bytes") o.bytes = std::stoll(val());
        else if (a == "--rounds") o.rounds = std::stoi(val());
        else if (a == "--gap-us") o.gap_us = std::stoll(val());
        else if (a == "--compute-us") o.compute_us = std::stoll(val());
        else if (a == "--handoff") o.handoff = true;
        else if (a == "--cert") o.cert = val();
        else if (a == "--key") o.key = val();
        else if (a == "--ca") o.ca = val();
        else throw std::invalid_argument("unrecognized argument: " + a);
    }
    if (o.transport != "tcp" && o.transport != "tls") throw std::invalid_argument("--transport is tcp or tls");
    if (o.transport == "tls" && (o.cert.empty() || o.key.empty() || o.ca.empty()))
        throw std::invalid_argument("--transport tls needs --cert, --key and --ca (`dgr certs init` and `dgr certs issue` make them)");
    if (o.stages < 2 || o.stages > 16) throw std::invalid_argument("--stages is 2..16");
    if (o.bytes < 1 || o.bytes > (64 << 20)) throw std::invalid_argument("--bytes is 1..64 MiB");
    if (o.rounds < 1 || o.gap_us < 0 || o.compute_us < 0) throw std::invalid_argument("--rounds >= 1, --gap-us and --compute-us >= 0");
    return 0;
}

}  // namespace

int main(int argc, char ** argv) {
    signal(SIGPIPE, SIG_IGN);   // a write to a gone peer is an error to report, not a silent death
    Opts o;
    try {
        parse(argc, argv, o);
    } catch (const std::exception & e) {
        fprintf(stderr, "dgr-hop-probe: %s\n", e.what());
        return 2;
    }
    std::vector<int> lfds, ports;
    for (int i = 0; i < o.stages; ++i) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t n = sizeof a;
        if (bind(fd, reinterpret_cast<sockaddr *>(&a), n) != 0 || listen(fd, 4) != 0 ||
            getsockname(fd, reinterpret_cast<sockaddr *>(&a), &n) != 0)
            die("cannot listen on 127.0.0.1");
        lfds.push_back(fd);
        ports.push_back(ntohs(a.sin_port));
    }
    std::vector<pid_t> pids;
    std::vector<int> pipes;
    for (int i = 0; i < o.stages; ++i) {
        int p[2];
        if (pipe(p) != 0) die("pipe failed");
        pid_t pid = fork();
        if (pid < 0) die("fork failed");
        if (pid == 0) {
            close(p[0]);
            for (int j = 0; j < o.stages; ++j)
                if (j != i) close(lfds[j]);
            std::vector<int64_t> s = run_stage(o, i, lfds[i], ports[(i + 1) % o.stages]);
            std::string text;
            for (int64_t x : s) text += std::to_string(x) + "\n";
            const char * d = text.data();
            size_t left = text.size();
            while (left > 0) {
                ssize_t k = write(p[1], d, left);
                if (k <= 0) _exit(3);
                d += k;
                left -= size_t(k);
            }
            _exit(0);
        }
        close(p[1]);
        pids.push_back(pid);
        pipes.push_back(p[0]);
    }
    // boundary j -> j+1 is recorded by its receiver: stage j+1, or stage 0 for the return
    std::vector<std::vector<int64_t>> into(o.stages);
    for (int i = 0; i < o.stages; ++i) {
        std::string text;
        char buf[65536];
        ssize_t k;
        while ((k = read(pipes[i], buf, sizeof buf)) > 0) text.append(buf, size_t(k));
        size_t at = 0;
        while (at < text.size()) {
            size_t nl = text.find('\n', at);
            into[i].push_back(std::stoll(text.substr(at, nl - at)));
            at = nl + 1;
        }
    }
    int bad = 0;
    for (size_t i = 0; i < pids.size(); ++i) {
        int st = 0;
        waitpid(pids[i], &st, 0);
        if (WIFEXITED(st) && WEXITSTATUS(st) == 0) continue;
        ++bad;
        if (WIFSIGNALED(st)) fprintf(stderr, "dgr-hop-probe: stage %zu died of signal %d\n", i, WTERMSIG(st));
        else fprintf(stderr, "dgr-hop-probe: stage %zu exited with %d\n", i, WEXITSTATUS(st));
    }
    if (bad) {
        fprintf(stderr, "dgr-hop-probe: %d stage process(es) failed\n", bad);
        return 1;
    }
    std::vector<int64_t> all;
    std::string rows;
    for (int j = 0; j < o.stages; ++j) {
        const int to = (j + 1) % o.stages;
        const auto & v = into[to];
        all.insert(all.end(), v.begin(), v.end());
        char row[160];
        snprintf(row, sizeof row, "%s{\"from\": %d, \"to\": %d, \"one_way_ms\": %.4f, \"p90_ms\": %.4f}", j ? ", " : "", j, to,
                 pct(v, 0.5), pct(v, 0.9));
        rows += row;
    }
    printf("{\"transport\": \"%s\", \"handoff\": %s, \"stages\": %d, \"bytes\": %lld, \"rounds\": %d, \"gap_us\": %lld, "
           "\"compute_us\": %lld, \"one_way_ms\": %.4f, \"p90_ms\": %.4f, \"boundaries\": [%s]}\n",
           o.transport.c_str(), o.handoff ? "true" : "false", o.stages, (long long)o.bytes, o.rounds, (long long)o.gap_us,
           (long long)o.compute_us, pct(all, 0.5), pct(all, 0.9), rows.c_str());
    return 0;
}
