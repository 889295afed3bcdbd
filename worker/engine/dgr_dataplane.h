// The native data plane: a stage's decode steps in C++, without Python on the way.
//
// The control plane (Python, gRPC: describe, open/close, prefill, the client's stream) registers each
// eligible session at every stage (dgr_dp_session); the origin then hands the session's decode to the
// plane (dgr_dp_decode) with the first token. From there every decode step goes round the ring here:
// stage 0 embeds the token, each stage runs its layers and writes the boundary straight to the next
// stage's plane over TCP, the last stage draws the token (dgr_sample) and writes it to the origin's plane,
// which counts it, queues the next step at once and hands the token to the control plane
// (dgr_dp_next_event) to stream to the client. Steps of different sessions queued together share one
// engine forward. Frame layout: proto/dgr/v1/native.md (tools/dgr/wire/native.py checks it).
#pragma once

#include "dgr_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DGR_DP_MAGIC    0x4E524744u  // "DGRN", little-endian: the first 4 bytes of every frame
#define DGR_DP_MAX_HOPS 64           // timings a frame carries (one per stage of the route)

enum dgr_dp_kind { DGR_DP_STEP = 1, DGR_DP_TOKEN = 2, DGR_DP_ERROR = 3 };

// What went wrong (an event's error_code; the control plane maps it to dgr.v1.ErrorCode).
enum dgr_dp_error {
    DGR_DP_E_UNREACHABLE   = 1, // a stage could not write to the next one (it died, refused, reset)
    DGR_DP_E_CACHE_MISS    = 2, // the step does not continue the session's cache there
    DGR_DP_E_ENGINE        = 3, // the engine refused or failed the step
    DGR_DP_E_UNKNOWN       = 4, // the session is not registered there (closed, reaped, never opened)
    DGR_DP_E_CONTEXT_FULL  = 5, // the next position is past n_ctx (position says which)
};

typedef struct dgr_dp dgr_dp;

typedef struct dgr_dp_hop {
    int32_t stage_index;
    int64_t queue_ns;     // waiting for the engine
    int64_t compute_ns;   // inside the engine forward
    int64_t wire_ns;      // frame build + write
    int64_t transit_ns;   // from the sender's write to this stage's read (wall clock)
} dgr_dp_hop;

typedef struct dgr_dp_event {
    char    session_id[128];
    int64_t epoch;
    int32_t kind;         // DGR_DP_TOKEN or DGR_DP_ERROR
    int32_t token_id;     // token: the last stage's draw
    int32_t position;     // token: the position it was drawn at; error: where it happened
    int32_t done;         // token: the last of the decode (a stop id or max_new reached)
    int32_t error_code;   // error: dgr_dp_error
    int32_t stage_index;  // error: the stage that reports it
    int64_t ring_ns;      // token: from queueing its step at the origin to its return
    int64_t return_ns;    // token: transit from the last stage (wall clock)
    int32_t n_hops;
    dgr_dp_hop hops[DGR_DP_MAX_HOPS];
    char    message[512]; // error: what was wrong
    int32_t n_logits;     // token: floats of its logits row (a session registered with logits), else 0
} dgr_dp_event;

// Listen on host:port (port 0 picks a free one) and serve decode steps through `eng` (the engine stays
// owned by the caller and must outlive the plane). `stage_index`: this stage's place in the route.
DGR_API int32_t dgr_dp_start(dgr_engine * eng, const char * host, int32_t port, int32_t stage_index,
                             dgr_dp ** out, int32_t * bound_port);
// Stop serving: close every socket, join every thread. Events not taken are dropped.
DGR_API void    dgr_dp_stop(dgr_dp * dp);
// A session this stage serves natively: `next` is HOST:PORT of the next stage's plane ("" on the last
// stage: its tokens go to the origin each frame names). The last stage: `logits` 1 sends the logits row
// each token was drawn from with it (parity runs), 0 none; the draw is dgr_sample's with the session's
// temperature (0: greedy), top_k, top_p and seed, keyed by each step's position.
DGR_API int32_t dgr_dp_session(dgr_dp * dp, const char * session_id, int64_t epoch, const char * next,
                               int32_t logits, double temperature, int32_t top_k, double top_p, uint64_t seed);
// Forget a session (closed): its queued steps are dropped, later frames for it answered UNKNOWN.
DGR_API int32_t dgr_dp_forget(dgr_dp * dp, const char * session_id, int64_t epoch);
// Origin: decode the session from (position, token) on, natively: at most `max_new` more tokens, ending
// at the first of `stop_ids`. The session must be registered here (dgr_dp_session).
DGR_API int32_t dgr_dp_decode(dgr_dp * dp, const char * session_id, int64_t epoch, int32_t position,
                              int32_t token, int32_t max_new, const int32_t * stop_ids, int32_t n_stop);
// Origin: the next event, waiting up to timeout_ms. 1: *out filled (and its logits row, up to `cap`
// floats, into `logits` when given); 0: none yet; -1: the plane stopped.
DGR_API int32_t dgr_dp_next_event(dgr_dp * dp, int32_t timeout_ms, dgr_dp_event * out, float * logits, int32_t cap);
// CLOCK_MONOTONIC ns of the session's last native step here (0: none): idle reaping counts it.
DGR_API int64_t dgr_dp_last_used(dgr_dp * dp, const char * session_id, int64_t epoch);
// How steps share forwards: at most `max_batch_sessions` sessions per forward (1: none shared; default
// 64), and, for tests that must force sharing, `hold_sessions` > 0 runs a forward only when steps of that
// many distinct sessions wait (or of every session registered here, when fewer are). Results do not
// depend on either (the engine is batch invariant); a hold only makes sharing certain instead of likely.
DGR_API int32_t dgr_dp_configure(dgr_dp * dp, int32_t max_batch_sessions, int32_t hold_sessions);
// Tests: the process kills itself (SIGKILL) when it is about to run the step of `session_id` at `epoch`
// and `position`: a kill -9 at an exact point of a generation, which no timing can move.
DGR_API int32_t dgr_dp_die_at(dgr_dp * dp, const char * session_id, int64_t epoch, int32_t position);
// Steps this plane has run, and engine forwards they took (batching: steps / forwards).
DGR_API void    dgr_dp_counts(dgr_dp * dp, int64_t * steps, int64_t * forwards);

// The last stage's draw from one logits row (dgr_sample.cpp; the same algorithm, operation for operation,
// as tools/dgr/wire/sampling.py): greedy when temperature <= 0, else temperature, top_k (0: off), top_p
// (0 or 1: off), the uniform keyed by (seed, position). Returns the token id, -1 on bad arguments.
DGR_API int32_t dgr_sample(const float * logits, int32_t n_vocab, double temperature, int32_t top_k, double top_p,
                           uint64_t seed, int64_t position);
// Its parts, for the cross-check against the Python sampler: e^d for d <= 0, and the uniform in [0, 1).
DGR_API double  dgr_exp_fixed(double d);
DGR_API double  dgr_uniform(uint64_t seed, int64_t position);

#ifdef __cplusplus
}
#endif
