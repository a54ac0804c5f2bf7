"""The pieces of a self-contained HTML page (nothing to fetch): figures
inline as base64 PNG, every text escaped. Used by ``megatronapp report`` and
by ``megatronapp sweep --report``."""
from __future__ import annotations

import base64
import html
import io
import json
from typing import Any, Iterable, Iterator, Mapping, Sequence

from matplotlib.figure import Figure

STYLE = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;
color:#222}h1{margin-bottom:0}section{margin:2em 0}img{max-width:100%;border:1px solid #ddd}
pre{background:#f6f6f6;padding:1em;overflow:auto}.verdict{border-left:6px solid #D62728;
padding-left:1em}.healthy{border-left-color:#55A868}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left}.cost{font-size:1.25em;
font-weight:600}"""


def inline_png(fig: Figure, alt: str, dpi: int) -> str:
    """``fig`` as an inline PNG."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def section(ident: str, title: str, body: str) -> str:
    return f'<section id="{ident}"><h2>{html.escape(title)}</h2>\n{body}\n</section>'


def pre(lines: Iterator[str] | list[str]) -> str:
    return "<pre>" + html.escape("\n".join(lines)) + "</pre>"


def table(rows: Mapping[str, Any]) -> str:
    """A two-column table: one row per key."""
    cells = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(cell_text(v))}</td></tr>"
                    for k, v in rows.items())
    return f"<table>{cells}</table>"


def grid_table(columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> str:
    """A table with a header row: one row per mapping, one column per name."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell_text(r.get(c)))}</td>"
                                    for c in columns) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def cell_text(v: Any) -> str:
    if v is None:
        return ""
    return f"{v:.6g}" if isinstance(v, float) else json.dumps(v) if isinstance(v, (dict, list)) \
        else str(v)


def page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(title)}</title><style>{STYLE}</style>"
            f"</head><body><h1>{html.escape(title.split(':')[0])}</h1>\n{body}\n</body></html>\n")
