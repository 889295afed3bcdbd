// Where a worker may connect (net_policy.h) alone: the peer addresses it admits (TCP HOST:PORT only), the
// one-line refusals a route's owner reads, --peer-allow's networks (what parses, what is refused and how) and
// which addresses lie inside them, literal or a name resolved here. No gRPC, no engine, no network: the only
// name looked up is `localhost`. `bazel test //worker/server:net_policy_test`, or the CMake target
// dgr-unit-net_policy_test (tests/worker/test_worker_units.py builds and runs it).
#include "unit_check.h"
#include "trust/net_policy.h"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using dgr::NetPolicy;
using dgr::parse_peer_allow;
using dgr::refuse_peer_address;

const std::string TCP = "give the peer's HOST:PORT (an IPv4 address, [IPv6] or a DNS name, and a port 1-65535)";
const std::string SCHEME =
    "peers are reached over TCP only, never by a gRPC target with a scheme (unix:, dns:, ipv4:, vsock:, ...)";
const std::string NETWORKS = "give networks as CIDR,CIDR,... (10.0.0.0/8, 192.168.1.7, fd00::/8, ::1/128)";

bool contains(const std::string & s, const std::string & part) { return s.find(part) != std::string::npos; }

// the verdict under `allow` (--peer-allow's value; "" for none)
std::string verdict(const std::string & address, const std::string & allow = "") {
    return refuse_peer_address(address, allow.empty() ? NetPolicy{} : parse_peer_allow(allow));
}

bool admitted(const std::string & address, const std::string & allow = "") {
    const std::string why = verdict(address, allow);
    if (!why.empty()) std::fprintf(stderr, "  '%s' under '%s' refused: %s\n", address.c_str(), allow.c_str(), why.c_str());
    return why.empty();
}

// refused with one line that quotes the address as `shown`, then the rule, then `fix`
bool refused_as(const std::string & address, const std::string & rule, const std::string & fix = TCP,
                const std::string & allow = "", const std::string & shown = "") {
    const std::string why = verdict(address, allow);
    const std::string want = "this worker does not connect to peer address '" + (shown.empty() ? address : shown) +
                             "': " + rule + "; " + fix;
    if (why != want) {
        std::fprintf(stderr, "  '%s' under '%s':\n    got  %s\n    want %s\n", address.c_str(), allow.c_str(),
                     why.c_str(), want.c_str());
    }
    return why == want;
}

// --peer-allow's value refused with std::invalid_argument, its one line holding `why`
bool bad_allow(const std::string & value, const std::string & why) {
    try {
        parse_peer_allow(value);
    } catch (const std::invalid_argument & e) {
        const std::string got = e.what();
        if (!contains(got, why) || contains(got, "\n")) std::fprintf(stderr, "  '%s': %s\n", value.c_str(), got.c_str());
        return contains(got, why) && !contains(got, "\n");
    }
    std::fprintf(stderr, "  '%s' was taken\n", value.c_str());
    return false;
}

// a DNS name of exactly n characters (labels of at most 63)
std::string name_of(size_t n) {
    std::string s;
    while (s.size() < n) {
        if (!s.empty()) s += '.';
        s += std::string(std::min<size_t>(63, n - s.size()), 'a');
    }
    return s;
}

void tcp_host_port_is_admitted_anywhere_without_peer_allow() {
    CHECK(admitted("127.0.0.1:7001"));
    CHECK(admitted("10.1.2.3:1"));
    CHECK(admitted("10.1.2.3:65535"));
    CHECK(admitted("10.1.2.3:080"));                        // a port is its digits
    CHECK(admitted("[::1]:7001"));
    CHECK(admitted("[fd00::1]:7001"));
    CHECK(admitted("[::ffff:10.0.0.1]:7001"));
    CHECK(admitted("stage1.example:7001"));
    CHECK(admitted("Stage1.EXAMPLE:7001"));
    CHECK(admitted("w-2.mesh.internal.:443"));              // one trailing dot
    CHECK(admitted("localhost:7001"));
    CHECK(admitted(std::string(63, 'a') + ".example:1"));    // a label of 63
    CHECK(admitted("nowhere.invalid:7001"));                // without --peer-allow nothing is looked up
    CHECK(admitted("dnsx:7001") && admitted("unix1:7001") && admitted("vsock.example:7001"));   // not schemes
}

