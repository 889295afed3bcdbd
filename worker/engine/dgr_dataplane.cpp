// The native data plane (dgr_dataplane.h): decode steps round the ring in C++ over plain TCP.
//
// Threads: one accepts connections; one per incoming connection reads frames (a step is queued for the
// engine, a token or an error at the origin becomes an event); one engine thread takes the queued steps
// of distinct sessions into one dgr_forward and writes each result on (boundary to the next stage, the
// token to the origin). Outgoing connections are one per peer, shared by all sessions, written under a
// lock with one writev per frame (the boundary goes from the engine's output buffer to the kernel).
#include "dgr_dataplane.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <csignal>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace {

constexpr size_t   FIXED_BYTES   = 48;          // the fixed part of a frame body (proto/dgr/v1/native.md)
constexpr size_t   HOP_BYTES     = 36;          // one timing record
constexpr uint32_t MAX_BODY      = 1u << 24;    // a frame body larger than this (16 MiB) is refused
constexpr int      CONNECT_MS    = 2000;

int64_t mono_ns() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t) t.tv_sec * 1000000000 + t.tv_nsec;
}

int64_t unix_ns() {
    timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (int64_t) t.tv_sec * 1000000000 + t.tv_nsec;
}

struct frame {
    uint8_t     kind = 0;
    std::string sid;
    int64_t     epoch = 0;
    int32_t     position = 0;
    int32_t     token = 0;      // step: the input token; token: the draw; error: the reporting stage
    int32_t     code = 0;       // error: dgr_dp_error
    int64_t     origin_sent_ns = 0;
    int64_t     sent_unix_ns = 0;
    std::string origin;         // HOST:PORT of the origin's plane
    std::string msg;
    std::vector<dgr_dp_hop> hops;
    std::vector<float> floats;  // step: the boundary [n_streams * n_embd]
};

template <typename T> void put(std::string & b, T v) { b.append((const char *) &v, sizeof v); }
template <typename T> T take(const char *& p) { T v; memcpy(&v, p, sizeof v); p += sizeof v; return v; }

// magic, body length, then the body without its floats (those follow from their own buffer)
std::string head_of(const frame & f) {
    std::string b;
    b.reserve(8 + FIXED_BYTES + f.sid.size() + f.origin.size() + f.msg.size() + f.hops.size() * HOP_BYTES);
    const size_t nh = std::min<size_t>(f.hops.size(), DGR_DP_MAX_HOPS);
    const uint64_t body = FIXED_BYTES + f.sid.size() + f.origin.size() + f.msg.size() + nh * HOP_BYTES
                        + f.floats.size() * sizeof(float);
    put<uint32_t>(b, DGR_DP_MAGIC);
    put<uint32_t>(b, (uint32_t) body);
    put<uint8_t>(b, f.kind);
    put<uint8_t>(b, (uint8_t) nh);
    put<uint16_t>(b, (uint16_t) f.sid.size());
    put<uint16_t>(b, (uint16_t) f.origin.size());
    put<uint16_t>(b, (uint16_t) f.msg.size());
    put<int64_t>(b, f.epoch);
    put<int32_t>(b, f.position);
    put<int32_t>(b, f.token);
    put<int32_t>(b, f.code);
    put<uint32_t>(b, (uint32_t) f.floats.size());
    put<int64_t>(b, f.origin_sent_ns);
    put<int64_t>(b, f.sent_unix_ns);
    b += f.sid;
    b += f.origin;
    b += f.msg;
    for (size_t i = 0; i < nh; ++i) {
        const dgr_dp_hop & h = f.hops[i];
        put<int32_t>(b, h.stage_index);
        put<int64_t>(b, h.queue_ns);
        put<int64_t>(b, h.compute_ns);
        put<int64_t>(b, h.wire_ns);
        put<int64_t>(b, h.transit_ns);
    }
    return b;
}

bool read_all(int fd, void * buf, size_t n) {
    char * p = (char *) buf;
    while (n > 0) {
        const ssize_t r = recv(fd, p, n, 0);
        if (r == 0) return false;
        if (r < 0) {
            if (errno == EINTR) continue;
            return false;
        }
        p += r;
        n -= (size_t) r;
    }
    return true;
}

bool write_all(int fd, iovec * iov, int n) {
    while (n > 0) {
        msghdr m {};
        m.msg_iov = iov;
        m.msg_iovlen = (size_t) n;
        ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return false;
        }
        while (n > 0 && (size_t) w >= iov->iov_len) {
            w -= (ssize_t) iov->iov_len;
            ++iov;
            --n;
        }
        if (n > 0) {
            iov->iov_base = (char *) iov->iov_base + w;
            iov->iov_len -= (size_t) w;
        }
    }
    return true;
}

