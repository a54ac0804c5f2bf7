"""MegaScope's subcommands: ``scope generate``, ``summary``, ``query``, ``serve``, ``import``,
``lens``, ``patch`` and ``dla``."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator


from ..errors import UserError
from ..host import limits as host_limits
from ..io.outdirs import add_force_option, check_output

if TYPE_CHECKING:  # the backend loads with the command that needs it
    from ..program.backend import ScopeModel


def _yaml_arg(text: str, what: str) -> Any:
    """A YAML value given inline, or the path of a YAML file holding it (through
    the input gate); deep nesting and bad YAML are one line."""
    from ..io import gate
    from ..io.text import TextError, load_yaml

    try:
        is_file = gate.names_fit(text) and gate.exists(text, what)
        source = gate.read_text(text, what, gate.MAX_TEXT_BYTES) if is_file else text
        return load_yaml(source, what)
    except TextError as err:
        raise UserError(str(err)) from None


def _perturbations(items: list[str]) -> list[Any]:
    out: list[Any] = []
    for text in items:
        value = _yaml_arg(text, "--perturb")
        out += value if isinstance(value, list) else [value]
    return out


def generation_scope(ckpt: Any, observe: str | None, perturb: list[str], seed: int) -> Any:
    """The ``scope:`` section of a generation, validated like a scenario's."""
    from ..scenario.config import parse_scenario
    from .generate import default_observe

    m = ckpt.model
    obs = (_yaml_arg(observe, "--observe") if observe
           else default_observe(m.hidden, m.heads, m.ffn))
    if isinstance(obs, dict) and "observe" in obs:
        obs = obs["observe"]
    s = parse_scenario({"seed": seed, "model": m.model_dump(mode="json"), "data": {"kind": "random"},
                        "scope": {"observe": obs, "perturb": _perturbations(perturb)}})
    return s.scope


def _step_line(rec: Any, layers: list[int]) -> str:
    c = rec.clean
    top = " ".join(f"{t.token!r}:{t.prob:.2f}" for t in c.topk[:3])
    line = f"{rec.step:4d}  {c.token!r:>6}  {c.prob:6.3f}  {top}"
    if rec.perturbed is not None:
        dh = " ".join(f"L{n}:{rec.delta_h[n]:.3g}" for n in layers)
        line += f"  | {rec.perturbed.token!r:>6} {rec.perturbed.prob:6.3f}  KL {rec.kl:.4f}  {dh}"
    return line


def _model() -> ScopeModel:
    """The torch backend's runner of saved checkpoints, asked of the registry
    (its ``SCOPE_MODEL`` capability), not of a backend module."""
    from backends.registry import scope_model

    return scope_model("torch")


def cmd_generate(args: argparse.Namespace) -> int:
    from ..scenario.checkpoint import read_checkpoint
    from .storage import checkpoint_dir

    model = _model()  # a backend that cannot run checkpoints is refused before anything is read
    if args.observe:  # its YAML, before anything loads (checked against the model below)
        _yaml_arg(args.observe, "--observe")
    _perturbations(args.perturb)
    if args.tokens < 1:
        raise UserError(f"--tokens: must be >= 1, got {args.tokens}")
    if args.top_k < 1:
        raise UserError(f"--top-k: must be >= 1, got {args.top_k}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature: must be a finite number >= 0 (0: greedy), got "
                        f"{args.temperature}")
    check_output(Path(args.out), args.force)  # before any work
    ckpt = read_checkpoint(checkpoint_dir(args.checkpoint))
    scope = generation_scope(ckpt, args.observe, args.perturb, args.seed)
    _check_generation(args, ckpt, 1 + bool(scope.perturb))
    out = Path(args.out)
    try:
        with _model_warnings(args):
            text = _decode(args, ckpt, scope, out, model)
    except OSError as err:  # the output directory (nothing half-written is left)
        raise UserError(f"--out: cannot write {out}: {err.strerror or err}") from None
    if not args.json:
        print(f"text: {text!r}")
        print(f"wrote {out}/generation.jsonl, {out}/clean/" + (", " + str(out) + "/perturbed/"
                                                               if scope.perturb else ""))
    return 0


def _check_generation(args: argparse.Namespace, ckpt: Any, runs: int) -> None:
    """Refuse a decode too long for --max-seconds or the disk, before it starts."""
    m = ckpt.model
    parameters = 12 * m.layers * m.hidden ** 2 + m.vocab * m.hidden
    window = min(m.seq_len, len(args.prompt) + args.tokens)
    host_limits.enforce(args, host_limits.estimate_generation(args.tokens, parameters, window, runs),
                   Path(args.out).parent, what=f"decoding {args.tokens:,} tokens")


