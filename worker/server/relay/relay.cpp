// The relay (relay.h): links opened on demand, sent over with one retry, pruned, stopped; a peer's answers and a
// broken link's sessions handed to the owner.
#include "relay/relay.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdio>

#include "wire/wire_common.h"
#include "wire_constants.h"

namespace dgr {

namespace pb = dgr::v1;

Relay::Relay(RelayOwner & owner, std::string address, RelaySettings settings)
    : owner_(owner), settings_(settings), address_(std::move(address)), credentials_(grpc::InsecureChannelCredentials()) {}

void Relay::set_credentials(std::shared_ptr<grpc::ChannelCredentials> credentials) {
    if (!credentials) credentials = grpc::InsecureChannelCredentials();   // made outside the lock: it is a leaf
    std::lock_guard<std::mutex> g(mu_);
    credentials_ = std::move(credentials);
}

std::shared_ptr<grpc::ChannelCredentials> Relay::credentials() const {
    std::lock_guard<std::mutex> g(mu_);
    return credentials_;
}

std::string Relay::address() const {
    std::lock_guard<std::mutex> g(mu_);
    return address_;
}

void Relay::set_address(const std::string & address) {
    std::lock_guard<std::mutex> g(mu_);
    address_ = address;
}

std::shared_ptr<Link> Relay::open(const std::string & address, uint32_t hop_index) {
    std::shared_ptr<Link> lost;                      // made here while another thread's was kept: ended below
    std::shared_ptr<Link> l = links_.open(address, [&] {
        LinkSettings settings{credentials(), settings_.max_message_bytes, settings_.keepalive_timeout_s,
                              settings_.max_send_queue_bytes};
        LinkOwner * owner = this;                    // a private base: converted here, where it is reachable
        return std::make_shared<Link>(owner, address, hop_name(hop_index, address), settings);
    }, &lost);
    if (lost) {                                      // never waited for: this may be one of gRPC's threads
        lost->abandon();
        links_.bury(std::move(lost));
    }
    return l;
}

bool Relay::send(const std::string & address, uint32_t hop_index, pb::Frame & frame, const Key & mine) {
    const uint64_t size = frame.ByteSizeLong();
    uint64_t seen = max_frame_bytes_sent_.load();
    while (size > seen && !max_frame_bytes_sent_.compare_exchange_weak(seen, size)) {
    }
    for (int attempt = 0; attempt < 2; ++attempt) {
        std::shared_ptr<Link> l = open(address, hop_index);
        if (!l) return false;                        // stopping
        if (l->send(frame, mine)) return true;
        links_.retire(address, l.get());            // broken but not yet forgotten: the next try opens a new one
    }
    return false;
}

std::shared_ptr<Relay::Stub> Relay::channel(const std::string & address) {
    return links_.channel(address, [&] {
        grpc::ChannelArguments args;
        int limit = int(settings_.max_message_bytes + FRAME_OVERHEAD);
        args.SetMaxSendMessageSize(limit);
        args.SetMaxReceiveMessageSize(limit);
        // its own connection: a peer restarted in place is not stuck behind a shared connection's backoff
        args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
        args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, RECONNECT_INITIAL_MS);   // as the links (wire_constants.h)
        args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, CONNECT_TIMEOUT_MS);
        args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, RECONNECT_MAX_MS);
        return std::shared_ptr<Stub>(pb::Stage::NewStub(grpc::CreateCustomChannel(address, credentials(), args)));
    });
}

std::shared_ptr<Link> Relay::find(const std::string & address) const { return links_.find(address); }

void Relay::forget(const Key & sent) {
    for (auto & l : links_.live()) l->forget(sent);
}

void Relay::check_stalls(int64_t now_ns, int64_t timeout_ns) {
    for (auto & l : links_.live()) l->check_stall(now_ns, timeout_ns);
}

Relay::Dropped Relay::prune(const std::set<std::string> & used) { return links_.prune(used); }

void Relay::close(Dropped & dropped) {
    for (auto & l : dropped.links) l->close();
}

void Relay::stop() {
    links_.stop();                                   // no link opens from now on
}

void Relay::close_all() {
    for (auto & l : links_.stop()) l->close();
    links_.clear();                                  // every link and channel destroyed here, outside the locks
}

size_t Relay::size() const { return links_.size(); }

// What the peer of an outgoing link writes back: errors about frames this worker sent it. Taken only for a
// session this worker sent over this very link (a peer never reaches another session, whatever it names).
void Relay::on_link_reply(Link * link, pb::Frame frame) {
    std::optional<Key> mine = link->mine_of(frame.session_id(), frame.epoch());
    if (!mine) {
        fprintf(stderr, "dgr-worker: %s named session %s epoch %llu, which this worker never sent it: dropped\n",
                link->label.c_str(), frame.session_id().c_str(), (unsigned long long)frame.epoch());
        return;
    }
    owner_.on_reply(*mine, std::move(frame));
}

void Relay::on_link_broken(Link * link, const std::string & why, const std::set<Key> & lost) {
    links_.retire(link->address, link);              // never reused: the next frame opens a new one
    owner_.on_broken(link->address, why, lost);
}

}  // namespace dgr
