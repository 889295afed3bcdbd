// Serving until SIGTERM (the reaper: idle sessions, send deadlines), then the drain within --drain-timeout:
// the clients told, the server shut down, the engine closed, the process left.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <thread>

#include "serve.h"

namespace dgr::serve {

void serve_until_signal(const Options & o, Stage & s, Serving & sv) {
    auto & worker = sv.worker;
    auto & server = sv.server;
    const std::string & address = sv.address;
    auto * health = server->GetHealthCheckService();
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

}  // namespace dgr::serve
