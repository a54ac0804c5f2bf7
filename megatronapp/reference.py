"""The reference page, written from the code so that it cannot drift: every
command's arguments (the argparse parsers ``megatronapp.cli`` builds) and every
scenario key (the pydantic model ``megatronapp.scenario.config.Scenario``) with
its type, default, description and, where it mirrors one, the Megatron-core
argument (``megatron_defaults.DEFAULTS``, else ``MIRRORS`` below).

    python -m megatronapp.reference           # write docs/reference.md
    python -m megatronapp.reference --check   # change nothing; exit 1 if it differs

``tests/test_reference.py`` fails when docs/reference.md is not what this writes.
"""
from __future__ import annotations

import argparse
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
from pathlib import Path
from typing import Annotated, Any, Iterator, Literal, Sequence, Union, get_args, get_origin

from pydantic import AliasChoices, BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .cli import build_parser
from .faults import KINDS, FaultSpec
from .io import gate
from .scenario.config import Scenario
from .scenario.megatron_defaults import DEFAULTS

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"

# Keys that mirror a Megatron-LM argument and are not in megatron_defaults.DEFAULTS
# (which names the argument of every key whose unset value follows Megatron's default).
MIRRORS: dict[str, str] = {
    "parallel.tp": "--tensor-model-parallel-size",
    "parallel.pp": "--pipeline-model-parallel-size",
    "parallel.context_parallel_size": "--context-parallel-size",
    "model.layers": "--num-layers",
    "model.hidden": "--hidden-size",
    "model.heads": "--num-attention-heads",
    "model.seq_len": "--seq-length",
    "model.micro_batch_size": "--micro-batch-size",
    "model.num_query_groups": "--num-query-groups",
    "model.activation": "--swiglu (swiglu)",
    "model.openai_gelu": "--openai-gelu",
}

# What a key means, for the keys whose definition carries no comment.
DESCRIPTIONS: dict[str, str] = {
    "name": "the run's name: the default output directory is runs/<name>",
    "iterations": "training iterations to run",
    "schedule": "the pipeline schedule (dfc, bfc and adaptive: MegaDPP's)",
    "parallel.tp": "tensor-parallel size",
    "parallel.pp": "pipeline-parallel size (stages)",
    "parallel.dp": "data-parallel size (replicas)",
    "parallel.vpp": "model chunks per pipeline rank (interleaved schedule)",
    "parallel.microbatches": "microbatches per iteration (global batch / (dp · micro_batch_size))",
    "model.layers": "transformer layers",
    "model.hidden": "hidden size",
    "model.heads": "attention heads",
    "model.seq_len": "sequence length in tokens",
    "model.vocab": "vocabulary size before Megatron's padding (make_vocab_size_divisible_by)",
    "model.micro_batch_size": "sequences per microbatch",
    "model.activation": "the MLP's activation (swiglu: a first projection twice as wide)",
    "cluster.gpus_per_node": "GPUs per node (intra-node links inside, inter-node links across)",
    "cluster.gpu.software": "the software generation (scenario/software.py): Megatron's defaults "
                            "and the fitted constants it takes",
    "cluster.gpu.tflops": "peak dense TFLOP/s of one GPU",
    "cluster.gpu.memory_gb": "memory of one GPU in GB",
    "cluster.links.inter_node_gbps": "bandwidth between nodes, Gbit/s per GPU",
    "training.optimizer": "the torch backend's optimizer",
    "training.lr": "the torch backend's learning rate",
    "training.recompute_num_layers": "layers per recomputed group (with recompute_method)",
    "model.attention_dropout": "attention-probability dropout (see hidden_dropout)",
    "cluster.links.latency_us": "latency of one message, µs (both link classes unless set apart)",
    "cluster.jitter.compute_sigma": "log-normal sigma of every compute op's duration (healthy noise)",
    "cluster.jitter.link_sigma": "log-normal sigma of every transfer's duration (healthy noise)",
    "costs.forward_s": "a fixed forward time per microbatch and stage, replacing the cost model",
    "costs.backward_s": "a fixed backward time per microbatch and stage",
    "costs.p2p_s": "a fixed pipeline transfer time",
    "costs.allreduce_s": "a fixed data-parallel all-reduce time",
    "costs.optimizer_s": "a fixed optimizer-step time",
    "faults[].rank": "the rank the fault hits",
    "faults[].ranks": "the two ranks whose link the fault hits",
    "faults[].factor": "how many times slower (a throttle: compute; a slow link: transfers)",
    "faults[].start_s": "simulated time the fault starts at, seconds",
    "faults[].end_s": "simulated time the fault ends at (unset: the end of the run)",
    "faults[].sigma": "log-normal sigma of the link's transfer times",
    "faults[].offset_us": "the rank's clock offset, µs",
    "faults[].drift_ppm": "the rank's clock drift, parts per million",
}
KIND = "which kind of entry this is (the sections below, one per kind)"

