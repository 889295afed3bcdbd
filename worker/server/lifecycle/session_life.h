// A session's life on this stage: OpenSession (the route's hop checked, the session opened in the engine, from the
// prefix cache where it can, then chained to the next hop), CloseSession (here and along the route, once however
// many callers; what the prefix cache keeps of it), idle sessions past --session-ttl, the outgoing channels no
// open session uses any more, and SIGTERM's refusal of new ones.
//
// A part that owns the sessions being closed along the route, whether the stage still opens sessions, the count
// of sessions opened and the grammar conversions' turns, under its own lock (`SessionLife::mu_`), and answers the
// Stage service's OpenSession and CloseSession (stage_calls.h: SessionCalls). The open sessions are the session
// table's (sessions/session_table.h: its own lock), shared with the data path, which finds sessions there; a
// session's changing fields have their own owners (sessions/session.h). It asks its owner (`SessionLifePort`: the
// worker) for this stage's description and its typed errors; the engine, the relay, the step queue, the origin,
// the prefix cache and the counters it is handed. It links gRPC (chained calls), so the process tests test it
// (tests/worker/test_worker_cpp.py, the prefix cache's and the trust tests); its rules are the parts' it asks,
// each with a plain test.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cache/prefix_cache.h"
#include "dgr/v1/stage.grpc.pb.h"
#include "engine_loop/scheduler.h"
#include "engine_loop/stage_engine.h"
#include "metrics/metrics.h"
#include "origin/origin.h"
#include "relay/relay.h"
#include "sessions/names.h"
#include "sessions/session.h"
#include "sessions/session_table.h"
#include "stage_calls.h"
#include "step_work.h"
#include "tls.h"
#include "trust/net_policy.h"
#include "trust/turns.h"

namespace dgr {

// What a session's life asks of its owner.
class SessionLifePort {
  public:
    // this stage's description now (what OpenSession answers with and checks the previous hop against)
    virtual void describe(dgr::v1::StageDescription * me) = 0;
    // a typed error from this stage (counted, named after it; retry_after_ms: when to try again)
    virtual dgr::v1::WireError error(dgr::v1::ErrorCode code, const std::string & message, uint32_t retry_after_ms) = 0;
    virtual void count_error(dgr::v1::ErrorCode code) = 0;
    virtual std::string hop() const = 0;             // this stage's name in messages

  protected:
    ~SessionLifePort() = default;
};

// What it bounds and waits for (the worker's flags) and what the stage is (the engine's stage info).
struct SessionLifeSettings {
    bool is_first = false, is_last = false;
    int64_t n_ctx = 0, n_vocab = 0, max_sessions = 0;
    uint32_t stage_count = 0;                        // the bundle's stages (a close chain's longest wait)
    uint64_t max_message_bytes = 0;
    int64_t max_sessions_per_member = 0;             // --max-sessions-per-member (0: none)
    double session_ttl_s = 0, rpc_timeout_s = 0;     // --session-ttl, --rpc-timeout
    bool prefix_cache_shared = false;                // --prefix-cache-shared
    int64_t max_grammar_bytes = 0, max_grammar_depth = 0;   // --max-grammar-bytes, --max-grammar-depth
};

class SessionLife final : public SessionCalls {
  public:
    using Key = SessionKey;
    using Scheduler = StepScheduler<SessionKey, Work>;
    // `trust`, `names` and `net` are the worker's, fixed before serving; `prefix` is null where the cache is off
    SessionLife(SessionLifePort & port, SessionTable<Session> & sessions, StageEngine & engine, Relay & relay,
                Scheduler & sched, Origin & origin, Metrics & metrics, PrefixCache * prefix, const Trust & trust,
                const SessionNames & names, const NetPolicy & net, SessionLifeSettings settings);
    SessionLife(const SessionLife &) = delete;
    SessionLife & operator=(const SessionLife &) = delete;

