"""A self-contained HTML timeline page for trio_cuda lifetime traces.

``render_html(trace)`` takes a trace in Chrome trace-event JSON form (the dict the
trace exporter writes; the same data opens in ui.perfetto.dev) and returns one HTML
page drawing it: one lane per track grouped by scope, slices as bars, instants as
markers, flows as arrows, with hover details, zoom and pan.

Invariants of the page:

* No network: no CDN, no external fonts, scripts, stylesheets or images. Nothing in
  the page refers to a URL (no ``src`` or ``href``; ``url()`` only names ``#fragments``
  of the page itself): CSS, JavaScript, the SVG drawing and the data are all inline,
  so the page works offline and from ``file://``.
* Text from the trace (names, args, metadata) is escaped: in the markup with
  ``html.escape``; the drawing data is JSON in a ``<script type="application/json">``
  element with every ``<``, ``>`` and ``&`` written as a ``\\u`` escape (so neither
  ``</script>`` nor ``<!--`` can occur), read with ``JSON.parse`` and put into the
  page only through ``textContent`` and ``setAttribute``, never as markup.
* The output is ASCII: other characters become character references or JSON escapes.
* Malformed input does not raise: unknown phases and metadata are ignored, events
  without a finite time are skipped, values JSON cannot carry become strings.
* Standard library only.

Hooks for tests and tools: lanes have class ``lane`` and ``data-track``; drawn
events (slices and instants) class ``ev`` and ``data-cat``; ``#tooltip``,
``#legend``, ``#dropped`` (only when the recorder dropped events), ``#zoom-in``,
``#zoom-out``, ``#zoom-reset``. Once drawn, ``<body>`` has ``data-ready="1"`` and
``data-events`` (the number of ``.ev``); a script error is shown on the page and
counted in ``data-errors`` on ``<html>``.

The header's ``events`` fact counts the lifetime events recorded (``otherData.events``,
which is ``len(trace.events)``), never the JSON's records: one event becomes several
records (a retirement: complete and retire markers, lease slices, a flow's ends; each
track: its metadata). A trace without that count shows its ``records`` instead. The
``drawn`` fact counts the bars (``.ev`` slices), markers (``.ev`` instants) and flow
arrows the page draws.
"""

from __future__ import annotations

import html
import json
import math
import re
from typing import Any

__all__ = ["render_html"]

# Lane kinds by tid range, in display order within a scope (trio_cuda.trace
# numbers allocation tracks from 100000 on, sixteen per allocation).
_KINDS = (
    ("scope", 0, 0),
    ("task", 2000, 2999),
    ("stream", 1, 99),
    ("alloc", 1000, 1999),
    ("alloc", 100_000, 2**62),
)

# Instant categories: colour, marker shape, legend text. The last four also draw a
# line across their scope.
_INSTANTS: dict[str, tuple[str, str, str]] = {
    "scope": ("#6b7280", "dot", "scope event"),
    "alloc": ("#16a34a", "tri", "allocated"),
    "free": ("#111827", "bar", "really freed"),
    "submit": ("#7c3aed", "dot", "submitted"),
    "enqueue": ("#2563eb", "dot", "enqueued"),
    "wait": ("#ca8a04", "dot", "cross-stream wait"),
    "lease": ("#0284c7", "dot", "lease event"),
    "complete": ("#059669", "dot", "completion seen"),
    "retire": ("#64748b", "dot", "retired"),
    "cancel": ("#dc2626", "diamond", "waiter cancelled"),
    "drop": ("#ea580c", "diamond", "future dropped"),
    "quarantine": ("#c026d3", "diamond", "quarantined"),
    "error": ("#991b1b", "cross", "device error"),
}
_ALERTS = ["cancel", "drop", "quarantine", "error"]

# Slice styles (fill, stroke, legend text), chosen by _slice_style.
_SLICES: dict[str, tuple[str, str, str]] = {
    "kernel": ("#6366f1", "#4338ca", "kernel running"),
    "copy": ("#14b8a6", "#0f766e", "copy"),
    "fill": ("#94a3b8", "#64748b", "fill"),
    "host_closure": ("#f59e0b", "#b45309", "host closure"),
    "alive": ("#dcfce7", "#16a34a", "allocation alive"),
    "read": ("#7dd3fc", "#0284c7", "read lease"),
    "write": ("#fdba74", "#ea580c", "write lease"),
    "await": ("#ede9fe", "#7c3aed", "task awaiting"),
    "other": ("#e5e7eb", "#6b7280", "other"),
}
_MAX_ROWS = 8
_DEVICE_TIME = {
    "simulated": "times come from the simulated device",
    "cuda-events": "device times measured with CUDA events",
    "host-observed": "device times are host observations (approximate)",
}


def _kind(tid: int) -> tuple[int, str]:
    found = ((i, k) for i, (k, lo, hi) in enumerate(_KINDS) if lo <= tid <= hi)
    return next(found, (len(_KINDS), "other"))


