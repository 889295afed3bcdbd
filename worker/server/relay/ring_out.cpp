// The ring's outgoing side (ring_out.h): a step's boundary encoded in the wire dtype and sent to the next hop in
// frames that fit, frames to the origin, a peer's answers about a session, and what a broken link tells its
// sessions.
#include "relay/ring_out.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "clock.h"
#include "data_path.h"
#include "link.h"
#include "wire/wire_common.h"

namespace dgr {

RingOut::RingOut(RingOutPort & port, Relay & relay, SessionTable<Session> & sessions, Origin & origin, Metrics & metrics,
                 const EngineLib & lib, RingOutSettings settings)
    : port_(port), relay_(relay), sessions_(sessions), origin_(origin), metrics_(metrics), lib_(lib),
      settings_(std::move(settings)) {}

void RingOut::encode(const float * x, int64_t n_tokens, pb::Boundary * b) const {
    const int64_t values = n_tokens * settings_.width;
    b->set_dtype(dtype_code(*settings_.dtype));
    b->add_shape(uint32_t(n_tokens));
    b->add_shape(uint32_t(settings_.n_streams));
    b->add_shape(uint32_t(settings_.n_embd));
    std::string * data = b->mutable_data();
    data->resize(nbytes(*settings_.dtype, uint64_t(values)));
    switch (settings_.dtype->code) {
        case pb::F32: std::memcpy(&(*data)[0], x, size_t(values) * 4); break;
        case pb::F16: {
            std::vector<uint16_t> h(static_cast<size_t>(values));
            lib_.fp32_to_fp16(x, h.data(), values);
            std::memcpy(&(*data)[0], h.data(), size_t(values) * 2);
            break;
        }
        case pb::BF16: {
            std::vector<uint16_t> h(static_cast<size_t>(values));
            lib_.fp32_to_bf16(x, h.data(), values);
            std::memcpy(&(*data)[0], h.data(), size_t(values) * 2);
            break;
        }
        case pb::Q8_0: lib_.quantize_q8_0(x, &(*data)[0], values); break;
        default: throw std::runtime_error("cannot encode wire dtype " + std::string(settings_.dtype->name));
    }
}

void RingOut::emit_boundary(const Work & w, const SessionPtr & sess, const float * boundary, pb::HopTiming timing) {
    const int64_t t0 = mono_ns();
    const pb::Step & s = w.frame.step();
    const pb::Hop & nxt = sess->route[sess->hop_index + 1];
    const pb::BoundarySchema & schema = settings_.schema_out;
    const int64_t width = settings_.width;
    const int64_t per = int64_t(tokens_per_frame(settings_.max_message_bytes, settings_.seam_bytes_per_token));
    const int64_t n = s.positions_size();
    std::vector<pb::Frame> frames;
    for (int64_t lo = 0; lo < n; lo += per) {
        const int64_t hi = std::min(n, lo + per);
        pb::Frame f;
        f.set_session_id(sess->wire_down);
        f.set_epoch(w.frame.epoch());
        pb::Step * step = f.mutable_step();
        for (int64_t k = lo; k < hi; ++k) step->add_positions(s.positions(int(k)));
        for (int64_t k = lo; k < hi && k < s.token_ids_size(); ++k) step->add_token_ids(s.token_ids(int(k)));
        encode(boundary + lo * width, hi - lo, step->mutable_boundary());
        {
            std::lock_guard<std::mutex> g(metrics_.mu);
            metrics_.seam_out += step->boundary().data().size();
        }
        *step->mutable_schema() = schema;
        step->set_cache_expect(uint64_t(s.positions(int(lo))));
        step->set_sample(s.sample() && hi == n);
        step->set_drafts(hi == n ? s.drafts() : 0);
        step->set_mtp_drafts(hi == n ? s.mtp_drafts() : 0);
        step->set_rollback(s.rollback() && lo == 0);
        f.set_origin_sent_ns(w.frame.origin_sent_ns());
        *f.mutable_timings() = w.frame.timings();
        frames.push_back(std::move(f));
    }
    timing.set_wire_ns(uint64_t(mono_ns() - t0));
    for (auto & f : frames) {
        *f.add_timings() = timing;
        send(nxt.address(), sess->hop_index + 1, std::move(f), sess);
    }
}

void RingOut::send(const std::string & address, uint32_t hop_index, pb::Frame frame, const SessionPtr & sess) {
    frame.set_sent_unix_ns(uint64_t(wall_ns()));
    const uint64_t size = frame.ByteSizeLong();
    if (size > settings_.max_message_bytes) {        // a bug if it happens: frames are sized below the limit
        pb::Frame e;
        e.set_session_id(frame.session_id());
        e.set_epoch(frame.epoch());
        *e.mutable_error() = port_.error(pb::MESSAGE_TOO_LARGE, "a " + std::to_string(size) + "-byte frame would exceed the " +
                                                            std::to_string(settings_.max_message_bytes) + "-byte limit");
        to_origin(sess, std::move(e));
        return;
    }
    if (hop_index == 0 && settings_.is_first && address == relay_.address()) {   // a one-stage route: the origin is this worker
        frame.set_session_id(sess->sid);             // its own key: a frame it sends itself is not checked
        port_.take_own(std::move(frame));
        return;
    }
    relay_.send(address, hop_index, frame, SessionKey{sess->sid, frame.epoch()});   // false: stopping, or its sessions are told
}

void RingOut::to_origin(const SessionPtr & sess, pb::Frame frame) {
    if (settings_.is_first) {
        frame.set_session_id(sess->sid);
        origin_.deliver(std::move(frame));
    } else {
        frame.set_session_id(sess->wire_down);       // as the origin knows it
        send(sess->route[0].address(), 0, std::move(frame), sess);
    }
}

// A peer's answer about a session this worker sent it (the relay checked that it was sent over that very link):
// to the session's origin.
void RingOut::on_reply(const SessionKey & mine, pb::Frame frame) {
    SessionPtr sess = sessions_.find(mine);
    if (sess) to_origin(sess, std::move(frame));
}

void RingOut::on_broken(const std::string & address, const std::string & why, const std::set<SessionKey> & lost) {
    std::vector<std::pair<SessionKey, SessionPtr>> sessions;
    for (auto & k : lost) {                          // lookups: the session table's lock alone
        if (SessionPtr s = sessions_.find(k)) sessions.emplace_back(k, std::move(s));
    }
    const int keepalive = LINK_KEEPALIVE_MS + int(settings_.link_keepalive_timeout_s * 1000);
    for (auto & [key, sess] : sessions) {
        int idx = -1;
        for (size_t i = 0; i < sess->route.size(); ++i) {
            if (sess->route[i].address() == address) { idx = int(i); break; }
        }
        const std::string name = idx >= 0 ? hop_name(uint32_t(idx), address) : address;
        pb::Frame f;
        f.set_session_id(key.first);
        f.set_epoch(key.second);
        pb::WireError * e = f.mutable_error();
        e->set_code(pb::HOP_UNREACHABLE);
        e->set_hop(name);
        e->set_message(name + " is unreachable: " + port_.hop() + " lost its stream to it (" + why + "); that worker died, stopped "
                       "answering (keepalive " + std::to_string(keepalive) + " ms) or shut down (a thin link carrying a long "
                       "prompt: raise --link-keepalive-timeout): use another replica or restart it");
        if (address != sess->route[0].address()) {
            port_.count_error(pb::HOP_UNREACHABLE);
            to_origin(sess, std::move(f));
            continue;
        }
        const bool tell = !sess->last.told_origin.exchange(true);
        if (tell) {
            // the ring's token may be lost and a live origin would wait for it: say so on a new stream (once)
            port_.count_error(pb::HOP_UNREACHABLE);
            e->set_hop(port_.hop());
            e->set_message(port_.hop() + " lost its stream back to the origin " + name + " (" + why +
                           "): the ring's last token may be lost; the session goes on in a new epoch");
            fprintf(stderr, "dgr-worker: stream to the origin broke for session %s: %s; telling the origin on a new stream\n",
                    f.session_id().c_str(), why.c_str());
            to_origin(sess, std::move(f));
        } else {
            fprintf(stderr, "dgr-worker: origin unreachable for session %s: %s\n", f.session_id().c_str(), e->message().c_str());
        }
    }
}

}  // namespace dgr