void grpc_target_schemes_are_refused_by_name() {
    for (const char * a : {"unix:/run/dgr/admin.sock", "dns:///stage1.example:7001", "http://stage1.example:7001",
                           "stage1.example:/7001", "unix:///tmp/x:1"}) {
        CHECK(refused_as(a, SCHEME));
    }
    for (const char * a : {"ipv4:10.0.0.1:7001", "ipv6:[::1]:7001", "vsock:2:7001", "unix:x:1", "a:b:c"}) {
        CHECK(refused_as(a, SCHEME));
    }
    CHECK(refused_as("unix:7001", "'unix:' is a gRPC target scheme, not a host name: peers are reached over TCP only"));
    CHECK(refused_as("dns:7001", "'dns:' is a gRPC target scheme, not a host name: peers are reached over TCP only"));
    CHECK(refused_as("UNIX-Abstract:1", "'UNIX-Abstract:' is a gRPC target scheme, not a host name: peers are "
                                        "reached over TCP only"));     // any case; quoted as given
    for (const char * s : {"ipv4", "ipv6", "vsock", "xds", "google-c2p", "c2p", "fake", "sockaddr", "binder", "http",
                           "https"}) {
        CHECK(contains(verdict(std::string(s) + ":7001"), "is a gRPC target scheme, not a host name"));
    }
}

void ipv6_goes_in_brackets() {
    CHECK(refused_as("::1:7001", "an IPv6 address goes in brackets", "give [::1]:7001"));
    CHECK(refused_as("fd00::1:2:7001", "an IPv6 address goes in brackets", "give [fd00::1:2]:7001"));
    // an IPv6 address alone: no port, and no brackets (not a scheme)
    CHECK(refused_as("::1", "an IPv6 address goes in brackets, with a :PORT after it", "give [::1]:PORT"));
    CHECK(refused_as("fd00::1", "an IPv6 address goes in brackets, with a :PORT after it", "give [fd00::1]:PORT"));
    CHECK(refused_as("::ffff:10.0.0.1", "an IPv6 address goes in brackets, with a :PORT after it",
                     "give [::ffff:10.0.0.1]:PORT"));     // not "[::ffff]:10.0.0.1"
    CHECK(refused_as("[::1:7001", "an IPv6 address opened with '[' is not closed with ']'"));
    CHECK(refused_as("[::1]", "it has no :PORT after the IPv6 address"));
    CHECK(refused_as("[::1]7001", "it has no :PORT after the IPv6 address"));
    CHECK(refused_as("[::1]:", "its port '' is not a number 1-65535"));
    CHECK(refused_as("[nope]:7001", "'[nope]' is not an IPv6 address"));
    CHECK(refused_as("[]:7001", "'[]' is not an IPv6 address"));
    CHECK(refused_as("[10.0.0.1]:7001", "'[10.0.0.1]' is not an IPv6 address"));
    CHECK(refused_as("[fe80::1%eth0]:7001", "'[fe80::1%eth0]' is not an IPv6 address"));   // no zone ids
}

void hosts_are_ipv4_addresses_or_dns_names() {
    CHECK(refused_as(":7001", "its host is empty"));
    CHECK(refused_as("stage1.example", "it has no :PORT"));
    CHECK(refused_as("999.0.0.1:7001", "'999.0.0.1' is not an IPv4 address (give a.b.c.d)"));
    CHECK(refused_as("10.1.2:7001", "'10.1.2' is not an IPv4 address (give a.b.c.d)"));
    CHECK(refused_as("127.1:7001", "'127.1' is not an IPv4 address (give a.b.c.d)"));
    CHECK(refused_as("1.2.3.4.:7001", "'1.2.3.4.' is not an IPv4 address (give a.b.c.d)"));
    CHECK(refused_as("st age:7001", "its host holds ' ' (a host is an IPv4 address or a DNS name)"));
    CHECK(refused_as("stage_1:7001", "its host holds '_' (a host is an IPv4 address or a DNS name)"));
    CHECK(refused_as("a/b:7001", "its host holds '/' (a host is an IPv4 address or a DNS name)"));
    CHECK(refused_as("a]:7001", "its host holds ']' (a host is an IPv4 address or a DNS name)"));
    const std::string dns = "' is not a DNS name (labels of letters, digits and '-', 1-63 characters each)";
    CHECK(refused_as("-stage:7001", "'-stage" + dns));
    CHECK(refused_as("stage-:7001", "'stage-" + dns));
    CHECK(refused_as("a..b:7001", "'a..b" + dns));
    CHECK(refused_as(".a:7001", "'.a" + dns));
    CHECK(refused_as("a..:7001", "'a.." + dns));
    CHECK(refused_as(".:7001", "'.' is not an IPv4 address (give a.b.c.d)"));    // digits and dots alone
    const std::string long_label = std::string(64, 'a') + ".example";
    CHECK(refused_as(long_label + ":7001", "'" + long_label + dns));
}