HEADER = """# Reference

Generated by `python -m megatronapp.reference` from the command-line parsers
(`megatronapp/cli.py` and each module's `cli.py`) and the scenario schema
(`megatronapp/scenario/config.py`); do not edit by hand. The tasks, step by
step: [README](../README.md#what-you-can-do).
"""


# ---------------------------------------------------------------- commands
def _cell(text: str) -> str:
    """One Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """``(name, help, parser)`` of each subcommand, in the order they were added."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            found += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return found


def _argument_name(action: argparse.Action) -> str:
    if not action.option_strings:
        return action.metavar or action.dest  # type: ignore[return-value]
    takes_value = action.nargs != 0
    metavar = action.metavar or (action.dest.upper() if takes_value else "")
    if action.choices is not None and action.metavar is None:
        metavar = "|".join(str(c) for c in action.choices)
    return ", ".join(action.option_strings) + (f" {metavar}" if takes_value else "")


def _default(action: argparse.Action) -> str:
    if action.default in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
        return ""
    return str(action.default)


def _help(action: argparse.Action, prog: str) -> str:
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = prog
    if action.choices is not None:
        params["choices"] = ", ".join(str(c) for c in action.choices)
    return (action.help or "") % params


def command_sections(parser: argparse.ArgumentParser, prefix: str = "") -> Iterator[str]:
    """One section per (sub)command: what it does and a table of its arguments."""
    for name, help_text, sub in _subcommands(parser):
        command = f"{prefix}{name}"
        lines = [f"### `megatronapp {command}`", "", _cell(help_text or sub.description or "")]
        rows = [a for a in sub._actions
                if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
                and a.help is not argparse.SUPPRESS]
        if rows:
            lines += ["", "| argument | default | what it does |", "|---|---|---|"]
            lines += [f"| `{_cell(_argument_name(a))}` | {_cell(_default(a))} | "
                      f"{_cell(_help(a, sub.prog))} |" for a in rows]
        yield "\n".join(lines) + "\n"
        yield from command_sections(sub, f"{command} ")


# ---------------------------------------------------------------- scenario
def field_comments(cls: type) -> dict[str, str]:
    """Each field's comments in the class's source: the comment lines right above
    it and the one at the end of its line, joined."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            text = token.string.lstrip("#").strip()
            if not text.startswith(("type:", "noqa")):  # a checker's marks, not a description
                comments[token.start[0]] = text
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                                tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.add(token.start[0])
    found: dict[str, str] = {}
    for number, line in enumerate(source.splitlines(), 1):
        match = re.match(r"    (\w+)\s*:", line)
        if match is None:
            continue
        above: list[str] = []
        previous = number - 1
        while previous in comments and previous not in code_lines:
            above.insert(0, comments[previous])
            previous -= 1
        trailing = [comments[number]] if number in comments and number in code_lines else []
        found[match.group(1)] = " ".join(above + trailing)
    return found


def _unwrap(annotation: Any) -> Any:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _members(annotation: Any) -> tuple[Any, ...]:
    """The alternatives of a union (``X | None`` included), else the type itself."""
    annotation = _unwrap(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(_unwrap(a) for a in get_args(annotation))
    return (annotation,)


def _bounds(metadata: Sequence[Any]) -> str:
    marks = []
    for item in metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            value = getattr(item, attr, None)
            if value is not None and abs(value) < 1000 and value not in marks:
                marks.append(f"{sign} {value:g}")
    return f" ({', '.join(marks)})" if marks else ""


def type_name(annotation: Any, metadata: Sequence[Any] = ()) -> str:
    """A field's type as a reader writes it: ``int (≥ 1)``, ``gelu | swiglu``, ``float or unset``."""
    extra = list(metadata)
    while get_origin(annotation) is Annotated:
        annotation, *more = get_args(annotation)
        extra += [m for m in more if not isinstance(m, FieldInfo)]
        extra += [c for m in more if isinstance(m, FieldInfo) for c in m.metadata]
    members = _members(annotation)
    if len(members) > 1:
        named = [type_name(m) for m in members if m is not type(None)]
        optional = " or unset" if type(None) in members else ""
        return " or ".join(named) + optional + _bounds(extra)
    origin = get_origin(annotation)
    if origin is Literal:
        return " | ".join(str(a) for a in get_args(annotation))
    if origin is tuple:
        args = [a for a in get_args(annotation) if a is not Ellipsis]
        inner = ", ".join(type_name(a) for a in args)
        return f"list of {inner}" if Ellipsis in get_args(annotation) else f"[{inner}]"
    name = getattr(annotation, "__name__", str(annotation))
    return name + _bounds(extra)


