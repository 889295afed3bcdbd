"""`dgr bench`: the whole model against the pipeline side by side (the bare command), plus its sections
(`--wan-rtt-ms`, `--dtypes`, `--speculate`); subcommands `soak` (concurrent sessions for
minutes, errors and RSS), `tls` (what mutual TLS costs per hop against plaintext), `frames` (gRPC against
hand-framed TCP and TLS per hop), `conversation` (what
the prefix cache buys a chat), `numerics` (how far apart the numerics this machine runs are),
`kernels` (what batch invariance costs on the CPU, against stock llama.cpp) and `scale` (the cost curve of 1, 2,
4, 8 stages)."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

from dgr.app.bench import pipeline_report
from dgr.core.errors import DgrError
from dgr.core.log import get_logger
from dgr.core.paths import workspace
from dgr.runtime.engine_abi import EXACT_KERNELS, library_path

log = get_logger(__name__)


def _soak(args) -> int:
    # lazy: dgr.app.bench.soak costs 187 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.bench.soak import run_soak, write_json

    rep = run_soak(args.minutes, stages=args.stages, sessions=args.sessions, fake=args.fake,
                   max_tokens=args.max_tokens, threads=args.threads, hostile=args.hostile)
    print(rep.table())
    if args.json:
        write_json(rep, args.json)
    return 0 if not rep.errors and not rep.breaches and not (rep.hostile and rep.mismatched) else 1


def _tls(args) -> int:
    # lazy: dgr.app.bench.tls_cost costs 181 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.bench.tls_cost import measure

    rep = measure(stages=args.stages, tokens=args.max_tokens, rounds=args.rounds, threads=args.threads)
    print(rep.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep.as_dict(), f, indent=2)
    return 0 if rep.same_text else 1


def _frames(args) -> int:
    # lazy: dgr.app.bench.frame_cost costs 154 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.bench.frame_cost import measure

    rep = measure(stages=args.stages, tokens=args.max_tokens, rounds=args.rounds, layers_per_stage=args.layers_per_stage)
    print(rep.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep.as_dict(), f, indent=2)
    return 0


def _conversation(args) -> int:
    # lazy: dgr.app.bench.conversation costs 364 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.bench.conversation import measure_conversation

    rep = measure_conversation(stages=args.stages, turns=args.turns, rtt_ms=args.wan_rtt_ms, max_tokens=args.max_tokens,
                               conversations=args.conversations, threads=args.threads)
    print(rep.table())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rep.as_dict(), f, indent=2)
    return 0 if rep.as_dict()["same_text"] else 1


def _write_json(path: str | None, obj) -> None:
    """--json FILE: the report, indented (nothing when not asked for)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2) + "\n")


def _numerics(args) -> int:
    # lazy: dgr.app.bench.numerics costs 196 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.bench.numerics import Variant, as_json, compare, default_models, table

    libs = [tuple(x.split("=", 1)) for x in args.lib] if args.lib else \
        [("x86-64-v3", str(library_path()))] + \
        ([("native", str(n))] if (n := workspace() / "build" / "cpu-native" / "libdgr_engine.so").is_file() else [])
    if any(len(x) != 2 or not Path(x[1]).is_file() for x in libs):
        raise DgrError("--lib LABEL=PATH: give a label and a built engine library (e.g. native=.dgr/build/cpu-native/"
                       "libdgr_engine.so from `dgr build-engine --cpu-variant native`)")
    variants = [Variant(f"{label} {k}", Path(path), k) for label, path in libs for k in ("reference", "invariant", "fast")]
    models = default_models(workspace() / "bench-numerics", variants[0].lib)
    rows = compare(models, variants, tokens=args.tokens, threads=args.threads, rounds=args.rounds)
    print(table(rows))
    _write_json(args.json, as_json(rows, args.tokens))
    return 0