// Read one frame; false at EOF, on a socket error or a malformed frame (`why` says which).
bool read_frame(int fd, frame & f, std::string & why) {
    uint32_t hdr[2];
    if (!read_all(fd, hdr, sizeof hdr)) { why = "closed"; return false; }
    if (hdr[0] != DGR_DP_MAGIC) { why = "not a dgr native frame (bad magic)"; return false; }
    if (hdr[1] < FIXED_BYTES || hdr[1] > MAX_BODY) { why = "frame body length out of range"; return false; }
    char fixed[FIXED_BYTES];
    if (!read_all(fd, fixed, sizeof fixed)) { why = "truncated frame"; return false; }
    const char * p = fixed;
    f.kind = take<uint8_t>(p);
    const uint8_t  nh    = take<uint8_t>(p);
    const uint16_t nsid  = take<uint16_t>(p);
    const uint16_t norig = take<uint16_t>(p);
    const uint16_t nmsg  = take<uint16_t>(p);
    f.epoch    = take<int64_t>(p);
    f.position = take<int32_t>(p);
    f.token    = take<int32_t>(p);
    f.code     = take<int32_t>(p);
    const uint32_t nfl = take<uint32_t>(p);
    f.origin_sent_ns = take<int64_t>(p);
    f.sent_unix_ns   = take<int64_t>(p);
    const uint64_t rest = (uint64_t) nsid + norig + nmsg + (uint64_t) nh * HOP_BYTES;
    if (FIXED_BYTES + rest + (uint64_t) nfl * sizeof(float) != hdr[1] || nh > DGR_DP_MAX_HOPS) {
        why = "frame lengths disagree with its body length";
        return false;
    }
    std::string var(rest, '\0');
    if (rest && !read_all(fd, &var[0], rest)) { why = "truncated frame"; return false; }
    p = var.data();
    f.sid.assign(p, nsid);     p += nsid;
    f.origin.assign(p, norig); p += norig;
    f.msg.assign(p, nmsg);     p += nmsg;
    f.hops.resize(nh);
    for (auto & h : f.hops) {
        h.stage_index = take<int32_t>(p);
        h.queue_ns    = take<int64_t>(p);
        h.compute_ns  = take<int64_t>(p);
        h.wire_ns     = take<int64_t>(p);
        h.transit_ns  = take<int64_t>(p);
    }
    f.floats.resize(nfl);
    if (nfl && !read_all(fd, f.floats.data(), (size_t) nfl * sizeof(float))) { why = "truncated frame"; return false; }
    return true;
}

bool split_addr(const std::string & a, std::string & host, std::string & port) {
    const size_t c = a.rfind(':');
    if (c == std::string::npos || c == 0 || c + 1 >= a.size()) return false;
    host = a.substr(0, c);
    port = a.substr(c + 1);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    return true;
}

int connect_to(const std::string & addr, std::string & why) {
    std::string host, port;
    if (!split_addr(addr, host, port)) { why = "'" + addr + "' is not HOST:PORT"; return -1; }
    addrinfo hints {}, * res = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    const int gai = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
    if (gai != 0) { why = std::string("cannot resolve ") + addr + ": " + gai_strerror(gai); return -1; }
    int fd = -1;
    why = "no address";
    for (addrinfo * ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) continue;
        int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (rc < 0 && errno == EINPROGRESS) {
            pollfd pf { fd, POLLOUT, 0 };
            rc = poll(&pf, 1, CONNECT_MS) == 1 ? 0 : -1;
            int err = 0;
            socklen_t len = sizeof err;
            if (rc == 0 && (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0)) {
                errno = err;
                rc = -1;
            } else if (rc != 0) {
                errno = ETIMEDOUT;
            }
        }
        if (rc == 0) break;
        why = strerror(errno);
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd >= 0) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        // back to blocking writes (a full socket buffer waits for the peer, as TCP does)
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    }
    return fd;
}

struct out_conn {
    int fd = -1;
    std::mutex mu;
    ~out_conn() { if (fd >= 0) close(fd); }
};

// What a step of a session needs after its forward: where it goes, and the last stage's draw.
struct dp_plan {
    std::string next;
    bool        logits = false;    // the last stage: send each token's logits row with it
    double      temperature = 0.0; // the last stage's draw (dgr_sample)
    int32_t     top_k = 0;
    double      top_p = 0.0;
    uint64_t    seed = 0;

