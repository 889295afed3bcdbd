// The stage on its engine and the identity it advertises: a bundle's stage (manifest, pin, engine library)
// or a stage of the fake model; what every stage checks once open.
#include <limits.h>
#include <openssl/sha.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "blake3.h"
#include "gguf_header.h"
#include "nlohmann/json.hpp"
#include "serve.h"
#include "stage_check.h"
#include "wire/wire_common.h"

namespace dgr::serve {

namespace {

// The pin (toolchains/llama.cpp.pin.json) this binary was built with: its commit and patch series are
// the worker's identity, as dgr.toolchain.buildinfo reads them from the checkout.
const char * PIN_JSON =
#include "dgr_pin.inc"
    ;

std::string self_dir() {
    char buf[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
    if (n <= 0) return ".";
    std::string p(buf, size_t(n));
    return p.substr(0, p.rfind('/'));
}

// Where the engine library is looked for (unless $DGR_ENGINE_LIB names it): beside this program (a build
// folder), else ../lib (a release: bin/dgr-worker, lib/libdgr_engine.so).
std::string engine_dir() {
    const std::string here = self_dir();
    struct stat st;
    if (stat((here + "/libdgr_engine.so").c_str(), &st) != 0 && stat((here + "/../lib/libdgr_engine.so").c_str(), &st) == 0)
        return here + "/../lib";
    return here;
}

std::string sha256_hex(const std::string & text) {
    unsigned char md[SHA256_DIGEST_LENGTH];
    SHA256(reinterpret_cast<const unsigned char *>(text.data()), text.size(), md);
    static const char * hex = "0123456789abcdef";
    std::string out;
    for (unsigned char c : md) out += hex[c >> 4], out += hex[c & 15];
    return out;
}

}  // namespace

void check_stage(Stage & s, const dgr_stage_info & info);

void open_stage(const Options & o, Stage & s) {
    using json = nlohmann::json;
    std::string root = o.bundle;
    while (root.size() > 1 && root.back() == '/') root.pop_back();
    std::string mpath = root + "/manifest.json";
    std::string raw;
    {
        std::ifstream f(mpath, std::ios::binary);
        if (!f) throw std::runtime_error(mpath + ": cannot read the bundle manifest (" + std::strerror(errno) + "); is " +
                                         o.bundle + " a bundle folder?");
        std::ostringstream ss;
        ss << f.rdbuf();
        raw = ss.str();
    }
    json m;
    try {
        m = json::parse(raw);
        if (m.at("format_version").get<int>() != 1) {
            throw std::runtime_error(mpath + ": format_version " + m.at("format_version").dump() + ", this dgr-worker reads 1; use a matching dgr");
        }
    } catch (const json::exception & e) {
        throw std::runtime_error(mpath + ": not a valid dgr manifest: " + e.what());
    }
    // the manifest's bytes are canonical: its blake3 is the bundle id (dgr.toolchain.bundle.manifest.bundle_id)
    s.id.bundle_id = dgr::blake3_hex(raw);
    const json & stages = m.at("stages");
    const int n = int(stages.size());
    if (o.stage < 0 || o.stage >= n) {
        throw std::runtime_error("bundle " + root + " has " + std::to_string(n) + " stages (0.." + std::to_string(n - 1) +
                                 "); there is no stage " + std::to_string(o.stage));
    }
    const json & entry = stages.at(size_t(o.stage));
    std::string fname = entry.at("file").get<std::string>();
    if (fname.empty() || fname == "." || fname == ".." || fname.find('/') != std::string::npos) {
        throw std::runtime_error(mpath + ": stage " + std::to_string(o.stage) + " file '" + fname + "' is not a plain file name");
    }
    std::string file = root + "/" + fname;
    // the stage file is what the manifest says, chunk by chunk, before anything of the engine is loaded
    uint64_t chunk = 0;
    try {
        chunk = m.at("chunk_size").get<uint64_t>();
    } catch (const json::exception & e) {
        throw std::runtime_error(mpath + ": not a valid dgr manifest: " + e.what());
    }
    if (chunk < 4096 || (chunk & (chunk - 1)) != 0 || chunk > (uint64_t(1) << 30)) {
        throw std::runtime_error(mpath + ": chunk_size " + std::to_string(chunk) + " is not a power of two in [4096, 1 GiB]: "
                                 "not a valid dgr manifest; rebuild the bundle");
    }
    const StageCheck checked = check_stage_file(file, entry, chunk, o.stage, mpath, !o.no_verify);
    if (!o.no_verify) {
        std::printf("dgr worker: %s: %zu chunk(s), %llu bytes match the manifest (%.3f s)\n", file.c_str(), checked.chunks,
                    (unsigned long long)checked.bytes, checked.seconds);
        std::fflush(stdout);
    }
    s.id.model = m.at("recipe").at("name").get<std::string>();
    s.id.stage_index = o.stage;
    s.id.stage_count = n;
    s.id.wire_dtype = o.wire_dtype.empty() ? m.at("boundary_dtype").get<std::string>() : o.wire_dtype;
    if (!dgr::find_dtype(s.id.wire_dtype)) {
        throw std::runtime_error("unknown wire dtype '" + s.id.wire_dtype + "'; use one of " DGR_WIRE_DTYPE_NAMES);
    }
    json pin = json::parse(PIN_JSON);
    s.id.upstream_commit = pin.at("commit").get<std::string>();
    std::string series;
    for (auto & p : pin.at("patches")) {
        series += p.at("file").get<std::string>() + '\0' + p.at("blake3").get<std::string>() + '\n';
    }
    s.id.patch_series = dgr::blake3_hex(series);

    s.lib = dgr::load_engine_lib(engine_dir());
    std::string lane = s.lib.lane();
    if (!o.lane.empty() && o.lane != lane) {
        throw std::runtime_error("--lane " + o.lane + ": the engine library was built for the " + lane +
                                 " lane, and a worker advertises its engine's lane; start it with the " + o.lane +
                                 " lane's engine ($DGR_ENGINE_LIB), or drop --lane");
    }
    s.id.lane = lane;
    s.id.engine_blake3 = dgr::blake3_file(s.lib.path);
    s.id.chat_template = dgr::gguf_string(file, "tokenizer.chat_template").value_or("");

    dgr_open_params p{};
    p.n_ctx = int32_t(o.n_ctx);
    p.max_sessions = int32_t(o.max_sessions);
    p.n_ubatch = 512;
    p.n_threads = int32_t(o.threads);
    p.n_gpu_layers = -1;
    p.n_draft_max = int32_t(o.draft_max);        // V4 and other snapshot caches: how far a step rolls back
    p.poll = int32_t(o.poll);
    // the kernel set (dgr_open_params.fast_kernels holds a DGR_KERNELS_* code): --kernels, or --fast-kernels
    p.fast_kernels = o.kernels == "invariant" ? DGR_KERNELS_INVARIANT
                   : (o.kernels == "fast" || o.fast_kernels) ? DGR_KERNELS_FAST : DGR_KERNELS_REFERENCE;
    int32_t st = s.lib.open(file.c_str(), &p, &s.eng);
    if (st != DGR_OK) throw std::runtime_error(s.lib.error(st));
    s.id.numerics = s.lib.numerics(s.eng);
    dgr_stage_info info{};
    st = s.lib.describe(s.eng, &info);
    if (st != DGR_OK) throw std::runtime_error(s.lib.error(st));
    int lb = entry.at("layer_begin").get<int>(), le = entry.at("layer_end").get<int>();
    if (info.layer_begin != lb || info.layer_end != le) {
        throw std::runtime_error(file + ": the engine opened layers [" + std::to_string(info.layer_begin) + ", " +
                                 std::to_string(info.layer_end) + ") but the manifest says [" + std::to_string(lb) + ", " +
                                 std::to_string(le) + "): rebuild the bundle");
    }
    const json & sch = entry.at("boundary_in");
    if (!sch.is_null()) {
        int ns = sch.at("n_streams").get<int>(), ne = sch.at("n_embd").get<int>();
        bool ti = sch.at("token_ids").get<bool>();
        if (ns != info.n_streams || ne != info.n_embd || ti != bool(info.needs_token_ids)) {
            throw std::runtime_error(file + ": the manifest says stage " + std::to_string(o.stage) + " takes [n, " + std::to_string(ns) +
                                     ", " + std::to_string(ne) + "]" + (ti ? " +token ids" : "") + " but the engine takes [n, " +
                                     std::to_string(info.n_streams) + ", " + std::to_string(info.n_embd) + "]" +
                                     (info.needs_token_ids ? " +token ids" : "") +
                                     ": rebuild the bundle with this dgr, or use the engine it was built for");
        }
    }
    check_stage(s, info);
}

// What every stage checks once open, bundle or fake: the wire dtype fits the boundary; the stop ids.
void check_stage(Stage & s, const dgr_stage_info & info) {
    // the boundary must fill the wire dtype's blocks (dgr.core.contract.StageContract.with_dtype)
    const dgr::WireDtype * d = dgr::find_dtype(s.id.wire_dtype);
    int width = info.n_streams * info.n_embd;
    if (width % d->block != 0) {
        std::string others;
        for (auto & x : dgr::wire_dtypes()) {
            if (width % x.block == 0) others += (others.empty() ? "" : ", ") + std::string(x.name);
        }
        throw std::runtime_error("--wire-dtype " + s.id.wire_dtype + ": wire dtype " + s.id.wire_dtype + " packs " +
                                 std::to_string(d->block) + " values per block, but this boundary has " + std::to_string(width) +
                                 " values per token (not a multiple of " + std::to_string(d->block) + "); use " + others);
    }
    // every id that ends a generation as llama.cpp sees it, the eos first (dgr.runtime.engine_api.VocabInfo.stop_ids)
    std::vector<int32_t> eog(64);
    dgr_vocab_info v{};
    while (true) {
        int32_t st = s.lib.vocab(s.eng, &v, eog.data(), int32_t(eog.size()));
        if (st != DGR_OK) throw std::runtime_error(s.lib.error(st));
        if (size_t(v.n_eog) <= eog.size()) break;
        eog.resize(size_t(v.n_eog));
    }
    if (v.eos >= 0) s.id.eos_token_ids.push_back(v.eos);
    for (int32_t k = 0; k < v.n_eog; ++k) {
        if (eog[size_t(k)] != v.eos) s.id.eos_token_ids.push_back(eog[size_t(k)]);
    }
}

// Stage `--stage` of the fake model `--fake-engine SPEC` on the fake engine library (worker/fake), and the
// identity it advertises: the model "fake:" + the canonical spec, the bundle id "fake-" + its sha256
// (dgr.testing.fake_engine.FakeModel.bundle_id), the library's lane (cpu), the engine "fake". The
// spec's ctx= and sessions= are the stage's n_ctx and max_sessions (--n-ctx, --max-sessions and --threads
// are not the fake's, as in `dgr worker serve --fake-engine`).
void open_fake_stage(const Options & o, Stage & s) {
    s.lib = dgr::load_fake_engine_lib(self_dir());
    int32_t n_stages = 0;
    int32_t len = s.lib.fake_spec(o.fake_engine.c_str(), nullptr, 0, &n_stages);
    if (len < 0) throw std::runtime_error(s.lib.error(DGR_E_ENGINE));
    std::string spec(size_t(len) + 1, '\0');
    s.lib.fake_spec(o.fake_engine.c_str(), &spec[0], int32_t(spec.size()), &n_stages);
    spec.resize(size_t(len));
    if (o.stage < 0 || o.stage >= n_stages) {
        throw std::runtime_error("fake bundle has " + std::to_string(n_stages) + " stages; there is no stage " +
                                 std::to_string(o.stage));
    }
    std::string lane = s.lib.lane();
    if (!o.lane.empty() && o.lane != lane) {
        throw std::runtime_error("--lane " + o.lane + ": the fake engine serves the " + lane + " lane; drop --lane");
    }
    s.id.model = "fake:" + spec;
    s.id.bundle_id = "fake-" + sha256_hex(spec).substr(0, 16);
    s.id.stage_index = o.stage;
    s.id.stage_count = n_stages;
    s.id.lane = lane;
    s.id.engine = "fake";
    s.id.wire_dtype = o.wire_dtype.empty() ? dgr::DEFAULT_WIRE_DTYPE : o.wire_dtype;
    if (!dgr::find_dtype(s.id.wire_dtype)) {
        throw std::runtime_error("unknown wire dtype '" + s.id.wire_dtype + "'; use one of " DGR_WIRE_DTYPE_NAMES);
    }
    s.id.engine_blake3 = dgr::blake3_file(s.lib.path);
    const std::string open = spec + ",stage=" + std::to_string(o.stage);
    dgr_open_params p{};
    int32_t st = s.lib.open(open.c_str(), &p, &s.eng);
    if (st != DGR_OK) throw std::runtime_error(s.lib.error(st));
    s.id.numerics = s.lib.numerics(s.eng);
    dgr_stage_info info{};
    st = s.lib.describe(s.eng, &info);
    if (st != DGR_OK) throw std::runtime_error(s.lib.error(st));
    check_stage(s, info);
}

}  // namespace dgr::serve
