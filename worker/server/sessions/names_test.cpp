// Session names alone (names.h): under mutual TLS no two members' keys meet, whatever their names; a key
// gives back its owner and the id as named; the plaintext worker has one tenant.
#include "unit_check.h"
#include "sessions/names.h"

#include <cstdio>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace {

using dgr::SessionNames;

void a_key_gives_back_its_owner_and_the_id() {
    SessionNames n(true);
    const std::string k = n.key(std::string("alice"), "chat-1");
    CHECK(k == "alice/chat-1");
    CHECK(n.owner_of(k) == "alice" && n.wire_of(k) == "chat-1");
    // an id may hold slashes: the first one ends the (escaped) member
    const std::string k2 = n.key(std::string("alice"), "a/b/c");
    CHECK(n.owner_of(k2) == "alice" && n.wire_of(k2) == "a/b/c");
}

void no_two_members_keys_meet() {
    SessionNames n(true);
    // names built to collide if '/' or '%' went through unescaped
    const std::vector<std::pair<std::string, std::string>> asks = {
        {"a", "b/c"}, {"a/b", "c"}, {"a%2Fb", "c"}, {"a%252Fb", "c"}, {"a%", "2Fb/c"}, {"", "a/b/c"},
        {"a/", "b/c"}, {"%", "x"}, {"%25", "x"}, {"/", "x"}, {"%2F", "x"},
    };
    std::set<std::string> keys;
    std::set<std::string> owners;
    for (auto & [member, id] : asks) {
        const std::string k = n.key(member, id);
        CHECK(keys.insert(k).second);                         // every (member, id) its own key
        CHECK(n.wire_of(k) == id);                            // the id comes back as named
        owners.insert(n.owner_of(k));
    }
    CHECK(owners.size() == 11);                               // eleven members asked ("a" twice): eleven owners
    // the same id under two members: two sessions
    CHECK(n.key(std::string("alice"), "s") != n.key(std::string("bob"), "s"));
    // a member without a name is its own (empty) namespace, not anyone else's
    CHECK(n.key(std::nullopt, "s") == n.key(std::string(""), "s") && n.owner_of(n.key(std::nullopt, "s")).empty());
}

void plaintext_has_one_tenant() {
    SessionNames n(false);
    CHECK(!n.mutual());
    CHECK(n.key(std::string("alice"), "s") == "s" && n.key(std::string("bob"), "s") == "s");
    CHECK(n.wire_of("a/b") == "a/b" && n.owner_of("a/b").empty() && n.client_name("x#y") == "x#y");
}

void stage0_names_a_session_by_an_id_no_one_guesses() {
    const std::string a = SessionNames::wire_down("chat"), b = SessionNames::wire_down("chat");
    CHECK(a.rfind("chat#", 0) == 0 && a.size() == 5 + 32 && a != b);
    CHECK(a.find_first_not_of("0123456789abcdef", 5) == std::string::npos);
    SessionNames n(true);
    // a later stage's key for it, and the name a test hook gives: the client's id
    CHECK(n.client_name(n.key(std::string("stage0"), a)) == "chat");
    CHECK(n.client_name(n.key(std::string("alice"), "plain")) == "plain");
}

}  // namespace

int main() {
    a_key_gives_back_its_owner_and_the_id();
    no_two_members_keys_meet();
    plaintext_has_one_tenant();
    stage0_names_a_session_by_an_id_no_one_guesses();
    return dgr::unit::finish("names_test");
}
