// Steps into the scheduler (engine_loop/scheduler.h): a refused step is answered OVERLOADED with the bound that
// refused it. The scheduler hands each batch to the engine thread's work (engine_run/engine_run.h).
#include <grpcpp/grpcpp.h>

#include <cstdio>

#include "data_path.h"
#include "frames/frame_intake.h"

namespace dgr {

namespace pb = dgr::v1;

thread_local bool t_reads_frames = false;

void FrameIntake::enqueue(Work w, const SessionPtr & sess, bool own) {
    const Key key{w.frame.session_id(), w.frame.epoch()};
    using Refused = StepScheduler<Key, Work>::Refused;
    const int64_t positions = w.frame.step().positions_size();
    // a reader of frames (t_reads_frames) runs a lone decode step itself when the engine is idle
    const auto pushed = sched_.push(key, names_.owner_of(key.first), std::move(w), positions, own, t_reads_frames);
    std::string why;
    switch (pushed.refused) {
        case Refused::none:
            return;
        case Refused::worker_full:
            why = std::to_string(pushed.queued) + " steps are queued (--max-queued-steps " + std::to_string(set_.max_queued_steps) + ")";
            break;
        case Refused::member_full: {
            const int64_t cap = set_.max_queued_steps_per_member;
            why = "this member has " + std::to_string(cap) + " steps queued here (--max-queued-steps-per-member " +
                  std::to_string(cap) + ")";
            break;
        }
        case Refused::session_full:               // (--session-ttl counts steps run, not steps asked for)
            why = "session " + names_.wire_of(key.first) + " has " + std::to_string(pushed.queued) + " steps queued (--max-session-steps " +
                  std::to_string(set_.max_session_steps) + ")";
            break;
    }
    metrics_.count_overloaded();
    reply_error(w.reply, w.frame, err(pb::OVERLOADED, why + ": retry later", pushed.retry_after_ms));
}

}  // namespace dgr
