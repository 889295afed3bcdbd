// The fake engine's sessions: open, close, cached positions, and dropping rejected drafts (truncate), which
// re-adds the kept inputs in order so the cache is bit for bit that of the shorter history.
#include "dgr_fake_internal.h"

#include <mutex>
#include <string>
#include <utility>
#include <vector>

using namespace dgr_fake;

extern "C" {

DGR_API int32_t dgr_session_open(dgr_engine * eng, const char * session_id, int64_t epoch) {
    return guarded([&] {
        if (!eng) throw Fail(DGR_E_ENGINE, "dgr_session_open: NULL engine");
        std::lock_guard<std::mutex> g(eng->mu);
        const std::string sid = str(session_id);
        if (eng->sessions.count({sid, epoch})) {
            throw Fail(DGR_E_ENGINE, "session " + sid + " epoch " + std::to_string(epoch) + " is already open");
        }
        if (int64_t(eng->sessions.size()) >= eng->spec.sessions) {
            throw Fail(DGR_E_ENGINE, "all " + std::to_string(eng->spec.sessions) + " sessions are in use; close one first");
        }
        Session s;
        s.sums.assign(size_t(eng->end - eng->begin), std::vector<double>(size_t(eng->d), 0.0));
        s.inputs.assign(size_t(eng->end - eng->begin), std::vector<float>());
        eng->sessions.emplace(std::make_pair(sid, epoch), std::move(s));
        return DGR_OK;
    });
}

DGR_API int32_t dgr_session_close(dgr_engine * eng, const char * session_id, int64_t epoch) {
    return guarded([&] {
        if (!eng) throw Fail(DGR_E_ENGINE, "dgr_session_close: NULL engine");
        std::lock_guard<std::mutex> g(eng->mu);
        eng->sessions.erase({str(session_id), epoch});
        return DGR_OK;
    });
}

DGR_API int32_t dgr_session_n_cached(dgr_engine * eng, const char * session_id, int64_t epoch, int32_t * out) {
    return guarded([&] {
        if (!eng || !out) throw Fail(DGR_E_ENGINE, "dgr_session_n_cached: NULL argument");
        std::lock_guard<std::mutex> g(eng->mu);
        *out = eng->session(str(session_id), epoch).n;
        return DGR_OK;
    });
}

DGR_API int32_t dgr_engine_can_truncate(dgr_engine * eng) { return eng && !eng->spec.recurrent ? 1 : 0; }

// The sums become those of the first n_keep inputs, added in the order the forward added them: bit for
// bit the cache of the shorter history.
DGR_API int32_t dgr_session_truncate(dgr_engine * eng, const char * session_id, int64_t epoch, int32_t n_keep) {
    return guarded([&] {
        if (!eng) throw Fail(DGR_E_ENGINE, "dgr_session_truncate: NULL engine");
        std::lock_guard<std::mutex> g(eng->mu);
        const std::string sid = str(session_id);
        Session & s = eng->session(sid, epoch);
        if (n_keep < 0 || n_keep > s.n) {
            throw Fail(DGR_E_ENGINE, "session " + sid + " epoch " + std::to_string(epoch) + " holds " + std::to_string(s.n) +
                                         " positions: cannot keep " + std::to_string(n_keep));
        }
        if (n_keep == s.n) return DGR_OK;
        if (eng->spec.recurrent) {
            throw Fail(DGR_E_UNSUPPORTED, "fake recurrent model: its state cannot drop positions (only the latest state "
                                          "is kept), so speculative decoding is not possible; generate without --speculate");
        }
        const size_t d = size_t(eng->d);
        for (size_t li = 0; li < s.sums.size(); ++li) {
            s.inputs[li].resize(size_t(n_keep) * d);
            std::vector<double> sum(d, 0.0);
            for (int32_t p = 0; p < n_keep; ++p) {
                const float * h = s.inputs[li].data() + size_t(p) * d;
                for (size_t j = 0; j < d; ++j) sum[j] += double(h[j]);
            }
            s.sums[li] = std::move(sum);
        }
        s.n = n_keep;
        return DGR_OK;
    });
}

}  // extern "C"
