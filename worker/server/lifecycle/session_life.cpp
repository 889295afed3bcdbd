// The session's life on this stage (session_life.h): the part made over what it is handed, SIGTERM's stop, and
// the names and bounds a request is checked against before anything opens. OpenSession is open.cpp, the closes
// close.cpp, what the prefix cache keeps keep_prefix.cpp.
#include "lifecycle/session_life.h"

#include "trust/grammar_bounds.h"

namespace dgr {

namespace pb = dgr::v1;

SessionLife::SessionLife(SessionLifePort & port, SessionTable<Session> & sessions, StageEngine & engine, Relay & relay,
                         Scheduler & sched, Origin & origin, Metrics & metrics, PrefixCache * prefix, const Trust & trust,
                         const SessionNames & names, const NetPolicy & net, SessionLifeSettings settings)
    : port_(port), sessions_(sessions), engine_(engine), relay_(relay), sched_(sched), origin_(origin), metrics_(metrics),
      prefix_(prefix), trust_(trust), names_(names), net_(net), set_(std::move(settings)) {}

std::vector<std::pair<SessionLife::Key, SessionPtr>> SessionLife::stop() {
    std::vector<std::pair<Key, SessionPtr>> open;
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = true;
    sessions_.for_each([&](const Key & k, const SessionPtr & s) { open.emplace_back(k, s); });
    return open;
}

bool SessionLife::serving() const {
    std::lock_guard<std::mutex> g(mu_);
    return !stopping_;
}

// Owners (docs/security.md): under mutual TLS a session lives in the namespace of the member that opened it here;
// stage 0 maps the ids it gave its sessions' routes back to its keys (kept by the session table)
std::string SessionLife::origin_key(const std::string & wire) const {
    return trust_.mutual ? sessions_.origin_key(wire) : wire;
}

// The part (trust/grammar_bounds.h) over the field the request filled: the GBNF grammar, else the JSON schema
std::string SessionLife::refuse_grammar(const pb::Sampling & sp) const {
    const bool json = sp.grammar().empty();
    return dgr::refuse_grammar(json ? sp.json_schema() : sp.grammar(), json, set_.max_grammar_bytes, set_.max_grammar_depth);
}

}  // namespace dgr