void ports_are_1_to_65535() {
    CHECK(refused_as("stage1.example:", "its port '' is not a number 1-65535"));
    CHECK(refused_as("stage1.example:0", "its port 0 is not in 1-65535"));
    CHECK(refused_as("stage1.example:00000", "its port 00000 is not in 1-65535"));
    CHECK(refused_as("stage1.example:65536", "its port 65536 is not in 1-65535"));
    CHECK(refused_as("stage1.example:99999", "its port 99999 is not in 1-65535"));
    CHECK(refused_as("stage1.example:100000", "its port '100000' is not a number 1-65535"));
    CHECK(refused_as("stage1.example:http", "its port 'http' is not a number 1-65535"));
    CHECK(refused_as("stage1.example:-1", "its port '-1' is not a number 1-65535"));
    CHECK(refused_as("stage1.example:+80", "its port '+80' is not a number 1-65535"));
    CHECK(refused_as("stage1.example: 80", "its port ' 80' is not a number 1-65535"));
}

void what_is_quoted_back_is_bounded_and_printable() {
    CHECK(refused_as("", "it is empty"));
    CHECK(refused_as("stage\x01:7001", "it holds control characters", TCP, "", "stage?:7001"));
    CHECK(refused_as("stage\x7f:7001", "it holds control characters", TCP, "", "stage?:7001"));
    CHECK(refused_as("a:1\nb:2", "it holds control characters", TCP, "", "a:1?b:2"));     // never two lines
    CHECK(refused_as("st\xc3\xa4ge:7001", "it holds characters outside ASCII (give an IDN name in its xn-- form)"));
    // 255 characters pass; 256 are refused, and only 255 of them are quoted back
    const std::string at_limit = name_of(255 - 5) + ":7001";
    CHECK(at_limit.size() == 255 && admitted(at_limit));
    const std::string over = name_of(256 - 5) + ":7001";
    CHECK(refused_as(over, "it is longer than 255 characters", TCP, "", over.substr(0, 255) + "..."));
    const std::string huge(100000, '\x01');
    const std::string why = verdict(huge);
    CHECK(contains(why, "it is longer than 255 characters") && why.size() < 600 && !contains(why, "\x01"));
    // nothing is tried: no refusal speaks of the port's answer
    for (const char * a : {"127.0.0.1:1", "[::1]:1", "unix:/x"}) {
        const std::string w = verdict(a, "10.0.0.0/8");
        CHECK(!contains(w, "onnection") && !contains(w, "unreachable") && !contains(w, "timed out"));
    }
}

void peer_allow_takes_cidrs_and_bare_addresses() {
    NetPolicy p = parse_peer_allow(" 10.0.0.0/8 ,192.168.1.7,  fd00::/8,::1/128 ,[::1]/128,[fe80::1],0.0.0.0/0");
    CHECK((p.peer_allow == std::vector<std::string>{"10.0.0.0/8", "192.168.1.7", "fd00::/8", "::1/128", "[::1]/128",
                                                    "[fe80::1]", "0.0.0.0/0"}));    // each trimmed, as given
    CHECK(parse_peer_allow("::/0").peer_allow.size() == 1);
    CHECK(parse_peer_allow("10.0.0.0/08").peer_allow.size() == 1);
    CHECK(parse_peer_allow("::ffff:10.0.0.0/104").peer_allow.size() == 1);    // 10.0.0.0/8
    CHECK(parse_peer_allow("::ffff:10.0.0.1").peer_allow.size() == 1);        // 10.0.0.1/32
    CHECK(parse_peer_allow("::ffff:0.0.0.0/96").peer_allow.size() == 1);      // every IPv4 address
}

