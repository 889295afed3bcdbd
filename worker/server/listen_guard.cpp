// The descriptor guard (listen_guard.h): a socket mutator on every connection gRPC accepts, a decoy listener, and
// the thread that puts the real one back.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <grpc/support/sync.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/server_builder_option.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

// gRPC's socket mutator (src/core/lib/iomgr/socket_mutator.h, not installed; the same layout from 1.13 through
// 1.6x, and 1.51's libgrpc exports the functions that read it): gRPC calls mutate_fd_2 on its listening socket
// when it makes it, and on every connection it accepts, in its accept loop, before anything else.
typedef enum {
    GRPC_FD_CLIENT_CONNECTION_USAGE,
    GRPC_FD_SERVER_LISTENER_USAGE,
    GRPC_FD_SERVER_CONNECTION_USAGE,
} grpc_fd_usage;
typedef struct {
    int fd;
    grpc_fd_usage usage;
} grpc_mutate_socket_info;
struct grpc_socket_mutator_vtable {
    bool (*mutate_fd)(int fd, grpc_socket_mutator * mutator);
    int (*compare)(grpc_socket_mutator * a, grpc_socket_mutator * b);
    void (*destroy)(grpc_socket_mutator * mutator);
    bool (*mutate_fd_2)(const grpc_mutate_socket_info * info, grpc_socket_mutator * mutator);
};
struct grpc_socket_mutator {
    const grpc_socket_mutator_vtable * vtable;
    gpr_refcount refcount;
};

#include "listen_guard.h"

namespace dgr::serve {

namespace {

// ------------------------------------------------------------------------------------- descriptors
//
// gRPC 1.51's listener (tcp_server_posix.cc, on_read) stops accepting for good the first time accept4 fails
// with anything but EAGAIN/EINTR: one EMFILE (every descriptor taken, e.g. by a flood of bare TCP
// connections) and the port never accepts again, though the process serves on (later gRPC retries after a
// second). So the worker never lets gRPC's accept4 meet EMFILE:
//
// - at start the soft RLIMIT_NOFILE is raised to the hard one, and --max-connections must leave room below it;
// - every connection gRPC accepts passes through a socket mutator first (in gRPC's accept loop). When the
//   descriptor it got is within `margin` of the limit (descriptors are handed out lowest first, so every one
//   below it is taken), the connection is shut down (gRPC fails its handshake and closes it), and the
//   listening descriptor is pointed (dup2) at a decoy: a listening socket no connection can reach (a socket
//   filter drops every packet), whose accept4 answers EAGAIN. gRPC's loop ends there and waits, as it does on
//   any idle listener; connections meanwhile wait in the kernel's listen queue (clients connecting then wait,
//   connections already made are served on);
// - a guard thread puts the real listening socket back once enough descriptors are free again (the flood's
//   connections closed, or closed by --handshake-timeout), and connects to it once so that gRPC looks at the
//   listen queue again (its poller is edge triggered).
//
// The real socket stays open meanwhile (the guard holds a duplicate), so the poller's registration of it, its
// port and its queue live on.
class ListenGuard {
public:
    static ListenGuard & get() {
        static ListenGuard * g = new ListenGuard;    // lives as long as the process (gRPC holds its mutator)
        return *g;
    }

    grpc_socket_mutator * mutator() { return &base_; }

    void set_limit(int64_t limit) {
        limit_ = int(std::min<int64_t>(limit, 1 << 30));
        margin_ = margin_for(limit_);
    }

    static int margin_for(int64_t limit) { return int(std::clamp<int64_t>(limit / 16, 8, 256)); }

    // After the server started: the listening sockets gRPC made, checked (listening, on `port`), duplicated,
    // and a decoy; then the thread that puts them back.
    void arm(int port) {
        std::lock_guard<std::mutex> g(mu_);
        for (int fd : candidates_) {
            int listening = 0;
            socklen_t len = sizeof listening;
            sockaddr_storage ss{};
            socklen_t sl = sizeof ss;
            if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening) continue;
            if (getsockname(fd, reinterpret_cast<sockaddr *>(&ss), &sl) != 0) continue;
            const int p = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6 *>(&ss)->sin6_port)
                                                   : ntohs(reinterpret_cast<sockaddr_in *>(&ss)->sin_port);
            if (p != port) continue;
            int real = fcntl(fd, F_DUPFD_CLOEXEC, 0);
            if (real < 0) continue;
            listeners_.push_back(Listener{fd, real, ss});
        }
        if (listeners_.empty()) {
            std::fprintf(stderr, "dgr-worker: warning: gRPC's listening socket was not found: a flood that takes every "
                                 "descriptor could stop this port accepting\n");
            return;
        }
        decoy_ = make_decoy();
        if (decoy_ < 0) {
            std::fprintf(stderr, "dgr-worker: warning: no decoy socket (%s): a flood that takes every descriptor could "
                                 "stop this port accepting\n", std::strerror(errno));
            listeners_.clear();
            return;
        }
        struct stat st{};
        fstat(decoy_, &st);
        decoy_id_ = {st.st_dev, st.st_ino};
        armed_ = true;
        std::thread([this] { run(); }).detach();
    }

private:
    struct Listener {
        int fd;                                      // gRPC's descriptor
        int real;                                    // ours: the same socket
        sockaddr_storage addr;
    };

    ListenGuard() {
        static const grpc_socket_mutator_vtable vt = {&mutate_fd, &compare, &destroy, &mutate_fd_2};
        base_.vtable = &vt;
        gpr_ref_init(&base_.refcount, 1);            // never released: this object outlives gRPC
    }