def _key_names(name: str, info: FieldInfo) -> tuple[str, str]:
    """The key a scenario writes, and any other name it accepts."""
    alias = info.validation_alias
    if isinstance(alias, AliasChoices):
        first, *others = [str(c) for c in alias.choices]
        return first, ", ".join(o for o in others if o != first)
    return (alias if isinstance(alias, str) else name), ""


def _default_text(info: FieldInfo) -> str:
    if info.default is PydanticUndefined and info.default_factory is None:
        return "required"
    value = info.default_factory() if info.default_factory else info.default  # type: ignore[call-arg]
    if value is None:
        return "unset"
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):
        return ", ".join("×".join(str(v) for v in item) for item in value)
    if isinstance(value, tuple):
        return ", ".join(str(v) for v in value) or "none"
    return str(value)


def _mirror(key: str) -> str:
    for row in DEFAULTS:
        if row.key == key:
            argument = f"`{row.argument}`" if row.argument.startswith("--") else row.argument
            return f"{argument} (Megatron: {row.megatron})"
    return f"`{MIRRORS[key]}`" if key in MIRRORS else ""


def _kind_of(model: type[BaseModel]) -> str | None:
    kind = model.model_fields.get("kind")
    if kind is not None and kind.is_required() and get_origin(kind.annotation) is Literal:
        return str(get_args(kind.annotation)[0])
    return None


def _concrete(model: type[BaseModel]) -> list[type[BaseModel]]:
    """A fault entry is held as the kinds' base; its schema is its kind's."""
    return list(KINDS.values()) if model is FaultSpec else [model]


def _section_models(annotation: Any) -> list[tuple[type[BaseModel], bool]]:
    """The models a field holds, each with whether it is a list of them."""
    found: list[tuple[type[BaseModel], bool]] = []
    for member in _members(annotation):
        listed = get_origin(member) is tuple
        for inner in (get_args(member) if listed else (member,)):
            for candidate in _members(inner):
                if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                    found += [(model, listed) for model in _concrete(candidate)]
    return found


def scenario_sections(model: type[BaseModel], path: str = "") -> Iterator[str]:
    """A table of ``model``'s keys, then one section per nested model."""
    comments = field_comments(model)
    doc = inspect.getdoc(model) if model.__doc__ else ""
    rows, nested = [], []
    for name, info in model.model_fields.items():
        key, also = _key_names(name, info)
        dotted = f"{path}{key}"
        models = _section_models(info.annotation)
        if models:
            nested += [(m, f"{dotted}[]" if listed else dotted, info) for m, listed in models]
            continue
        description = (info.description or comments.get(name) or DESCRIPTIONS.get(dotted)
                       or (KIND if name == "kind" else ""))
        if also:
            description = f"(also `{also}`) {description}".strip()
        rows.append(f"| `{dotted}` | {_cell(type_name(info.annotation, info.metadata))} | "
                    f"{_cell(_default_text(info))} | {_cell(description)} | "
                    f"{_cell(_mirror(dotted))} |")
    title = path.rstrip(".") or "top level"
    kind = _kind_of(model)
    lines = [f"### `{title}`" + (f" (kind: {kind})" if kind else ""), ""]
    if doc and model is not Scenario:
        lines += [_cell(doc), ""]
    if rows:
        lines += ["| key | type | default | what it means | Megatron-core argument |",
                  "|---|---|---|---|---|", *rows]
    yield "\n".join(lines) + "\n"
    for sub_model, sub_path, info in nested:
        yield from scenario_sections(sub_model, f"{sub_path}.")


# ---------------------------------------------------------------- page
def render(parser: argparse.ArgumentParser, scenario: type[BaseModel] = Scenario) -> str:
    parts = [HEADER, "## Commands\n",
             "`megatronapp --version` prints the installed version; every command takes "
             "`--help`.\n", *command_sections(parser),
             "## Scenario files\n",
             "A scenario is a YAML file of these keys (`--set dotted.key=value` overrides "
             "one). A key left unset means what the Megatron-core argument it mirrors means "
             "by default; `megatronapp predict` lists the defaults a scenario took. Sizes "
             "are counts, times in seconds (`_s`) or microseconds (`_us`), rates as named "
             "(`tflops`, `_gbps` in Gbit/s, `_tbps` in TB/s).\n",
             *scenario_sections(scenario)]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m megatronapp.reference",
                                  description=__doc__.split("\n\n")[0])
    cli.add_argument("--check", action="store_true",
                     help="change nothing; exit 1 if docs/reference.md differs")
    cli.add_argument("--out", type=Path, default=PAGE, help="where to write the page")
    args = cli.parse_args(argv)
    text = render(build_parser())
    if args.check:
        same = args.out.is_file() and gate.read_text(args.out, "--out") == text
        print(f"{args.out}: " + ("up to date" if same else
                                 "differs; run python -m megatronapp.reference"))
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
