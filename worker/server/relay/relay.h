// The ring's outgoing side: where this worker's frames go. It owns the links to every peer (one Frames stream per
// address, link.h, kept by the link table, ring/link_table.h), the unary channels of the open and close chains,
// the credentials they are made with, the address this worker names itself by, and the largest frame it sent.
//
// A part with narrow edges: the worker hands it frames to send (already named as the peer knows the session,
// with the worker's own key for it beside them) and hears back, through RelayOwner, what a peer wrote about a
// session sent to it and which sessions a broken link took with it. It knows nothing of sessions, the engine or
// the step queue. Its own state is behind the link table's lock, its own leaf lock (address, credentials) and an
// atomic; a peer's answers reach the owner with no lock of the relay's held (docs/worker.md "Locks and their
// order"). The process tests (tests/worker) run it between real workers; it links gRPC, so it has no plain unit test.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <grpcpp/security/credentials.h>

#include "dgr/v1/stage.grpc.pb.h"
#include "link.h"
#include "ring/link_table.h"

namespace dgr {

// Whoever the relay sends for (the worker): told on gRPC's threads, with no lock of the relay's held.
class RelayOwner {
  public:
    using Key = LinkOwner::Key;
    // the peer of a link wrote `frame` back about the session this worker knows as `mine` (only one it sent
    // over that very link: a peer never reaches another session, whatever it names)
    virtual void on_reply(const Key & mine, dgr::v1::Frame frame) = 0;
    // the link to `address` broke (`why`, for the sessions' origins); `lost`, this worker's keys of the
    // sessions sent over it and still open. The next frame to that address opens a new link.
    virtual void on_broken(const std::string & address, const std::string & why, const std::set<Key> & lost) = 0;

  protected:
    ~RelayOwner() = default;
};

// What the relay's links and channels are made with (`dgr worker serve`'s flags).
struct RelaySettings {
    uint64_t max_message_bytes = 0;                  // + FRAME_OVERHEAD: every channel's message limits
    double keepalive_timeout_s = 0;                  // --link-keepalive-timeout
    int64_t max_send_queue_bytes = 0;                // --max-send-queue-bytes, per link (0: unbounded)
};

class Relay final : private LinkOwner {
  public:
    using Key = LinkOwner::Key;
    using Stub = dgr::v1::Stage::Stub;

    Relay(RelayOwner & owner, std::string address, RelaySettings settings);
    Relay(const Relay &) = delete;
    Relay & operator=(const Relay &) = delete;

    // TLS (before serving): what every link and channel is made with (default: plaintext)
    void set_credentials(std::shared_ptr<grpc::ChannelCredentials> credentials);
    // HOST:PORT as this worker names itself (set again once its port is known)
    std::string address() const;
    void set_address(const std::string & address);

    // Send `frame` to `address`, hop `hop_index` of the session's route (its name in the link's errors), for the
    // session this worker knows as `mine` (what the peer's answers about it are taken for). A broken link is
    // retired and one new link tried. false: the relay is stopping, or the new link broke too (its sessions are
    // told through on_broken).
    bool send(const std::string & address, uint32_t hop_index, dgr::v1::Frame & frame, const Key & mine);
    // The unary channel to `address` (OpenSession and CloseSession along the route).
    std::shared_ptr<Stub> channel(const std::string & address);
    // The link kept for `address`, if any (--test-break-origin-link-at fails it).
    std::shared_ptr<Link> find(const std::string & address) const;
    // The session this worker sent as `sent` closed: no link takes its peer's answers about it any more.
    void forget(const Key & sent);
    // --send-timeout: a link whose write waited longer than `timeout_ns` fails (its sessions are told).
    void check_stalls(int64_t now_ns, int64_t timeout_ns);
    // The links and channels to addresses not in `used` (no open session goes there), and the broken links gRPC
    // is done with: taken out of the table and handed back, for the caller to close (`close`) outside every lock
    // a link's callback takes.
    using Dropped = LinkTable<Link, Stub>::Pruned;
    Dropped prune(const std::set<std::string> & used);
    static void close(Dropped & dropped);
    // Stopping: no link opens from now on (what is kept goes on until close_all).
    void stop();
    // Once stopped and nothing sends any more: every link closed (waiting until gRPC is done with each), then
    // every link and channel destroyed.
    void close_all();

    size_t size() const;                             // links (kept and broken) and channels: dgr_worker_links
    uint64_t max_frame_bytes_sent() const { return max_frame_bytes_sent_.load(); }

  private:
    std::shared_ptr<Link> open(const std::string & address, uint32_t hop_index);
    std::shared_ptr<grpc::ChannelCredentials> credentials() const;
    void on_link_reply(Link * link, dgr::v1::Frame frame) override;                                  // LinkOwner
    void on_link_broken(Link * link, const std::string & why, const std::set<Key> & lost) override;  // LinkOwner

    RelayOwner & owner_;
    const RelaySettings settings_;
    mutable std::mutex mu_;                          // a leaf: address_ and credentials_
    std::string address_;
    std::shared_ptr<grpc::ChannelCredentials> credentials_;
    std::atomic<uint64_t> max_frame_bytes_sent_{0};
    LinkTable<Link, Stub> links_;                    // its own lock (ring/link_table.h)
};

}  // namespace dgr