def _decode(args: argparse.Namespace, ckpt: Any, scope: Any, out: Path, model: ScopeModel
            ) -> str:
    """Generate into a staged ``out``, printing a line (or a JSON record) per step."""
    from ..io.outdirs import staged_dir

    layers = list(range(1, ckpt.model.layers + 1))
    text = args.prompt
    with staged_dir(out, args.force) as tmp, model.one_rank(), \
            open(tmp / "generation.jsonl", "w") as log:
        if not args.json:
            print(f"{ckpt.path}: {ckpt.model.layers} layers, hidden {ckpt.model.hidden}; "
                  f"prompt {args.prompt!r}, {args.tokens} tokens"
                  + (f", {len(scope.perturb)} perturbation(s) beside the clean run"
                     if scope.perturb else ""))
            print(" step   token       p  top-3" + ("  | perturbed     p  KL  ‖Δh‖/‖h‖ per layer"
                                                  if scope.perturb else ""))
        for rec in model.generate(ckpt, args.prompt, args.tokens, scope, seed=args.seed,
                                  k=args.top_k, temperature=args.temperature, out=tmp):
            record = rec.to_json()
            log.write(json.dumps(record) + "\n")
            text += rec.clean.token
            print(json.dumps(record) if args.json else _step_line(rec, layers), flush=True)
    return text


def cmd_summary(args: argparse.Namespace) -> int:
    from .storage import find_capture
    from .summary import summary_lines

    print("\n".join(summary_lines(find_capture(args.capture))))
    return 0


def cmd_query(args: argparse.Namespace) -> int:
    from ..scan.query import QueryLimits, answer, read_only, show
    from ..scan.query_options import Output
    from .storage import Capture, find_capture
    from .summary import connect

    read_only(args.sql)
    path, output, limits = find_capture(args.capture), Output.of(args), QueryLimits.of(args)
    show(answer(connect(Capture(path), limits), args.sql, output, Path(path),
                limits.max_seconds), output)
    return 0


def _live_model(checkpoint: Path) -> Any:
    """Live generation on the torch backend (one process, one rank)."""
    from ..scenario.checkpoint import read_checkpoint
    from .view.server import LiveModel

    ckpt = read_checkpoint(checkpoint)
    if ckpt.vocab is None:
        return None
    vocab, model = ckpt.vocab, _model()

    def run(prompt: str, tokens: int, k: int, perturb: list[dict[str, Any]]) -> Any:
        # a JSON object is YAML: the perturbation is validated like --perturb
        scope = generation_scope(ckpt, None, [json.dumps(p) for p in perturb], 0)
        return model.generate(ckpt, prompt, tokens, scope, k=k)

    m = ckpt.model
    return LiveModel(m.layers, m.heads, m.seq_len, run, vocab.decode)


def cmd_serve(args: argparse.Namespace) -> int:
    from ..host.listen import check_bind
    from .view.server import ServerConfig, ViewApp, bind, log_to_stderr, run_server
    from .view.follow import PartsFollower
    from .view.source import followed_source, open_source

    source = followed_source(args.capture) if args.follow else open_source(args.capture)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port: must be 0..65535, got {args.port}")
    limits = _limits(args)
    check_bind(args.host, args.allow_remote)
    sock = bind(args.host, args.port)
    port = sock.getsockname()[1]
    config = ServerConfig.local(args.host, port, args.allow_perturb)
    log_to_stderr()
    with contextlib.ExitStack() as stack:
        live = None
        if source.checkpoint_dir is not None:
            model = _model()
            print(f"loading {source.checkpoint_dir} for live generation ...", flush=True)
            stack.enter_context(_model_warnings(args))
            stack.enter_context(model.one_rank())
            live = _live_model(source.checkpoint_dir)
        _announce(args.host, port, config, source, live, args.follow)
        follower = PartsFollower(source.capture_dir) if args.follow else None
        run_server(ViewApp(source, live, config, follower), sock, limits)
    return 0


def _limits(args: argparse.Namespace) -> Any:
    from .view.server import Limits

    if not 0 < args.header_timeout < float("inf"):  # NaN too
        raise UserError(f"--header-timeout: must be a positive number of seconds, "
                        f"got {args.header_timeout}")
    if args.max_connections < 1:
        raise UserError(f"--max-connections: must be at least 1, got {args.max_connections}")
    return Limits(args.header_timeout, args.max_connections)


