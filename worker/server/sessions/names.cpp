#include "sessions/names.h"

#include <fcntl.h>
#include <unistd.h>

#include <stdexcept>

namespace dgr {

std::string SessionNames::key(const std::optional<std::string> & member, const std::string & sid) const {
    if (!mutual_) return sid;
    std::string out;
    for (char c : member.value_or("")) {
        if (c == '%') out += "%25";
        else if (c == '/') out += "%2F";
        else out += c;
    }
    return out + "/" + sid;
}

std::string SessionNames::wire_of(const std::string & key) const {
    if (!mutual_) return key;
    const size_t slash = key.find('/');
    return slash == std::string::npos ? key : key.substr(slash + 1);
}

std::string SessionNames::owner_of(const std::string & key) const {
    if (!mutual_) return "";
    const size_t slash = key.find('/');
    return slash == std::string::npos ? "" : key.substr(0, slash);
}

std::string SessionNames::client_name(const std::string & key) const {
    if (!mutual_) return key;
    std::string name = wire_of(key);
    if (size_t hash = name.rfind('#'); hash != std::string::npos) name = name.substr(0, hash);
    return name;
}

std::string SessionNames::wire_down(const std::string & client_id) { return client_id + "#" + random_hex16(); }

std::string random_hex16() {
    unsigned char b[16];
    size_t got = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        while (got < sizeof b) {
            ssize_t n = read(fd, b + got, sizeof b - got);
            if (n <= 0) break;
            got += size_t(n);
        }
        close(fd);
    }
    if (got != sizeof b) throw std::runtime_error("could not read /dev/urandom for a session id");
    static const char * HEX = "0123456789abcdef";
    std::string out;
    for (unsigned char c : b) {
        out += HEX[c >> 4];
        out += HEX[c & 15];
    }
    return out;
}

}  // namespace dgr
