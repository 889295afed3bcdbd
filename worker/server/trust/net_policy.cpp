// trust/net_policy.h: where a worker may connect.
//
// A route's addresses come from whoever opens a session (a member of the mesh, not trusted: docs/security.md). gRPC
// reads a target string as a URI: "unix:/run/x", "unix-abstract:x", "vsock:2:80", "ipv4:10.0.0.1:80" or
// even "dns:80" would reach what the route's owner chose, not a TCP peer; so only a plain HOST:PORT passes.
// Refusals name the address and the rule and say what to give instead; nothing here connects, so no answer
// depends on whether something listens there.
#include "trust/net_policy.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <stdexcept>

namespace dgr {

namespace {

constexpr size_t MAX_ADDRESS = 255;

// gRPC's resolver and address schemes (1.51 and later): "NAME:PORT" with one of these as NAME is read as
// that scheme, not as a host called NAME
const char * const SCHEMES[] = {"dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock", "xds", "google-c2p",
                                "google-c2p-experimental", "c2p", "fake", "sockaddr", "binder", "http", "https"};

struct Net {
    int family = 0;                                  // AF_INET or AF_INET6
    unsigned char a[16] = {0};
    int bits = 0;
};

// an IPv4-mapped IPv6 address (::ffff:a.b.c.d) is the IPv4 address for every check
void unmap(int & family, unsigned char * a) {
    static const unsigned char prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (family == AF_INET6 && std::memcmp(a, prefix, 12) == 0) {
        std::memmove(a, a + 12, 4);
        std::memset(a + 4, 0, 12);
        family = AF_INET;
    }
}

bool inside(const Net & n, int family, const unsigned char * a) {
    if (family != n.family) return false;
    int full = n.bits / 8, rest = n.bits % 8;
    if (std::memcmp(n.a, a, size_t(full)) != 0) return false;
    if (rest == 0) return true;
    unsigned char mask = static_cast<unsigned char>(0xff << (8 - rest));
    return (n.a[full] & mask) == (a[full] & mask);
}

Net parse_net(const std::string & entry) {
    auto bad = [&](const std::string & why) {
        return std::invalid_argument("--peer-allow: '" + entry + "' " + why +
                                     ": give networks as CIDR,CIDR,... (10.0.0.0/8, 192.168.1.7, fd00::/8, ::1/128)");
    };
    Net n;
    auto slash = entry.find('/');
    std::string host = entry.substr(0, slash);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    if (inet_pton(AF_INET, host.c_str(), n.a) == 1) n.family = AF_INET, n.bits = 32;
    else if (inet_pton(AF_INET6, host.c_str(), n.a) == 1) n.family = AF_INET6, n.bits = 128;
    else throw bad("is not an IPv4 or IPv6 network");
    if (slash != std::string::npos) {
        std::string b = entry.substr(slash + 1);
        if (b.empty() || b.size() > 3 || b.find_first_not_of("0123456789") != std::string::npos || std::stoi(b) > n.bits) {
            throw bad("has a bad prefix length (0-" + std::to_string(n.bits) + ")");
        }
        n.bits = std::stoi(b);
    }
    // ::ffff:a.b.c.d/120 is a.b.c.d/24; under /96 the ffff is host bits, refused below as an IPv6 network
    if (n.family == AF_INET6 && n.bits >= 96) {
        unmap(n.family, n.a);
        if (n.family == AF_INET) n.bits -= 96;
    }
    // the host bits must be zero (10.0.0.1/8 is a typo for one address or for 10.0.0.0/8: say which)
    Net zero = n;
    for (int i = 0; i < 16; ++i) {
        int keep = std::max(0, std::min(8, n.bits - 8 * i));
        zero.a[i] = static_cast<unsigned char>(n.a[i] & (keep == 0 ? 0 : (0xff << (8 - keep)) & 0xff));
    }
    if (std::memcmp(zero.a, n.a, 16) != 0) throw bad("has host bits set");
    return n;
}

std::vector<Net> nets(const NetPolicy & p) {
    std::vector<Net> out;
    for (auto & e : p.peer_allow) out.push_back(parse_net(e));
    return out;
}

std::string joined(const NetPolicy & p) {
    std::string s;
    for (auto & e : p.peer_allow) s += (s.empty() ? "" : ",") + e;
    return s;
}

bool name_char(char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.';
}

// a DNS name: labels of letters, digits and '-', not starting or ending with '-', 1-63 each; one trailing '.'
bool dns_name(const std::string & h) {
    std::string n = h.size() > 1 && h.back() == '.' ? h.substr(0, h.size() - 1) : h;
    size_t start = 0;
    while (true) {
        size_t dot = n.find('.', start);
        std::string label = n.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
        if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') return false;
        for (char c : label) {
            if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-')) return false;
        }
        if (dot == std::string::npos) return true;
        start = dot + 1;
    }
}

}  // namespace

NetPolicy parse_peer_allow(const std::string & value) {
    NetPolicy p;
    size_t start = 0;
    while (start <= value.size()) {
        size_t comma = value.find(',', start);
        std::string e = value.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        while (!e.empty() && std::isspace(static_cast<unsigned char>(e.front()))) e.erase(0, 1);
        while (!e.empty() && std::isspace(static_cast<unsigned char>(e.back()))) e.pop_back();
        if (e.empty()) {
            throw std::invalid_argument("--peer-allow '" + value + "': an empty entry: give networks as CIDR,CIDR,... "
                                        "(10.0.0.0/8, 192.168.1.7, fd00::/8, ::1/128)");
        }
        parse_net(e);                                // its one-line refusal
        p.peer_allow.push_back(e);
        if (comma == std::string::npos) break;
        start = comma + 1;
    }
    return p;
}

std::string refuse_peer_address(const std::string & address, const NetPolicy & policy) {
    const std::string fix = "give the peer's HOST:PORT (an IPv4 address, [IPv6] or a DNS name, and a port 1-65535)";
    // the address as it may be quoted back: never its control characters, never more than 255 of them
    std::string shown;
    for (char c : address.substr(0, MAX_ADDRESS)) {
        unsigned char u = static_cast<unsigned char>(c);
        shown += (u < 0x20 || u == 0x7f) ? '?' : c;
    }
    if (address.size() > MAX_ADDRESS) shown += "...";
    auto refuse = [&](const std::string & rule, const std::string & what = "") {
        return "this worker does not connect to peer address '" + shown + "': " + rule + "; " + (what.empty() ? fix : what);
    };
    if (address.empty()) return refuse("it is empty");
    if (address.size() > MAX_ADDRESS) return refuse("it is longer than " + std::to_string(MAX_ADDRESS) + " characters");
    for (char c : address) {
        unsigned char u = static_cast<unsigned char>(c);
        if (u < 0x20 || u == 0x7f) return refuse("it holds control characters");
        if (u >= 0x80) return refuse("it holds characters outside ASCII (give an IDN name in its xn-- form)");
    }
    if (address.find("://") != std::string::npos || address.find(":/") != std::string::npos) {
        return refuse("peers are reached over TCP only, never by a gRPC target with a scheme (unix:, dns:, ipv4:, "
                      "vsock:, ...)");
    }
    std::string host, port;
    if (address.front() == '[') {
        auto close = address.find(']');
        if (close == std::string::npos) return refuse("an IPv6 address opened with '[' is not closed with ']'");
        host = address.substr(1, close - 1);
        if (close + 1 >= address.size() || address[close + 1] != ':') return refuse("it has no :PORT after the IPv6 address");
        port = address.substr(close + 2);
        in6_addr a6;
        if (host.empty() || inet_pton(AF_INET6, host.c_str(), &a6) != 1) {
            return refuse("'[" + host + "]' is not an IPv6 address");
        }
    } else {
        auto colon = address.rfind(':');
        if (colon == std::string::npos) return refuse("it has no :PORT");
        host = address.substr(0, colon);
        port = address.substr(colon + 1);
        if (host.find(':') != std::string::npos) {
            // "unix:x:1", "vsock:2:80", or an IPv6 address without its brackets
            in6_addr a6;
            const bool numeric_port = !port.empty() && port.find_first_not_of("0123456789") == std::string::npos;
            if (numeric_port && inet_pton(AF_INET6, host.c_str(), &a6) == 1) {
                return refuse("an IPv6 address goes in brackets", "give [" + host + "]:" + port);
            }
            // "::1", "fd00::1", "::ffff:10.0.0.1": an IPv6 address alone, not a scheme
            if (inet_pton(AF_INET6, address.c_str(), &a6) == 1) {
                return refuse("an IPv6 address goes in brackets, with a :PORT after it", "give [" + address + "]:PORT");
            }
            return refuse("peers are reached over TCP only, never by a gRPC target with a scheme (unix:, dns:, "
                          "ipv4:, vsock:, ...)");
        }
        if (host.empty()) return refuse("its host is empty");
        for (char c : host) {
            if (!name_char(c)) return refuse("its host holds '" + std::string(1, c) + "' (a host is an IPv4 address or a DNS name)");
        }
        std::string lower;
        for (char c : host) lower += char(std::tolower(static_cast<unsigned char>(c)));
        for (const char * s : SCHEMES) {
            if (lower == s) {
                return refuse("'" + host + ":' is a gRPC target scheme, not a host name: peers are reached over TCP only");
            }
        }
        if (host.find_first_not_of("0123456789.") == std::string::npos) {
            in_addr a4;
            if (inet_pton(AF_INET, host.c_str(), &a4) != 1) return refuse("'" + host + "' is not an IPv4 address (give a.b.c.d)");
        } else if (!dns_name(host)) {
            return refuse("'" + host + "' is not a DNS name (labels of letters, digits and '-', 1-63 characters each)");
        }
    }
    if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos) {
        return refuse("its port '" + port + "' is not a number 1-65535");
    }
    const long p = std::stol(port);
    if (p < 1 || p > 65535) return refuse("its port " + port + " is not in 1-65535");
    if (policy.peer_allow.empty()) return "";