def _slice_style(cat: str, name: str) -> str:
    if cat == "enqueue":
        return name if name in ("copy", "fill", "host_closure") else "kernel"
    if cat == "lease":
        return "write" if name == "write" else "read"
    return {"alloc": "alive", "submit": "await"}.get(cat, "other")


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value) if math.isfinite(value) else None
    except OverflowError:  # an int too large for a float
        return None


def _int(value: Any) -> int:
    f = _num(value)
    return int(f) if f is not None else 0


def _count(value: Any) -> int | None:
    """A count from the trace's metadata: an int >= 0, else None (unknown)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _clean(value: Any, depth: int = 0) -> Any:
    """A JSON-safe copy of an ``args`` value (finite numbers, bounded size)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return value[:2000]
    if isinstance(value, int):
        return value if abs(value) <= 2**53 else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth >= 6:
        return "..."
    if isinstance(value, list | tuple):
        return [_clean(v, depth + 1) for v in value[:200]]
    if isinstance(value, dict):
        return {str(k)[:200]: _clean(v, depth + 1) for k, v in list(value.items())[:200]}
    return str(value)[:2000]


def _model(trace: dict[str, Any]) -> dict[str, Any]:
    """Normalise a trace into what the page's script draws: scopes, lanes, events, flows."""
    raw = trace.get("traceEvents") if isinstance(trace, dict) else None
    events = [e for e in raw if isinstance(e, dict)] if isinstance(raw, list) else []
    procs: dict[int, dict[str, Any]] = {}
    tracks: dict[tuple[int, int], dict[str, Any]] = {}

    def track(pid: int, tid: int | None) -> dict[str, Any]:
        procs.setdefault(pid, {"pid": pid, "name": f"pid {pid}", "sort": pid})
        if tid is None:
            return procs[pid]
        return tracks.setdefault((pid, tid), {"pid": pid, "tid": tid, "name": f"tid {tid}", "sort": tid})

    # Each drawn event: [lane, ph, ts, dur, row, name, cat, args, style] (lane is (pid, tid) at first).
    drawn: list[list[Any]] = []
    flows: dict[tuple[int, str], list[tuple[float, int, int, int]]] = {}
    for e in events:
        ph, pid, tid = e.get("ph"), _int(e.get("pid")), _int(e.get("tid"))
        args: dict[str, Any] = e["args"] if isinstance(e.get("args"), dict) else {}
        if ph == "M":
            meta, value, order = e.get("name"), args.get("name"), _num(args.get("sort_index"))
            if meta in ("process_name", "thread_name") and value is not None:
                track(pid, tid if meta == "thread_name" else None)["name"] = str(value)
            elif meta in ("process_sort_index", "thread_sort_index") and order is not None:
                track(pid, tid if meta == "thread_sort_index" else None)["sort"] = order
            continue
        ts = _num(e.get("ts"))
        if ts is None or ph not in ("X", "i", "I", "s", "t", "f"):
            continue
        track(pid, tid)
        if ph in ("s", "t", "f"):
            key = (_int(e.get("id")), str(e.get("cat", "")))
            flows.setdefault(key, []).append((ts, "stf".index(ph), pid, tid))
            continue
        cat, name = str(e.get("cat") or "")[:100], str(e.get("name") or "")[:500]
        dur = max(0.0, _num(e.get("dur")) or 0.0) if ph == "X" else 0.0
        style = _slice_style(cat, name) if ph == "X" else ""
        drawn.append([(pid, tid), "X" if ph == "X" else "i", ts, dur, 0, name, cat, _clean(args), style])

    lanes: list[dict[str, Any]] = []
    lane_of: dict[tuple[int, int], int] = {}
    out_procs: list[dict[str, Any]] = []
    for p in sorted(procs.values(), key=lambda p: (p["sort"], p["pid"])):
        mine = [t for t in tracks.values() if t["pid"] == p["pid"]]
        mine.sort(key=lambda t: (_kind(t["tid"]), t["sort"], t["tid"]))
        out_procs.append({"name": p["name"], "first": len(lanes), "count": len(mine)})
        for t in mine:
            lane_of[(t["pid"], t["tid"])] = len(lanes)
            lanes.append(
                {"name": t["name"], "kind": _kind(t["tid"])[1], "rows": 1, "proc": len(out_procs) - 1}
            )

    # Pack each lane's slices into rows: a slice takes the first row free at its start,
    # so a nested slice (a lease inside "alive") sits below its parent.
    row_ends: dict[int, list[float]] = {}
    for d in sorted(drawn, key=lambda d: (d[2], -d[3])):
        d[0] = lane_of[d[0]]
        if d[1] == "X":
            ends = row_ends.setdefault(d[0], [])
            row = min(next((r for r, end in enumerate(ends) if end <= d[2]), len(ends)), _MAX_ROWS - 1)
            if row == len(ends):
                ends.append(0.0)
            ends[row] = max(ends[row], d[2] + d[3])
            d[4] = row
            lanes[d[0]]["rows"] = max(lanes[d[0]]["rows"], row + 1)
    drawn.sort(key=lambda d: (d[0], d[1] == "i", d[4], d[2]))

    times = [d[2] + d[3] * k for d in drawn for k in (0, 1)] + [p[0] for c in flows.values() for p in c]
    t0, t1 = (min(times), max(times)) if times else (0.0, 1000.0)
    t1 = max(t1, t0 + 1.0)

    # A quarantined allocation is hatched from the quarantine to the end of its "alive"
    # slice (the end of the trace when it has none).
    alive: dict[int, list[tuple[float, float]]] = {}
    for d in drawn:
        if d[1] == "X" and d[6] == "alloc":
            alive.setdefault(d[0], []).append((d[2], d[2] + d[3]))
    bands = []
    for d in drawn:
        if d[1] == "i" and d[6] == "quarantine":
            ends = [end for start, end in alive.get(d[0], []) if start <= d[2] <= end]
            bands.append([d[0], d[2], max(ends, default=t1)])

    chains = [(k[0], [[lane_of[(pid, tid)], ts] for ts, _, pid, tid in sorted(c)]) for k, c in flows.items()]
    other = trace.get("otherData") if isinstance(trace, dict) else None
    other = other if isinstance(other, dict) else {}
    return {
        "procs": out_procs,
        "lanes": lanes,
        "events": drawn,
        "flows": [c for c in chains if len(c[1]) >= 2],
        "bands": bands,
        "t0": t0,
        "t1": t1,
        "instants": {k: [c, s] for k, (c, s, _) in _INSTANTS.items()},
        "slices": {k: [f, s] for k, (f, s, _) in _SLICES.items()},
        "alerts": _ALERTS,
        "records": len(events),
        "recorded": _count(other.get("events")),
        "dropped": _int(other.get("dropped")),
        "backend": str(other.get("backend", "unknown")),
        "device_time": str(other.get("device_time", "unknown")),
        "version": str(other.get("trio_cuda", "")),
    }