def _peers(args) -> int:
    # lazy: dgr.app.bench.peers costs 164 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.bench.peers import bench_peers, plot, table

    rtts = [float(x) for x in args.rtt_ms.split(",")]
    prompts = [int(x) for x in args.prompt_lengths.split(",")]
    rep = bench_peers(Path(args.model) if args.model else None, hosts=args.hosts, rtts=rtts, prompts=prompts,
                      tokens=args.tokens, threads=args.threads, kernels=args.kernels,
                      chunk_tokens=args.chunk_tokens, mbit=args.mbit, speculate=args.speculate,
                      draft_k=args.draft_k)
    print(table(rep))
    _write_json(args.json, rep)
    if args.plot:
        print(f"plot: {plot(rep, args.plot)}")
    return 0


def _kernels(args) -> int:
    # lazy: dgr.app.bench.kernels costs 449 ms at start-up (python -X importtime, 2026-12-06)
    from dgr.app.bench.kernels import DEFAULT_POLL, VARIANTS, bench_kernels, default_models, plot, table

    def ints(text: str, flag: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise DgrError(f"{flag} {text!r}: give whole numbers separated by commas") from None

    variants = tuple(v.strip() for v in args.kernels.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise DgrError(f"--kernels {args.kernels!r}: choose from {', '.join(VARIANTS)}")
    lib = Path(args.lib) if args.lib else library_path()
    models = [(Path(m).name, Path(m)) for m in args.model] if args.model else \
        default_models(workspace() / "bench-kernels", lib, large_layers=args.large_layers)
    rep = bench_kernels(models, lib, threads=ints(args.threads, "--threads"),
                        prefills=ints(args.prompt_lengths, "--prompt-lengths"), tokens=args.tokens,
                        rounds=args.rounds, variants=variants,
                        poll=DEFAULT_POLL if args.poll is None else args.poll)
    print(table(rep))
    _write_json(args.json, rep)
    if args.plot:
        log.info("bench kernels: drew %s", plot(rep, args.plot))
    return 0


def _scale(args) -> int:
    # lazy: dgr.app.bench.scale costs 480 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.bench.scale import plot, run_scale, table

    try:
        counts = [int(x) for x in args.stages.split(",") if x.strip()]
    except ValueError:
        raise DgrError(f"--stages {args.stages!r}: give stage counts separated by commas, e.g. 1,2,4,8") from None
    if args.lib:
        os.environ["DGR_ENGINE_LIB"] = str(Path(args.lib).resolve())   # worker processes load the same one
    rep = run_scale(stages=counts, tokens=args.tokens, threads=args.threads, source=args.source, synth=args.synth,
                    synth_shape=args.synth_shape, lib=args.lib, keep=args.keep,
                    long_context_tokens=args.long_context, long_stages=args.long_stages,
                    long_chunk_tokens=args.chunk_tokens, kernels=args.kernels)
    print(table(rep))
    _write_json(args.json, rep)
    if args.plot:
        log.info("bench scale: drew %s", plot(rep, args.plot))
    lc = rep.get("long_context")
    return 0 if rep["same_tokens"] and (lc is None or (lc["logits_exact"] and lc["same_tokens"])) else 1


# ---------------------------------------------------------------------------------------- the sections
def _section(module: str, name: str, call):
    """Run `module.name` through `call(fn)`; a module or function not built yet, or a section that fails
    with a dgr error, is said so (the report carries {"error": ...} and the command fails) instead of a
    traceback that would lose the other sections."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return {"error": f"{module} is not built yet (no such module): this section cannot run in this checkout"}
    fn = getattr(mod, name, None)
    if fn is None:
        return {"error": f"{module}.{name} is not built yet: this section cannot run in this checkout"}
    try:
        return call(fn)
    except DgrError as e:                   # the other sections and the main figures are still written
        return {"error": str(e)}


def _dtype_summary(rows) -> str:
    if not rows:
        return "dtypes: the table has no rows"
    cols = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)   # noqa: E731
    width = {c: max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols}
    lines = ["  " + "  ".join(c.ljust(width[c]) for c in cols)]
    lines += ["  " + "  ".join(fmt(r.get(c, "")).ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def _extras(args, bundle, stages: int) -> dict:
    """The sections the flags ask for, each under its JSON key."""
    out: dict = {}
    if args.wan_rtt_ms is not None:
        log.info("bench: the emulated WAN, %g ms RTT%s", args.wan_rtt_ms,
                 f", {args.wan_mbit:g} Mbit/s" if args.wan_mbit else "")
        out["wan"] = _section("dgr.app.bench.wan", "measure_wan", lambda f: f(
            stages=stages, bundle=bundle, rtt_ms=args.wan_rtt_ms, mbit=args.wan_mbit, threads=args.threads))
        w = out["wan"]
        if "error" not in w:
            print(f"wan: {args.wan_rtt_ms:g} ms RTT: TPOT {w.get('tpot_ms', 0):.2f} ms against an ideal ring of "
                  f"{w.get('ideal_ring_ms', 0):.2f} ms ({w.get('tpot_over_ideal', 0):.3f}x)")
    if args.dtypes:
        log.info("bench: the wire dtype table")
        kw = {"n_threads": args.threads, **({"lib": args.lib} if args.lib else {})}
        if args.dtypes_out:
            kw["out"] = Path(args.dtypes_out)
        rows = _section("dgr.app.bench.dtypes", "run_dtype_table", lambda f: f(**kw))
        out["dtypes"] = rows if isinstance(rows, dict) else {"rows": rows}
        if not isinstance(rows, dict):
            print("dtypes:\n" + _dtype_summary(rows))
    if args.speculate == "mtp":
        log.info("bench: MTP drafts against n-gram drafts and none on DeepSeek V4, k=%d", args.draft_k)
        out["mtp"] = _section("dgr.app.bench.speculate_mtp", "measure_mtp", lambda f: f(
            stages=args.stages or 4, k=args.draft_k, rounds=args.rounds, tokens=args.tokens,
            rtt_ms=20.0 if args.wan_rtt_ms is None else args.wan_rtt_ms, agree=args.mtp_agree, threads=args.threads or 1))
        if "error" not in out["mtp"]:
            # lazy: dgr.app.bench.speculate_mtp costs 196 ms at start-up (python -X importtime, 2026-12-05)
            from dgr.app.bench.speculate_mtp import table

            print("mtp:\n" + table(out["mtp"]))
    elif args.speculate:
        log.info("bench: speculation (%s drafts, k=%d)", args.speculate, args.draft_k)
        out["spec"] = _section("dgr.app.bench.speculate_ngram", "measure_speculation", lambda f: f(
            stages=stages, bundle=bundle, threads=args.threads, k=args.draft_k))
        s = out["spec"]
        if "error" not in s:
            print(f"spec: {s.get('tokens_per_ring', 0):.2f} tokens per ring on the repetitive workload; "
                  f"TPOT with/without on the other {s.get('tpot_ratio_plain', 0):.3f}")
    if args.tls:
        log.info("bench: mutual TLS beside plaintext, %d rounds", args.rounds)
        out["tls"] = _section("dgr.app.bench.tls_cost", "measure", lambda f: f(
            stages=stages, bundle=_bundle_of(bundle), tokens=args.tokens, rounds=args.rounds,
            threads=args.threads).as_dict())
        t = out["tls"]
        if "error" not in t:
            print(f"tls: per-hop overhead {t['plaintext_per_hop_ms']:.3f} ms plaintext, {t['tls_per_hop_ms']:.3f} ms "
                  f"mutual TLS ({t['tls_cost_per_hop_ms']:+.3f}); decode {t['plaintext_decode_tok_s']:.1f} and "
                  f"{t['tls_decode_tok_s']:.1f} tok/s; same text: {'yes' if t['same_text'] else 'NO'}")
    for key, v in out.items():
        if isinstance(v, dict) and "error" in v:
            print(f"{key}: {v['error']}", file=sys.stderr)
    return out


def _bundle_of(bundle):
    """A Bundle from what the sections get (a folder, a Bundle, or None: the embedded SmolLM2)."""
    if bundle is None or hasattr(bundle, "manifest"):
        return bundle
    # lazy: dgr.toolchain.bundle.manifest costs 5 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain.bundle import load_bundle

    return load_bundle(bundle)


def _main(args) -> int:
    # lazy: dgr.app.bench.pipeline costs 202 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.bench.pipeline import prepare, rounded, run_bench, synth_bundle

    if args.lib:
        os.environ["DGR_ENGINE_LIB"] = str(Path(args.lib).resolve())   # worker processes load the same one
    try:
        lengths = [int(x) for x in args.prompt_lengths.split(",") if x.strip()]
    except ValueError:
        raise DgrError(f"--prompt-lengths {args.prompt_lengths!r}: give token counts separated by commas, "
                       "e.g. 32,128,256") from None
    if not lengths or min(lengths) < 1 or args.tokens < 2 or args.rounds < 1 or args.sessions < 1:
        raise DgrError("dgr bench: --prompt-lengths, --rounds and --sessions must be positive, --tokens at least 2")
    extras = args.wan_rtt_ms is not None or args.dtypes or args.speculate or args.tls
    if args.no_main and not extras:
        raise DgrError("dgr bench --no-main: nothing left to run; add --wan-rtt-ms, --dtypes, --speculate or --tls")
    rep: dict = {}
    stages, bundle = args.stages or 3, args.bundle
    if not args.no_main:
        setup = prepare(stages=args.stages, bundle=args.bundle, source=args.source, synth=args.synth,
                        lib=args.lib, threads=args.threads, wire_dtype=args.wire_dtype)
        rep = run_bench(setup, tokens=args.tokens, prompt_lengths=lengths, sessions=args.sessions,
                        rounds=args.rounds, n_ctx=args.n_ctx, kernels=args.kernels)
        stages, bundle = setup.stages, setup.bundle if (args.bundle or args.synth) else None
        print(pipeline_report.table(rep))
    elif args.synth:
        bundle = synth_bundle(args.synth, stages)[0]
    rep.update(_extras(args, bundle, stages))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rounded(rep), indent=2) + "\n")
        log.info("bench: wrote %s", args.json)
    if args.plot and "pipeline" in rep:
        log.info("bench: drew %s", pipeline_report.plot(rep, args.plot))
    failed = [k for k, v in rep.items() if isinstance(v, dict) and "error" in v]
    same = rep.get("pipeline", {}).get("same_tokens_as_whole", True)
    return 0 if same and not failed else 1


def register(sub) -> None:
    """Add `dgr bench` to the `dgr` parser."""
    bench = sub.add_parser("bench", help="the whole model vs the pipeline side by side; soak, tls",
                           description="Without ACTION: the whole model (in this process) against the pipeline "
                           "(one worker process per stage, loopback) on one bundle, side by side in one run. "
                           "docs/bench.md says what every number means.")
    bench.add_argument("--stages", type=int, default=None,
                       help="stages of the embedded SmolLM2 (2, 3 or 4; default 3) or of --synth; a --bundle has its own")
    bench.add_argument("--bundle", metavar="B", help="a bundle folder (default: the embedded SmolLM2, built if missing)")
    bench.add_argument("--source", metavar="GGUF", help="the bundle's source model for the whole-model side "
                       "(default: found from its manifest)")
    bench.add_argument("--synth", metavar="ARCH", help="a fresh tiny random-weight ARCH model (`dgr synth --list`) "
                       "split into --stages, instead of SmolLM2")
    bench.add_argument("--lib", help="engine library (default: $DGR_ENGINE_LIB or the CPU build, built if missing)")
    bench.add_argument("--threads", type=int, default=1,
                       help="compute threads of every worker process and of the whole model (default 1)")
    bench.add_argument("--wire-dtype", help="boundary dtype of the workers (default: the bundle's)")
    bench.add_argument("--tokens", type=int, default=64, help="decode tokens per generation (default 64)")
    bench.add_argument("--prompt-lengths", default="32,128,256", help="prefill prompt lengths (default 32,128,256)")
    bench.add_argument("--sessions", type=int, default=4, help="concurrent sessions against one (default 4)")
    bench.add_argument("--kernels", choices=EXACT_KERNELS, default="reference",
                       help="the CPU kernel set of every worker and of the whole model (default reference, the "
                            "workers' default; invariant: ggml's batch-invariant dispatch, docs/batching.md)")
    bench.add_argument("--n-ctx", type=int, default=None,
                       help="positions per session on both sides (default: the embedded model's default, or the "
                            "prompts and tokens asked for on a synthetic one; lower it for a large --bundle: each "
                            "worker holds its layers' KV for --sessions+2 sessions of this length)")
    bench.add_argument("--rounds", type=int, default=3,
                       help="rounds alternating whole and pipeline; medians over them (default 3)")
    bench.add_argument("--json", metavar="FILE", help="write the report as JSON")
    bench.add_argument("--plot", metavar="FILE.png", help="draw tok/s bars and the per-hop breakdown (matplotlib)")
    bench.add_argument("--wan-rtt-ms", type=float, metavar="R", help="also: the pipeline through emulated links "
                       "of R ms round trip per hop (JSON key `wan`)")
    bench.add_argument("--wan-mbit", type=float, metavar="B", help="with --wan-rtt-ms: each link's bandwidth")
    bench.add_argument("--dtypes", action="store_true", help="also: the wire dtype table, loss against f32 for "
                       "every ported architecture (writes docs/wire-dtypes.md; JSON key `dtypes`)")
    bench.add_argument("--dtypes-out", metavar="FILE", help="with --dtypes: write the table here instead")
    bench.add_argument("--speculate", choices=["ngram", "mtp"], help="also: speculative decoding over the ring. ngram: "
                       "two workloads, with and without (JSON key `spec`); mtp: MTP drafts against n-gram drafts and "
                       "none on tiny DeepSeek V4 bundles with the MTP block (random, agreeing at --mtp-agree, never "
                       "agreeing), on loopback and through links of --wan-rtt-ms (default 20) (JSON key `mtp`)")
    bench.add_argument("--mtp-agree", type=float, default=0.8, metavar="R", help="with --speculate mtp: the rate at "
                       "which the synthetic V4's MTP drafts agree with its trunk (default 0.8)")
    bench.add_argument("--draft-k", type=int, default=4, help="with --speculate: drafted tokens per trip (default 4)")
    bench.add_argument("--tls", action="store_true", help="also: the same bundle served with mutual TLS beside "
                       "plaintext, generations alternating; per-hop overhead and decode of each (JSON key `tls`)")
    bench.add_argument("--no-main", action="store_true", help="only the sections the flags above ask for")
    bench.set_defaults(func=_main)
    bsub = bench.add_subparsers(dest="bench_command", metavar="ACTION")
    p = bsub.add_parser("soak", help="N concurrent sessions generating over a local route for M minutes; "
                                     "errors by code and every process's RSS at start and end")
    p.add_argument("--minutes", type=float, required=True)
    p.add_argument("--stages", type=int, default=3, help="worker processes, one per stage (default 3)")
    p.add_argument("--sessions", type=int, default=4, help="concurrent client sessions (default 4)")
    p.add_argument("--fake", action="store_true",
                   help="the fake engine (no build, fast) instead of the SmolLM2 bundle `dgr demo` builds")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per generation (default 48)")
    p.add_argument("--threads", type=int, default=0, help="engine threads per worker (0: cores / stages)")
    p.add_argument("--hostile", type=int, default=0, metavar="N", help="also N hostile members attacking the route "
                   "in a loop, under mutual TLS (docs/security.md); honest tokens are compared with an undisturbed run")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.set_defaults(func=_soak)

    t = bsub.add_parser("tls", help="per-hop overhead of a mutual-TLS route against a plaintext one, the same "
                                    "SmolLM2 bundle, generations alternating")
    t.add_argument("--stages", type=int, default=3)
    t.add_argument("--rounds", type=int, default=5, help="generations per route, alternating (default 5)")
    t.add_argument("--max-tokens", type=int, default=48, help="tokens per generation (default 48)")
    t.add_argument("--threads", type=int, default=1, help="engine threads per worker (default 1)")
    t.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    t.set_defaults(func=_tls)

    fr = bsub.add_parser("frames", help="gRPC streaming (dgr-worker, plaintext and mutual TLS) against hand-framed "
                                        "TCP and TLS (dgr-hop-probe), per hop, alternating in one run (docs/wire.md)")
    fr.add_argument("--stages", type=int, default=3, help="processes in the ring (default 3)")
    fr.add_argument("--rounds", type=int, default=5, help="rounds, each measuring every kind once (default 5)")
    fr.add_argument("--max-tokens", type=int, default=64, help="decode tokens (probe frames) per measurement (default 64)")
    fr.add_argument("--layers-per-stage", type=int, default=2,
                    help="fake layers per stage, which sets each stage's compute (default 2, about 0.6 ms here; "
                         "14 gives SmolLM2's 4-5 ms on a 2-vCPU machine, so receivers sleep as long as in dgr bench)")
    fr.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    fr.set_defaults(func=_frames)

    c = bsub.add_parser("conversation", help="a chat through the gateway with and without the prefix cache: time "
                                             "to first token per turn on loopback and an emulated WAN, cache memory "
                                             "per 1,000 tokens, hit rate of interleaved conversations")
    c.add_argument("--stages", type=int, default=4, help="stages of the embedded SmolLM2 (default 4)")
    c.add_argument("--turns", type=int, default=10, help="turns of the conversation (default 10)")
    c.add_argument("--wan-rtt-ms", type=float, default=20.0, help="round trip per hop of the WAN links (default 20)")
    c.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default 16)")
    c.add_argument("--conversations", type=int, default=8, help="interleaved conversations (default 8)")
    c.add_argument("--threads", type=int, default=1, help="engine threads per worker (default 1)")
    c.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    c.set_defaults(func=_conversation)

    n = bsub.add_parser("numerics", help="how far apart the numerics this machine can run are (docs/numerics.md): "
                                         "logit differences, greedy divergence within --tokens, and speed, side by side")
    n.add_argument("--lib", action="append", metavar="LABEL=PATH", help="an engine library to compare, each with the "
                   "reference, the invariant and the fast kernels; the first is the reference (default: the workspace's CPU build, "
                   "then its native build if `dgr build-engine --cpu-variant native` made one)")
    n.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    n.add_argument("--threads", type=int, default=1, help="engine threads (default 1)")
    n.add_argument("--rounds", type=int, default=3, help="timed rounds, alternating the variants' order (default 3)")
    n.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    n.set_defaults(func=_numerics)

    pe = bsub.add_parser("peers", help="a dgr route against llama.cpp's own RPC backend (rpc-server, built from the "
                                       "pinned tree): the same model, hosts and threads, through emulated links")
    pe.add_argument("--model", metavar="GGUF", help="the model (default: the embedded SmolLM2; `dgr synth --shape "
                    "llama-7b` writes one of a real size)")
    pe.add_argument("--hosts", type=int, default=3, help="processes the layers are split over (default 3)")
    pe.add_argument("--rtt-ms", default="0,1,5,20", help="round trips per link to measure at (default 0,1,5,20)")
    pe.add_argument("--prompt-lengths", default="64,512,2048", help="TTFT prompts (default 64,512,2048; those "
                    "longer than the model's context are left out)")
    pe.add_argument("--tokens", type=int, default=32, help="decode tokens (default 32)")
    pe.add_argument("--threads", type=int, default=1, help="compute threads per process (default 1)")
    pe.add_argument("--kernels", choices=EXACT_KERNELS, default="reference",
                    help="dgr's workers' CPU kernel set (default reference, the workers' default; invariant: ggml's "
                         "batch-invariant dispatch, docs/batching.md); RPC runs llama.cpp's stock fast kernels")
    pe.add_argument("--chunk-tokens", type=int, default=512,
                    help="dgr's prompt chunk: the stages run a prompt's chunks at once, pipelined (default 512)")
    pe.add_argument("--mbit", type=float, help="every link's bandwidth in Mbit/s, both sides (default: no cap)")
    pe.add_argument("--speculate", choices=["ngram"], help="also dgr's TPOT with n-gram drafts on a workload whose "
                    "answer copies its prompt, and whether its text equals the run without (JSON dgr.tpot_spec_ms)")
    pe.add_argument("--draft-k", type=int, default=4, help="with --speculate: drafts per step (default 4)")
    pe.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    pe.add_argument("--plot", metavar="FILE.png", help="TPOT against the round trip, both sides")
    pe.set_defaults(func=_peers)

    k = bsub.add_parser("kernels", help="what batch invariance costs on the CPU: the same whole model on the "
                                     "invariant kernels, the reference kernels, llama.cpp's shape-dependent ones "
                                     "and stock llama.cpp, prefill and decode side by side (docs/batching.md)")
    k.add_argument("--model", action="append", metavar="GGUF", help="a model to measure (repeatable; default: "
                   "SmolLM2, a Q4_K model and Llama-2-7B's width with --large-layers layers, written once)")
    k.add_argument("--large-layers", type=int, default=8, help="layers of the large default model (default 8)")
    k.add_argument("--kernels", default=",".join(("invariant", "reference", "fast", "stock")),
                   help="which to measure (default: all; stock builds llama.cpp's own tools once, minutes)")
    k.add_argument("--threads", default="1,2", help="compute thread counts (default 1,2)")
    k.add_argument("--prompt-lengths", default="64,256,1024", help="prefill prompt lengths (default 64,256,1024)")
    k.add_argument("--tokens", type=int, default=32, help="decode tokens (default 32)")
    k.add_argument("--rounds", type=int, default=3, help="measured rounds after one warm-up (default 3)")
    k.add_argument("--poll", type=int, metavar="N", help="both sides' compute threads spin at this polling level "
                   "(0-100) before sleeping between graphs (default: llama.cpp's own, dgr.app.bench.kernels.DEFAULT_POLL)")
    k.add_argument("--lib", help="engine library (default: $DGR_ENGINE_LIB or the CPU build)")
    k.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    k.add_argument("--plot", metavar="FILE.png", help="speed relative to stock llama.cpp, per model (matplotlib)")
    k.set_defaults(func=_kernels)

    sc = bsub.add_parser("scale", help="the cost curve: one model split into 1, 2, 4, 8 stages (one process each); "
                                       "TPOT and its slope, per-hop overhead against the loopback floor, RSS per "
                                       "stage against its weights, the boundary per hop (docs/bench.md)")
    sc.add_argument("--source", metavar="GGUF", help="the model (default: the embedded SmolLM2's source GGUF)")
    sc.add_argument("--synth-shape", metavar="NAME", help="a random-weight model of a real size, written first "
                    "(`dgr synth --shape`: llama-7b, qwen2-7b; about 4 GB, and a bundle of that size per stage count)")
    sc.add_argument("--synth", metavar="ARCH", help="a tiny random-weight ARCH model (`dgr synth --list`), "
                    "for quick tries")
    sc.add_argument("--stages", default="1,2,4,8", help="stage counts to measure (default 1,2,4,8)")
    sc.add_argument("--tokens", type=int, default=32, help="greedy decode tokens per stage count (default 32)")
    sc.add_argument("--threads", type=int, default=1, help="compute threads per worker process (default 1)")
    sc.add_argument("--kernels", choices=EXACT_KERNELS, default="invariant",
                    help="the workers' CPU kernel set, an exact one (default invariant: tiled attention, which a long "
                         "prompt needs)")
    sc.add_argument("--lib", help="engine library (default: $DGR_ENGINE_LIB or the CPU build)")
    sc.add_argument("--long-context", type=int, default=0, metavar="N",
                    help="also the long-context lane: an N-token prompt (e.g. 32768) prefilled whole and on "
                         "--long-stages stages, TTFT, logits compared bit for bit, memory per stage (the model "
                         "needs room for N positions; --synth is written with it)")
    sc.add_argument("--long-stages", type=int, default=4, help="stages of the long-context lane's route (default 4)")
    sc.add_argument("--chunk-tokens", type=int, default=512,
                    help="prompt tokens per chunk the long-context lane's stages pipeline (default 512)")
    sc.add_argument("--keep", action="store_true", help="keep the model and bundles (their folder is logged)")
    sc.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    sc.add_argument("--plot", metavar="FILE.png", help="TPOT, per hop and RSS against the stage count (matplotlib)")
    sc.set_defaults(func=_scale)