def _announce(host: str, port: int, config: Any, source: Any, live: Any,
              follow: bool) -> None:
    from ..host.listen import host_names, is_loopback, remote_warning
    from .view.server import url_host

    shown = url_host(host_names(host)[0])
    if not is_loopback(host):
        print(f"megatronapp: {remote_warning(host, port)}", file=sys.stderr, flush=True)
    print(f"MegaScope view of {source.capture_dir} "
          f"({'live generation on ' + str(source.checkpoint_dir) if live else 'capture only'}"
          f"{', following the run as it writes' if follow else ''}"
          f"{', perturbations allowed' if config.allow_perturb else ''}):", flush=True)
    print(f"  http://{shown}:{port}/?token={config.token}", flush=True)


@contextlib.contextmanager
def _model_warnings(args: argparse.Namespace, more: list[str] | None = None) -> Iterator[None]:
    """Megatron-core's warnings while the model loads and runs, printed at
    the end with ``--verbose`` only."""
    from .quiet import kept_warnings

    kept: list[str] = []
    try:
        with kept_warnings(kept):
            yield
    finally:
        if getattr(args, "verbose", False):
            for line in kept + (more or []):
                print(f"warning: {line}", file=sys.stderr)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _results_beside_capture(target: str, name: str, force: bool, with_plot: bool) -> Path:
    """The capture that ``scope lens``/``patch``/``dla`` results join, checked
    writable before any work."""
    from ..io.outdirs import check_file
    from .storage import find_capture

    capture = find_capture(target, "RUN_DIR")
    for suffix in (".json", ".png") if with_plot else (".json",):
        check_file(capture / f"{name}{suffix}", "RUN_DIR", force)
    return capture


def _show_saved(result: Any, as_json: bool, written: list[Path]) -> None:
    if as_json:
        print(json.dumps(result.to_json()))
        return
    print("\n".join(result.lines()))
    print("wrote " + ", ".join(str(p) for p in written))


def _checked_inputs(args: argparse.Namespace, prompts: dict[str, str],
                    answers: dict[str, str | None]) -> list[list[int]]:
    """Every prompt and answer checked against the checkpoint's tokenizer
    before the model loads; the prompts' token ids."""
    from ..scenario.checkpoint import read_checkpoint
    from .storage import checkpoint_dir
    from .tokens import encode_checked, one_token, tokenizer_of

    ckpt = read_checkpoint(checkpoint_dir(args.run))
    tokenizer = tokenizer_of(ckpt)
    ids = [encode_checked(tokenizer, text, ckpt.model.seq_len, field)
           for field, text in prompts.items()]
    for field, text in answers.items():
        if text is not None:
            one_token(tokenizer, text, field)
    return ids


def _as_option(message: str) -> str:
    """An analysis's error names its Python argument (``corrupt: ...``); the
    command's user typed the option (``--corrupt: ...``)."""
    field, sep, rest = message.partition(": ")
    if not (sep and field.isidentifier()):
        return message
    for name in ("clean_answer", "corrupt_answer"):
        rest = rest.replace(name, "--" + name.replace("_", "-"))
    return f"--{field.replace('_', '-')}: {rest}"


def _analysis(args: argparse.Namespace, backend: ScopeModel,
              run: Callable[[Any, Any], Any]) -> Any:
    """Load the model once (progress on stderr), run ``run(backend, model)``."""
    more: list[str] = []
    with _model_warnings(args, more):
        model = backend.load(args.run, pp=args.pp, tp=args.tp, say=_say)
        with model:
            more += model.warnings
            try:
                return run(backend, model)
            except UserError as err:
                raise UserError(_as_option(str(err))) from None


def cmd_lens(args: argparse.Namespace) -> int:
    from .lens import result_name, save

    backend = _model()
    if args.top_k < 1:
        raise UserError(f"--top-k: must be >= 1, got {args.top_k}")
    _checked_inputs(args, {"--prompt": args.prompt}, {})
    name = result_name("lens", args.prompt)
    capture = _results_beside_capture(args.run, name, args.force, False)
    result = _analysis(args, backend, lambda b, m: b.logit_lens(m, args.prompt, args.top_k))
    _show_saved(result, args.json, save(capture, name, result.to_json(), args.force))
    return 0