    bool wants_row() const { return logits || temperature > 0.0; }
};

struct dp_session {
    dp_plan     plan;
    int64_t     last_used = 0;
    bool        decoding = false;
    int32_t     remaining = 0;
    std::set<int32_t> stop;
};

struct work {
    frame   f;
    int64_t t_recv = 0;        // monotonic, when it was queued
    int64_t transit_ns = 0;
};

using sess_key = std::pair<std::string, int64_t>;

} // namespace

struct dgr_dp {
    dgr_engine *   eng = nullptr;
    dgr_stage_info info {};
    int32_t        stage_index = 0;
    std::string    self;            // HOST:PORT of this plane (the origin's name in its frames)
    int            listen_fd = -1;
    std::atomic<bool> stopping { false };

    std::mutex mu;                  // sessions, pending, events, incoming
    std::condition_variable work_cv, event_cv;
    std::map<sess_key, dp_session> sessions;
    std::deque<work> pending;
    bool busy = false;              // a thread is driving the engine (drain)
    int32_t max_batch = 64;         // sessions per forward (dgr_dp_configure; 1: no sharing)
    int32_t hold = 0;               // tests: run only when this many sessions (or all registered) wait
    int64_t n_registered = 0;       // sessions ever registered here (a hold is strict until `hold` were)
    std::set<std::tuple<std::string, int64_t, int32_t>> die_at;   // tests: (session, epoch, position)
    std::deque<std::pair<dgr_dp_event, std::vector<float>>> events;   // with the token's logits row
    std::set<int> incoming;
    std::vector<std::thread> readers;
    int64_t n_steps = 0, n_forwards = 0;

    std::mutex outs_mu;
    std::map<std::string, std::shared_ptr<out_conn>> outs;

    std::thread acceptor, engine_thread;

    // ---------------------------------------------------------------- sending
    std::shared_ptr<out_conn> conn_to(const std::string & addr, bool fresh, std::string & why) {
        std::lock_guard<std::mutex> lock(outs_mu);
        auto it = outs.find(addr);
        if (it != outs.end() && !fresh) return it->second;
        if (it != outs.end()) outs.erase(it);
        auto c = std::make_shared<out_conn>();
        c->fd = connect_to(addr, why);
        if (c->fd < 0) return nullptr;
        outs[addr] = c;
        return c;
    }

    // One writev per frame; a broken connection is replaced once (a peer restarted in place).
    bool send(const std::string & addr, frame & f, std::string & why) {
        for (int attempt = 0; attempt < 2; ++attempt) {
            auto c = conn_to(addr, attempt > 0, why);
            if (!c) return false;
            f.sent_unix_ns = unix_ns();
            std::string head = head_of(f);
            iovec iov[2] = { { &head[0], head.size() }, { f.floats.data(), f.floats.size() * sizeof(float) } };
            std::lock_guard<std::mutex> lock(c->mu);
            if (write_all(c->fd, iov, f.floats.empty() ? 1 : 2)) return true;
            why = strerror(errno);
        }
        return false;
    }

    void event(dgr_dp_event && ev) {
        std::lock_guard<std::mutex> lock(mu);
        events.emplace_back(std::move(ev), std::vector<float>());
        event_cv.notify_one();
    }

    static void fill_id(dgr_dp_event & ev, const frame & f) {
        snprintf(ev.session_id, sizeof ev.session_id, "%s", f.sid.c_str());
        ev.epoch = f.epoch;
    }

    // An error about session `f` goes to its origin (an event when this is the origin).
    void fail(const frame & f, int32_t code, const std::string & message) {
        frame e;
        e.kind = DGR_DP_ERROR;
        e.sid = f.sid;
        e.epoch = f.epoch;
        e.position = f.position;
        e.token = stage_index;
        e.code = code;
        e.msg = message.substr(0, 500);
        if (info.is_first || f.origin.empty() || f.origin == self) {
            on_error(e);
            return;
        }
        std::string why;
        if (!send(f.origin, e, why)) {
            fprintf(stderr, "dgr: native plane: cannot tell the origin %s about session %s (%s): %s\n",
                    f.origin.c_str(), f.sid.c_str(), why.c_str(), message.c_str());
        }
    }

