// Who may send a session's frames under mutual TLS (senders.h) alone, as a hostile member would try it: a
// member that did not open the session sending its steps, a hop other than the last sending tokens into the
// origin, a stranger sending errors, a stream with no certificate name, and what passes before the senders are
// known. Each refusal is checked word for word (the WRONG_STAGE message a client or a log reads). No gRPC, no
// engine. `bazel test //worker/server:senders_test`, or the CMake target dgr-unit-senders_test
// (tests/worker/test_worker_units.py builds and runs it).
#include "unit_check.h"
#include "trust/senders.h"

#include <cstdio>
#include <optional>
#include <string>
#include <thread>

namespace {

using dgr::refuse_sender;
using dgr::Senders;
using dgr::SessionSenders;
using Peer = std::optional<std::string>;

// A 3-hop route's session at stage 1: opened by stage 0's member "stage-a"; the route's hops are "stage-a",
// "stage-b" and its last, "stage-c"
SessionSenders route() {
    SessionSenders s;
    s.opener = "stage-a";
    s.returner = "stage-c";
    s.route_members = {"stage-a", "stage-b", "stage-c"};
    return s;
}

bool accepted(const std::string & kind, const SessionSenders & s, const Peer & peer) {
    const std::string why = refuse_sender(kind, s, peer, "stage 0", "s1");
    if (!why.empty()) std::fprintf(stderr, "  %s from %s refused: %s\n", kind.c_str(), peer ? peer->c_str() : "(none)", why.c_str());
    return why.empty();
}

// refused, the message naming the session, who may send (`from`, then `members`) and who sent
bool refused(const std::string & kind, const SessionSenders & s, const Peer & peer, const std::string & from,
             const std::string & members, const std::string & who_opens = "stage 0") {
    const std::string why = refuse_sender(kind, s, peer, who_opens, "s1");
    const std::string want = kind + " frames of session s1 are accepted here only from " + from + ", member " + members +
                             "; this stream comes from member " + (peer ? *peer : "(no certificate name)");
    if (why != want) std::fprintf(stderr, "  %s:\n    got  %s\n    want %s\n", kind.c_str(), why.c_str(), want.c_str());
    return why == want;
}

const std::string OPENER = "the peer that opened it at this stage (stage 0)";
const std::string LAST = "the route's last hop";
const std::string HOP = "a hop of the route";

void only_the_opener_sends_steps() {
    const SessionSenders s = route();
    for (const char * kind : {"step", "generate", "other"}) {
        CHECK(accepted(kind, s, "stage-a"));
        CHECK(refused(kind, s, "mallory", OPENER, "stage-a"));
        // being on the route is not enough: a later hop may not feed the session its own steps
        CHECK(refused(kind, s, "stage-b", OPENER, "stage-a"));
        CHECK(refused(kind, s, "stage-c", OPENER, "stage-a"));
        // the name is matched whole, never as a prefix or with what a certificate might pad it with
        CHECK(refused(kind, s, "stage-", OPENER, "stage-a"));
        CHECK(refused(kind, s, "stage-a ", OPENER, "stage-a"));
        CHECK(refused(kind, s, "", OPENER, "stage-a"));
    }
    // at stage 0 the opener is the client
    SessionSenders origin = route();
    origin.opener = "client-1";
    CHECK(refused("step", origin, "client-2", "the peer that opened it at this stage (the client)", "client-1", "the client"));
}

void only_the_last_hop_returns_tokens() {
    const SessionSenders s = route();
    for (const char * kind : {"token", "logits"}) {
        CHECK(accepted(kind, s, "stage-c"));
        CHECK(refused(kind, s, "stage-b", LAST, "stage-c"));       // a hop of the route, not the last
        CHECK(refused(kind, s, "stage-a", LAST, "stage-c"));       // the opener
        CHECK(refused(kind, s, "mallory", LAST, "stage-c"));
    }
}

void only_a_hop_of_the_route_sends_errors() {
    const SessionSenders s = route();
    for (const char * hop : {"stage-a", "stage-b", "stage-c"}) CHECK(accepted("error", s, hop));
    // the message names every hop, in order
    CHECK(refused("error", s, "mallory", HOP, "stage-a or stage-b or stage-c"));
    CHECK(refused("error", s, "stage-d", HOP, "stage-a or stage-b or stage-c"));
}

void no_certificate_name_is_nobody() {
    const SessionSenders s = route();
    CHECK(refused("step", s, std::nullopt, OPENER, "stage-a"));
    CHECK(refused("token", s, std::nullopt, LAST, "stage-c"));
    CHECK(refused("error", s, std::nullopt, HOP, "stage-a or stage-b or stage-c"));
}

void nothing_known_checks_nothing() {
    // before the OpenSession reply names the route, and where the opener had no name: every peer passes
    const SessionSenders none;
    for (const char * kind : {"step", "generate", "other", "token", "logits", "error"}) {
        CHECK(accepted(kind, none, "mallory"));
        CHECK(accepted(kind, none, std::nullopt));
    }
    // each set alone: the others still check
    SessionSenders opened;
    opened.opener = "stage-a";
    CHECK(accepted("token", opened, "mallory"));
    CHECK(accepted("error", opened, "mallory"));
    CHECK(refused("step", opened, "mallory", OPENER, "stage-a"));
    SessionSenders routed = route();
    routed.opener.reset();
    CHECK(accepted("step", routed, "mallory"));
    CHECK(refused("token", routed, "stage-b", LAST, "stage-c"));
    CHECK(refused("error", routed, "mallory", HOP, "stage-a or stage-b or stage-c"));
}

void the_route_named_while_frames_are_checked() {
    // OpenSession names the route on its call's thread while a frame's check reads the senders on gRPC's: the
    // guarded senders (under TSan this is the check) refuse nothing before the route is known, the wrong hop after
    Senders s;
    s.set_opener(std::string("client-a"));
    std::thread named([&] { s.set_route("stage-c", {"stage-a", "stage-b", "stage-c"}); });
    for (int i = 0; i < 1000; ++i) CHECK(s.refuse("step", std::string("client-a"), "the client", "s").empty());
    named.join();
    CHECK(s.refuse("token", std::string("stage-c"), "the client", "s").empty());
    CHECK(!s.refuse("token", std::string("stage-b"), "the client", "s").empty());
    CHECK(!s.refuse("step", std::string("mallory"), "the client", "s").empty());
}

}  // namespace

int main() {
    only_the_opener_sends_steps();
    only_the_last_hop_returns_tokens();
    only_a_hop_of_the_route_sends_errors();
    no_certificate_name_is_nobody();
    nothing_known_checks_nothing();
    the_route_named_while_frames_are_checked();
    return dgr::unit::finish("senders_test");
}
