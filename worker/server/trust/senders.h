// Who may send a session's frames here under mutual TLS (docs/worker.md "Peer checks under mutual TLS"), as a
// pure function over plain data: the session's senders (filled by OpenSession) and the stream's certificate name.
// `Senders` holds one session's under its own leaf lock: OpenSession writes them, each frame's check reads them.
#pragma once

#include <mutex>
#include <optional>
#include <set>
#include <string>

namespace dgr {

// Who may send one session's frames to this worker (each empty until known; an empty one checks nothing).
struct SessionSenders {
    std::optional<std::string> opener;           // the member that opened it at this stage (its step, generate, ...)
    std::string returner;                        // the route's last hop (token and logits frames into the origin)
    std::set<std::string> route_members;         // every hop of the route (error frames into the origin)
};

// "" when a frame of `kind` ("token", "logits", "error"; anything else is the opener's: "step", "generate",
// "other") of session `sid` (as the sender named it) may come from `peer` (the stream's certificate name;
// nullopt: it had none), else the WRONG_STAGE message naming the session, who may send it and who sent it.
// `who_opens`: who opens sessions at this stage, "the client" (stage 0) or "stage N" (the previous hop).
// No one to check against (an empty opener, returner or route) lets every peer through.
std::string refuse_sender(const std::string & kind, const SessionSenders & senders,
                          const std::optional<std::string> & peer, const std::string & who_opens,
                          const std::string & sid);

// One session's senders, under their own leaf lock (sessions/session.h holds one per session): OpenSession names
// the opener before the session is in the table and the route's members once its chain answered; every frame's
// check reads them in place (no copy of the route's members per frame).
class Senders {
  public:
    void set_opener(std::optional<std::string> opener) {
        std::lock_guard<std::mutex> g(mu_);
        s_.opener = std::move(opener);
    }
    void set_route(std::string returner, std::set<std::string> route_members) {
        std::lock_guard<std::mutex> g(mu_);
        s_.returner = std::move(returner);
        s_.route_members = std::move(route_members);
    }
    // refuse_sender over these senders
    std::string refuse(const std::string & kind, const std::optional<std::string> & peer, const std::string & who_opens,
                       const std::string & sid) const {
        std::lock_guard<std::mutex> g(mu_);
        return refuse_sender(kind, s_, peer, who_opens, sid);
    }

  private:
    mutable std::mutex mu_;
    SessionSenders s_;
};

}  // namespace dgr
