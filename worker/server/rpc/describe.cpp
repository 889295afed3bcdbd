// Describe (rpc/describe.h): the card and a snapshot of the load into dgr.v1.StageDescription
// (description/stage_description.h), the descriptor JSON (metrics/description.h's) beside them.
#include "rpc/describe.h"

#include <cstdio>
#include <exception>

#include "description/stage_description.h"
#include "rpc/guarded.h"

namespace dgr {

namespace pb = dgr::v1;

grpc::Status describe_rpc(const StageCard & card, const std::function<StageLoad()> & load, pb::StageDescription * d) {
    return guarded("Describe", [&] {
        const StageLoad l = load();
        describe_msg(card, l, d);
        try {                                        // a liveness probe never fails on the descriptor
            d->set_descriptor_json(descriptor_json(card, l));
        } catch (const std::exception & e) {
            fprintf(stderr, "dgr-worker: could not build the descriptor: %s\n", e.what());
        }
        return grpc::Status::OK;
    });
}

}  // namespace dgr
