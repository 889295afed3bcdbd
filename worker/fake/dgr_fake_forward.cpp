// The fake engine's dgr_forward: every step checked before any cache changes (all or nothing), then each
// token through the owned layers, and the boundary rows or the head's logits.
#include "dgr_fake_internal.h"

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

using namespace dgr_fake;

extern "C" {

// Every step is checked (and the memory it needs reserved) before any cache changes: all or nothing.
DGR_API int32_t dgr_forward(dgr_engine * eng, int32_t n_steps, const dgr_step * steps, dgr_step_out * outs) {
    return guarded([&] {
        if (!eng) throw Fail(DGR_E_ENGINE, "dgr_forward: NULL engine");
        if (n_steps <= 0 || !steps || !outs) throw Fail(DGR_E_ENGINE, "forward needs at least one step");
        std::lock_guard<std::mutex> g(eng->mu);
        const int64_t d = eng->d, V = eng->spec.vocab;
        const std::string where = eng->where();
        std::vector<Session *> sess(static_cast<size_t>(n_steps));
        for (int32_t k = 0; k < n_steps; ++k) {
            const dgr_step & st = steps[k];
            const std::string sid = str(st.session_id);
            for (int32_t j = 0; j < k; ++j) {
                if (str(steps[j].session_id) == sid && steps[j].epoch == st.epoch) {
                    throw Fail(DGR_E_ENGINE, "one batch holds at most one step per session");
                }
            }
            Session & s = eng->session(sid, st.epoch);
            const int32_t n = st.n_tokens;
            if (n <= 0 || !st.positions) throw Fail(DGR_E_ENGINE, "a step needs at least one position");
            const int32_t p0 = st.positions[0];
            if (p0 != s.n) {
                g_miss_held = s.n;
                g_miss_expected = p0;
                throw Fail(DGR_E_CACHE_MISS, "session " + sid + " epoch " + std::to_string(st.epoch) + " holds " +
                                                 std::to_string(s.n) + " positions on " + where + " but the step starts at " +
                                                 std::to_string(p0) + ": re-prefill at a new epoch");
            }
            for (int32_t t = 1; t < n; ++t) {
                if (st.positions[t] != p0 + t) throw Fail(DGR_E_ENGINE, "positions must be contiguous and increasing");
            }
            if (int64_t(p0) + n - 1 >= eng->spec.ctx) {
                throw Fail(DGR_E_ENGINE, "position " + std::to_string(int64_t(p0) + n - 1) + " is beyond the context of " +
                                             std::to_string(eng->spec.ctx));
            }
            if ((eng->first || eng->needs_ids) && !st.token_ids) {
                throw Fail(DGR_E_SCHEMA, where + " need " + std::to_string(n) + " token ids with the step (got None)");
            }
            if (st.token_ids) {
                for (int32_t t = 0; t < n; ++t) {
                    if (st.token_ids[t] < 0 || st.token_ids[t] >= V) {
                        throw Fail(DGR_E_ENGINE, "token id out of range [0, " + std::to_string(V) + ")");
                    }
                }
            }
            if (!eng->first && (!st.boundary || st.boundary_width != d)) {
                std::string got = !st.boundary ? "None" : "float32[" + std::to_string(n) + " x " + std::to_string(st.boundary_width) + "]";
                throw Fail(DGR_E_SCHEMA, where + " take a float32 boundary [" + std::to_string(n) + ", " +
                                             std::to_string(eng->spec.streams) + ", " + std::to_string(eng->spec.embd) +
                                             "], got " + got);
            }
            if (st.want_logits < DGR_LOGITS_NONE || st.want_logits > DGR_LOGITS_ALL) {
                throw Fail(DGR_E_ENGINE, "want_logits must be 0 (none), 1 (last) or 2 (all), got " + std::to_string(st.want_logits));
            }
            if (eng->last ? (st.want_logits != DGR_LOGITS_NONE && !outs[k].logits) : !outs[k].boundary) {
                throw Fail(DGR_E_ENGINE, std::string("step ") + std::to_string(k) + ": no output buffer for its " +
                                             (eng->last ? "logits" : "boundary"));
            }
            for (auto & in : s.inputs) in.reserve(in.size() + size_t(n) * size_t(d));
            sess[size_t(k)] = &s;
        }
        for (int32_t k = 0; k < n_steps; ++k) {
            const dgr_step & st = steps[k];
            dgr_step_out & o = outs[k];
            Session & s = *sess[size_t(k)];
            const int32_t n = st.n_tokens;
            std::vector<float> x(size_t(n) * size_t(d));
            for (int32_t t = 0; t < n; ++t) {
                float * h = x.data() + size_t(t) * size_t(d);
                if (eng->first) std::copy_n(eng->embed.data() + int64_t(st.token_ids[t]) * d, d, h);
                else std::copy_n(st.boundary + size_t(t) * size_t(d), d, h);
                eng->token(s, h, s.n + t, st.token_ids ? st.token_ids[t] : -1);
            }
            s.n += n;
            o.n_cached = s.n;
            o.n_logit_rows = 0;
            o.next_token = -1;
            if (!eng->last) {
                std::copy(x.begin(), x.end(), o.boundary);
                continue;
            }
            std::vector<float> row(static_cast<size_t>(V));
            const int32_t first_row = st.want_logits == DGR_LOGITS_ALL ? 0 : n - 1;
            if (st.want_logits != DGR_LOGITS_NONE) {
                for (int32_t t = first_row; t < n; ++t) eng->logits(x.data() + size_t(t) * size_t(d), o.logits + size_t(t - first_row) * size_t(V));
                o.n_logit_rows = n - first_row;
                std::copy_n(o.logits + size_t(n - 1 - first_row) * size_t(V), V, row.data());
            } else {
                eng->logits(x.data() + size_t(n - 1) * size_t(d), row.data());
            }
            o.next_token = int32_t(std::max_element(row.begin(), row.end()) - row.begin());
        }
        return DGR_OK;
    });
}

}  // extern "C"
