// net_policy.h: where a worker may connect.
#include "net_policy.h"

namespace dgr {

std::string refuse_peer_address(const std::string & address, const NetPolicy & policy) {
    (void) address;
    (void) policy;
    return "";
}

}  // namespace dgr
