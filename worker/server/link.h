// An outgoing Frames stream to one peer (the next hop, or the origin), shared by every session going
// there. gRPC's callback API (a ClientBidiReactor): the thread that sends a frame (the engine thread, for a
// boundary or a token) starts its write itself when no write is in flight, and the write that completes
// starts the next queued one, so no thread of its own is woken per frame; the peer's answers (typed errors
// about frames sent) are read by gRPC's callbacks and handed to its owner. A broken stream is never
// reused: its sessions hear HOP_UNREACHABLE and the next frame to that address opens a new link.
//
// It knows nothing of the worker: what it needs comes in LinkSettings, what it tells goes to a LinkOwner (the
// relay, relay/relay.h), and the links to every peer are kept by the link table (ring/link_table.h).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include <grpcpp/security/credentials.h>

#include "dgr/v1/stage.grpc.pb.h"

namespace dgr {

constexpr int LINK_KEEPALIVE_MS = 1000;   // each link pings its peer every second (docs/wire.md "Liveness of links")

class Link;

// Whoever opened a link hears from it here, on gRPC's threads, with the link's own lock released.
class LinkOwner {
  public:
    using Key = std::pair<std::string, uint64_t>;
    // the peer wrote `frame` back about a session this worker sent over this link (Link::mine_of finds which)
    virtual void on_link_reply(Link * link, dgr::v1::Frame frame) = 0;
    // the stream is over (not by close()): `why`, for the sessions' origins, never gRPC's reason; `lost`, the
    // owner's keys of the sessions that were sent over it and still open
    virtual void on_link_broken(Link * link, const std::string & why, const std::set<Key> & lost) = 0;

  protected:
    ~LinkOwner() = default;
};

// What a link is made with: the channel's credentials and bounds (`dgr worker serve`'s flags).
struct LinkSettings {
    std::shared_ptr<grpc::ChannelCredentials> credentials;
    uint64_t max_message_bytes = 0;                  // + FRAME_OVERHEAD: the channel's message limits
    double keepalive_timeout_s = 0;                  // --link-keepalive-timeout
    int64_t max_send_queue_bytes = 0;                // --max-send-queue-bytes (0: unbounded)
};

class Link final : public grpc::ClientBidiReactor<dgr::v1::Frame, dgr::v1::Frame> {
  public:
    Link(LinkOwner * owner, std::string address, std::string label, const LinkSettings & settings);
    ~Link() override;
    using Key = LinkOwner::Key;
    // false: the link is broken or closing (the caller opens a new one). `mine`: the session's key in this
    // worker (the frame names it as the peer knows it); only the peer's answers about sessions sent here are
    // taken (mine_of)
    bool send(dgr::v1::Frame & f, const Key & mine);   // moves f only when it returns true
    // the session in this worker that a frame from the peer names: only one this worker sent there
    std::optional<Key> mine_of(const std::string & sid, uint64_t epoch);
    void forget(const Key & sent);                   // the session (as sent) closed: its replies are no longer taken
    void close();   // cancel the stream and wait until gRPC is done with it
    // cancel the stream and return at once; its owner is not told (LinkTable::bury keeps it until done())
    void abandon();
    // the send deadline: a write waiting longer than `timeout_ns` fails the link (its sessions are told)
    void check_stall(int64_t now_ns, int64_t timeout_ns);
    // fail the link now, as a broken stream does (its sessions are told); --test-break-origin-link-at
    void fail(const std::string & why);
    bool idle();                                     // no session sent here is open, nothing queued or in flight
    bool done();                                     // gRPC is finished with it: it may be destroyed
    const std::string address, label;

    void OnWriteDone(bool ok) override;
    void OnReadDone(bool ok) override;
    void OnDone(const grpc::Status & status) override;

  private:
    void cancel_locked(const std::string & why);     // mu_ held
    // gRPC runs this link's reactions on its own threads and orders them with its own (uninstrumented)
    // atomics: the constructor, before it starts an operation, and every reaction take mu_ once, so the order
    // gRPC keeps is one TSan sees too (a reaction read `address` as a race, CI 2026-12-05; FramesReactor
    // does the same). OnWriteDone takes mu_ first anyway.
    void ordered() { std::lock_guard<std::mutex> g(mu_); }
    LinkOwner * owner_;
    const int64_t max_send_queue_bytes_;
    std::unique_ptr<dgr::v1::Stage::Stub> stub_;
    grpc::ClientContext ctx_;
    std::mutex mu_;
    std::condition_variable done_cv_;
    std::deque<dgr::v1::Frame> q_;                   // waiting behind the write in flight
    dgr::v1::Frame writing_;                         // the write in flight (gRPC reads it until OnWriteDone)
    dgr::v1::Frame in_;                              // the read in flight
    bool in_flight_ = false;
    std::map<Key, Key> sessions_;                    // (id, epoch) as sent -> this worker's own key
    bool broken_ = false, closing_ = false, done_ = false;
    int64_t bytes_ = 0, writing_since_ = 0;
    std::string failed_;                             // why this side failed the link (a bound), else ""
};

}  // namespace dgr
