// dgr-worker's engine parts bound to the engine library it loaded: the engine under its lock and the stage's
// vocabulary over it. The worker holds them; the handlers that use them (rpc/) name them from here, not from
// worker.h.
#pragma once

#include "engine_lib.h"
#include "engine_loop/locked_engine.h"
#include "engine_loop/vocabulary.h"

namespace dgr {

using StageEngine = LockedEngine<EngineLib, dgr_engine>;
using StageVocabulary = Vocabulary<EngineLib, dgr_engine>;

}  // namespace dgr
