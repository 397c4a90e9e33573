"""The HTML timeline page for lifetime traces (trio_cuda._trace_html).

Pure-Python tests check the markup and the embedded data; the others load the page in
headless Chromium (skipped when no chromium binary is on PATH) and check the DOM after
the page's script ran, the console, the interactions and a screenshot.
"""

from __future__ import annotations

import html
import importlib.util
import json
import math
import re
import shutil
import struct
import subprocess
import zlib
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from trio_cuda._trace_html import render_html

FIXTURE = Path(__file__).with_name("trace_fixture.json")
DOCS = Path(__file__).resolve().parents[2] / "docs"
EVIL = "</script><img src=x onerror=alert(1)>"


def load_fixture() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


class Page(HTMLParser):
    """Start tags with their attributes, and the text of each <script> element."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.scripts: list[tuple[dict[str, str], str]] = []
        self._script: dict[str, str] | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        d = {k: v or "" for k, v in attrs}
        self.tags.append((tag, d))
        if tag == "script":
            self._script = d
            self.scripts.append((d, ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._script = None

    def handle_data(self, data: str) -> None:
        if self._script is not None:
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)

    def by_class(self, cls: str) -> list[dict[str, str]]:
        return [a for _, a in self.tags if cls in a.get("class", "").split()]

    def by_id(self, ident: str) -> dict[str, str] | None:
        return next((a for _, a in self.tags if a.get("id") == ident), None)


def embedded_data(page: str) -> dict[str, Any]:
    (text,) = [t for a, t in Page(page).scripts if a.get("type") == "application/json"]

    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    return json.loads(text, parse_constant=no_constants)


def facts(page: str) -> dict[str, str]:
    """The header's facts: label -> text."""
    header = re.search(r"<header>(.*?)</header>", page, re.S)
    assert header is not None
    found = re.findall(r'<span class="fact"[^>]*><i>([^<]*)</i> ([^<]*)</span>', header.group(1))
    return {html.unescape(k): html.unescape(v) for k, v in found}


def fixture_tracks(trace: dict[str, Any]) -> list[str]:
    return [e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]


def fixture_cats(trace: dict[str, Any]) -> Counter[str]:
    return Counter(e["cat"] for e in trace["traceEvents"] if e["ph"] in ("X", "i"))


def evil_trace() -> dict[str, Any]:
    return {
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": EVIL}},
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "scope #1 <u>&amp;</u>"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {"name": EVIL}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2000, "args": {"name": "task <!-- x"}},
            {"ph": "X", "name": EVIL, "cat": "enqueue", "ts": 10.0, "dur": 50.0, "pid": 2, "tid": 1,
             "args": {EVIL: EVIL, "nested": [EVIL, {"k": "</SCRIPT >"}]}},
            {"ph": "i", "s": "t", "name": "'\"&<>\u2028\u2029", "cat": EVIL, "ts": 20.0, "pid": 1,
             "tid": 2000, "args": {}},
        ],
        "otherData": {"trio_cuda": EVIL, "dropped": 0, "backend": EVIL, "device_time": EVIL},
    }  # fmt: skip


# -- pure Python ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [load_fixture, evil_trace, dict])
def test_no_network_references(make: Any) -> None:
    page = render_html(make(), title="offline")
    low = page.lower()
    for needle in ("http://", "https://", "//cdn", "@import", "<link", "<img", "<iframe"):
        assert needle not in low, needle
    for _, attrs in Page(page).tags:
        assert not {"src", "href", "srcset", "xlink:href"} & attrs.keys(), attrs
    # The only url(...) references are local fragments (clip paths, markers, patterns).
    assert all(part.startswith("#") for part in low.split("url(")[1:])
    assert page.isascii()


def test_malicious_names_are_escaped() -> None:
    page = render_html(evil_trace(), title=EVIL)
    assert "<img" not in page.lower()
    assert page.lower().count("</script") == page.lower().count("<script")
    assert "<!--" not in page
    parsed = Page(page)
    assert [tag for tag, _ in parsed.tags if tag in ("img", "u")] == []
    assert [a.get("type", "js") for a, _ in parsed.scripts] == ["application/json", "js", "js"]
    # The title and header show the text, escaped.
    assert page.count("&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;") >= 3
    # The data round-trips exactly through the JSON island.
    data = embedded_data(page)
    assert data["backend"] == EVIL
    assert data["version"] == EVIL
    assert {p["name"] for p in data["procs"]} == {EVIL, "scope #1 <u>&amp;</u>"}
    assert {lane["name"] for lane in data["lanes"]} == {EVIL, "task <!-- x"}
    names = {e[5]: e for e in data["events"]}
    assert names[EVIL][7] == {EVIL: EVIL, "nested": [EVIL, {"k": "</SCRIPT >"}]}
    assert "'\"&<>\u2028\u2029" in names


