"""Reading user files as text, YAML and JSON without surprises.

Every failure is a ``ValueError`` subclass chosen by the caller (scenario or
trace error) carrying one line: undecodable bytes, nesting too deep for the
parser, duplicate YAML keys. Nothing read here is ever evaluated.
"""
from __future__ import annotations

import codecs
import json
import sys
from collections import deque
from typing import Any, Callable

import yaml

from ..errors import UserError

MAX_DEPTH = 64  # deeper than any scenario or trace we write; parsers recurse per level
MAX_NODES = 10_000_000  # values a scenario may expand to (YAML aliases can multiply them)

_UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE, codecs.BOM_UTF32_LE,
               codecs.BOM_UTF32_BE)


class TextError(ValueError):
    """A file or value that cannot be read as the text it should be (one line)."""


def one_line_errors(prog: str, run: Callable[[], int]) -> int:
    """``run()``'s exit status; bad input it names (a user or text error) as
    one line on stderr and status 2, for scripts outside the CLI."""
    try:
        return run()
    except (UserError, TextError) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2


def decode_utf8(raw: bytes, what: str) -> str:
    """UTF-8 (with or without a byte-order mark); say what else it looks like."""
    if raw.startswith(_UTF16_BOMS):
        raise TextError(f"{what} is UTF-16/32 text, not UTF-8; save it as UTF-8")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        kind = "binary data" if b"\0" in raw[:4096] else "text in another encoding"
        raise TextError(f"{what} is not UTF-8 (byte 0x{raw[err.start]:02x} at offset "
                        f"{err.start}; looks like {kind})") from None


def _children(node: Any) -> Any:
    if isinstance(node, dict):
        return node.values()
    return node if isinstance(node, list) else ()


def structure_size(data: Any) -> tuple[int, int]:
    """(depth, expanded value count) of decoded data, without recursion. A
    shared node (a YAML alias) counts each time it appears, as consumers see it;
    each distinct node is visited once, so alias bombs are measured cheaply."""
    sizes: dict[int, tuple[int, int]] = {}
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        node, expanded = stack.pop()
        if id(node) in sizes:
            continue
        kids = list(_children(node))
        if expanded or not kids:
            depth = 1 + max((sizes[id(k)][0] for k in kids), default=0)
            count = 1 + sum(sizes[id(k)][1] for k in kids)
            sizes[id(node)] = (min(depth, MAX_DEPTH + 1), min(count, MAX_NODES + 1))
            continue
        if len(stack) > 4 * MAX_NODES:
            return MAX_DEPTH + 1, MAX_NODES + 1
        stack.append((node, True))
        stack.extend((k, False) for k in kids)
    return sizes[id(data)]


def check_depth(data: Any, what: str) -> None:
    depth, count = structure_size(data)
    if depth > MAX_DEPTH:
        raise TextError(f"{what} is nested more than {MAX_DEPTH} levels deep")
    if count > MAX_NODES:
        raise TextError(f"{what} expands to more than {MAX_NODES:,} values (aliases?)")


# -------------------------------------------------------------------- YAML
_BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _UniqueKeyLoader(_BaseLoader):  # type: ignore[misc, valid-type]
    """Safe YAML in which a mapping that repeats a key is an error, not a
    silent 'last one wins' (merge keys ``<<`` may still be overridden)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                continue  # unhashable: the base constructor reports it
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
        return super().construct_mapping(node, deep)


def _check_event_depth(text: str, what: str) -> None:
    """Walk the parser's events (no recursion) before anything builds nested
    objects: the composer recurses per level and crashes on deep input."""
    depth = 0
    for event in yaml.parse(text, Loader=_BaseLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise TextError(f"{what} is nested more than {MAX_DEPTH} levels deep")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def load_yaml(text: str, what: str) -> Any:
    """Parse YAML; duplicate keys, syntax errors, deep nesting and alias bombs
    are one line."""
    try:
        _check_event_depth(text, what)
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except TextError:
        raise
    except RecursionError:
        raise TextError(f"{what} is nested too deeply") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(err, "problem", None)
        if problem and "nesting depth" in problem:  # libyaml's own limit, met while scanning ahead
            raise TextError(f"{what} is nested too deeply{where}") from None
        if problem and problem.startswith("duplicate key"):
            raise TextError(f"{what}: {problem}{where}") from None
        raise TextError(f"{what} is not valid YAML{where}") from None
    except ValueError as err:  # e.g. an integer with more digits than Python converts
        raise TextError(f"{what} is not valid YAML ({str(err).splitlines()[0][:80]})") from None
    check_depth(data, what)
    return data


# -------------------------------------------------------------------- JSON
def load_json_bytes(raw: bytes, what: str) -> Any:
    """JSON from UTF-8 bytes; bad bytes, syntax and runaway nesting are one line.
    NaN/Infinity parse (as Python does) so that callers can name the field."""
    text = decode_utf8(raw, what)
    try:
        return json.loads(text)
    except RecursionError:
        raise TextError(f"{what} is nested too deeply") from None
    except json.JSONDecodeError as err:
        raise TextError(f"{what} is not valid JSON (line {err.lineno}: {err.msg})") from None
    except ValueError as err:  # e.g. an integer with more digits than Python converts
        raise TextError(f"{what} is not valid JSON ({str(err).splitlines()[0][:80]})") from None
