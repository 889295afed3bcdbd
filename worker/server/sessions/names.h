// Session names: whose a session is, from its key alone (docs/security.md "Owners").
//
// Under mutual TLS every session lives in the namespace of the member that opened it at this worker, so no
// other member can name, step, evict or close it at any epoch. This worker's key for a session is
// key(opener, id as the opener named it): "<member>/<id>", the member's '%' and '/' escaped, so two members'
// keys never meet and the first '/' always ends the member. Stage 0 names each session to the route's later
// hops and its origin by an id of its own (the client's id, '#', and 128 random bits: wire_down), which no
// member off the route can guess. Without mutual TLS the worker has one tenant and a key is the id itself.
//
// A part with no state of its own beyond the trust mode, set once before serving; tested alone by
// names_test.cpp.
#pragma once

#include <optional>
#include <string>

namespace dgr {

class SessionNames {
  public:
    explicit SessionNames(bool mutual = false) : mutual_(mutual) {}
    bool mutual() const { return mutual_; }

    // this worker's key for session `sid` opened by `member` (nullopt or "": a peer without a name)
    std::string key(const std::optional<std::string> & member, const std::string & sid) const;
    std::string wire_of(const std::string & key) const;      // the id as its opener named it
    std::string owner_of(const std::string & key) const;     // the (escaped) member it belongs to; "" plaintext
    // The id a test hook (--test-die-at SESSION:...) names: as the client named it, without its owner and
    // without the random part stage 0 added
    std::string client_name(const std::string & key) const;
    // Stage 0's id for a session along the route: the client's id and 128 random bits (mutual TLS only)
    static std::string wire_down(const std::string & client_id);

  private:
    bool mutual_;
};

std::string random_hex16();                                  // 128 bits from the kernel, as hex

}  // namespace dgr
