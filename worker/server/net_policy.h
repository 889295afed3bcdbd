// Where a worker may connect (issue 35, docs/security.md): outgoing links and chained calls go only to
// TCP HOST:PORT addresses (no unix: or other gRPC target schemes), inside --peer-allow where an operator
// fixed the mesh's address space, and errors about them never say whether a port was open.
#pragma once

#include <string>
#include <vector>

namespace dgr {

struct NetPolicy {
    // --peer-allow CIDR,...: the networks peers may be in (empty: anywhere)
    std::vector<std::string> peer_allow;
};

// "" when the worker may connect to `address`, else why not: one line for the route's owner, naming the
// address and the rule (never the result of trying it).
std::string refuse_peer_address(const std::string & address, const NetPolicy & policy);

}  // namespace dgr
