// One open session on this worker, by role: what every stage keeps of it, what only its origin (stage 0)
// keeps (the client, generation control, drafts), and what only the route's last stage keeps (the grammar,
// whether it told the origin its stream broke). A value with no lock of its own: the session table
// (sessions/session_table.h) holds it; `origin` is the origin part's (origin/origin.h: under its lock),
// `last.told_origin` the ring's outgoing side's (relay/ring_out.h: an atomic), `steps` has its own lock, the engine
// thread alone uses `last.grammar`, and the rest is fixed once the session is open, but for `senders` (the
// frames' checks: docs/worker.md "Locks and their order").
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dgr/v1/stage.pb.h"
#include "engine_lib.h"
#include "frame_queue.h"
#include "ring/generation.h"
#include "speculation/drafts.h"
#include "sessions/step_record.h"
#include "trust/senders.h"

namespace dgr {

// Stage 0 only: the client's stream, what the session may make, and how it speculates.
struct OriginRole {
    ReplyPtr client;                                 // the client's reply stream
    Generation gen;                                  // what it may make, has made and has run (ring/generation.h)
    std::string text;                                // the generated tokens' text as the client has it
    // speculation: the draft source and its k (drafts are looked up in gen.history), whether every hop can roll
    // back (and why not), the positions a step may carry unsplit
    std::unique_ptr<DraftSource> drafter;
    uint32_t draft_k = 0;
    bool can_roll_back = false;
    std::string no_roll_back;
    uint64_t spec_cap = MAX_DRAFT_K + 1;
    // MTP: the route's last stage drafts with its MTP block (StageDescription.has_mtp); the most drafts a step may
    // carry and still roll back at every hop (the least StageDescription.n_draft_max; 0: no limit)
    bool last_has_mtp = false;
    uint32_t draft_max = 0;
    std::string last_hop;                            // its name, for errors
};

// The route's last stage only.
struct LastStageRole {
    // Sampling.grammar / json_schema: llama.cpp's grammar sampler, advanced over every token drawn (used on the
    // engine thread only; closed with the session)
    std::shared_ptr<dgr_grammar> grammar;
    std::atomic<bool> told_origin{false};            // its stream back to the origin broke (told once)
};

struct Session {
    std::string sid;                                 // this worker's key for it (sessions/names.h: key)
    std::vector<dgr::v1::Hop> route;
    uint32_t hop_index = 0;
    dgr::v1::Sampling sampling;
    int logits = 0;                                  // dgr::v1::LogitsMode
    std::string prefix_seed;                         // the prefix cache: what its state depends on (prefix_seed())
    std::string prefix_owner;                        // the prefix cache: whose entries it may use and leave
    // the id the route's later hops and its origin know it by (stage 0 draws one per session under mTLS:
    // unguessable, so no member off the route can name it there; later stages pass on what they got)
    std::string wire_down;
    // what its steps left here: the positions held, stage 0's record of the tokens it ran, where a rollback may
    // start (sessions/step_record.h: its own lock)
    StepRecord steps;
    Senders senders;                                 // mutual TLS (check_sender): who may send its frames here (its own lock)
    OriginRole origin;                               // stage 0
    LastStageRole last;                              // the last stage
};

using SessionKey = std::pair<std::string, uint64_t>;  // (this worker's key, epoch)
using SessionPtr = std::shared_ptr<Session>;

}  // namespace dgr
