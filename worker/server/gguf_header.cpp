#include "gguf_header.h"

#include <cstdint>
#include <fstream>
#include <stdexcept>

namespace dgr {
namespace {

// GGUF value types (ggml's gguf_type)
enum : uint32_t { U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 };

class Reader {
  public:
    Reader(const std::string & path) : path_(path), f_(path, std::ios::binary) {
        if (!f_) throw std::runtime_error(path + ": cannot open the GGUF file");
    }
    template <typename T> T get() {
        T v;
        if (!f_.read(reinterpret_cast<char *>(&v), sizeof v)) bad("truncated");
        return v;
    }
    std::string str() {
        uint64_t n = get<uint64_t>();
        if (n > (1ull << 30)) bad("a string of " + std::to_string(n) + " bytes");
        std::string s(n, '\0');
        if (n && !f_.read(&s[0], std::streamsize(n))) bad("truncated");
        return s;
    }
    void skip(uint64_t n) {
        f_.seekg(std::streamoff(n), std::ios::cur);
        if (!f_) bad("truncated");
    }
    void skip_value(uint32_t type) {
        switch (type) {
            case U8: case I8: case BOOL: skip(1); break;
            case U16: case I16: skip(2); break;
            case U32: case I32: case F32: skip(4); break;
            case U64: case I64: case F64: skip(8); break;
            case STRING: skip(get<uint64_t>()); break;
            case ARRAY: {
                uint32_t et = get<uint32_t>();
                uint64_t n = get<uint64_t>();
                if (et == ARRAY) bad("nested arrays");
                for (uint64_t i = 0; i < n; ++i) skip_value(et);
                break;
            }
            default: bad("unknown value type " + std::to_string(type));
        }
    }
    [[noreturn]] void bad(const std::string & why) {
        throw std::runtime_error(path_ + ": not a readable GGUF header (" + why + ")");
    }

  private:
    std::string path_;
    std::ifstream f_;
};

}  // namespace

std::optional<std::string> gguf_string(const std::string & path, const std::string & key) {
    Reader r(path);
    if (r.get<uint32_t>() != 0x46554747u) r.bad("bad magic");
    uint32_t version = r.get<uint32_t>();
    if (version < 2) r.bad("version " + std::to_string(version));
    r.get<uint64_t>();                       // tensors
    uint64_t n_kv = r.get<uint64_t>();
    for (uint64_t i = 0; i < n_kv; ++i) {
        std::string k = r.str();
        uint32_t type = r.get<uint32_t>();
        if (k == key) {
            if (type != STRING) return std::nullopt;
            return r.str();
        }
        r.skip_value(type);
    }
    return std::nullopt;
}

}  // namespace dgr