def cmd_patch(args: argparse.Namespace) -> int:
    from .lens import patch_sites, result_name, save

    backend = _model()
    sites = patch_sites(args.sites, args.per)
    clean, corrupt = _checked_inputs(args, {"--clean": args.clean, "--corrupt": args.corrupt},
                                     {"--clean-answer": args.clean_answer,
                                      "--corrupt-answer": args.corrupt_answer})
    if len(clean) != len(corrupt):
        raise UserError(f"--corrupt: must have as many tokens as --clean ({len(corrupt)} vs "
                        f"{len(clean)})")
    name = result_name("patch", args.clean, args.corrupt, *sites, args.clean_answer or "",
                       args.corrupt_answer or "", *([args.per] if args.per != "position" else []))
    capture = _results_beside_capture(args.run, name, args.force, True)
    result = _analysis(args, backend, lambda b, m: b.activation_patching(
        m, args.clean, args.corrupt, sites, args.per, args.clean_answer, args.corrupt_answer))
    _show_saved(result, args.json, save(capture, name, result.to_json(), args.force,
                                        result.plot))
    return 0


def cmd_dla(args: argparse.Namespace) -> int:
    from .lens import result_name, save

    backend = _model()
    _checked_inputs(args, {"--prompt": args.prompt},
                    {"--answer": args.answer, "--baseline": args.baseline})
    name = result_name("dla", args.prompt, args.answer or "", args.baseline or "")
    capture = _results_beside_capture(args.run, name, args.force, False)
    result = _analysis(args, backend, lambda b, m: b.direct_logit_attribution(
        m, args.prompt, args.answer, args.baseline))
    _show_saved(result, args.json, save(capture, name, result.to_json(), args.force))
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from ..io.outdirs import staged_dir
    from .imports import write_imported

    backend = _model()
    source, out = Path(args.source), Path(args.out)
    if not source.is_dir():
        raise UserError(f"SRC: {source} is not a directory")
    check_output(out, args.force)  # before any work
    _say(f"reading {source}")
    with _model_warnings(args):
        imported = backend.import_checkpoint(source)
    with staged_dir(out, args.force) as tmp:
        write_imported(imported, tmp, source)
    m = imported.model
    print(f"{imported.source['format']}: {m.layers} blocks, d_model {m.hidden}, {m.heads} heads, "
          f"vocabulary {imported.vocab_size}, context {m.seq_len}; wrote {out}/checkpoint")
    return 0


def _verbose_option(parser: Any) -> None:
    parser.add_argument("--verbose", action="store_true", help="print the model library's "
                        "warnings (megatron-core, Transformer Engine) kept while it loads")


def _analysis_options(parser: Any) -> None:
    """What ``scope lens``, ``patch`` and ``dla`` share: the run, how the
    model is split, the output."""
    parser.add_argument("run", metavar="RUN_DIR", help="a run directory (checkpoint/ and a "
                        "capture), a scope import output or a scope generate output")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages to split the model "
                        "over, one process each (default 1: this process)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage "
                        "(default 1)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    _verbose_option(parser)
    add_force_option(parser, "a result file beside the capture that megatronapp did not write")


def _register_lens(sub: Any) -> None:
    lens = sub.add_parser("lens", help="the logit lens: each layer's residual stream through "
                          "the final norm and unembedding")
    _analysis_options(lens)
    lens.add_argument("--prompt", required=True, help="the text read by the lens")
    lens.add_argument("--top-k", type=int, default=5, help="tokens kept per layer and position "
                      "(default 5)")
    lens.set_defaults(func=cmd_lens)

    patch = sub.add_parser("patch", help="activation patching, clean into corrupted, per site, "
                           "layer and position or head (a heat map beside the capture)")
    _analysis_options(patch)
    patch.add_argument("--clean", required=True, help="the clean prompt")
    patch.add_argument("--corrupt", required=True,
                       help="the corrupted prompt (as many tokens as --clean)")
    patch.add_argument("--sites", help="comma-separated sites to patch (default "
                       "resid_pre,attn_out,mlp_out per position; z per head)")
    patch.add_argument("--per", choices=("position", "head"), default="position",
                       help="patch one position at a time (default), or one head at every "
                       "position")
    patch.add_argument("--clean-answer", help="the clean answer (one token; default: the "
                       "model's first choice after --clean)")
    patch.add_argument("--corrupt-answer", help="the corrupted answer (default: the model's "
                       "first choice after --corrupt)")
    patch.set_defaults(func=cmd_patch)

    dla = sub.add_parser("dla", help="direct logit attribution: each attention head's share of "
                         "the answer's logit over a baseline's, at the prompt's last position")
    _analysis_options(dla)
    dla.add_argument("--prompt", required=True, help="the text; attributed at its last position")
    dla.add_argument("--answer", help="one token (default: the model's first choice)")
    dla.add_argument("--baseline", help="one token (default: the model's first choice other "
                     "than the answer)")
    dla.set_defaults(func=cmd_dla)

    imp = sub.add_parser("import", help="a checkpoint from the ecosystem (a Hugging Face GPT-2 "
                         "folder, a Megatron-LM checkpoint) as a run directory the analyses open")
    imp.add_argument("source", metavar="SRC", help="a folder written by save_pretrained "
                     "(config.json, model.safetensors or pytorch_model.bin), or a Megatron "
                     "checkpoint folder (torch_dist, or legacy mp_rank_00)")
    imp.add_argument("--out", required=True, metavar="RUN_DIR", help="the run directory to write")
    _verbose_option(imp)
    add_force_option(imp, "a previous scope import output in --out")
    imp.set_defaults(func=cmd_import)