    // --peer-allow: every address it stands for inside one of the networks
    const std::vector<Net> allowed = nets(policy);
    const std::string widen = "give an address inside --peer-allow " + joined(policy) + ", or widen --peer-allow on this worker";
    auto allowed_addr = [&](int family, const void * bytes) {
        unsigned char a[16] = {0};
        std::memcpy(a, bytes, family == AF_INET ? 4 : 16);
        unmap(family, a);
        for (auto & n : allowed) {
            if (inside(n, family, a)) return true;
        }
        return false;
    };
    unsigned char buf[16];
    if (inet_pton(AF_INET, host.c_str(), buf) == 1) {
        return allowed_addr(AF_INET, buf) ? "" : refuse("it is outside --peer-allow", widen);
    }
    if (inet_pton(AF_INET6, host.c_str(), buf) == 1) {
        return allowed_addr(AF_INET6, buf) ? "" : refuse("it is outside --peer-allow", widen);
    }
    addrinfo hints{}, * res = nullptr;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || !res) {
        return refuse("its name does not resolve here, and under --peer-allow a name must resolve to addresses inside it",
                      "give an address inside --peer-allow " + joined(policy));
    }
    bool ok = true;
    for (addrinfo * a = res; a && ok; a = a->ai_next) {
        if (a->ai_family == AF_INET) ok = allowed_addr(AF_INET, &reinterpret_cast<sockaddr_in *>(a->ai_addr)->sin_addr);
        else if (a->ai_family == AF_INET6) ok = allowed_addr(AF_INET6, &reinterpret_cast<sockaddr_in6 *>(a->ai_addr)->sin6_addr);
        else ok = false;
    }
    freeaddrinfo(res);
    return ok ? "" : refuse("its name resolves to an address outside --peer-allow (every address it resolves to must be inside)", widen);
}

}  // namespace dgr