    // ---------------------------------------------------------------- the origin
    void on_error(const frame & e) {
        {
            std::lock_guard<std::mutex> lock(mu);
            auto it = sessions.find(sess_key(e.sid, e.epoch));
            if (it == sessions.end() || !it->second.decoding) return;   // closed: nobody waits for it
            it->second.decoding = false;
        }
        dgr_dp_event ev {};
        fill_id(ev, e);
        ev.kind = DGR_DP_ERROR;
        ev.error_code = e.code;
        ev.position = e.position;
        ev.stage_index = e.token;
        snprintf(ev.message, sizeof ev.message, "%s", e.msg.c_str());
        event(std::move(ev));
    }

    // `from_reader`: the reader thread that read it runs the next step itself and wakes the control plane
    // after that step started (read_loop); else the engine thread runs it and the control plane is woken now.
    void on_token(frame & f, int64_t transit_ns, bool from_reader = false) {
        dgr_dp_event ev {};
        fill_id(ev, f);
        ev.kind = DGR_DP_TOKEN;
        ev.token_id = f.token;
        ev.position = f.position;
        ev.ring_ns = f.origin_sent_ns ? mono_ns() - f.origin_sent_ns : 0;
        ev.return_ns = transit_ns;
        ev.n_hops = (int32_t) std::min<size_t>(f.hops.size(), DGR_DP_MAX_HOPS);
        std::copy(f.hops.begin(), f.hops.begin() + ev.n_hops, ev.hops);
        const int32_t next_pos = f.position + 1;
        bool full = false;
        {
            std::lock_guard<std::mutex> lock(mu);
            auto it = sessions.find(sess_key(f.sid, f.epoch));
            if (it == sessions.end() || !it->second.decoding) return;
            dp_session & s = it->second;
            s.remaining--;
            ev.done = s.stop.count(f.token) || s.remaining <= 0;
            if (!ev.done && next_pos >= info.n_ctx) {
                full = true;
                s.decoding = false;
            } else if (!ev.done) {      // the next step first: the ring goes on while the token is streamed
                queue_step(f.sid, f.epoch, next_pos, f.token, !from_reader);
            } else {
                s.decoding = false;
            }
            ev.n_logits = (int32_t) f.floats.size();
            events.emplace_back(ev, std::move(f.floats));
            if (full) {
                dgr_dp_event e {};
                fill_id(e, f);
                e.kind = DGR_DP_ERROR;
                e.error_code = DGR_DP_E_CONTEXT_FULL;
                e.position = next_pos;
                e.stage_index = stage_index;
                events.emplace_back(e, std::vector<float>());
            }
            if (!from_reader) event_cv.notify_one();
        }
    }

    // (mu held) whether queued steps may run: some are queued and, with a hold (tests), steps of `hold`
    // distinct sessions wait; once `hold` sessions have been registered, of every session still registered
    // when fewer are (so the last rounds of a test's sessions, and later single sessions, run)
    bool runnable() const {
        if (pending.empty()) return false;
        if (hold <= 0) return true;
        std::set<sess_key> waiting;
        for (const work & w : pending) waiting.insert(sess_key(w.f.sid, w.f.epoch));
        const int64_t need = n_registered < hold ? hold : std::min<int64_t>(hold, (int64_t) sessions.size());
        return (int64_t) waiting.size() >= need;
    }

    // (mu held) the origin's own next step: the token at `pos`, no boundary
    void queue_step(const std::string & sid, int64_t epoch, int32_t pos, int32_t token, bool wake = true) {
        work w;
        w.f.kind = DGR_DP_STEP;
        w.f.sid = sid;
        w.f.epoch = epoch;
        w.f.position = pos;
        w.f.token = token;
        w.f.origin = self;
        w.f.origin_sent_ns = w.t_recv = mono_ns();
        pending.push_back(std::move(w));
        if (wake) work_cv.notify_one();
    }