def _script_json(value: Any) -> str:
    """JSON safe inside a ``<script>`` element: it holds no ``<``, ``>`` or ``&`` at all."""
    text = json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _legend() -> str:
    svg = '<span class="key"><svg width="22" height="16" aria-hidden="true">'
    marks = {
        "dot": '<circle cx="11" cy="8" r="4.5" fill="{c}"/>',
        "tri": '<path d="M7 3 L16 8 L7 13 Z" fill="{c}"/>',
        "bar": '<path d="M5 1 H13 V15 H5 V12 H10 V4 H5 Z" fill="{c}"/>',
        "diamond": '<path d="M11 1 L18 8 L11 15 L4 8 Z" fill="{c}"/>',
        "cross": '<path d="M6 3 L16 13 M16 3 L6 13" stroke="{c}" stroke-width="3.5"/>',
    }
    bars = "".join(
        f'{svg}<rect x="1" y="3" width="20" height="10" rx="2" fill="{f}" stroke="{s}"/></svg>{t}</span>'
        for f, s, t in _SLICES.values()
        if t != "other"
    )
    dots = "".join(
        f"{svg}{marks[shape].format(c=colour)}</svg><b>{cat}</b>&nbsp;{text}</span>"
        for cat, (colour, shape, text) in _INSTANTS.items()
    )
    lines = (
        f'{svg}<path d="M1 8 H17" stroke="#475569" stroke-width="1.3"/><path d="M15 4 L21 8 L15 12 Z"'
        ' fill="#475569"/></svg>submission flow: submit &rarr; complete &rarr; retire</span>'
        f'{svg}<rect x="1" y="3" width="20" height="10" fill="#fae8ff" stroke="#c026d3"/><path d="M4 13 L12 3'
        ' M10 13 L18 3 M16 13 L21 7" stroke="#e879f9" stroke-width="2.5"/></svg>quarantined memory (leaked,'
        f' never freed)</span>{svg}<path d="M11 0 V16" stroke="#dc2626" stroke-width="2"/></svg>a cancel'
        " (solid) or a drop, quarantine or error (dashed) marks its whole scope</span>"
    )
    rows = (("Bars", bars), ("Markers", dots), ("Lines", lines))
    body = "".join(
        f'<div class="lrow"><span class="lhead">{h}</span><span class="litems">{k}</span></div>'
        for h, k in rows
    )
    return f'<div id="legend">{body}</div>'


#: what each counted fact of the header counts (the hover text of the fact)
_FACT_HELP = {
    "events": "lifetime events the trace recorded (trace.events): an allocation, a free, a submission,"
    " an enqueue, a retirement, ...; one event may be drawn as several bars and markers",
    "records": "records of the trace-event JSON (metadata, slices, instants and flows)",
    "drawn": "bars (kernels, copies, allocations alive, leases, awaits) and markers the timeline draws,"
    " and arrows from each submission's work to its retirement",
}


