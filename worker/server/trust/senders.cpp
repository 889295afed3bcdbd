#include "trust/senders.h"

namespace dgr {

std::string refuse_sender(const std::string & kind, const SessionSenders & senders,
                          const std::optional<std::string> & peer, const std::string & who_opens,
                          const std::string & sid) {
    const bool returning = kind == "token" || kind == "logits";
    const bool error = kind == "error";
    // the members a peer must be among (the route's own set for errors, not a copy: this runs for every frame)
    std::set<std::string> one;
    if (returning && !senders.returner.empty()) one.insert(senders.returner);
    if (!returning && !error && senders.opener) one.insert(*senders.opener);
    const std::set<std::string> & want = error ? senders.route_members : one;
    if (want.empty() || (peer && want.count(*peer))) return "";
    const std::string what = returning ? "the route's last hop"
                             : error   ? "a hop of the route"
                                       : "the peer that opened it at this stage (" + who_opens + ")";
    std::string names;
    for (auto & n : want) names += (names.empty() ? "" : " or ") + n;
    return kind + " frames of session " + sid + " are accepted here only from " + what + ", member " + names +
           "; this stream comes from member " + (peer ? *peer : std::string("(no certificate name)"));
}

}  // namespace dgr