    // ---------------------------------------------------------------- reading
    void read_loop(int fd) {
        for (;;) {
            frame f;
            std::string why;
            if (!read_frame(fd, f, why)) {
                if (why != "closed" && !stopping) {
                    fprintf(stderr, "dgr: native plane: dropped a connection: %s\n", why.c_str());
                }
                break;
            }
            const int64_t transit = f.sent_unix_ns ? std::max<int64_t>(0, unix_ns() - f.sent_unix_ns) : 0;
            if (f.kind == DGR_DP_TOKEN) {
                // the next step starts before the control plane is woken for this token: woken first, it
                // takes the core and the engine (detokenizing) and the step waits behind it
                on_token(f, transit, true);
                pollfd pf { fd, POLLIN, 0 };
                if (poll(&pf, 1, 0) <= 0) {     // more tokens already here: their steps share the forward
                    kick_and_tell();
                }
            } else if (f.kind == DGR_DP_ERROR) {
                on_error(f);
            } else if (f.kind == DGR_DP_STEP) {
                {
                    std::lock_guard<std::mutex> lock(mu);
                    work w;
                    w.f = std::move(f);
                    w.t_recv = mono_ns();
                    w.transit_ns = transit;
                    pending.push_back(std::move(w));
                }
                // more frames already here (other sessions): queue them too, so they share the forward
                pollfd pf { fd, POLLIN, 0 };
                if (poll(&pf, 1, 0) <= 0) kick();
            } else {
                fprintf(stderr, "dgr: native plane: dropped a connection: unknown frame kind %d\n", f.kind);
                break;
            }
        }
        kick_and_tell();                // a step (or a token) this loop queued and left for the next frame
        std::lock_guard<std::mutex> lock(mu);
        if (incoming.erase(fd)) close(fd);
    }

    void accept_loop() {
        while (!stopping) {
            const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
            if (fd < 0) {
                if (errno == EINTR || errno == ECONNABORTED) continue;
                break;
            }
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            std::lock_guard<std::mutex> lock(mu);
            if (stopping) { close(fd); break; }
            incoming.insert(fd);
            readers.emplace_back([this, fd] { read_loop(fd); });
        }
    }

    // ---------------------------------------------------------------- the engine
    // The engine is driven by one thread at a time, whichever holds `busy`: a reader thread that just
    // queued a boundary step runs it (and whatever else is queued) at once, rather than waking the engine
    // thread (a hand-off costs about as much as the hop itself on a busy machine); the engine thread runs
    // the origin's own steps (queued with a token, when the control plane is woken too) and anything left
    // while nobody drains.
    void engine_loop() {
        for (;;) {
            {
                std::unique_lock<std::mutex> lock(mu);
                work_cv.wait(lock, [&] { return stopping || (runnable() && !busy); });
                if (stopping) return;
                busy = true;
            }
            drain();
        }
    }

    // The origin: wake the control plane once the queued steps have started (or someone else runs them).
    void kick_and_tell() {
        bool mine = false;
        {
            std::lock_guard<std::mutex> lock(mu);
            if (!busy && runnable() && !stopping) {
                busy = mine = true;
            }
        }
        if (mine) {
            drain(true);
        } else {
            std::lock_guard<std::mutex> lock(mu);
            event_cv.notify_one();
        }
    }

    // Run queued steps if no other thread is: called after queueing one, without `mu`.
    void kick() {
        {
            std::lock_guard<std::mutex> lock(mu);
            if (busy || !runnable() || stopping) return;
            busy = true;
        }
        drain();
    }

    // (`busy` is ours) batches until the queue is empty, then let go of `busy`. `tell`: wake the control
    // plane's event thread once the first forward has started (kick_and_tell).
    void drain(bool tell = false) {
        const int32_t width = info.n_streams * info.n_embd;
        for (;;) {
            std::vector<work> batch;
            {
                std::unique_lock<std::mutex> lock(mu);
                if (stopping || !runnable()) {
                    busy = false;
                    return;
                }
                // one step per session per forward (distinct sessions), in arrival order
                std::set<sess_key> taken;
                for (auto it = pending.begin(); it != pending.end() && batch.size() < (size_t) max_batch;) {
                    sess_key k(it->f.sid, it->f.epoch);
                    if (taken.count(k)) { ++it; continue; }
                    taken.insert(k);
                    batch.push_back(std::move(*it));
                    it = pending.erase(it);
                }
            }
            std::vector<work *> unknown, misfit;
            std::vector<std::pair<work *, dp_plan>> ready;
            {
                std::lock_guard<std::mutex> lock(mu);
                for (auto & w : batch) {
                    auto it = sessions.find(sess_key(w.f.sid, w.f.epoch));
                    if (it == sessions.end()) {
                        unknown.push_back(&w);
                    } else if (!info.is_first && (int32_t) w.f.floats.size() != width) {
                        misfit.push_back(&w);
                    } else {
                        it->second.last_used = mono_ns();
                        ready.emplace_back(&w, it->second.plan);
                    }
                }
            }
            for (work * w : unknown) {
                fail(w->f, DGR_DP_E_UNKNOWN, "stage " + std::to_string(stage_index) + " has no native session " +
                     w->f.sid + " epoch " + std::to_string(w->f.epoch) + " (closed or reaped): open it again");
            }
            for (work * w : misfit) {
                fail(w->f, DGR_DP_E_ENGINE, "stage " + std::to_string(stage_index) + " takes " + std::to_string(width) +
                     " boundary floats per token, the frame has " + std::to_string(w->f.floats.size()));
            }
            if (!ready.empty()) {
                run(ready, width, tell);
            } else if (tell) {
                std::lock_guard<std::mutex> lock(mu);
                event_cv.notify_one();
            }
            tell = false;
        }
    }

