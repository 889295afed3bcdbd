// Closing sessions (session_life.h): CloseSession, here and along the route (once, however many callers), idle
// ones past --session-ttl (reap), and the links and channels no open session uses any more (prune_links).
#include "grpc_status.h"
#include "rpc/guarded.h"
#include "wire/wire_common.h"
#include "lifecycle/session_life.h"

#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <future>
#include <set>
#include <string>
#include <vector>

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

void SessionLife::close_local(const std::string & sid, uint64_t epoch) {
    SessionPtr s;                                    // dropped after the lock: its grammar is freed outside it
    {
        // the table and the step queue together (mu_ held): nothing of a session outlives it (the table drops
        // its wire_down id, its owner's count and, once no epoch is open, its latest epoch)
        std::lock_guard<std::mutex> g(mu_);
        s = sessions_.erase(Key{sid, epoch});
        sched_.drop(Key{sid, epoch});               // its queued steps are forgotten
    }
    const bool held = s != nullptr;
    const std::string wire = held ? s->wire_down : std::string();
    if (held) relay_.forget(Key{wire, epoch});       // the links' note of it
    if (held) {
        auto eg = engine_.lock();
        int32_t st = eg.session_close(sid.c_str(), int64_t(epoch));
        if (st != DGR_OK) fprintf(stderr, "dgr-worker: closing session %s epoch %llu: %s\n", sid.c_str(),
                                  (unsigned long long) epoch, engine_.lib().error(st).c_str());
    }
}

void SessionLife::close_chained(const std::string & sid, uint64_t epoch, const grpc::ServerContextBase * ctx,
                                pb::CloseSessionReply * reply, const std::pair<std::vector<std::string>, uint32_t> * keep) {
    std::vector<pb::Hop> route;
    uint32_t hop_index = 0;
    std::string wire;
    bool had;
    const Key key{sid, epoch};
    std::shared_ptr<std::promise<void>> mine;        // this call closes it along the route
    std::shared_future<void> theirs;                 // another call is closing it along the route now
    {
        std::lock_guard<std::mutex> g(mu_);
        SessionPtr s = sessions_.find(key);
        had = s != nullptr;
        if (had) {
            route = s->route;
            hop_index = s->hop_index;
            wire = s->wire_down;
            mine = std::make_shared<std::promise<void>>();
            closing_[key] = mine->get_future().share();
        } else if (auto c = closing_.find(key); c != closing_.end()) {
            theirs = c->second;
        }
    }
    if (!had) {
        // e.g. the client's stream ended (client_gone) just before its CloseSession came: answer once that
        // close has gone along the route, never while later hops still hold the session
        if (theirs.valid()) theirs.wait_for(std::chrono::duration<double>(set_.rpc_timeout_s * double(set_.stage_count + 1)));
        return;
    }
    struct Done {                                    // however this returns: waiters go on, the entry goes
        SessionLife * w;
        Key key;
        std::shared_ptr<std::promise<void>> p;
        ~Done() {
            {
                std::lock_guard<std::mutex> g(w->mu_);
                w->closing_.erase(key);
            }
            p->set_value();
        }
    } done{this, key, mine};
    close_local(sid, epoch);
    if (!set_.is_last && hop_index + 1 < route.size()) {
        const pb::Hop & nxt = route[hop_index + 1];
        pb::CloseSessionRequest req;
        req.set_session_id(wire);                    // as the next hop knows it
        req.set_epoch(epoch);
        req.set_chain(true);
        if (keep && !keep->first.empty()) {
            for (auto & b : keep->first) req.add_prefix_blocks(b);
            req.set_prefix_block_tokens(keep->second);
        }
        pb::CloseSessionReply theirs;
        grpc::ClientContext cc;
        cc.set_deadline(chain_deadline(route.size() - 1 - hop_index, ctx));
        grpc::Status st = relay_.channel(nxt.address())->CloseSession(&cc, req, &theirs);
        if (!st.ok() && reply) {
            *reply->mutable_error() = err(pb::HOP_UNREACHABLE, "could not close on " + hop_name(hop_index + 1, nxt.address()) +
                                                                   ": " + status_name(st.error_code()));
        }
    }
}

