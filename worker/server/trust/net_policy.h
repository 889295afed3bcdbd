// Where a worker may connect (docs/security.md): outgoing links and chained calls go only to
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
//
// An address is HOST:PORT: HOST an IPv4 address (a.b.c.d), an IPv6 address in brackets ([::1]) or a DNS
// name (letters, digits, '-' and '.'; not one of gRPC's target schemes: unix, dns, ipv4, ...), PORT 1-65535;
// at most 255 characters, no control characters. Under --peer-allow an address must lie inside one of the
// networks, and a name must resolve (getaddrinfo, here and now) only to addresses inside them.
std::string refuse_peer_address(const std::string & address, const NetPolicy & policy);

// --peer-allow's value, "CIDR,CIDR,..." (IPv4 a.b.c.d/n, IPv6 x:y::z/n; a bare address is /32 or /128): the
// policy, or std::invalid_argument with one line naming the bad entry.
NetPolicy parse_peer_allow(const std::string & value);

}  // namespace dgr