    void run(std::vector<std::pair<work *, dp_plan>> & ready, int32_t width, bool tell = false) {
        const size_t n = ready.size();
        if (!die_at.empty()) {          // tests: a kill -9 at an exact step, whatever the timing
            for (auto & r : ready) {
                const frame & f = r.first->f;
                if (die_at.count(std::make_tuple(f.sid, f.epoch, f.position))) {
                    fprintf(stderr, "dgr: native plane: --test-die-at %s:%lld:%d reached: SIGKILL\n", f.sid.c_str(),
                            (long long) f.epoch, f.position);
                    raise(SIGKILL);
                }
            }
        }
        std::vector<dgr_step> steps(n);
        std::vector<dgr_step_out> outs(n);
        std::vector<std::vector<float>> bouts(n);
        for (size_t k = 0; k < n; ++k) {
            frame & f = ready[k].first->f;
            dgr_step & s = steps[k];
            s.session_id = f.sid.c_str();
            s.epoch = f.epoch;
            s.n_tokens = 1;
            s.positions = &f.position;
            s.token_ids = &f.token;
            s.boundary = info.is_first ? nullptr : f.floats.data();
            s.boundary_width = info.is_first ? 0 : width;
            s.want_logits = info.is_last && ready[k].second.wants_row() ? DGR_LOGITS_LAST : DGR_LOGITS_NONE;
            outs[k] = dgr_step_out {};
            if (!info.is_last) {
                bouts[k].resize((size_t) width);
                outs[k].boundary = bouts[k].data();
            } else if (ready[k].second.wants_row()) {   // the row the token is drawn from
                bouts[k].resize((size_t) info.n_vocab);
                outs[k].logits = bouts[k].data();
            }
        }
        const int64_t t0 = mono_ns();
        if (tell) {                     // the tokens these steps follow: to the control plane now
            std::lock_guard<std::mutex> lock(mu);
            event_cv.notify_one();
        }
        int32_t rc = dgr_forward(eng, (int32_t) n, steps.data(), outs.data());
        int64_t compute = mono_ns() - t0;
        std::vector<int32_t> ok(n, rc == DGR_OK);
        if (rc != DGR_OK) {
            if (n == 1) {
                fail(ready[0].first->f, rc == DGR_E_CACHE_MISS ? DGR_DP_E_CACHE_MISS : DGR_DP_E_ENGINE, dgr_last_error());
            } else {                    // find the step at fault: the others go on
                for (size_t k = 0; k < n; ++k) {
                    const int64_t t1 = mono_ns();
                    const int32_t r = dgr_forward(eng, 1, &steps[k], &outs[k]);
                    if (r == DGR_OK) {
                        ok[k] = 1;
                    } else {
                        fail(ready[k].first->f, r == DGR_E_CACHE_MISS ? DGR_DP_E_CACHE_MISS : DGR_DP_E_ENGINE, dgr_last_error());
                    }
                    compute = mono_ns() - t1;
                }
            }
        }
        {
            std::lock_guard<std::mutex> lock(mu);
            n_steps += (int64_t) n;
            n_forwards += 1;
        }
        for (size_t k = 0; k < n; ++k) {
            if (!ok[k]) continue;
            work & w = *ready[k].first;
            frame out;
            const int64_t tw = mono_ns();
            out.sid = std::move(w.f.sid);
            out.epoch = w.f.epoch;
            out.position = w.f.position;
            out.origin = std::move(w.f.origin);
            out.origin_sent_ns = w.f.origin_sent_ns;
            out.hops = std::move(w.f.hops);
            dgr_dp_hop h {};
            h.stage_index = stage_index;
            h.queue_ns = t0 - w.t_recv;
            h.compute_ns = compute;
            h.transit_ns = w.transit_ns;
            std::string dest;
            if (info.is_last) {
                out.kind = DGR_DP_TOKEN;
                const dp_plan & d = ready[k].second;
                out.token = d.temperature > 0.0
                    ? dgr_sample(bouts[k].data(), info.n_vocab, d.temperature, d.top_k, d.top_p, d.seed, w.f.position)
                    : outs[k].next_token;
                if (d.logits) out.floats = std::move(bouts[k]);   // travels with it only when asked for
                dest = out.origin;
            } else {
                out.kind = DGR_DP_STEP;
                out.token = w.f.token;          // the token-id sideband travels with every step
                out.floats = std::move(bouts[k]);
                dest = ready[k].second.next;
            }
            h.wire_ns = mono_ns() - tw;
            out.hops.push_back(h);
            if (info.is_last && (info.is_first || dest == self)) {
                on_token(out, 0);
                continue;
            }
            std::string why;
            if (!send(dest, out, why)) {
                if (info.is_last) {             // the origin is gone: nobody to tell (its client sees it)
                    fprintf(stderr, "dgr: native plane: cannot return a token of session %s to the origin %s: %s\n",
                            out.sid.c_str(), dest.c_str(), why.c_str());
                    continue;
                }
                fail(out, DGR_DP_E_UNREACHABLE, "stage " + std::to_string(stage_index) + " could not write to stage " +
                     std::to_string(stage_index + 1) + " (" + dest + "): " + why +
                     ": that worker died or stopped; use another replica or restart it");
            }
        }
    }
};