grpc::Status SessionLife::close_session_rpc(const grpc::ServerContextBase * ctx, const pb::CloseSessionRequest * req,
                                            pb::CloseSessionReply * reply) {
    return guarded("CloseSession", [&] {
        // the caller's own session: its namespace (sessions/names.h); another member's id names nothing here, so
        // no member can close another's
        const std::string sid = names_.key(trust_.mutual ? peer_identity(ctx) : std::nullopt, req->session_id());
        std::pair<std::vector<std::string>, uint32_t> keep{{}, req->prefix_block_tokens()};
        if (req->prefix_blocks_size() > 0) keep.first = keep_prefix(sid, req->epoch(), *req);
        if (req->chain()) close_chained(sid, req->epoch(), ctx, reply, &keep);
        else close_local(sid, req->epoch());
        return grpc::Status::OK;
    });
}

int SessionLife::reap() {
    prune_links();
    double ttl = set_.session_ttl_s;
    if (ttl <= 0) return 0;
    std::vector<Key> idle;
    std::vector<SessionPtr> told;
    {
        // the table and the step queue at one time (mu_ held): a session with steps queued is not idle
        std::lock_guard<std::mutex> g(mu_);
        for (auto & [k, s] : sessions_.expired(Clock::now(), ttl)) {
            if (sched_.has(k)) continue;
            idle.push_back(k);
            told.push_back(s);
        }
    }
    for (size_t n = 0; n < idle.size(); ++n) {
        const Key & k = idle[n];
        SessionPtr sess = told[n];
        if (ReplyPtr client = origin_.fail(sess)) {
            char ttl_s[32];
            snprintf(ttl_s, sizeof ttl_s, "%g", ttl);
            pb::Frame f;
            f.set_session_id(names_.wire_of(k.first));
            f.set_epoch(k.second);
            *f.mutable_error() = err(pb::UNKNOWN_SESSION, "session " + names_.wire_of(k.first) + " epoch " + std::to_string(k.second) +
                                                              " was closed after " + ttl_s + " s idle (--session-ttl): open it again");
            client->put(std::move(f));
        }
        close_local(k.first, k.second);
        metrics_.count_reaped();
    }
    return int(idle.size());
}

std::chrono::system_clock::time_point SessionLife::chain_deadline(size_t hops_after, const grpc::ServerContextBase * ctx) const {
    // one rpc_timeout per hop still to go (the hop nearest a fault times out first), never past the
    // caller's own deadline (less 0.2 s to answer), at least 0.1 s
    double t = set_.rpc_timeout_s * double(std::max<size_t>(1, hops_after));
    auto now = std::chrono::system_clock::now();
    auto theirs = ctx ? ctx->deadline() : std::chrono::system_clock::time_point::max();
    if (theirs != std::chrono::system_clock::time_point::max()) {
        double left = std::chrono::duration<double>(theirs - now).count();
        t = std::max(0.1, std::min(t, left - 0.2));
    }
    return now + std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::duration<double>(t));
}

// What a member's routes made this worker open outlives nothing: every few seconds the channels and links to
// addresses no open session goes to are dropped, and broken links gRPC is done with are destroyed, so a member
// naming ever new addresses cannot grow the worker (docs/security.md)
void SessionLife::prune_links() {
    Relay::Dropped drop;
    {
        std::lock_guard<std::mutex> g(mu_);
        const auto now = Clock::now();
        if (now - pruned_ < std::chrono::seconds(2) || sched_.stopped()) return;
        pruned_ = now;
        std::set<std::string> used;                  // where open sessions (and sessions being closed) still go
        sessions_.for_each([&](const Key &, const SessionPtr & p) {
            const Session & s = *p;
            if (s.hop_index + 1 < s.route.size()) used.insert(s.route[s.hop_index + 1].address());
            if (!s.route.empty()) used.insert(s.route[0].address());
        });
        if (!closing_.empty()) return;               // a close chain may be using a channel right now
        drop = relay_.prune(used);                   // the link table's lock, under mu_: no session opens meanwhile
    }
    Relay::close(drop);                              // outside every lock: gRPC's callbacks take them
}

}  // namespace dgr