def _title(text: str | None) -> str:
    return f' title="{html.escape(text)}"' if text else ""


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _counted(model: dict[str, Any]) -> tuple[str, str]:
    """The header's count: the lifetime events recorded (``trace.events``, as the
    trace's metadata counts them), or, for a trace without that count, its records."""
    if model["recorded"] is None:
        return ("records", f"{model['records']} in the JSON")
    dropped = f", {model['dropped']} dropped" if model["dropped"] > 0 else ""
    return ("events", f"{model['recorded']} recorded{dropped}")


def _drawn(model: dict[str, Any]) -> str:
    bars = sum(1 for e in model["events"] if e[1] == "X")
    marks = len(model["events"]) - bars
    return f"{_plural(bars, 'bar')}, {_plural(marks, 'marker')}, {_plural(len(model['flows']), 'flow arrow')}"


def render_html(trace: dict[str, Any], *, title: str = "trio_cuda trace") -> str:
    """Return a self-contained HTML page drawing ``trace`` (Chrome trace-event JSON, as a dict)."""
    if not isinstance(title, str):
        raise TypeError(f"title: expected a str, got {type(title).__name__} {title!r}")
    model = _model(trace)
    esc = html.escape
    dropped = ""
    if model["dropped"] > 0:
        dropped = (
            f'<div id="dropped" role="alert">&#9888; The recorder dropped {model["dropped"]} events:'
            " this timeline is incomplete (the recorder is bounded: a larger limit keeps them all).</div>"
        )
    hint = _DEVICE_TIME.get(model["device_time"])
    facts = [
        ("backend", model["backend"]),
        ("device time", model["device_time"] + (f" ({hint})" if hint else "")),
        _counted(model),
        ("drawn", _drawn(model)),
    ] + ([("trio_cuda", model["version"])] if model["version"] else [])
    parts = {
        "TITLE": esc(title),
        "FACTS": "".join(
            f'<span class="fact"{_title(_FACT_HELP.get(k))}><i>{esc(k)}</i> {esc(v)}</span>' for k, v in facts
        ),
        "DROPPED": dropped,
        "LEGEND": _legend(),
        "DATA": _script_json(model),
    }
    # One pass, so that text from the trace is never taken for a placeholder.
    page = re.sub(r"%%([A-Z]+)%%", lambda m: parts[m.group(1)], _TEMPLATE)
    return page.encode("ascii", "xmlcharrefreplace").decode("ascii")


