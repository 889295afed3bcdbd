// dgr-worker's certificates of certification (certification.h): dgr.core.certificate (load_certificate, check, Certificate.digest) in
// C++, message for message: the worker logs each reason in check's words.
#include "certification.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "blake3.h"
#include "nlohmann/json.hpp"

namespace dgr {
namespace {

using J = nlohmann::json;
const char * SCHEMA = "dgr.certificate/v1";

struct Bad : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// Python's repr() of a str, for the plain strings identities hold
std::string py_repr(const std::string & s) {
    const char q = (s.find('\'') != std::string::npos && s.find('"') == std::string::npos) ? '"' : '\'';
    std::string o(1, q);
    for (unsigned char c : s) {
        if (c == '\\' || c == (unsigned char) q) { o += '\\'; o += char(c); }
        else if (c == '\n') o += "\\n";
        else if (c == '\r') o += "\\r";
        else if (c == '\t') o += "\\t";
        else if (c < 0x20 || c == 0x7f) { char b[8]; std::snprintf(b, sizeof b, "\\x%02x", c); o += b; }
        else o += char(c);
    }
    return o + q;
}

// dgr.core.certificate._short: a long hex hash by its first 16 digits, anything else as repr()
std::string short_(const std::string & v) {
    bool hex = v.size() > 24 && std::all_of(v.begin(), v.end(), [](char c) { return std::strchr("0123456789abcdef", c) && c; });
    return hex ? v.substr(0, 16) : py_repr(v);
}

// str(pathlib.Path(p)): no "." parts, no doubled or trailing slashes
std::string path_str(const std::string & p) {
    if (p.empty()) return ".";
    std::string o = p[0] == '/' ? "/" : "";
    std::stringstream ss(p);
    std::string part;
    bool first = true;
    while (std::getline(ss, part, '/')) {
        if (part.empty() || part == ".") continue;
        if (!first) o += '/';
        o += part;
        first = false;
    }
    return o.empty() ? "." : o;
}

// the model's fields, their JSON kinds, and the defaults pydantic fills in (dgr.core.certificate)
enum Kind { STR, INT, BOOL, FIGURE, ARRAY, OBJECT };
struct Field {
    const char * name;
    Kind kind;
    const J * dflt;   // nullptr: required
};

const J S_EMPTY = "", B_FALSE = false, A_EMPTY = J::array(), SCHEMA_J = SCHEMA;

J validated(const J & v, const std::vector<Field> & fields, const std::string & where) {
    if (!v.is_object()) throw Bad(where + ": not an object");
    for (auto & [k, _] : v.items()) {
        if (std::none_of(fields.begin(), fields.end(), [&](const Field & f) { return k == f.name; }))
            throw Bad(where + "." + k + ": extra inputs are not permitted");
    }
    J o = J::object();
    for (const Field & f : fields) {
        const std::string at = where.empty() ? f.name : where + "." + f.name;
        if (!v.contains(f.name)) {
            if (!f.dflt) throw Bad(at + ": field required");
            o[f.name] = *f.dflt;
            continue;
        }
        const J & x = v.at(f.name);
        bool ok = f.kind == STR ? x.is_string() : f.kind == INT ? x.is_number_integer() : f.kind == BOOL ? x.is_boolean()
                : f.kind == FIGURE ? (x.is_number() || x.is_string()) : f.kind == ARRAY ? x.is_array() : x.is_object();
        if (!ok) throw Bad(at + ": wrong type (" + std::string(x.type_name()) + ")");
        o[f.name] = x;
    }
    return o;
}

// load_certificate: the canonical form (every field, defaults filled) of DIR/NAME, or Bad(why)
J load(const std::string & path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw Bad(path + ": not a readable certificate: " + std::strerror(errno));
    std::stringstream buf;
    buf << f.rdbuf();
    J raw;
    try {
        raw = J::parse(buf.str());
    } catch (const std::exception & e) {
        throw Bad(path + ": not a readable certificate: " + e.what());
    }
    if (!raw.is_object() || !raw.contains("schema") || raw["schema"] != SCHEMA) {
        std::string got = !raw.is_object() ? "'" + std::string(raw.is_array() ? "list" : raw.type_name()) + "'"
                        : !raw.contains("schema") ? "None" : raw["schema"].is_string() ? py_repr(raw["schema"]) : raw["schema"].dump();
        throw Bad(path + ": not a " + SCHEMA + " certificate (schema " + got + ")");
    }
    try {
        J c = validated(raw, {{"schema", STR, &SCHEMA_J}, {"identity", OBJECT, nullptr}, {"contract", OBJECT, nullptr},
                              {"hardware", OBJECT, nullptr}, {"stages", ARRAY, &A_EMPTY}, {"figures", ARRAY, &A_EMPTY},
                              {"passed", BOOL, &B_FALSE}, {"created_at", STR, &S_EMPTY}, {"dgr_version", STR, &S_EMPTY}}, "");
        c["identity"] = validated(c["identity"], {{"model", STR, nullptr}, {"bundle_id", STR, nullptr}, {"lane", STR, nullptr},
                                                  {"upstream_commit", STR, nullptr}, {"patch_series", STR, nullptr},
                                                  {"engine_blake3", STR, nullptr}, {"worker_blake3", STR, &S_EMPTY},
                                                  {"contract_blake3", STR, &S_EMPTY}, {"numerics", STR, &S_EMPTY}}, "identity");
        c["contract"] = validated(c["contract"], {{"path", STR, nullptr}, {"blake3", STR, nullptr}, {"name", STR, &S_EMPTY}}, "contract");
        c["hardware"] = validated(c["hardware"], {{"cpu_model", STR, nullptr}, {"cores", INT, nullptr}, {"memory_bytes", INT, nullptr},
                                                  {"os", STR, nullptr}, {"machine", STR, &S_EMPTY}, {"gpu", STR, &S_EMPTY}}, "hardware");
        for (size_t i = 0; i < c["stages"].size(); ++i)
            c["stages"][i] = validated(c["stages"][i], {{"stage", INT, nullptr}, {"layer_begin", INT, nullptr}, {"layer_end", INT, nullptr}},
                                       "stages." + std::to_string(i));
        for (size_t i = 0; i < c["figures"].size(); ++i)
            c["figures"][i] = validated(c["figures"][i], {{"check", STR, nullptr}, {"figure", FIGURE, nullptr}, {"threshold", STR, nullptr},
                                                          {"passed", BOOL, nullptr}, {"detail", STR, &S_EMPTY}},
                                        "figures." + std::to_string(i));
        return c;
    } catch (const Bad & e) {
        throw Bad(path + ": malformed certificate: " + e.what());
    }
}

// dgr.core.certificate.check: "" when valid for this worker
std::string check(const J & c, const CertIdentity & me, const std::string & mine_contract_blake3, const std::string & contract) {
    const J & id = c["identity"];
    const std::pair<const char *, const std::string *> fields[] = {
        {"model", &me.model}, {"bundle_id", &me.bundle_id}, {"lane", &me.lane}, {"upstream_commit", &me.upstream_commit},
        {"patch_series", &me.patch_series}, {"engine_blake3", &me.engine_blake3}};
    for (auto & [f, mine] : fields) {
        const std::string a = id[f];
        if (a != *mine) return std::string("certificate is for ") + f + " " + short_(a) + ", this worker has " + short_(*mine);
    }
    const std::string numerics = id["numerics"];
    if (!numerics.empty() && numerics != me.numerics)
        return "certificate is for numerics '" + numerics + "', this worker computes '" + me.numerics + "'";
    const std::string worker = id["worker_blake3"];
    if (worker.empty()) return "certificate names no worker binary (it was made before certificates recorded worker_blake3): re-certify";
    if (worker != me.worker_blake3)
        return "certificate is for worker " + worker.substr(0, 12) + ", this worker is " + me.worker_blake3.substr(0, 12) + ": re-certify";
    const std::string theirs = id["contract_blake3"];
    if (!mine_contract_blake3.empty() && mine_contract_blake3 != theirs)
        return "certificate was measured against contract " + short_(theirs) + ", this worker expects " + short_(mine_contract_blake3);
    if (theirs != c["contract"]["blake3"].get<std::string>())
        return "certificate is inconsistent: its identity and its contract name different contract hashes";
    const std::string path = path_str(contract.empty() ? c["contract"]["path"].get<std::string>() : contract);
    std::string now;
    try {
        std::ifstream f(path, std::ios::binary);
        if (!f) throw std::runtime_error(std::strerror(errno));
        now = blake3_file(path);
    } catch (const std::exception & e) {
        return "contract file " + path + " cannot be read (" + e.what() + "): the certificate cannot be checked";
    }
    if (now != theirs)
        return "contract file " + path + " changed since the certificate was made (blake3 " + short_(now) +
               ", certified against " + short_(theirs) + "): recertify";
    bool all = !c["figures"].empty();
    std::string failed;
    for (auto & f : c["figures"]) {
        if (f["passed"]) continue;
        all = false;
        failed += (failed.empty() ? "" : ", ") + f["check"].get<std::string>();
    }
    if (!c["passed"].get<bool>() || !all) return "certificate records a failed gate (" + (failed.empty() ? "no figures" : failed) + ")";
    return "";
}

}  // namespace

std::vector<HeldCertificate> held_certificates(const std::string & dir, const CertIdentity & me, const std::string & contract) {
    struct stat st{};
    if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
        throw std::runtime_error("--certs " + path_str(dir) + ": no such directory (put the certificates `dgr certify` wrote there)");
    std::string mine_contract;
    if (!contract.empty()) {
        if (stat(contract.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) throw std::runtime_error("--contract " + contract + ": no such file");
        mine_contract = blake3_file(contract);
    }
    std::vector<std::string> names;
    if (DIR * d = opendir(dir.c_str())) {
        while (dirent * e = readdir(d)) {
            std::string n = e->d_name;
            if (n.size() > 5 && n.compare(n.size() - 5, 5, ".json") == 0) names.push_back(n);
        }
        closedir(d);
    }
    std::sort(names.begin(), names.end());
    std::vector<HeldCertificate> held;
    for (const std::string & name : names) {
        const std::string path = path_str(dir + "/" + name);
        J c;
        try {
            c = load(path);
        } catch (const Bad & e) {
            std::fprintf(stderr, "dgr-worker: ignoring %s: %s\n", name.c_str(), e.what());
            continue;
        }
        const std::string lane = c["identity"]["lane"];
        std::string why = check(c, me, mine_contract, contract);
        std::set<std::tuple<int64_t, int64_t, int64_t>> covered;
        for (auto & r : c["stages"]) covered.insert({r["stage"].get<int64_t>(), r["layer_begin"].get<int64_t>(), r["layer_end"].get<int64_t>()});
        if (why.empty() && !covered.empty() && !covered.count({me.stage_index, me.layer_begin, me.layer_end})) {
            std::string list = "[";
            for (auto & [s, b, e] : covered)
                list += (list.size() > 1 ? ", (" : "(") + std::to_string(s) + ", " + std::to_string(b) + ", " + std::to_string(e) + ")";
            why = "certificate covers stages " + list + "], not stage " + std::to_string(me.stage_index) + " [" +
                  std::to_string(me.layer_begin) + ", " + std::to_string(me.layer_end) + ")";
        }
        if (!why.empty()) {
            std::fprintf(stderr, "dgr-worker: ignoring certificate %s (lane %s): %s\n", name.c_str(), lane.c_str(), why.c_str());
            continue;
        }
        // Certificate.digest: blake3 of the sorted-key compact JSON, non-ASCII escaped (Python's json.dumps)
        const std::string digest = blake3_hex(c.dump(-1, ' ', true));
        const J & hw = c["hardware"];
        size_t n_pass = 0;
        for (auto & f : c["figures"]) n_pass += f["passed"].get<bool>();
        const std::string gpu = hw["gpu"];
        const std::string cname = c["contract"]["name"];
        held.push_back({digest, cname.empty() ? c["contract"]["path"].get<std::string>() : cname, c["contract"]["blake3"], lane,
                        c["created_at"],
                        std::to_string(n_pass) + "/" + std::to_string(c["figures"].size()) + " checks passed on " +
                            hw["cpu_model"].get<std::string>() + (gpu.empty() ? "" : " + " + gpu)});
        std::fprintf(stderr, "dgr-worker: advertising certificate %s (%s, lane %s)\n", name.c_str(), digest.substr(0, 16).c_str(), lane.c_str());
    }
    return held;
}

}  // namespace dgr
