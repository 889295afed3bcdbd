// OpenSession (session_life.h): the route's hop checked against this stage, the session opened in the engine (from
// the prefix cache where it can), then chained to the next hop; what the route can do (roll back, frame sizes)
// noted.
#include "description/stage_description.h"
#include "grpc_status.h"
#include "rpc/guarded.h"
#include "wire/wire_common.h"
#include "lifecycle/session_life.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

static const char * py_bool(bool b) { return b ? "True" : "False"; }

uint32_t SessionLife::session_retry_ms() {
    // when a slot may free up: the next idle session's reaping, else a second (mu_ held)
    double ttl = set_.session_ttl_s;
    if (ttl <= 0 || sessions_.size() == 0) return 1000;
    const double idle = sessions_.longest_idle_s(Clock::now());
    return uint32_t(std::min(ttl, std::max(0.1, ttl - idle)) * 1000);
}

grpc::Status SessionLife::open_session_rpc(const grpc::ServerContextBase * ctx, const pb::OpenSessionRequest * req,
                                           pb::OpenSessionReply * reply) {
    const EngineLib & lib = engine_.lib();
    return guarded("OpenSession", [&] {
        auto fail = [&](pb::ErrorCode code, const std::string & msg, uint32_t retry = 0) {
            *reply->mutable_error() = err(code, msg, retry);
            return grpc::Status::OK;
        };
        bool stopping;
        { std::lock_guard<std::mutex> g(mu_); stopping = stopping_; }
        if (stopping) return fail(pb::HOP_UNREACHABLE, "this worker is shutting down: open the session on another replica");
        pb::StageDescription me;
        port_.describe(&me);
        const auto & ident = me.identity();
        if (req->hop_index() >= uint32_t(req->route_size())) return fail(pb::BAD_FRAME, "hop_index is outside the route");
        const pb::Hop & at = req->route(int(req->hop_index()));
        auto range = [](uint32_t s, uint32_t b, uint32_t e, const std::string & bundle) {
            return "stage " + std::to_string(s) + " [" + std::to_string(b) + ", " + std::to_string(e) + ") of bundle " + bundle;
        };
        std::string mine = range(ident.stage_index(), ident.layer_begin(), ident.layer_end(), ident.bundle_id());
        std::string want = range(at.stage_index(), at.layer_begin(), at.layer_end(), at.bundle_id());
        if (at.bundle_id() != ident.bundle_id() || at.stage_index() != ident.stage_index()) {
            return fail(pb::WRONG_STAGE, "the route expects " + want + " at " + at.address() + " but this worker serves " +
                                             mine + ": fix the route or start the right worker");
        }
        if (at.layer_begin() != ident.layer_begin() || at.layer_end() != ident.layer_end()) {
            return fail(pb::WRONG_RANGE, "the route expects " + want + " but this worker serves " + mine);
        }
        // where this worker will connect for the session: the next hop, and the origin from a later stage
        for (int i : {int(req->hop_index()) + 1, req->hop_index() > 0 ? 0 : -1}) {
            if (i < 0 || i >= req->route_size()) continue;
            if (std::string why = refuse_peer_address(req->route(i).address(), net_); !why.empty()) {
                return fail(pb::BAD_FRAME, "route[" + std::to_string(i) + "]: " + why);
            }
        }
        const bool last_hop = req->hop_index() == uint32_t(req->route_size() - 1);
        if ((req->hop_index() == 0) != bool(set_.is_first) || last_hop != bool(set_.is_last)) {
            return fail(pb::WRONG_STAGE, "this worker serves " + mine + " (first=" + py_bool(set_.is_first) + ", last=" +
                                             py_bool(set_.is_last) + ") but is hop " + std::to_string(req->hop_index()) +
                                             " of a " + std::to_string(req->route_size()) +
                                             "-hop route: the route must cover every layer in order");
        }
        if (req->hop_index() > 0) {
            const auto & up = req->upstream();
            if (!up.has_schema_out()) return fail(pb::WRONG_STAGE, "the previous hop did not say what it sends (no schema_out)");
            std::string theirs = hop_name(up.identity().stage_index(), req->route(int(req->hop_index()) - 1).address());
            const auto & so = up.schema_out();
            const auto & si = me.schema_in();
            std::vector<std::string> diff;
            if (so.n_streams() != si.n_streams()) diff.push_back("n_streams");
            if (so.n_embd() != si.n_embd()) diff.push_back("n_embd");
            if (so.dtype() != si.dtype()) diff.push_back("dtype");
            if (so.bundle_id() != si.bundle_id()) diff.push_back("bundle_id");
            if (si.token_ids() && !so.token_ids()) diff.push_back("token_ids");
            if (!diff.empty()) {
                std::string d;
                for (auto & f : diff) d += (d.empty() ? "" : ", ") + f;
                return fail(pb::SCHEMA_MISMATCH, theirs + " sends " + schema_str(so) + " but this stage takes " + schema_str(si) +
                                                     " (differs in " + d + "): both hops must serve stages of the same bundle");
            }
            if (so.layer() != si.layer()) {
                return fail(pb::WRONG_RANGE, theirs + " hands over at layer " + std::to_string(so.layer()) +
                                                 " but this stage begins at layer " + std::to_string(si.layer()));
            }
        }
        if (set_.is_last) {
            uint64_t vocab_bytes = uint64_t(set_.n_vocab) * 4 + FRAME_OVERHEAD;
            if (req->logits() != pb::LOGITS_NONE && vocab_bytes > set_.max_message_bytes) {
                return fail(pb::MESSAGE_TOO_LARGE, "one logits row needs " + std::to_string(vocab_bytes) + " bytes, over the " +
                                                       std::to_string(set_.max_message_bytes) + "-byte message limit");
            }
        }
        // what the last stage does with each draw: log-probabilities, a grammar
        const pb::Sampling & sp = req->sampling();
        if (sp.top_logprobs() > MAX_TOP_LOGPROBS) {
            return fail(pb::ENGINE, "sampling.top_logprobs is " + std::to_string(sp.top_logprobs()) + ", at most " +
                                        std::to_string(MAX_TOP_LOGPROBS));
        }
        if (!sp.grammar().empty() && !sp.json_schema().empty()) {
            return fail(pb::ENGINE, "sampling.grammar and sampling.json_schema are both set: give one of them");
        }
        // A grammar's open takes a turn (trust/turns.h): at the last stage for its conversion (at most
        // GRAMMARS_AT_ONCE at once: memory), at an earlier stage for its chain to the last. Members take
        // turns, so one member's many grammars queue behind each other, not in front of another member's (at a
        // later stage the member is the previous hop, carrying every client's: stage 0's turns keep those fair)
        const bool has_grammar = !sp.grammar().empty() || !sp.json_schema().empty();
        std::optional<FairTurns::Turn> turn;
        auto take_turn = [&] {
            if (!turn) turn.emplace(grammar_turns_.take(trust_.mutual ? peer_identity(ctx).value_or("") : std::string()));
        };
        std::shared_ptr<dgr_grammar> grammar;
        if (set_.is_last) {
            if ((sp.logprobs() || sp.top_logprobs()) && !lib.logprobs) {
                return fail(pb::ENGINE, "sampling.logprobs: " + lib.path + " reports no log-probabilities (built before "
                                        "them): rebuild it (`dgr build-engine`)");
            }
            if (has_grammar) {
                const char * field = sp.grammar().empty() ? "sampling.json_schema" : "sampling.grammar";
                if (!lib.grammar_open) {
                    return fail(pb::ENGINE, std::string(field) + ": " + lib.path + " has no grammar sampler (the fake "
                                            "engine has no vocabulary; an engine built before grammars): serve a real "
                                            "model, or rebuild the engine (`dgr build-engine`)");
                }
                if (std::string why = refuse_grammar(sp); !why.empty()) return fail(pb::ENGINE, why);
                dgr_grammar * g = nullptr;
                std::string refused;
                take_turn();
                {
                    // outside the engine lock, in this call's turn: a grammar reads only the vocabulary, which no
                    // step changes, so a slow conversion holds up this request alone
                    int32_t st = engine_.grammar_open(sp.grammar().empty() ? nullptr : sp.grammar().c_str(),
                                                      sp.json_schema().empty() ? nullptr : sp.json_schema().c_str(), &g);
                    if (st != DGR_OK) refused = lib.error(st);
                    if (g) grammar.reset(g, lib.grammar_close);
                    for (int i = 0; refused.empty() && i < sp.grammar_accepted_size(); ++i) {
                        st = lib.grammar_accept(g, sp.grammar_accepted(i));
                        if (st != DGR_OK) refused = "sampling.grammar_accepted[" + std::to_string(i) + "]: " + lib.error(st);
                    }
                }
                if (!refused.empty()) return fail(pb::ENGINE, refused);
                turn.reset();                        // converted: the next member's turn
            }
        }
        if (has_grammar && !set_.is_last) take_turn();   // an earlier stage: for its chain to the last
        // the session in the caller's own namespace (sessions/names.h): no other member's id can be named here
        const std::string sid = names_.key(trust_.mutual ? peer_identity(ctx) : std::nullopt, req->session_id());
        const Key key{sid, req->epoch()};
        // the id the route's later hops know it by: stage 0 adds 128 random bits under mutual TLS
        const std::string wire_down = trust_.mutual && set_.is_first ? SessionNames::wire_down(req->session_id()) : names_.wire_of(sid);
        // its owner: whose count it is in (--max-sessions-per-member)
        const std::string owner = names_.owner_of(sid);
        std::vector<Key> old;
        {
            // the table's answer and the overload counter (and the retry hint) go together: mu_ held around it
            std::unique_lock<std::mutex> g(mu_);
            using Refused = SessionTable<Session>::Refused;
            auto a = sessions_.admit(key, owner, set_.max_sessions_per_member, set_.max_sessions);
            switch (a.refused) {
                case Refused::none:
                    break;
                case Refused::stale_epoch:
                    g.unlock();
                    return fail(pb::STALE_EPOCH, "session " + req->session_id() + " is already at epoch " +
                                                     std::to_string(a.at) + "; open a newer epoch");
                case Refused::member_full:
                    g.unlock();
                    metrics_.count_overloaded();
                    return fail(pb::OVERLOADED, "this member holds " + std::to_string(a.member_held) + " sessions here (--max-sessions-per-member " +
                                                    std::to_string(set_.max_sessions_per_member) + "): close one, or retry later", 1000);
                case Refused::worker_full: {
                    uint32_t retry = session_retry_ms();
                    g.unlock();
                    metrics_.count_overloaded();
                    return fail(pb::OVERLOADED, "all " + std::to_string(set_.max_sessions) +
                                                    " sessions are in use: retry later or use another route", retry);
                }
            }
            old = std::move(a.older);
        }
        for (auto & k : old) close_local(k.first, k.second);
        {
            auto eg = engine_.lock();
            int32_t st = eg.session_open(sid.c_str(), int64_t(req->epoch()));
            if (st != DGR_OK) {
                std::string msg = lib.error(st);
                return fail(pb::ENGINE, msg);
            }
        }
        // the prefix cache: the longest kept prefix of the blocks the previous hop matched, among the entries
        // this session may use: its member's own at stage 0 (any member's with --prefix-cache-shared), its
        // opener's at a later stage (docs/security.md)
        int32_t restored = 0;
        size_t matched = 0;
        std::vector<int32_t> ran;
        const std::string prefix_owner = set_.is_first && set_.prefix_cache_shared ? std::string("*") : names_.owner_of(sid);
        const std::string seed = prefix_owner + "|" + prefix_seed(req->upstream());
        if (prefix_ && req->prefix_blocks_size() > 0 && req->prefix_block_tokens() > 0) {
            PrefixCache::Hit hit = prefix_->find(seed, prefix_blocks(req->prefix_blocks()), req->prefix_block_tokens());
            if (hit.n_keep > 0 && set_.is_first && (!hit.tokens || hit.tokens->size() < size_t(hit.n_keep))) hit = {};
            if (hit.n_keep > 0) {
                auto eg = engine_.lock();
                int32_t st = eg.state_set(sid.c_str(), int64_t(req->epoch()), hit.state->data(),
                                          hit.state->size(), hit.n_positions, hit.n_keep);
                if (st == DGR_OK) {
                    restored = hit.n_keep;
                    matched = hit.blocks;
                    if (set_.is_first) ran.assign(hit.tokens->begin(), hit.tokens->begin() + hit.n_keep);
                } else {                             // an ordinary miss: prefill it all
                    fprintf(stderr, "dgr-worker: the prefix cache's state did not load: %s\n", lib.error(st).c_str());
                }
            }
        }
        {
            std::lock_guard<std::mutex> g(mu_);
            auto s = std::make_shared<Session>();
            s->sid = sid;
            s->wire_down = wire_down;
            s->prefix_owner = prefix_owner;
            s->route.assign(req->route().begin(), req->route().end());
            s->hop_index = req->hop_index();
            s->sampling = req->sampling();
            s->sampling.clear_grammar_accepted();    // used above; not kept
            s->last.grammar = std::move(grammar);
            s->logits = int(req->logits());
            s->steps.restore(uint64_t(restored), std::move(ran));
            s->prefix_seed = prefix_seed(req->upstream());
            if (trust_.mutual) s->senders.set_opener(peer_identity(ctx));
            // its id is at this epoch from now on; stage 0 under mTLS: the route's hops name it by wire_down
            sessions_.insert(key, std::move(s), owner, trust_.mutual && set_.is_first ? wire_down : std::string(), Clock::now());
            ++opened_total_;
        }
        *reply->add_hops() = me;
        if (!set_.is_last) {
            const pb::Hop & nxt = req->route(int(req->hop_index()) + 1);
            pb::OpenSessionRequest fwd = *req;
            fwd.set_session_id(wire_down);
            fwd.set_hop_index(req->hop_index() + 1);
            *fwd.mutable_upstream() = me;
            while (size_t(fwd.prefix_blocks_size()) > matched) fwd.mutable_prefix_blocks()->RemoveLast();
            pb::OpenSessionReply theirs;
            grpc::ClientContext cc;
            cc.set_deadline(chain_deadline(size_t(req->route_size()) - 1 - req->hop_index(), ctx));
            grpc::Status st = relay_.channel(nxt.address())->OpenSession(&cc, fwd, &theirs);
            if (!st.ok()) {
                std::string name = hop_name(req->hop_index() + 1, nxt.address());
                port_.count_error(pb::HOP_UNREACHABLE);
                theirs.Clear();
                auto * e = theirs.mutable_error();
                e->set_code(pb::HOP_UNREACHABLE);
                e->set_hop(name);
                // the caller hears no more than that: whether a port was open is not its business (its detail is
                // in this worker's log, for its operator)
                fprintf(stderr, "dgr-worker: opening a session on %s: %s: %s\n", name.c_str(), status_name(st.error_code()).c_str(),
                        st.error_message().c_str());
                e->set_message(name + " is unreachable: " + port_.hop() + " could not open the session there (no dgr "
                               "worker answered at that address): is that worker running, and is its address in "
                               "the route right? (this worker's log says why)");
            }
            if (theirs.has_error()) {
                close_local(key.first, key.second);
                reply->Clear();
                *reply->mutable_error() = theirs.error();
                return grpc::Status::OK;
            }
            for (auto & h : theirs.hops()) *reply->add_hops() = h;
            if (int32_t(theirs.cached_tokens()) < restored) {   // a later hop kept less: hold what every hop holds
                auto eg = engine_.lock();
                int32_t st = eg.truncate(sid.c_str(), int64_t(req->epoch()), int32_t(theirs.cached_tokens()));
                if (st != DGR_OK) return fail(pb::ENGINE, lib.error(st));
                restored = int32_t(theirs.cached_tokens());
                if (SessionPtr s = sessions_.find(key)) s->steps.hold(uint64_t(restored));
            }
        }
        reply->set_cached_tokens(uint32_t(restored));
        if (prefix_ && restored > 0) prefix_->note_hit(restored);
        {
            // the origin takes tokens back only from the last hop, errors from any hop of the route (mTLS)
            SessionPtr s = sessions_.find(key);
            if (s && reply->hops_size() > 0) {
                origin_.note_route(*s, reply->hops());
                std::set<std::string> members;
                for (auto & h : reply->hops()) {
                    if (!h.member().empty()) members.insert(h.member());
                }
                s->senders.set_route(reply->hops(reply->hops_size() - 1).member(), std::move(members));
            }
        }
        return grpc::Status::OK;
    });
}

}  // namespace dgr
