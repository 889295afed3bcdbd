// The engine thread's work (engine_run.h): the part made over what it is handed, a batch guarded, and the tests'
// faults at an exact step. A batch itself is run_batch.cpp, the last stage's answer last_stage.cpp.
#include <grpcpp/grpcpp.h>

#include <csignal>
#include <cstdio>

#include <unistd.h>

#include "data_path.h"
#include "engine_run/engine_run.h"

namespace dgr {

namespace pb = dgr::v1;

EngineRun::EngineRun(EngineRunPort & port, StageEngine & engine, SessionTable<Session> & sessions,
                     StepScheduler<SessionKey, Work> & sched, RingOut & ring_out, Relay & relay, Metrics & metrics,
                     const SessionNames & names, EngineRunSettings settings)
    : port_(port), engine_(engine), sessions_(sessions), sched_(sched), ring_out_(ring_out), relay_(relay),
      metrics_(metrics), names_(names), set_(std::move(settings)) {}

void EngineRun::run(std::vector<Work> & batch) {
    if (batch.empty()) return;
    try {
        run_batch(batch);
    } catch (const std::exception & e) {
        fprintf(stderr, "dgr-worker: engine batch failed: %s\n", e.what());
        for (auto & w : batch) reply_error(w.reply, w.frame, err(pb::INTERNAL, "the worker failed on this step; see its log"));
    }
}

// The tests' hooks (--test-die-at SESSION:...) name a session as its client did (SessionNames::client_name)
bool EngineRun::hook_at(const StepHooks & at, const std::string & key, uint64_t epoch, int64_t p) const {
    return !at.empty() && at.count({names_.client_name(key), epoch, p}) > 0;
}

// --test-die-at (tests: a kill -9 at an exact step): about to run a step
// that holds a listed (session, epoch, position), the worker SIGKILLs itself, nothing flushed or closed.
// --test-stop-at: the same, SIGSTOP (a hung worker; it runs the step when it gets SIGCONT).
void EngineRun::die_if_asked(size_t n, const std::function<const pb::Frame &(size_t)> & frame) {
    for (size_t k = 0; k < n; ++k) {
        const pb::Frame & f = frame(k);
        for (int64_t p : f.step().positions()) {
            if (hook_at(set_.die_at, f.session_id(), f.epoch(), p)) {
                fprintf(stderr, "dgr-worker: --test-die-at %s:%llu:%lld reached: SIGKILL\n", f.session_id().c_str(),
                        (unsigned long long)f.epoch(), (long long)p);
                fflush(stderr);
                kill(getpid(), SIGKILL);
            }
            if (hook_at(set_.stop_at, f.session_id(), f.epoch(), p)) {
                fprintf(stderr, "dgr-worker: --test-stop-at %s:%llu:%lld reached: SIGSTOP\n", f.session_id().c_str(),
                        (unsigned long long)f.epoch(), (long long)p);
                fflush(stderr);
                kill(getpid(), SIGSTOP);
            }
        }
    }
}

// --test-evict-at, --test-break-origin-link-at (tests: a fault at an exact step, which no timing can move)
void EngineRun::test_faults(StageEngine::Guard & eg, const pb::Frame & f, const SessionPtr & sess) {
    const std::string & sid = f.session_id();
    for (int64_t p : f.step().positions()) {
        if (hook_at(set_.evict_at, sid, f.epoch(), p)) {
            // the session's cache is lost (as under memory pressure): the session stays, its cache is empty
            fprintf(stderr, "dgr-worker: --test-evict-at %s:%llu:%lld reached: cache dropped\n", sid.c_str(),
                    (unsigned long long)f.epoch(), (long long)p);
            eg.session_close(sid.c_str(), int64_t(f.epoch()));
            int32_t st = eg.session_open(sid.c_str(), int64_t(f.epoch()));
            if (st != DGR_OK) fprintf(stderr, "dgr-worker: --test-evict-at: reopen failed: %s\n", engine_.lib().error(st).c_str());
        }
        if (hook_at(set_.break_origin_link_at, sid, f.epoch(), p) && !set_.is_first) {
            std::shared_ptr<Link> l = relay_.find(sess->route[0].address());
            fprintf(stderr, "dgr-worker: --test-break-origin-link-at %s:%llu:%lld reached: %s\n", sid.c_str(),
                    (unsigned long long)f.epoch(), (long long)p, l ? "link failed" : "no link to fail");
            if (l) l->fail("--test-break-origin-link-at");
        }
    }
}

}  // namespace dgr