_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>%%TITLE%%</title>
<style>
* { box-sizing: border-box; }
body { margin: 0; font: 13px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1f2937;
  background: #f8fafc; }
header { padding: 10px 16px 6px; background: #fff; border-bottom: 1px solid #e2e8f0; }
h1 { font-size: 18px; margin: 0 0 4px; font-weight: 650; }
.fact { display: inline-block; margin: 0 14px 2px 0; color: #334155; }
.fact i { font-style: normal; color: #64748b; margin-right: 2px; }
#dropped, #errors { margin: 8px 16px; padding: 7px 12px; border-radius: 6px; font-weight: 600;
  background: #fef3c7; border: 1px solid #f59e0b; color: #92400e; }
#errors { background: #fee2e2; border-color: #dc2626; color: #991b1b; }
#legend { padding: 6px 16px 3px; background: #fff; border-bottom: 1px solid #e2e8f0; font-size: 12px; }
.lrow { display: flex; align-items: flex-start; margin-bottom: 2px; }
.lhead { flex: 0 0 64px; font-weight: 650; color: #475569; line-height: 18px; }
.litems { display: flex; flex-wrap: wrap; align-items: center; gap: 0 14px; flex: 1; }
.key { display: inline-flex; align-items: center; gap: 3px; white-space: nowrap; color: #334155; height: 18px;
  }
.key b { font-weight: 600; }
#toolbar { display: flex; align-items: center; gap: 6px; height: 36px; padding: 0 16px; background: #f1f5f9;
  border-bottom: 1px solid #e2e8f0; position: sticky; top: 0; z-index: 3; }
#toolbar button { font: inherit; min-width: 30px; padding: 2px 9px; border: 1px solid #cbd5e1;
  border-radius: 5px; background: #fff; cursor: pointer; }
#toolbar button:hover { background: #e2e8f0; }
#view { font-variant-numeric: tabular-nums; color: #334155; margin: 0 10px 0 6px; white-space: nowrap; }
.help { color: #64748b; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; min-width: 0; }
#axis-wrap { position: sticky; top: 36px; z-index: 2; background: #fff; border-bottom: 1px solid #cbd5e1; }
svg { display: block; }
#chart { cursor: grab; user-select: none; touch-action: none; }
#chart.dragging { cursor: grabbing; }
.tick { font-size: 11px; fill: #475569; font-variant-numeric: tabular-nums; }
.lane-label { font-size: 12px; fill: #1e293b; }
.lane-kind { font-size: 8.5px; font-weight: 700; letter-spacing: .03em; }
.proc-label { font-size: 13px; font-weight: 700; fill: #0f172a; }
.ev-label { font-size: 10.5px; fill: #1e293b; pointer-events: none; }
.ev-label.light { fill: #fff; }
.ev:hover { filter: brightness(0.88); }
.ev.hl { filter: drop-shadow(0 0 1.5px #0f172a) drop-shadow(0 0 1px #0f172a); }
.flow.hl { opacity: 1; stroke: #0f172a; stroke-width: 2; }
.flow { fill: none; stroke: #475569; stroke-width: 1.2; opacity: .55; pointer-events: none; }
.alert { pointer-events: none; stroke-width: 2; opacity: .8; }
#empty { padding: 40px; text-align: center; color: #64748b; font-size: 15px; }
#tooltip { position: fixed; z-index: 10; display: none; max-width: 440px; padding: 7px 10px; font-size: 12px;
  background: #0f172a; color: #f8fafc; border-radius: 6px; pointer-events: none;
  box-shadow: 0 4px 14px rgba(0,0,0,.25); }
#tooltip .tt-name { font-weight: 700; margin-bottom: 3px; word-break: break-all; }
#tooltip td { padding: 0 8px 0 0; vertical-align: top; word-break: break-all; }
#tooltip td:first-child { color: #94a3b8; white-space: nowrap; }
</style>
</head>
<body>
<header><h1>%%TITLE%%</h1>%%FACTS%%</header>
%%DROPPED%%
%%LEGEND%%
<div id="toolbar">
<button id="zoom-in" type="button" title="Zoom in (+)">+</button>
<button id="zoom-out" type="button" title="Zoom out (&minus;)">&minus;</button>
<button id="zoom-reset" type="button" title="Show everything (0)">reset</button>
<span id="view"></span><span class="help">wheel: zoom at the pointer &middot; drag or shift+wheel: pan
 &middot; keys + &minus; 0 &larr; &rarr; &middot; hover a mark for details</span>
</div>
<div id="axis-wrap"><svg id="axis" height="26"></svg></div>
<div id="chart-wrap"><svg id="chart" height="10"><defs>
<clipPath id="plot-clip"><rect id="plot-clip-rect" x="0" y="0" width="10" height="10"></rect></clipPath>
<marker id="arrow" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="7" markerHeight="7" orient="auto">
<path d="M0 0 L8 4 L0 8 Z" fill="#475569"></path></marker>
<pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">
<rect width="6" height="6" fill="#fae8ff"></rect><rect width="2.5" height="6" fill="#e879f9"></rect></pattern>
</defs></svg></div>
<div id="tooltip" role="tooltip"></div>
<script type="application/json" id="trace-data">%%DATA%%</script>
<script>
window.addEventListener("error", function (e) {
  var n = Number(document.documentElement.getAttribute("data-errors") || 0) + 1;
  document.documentElement.setAttribute("data-errors", String(n));
  var box = document.getElementById("errors");
  if (!box) { box = document.createElement("div"); box.id = "errors"; document.body.prepend(box); }
  box.textContent = "This page failed to draw the trace: " + e.message;
});
</script>
<script>
(function () {
  "use strict";
  var M = JSON.parse(document.getElementById("trace-data").textContent);
  var chart = document.getElementById("chart"), axis = document.getElementById("axis");
  var NS = chart.namespaceURI, tip = document.getElementById("tooltip");
  var LABEL_W = 270, GAP = 14, ROW_H = 16, PAD = 6, PROC_H = 26, H = 10;
  var KIND_COL = {scope: "#6b7280", task: "#7c3aed", stream: "#4338ca", alloc: "#16a34a", other: "#6b7280"};
  var W = 800, plotW = 500, full = {a: M.t0, b: M.t1}, view = {a: M.t0, b: M.t1};
  var els = [], flowEls = [], alertEls = [], bandEls = [], laneTop = [], laneH = [], gridG = null;
  var subs = {}, lit = [];  // the elements of each submission, and those highlighted now

  function mk(tag, attrs, parent) {
    var el = document.createElementNS(NS, tag);
    for (var k in attrs) { el.setAttribute(k, attrs[k]); }
    if (parent) { parent.appendChild(el); }
    return el;
  }
  function X(t) { return LABEL_W + GAP + (t - view.a) / (view.b - view.a) * plotW; }
  function clampX(x) { return Math.max(LABEL_W - 20, Math.min(W + 20, x)); }
  function fmtMs(us, digits) { return (us / 1000).toFixed(digits) + " ms"; }
  function fmtDur(us) { return us < 1000 ? us.toFixed(us < 10 ? 2 : 1) + " \\u00b5s" : fmtMs(us, 3); }
  function midY(l) { return laneTop[l] + PAD + ROW_H / 2; }

  function build() {
    var bg = mk("g", {}, chart), laneG, overG, y = 0, laneEls = [], firstI = {};
    gridG = mk("g", {}, chart);
    laneG = mk("g", {id: "lanes"}, chart);
    overG = mk("g", {"clip-path": "url(#plot-clip)"}, chart);
    M.procs.forEach(function (p) {
      var head = mk("g", {"class": "proc", "data-proc": p.name}, bg);
      mk("rect", {x: 0, y: y, width: "100%", height: PROC_H, fill: "#e2e8f0"}, head);
      mk("text", {x: 10, y: y + 17, "class": "proc-label"}, head).textContent = p.name;
      p.top = y; y += PROC_H;
      for (var l = p.first; l < p.first + p.count; l++) {
        var lane = M.lanes[l], h = PAD * 2 + lane.rows * ROW_H, col = KIND_COL[lane.kind];
        laneTop[l] = y; laneH[l] = h;
        mk("rect", {x: 0, y: y, width: "100%", height: h, fill: (l - p.first) % 2 ? "#f8fafc" : "#fff"}, bg);
        mk("line", {x1: 0, x2: "100%", y1: y + h - 0.5, y2: y + h - 0.5, stroke: "#eef2f7"}, bg);
        var g = mk("g", {"class": "lane", "data-track": lane.name, "data-kind": lane.kind}, laneG);
        laneEls.push(mk("g", {"clip-path": "url(#plot-clip)"}, g));
        mk("rect", {x: 8, y: y + h / 2 - 7, width: 50, height: 14, rx: 3, fill: col, opacity: 0.14}, g);
        mk("text", {x: 33, y: y + h / 2 + 3, "text-anchor": "middle", "class": "lane-kind", fill: col}, g)
          .textContent = lane.kind.toUpperCase();
        var t = mk("text", {x: 64, y: y + h / 2 + 4, "class": "lane-label"}, g);
        t.textContent = lane.name.length > 33 ? lane.name.slice(0, 32) + "\\u2026" : lane.name;
        mk("title", {}, t).textContent = lane.name;
        y += h;
      }
      p.bottom = y;
    });
    H = y + 4;
    chart.setAttribute("height", H);
    mk("line", {x1: LABEL_W - 0.5, x2: LABEL_W - 0.5, y1: 0, y2: y, stroke: "#cbd5e1"}, chart);
    function sub(id, el) { if (id !== undefined) { (subs[id] = subs[id] || []).push(el); } }
    M.events.forEach(function (e, i) {
      var l = e[0], cat = e[6], parent = laneEls[l], rec = {e: e}, y0 = laneTop[l] + PAD + e[4] * ROW_H;
      if (e[1] === "X") {
        var st = M.slices[e[8]] || M.slices.other;
        rec.el = mk("rect", {"class": "ev", "data-cat": cat, "data-i": i, y: y0 + 1, height: ROW_H - 2, rx: 2,
          fill: st[0], stroke: st[1]}, parent);
        rec.label = mk("text", {"class": cat === "enqueue" ? "ev-label light" : "ev-label", y: y0 + 11.5},
          parent);
        els.push(rec); sub(e[7].sub, rec.el);
        return;
      }
      var ins = M.instants[cat] || ["#334155", "dot"], c = ins[0], cy = midY(l);
      var top = laneTop[l] + 2 - cy, bot = laneTop[l] + laneH[l] - 2 - cy;
      rec.el = mk("g", {"class": "ev", "data-cat": cat, "data-i": i}, parent);
      if (firstI[l] === undefined) { firstI[l] = rec.el; }
      if (ins[1] === "tri") { mk("path", {d: "M-3 -6 L7 0 L-3 6 Z", fill: c, stroke: "#fff"}, rec.el); }
      else if (ins[1] === "bar") {
        mk("path", {d: "M-7 " + top + " H2 V" + bot + " H-7 V" + (bot - 3) + " H-2 V" + (top + 3) + " H-7 Z",
          fill: c}, rec.el);
      } else if (ins[1] === "diamond") {
        mk("path", {d: "M0 -8 L8 0 L0 8 L-8 0 Z", fill: c, stroke: "#fff", "stroke-width": 1.5}, rec.el);
      } else if (ins[1] === "cross") {
        mk("circle", {r: 8, fill: "#fff", opacity: 0.8}, rec.el);
        mk("path", {d: "M-5 -5 L5 5 M5 -5 L-5 5", stroke: c, "stroke-width": 3.2}, rec.el);
      } else { mk("circle", {r: 4.5, fill: c, stroke: "#fff", "stroke-width": 1.2}, rec.el); }
      mk("rect", {x: -6, y: -8, width: 12, height: 16, fill: "transparent"}, rec.el);
      rec.y = cy;
      if (M.alerts.indexOf(cat) >= 0) {
        var p = M.procs[M.lanes[l].proc];
        alertEls.push({t: e[2], el: mk("line", {"class": "alert", "data-cat": cat, y1: p.top, y2: p.bottom,
          stroke: c, "stroke-dasharray": cat === "cancel" ? "none" : "6 3"}, overG)});
      }
      els.push(rec); sub(e[7].sub, rec.el);
    });
    M.bands.forEach(function (b) {  // over the "alive" bar, under the markers
      var el = mk("rect", {y: laneTop[b[0]] + PAD + 1, height: ROW_H - 2, fill: "url(#hatch)",
        "pointer-events": "none"});
      laneEls[b[0]].insertBefore(el, firstI[b[0]] || null);
      bandEls.push({b: b, el: el});
    });
    M.flows.forEach(function (f) {
      flowEls.push({pts: f[1], el: mk("path", {"class": "flow", "marker-end": "url(#arrow)"}, overG)});
      sub(f[0], flowEls[flowEls.length - 1].el);
    });
  }

  function draw() {
    W = Math.max(600, document.getElementById("chart-wrap").clientWidth);
    plotW = W - LABEL_W - 2 * GAP;
    chart.setAttribute("width", W); axis.setAttribute("width", W);
    var clip = document.getElementById("plot-clip-rect");
    clip.setAttribute("x", LABEL_W); clip.setAttribute("width", W - LABEL_W); clip.setAttribute("height", H);
    while (axis.firstChild) { axis.removeChild(axis.firstChild); }
    while (gridG && gridG.firstChild) { gridG.removeChild(gridG.firstChild); }
    var raw = (view.b - view.a) / Math.max(2, plotW / 110), p10 = Math.pow(10, Math.floor(Math.log10(raw)));
    var m = raw / p10, step = (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p10;
    var digits = Math.min(6, Math.max(0, -Math.floor(Math.log10(step / 1000) + 1e-9)));
    mk("text", {x: LABEL_W - 10, y: 17, "text-anchor": "end", "class": "tick"}, axis).textContent = "ms";
    for (var n = Math.ceil(view.a / step); n * step <= view.b; n++) {
      var x = X(n * step);
      mk("line", {x1: x, x2: x, y1: 19, y2: 26, stroke: "#94a3b8"}, axis);
      mk("text", {x: x, y: 14, "text-anchor": "middle", "class": "tick"}, axis).textContent =
        (n * step / 1000).toFixed(digits);
      if (gridG) { mk("line", {x1: x, x2: x, y1: 0, y2: H, stroke: "#e8edf3"}, gridG); }
    }
    document.getElementById("view").textContent =
      fmtMs(view.a, 3) + " \\u2013 " + fmtMs(view.b, 3) + " (" + fmtDur(view.b - view.a) + " shown)";
    els.forEach(function (r) {
      var e = r.e;
      if (e[1] !== "X") {
        r.el.setAttribute("transform", "translate(" + X(e[2]).toFixed(2) + "," + r.y + ")");
        return;
      }
      var x0 = clampX(X(e[2])), x1 = Math.max(clampX(X(e[2] + e[3])), x0 + 2);
      r.el.setAttribute("x", x0); r.el.setAttribute("width", x1 - x0);
      var lx = Math.max(x0, LABEL_W) + 4, room = Math.floor((x1 - lx - 3) / 6.2), s = e[5];
      if (room < 3) { s = ""; } else if (s.length > room) { s = s.slice(0, room - 1) + "\\u2026"; }
      r.label.setAttribute("x", lx); r.label.textContent = s;
    });
    alertEls.forEach(function (a) { a.el.setAttribute("x1", X(a.t)); a.el.setAttribute("x2", X(a.t)); });
    bandEls.forEach(function (b) {
      var x0 = clampX(X(b.b[1]));
      b.el.setAttribute("x", x0); b.el.setAttribute("width", Math.max(0, clampX(X(b.b[2])) - x0));
    });
    flowEls.forEach(function (f) {
      var d = "";
      for (var i = 1; i < f.pts.length; i++) {
        var xa = X(f.pts[i - 1][1]), xb = X(f.pts[i][1]), ya = midY(f.pts[i - 1][0]), yb = midY(f.pts[i][0]);
        var bend = Math.max(12, (xb - xa) / 2);
        d += "M" + xa.toFixed(1) + " " + ya + " C" + (xa + bend).toFixed(1) + " " + ya + " " +
          (xb - bend).toFixed(1) + " " + yb + " " + xb.toFixed(1) + " " + yb + " ";
      }
      f.el.setAttribute("d", d);
    });
  }

  function setView(a, b) {
    var span = Math.min(Math.max(b - a, 0.01), (full.b - full.a) * 4), mid = (a + b) / 2;
    var lo = full.a - span / 2, hi = full.b + span / 2;
    a = Math.max(lo, Math.min(mid - span / 2, hi - span));
    view = {a: a, b: a + span};
    draw();
  }
  function zoom(factor, pivot) {
    if (pivot === undefined) { pivot = (view.a + view.b) / 2; }
    setView(pivot - (pivot - view.a) * factor, pivot + (view.b - pivot) * factor);
  }
  function pan(frac) { var d = (view.b - view.a) * frac; setView(view.a + d, view.b + d); }
  function reset() { setView(full.a, full.b); }

  function highlight(id) {  // every mark of the submission under the pointer
    lit.forEach(function (el) { el.classList.remove("hl"); });
    lit = (id !== undefined && subs[id]) || [];
    lit.forEach(function (el) { el.classList.add("hl"); });
  }
  function hideTip() { tip.style.display = "none"; highlight(); }
  function showTip(ev, e) {
    highlight(e[7].sub);
    var lane = M.lanes[e[0]], args = e[7] || {}, table = document.createElement("table");
    var rows = [["cat", e[6]], ["track", lane.name], ["scope", M.procs[lane.proc].name],
      ["at", fmtMs(e[2], 4)]];
    if (e[1] === "X") { rows.push(["duration", fmtDur(e[3])], ["until", fmtMs(e[2] + e[3], 4)]); }
    Object.keys(args).forEach(function (k) {
      rows.push([k, typeof args[k] === "string" ? args[k] : JSON.stringify(args[k])]);
    });
    while (tip.firstChild) { tip.removeChild(tip.firstChild); }
    var name = document.createElement("div");
    name.className = "tt-name"; name.textContent = e[5] || "(unnamed)";
    tip.appendChild(name); tip.appendChild(table);
    rows.forEach(function (r) { var tr = table.insertRow(); tr.insertCell().textContent = r[0];
      tr.insertCell().textContent = r[1]; });
    tip.style.display = "block";
    var x = ev.clientX + 14, y = ev.clientY + 14, w = tip.offsetWidth, h = tip.offsetHeight;
    if (x + w > window.innerWidth - 4) { x = ev.clientX - w - 10; }
    if (y + h > window.innerHeight - 4) { y = ev.clientY - h - 10; }
    tip.style.left = Math.max(4, x) + "px"; tip.style.top = Math.max(4, y) + "px";
  }

  var drag = null;
  chart.addEventListener("pointermove", function (ev) {
    if (drag) {
      var dt = (ev.clientX - drag.x) / plotW * (drag.b - drag.a);
      setView(drag.a - dt, drag.b - dt);
      return;
    }
    var target = ev.target.closest ? ev.target.closest(".ev") : null;
    if (target) { showTip(ev, els[Number(target.getAttribute("data-i"))].e); }
    else { hideTip(); }
  });
  chart.addEventListener("pointerleave", hideTip);
  chart.addEventListener("pointerdown", function (ev) {
    if (ev.button !== 0) { return; }
    drag = {x: ev.clientX, a: view.a, b: view.b};
    try { chart.setPointerCapture(ev.pointerId); } catch (err) { /* not a live pointer: no capture */ }
    chart.classList.add("dragging"); hideTip();
  });
  function endDrag() { drag = null; chart.classList.remove("dragging"); }
  chart.addEventListener("pointerup", endDrag);
  chart.addEventListener("pointercancel", endDrag);
  function onWheel(ev) {
    ev.preventDefault();
    var unit = ev.deltaMode === 1 ? 16 : ev.deltaMode === 2 ? 400 : 1;
    if (ev.shiftKey || Math.abs(ev.deltaX) > Math.abs(ev.deltaY)) {
      pan((ev.shiftKey ? ev.deltaY || ev.deltaX : ev.deltaX) * unit / plotW);
      return;
    }
    var px = ev.clientX - chart.getBoundingClientRect().left - LABEL_W - GAP;
    var pivot = px < -GAP ? undefined : view.a + px / plotW * (view.b - view.a);
    zoom(Math.exp(ev.deltaY * unit * 0.0015), pivot);
  }
  chart.addEventListener("wheel", onWheel, {passive: false});
  axis.addEventListener("wheel", onWheel, {passive: false});
  document.getElementById("zoom-in").addEventListener("click", function () { zoom(1 / 1.5); });
  document.getElementById("zoom-out").addEventListener("click", function () { zoom(1.5); });
  document.getElementById("zoom-reset").addEventListener("click", reset);
  document.addEventListener("keydown", function (ev) {
    var act = {"+": [zoom, 1 / 1.5], "=": [zoom, 1 / 1.5], "-": [zoom, 1.5], "_": [zoom, 1.5], "0": [reset],
      ArrowLeft: [pan, -0.15], ArrowRight: [pan, 0.15]}[ev.key];
    if (!act || ev.ctrlKey || ev.metaKey || ev.altKey) { return; }
    ev.preventDefault();
    act[0](act[1]);
  });
  window.addEventListener("resize", draw);

  if (M.lanes.length) { build(); } else {
    var empty = document.createElement("div");
    empty.id = "empty"; empty.textContent = "This trace has no events to draw.";
    document.getElementById("chart-wrap").appendChild(empty);
    chart.style.display = "none";
  }
  draw();
  document.body.dataset.events = String(els.length);
  document.body.dataset.ready = "1";
})();
</script>
</body>
</html>
"""
