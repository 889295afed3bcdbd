// Link (link.h): one outgoing Frames stream to a peer, shared by every session going there, on gRPC's
// callback API; a broken one tells its owner and is never reused.
#include "link.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdio>

#include "clock.h"
#include "grpc_status.h"
#include "wire_constants.h"

namespace dgr {

namespace pb = dgr::v1;

Link::Link(LinkOwner * owner, std::string address_, std::string label_, const LinkSettings & settings)
    : address(std::move(address_)), label(std::move(label_)), owner_(owner),
      max_send_queue_bytes_(settings.max_send_queue_bytes) {
    grpc::ChannelArguments args;                     // keepalive: docs/wire.md "Liveness of links"
    int limit = int(settings.max_message_bytes + FRAME_OVERHEAD);
    args.SetMaxSendMessageSize(limit);
    args.SetMaxReceiveMessageSize(limit);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, RECONNECT_INITIAL_MS);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, CONNECT_TIMEOUT_MS);   // gRPC's name for it (wire_constants.h)
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, RECONNECT_MAX_MS);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, LINK_KEEPALIVE_MS);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, int(settings.keepalive_timeout_s * 1000));
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    stub_ = pb::Stage::NewStub(grpc::CreateCustomChannel(address, settings.credentials, args));
    stub_->async()->Frames(&ctx_, this);
    ordered();                                       // every field above is set before gRPC may react
    StartRead(&in_);
    StartCall();
}

Link::~Link() { close(); }

std::optional<Link::Key> Link::mine_of(const std::string & sid, uint64_t epoch) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = sessions_.find(Key{sid, epoch});
    if (it == sessions_.end()) return std::nullopt;
    return it->second;
}

bool Link::idle() {
    std::lock_guard<std::mutex> g(mu_);
    return sessions_.empty() && !in_flight_ && q_.empty();
}

bool Link::done() {
    std::lock_guard<std::mutex> g(mu_);
    return done_;
}

void Link::forget(const Key & sent) {
    std::lock_guard<std::mutex> g(mu_);
    sessions_.erase(sent);
}

bool Link::send(pb::Frame & f, const Key & mine) {
    const int64_t size = int64_t(f.ByteSizeLong());
    {
        std::lock_guard<std::mutex> g(mu_);
        if (broken_ || closing_) return false;
        const int64_t cap = max_send_queue_bytes_;
        if (cap > 0 && bytes_ + size > cap && in_flight_) {
            // the peer stopped reading: fail the link (its sessions hear HOP_UNREACHABLE), never block the engine
            cancel_locked("it fell " + std::to_string(bytes_ + size) + " bytes behind (--max-send-queue-bytes " +
                          std::to_string(cap) + ")");
            return false;
        }
        sessions_.emplace(Key{f.session_id(), f.epoch()}, mine);
        if (in_flight_) {                            // behind the write in flight: OnWriteDone starts it
            bytes_ += size;
            q_.push_back(std::move(f));
            return true;
        }
        in_flight_ = true;
        writing_ = std::move(f);
        writing_since_ = mono_ns();
    }
    StartWrite(&writing_);                           // this thread starts it: no writer thread to wake
    return true;
}

void Link::OnWriteDone(bool ok) {
    {
        std::lock_guard<std::mutex> g(mu_);
        writing_since_ = 0;
        if (!ok || broken_ || closing_ || q_.empty()) {
            in_flight_ = false;
            if (!ok) broken_ = true;                 // the stream is over: OnDone says why
            return;
        }
        writing_ = std::move(q_.front());
        q_.pop_front();
        bytes_ = q_.empty() ? 0 : std::max<int64_t>(0, bytes_ - int64_t(writing_.ByteSizeLong()));
        writing_since_ = mono_ns();
    }
    StartWrite(&writing_);
}

void Link::OnReadDone(bool ok) {
    ordered();
    if (!ok) {                                       // the peer ended the stream: OnDone follows
        std::lock_guard<std::mutex> g(mu_);
        broken_ = true;
        return;
    }
    try {
        owner_->on_link_reply(this, std::move(in_));     // the peer's answers: errors about frames sent
    } catch (const std::exception & e) {
        fprintf(stderr, "dgr-worker: link to %s: %s\n", address.c_str(), e.what());
    } catch (...) {
    }
    in_.Clear();
    StartRead(&in_);
}

void Link::OnDone(const grpc::Status & st) {
    ordered();
    // the sessions' origins hear that the stream ended, never gRPC's reason (refused, timed out, TLS refused:
    // whether a port is open is not a route owner's business); this worker's log has it
    if (!st.ok()) fprintf(stderr, "dgr-worker: link to %s ended: %s: %s\n", address.c_str(),
                          status_name(st.error_code()).c_str(), st.error_message().c_str());
    std::string why = st.ok() ? "closed the stream" : "the stream ended: " + status_name(st.error_code());
    std::set<Key> lost;
    bool closing;
    {
        std::lock_guard<std::mutex> g(mu_);
        broken_ = true;
        if (!failed_.empty()) why = "this worker failed the link: " + failed_;
        for (auto & kv : sessions_) lost.insert(kv.second);
        sessions_.clear();
        closing = closing_;
        q_.clear();
        bytes_ = 0;
    }
    if (!closing) {
        try {
            owner_->on_link_broken(this, why, lost);
        } catch (const std::exception & e) {
            fprintf(stderr, "dgr-worker: link to %s broke: %s\n", address.c_str(), e.what());
        } catch (...) {
        }
    }
    std::lock_guard<std::mutex> g(mu_);              // last: close() may destroy this link once it sees done_
    done_ = true;
    done_cv_.notify_all();
}

void Link::cancel_locked(const std::string & why) {
    if (failed_.empty()) failed_ = why;
    broken_ = true;
    ctx_.TryCancel();
}

void Link::check_stall(int64_t now_ns, int64_t timeout_ns) {
    std::lock_guard<std::mutex> g(mu_);
    if (broken_ || closing_ || !writing_since_ || now_ns - writing_since_ <= timeout_ns) return;
    cancel_locked("it did not take a frame for " + std::to_string(timeout_ns / 1000000) + " ms (--send-timeout)");
}

void Link::fail(const std::string & why) {
    std::lock_guard<std::mutex> g(mu_);
    if (broken_ || closing_) return;
    cancel_locked(why);
}

void Link::abandon() {
    std::lock_guard<std::mutex> g(mu_);
    if (closing_) return;
    closing_ = true;
    ctx_.TryCancel();
}

void Link::close() {
    std::unique_lock<std::mutex> l(mu_);
    if (!closing_) {
        closing_ = true;
        ctx_.TryCancel();
    }
    done_cv_.wait(l, [&] { return done_; });
}

}  // namespace dgr