    static ListenGuard & of(grpc_socket_mutator * m) { return *reinterpret_cast<ListenGuard *>(m); }
    static bool mutate_fd(int, grpc_socket_mutator *) { return true; }
    static int compare(grpc_socket_mutator * a, grpc_socket_mutator * b) { return a < b ? -1 : a > b ? 1 : 0; }
    static void destroy(grpc_socket_mutator *) {}
    // never false: gRPC would give up the listener, the very thing this guards
    static bool mutate_fd_2(const grpc_mutate_socket_info * info, grpc_socket_mutator * m) {
        ListenGuard & g = of(m);
        if (info->usage == GRPC_FD_SERVER_LISTENER_USAGE) {
            std::lock_guard<std::mutex> l(g.mu_);
            g.candidates_.push_back(info->fd);
        } else if (info->usage == GRPC_FD_SERVER_CONNECTION_USAGE && g.limit_ > 0 && info->fd >= g.limit_ - g.margin_) {
            shutdown(info->fd, SHUT_RDWR);           // gRPC's handshake fails on it, and gRPC closes it
            g.shed_.fetch_add(1);
            g.hold();
        }
        return true;
    }

    // a listening TCP socket on loopback that nothing reaches: a classic BPF filter that drops every packet
    static int make_decoy() {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) return -1;
        sock_filter drop[] = {{BPF_RET | BPF_K, 0, 0, 0}};
        sock_fprog prog{1, drop};
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (setsockopt(fd, SOL_SOCKET, SO_ATTACH_FILTER, &prog, sizeof prog) != 0 ||
            bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0 || listen(fd, 1) != 0) {
            int e = errno;
            close(fd);
            errno = e;
            return -1;
        }
        return fd;
    }

    bool is_decoy(int fd) const {
        struct stat st{};
        return fstat(fd, &st) == 0 && st.st_dev == decoy_id_.first && st.st_ino == decoy_id_.second;
    }

    // (gRPC's accept loop) the listening descriptors onto the decoy
    void hold() {
        if (!armed_ || held_.exchange(true)) return;
        for (auto & l : listeners_) dup2(decoy_, l.fd);
        std::lock_guard<std::mutex> g(mu_);
        cv_.notify_all();
    }

    static int open_descriptors() {
        DIR * d = opendir("/proc/self/fd");
        if (!d) return -1;
        int n = 0;
        while (readdir(d)) ++n;
        closedir(d);
        return n - 3;                                // ".", ".." and the directory's own
    }

    // one connection to the real socket: gRPC's poller is told there is something to accept
    static void poke(const sockaddr_storage & addr) {
        sockaddr_storage to = addr;
        if (to.ss_family == AF_INET) {
            auto * a = reinterpret_cast<sockaddr_in *>(&to);
            if (a->sin_addr.s_addr == htonl(INADDR_ANY)) a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        } else if (to.ss_family == AF_INET6) {
            auto * a = reinterpret_cast<sockaddr_in6 *>(&to);
            if (IN6_IS_ADDR_UNSPECIFIED(&a->sin6_addr)) a->sin6_addr = in6addr_loopback;
        }
        int fd = socket(to.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) return;
        const socklen_t len = to.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
        if (connect(fd, reinterpret_cast<sockaddr *>(&to), len) != 0 && errno == EINPROGRESS) {
            pollfd p{fd, POLLOUT, 0};
            poll(&p, 1, 1000);
        }
        close(fd);
    }

    void run() {
        std::unique_lock<std::mutex> l(mu_);
        while (true) {
            cv_.wait(l, [&] { return held_.load(); });
            // one line per episode, at most one episode in 10 s told (a sustained flood would flood the log)
            const auto now = std::chrono::steady_clock::now();
            const bool tell = now - told_ >= std::chrono::seconds(10);
            if (tell) {
                told_ = now;
                std::fprintf(stderr, "dgr-worker: descriptors nearly exhausted (%d of the open-files limit %d taken): new "
                                     "connections wait until some close (%llu connections shed so far)\n",
                             limit_ - margin_, limit_, static_cast<unsigned long long>(shed_.load()));
            }
            // back once the descriptors in use are below the limit by twice the margin
            while (true) {
                cv_.wait_for(l, std::chrono::milliseconds(100));
                const int n = open_descriptors();
                if (n >= 0 && n < limit_ - 2 * margin_) break;
            }
            for (auto & x : listeners_) {
                if (is_decoy(x.fd)) dup2(x.real, x.fd);  // (not when gRPC closed its descriptor: the server stopped)
            }
            held_ = false;
            l.unlock();
            for (auto & x : listeners_) poke(x.addr);
            if (tell) std::fprintf(stderr, "dgr-worker: descriptors free again: accepting connections\n");
            l.lock();
        }
    }

    grpc_socket_mutator base_;                       // first: gRPC's pointer is this object's
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<int> candidates_;
    std::vector<Listener> listeners_;                // fixed once armed
    int decoy_ = -1;
    std::pair<dev_t, ino_t> decoy_id_{0, 0};
    int limit_ = 0, margin_ = 8;
    std::atomic<bool> armed_{false}, held_{false};
    std::atomic<uint64_t> shed_{0};
    std::chrono::steady_clock::time_point told_{};
};

class GuardOption : public grpc::ServerBuilderOption {
public:
    void UpdateArguments(grpc::ChannelArguments * args) override { args->SetSocketMutator(ListenGuard::get().mutator()); }
    void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>> *) override {}
};

}  // namespace

int guard_margin_for(int64_t limit) { return ListenGuard::margin_for(limit); }
void guard_set_limit(int64_t limit) { ListenGuard::get().set_limit(limit); }
std::unique_ptr<grpc::ServerBuilderOption> guard_option() { return std::make_unique<GuardOption>(); }
void guard_arm(int port) { ListenGuard::get().arm(port); }

}  // namespace dgr::serve