    // SessionCalls: the Stage service's OpenSession and CloseSession (on a unary call's thread)
    grpc::Status open_session_rpc(const grpc::ServerContextBase * ctx, const dgr::v1::OpenSessionRequest * req,
                                  dgr::v1::OpenSessionReply * reply) override;
    grpc::Status close_session_rpc(const grpc::ServerContextBase * ctx, const dgr::v1::CloseSessionRequest * req,
                                   dgr::v1::CloseSessionReply * reply) override;

    // Closes the session here: its table entry, its queued steps, the links' note of it, its engine cache.
    void close_local(const std::string & sid, uint64_t epoch);
    // ... and along the route after it (once, however many callers). `ctx`: the caller's, for its deadline;
    // `reply`: where a hop's failure is told; `keep`: the prefix blocks (and their size) the next hops keep the
    // session's state under (keep_prefix's).
    void close_chained(const std::string & sid, uint64_t epoch, const grpc::ServerContextBase * ctx,
                       dgr::v1::CloseSessionReply * reply,
                       const std::pair<std::vector<std::string>, uint32_t> * keep = nullptr);
    // Idle sessions past --session-ttl are closed (their clients told); returns how many. Runs prune_links first.
    int reap();
    // Outgoing links and channels no open session uses any more are closed and forgotten (every 2 s at most).
    void prune_links();
    // SIGTERM: no session opens from now on; the sessions open now.
    std::vector<std::pair<Key, SessionPtr>> stop();
    bool serving() const;
    uint64_t opened_total() const { return opened_total_.load(); }
    // stage 0: this worker's key of a session that the route's hops name by its wire_down id ("" if none)
    std::string origin_key(const std::string & wire) const;

  private:
    std::vector<std::string> keep_prefix(const std::string & sid, uint64_t epoch, const dgr::v1::CloseSessionRequest & req);
    std::string prefix_seed(const dgr::v1::StageDescription & upstream) const;
    std::vector<std::string> prefix_blocks(const google::protobuf::RepeatedPtrField<std::string> & b) const;
    // Sampling.grammar / json_schema within --max-grammar-bytes and --max-grammar-depth: "" or why not
    std::string refuse_grammar(const dgr::v1::Sampling & sp) const;
    uint32_t session_retry_ms();                     // mu_ held
    std::chrono::system_clock::time_point chain_deadline(size_t hops_after, const grpc::ServerContextBase * ctx) const;
    dgr::v1::WireError err(dgr::v1::ErrorCode code, const std::string & message, uint32_t retry_after_ms = 0) {
        return port_.error(code, message, retry_after_ms);
    }

    SessionLifePort & port_;
    SessionTable<Session> & sessions_;
    StageEngine & engine_;
    Relay & relay_;
    Scheduler & sched_;
    Origin & origin_;
    Metrics & metrics_;
    PrefixCache * prefix_;
    const Trust & trust_;
    const SessionNames & names_;
    const NetPolicy & net_;
    const SessionLifeSettings set_;

    // grammar opens running at once (open.cpp): within DGR_GRAMMAR_MAX_EXPANSION a conversion takes up to ~0.3 s
    // and ~100 MiB, so at most GRAMMARS_AT_ONCE run and the rest wait, members taking turns (trust/turns.h; its
    // own leaf lock)
    static constexpr int GRAMMARS_AT_ONCE = 2;
    FairTurns grammar_turns_{GRAMMARS_AT_ONCE};
    std::atomic<uint64_t> opened_total_{0};          // (read by the scheduler under its lock: --hold-batch)

    // held around the session table's answer where it and this part's state go together (opening: the bounds
    // and the stop; closing: the step queue; reaping: the step queue; pruning: the links)
    mutable std::mutex mu_;
    std::map<Key, std::shared_future<void>> closing_;   // sessions being closed along the route now
    bool stopping_ = false;
    std::chrono::steady_clock::time_point pruned_;   // prune_links' last run
};

}  // namespace dgr