@pytest.mark.parametrize(("other", "shown"), [({"dropped": 0}, False), ({"dropped": 17}, True), ({}, False)])
def test_dropped_warning_iff_events_were_dropped(other: dict[str, Any], shown: bool) -> None:
    trace = load_fixture()
    trace["otherData"] = {**trace["otherData"], **other} if other else {}
    page = render_html(trace)
    parsed = Page(page)
    assert (parsed.by_id("dropped") is not None) is shown
    assert ("dropped 17 events" in page) is shown


@pytest.mark.parametrize("trace", [{}, {"traceEvents": []}, {"traceEvents": [], "otherData": {}}])
def test_empty_trace(trace: dict[str, Any]) -> None:
    page = render_html(trace)
    data = embedded_data(page)
    assert data["lanes"] == []
    assert data["events"] == []
    assert data["procs"] == []
    assert Page(page).by_id("legend") is not None
    assert facts(page)["records"] == "0 in the JSON"
    assert facts(page)["drawn"] == "0 bars, 0 markers, 0 flow arrows"


@pytest.mark.parametrize(
    ("other", "counted"),
    [
        ({"events": 40}, ("events", "40 recorded")),
        ({"events": 40, "dropped": 17}, ("events", "40 recorded, 17 dropped")),
        ({"events": 0}, ("events", "0 recorded")),
        ({}, ("records", "102 in the JSON")),  # a trace without the count: what is counted is said
        ({"events": -1}, ("records", "102 in the JSON")),
        ({"events": True}, ("records", "102 in the JSON")),
        ({"events": "40"}, ("records", "102 in the JSON")),
    ],
)
def test_header_counts_events_as_recorded_not_json_records(
    other: dict[str, Any], counted: tuple[str, str]
) -> None:
    trace = load_fixture()
    trace["otherData"] = {**trace["otherData"], **other}
    assert len(trace["traceEvents"]) == 102
    shown = facts(render_html(trace))
    label, text = counted
    assert shown[label] == text, shown
    assert ({"events", "records"} - {label}).isdisjoint(shown), shown  # one count, labelled as what it is
    phases = Counter(e["ph"] for e in trace["traceEvents"])
    assert (
        shown["drawn"]
        == f"{phases['X']} bars, {phases['i']} markers, 7 flow arrows"
        == ("25 bars, 43 markers, 7 flow arrows")
    )
    assert "in trace" not in render_html(trace)


def test_fixture_model() -> None:
    trace = load_fixture()
    data = embedded_data(render_html(trace))
    assert [p["name"] for p in data["procs"]] == ["scope #1 (sim0)"]
    # Scope first, then tasks, streams, allocations.
    assert [lane["kind"] for lane in data["lanes"]] == ["scope"] + ["task"] * 3 + ["stream"] * 2 + [
        "alloc"
    ] * 3
    assert sorted(lane["name"] for lane in data["lanes"]) == sorted(fixture_tracks(trace))
    assert Counter(e[6] for e in data["events"]) == fixture_cats(trace)
    assert len(data["flows"]) == len({e["id"] for e in trace["traceEvents"] if e["ph"] in "stf"})
    # Leases nest under "alive"; the overlapping reads of the first allocation take two rows.
    alloc0 = next(
        i for i, lane in enumerate(data["lanes"]) if lane["name"].startswith("alloc 0x7f0000000000")
    )
    assert data["lanes"][alloc0]["rows"] == 3
    assert {e[4] for e in data["events"] if e[0] == alloc0 and e[5] == "alive"} == {0}
    assert len(data["bands"]) == 1  # the quarantined allocation
    assert data["t0"] == 0.0
    assert data["t1"] == 3400.0


