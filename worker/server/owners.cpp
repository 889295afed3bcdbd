// Owners (docs/security.md): what a request may ask of the worker, bounded before any parser sees it, and the
// origin's map from the ids stage 0 gave its sessions to this worker's keys (kept by the session table,
// sessions/session_table.h). Whose a session is, from its key, is the part sessions/names.h; a grammar's bounds
// are the part trust/grammar_bounds.h.
#include <fcntl.h>
#include <unistd.h>

#include <string>

#include "trust/grammar_bounds.h"
#include "worker.h"

namespace dgr {

namespace pb = dgr::v1;

std::string StageWorker::origin_key(const std::string & wire) const {
    return trust_.mutual ? sessions_.origin_key(wire) : wire;
}

// The tests' hooks (--test-die-at SESSION:...) name a session as its client did (SessionNames::client_name)
bool StageWorker::hook_at(const std::set<std::tuple<std::string, uint64_t, int64_t>> & at, const std::string & key,
                          uint64_t epoch, int64_t p) const {
    return !at.empty() && at.count({names_.client_name(key), epoch, p}) > 0;
}

// The part (trust/grammar_bounds.h) over the field the request filled: the GBNF grammar, else the JSON schema
std::string StageWorker::refuse_grammar(const pb::Sampling & sp) const {
    const bool json = sp.grammar().empty();
    return dgr::refuse_grammar(json ? sp.json_schema() : sp.grammar(), json, limits_.max_grammar_bytes,
                               limits_.max_grammar_depth);
}

}  // namespace dgr
