// llama-simple: llama.cpp's examples/simple (MIT, the same project as the pin), kept here because the
// pinned source tree (the PyPI sdist's vendored copy) ships no examples/. It loads a GGUF and greedily
// generates through llama.cpp's own path, none of dgr's engine code, so a test can check that llama.cpp
// itself accepts a file (tests/families/test_v4_synth.py). Built on demand from the engine's CMake build:
//
//   cmake --build .dgr/build/cpu --target llama-simple     # -> .dgr/build/cpu/bin/llama-simple
//
//   llama-simple -m MODEL.gguf [-n N_PREDICT] [-ngl N_GPU_LAYERS] PROMPT...
//
// It prints the prompt token by token, then up to N_PREDICT generated tokens, to stdout.
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static void usage(const char * argv0) {
    fprintf(stderr, "usage: %s -m MODEL.gguf [-n N_PREDICT] [-ngl N_GPU_LAYERS] PROMPT...\n", argv0);
}

static void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

int main(int argc, char ** argv) {
    std::string model_path;
    std::string prompt = "Hello my name is";
    int n_predict = 32;
    int ngl = 99;
    int i = 1;
    for (; i < argc; ++i) {
        if (strcmp(argv[i], "-m") == 0 && i + 1 < argc) {
            model_path = argv[++i];
        } else if (strcmp(argv[i], "-n") == 0 && i + 1 < argc) {
            n_predict = atoi(argv[++i]);
        } else if (strcmp(argv[i], "-ngl") == 0 && i + 1 < argc) {
            ngl = atoi(argv[++i]);
        } else {
            break; // the prompt: the rest of the arguments
        }
    }
    if (model_path.empty()) {
        usage(argv[0]);
        return 1;
    }
    if (i < argc) {
        prompt = argv[i++];
        for (; i < argc; ++i) {
            prompt += " ";
            prompt += argv[i];
        }
    }

    llama_log_set(quiet_log, nullptr); // backends are linked in statically: nothing to load

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = ngl;
    mp.progress_callback = [](float, void *) { return true; }; // no progress dots on stderr
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) {
        fprintf(stderr, "%s: error: unable to load model %s\n", argv[0], model_path.c_str());
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);

    const int n_prompt = -llama_tokenize(vocab, prompt.c_str(), (int32_t) prompt.size(), nullptr, 0, true, true);
    std::vector<llama_token> tokens(n_prompt);
    if (llama_tokenize(vocab, prompt.c_str(), (int32_t) prompt.size(), tokens.data(), n_prompt, true, true) < 0) {
        fprintf(stderr, "%s: error: failed to tokenize the prompt\n", argv[0]);
        return 1;
    }

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx   = (uint32_t) (n_prompt + n_predict - 1);
    cp.n_batch = (uint32_t) n_prompt;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "%s: error: failed to create the llama_context\n", argv[0]);
        return 1;
    }

    llama_sampler_chain_params sp = llama_sampler_chain_default_params();
    sp.no_perf = true;
    llama_sampler * smpl = llama_sampler_chain_init(sp);
    llama_sampler_chain_add(smpl, llama_sampler_init_greedy());

    auto print_piece = [&](llama_token id) -> bool {
        char buf[256];
        const int n = llama_token_to_piece(vocab, id, buf, sizeof(buf), 0, true);
        if (n < 0) {
            fprintf(stderr, "%s: error: failed to convert token %d to a piece\n", argv[0], id);
            return false;
        }
        fwrite(buf, 1, (size_t) n, stdout);
        return true;
    };
    for (llama_token id : tokens) {
        if (!print_piece(id)) {
            return 1;
        }
    }

    llama_batch batch = llama_batch_get_one(tokens.data(), (int32_t) tokens.size());
    llama_token next = 0;
    for (int n_pos = 0; n_pos + batch.n_tokens < n_prompt + n_predict;) {
        if (llama_decode(ctx, batch)) {
            fprintf(stderr, "%s: error: llama_decode failed\n", argv[0]);
            return 1;
        }
        n_pos += batch.n_tokens;
        next = llama_sampler_sample(smpl, ctx, -1);
        if (llama_vocab_is_eog(vocab, next)) {
            break;
        }
        if (!print_piece(next)) {
            return 1;
        }
        fflush(stdout);
        batch = llama_batch_get_one(&next, 1);
    }
    fputc('\n', stdout);

    llama_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