def test_malformed_input_does_not_raise() -> None:
    trace: dict[str, Any] = {
        "traceEvents": [
            None, 3, "x", [], {}, {"ph": "X"}, {"ph": "X", "ts": "12"}, {"ph": "X", "ts": math.nan},
            {"ph": "i", "ts": math.inf}, {"ph": "Q", "ts": 1.0}, {"ph": "M", "name": "thread_name"},
            {"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": 5, "args": {"sort_index": "a"}},
            {"ph": "X", "ts": 5.0, "dur": -3, "pid": "p", "tid": 10**400, "name": 7, "cat": None},
            {"ph": "i", "ts": 1e300, "pid": 1, "tid": 4000, "args": {"a": math.nan, "b": 2**70, "c": object(),
             "d": {"e": {"f": {"g": {"h": {"i": {"j": 1}}}}}}, 5: (1, 2)}},
            {"ph": "s", "id": 1, "ts": 1.0, "pid": 1, "tid": 4000}, {"ph": "f", "id": 1, "ts": 2.0},
        ],
        "otherData": {"dropped": "many", "backend": None},
    }  # fmt: skip
    data = embedded_data(render_html(trace))
    assert len(data["events"]) == 2
    assert {lane["name"] for lane in data["lanes"]} == {"tid 0", "tid 4000"}
    assert data["dropped"] == 0
    (instant,) = [e for e in data["events"] if e[1] == "i"]
    assert instant[7]["a"] == "nan"
    assert instant[7]["b"] == str(2**70)
    assert instant[7]["5"] == [1, 2]
    assert render_html({"traceEvents": "nope", "otherData": []})


def test_scopes_and_unnamed_tracks() -> None:
    trace = {
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "scope #2"}},
            {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "scope #1"}},
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": "stream 0"}},
            {"ph": "i", "name": "a", "cat": "scope", "ts": 5.0, "pid": 7, "tid": 0},
            {"ph": "i", "name": "b", "cat": "alloc", "ts": 6.0, "pid": 3, "tid": 1001},
            {"ph": "i", "name": "c", "cat": "alloc", "ts": 7.0, "pid": 3, "tid": 9999},
        ]
    }
    data = embedded_data(render_html(trace))
    assert [p["name"] for p in data["procs"]] == ["scope #1", "scope #2"]
    assert [(lane["name"], lane["kind"], lane["proc"]) for lane in data["lanes"]] == [
        ("tid 1001", "alloc", 0),
        ("tid 9999", "other", 0),
        ("tid 0", "scope", 1),
        ("stream 0", "stream", 1),
    ]


# -- headless Chromium ------------------------------------------------------------------------------------


def find_chromium() -> str | None:
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


needs_chromium = pytest.mark.skipif(find_chromium() is None, reason="no chromium binary on PATH")