extern "C" {

int32_t dgr_dp_start(dgr_engine * eng, const char * host, int32_t port, int32_t stage_index, dgr_dp ** out,
                     int32_t * bound_port) {
    if (!eng || !out || !host) return DGR_E_ENGINE;
    auto dp = std::make_unique<dgr_dp>();
    dp->eng = eng;
    dp->stage_index = stage_index;
    if (dgr_engine_describe(eng, &dp->info) != DGR_OK) return DGR_E_ENGINE;
    addrinfo hints {}, * res = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    const std::string h = host;
    const std::string p = std::to_string(port);
    if (getaddrinfo(h.empty() ? nullptr : h.c_str(), p.c_str(), &hints, &res) != 0 || !res) return DGR_E_ENGINE;
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (fd < 0 || bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, 64) != 0) {
        if (fd >= 0) close(fd);
        freeaddrinfo(res);
        return DGR_E_ENGINE;
    }
    freeaddrinfo(res);
    sockaddr_storage ss {};
    socklen_t len = sizeof ss;
    getsockname(fd, (sockaddr *) &ss, &len);
    const int32_t bound = ntohs(ss.ss_family == AF_INET6 ? ((sockaddr_in6 *) &ss)->sin6_port : ((sockaddr_in *) &ss)->sin_port);
    dp->listen_fd = fd;
    dp->self = (h.find(':') != std::string::npos ? "[" + h + "]" : h) + ":" + std::to_string(bound);
    dgr_dp * raw = dp.get();
    dp->acceptor = std::thread([raw] { raw->accept_loop(); });
    dp->engine_thread = std::thread([raw] { raw->engine_loop(); });
    if (bound_port) *bound_port = bound;
    *out = dp.release();
    return DGR_OK;
}

void dgr_dp_stop(dgr_dp * dp) {
    if (!dp) return;
    dp->stopping = true;
    shutdown(dp->listen_fd, SHUT_RDWR);
    {
        std::lock_guard<std::mutex> lock(dp->mu);
        for (int fd : dp->incoming) shutdown(fd, SHUT_RDWR);
        dp->work_cv.notify_all();
        dp->event_cv.notify_all();
    }
    {
        std::lock_guard<std::mutex> lock(dp->outs_mu);
        for (auto & kv : dp->outs) shutdown(kv.second->fd, SHUT_RDWR);
    }
    if (dp->acceptor.joinable()) dp->acceptor.join();
    if (dp->engine_thread.joinable()) dp->engine_thread.join();
    std::vector<std::thread> readers;
    {
        std::lock_guard<std::mutex> lock(dp->mu);
        readers.swap(dp->readers);
    }
    for (auto & t : readers) t.join();
    close(dp->listen_fd);
    delete dp;
}

int32_t dgr_dp_session(dgr_dp * dp, const char * sid, int64_t epoch, const char * next, int32_t logits,
                       double temperature, int32_t top_k, double top_p, uint64_t seed) {
    if (!dp || !sid) return DGR_E_ENGINE;
    std::lock_guard<std::mutex> lock(dp->mu);
    if (!dp->sessions.count(sess_key(sid, epoch))) dp->n_registered += 1;
    dp_session & s = dp->sessions[sess_key(sid, epoch)];
    s.plan = dp_plan { next ? next : "", logits != 0, temperature, top_k, top_p, seed };
    s.last_used = mono_ns();
    return DGR_OK;
}

