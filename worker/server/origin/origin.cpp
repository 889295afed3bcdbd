// The origin (origin.h): the ring's tokens counted against the generation's bounds and delivered to the client
// with their text, the next step queued (with drafts when speculating), and a client gone.
#include "origin/origin.h"

#include <algorithm>
#include <stdexcept>

#include "clock.h"
#include "data_path.h"
#include "wire/utf8.h"
#include "wire/wire_common.h"

namespace dgr {

Origin::Origin(OriginPort & port, SessionTable<Session> & sessions, const SessionNames & names, Scheduler & sched,
               StageEngine & engine, OriginSettings settings)
    : port_(port), sessions_(sessions), names_(names), sched_(sched), engine_(engine), settings_(settings) {}

void Origin::begin(const SessionPtr & sess, const pb::Generate & g, const ReplyPtr & reply) {
    {
        std::lock_guard<std::mutex> l(mu_);
        sess->origin.client = reply;
        sess->origin.gen.begin(g.max_new_tokens(), g.stop_token_ids(), g.context_ids(), g.cached_ids());   // history: then the steps' tokens
        sess->origin.text = g.context_text();   // (not progress: --session-ttl counts steps run)
    }
    start_speculation(sess, g);
}

void Origin::on_client_step(const SessionPtr & sess, const ReplyPtr & reply, pb::Step * step) {
    std::lock_guard<std::mutex> g(mu_);
    if (!sess->origin.client) sess->origin.client = reply;
    const auto & ids = step->token_ids();
    sess->origin.gen.history.insert(sess->origin.gen.history.end(), ids.begin(), ids.end());   // what draft sources look up
    // the prompt's last chunk: MTP drafts for the first decode step come back with the first token
    if (sess->origin.drafter && step->sample()) step->set_mtp_drafts(sess->origin.drafter->remote_k(int64_t(sess->origin.draft_k)));
}

bool Origin::serves(const SessionPtr & sess, const ReplyPtr & out) {
    std::lock_guard<std::mutex> g(mu_);
    return sess->origin.client == out && !sess->origin.gen.done;
}

ReplyPtr Origin::fail(const SessionPtr & sess) {
    std::lock_guard<std::mutex> g(mu_);
    if (!sess->origin.client || sess->origin.gen.done) return nullptr;
    sess->origin.gen.failed = true;
    return sess->origin.client;
}

ReplyPtr Origin::unfinished_client(const SessionPtr & sess) {
    std::lock_guard<std::mutex> g(mu_);
    return sess->origin.gen.done ? nullptr : sess->origin.client;
}

bool Origin::failed(const SessionPtr & sess) {
    std::lock_guard<std::mutex> g(mu_);
    return sess->origin.gen.failed;
}

void Origin::deliver(pb::Frame frame) {
    SessionPtr sess = sessions_.find(SessionKey{frame.session_id(), frame.epoch()});
    if (!sess || !settings_.is_first) return;
    frame.set_session_id(names_.wire_of(sess->sid));        // what the client gets names the session as it did
    ReplyPtr client;
    {
        std::lock_guard<std::mutex> g(mu_);
        client = sess->origin.client;
    }
    if (!client) return;
    if (frame.has_error()) {
        // behind the tokens still being detokenized (jobs_, in order): an error never overtakes a token
        auto shared = std::make_shared<pb::Frame>(std::move(frame));
        std::lock_guard<std::mutex> g(mu_);
        sess->origin.gen.failed = true;
        sched_.defer([client, shared] { client->put(std::move(*shared)); });
        return;
    }
    if (frame.has_logits()) {
        client->put(std::move(frame));
        return;
    }
    if (!frame.has_token()) return;
    pb::Token * tok = frame.mutable_token();
    if (tok->origin_sent_ns()) tok->set_ring_ns(uint64_t(mono_ns()) - tok->origin_sent_ns());
    // A speculative ring returns several draws: the accepted drafts, then token_id. Count them one by one;
    // a stop id or max_new_tokens among them ends the generation there (the rest are dropped).
    std::vector<int32_t> draws(tok->accepted().begin(), tok->accepted().end());
    draws.push_back(tok->token_id());
    const int64_t first = int64_t(tok->position()) - tok->accepted_size();
    bool next = false, full = false;
    size_t used = 0, n_ids;
    int64_t pos = 0;
    pb::Frame step;
    {
        std::lock_guard<std::mutex> g(mu_);
        if (sess->origin.drafter && tok->drafted()) sess->origin.drafter->observe(tok->drafted(), uint32_t(tok->accepted_size()));
        if (sess->origin.drafter) sess->origin.drafter->offer(std::vector<int32_t>(tok->next_drafts().begin(), tok->next_drafts().end()));
        const Generation::Ring r = sess->origin.gen.count(draws, first, settings_.n_ctx);
        used = r.used;
        tok->set_done(r.done);
        pos = r.next;
        full = r.full;
        next = r.step;
        if (next) step = next_step(*sess, sess->sid, frame.epoch(), pos, r.last, tok->drafted() > 0);
        n_ids = sess->origin.gen.context_ids.size();
    }
    std::shared_ptr<pb::Frame> full_error;
    if (full) {                                      // sent after this ring's tokens (below)
        full_error = std::make_shared<pb::Frame>();
        full_error->set_session_id(frame.session_id());
        full_error->set_epoch(frame.epoch());
        *full_error->mutable_error() = port_.error(pb::ENGINE, context_full(pos, settings_.n_ctx));
    } else if (next) {
        // queue the next decode step first: the ring goes on while this token is detokenized and sent
        Work w;
        w.frame = std::move(step);
        w.reply = client;
        w.t_recv = mono_ns();
        port_.enqueue_next(std::move(w), sess);
    }
    // What the client gets for the ring: a Token per draw (accepted drafts
    // marked speculated), the ring's own frame (timings, ring time) last; LOGITS_LAST rows split among them.
    std::vector<pb::Frame> out;
    const size_t width = tok->accepted_size() && !tok->logits().empty() ? tok->logits().size() / size_t(tok->accepted_size() + 1) : 0;
    for (size_t i = 0; i + 1 < used; ++i) {
        pb::Frame f;
        f.set_session_id(frame.session_id());
        f.set_epoch(frame.epoch());
        pb::Token * t = f.mutable_token();
        t->set_token_id(draws[i]);
        t->set_position(int32_t(first + int64_t(i)));
        t->set_speculated(true);
        if (width) t->set_logits(tok->logits().substr(i * width, width));
        if (int(i) < tok->logprobs_size()) *t->add_logprobs() = tok->logprobs(int(i));
        out.push_back(std::move(f));
    }
    tok->set_token_id(draws[used - 1]);
    tok->set_position(int32_t(first + int64_t(used) - 1));
    while (size_t(tok->accepted_size()) > used - 1) tok->mutable_accepted()->RemoveLast();
    if (width) tok->set_logits(tok->logits().substr((used - 1) * width, width));
    if (tok->logprobs_size() > 1 && int(used - 1) < tok->logprobs_size()) {   // this Token's own draw only
        pb::DrawLogprobs mine = tok->logprobs(int(used - 1));
        tok->clear_logprobs();
        *tok->add_logprobs() = std::move(mine);
    }
    out.push_back(std::move(frame));
    // detokenize on the engine thread once the next step's forward has started: text never delays the
    // ring, and the engine is never called from two threads
    const size_t n0 = n_ids - out.size();
    auto shared = std::make_shared<std::vector<pb::Frame>>(std::move(out));
    std::lock_guard<std::mutex> g(mu_);              // (in this lock's order with an error's: never overtaken)
    sched_.defer([this, sess, shared, n0, client, full_error] {
        for (size_t i = 0; i < shared->size(); ++i) send_token(sess, std::move((*shared)[i]), n0 + i + 1);
        if (full_error) client->put(std::move(*full_error));   // the context is full: after its last token
    });
}

// The origin's next step: the last token at `pos`, plus what the session's draft source proposes (k+1
// positions, verified by the last stage in the same ring). `after_drafts`: the step answered was
// speculative, so stages may hold rejected positions >= pos to drop. mu_ held.
pb::Frame Origin::next_step(Session & s, const std::string & sid, uint64_t epoch, int64_t pos, int32_t token, bool after_drafts) {
    std::vector<int32_t> drafts;
    if (s.origin.drafter) {
        const int64_t k = s.origin.gen.draft_room(int64_t(s.origin.draft_k), pos, int64_t(settings_.n_ctx));
        if (k > 0) {
            drafts = s.origin.drafter->propose(s.origin.gen.history, k);
            if (int64_t(drafts.size()) > k) drafts.resize(size_t(k));
        }
    }
    pb::Frame f;
    f.set_session_id(sid);
    f.set_epoch(epoch);
    f.set_origin_sent_ns(uint64_t(mono_ns()));
    pb::Step * st = f.mutable_step();
    for (int64_t p = pos; p < pos + 1 + int64_t(drafts.size()); ++p) st->add_positions(int32_t(p));
    st->add_token_ids(token);
    for (int32_t d : drafts) st->add_token_ids(d);
    st->set_cache_expect(uint64_t(pos));
    st->set_sample(true);
    st->set_drafts(uint32_t(drafts.size()));
    st->set_rollback(after_drafts);
    if (s.origin.drafter) st->set_mtp_drafts(s.origin.drafter->remote_k(int64_t(s.origin.draft_k)));
    return f;
}

// Starting speculation: a Generate that asks for drafts gets its session's draft source, if
// every hop of the route can roll back rejected drafts.
void Origin::start_speculation(const SessionPtr & sess, const pb::Generate & g) {
    if (g.draft_source().empty()) return;
    std::unique_ptr<DraftSource> drafter;
    uint32_t k;
    try {
        k = check_draft_k(g.draft_k() ? g.draft_k() : DEFAULT_DRAFT_K);
        drafter = make_draft_source(g.draft_source());
    } catch (const std::invalid_argument & e) {
        throw Fault{pb::BAD_FRAME, e.what()};
    }
    std::lock_guard<std::mutex> l(mu_);
    if (!sess->sampling.grammar().empty() || !sess->sampling.json_schema().empty()) {
        throw Fault{pb::ENGINE, "speculative decoding with a grammar (sampling.grammar or sampling.json_schema) is not "
                                "supported: generate without --speculate, or without the grammar"};
    }
    if (!sess->origin.can_roll_back) {
        throw Fault{pb::ENGINE, "speculative decoding needs every stage to drop rejected drafts from its cache, and " +
                                    (sess->origin.no_roll_back.empty() ? std::string("a hop of the route") : sess->origin.no_roll_back) +
                                    " cannot (a recurrent or hybrid model keeps one running state, or the worker predates "
                                    "speculation): generate without --speculate"};
    }
    if (g.draft_source() == "mtp" && !sess->origin.last_has_mtp) {
        throw Fault{pb::ENGINE, "--speculate mtp: the route's last stage " + (sess->origin.last_hop.empty() ? std::string("") : sess->origin.last_hop + " ") +
                                    "has no MTP block (or its engine cannot draft with one): MTP drafts come from the last stage of "
                                    "a bundle built with bundle.include_mtp = true (DeepSeek V4); use --speculate ngram or none"};
    }
    sess->origin.drafter = std::move(drafter);
    uint64_t cap = std::min<uint64_t>(k, sess->origin.spec_cap - 1);
    if (sess->origin.draft_max) cap = std::min<uint64_t>(cap, sess->origin.draft_max);   // what every hop can roll back
    sess->origin.draft_k = uint32_t(cap);
}

void Origin::note_route(Session & s, const google::protobuf::RepeatedPtrField<pb::StageDescription> & hops) {
    std::lock_guard<std::mutex> g(mu_);
    std::string no;
    uint64_t cap = 0;
    for (int i = 0; i < hops.size(); ++i) {
        const pb::StageDescription & h = hops.Get(i);
        const size_t at = size_t(s.hop_index) + size_t(i);
        const std::string address = at < s.route.size() ? s.route[at].address() : std::string();
        if (!h.can_roll_back()) no += (no.empty() ? "" : ", ") + hop_name(h.identity().stage_index(), address);
        if (h.has_schema_out() && h.seam_bytes_per_token()) {
            uint64_t t = tokens_per_frame(std::min<uint64_t>(h.max_message_bytes(), settings_.max_message_bytes), h.seam_bytes_per_token());
            cap = cap ? std::min(cap, t) : t;
        }
    }
    s.origin.can_roll_back = no.empty();
    s.origin.no_roll_back = no;
    s.origin.spec_cap = cap ? cap : MAX_DRAFT_K + 1;
    uint32_t dmax = 0;
    for (int i = 0; i < hops.size(); ++i) {
        const uint32_t d = hops.Get(i).n_draft_max();
        if (d) dmax = dmax ? std::min(dmax, d) : d;
    }
    s.origin.draft_max = dmax;
    if (hops.size()) {
        const int i = hops.size() - 1;
        const size_t at = size_t(s.hop_index) + size_t(i);
        s.origin.last_has_mtp = hops.Get(i).has_mtp();
        s.origin.last_hop = hop_name(hops.Get(i).identity().stage_index(), at < s.route.size() ? s.route[at].address() : std::string());
    }
}

void Origin::send_token(const SessionPtr & sess, pb::Frame frame, size_t n_ids) {
    pb::Token * tok = frame.mutable_token();
    std::string full;
    if (settings_.has_vocab) {
        std::vector<int32_t> ids;
        {
            std::lock_guard<std::mutex> g(mu_);
            ids.assign(sess->origin.gen.context_ids.begin(), sess->origin.gen.context_ids.begin() + long(std::min(n_ids, sess->origin.gen.context_ids.size())));
        }
        std::string buf(16 * ids.size() + 16, '\0');
        int32_t n;
        auto eg = engine_.lock();
        const int32_t dummy = 0;
        while (true) {
            n = eg.detokenize(ids.empty() ? &dummy : ids.data(), int32_t(ids.size()), &buf[0], int32_t(buf.size()));
            if (n < 0) throw std::runtime_error("detokenize: " + engine_.lib().error(DGR_E_ENGINE));
            if (size_t(n) <= buf.size()) break;
            buf.resize(size_t(n));
        }
        buf.resize(size_t(n));
        full = utf8_replace(buf);
    }
    static const std::string REPL = "\xEF\xBF\xBD";
    ReplyPtr client;
    {
        std::lock_guard<std::mutex> g(mu_);
        const bool unfinished = full.size() >= 3 && full.compare(full.size() - 3, 3, REPL) == 0;
        if (unfinished && !tok->done()) {
            tok->set_text("");                       // an unfinished UTF-8 sequence: wait for more
        } else {
            tok->set_text(full.substr(byte_offset(full, code_points(sess->origin.text))));
            sess->origin.text = full;
        }
        client = sess->origin.client;
    }
    if (client) client->put(std::move(frame));
}

void Origin::client_gone(const ReplyPtr & out) {
    // the client's stream ended: stop decoding for it and free its sessions along the route
    std::vector<std::pair<SessionKey, SessionPtr>> open;
    sessions_.for_each([&](const SessionKey & k, const SessionPtr & s) { open.emplace_back(k, s); });
    std::vector<SessionKey> orphans;
    {
        std::lock_guard<std::mutex> g(mu_);
        for (auto & [k, s] : open) {
            if (s->origin.client == out && !s->origin.gen.done) {
                s->origin.gen.failed = true;
                orphans.push_back(k);
            }
        }
    }
    for (auto & k : orphans) port_.close_route(k.first, k.second);
}

}  // namespace dgr