def register(subparsers: Any, plot_hooks: list[Any]) -> None:
    scope = subparsers.add_parser("scope", help="MegaScope: generation with capture, capture "
                                  "summaries and SQL")
    sub = scope.add_subparsers(dest="scope_command", required=True)

    gen = sub.add_parser("generate", help="decode token by token with capture (and perturbation)")
    gen.add_argument("checkpoint", help="a checkpoint directory (or a run directory holding one)")
    gen.add_argument("--prompt", required=True, help="the text decoding starts from")
    gen.add_argument("--tokens", type=int, default=32, help="tokens to decode (default 32)")
    gen.add_argument("--perturb", action="append", default=[], metavar="YAML",
                     help="a perturbation as inline YAML, e.g. '{kind: act_noise, site: resid_post, "
                          "layers: [1], sigma: 0.5}', or a YAML file with a list (repeatable)")
    gen.add_argument("--observe", help="YAML list of observations (inline or a file); default: "
                     "pooled Q/K/V/MLP/residual pixels and attention statistics")
    gen.add_argument("--out", default="runs/scope_generate", help="capture directory "
                     "(default runs/scope_generate)")
    gen.add_argument("--top-k", type=int, default=5,
                     help="next-token probabilities kept per step (default 5)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--seed", type=int, default=0,
                     help="seeds sampling, perturbations and the PCA windows (default 0)")
    gen.add_argument("--json", action="store_true", help="print one JSON record per step")
    host_limits.add_options(gen)
    _verbose_option(gen)
    add_force_option(gen, "a previous capture in --out (only if it holds nothing else)")
    gen.set_defaults(func=cmd_generate)

    summ = sub.add_parser("summary", help="a readable table of a capture")
    summ.add_argument("capture", metavar="CAPTURE_DIR", help="a capture (or a run directory)")
    summ.set_defaults(func=cmd_summary)

    from ..scan.query_options import add_output_options  # no DuckDB import: --help stays fast

    q = sub.add_parser("query", help="SQL over a capture: tables stats, raw_index, injections")
    q.add_argument("capture", metavar="CAPTURE_DIR", help="a capture (or a run directory)")
    q.add_argument("sql", help='e.g. "SELECT layer, avg(value) FROM stats WHERE stat = \'std\' '
                   'GROUP BY layer"')
    add_output_options(q)
    q.set_defaults(func=cmd_query)

    srv = sub.add_parser("serve", help="the web view of a capture, with live generation when "
                         "a checkpoint is there (local: 127.0.0.1, a session token)")
    srv.add_argument("capture", metavar="CAPTURE_DIR_OR_RUN_DIR",
                     help="a capture, a run directory (scope/, checkpoint/) or a generate output")
    srv.add_argument("--port", type=int, default=8765, help="default 8765; 0 picks a free port")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to bind (default 127.0.0.1: this machine only); another "
                          "address needs --allow-remote")
    srv.add_argument("--allow-remote", action="store_true",
                     help="let --host be an address other machines can reach (0.0.0.0, ::, an "
                          "interface's address); the token is still required")
    srv.add_argument("--allow-perturb", action="store_true",
                     help="let the page run perturbed generations (bounded parameters)")
    srv.add_argument("--follow", action="store_true",
                     help="follow a run still writing its capture (parts/): the training view "
                          "gains each step as it arrives; no live generation")
    srv.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                     help="a connection that has not sent its request headers this long after "
                          "it opened (or after its last response) is closed (default 10)")
    srv.add_argument("--max-connections", type=int, default=64,
                     help="connections open at once; more are closed as they come (default 64)")
    _verbose_option(srv)
    srv.set_defaults(func=cmd_serve)
    _register_lens(sub)