void peer_allow_refuses_what_is_not_a_network() {
    try {
        parse_peer_allow("10.0.0.0/8,10.0.0.1/8");
        CHECK(false);
    } catch (const std::invalid_argument & e) {
        CHECK(std::string(e.what()) == "--peer-allow: '10.0.0.1/8' has host bits set: " + NETWORKS);   // the entry
    }
    CHECK(bad_allow("10.0.0.0/33", "'10.0.0.0/33' has a bad prefix length (0-32)"));
    CHECK(bad_allow("fd00::/129", "'fd00::/129' has a bad prefix length (0-128)"));
    CHECK(bad_allow("10.0.0.0/", "'10.0.0.0/' has a bad prefix length (0-32)"));
    CHECK(bad_allow("10.0.0.0/-1", "'10.0.0.0/-1' has a bad prefix length (0-32)"));
    CHECK(bad_allow("10.0.0.0/0008", "'10.0.0.0/0008' has a bad prefix length (0-32)"));
    CHECK(bad_allow("10.0.0.0/8/8", "'10.0.0.0/8/8' has a bad prefix length (0-32)"));
    CHECK(bad_allow("10.0.0.0/ 8", "'10.0.0.0/ 8' has a bad prefix length (0-32)"));
    CHECK(bad_allow("fd00::1/8", "'fd00::1/8' has host bits set"));
    CHECK(bad_allow("192.168.4.1/22", "'192.168.4.1/22' has host bits set"));
    CHECK(bad_allow("::ffff:10.0.0.1/104", "'::ffff:10.0.0.1/104' has host bits set"));
    // an IPv4-mapped network is IPv4 only from /96 on; shorter, its ffff is host bits (it used to be read as
    // an IPv4 prefix of 8, -1 or -32 bits: ::ffff:0.0.0.0/95 let every IPv4 address in)
    CHECK(bad_allow("::ffff:10.0.0.0/8", "'::ffff:10.0.0.0/8' has host bits set"));
    CHECK(bad_allow("::ffff:0.0.0.0/95", "'::ffff:0.0.0.0/95' has host bits set"));
    CHECK(bad_allow("::ffff:0.0.0.0/64", "'::ffff:0.0.0.0/64' has host bits set"));
    CHECK(bad_allow("stage1.example", "'stage1.example' is not an IPv4 or IPv6 network: " + NETWORKS));
    CHECK(bad_allow("localhost", "'localhost' is not an IPv4 or IPv6 network"));    // never resolved
    CHECK(bad_allow("10.0.0", "'10.0.0' is not an IPv4 or IPv6 network"));
    CHECK(bad_allow("[::1", "'[::1' is not an IPv4 or IPv6 network"));
    CHECK(bad_allow("fe80::1%eth0", "'fe80::1%eth0' is not an IPv4 or IPv6 network"));
    CHECK(bad_allow("10.0.0.0/8 fd00::/8", "'10.0.0.0/8 fd00::/8' has a bad prefix length"));
    for (const char * v : {"", " ", ",", "10.0.0.0/8,", ",10.0.0.0/8", "10.0.0.0/8,,::1", "10.0.0.0/8, ,::1"}) {
        CHECK(bad_allow(v, "--peer-allow '" + std::string(v) + "': an empty entry: " + NETWORKS));
    }
}

