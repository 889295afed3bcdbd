/* C ABI smoke test of the ShardEngine, in C (the header must be plain C).
 *
 * Built twice (toolchains/bazel/tests/BUILD.bazel): linked against the engine library, and with
 * DGR_ABI_DLOPEN against the released shared object (argv[1]), which must export every function
 * of the ABI. Checks what needs no model: versions, the size of every shared struct as the library was
 * compiled against C's own (dgr_abi_struct_size), hooks compiled in, and that bad input gets a status and a
 * message, not a crash.
 */
#include <stdio.h>
#include <string.h>

#include "dgr_engine.h"

#ifdef DGR_ABI_DLOPEN
#include <dlfcn.h>
#endif

static int failures = 0;

#define CHECK(cond, ...)                                             \
    do {                                                             \
        if (!(cond)) {                                               \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                            \
            fprintf(stderr, "\n");                                   \
            failures++;                                              \
        }                                                            \
    } while (0)

typedef int32_t (*fn_i32)(void);
typedef int32_t (*fn_size)(const char *);
typedef const char * (*fn_str)(void);
typedef int32_t (*fn_open)(const char *, const dgr_open_params *, dgr_engine **);

int main(int argc, char ** argv) {
    fn_i32 abi_version = dgr_abi_version;
    fn_size struct_size = dgr_abi_struct_size;
    fn_i32 has_hooks = dgr_has_hooks;
    fn_str last_error = dgr_last_error;
    fn_open engine_open = dgr_engine_open;
#ifdef DGR_ABI_DLOPEN
    CHECK(argc == 2, "usage: %s LIBDGR_ENGINE.so", argv[0]);
    if (argc != 2) return 1;
    void * lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    CHECK(lib != NULL, "dlopen %s: %s", argv[1], dlerror());
    if (!lib) return 1;
    /* every function dgr_engine.h declares: from ABI 5 on none is optional */
    static const char * abi[] = {
        "dgr_abi_version", "dgr_abi_struct_size", "dgr_has_hooks", "dgr_engine_lane", "dgr_last_error",
        "dgr_last_cache_miss", "dgr_engine_open", "dgr_engine_close", "dgr_engine_describe", "dgr_engine_memory",
        "dgr_session_open", "dgr_session_close", "dgr_session_n_cached", "dgr_session_truncate",
        "dgr_engine_can_truncate", "dgr_session_state_get", "dgr_session_state_set", "dgr_forward",
        "dgr_vocab_read", "dgr_engine_vocab", "dgr_tokenize", "dgr_detokenize", "dgr_quantize", "dgr_sample",
        "dgr_logprobs", "dgr_exp_fixed", "dgr_uniform", "dgr_grammar_open", "dgr_grammar_close",
        "dgr_grammar_apply", "dgr_grammar_accept", "dgr_json_schema_to_grammar", "dgr_mtp_draft",
    };
    for (size_t i = 0; i < sizeof(abi) / sizeof(abi[0]); i++) {
        CHECK(dlsym(lib, abi[i]) != NULL, "%s is not exported by %s", abi[i], argv[1]);
    }
    abi_version = (fn_i32) dlsym(lib, "dgr_abi_version");
    struct_size = (fn_size) dlsym(lib, "dgr_abi_struct_size");
    has_hooks = (fn_i32) dlsym(lib, "dgr_has_hooks");
    last_error = (fn_str) dlsym(lib, "dgr_last_error");
    engine_open = (fn_open) dlsym(lib, "dgr_engine_open");
    if (!abi_version || !struct_size || !has_hooks || !last_error || !engine_open) return 1;
#else
    (void) argc;
    (void) argv;
#endif

    CHECK(abi_version() == DGR_ABI_VERSION, "ABI %d, header says %d", abi_version(), DGR_ABI_VERSION);
    /* the library's structs are C's, byte for byte: each named here (not from DGR_ABI_STRUCTS, so that a
       struct left out of that list fails too), and DGR_ABI_STRUCTS names exactly these */
    struct { const char * name; size_t size; } structs[] = {
        {"dgr_open_params", sizeof(dgr_open_params)}, {"dgr_stage_info", sizeof(dgr_stage_info)},
        {"dgr_vocab_info", sizeof(dgr_vocab_info)},   {"dgr_step", sizeof(dgr_step)},
        {"dgr_step_out", sizeof(dgr_step_out)},       {"dgr_memory", sizeof(dgr_memory)},
    };
    for (size_t i = 0; i < sizeof(structs) / sizeof(structs[0]); i++) {
        CHECK(struct_size(structs[i].name) == (int32_t) structs[i].size, "%s is %d bytes in the library, %zu in C",
              structs[i].name, struct_size(structs[i].name), structs[i].size);
    }
#define DGR_COUNT(s) + 1
    CHECK(0 DGR_ABI_STRUCTS(DGR_COUNT) == (int) (sizeof(structs) / sizeof(structs[0])),
          "DGR_ABI_STRUCTS names %d structs, this test %zu", 0 DGR_ABI_STRUCTS(DGR_COUNT),
          sizeof(structs) / sizeof(structs[0]));
#undef DGR_COUNT
    CHECK(struct_size("dgr_no_such_struct") == -1, "an unknown name is %d bytes", struct_size("dgr_no_such_struct"));
    CHECK(struct_size("dgr_engine") == -1, "the opaque dgr_engine has a size: %d", struct_size("dgr_engine"));
    CHECK(struct_size(NULL) == -1, "NULL has a size: %d", struct_size(NULL));
    CHECK(has_hooks() == 1, "the engine was built without the layer-range hooks");

    const char * missing = "/nonexistent/dgr-abi-test.gguf";
    dgr_open_params params;
    memset(&params, 0, sizeof(params));
    params.max_sessions = 1;
    dgr_engine * eng = NULL;
    int32_t st = engine_open(missing, &params, &eng);
    CHECK(st != DGR_OK, "opening a missing file succeeded");
    CHECK(eng == NULL, "a failed open returned an engine");
    const char * err = last_error();
    CHECK(err != NULL && strlen(err) > 0, "no error message after a failed open");
    if (err) {
        CHECK(strstr(err, missing) != NULL, "the message does not name the file: %s", err);
    }

    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("engine C ABI v%d: 1 passed, 0 failed\n", DGR_ABI_VERSION);
    return 0;
}
