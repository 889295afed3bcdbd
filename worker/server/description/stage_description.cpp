// The stage's description as dgr.v1.StageDescription (description/stage_description.h).
#include "description/stage_description.h"

#include <algorithm>

#include "wire/wire_common.h"

namespace dgr {

namespace pb = dgr::v1;

void describe_msg(const StageCard & c, const StageLoad & l, pb::StageDescription * d) {
    const StageIdentity & id = c.id;
    auto * idn = d->mutable_identity();
    idn->set_model(id.model);
    idn->set_bundle_id(id.bundle_id);
    idn->set_stage_index(uint32_t(id.stage_index));
    idn->set_stage_count(uint32_t(id.stage_count));
    idn->set_layer_begin(uint32_t(c.layer_begin));
    idn->set_layer_end(uint32_t(c.layer_end));
    idn->set_n_layer(uint32_t(c.n_layer));
    idn->set_upstream_commit(id.upstream_commit);
    idn->set_patch_series(id.patch_series);
    idn->set_lane(id.lane);
    idn->set_arch(c.arch);
    idn->set_numerics(id.numerics);
    d->set_is_first(c.is_first);
    d->set_is_last(c.is_last);
    d->set_has_vocab(c.has_vocab);
    d->set_n_vocab(uint32_t(c.n_vocab));
    d->set_n_ctx(uint32_t(c.n_ctx));
    d->set_max_sessions(uint32_t(c.max_sessions));
    d->set_max_message_bytes(c.max_message_bytes);
    d->set_engine(id.engine);
    for (int32_t t : id.eos_token_ids) d->add_eos_token_ids(uint32_t(t));
    d->set_chat_template(id.chat_template);
    d->set_session_ttl_s(float(c.session_ttl_s));
    d->set_max_queued_steps(uint32_t(c.max_queued_steps));
    d->set_can_roll_back(c.can_roll_back);
    d->set_has_mtp(c.has_mtp);
    d->set_n_draft_max(uint32_t(std::max(0, c.n_draft_max)));
    d->set_batch_invariant(c.batch_invariant);
    d->set_matmul_kernels(c.matmul_kernels);
    d->set_prefix_cache_off(c.prefix_cache_off);
    if (l.prefix) {
        const PrefixCache::Stats & ps = *l.prefix;
        d->set_prefix_cache_capacity_bytes(ps.capacity);
        d->set_prefix_cache_bytes(ps.bytes);
        d->set_prefix_cache_entries(ps.entries);
        d->set_prefix_cache_hits(ps.hits);
        d->set_prefix_cache_lookups(ps.lookups);
    }
    d->set_tls(c.tls);
    d->set_mutual_tls(c.mutual_tls);
    d->set_member(c.member);
    d->set_open_sessions(uint32_t(l.open_sessions));
    d->set_reaped_sessions(l.reaped_sessions);
    d->set_overloaded(l.overloaded);
    d->set_queued_steps(uint32_t(l.queued_steps));
    d->set_max_frame_bytes_sent(l.max_frame_bytes_sent);
    d->set_cached_positions(l.cached_positions);
    const uint32_t width = uint32_t(c.n_streams) * uint32_t(c.n_embd);
    if (!c.is_first) {
        auto * s = d->mutable_schema_in();
        s->set_n_streams(uint32_t(c.n_streams));
        s->set_n_embd(uint32_t(c.n_embd));
        s->set_dtype(dtype_code(c.dtype));
        s->set_token_ids(c.needs_token_ids);
        s->set_bundle_id(id.bundle_id);
        s->set_layer(uint32_t(c.layer_begin));
    }
    if (!c.is_last) {
        // token ids always travel with the boundary: any later stage that needs them has them
        auto * s = d->mutable_schema_out();
        s->set_n_streams(uint32_t(c.n_streams));
        s->set_n_embd(uint32_t(c.n_embd));
        s->set_dtype(dtype_code(c.dtype));
        s->set_token_ids(true);
        s->set_bundle_id(id.bundle_id);
        s->set_layer(uint32_t(c.layer_end));
        d->set_seam_bytes_per_token(nbytes(c.dtype, width));
    }
}

}  // namespace dgr
