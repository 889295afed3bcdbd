// The stage file against its bundle manifest entry, chunk by chunk (BLAKE3), before the engine loads it.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "blake3.h"
#include "stage_check.h"

namespace dgr::serve {

StageCheck check_stage_file(const std::string & file, const nlohmann::json & entry, uint64_t chunk, int stage,
                            const std::string & mpath, bool hash) {
    const auto t0 = std::chrono::steady_clock::now();
    struct stat st{};
    if (stat(file.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
        throw std::runtime_error(file + ": stage " + std::to_string(stage) + " file is missing; re-provision the bundle");
    }
    const uint64_t want = entry.at("size").get<uint64_t>(), have = uint64_t(st.st_size);
    if (have != want) {
        const uint64_t bad = std::min(have, want) / chunk;
        throw std::runtime_error(file + ": size " + std::to_string(have) + " bytes, manifest says " + std::to_string(want) +
                                 ": the file is " + (have < want ? "truncated" : "too long") + "; first bad chunk " +
                                 std::to_string(bad) + " (bytes " + std::to_string(bad * chunk) + "-); re-provision the bundle");
    }
    StageCheck out;
    if (!hash) return out;
    const nlohmann::json & chunks = entry.at("chunks");
    const uint64_t n = (want + chunk - 1) / chunk;
    if (!chunks.is_array() || chunks.size() != n) {
        throw std::runtime_error(mpath + ": stage " + std::to_string(stage) + " lists " + std::to_string(chunks.size()) +
                                 " chunk hashes for " + std::to_string(want) + " bytes in chunks of " + std::to_string(chunk) +
                                 " (" + std::to_string(n) + " expected): not a valid dgr manifest; rebuild the bundle");
    }
    int fd = open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::runtime_error(file + ": cannot read the stage file (" + std::strerror(errno) + ")");
    struct Fd {
        int fd;
        ~Fd() { close(fd); }
    } guard{fd};
    posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    std::vector<uint8_t> buf(static_cast<size_t>(chunk));
    dgr::Blake3 h;
    for (uint64_t k = 0; k < n; ++k) {
        const uint64_t begin = k * chunk, len = std::min(chunk, want - begin);
        uint64_t got = 0;
        while (got < len) {
            ssize_t r = read(fd, buf.data() + got, size_t(len - got));
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) throw std::runtime_error(file + ": read error at byte " + std::to_string(begin + got) + " (" + std::strerror(errno) + ")");
            if (r == 0) {
                throw std::runtime_error(file + ": the file is truncated (it shrank while being read); first bad chunk " +
                                         std::to_string(k) + " (bytes " + std::to_string(begin) + "-); re-provision the bundle");
            }
            got += uint64_t(r);
        }
        h.reset();
        h.update(buf.data(), size_t(len));
        if (h.hex() != chunks[size_t(k)].get<std::string>()) {
            throw std::runtime_error(file + ": chunk " + std::to_string(k) + " (bytes " + std::to_string(begin) + "-" +
                                     std::to_string(begin + len - 1) + ") does not match the manifest: the file is corrupt; "
                                     "re-provision the bundle");
        }
        out.bytes += len;
        out.chunks += 1;
    }
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return out;
}

}  // namespace dgr::serve