void peer_allow_bounds_literal_addresses() {
    const std::string ten = "10.0.0.0/8";
    CHECK(admitted("10.0.0.0:1", ten) && admitted("10.255.255.255:1", ten) && admitted("10.1.2.3:1", ten));
    const std::string outside = "it is outside --peer-allow";
    const std::string widen = "give an address inside --peer-allow 10.0.0.0/8, or widen --peer-allow on this worker";
    CHECK(refused_as("11.0.0.0:1", outside, widen, ten));
    CHECK(refused_as("9.255.255.255:1", outside, widen, ten));
    CHECK(refused_as("[::1]:1", outside, widen, ten));
    CHECK(refused_as("[::a00:1]:1", outside, widen, ten));       // ::10.0.0.1 (IPv4-compatible) is not 10.0.0.1
    CHECK(admitted("[::ffff:10.1.2.3]:1", ten));                 // an IPv4-mapped address is its IPv4 address
    CHECK(admitted("[::FFFF:a01:203]:1", ten));
    // prefixes that do not end on a byte
    const std::string v22 = "192.168.4.0/22";
    CHECK(admitted("192.168.4.0:1", v22) && admitted("192.168.7.255:1", v22));
    CHECK(contains(verdict("192.168.8.0:1", v22), outside) && contains(verdict("192.168.3.255:1", v22), outside));
    const std::string v6 = "fc00::/7";
    CHECK(admitted("[fc00::1]:1", v6) && admitted("[fdff:ffff::1]:1", v6));
    CHECK(contains(verdict("[fe00::1]:1", v6), outside) && contains(verdict("[fbff::1]:1", v6), outside));
    // a bare address is that address alone
    CHECK(admitted("192.168.1.7:1", "192.168.1.7") && contains(verdict("192.168.1.8:1", "192.168.1.7"), outside));
    CHECK(admitted("[::1]:1", "::1") && contains(verdict("[::2]:1", "::1"), outside));
    CHECK(admitted("[fe80::1]:1", "[fe80::1]"));
    // /0 is its family, all of it, and no more
    CHECK(admitted("1.2.3.4:1", "0.0.0.0/0") && contains(verdict("[::1]:1", "0.0.0.0/0"), outside));
    CHECK(admitted("[2001:db8::1]:1", "::/0"));
    CHECK(contains(verdict("1.2.3.4:1", "::/0"), outside));
    CHECK(contains(verdict("[::ffff:1.2.3.4]:1", "::/0"), outside));    // mapped: IPv4, so outside an IPv6 net
    // IPv4-mapped networks are their IPv4 networks
    CHECK(admitted("10.1.2.3:1", "::ffff:10.0.0.0/104") && admitted("[::ffff:10.1.2.3]:1", "::ffff:10.0.0.0/104"));
    CHECK(contains(verdict("11.0.0.1:1", "::ffff:10.0.0.0/104"), outside));
    CHECK(admitted("1.2.3.4:1", "::ffff:0.0.0.0/96") && contains(verdict("[fd00::1]:1", "::ffff:0.0.0.0/96"), outside));
    CHECK(admitted("10.0.0.1:1", "::ffff:10.0.0.1") && contains(verdict("10.0.0.2:1", "::ffff:10.0.0.1"), outside));
    // any one network suffices; the refusal lists them as given
    const std::string two = " 10.0.0.0/8 , fd00::/8";
    CHECK(admitted("10.9.9.9:1", two) && admitted("[fd12::1]:1", two));
    CHECK(refused_as("172.16.0.1:1", outside,
                     "give an address inside --peer-allow 10.0.0.0/8,fd00::/8, or widen --peer-allow on this worker", two));
}

void the_form_is_checked_before_peer_allow() {
    const std::string allow = "0.0.0.0/0,::/0";
    CHECK(refused_as("unix:/tmp/x", SCHEME, TCP, allow));
    CHECK(refused_as("10.0.0.1:0", "its port 0 is not in 1-65535", TCP, allow));
    CHECK(refused_as("::1:7001", "an IPv6 address goes in brackets", "give [::1]:7001", allow));
    CHECK(refused_as("dns:53", "'dns:' is a gRPC target scheme, not a host name: peers are reached over TCP only",
                     TCP, allow));
}

void a_name_must_resolve_inside_peer_allow() {
    // localhost resolves offline (/etc/hosts) to 127.0.0.1, and on some hosts ::1 too
    CHECK(admitted("localhost:7001", "127.0.0.0/8,::1/128"));
    CHECK(admitted("LOCALHOST:7001", "127.0.0.0/8,::1/128"));
    const std::string rule =
        "its name resolves to an address outside --peer-allow (every address it resolves to must be inside)";
    CHECK(refused_as("localhost:7001", rule,
                     "give an address inside --peer-allow 10.0.0.0/8, or widen --peer-allow on this worker",
                     "10.0.0.0/8"));
    // inside for ::1 is not enough while it also resolves to 127.0.0.1
    CHECK(refused_as("localhost:7001", rule,
                     "give an address inside --peer-allow ::1/128, or widen --peer-allow on this worker", "::1/128"));
    // a numeric-looking name is resolved too, and judged by what it resolves to (inet_aton's 127.0.0.1)
    CHECK(refused_as("0x7f.1:7001", rule,
                     "give an address inside --peer-allow 10.0.0.0/8, or widen --peer-allow on this worker",
                     "10.0.0.0/8"));
}

}  // namespace

int main() {
    tcp_host_port_is_admitted_anywhere_without_peer_allow();
    grpc_target_schemes_are_refused_by_name();
    ipv6_goes_in_brackets();
    hosts_are_ipv4_addresses_or_dns_names();
    ports_are_1_to_65535();
    what_is_quoted_back_is_bounded_and_printable();
    peer_allow_takes_cidrs_and_bare_addresses();
    peer_allow_refuses_what_is_not_a_network();
    peer_allow_bounds_literal_addresses();
    the_form_is_checked_before_peer_allow();
    a_name_must_resolve_inside_peer_allow();
    return dgr::unit::finish("net_policy_test");
}