def run_chromium(page: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp / "page.html"
    path.write_text(page, encoding="utf-8")
    command = [
        str(find_chromium()),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        *args,
        path.as_uri(),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def dump_dom(page: str, tmp: Path) -> tuple[Page, str]:
    result = run_chromium(page, tmp, "--virtual-time-budget=2000", "--dump-dom")
    return Page(result.stdout), result.stderr


def console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def body(dom: Page) -> dict[str, str]:
    return next(a for tag, a in dom.tags if tag == "body")


@pytest.fixture(scope="module")
def fixture_dom(tmp_path_factory: pytest.TempPathFactory) -> tuple[Page, str]:
    if find_chromium() is None:
        pytest.skip("no chromium binary on PATH")
    return dump_dom(render_html(load_fixture()), tmp_path_factory.mktemp("dom"))


@needs_chromium
def test_dom_after_script(fixture_dom: tuple[Page, str]) -> None:
    dom, _ = fixture_dom
    trace = load_fixture()
    assert body(dom).get("data-ready") == "1"
    html_attrs = next(a for tag, a in dom.tags if tag == "html")
    assert "data-errors" not in html_attrs
    assert dom.by_id("errors") is None
    lanes = dom.by_class("lane")
    assert len(lanes) == len(fixture_tracks(trace))
    assert sorted(lane["data-track"] for lane in lanes) == sorted(fixture_tracks(trace))
    events = dom.by_class("ev")
    assert Counter(e["data-cat"] for e in events) == fixture_cats(trace)
    assert body(dom)["data-events"] == str(len(events)) == str(sum(fixture_cats(trace).values()))
    # the header's "drawn" counts what the page drew
    bars = len([e for tag, e in dom.tags if tag == "rect" and "ev" in e.get("class", "").split()])
    header = facts(render_html(trace))["drawn"]
    assert header == f"{bars} bars, {len(events) - bars} markers, {len(dom.by_class('flow'))} flow arrows"
    assert len(dom.by_class("flow")) == 7
    assert sorted(a["data-cat"] for a in dom.by_class("alert")) == ["cancel", "drop", "error", "quarantine"]
    for ident in ("legend", "tooltip", "zoom-in", "zoom-out", "zoom-reset"):
        assert dom.by_id(ident) is not None, ident
    assert dom.by_id("dropped") is None


@needs_chromium
def test_no_console_errors(fixture_dom: tuple[Page, str]) -> None:
    _, stderr = fixture_dom
    assert console_lines(stderr) == []


@needs_chromium
def test_console_check_sees_errors(tmp_path: Path) -> None:
    # The console check above can fail: a script error shows up both in the log and on the page.
    page = render_html(load_fixture()).replace('"use strict";', '"use strict"; undefinedName();', 1)
    dom, stderr = dump_dom(page, tmp_path)
    assert any("Uncaught ReferenceError" in line for line in console_lines(stderr))
    assert next(a for tag, a in dom.tags if tag == "html").get("data-errors") == "1"
    assert dom.by_id("errors") is not None
    assert "data-ready" not in body(dom)


@needs_chromium
def test_malicious_page_in_browser(tmp_path: Path) -> None:
    trace = evil_trace()
    trace["otherData"]["dropped"] = 3
    dom, stderr = dump_dom(render_html(trace, title=EVIL), tmp_path)
    assert body(dom).get("data-ready") == "1"
    assert body(dom)["data-events"] == "2"
    assert [tag for tag, _ in dom.tags if tag == "img"] == []
    assert sorted(a["data-track"] for a in dom.by_class("lane")) == sorted([EVIL, "task <!-- x"])
    assert {a["data-proc"] for a in dom.by_class("proc")} == {EVIL, "scope #1 <u>&amp;</u>"}
    assert dom.by_id("dropped") is not None
    assert console_lines(stderr) == []


@needs_chromium
def test_empty_page_in_browser(tmp_path: Path) -> None:
    dom, stderr = dump_dom(render_html({}), tmp_path)
    assert body(dom).get("data-ready") == "1"
    assert body(dom)["data-events"] == "0"
    assert dom.by_class("lane") == []
    assert dom.by_id("empty") is not None
    assert console_lines(stderr) == []


INTERACT = """<script>
(function () {
  var out = {}, view = document.getElementById("view"), chart = document.getElementById("chart");
  var mark = document.querySelector('.ev[data-cat="cancel"]');
  function centre() {
    var r = mark.getBoundingClientRect();
    return [r.left + r.width / 2, r.top + r.height / 2];
  }
  var c = centre(), tip = document.getElementById("tooltip");
  mark.dispatchEvent(new PointerEvent("pointermove", {bubbles: true, clientX: c[0], clientY: c[1]}));
  out.tip = [tip.style.display, tip.textContent];
  out.lit = document.querySelectorAll(".hl").length;
  out.view0 = view.textContent;
  document.getElementById("zoom-in").click(); out.zoomIn = view.textContent;
  document.getElementById("zoom-out").click(); document.getElementById("zoom-out").click();
  out.zoomOut = view.textContent;
  document.getElementById("zoom-reset").click(); out.reset = view.textContent;
  chart.dispatchEvent(new WheelEvent("wheel", {bubbles: true, cancelable: true, deltaY: -500,
    clientX: c[0], clientY: c[1]}));
  out.wheel = [view.textContent, centre()[0] - c[0]];
  var x0 = centre()[0], opts = {bubbles: true, button: 0, pointerId: 7, clientY: c[1]};
  chart.dispatchEvent(new PointerEvent("pointerdown", Object.assign({clientX: 900}, opts)));
  chart.dispatchEvent(new PointerEvent("pointermove", Object.assign({clientX: 780}, opts)));
  chart.dispatchEvent(new PointerEvent("pointerup", Object.assign({clientX: 780}, opts)));
  out.drag = centre()[0] - x0;
  document.dispatchEvent(new KeyboardEvent("keydown", {key: "ArrowRight", bubbles: true}));
  out.key = [centre()[0] - x0];
  document.dispatchEvent(new KeyboardEvent("keydown", {key: "0", bubbles: true}));
  out.key.push(view.textContent);
  document.body.setAttribute("data-test", JSON.stringify(out));
})();
</script>
</body>"""


@needs_chromium
def test_tooltip_zoom_and_pan(tmp_path: Path) -> None:
    page = render_html(load_fixture()).replace("</body>", INTERACT)
    dom, stderr = dump_dom(page, tmp_path)
    out = json.loads(body(dom)["data-test"])
    display, text = out["tip"]
    assert display == "block"
    for part in ("cancelled", "cancel", "task main", "scope #1 (sim0)", "1.5000 ms", "move_on_after(1.5 ms)"):
        assert part in text, part
    # Hovering the cancellation highlights every mark of its submission (#5) and its flow.
    trace = load_fixture()
    marks = [e for e in trace["traceEvents"] if e["ph"] in ("X", "i") and e["args"].get("sub") == 5]
    assert out["lit"] == len(marks) + 1
    assert out["view0"].startswith("0.000 ms \u2013 3.400 ms")
    assert "(2.267 ms shown)" in out["zoomIn"]
    assert "(5.100 ms shown)" in out["zoomOut"]
    assert out["reset"] == out["view0"]
    assert out["wheel"][0] != out["view0"]
    assert abs(out["wheel"][1]) < 1.0
    assert abs(out["drag"] + 120) < 1.0  # dragged 120 px to the left
    assert out["key"][0] < out["drag"] - 50
    assert out["key"][1] == out["view0"]
    assert console_lines(stderr) == []


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB rows of an 8-bit non-interlaced RGB or RGBA PNG (standard library only)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, [], b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, chunk = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = chunk
        elif kind == b"IDAT":
            idat.append(chunk)
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8
    assert colour in (2, 6)
    assert interlace == 0
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(b"".join(idat)), width * bpp
    prev, rows = bytearray(stride), []
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        if kind == 2:
            line = bytearray((a + b) & 255 for a, b in zip(line, prev))
        elif kind in (1, 3, 4):
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b = prev[i] if kind != 1 else 0
                c = prev[i - bpp] if i >= bpp and kind == 4 else 0
                if kind == 3:
                    pred = (a + b) >> 1
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                line[i] = (line[i] + pred) & 255
        rows.append(
            b"".join(bytes(line[i : i + 3]) for i in range(0, stride, bpp)) if bpp == 4 else bytes(line)
        )
        prev = line
    return width, height, rows


@needs_chromium
def test_screenshot(tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    run_chromium(
        render_html(load_fixture()),
        tmp_path,
        "--hide-scrollbars",
        "--virtual-time-budget=2000",
        f"--screenshot={shot}",
        "--window-size=1400,900",
    )
    width, height, rows = png_pixels(shot.read_bytes())
    assert (width, height) == (1400, 900)
    colours = Counter(row[i : i + 3] for row in rows for i in range(0, len(row), 3))
    (_, most), *_ = colours.most_common(1)
    assert len(colours) > 50
    assert most < 0.8 * width * height
    # The solid fills of drawn bars and markers are there, pixel-exact.
    for rgb in ("6366f1", "dcfce7", "fdba74", "7dd3fc", "dc2626"):  # kernel, alive, write, read, cancel
        assert colours[bytes.fromhex(rgb)] > 50, rgb


def _make_pictures() -> Any:
    """docs/make_pictures.py, imported."""
    spec = importlib.util.spec_from_file_location("make_pictures", DOCS / "make_pictures.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_pictures_are_sharp_and_small() -> None:
    mp = _make_pictures()
    pictures = sorted((DOCS / "_static").glob("*/*.png"))
    assert {p.parent.name for p in pictures} == {"traces", "lessons"}, pictures
    for png in pictures:
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", png
        width, height = struct.unpack(">II", data[16:24])
        assert width == mp.WIDTH * mp.PIXEL_RATIO, (png.name, width)  # made as make_pictures makes them
        assert height % mp.PIXEL_RATIO == 0, (png.name, height)
        assert len(data) < 1_000_000, (png.name, len(data))


@needs_chromium
def test_a_docs_picture_is_the_whole_page_and_nothing_more(tmp_path: Path) -> None:
    mp = _make_pictures()
    mp.WIDTH = 700  # a smaller picture, decoded faster
    page = tmp_path / "fixture.html"
    page.write_text(render_html(load_fixture()), encoding="utf-8")
    chromium = str(find_chromium())
    css_height = mp.page_height(page, chromium)
    assert 300 < css_height < 2000, css_height
    shot = tmp_path / "shot.png"
    mp.screenshot(page, shot, chromium)
    width, height, rows = png_pixels(shot.read_bytes())
    assert (width, height) == (700 * mp.PIXEL_RATIO, css_height * mp.PIXEL_RATIO)
    # the last lane is in the picture (its bars), and no empty band below it
    bottom = rows[-12 * mp.PIXEL_RATIO :]
    colours = Counter(row[i : i + 3] for row in bottom for i in range(0, len(row), 3))
    assert len(colours) > 20, colours.most_common(5)
    lane_bottom = rows[-40 * mp.PIXEL_RATIO :]
    assert any(bytes.fromhex(c) in row for row in lane_bottom for c in ("fdba74", "7dd3fc", "dcfce7")), (
        "the last lane's bars are not in the picture"
    )