int32_t dgr_dp_forget(dgr_dp * dp, const char * sid, int64_t epoch) {
    if (!dp || !sid) return DGR_E_ENGINE;
    const sess_key k(sid, epoch);
    std::vector<work> dropped;
    {
        std::lock_guard<std::mutex> lock(dp->mu);
        dp->sessions.erase(k);
        dp->work_cv.notify_one();       // a hold may now be met by fewer sessions
        for (auto it = dp->pending.begin(); it != dp->pending.end();) {
            if (it->f.sid == k.first && it->f.epoch == k.second) {
                dropped.push_back(std::move(*it));
                it = dp->pending.erase(it);
            } else {
                ++it;
            }
        }
    }
    // a step that waited here is answered, never dropped in silence: an origin still decoding the
    // session hears of it (one that closed the session itself ignores it)
    for (const work & w : dropped) {
        dp->fail(w.f, DGR_DP_E_UNKNOWN, "stage " + std::to_string(dp->stage_index) + " closed session " + w.f.sid +
                 " epoch " + std::to_string(w.f.epoch) + " while its step waited there (closed or reaped): open it again");
    }
    return DGR_OK;
}

int32_t dgr_dp_decode(dgr_dp * dp, const char * sid, int64_t epoch, int32_t position, int32_t token, int32_t max_new,
                      const int32_t * stop_ids, int32_t n_stop) {
    if (!dp || !sid || !dp->info.is_first) return DGR_E_ENGINE;
    std::lock_guard<std::mutex> lock(dp->mu);
    auto it = dp->sessions.find(sess_key(sid, epoch));
    if (it == dp->sessions.end()) return DGR_E_ENGINE;
    dp_session & s = it->second;
    s.decoding = max_new > 0;
    s.remaining = max_new;
    s.stop.clear();
    for (int32_t i = 0; i < n_stop; ++i) s.stop.insert(stop_ids[i]);
    if (s.decoding) dp->queue_step(sid, epoch, position, token);
    return DGR_OK;
}

int32_t dgr_dp_next_event(dgr_dp * dp, int32_t timeout_ms, dgr_dp_event * out, float * logits, int32_t cap) {
    if (!dp || !out) return -1;
    std::unique_lock<std::mutex> lock(dp->mu);
    dp->event_cv.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                          [&] { return dp->stopping || !dp->events.empty(); });
    if (!dp->events.empty()) {
        auto & front = dp->events.front();
        *out = front.first;
        const std::vector<float> & row = front.second;
        out->n_logits = (int32_t) std::min<size_t>(row.size(), logits ? (size_t) std::max(cap, 0) : 0);
        if (out->n_logits) memcpy(logits, row.data(), sizeof(float) * (size_t) out->n_logits);
        dp->events.pop_front();
        return 1;
    }
    return dp->stopping ? -1 : 0;
}

int64_t dgr_dp_last_used(dgr_dp * dp, const char * sid, int64_t epoch) {
    if (!dp || !sid) return 0;
    std::lock_guard<std::mutex> lock(dp->mu);
    auto it = dp->sessions.find(sess_key(sid, epoch));
    return it == dp->sessions.end() ? 0 : it->second.last_used;
}

int32_t dgr_dp_die_at(dgr_dp * dp, const char * sid, int64_t epoch, int32_t position) {
    if (!dp || !sid) return DGR_E_ENGINE;
    std::lock_guard<std::mutex> lock(dp->mu);
    dp->die_at.insert(std::make_tuple(std::string(sid), epoch, position));
    return DGR_OK;
}

int32_t dgr_dp_configure(dgr_dp * dp, int32_t max_batch_sessions, int32_t hold_sessions) {
    if (!dp || max_batch_sessions < 1 || hold_sessions < 0) return DGR_E_ENGINE;
    std::lock_guard<std::mutex> lock(dp->mu);
    dp->max_batch = max_batch_sessions;
    dp->hold = hold_sessions;
    dp->work_cv.notify_one();
    return DGR_OK;
}

void dgr_dp_counts(dgr_dp * dp, int64_t * steps, int64_t * forwards) {
    if (!dp) return;
    std::lock_guard<std::mutex> lock(dp->mu);
    if (steps) *steps = dp->n_steps;
    if (forwards) *forwards = dp->n_forwards;
}

} // extern "C"
