"""Attacks on the collector's HTTP surface: oversized and deeply nested bodies (issue #13
item 6's, on the collector), slow clients, path traversal in run ids, hostile /metrics label
values, tokens, malformed fields, and limits on cardinality (item 7).

Writes docs/BENCHMARKS.md: no section of its own; part of Collector › Collector and pager under
attack (issues #13 and #32, `bench/attacks/collector_attacks.py`).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.attacks.kit import (
    AUTH,
    G1,
    TOKEN,
    CollectorProc,
    Ledger,
    Row,
    batch,
    ms,
    raw_request,
    report,
    vm_kib,
)
from guard.core import schema

BIG = 200 << 20  # bytes an oversized body claims, or streams at most


def _post_head(path: str, framing: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\n{framing}\r\n\r\n"
    ).encode()


def _pieces(chunked: bool) -> Any:
    """~200 MB of JSON-looking bytes, 1 MB at a time (as chunks with `chunked`)."""
    piece = b'{"run":"big","rank":0,"seq":1,"reports":[' + b"0," * (1 << 19)
    for _ in range(BIG // len(piece)):
        yield b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece


def oversized_body(work: Path) -> Row:
    """A 200 MB body declared in Content-Length, one streamed chunked, and one to the commands
    endpoint; the default limit is 8 MiB."""
    ledger, c = Ledger(), CollectorProc(work).start()
    try:
        peak = vm_kib(c.pid, "VmHWM")
        declared, sent_declared = raw_request(
            c.port, _post_head("/v1/ingest", f"Content-Length: {BIG}"), _pieces(False)
        )
        chunked, sent_chunked = raw_request(
            c.port, _post_head("/v1/ingest", "Transfer-Encoding: chunked"), _pieces(True)
        )
        cmd, _ = raw_request(
            c.port, _post_head("/v1/runs/big/commands", "Transfer-Encoding: chunked"), _pieces(True)
        )
        grew = (vm_kib(c.pid, "VmHWM") - peak) / 1024
        ctrl = ledger.post(c, batch("big", G1 | 1, range(10)))
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    refused = [a.startswith("413") for a in (declared, chunked, cmd)]
    return Row(
        attack="oversized_body",
        item="6",
        what="200 MB bodies: declared, streamed chunked, and to /v1/runs/{run}/commands",
        answer=(
            f"413 for {sum(refused)}/3: declared before any body byte ({sent_declared >> 20} MB sent), chunked "
            f"after {sent_chunked >> 20} MB; peak RSS +{grew:.0f} MB; then a batch {ctrl.status_code}"
        ),
        up=up,
        lost=lost,
        twice=twice,
        held=all(refused) and sent_declared == 0 and grew < 64 and ctrl.status_code == 200,
    )


def _nested(depth: int) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for _ in range(depth):
        d = {"d": d}
    return d


def deep_nesting(work: Path) -> Row:
    """100,000 nested `[` to /v1/ingest and to the commands endpoint; a meta and an event
    detail nested 900 deep (valid JSON: stored), then a restart that must load the run."""
    ledger, c = Ledger(), CollectorProc(work).start()
    deep = b"[" * 100_000
    try:
        ingest = c.ingest(deep)
        cmd = httpx.post(f"{c.url}/v1/runs/nest/commands", content=deep, headers=AUTH, timeout=60)
        ev = {"step": 0, "kind": schema.EV_CHECKPOINT, "detail": _nested(900)}
        stored = ledger.post(c, batch("nest", G1 | 1, range(5), [ev], meta={"x": _nested(900)}))
        up = c.alive()
    finally:
        c.stop()
    c.start()
    try:
        after = ledger.post(c, batch("nest", G1 | 2, range(5, 10)))
        up = up and c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    return Row(
        attack="deep_nesting",
        item="6",
        what="100k nested '[' to ingest and commands; meta and event detail nested 900 deep, then a restart",
        answer=(
            f"{ingest.status_code} / {cmd.status_code} for the 100k '['; the 900-deep batch {stored.status_code}, "
            f"after a restart the run takes batches ({after.status_code})"
        ),
        up=up,
        lost=lost,
        twice=twice,
        held=ingest.status_code == 400 and cmd.status_code == 400 and after.status_code == 200,
    )


def slow_clients(work: Path) -> Row:
    """100 connections that never finish their headers and 50 that trickle a body, one byte a
    round, while a trainer streams."""
    ledger, c = Ledger(), CollectorProc(work).start()
    heads, bodies = [], []
    try:
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", c.port), timeout=10)
            s.sendall(b"POST /v1/ingest HTTP/1.1\r\nHost: x\r\n")
            heads.append(s)
        for _ in range(50):
            s = socket.create_connection(("127.0.0.1", c.port), timeout=10)
            s.sendall(_post_head("/v1/ingest", "Content-Length: 100000") + b'{"run":')
            bodies.append(s)
        took, answers = [], []
        for n in range(10):
            for s in heads:
                s.sendall(b"X-Slow: 1\r\n")
            for s in bodies:
                s.sendall(b" ")
            t0 = time.perf_counter()
            answers.append(ledger.post(c, batch("slow", G1 | (n + 1), [n])))
            took.append(time.perf_counter() - t0)
            time.sleep(0.2)
        up = c.alive()
    finally:
        for s in heads + bodies:
            s.close()
        c.stop()
    lost, twice = ledger.check(c.runs)
    ok = sum(r.status_code == 200 for r in answers)
    return Row(
        attack="slow_clients",
        item="held",
        what="150 slow connections (unfinished headers, bodies one byte a round) during ingest",
        answer=f"{ok}/{len(answers)} batches 200 meanwhile, the slowest in {ms(max(took))}",
        up=up,
        lost=lost,
        twice=twice,
        held=ok == len(answers) and max(took) < 2.0,
    )


def client_disconnect(work: Path) -> Row:
    """20 clients that send half a batch and hang up: an everyday event (a trainer killed, a
    timeout) that should not look like a server fault in the log."""
    ledger, c = Ledger(), CollectorProc(work).start()
    try:
        quiet_until = len(c.log_text())
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", c.port), timeout=10) as s:
                s.sendall(_post_head("/v1/ingest", "Content-Length: 100000") + b'{"run": "gone", "rank": 0')
                time.sleep(0.05)
        time.sleep(1.0)
        log = c.log_text()[quiet_until:]
        real = ledger.post(c, batch("gone", G1 | 1, range(5)))
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    tracebacks = log.count("Traceback (most recent call last)")
    errors = sum(" ERROR " in ln or ln.startswith("ERROR:") for ln in log.splitlines())
    return Row(
        attack="client_disconnect",
        item="9",
        what="20 clients hang up halfway through a batch",
        answer=f"{errors} ERROR lines, {tracebacks} tracebacks (ClientDisconnect) in the log; then a batch {real.status_code}",
        up=up,
        lost=lost,
        twice=twice,
        held=errors == 0 and tracebacks == 0 and real.status_code == 200,
    )


RUN_IDS = [
    "..",
    "../escape",
    "../../etc/passwd",
    "a/../../escape",
    "/abs",
    ".hidden",
    "-dash",
    "x\x00y",
    "%2e%2e",
    "a\\..\\b",
    "x" * 129,
    "",
    "ok/..",
    "ünï",
]
RAW_PATHS = ["..", "..%2F..%2Fescape", "%2e%2e", ".hidden", "%2e%2e%2fescape"]


def _tree(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


def path_traversal(work: Path) -> Row:
    """Run ids that name something outside the run store, in batches and in the commands URL.
    The store is work/a/b/runs, so an escape of up to three levels lands inside `work`."""
    ledger, c = Ledger(), CollectorProc(work / "a" / "b")
    before, absolute = _tree(work), Path("/abs").exists()
    c.start()
    try:
        ingest = [c.ingest(batch(rid, G1 | 1, [0])) for rid in RUN_IDS]
        urls = []
        for p in RAW_PATHS:
            get = f"GET /v1/runs/{p}/commands?rank=0 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n"
            urls.append(raw_request(c.port, get.encode(), iter(()))[0])
            body = b'{"action": "halt"}'
            post = _post_head(f"/v1/runs/{p}/commands", f"Content-Length: {len(body)}\r\nConnection: close")
            urls.append(raw_request(c.port, post, iter([body]))[0])
        ctrl = ledger.post(c, batch("fine", G1 | 1, range(5)))
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    mine = {"a/b/collector.log", "a/b/collector.port", "a/b/runs"}  # the service's own
    created = {p for p in _tree(work) - before if not p.startswith("a/b/runs/fine") and p not in mine}
    created |= {"/abs"} if Path("/abs").exists() and not absolute else set()
    refused = sum(r.status_code == 400 for r in ingest)
    url_ok = sum(a[:3] in ("400", "404") for a in urls)
    return Row(
        attack="path_traversal",
        item="held",
        what=f"{len(RUN_IDS)} hostile run ids in batches, {len(urls)} in commands URLs (GET and POST)",
        answer=(
            f"batches 400 for {refused}/{len(ingest)}; URLs 400/404 for {url_ok}/{len(urls)}; "
            f"{len(created)} paths created outside runs/fine"
        ),
        up=up,
        lost=lost,
        twice=twice,
        held=refused == len(ingest) and url_ok == len(urls) and not created and ctrl.status_code == 200,
    )


HOSTILE = 'H100"} 1\nmoeguard_injected{x="1'  # would end the label set and start a series of its own


def metrics_labels(work: Path) -> Row:
    """Label values a trainer controls (meta -> moeguard_run_info, detector names ->
    verdict counters) holding quotes, backslashes and newlines; then a scrape."""
    ledger, c = Ledger(), CollectorProc(work).start()
    meta = {"device_name": HOSTILE, "attention": 'back\\slash "q"\nnext', "torch": "\\"}
    detector = 'spike"} 2\nmoeguard_injected 3\n# '
    ev = {"step": 1, "kind": schema.EV_VERDICT, "detector": detector, "value": 1.0, "threshold": 0.5}
    parsed, err = [], ""
    try:
        stored = ledger.post(c, batch("lbl", G1 | 1, range(3), [ev], meta=meta))
        text = c.get("/metrics").text
        try:
            parsed = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
        except Exception as e:  # the attack worked: the exposition no longer parses
            err = f"{type(e).__name__}: {e}"[:80]
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    injected = [s for s in parsed if "injected" in s.name]
    info = [s.labels for s in parsed if s.name == schema.M_RUN_INFO and s.labels.get("run") == "lbl"]
    verdicts = [s for s in parsed if s.labels.get("detector") == detector]
    round_trip = (
        bool(info) and info[0].get("device") == HOSTILE and info[0].get("attention") == meta["attention"]
    )
    answer = (
        f"/metrics does not parse ({err})"
        if err
        else f"/metrics parses; hostile values round-trip: {'yes' if round_trip and verdicts else 'NO'}; "
        f"{len(injected)} injected series"
    )
    return Row(
        attack="metrics_labels",
        item="held",
        what='meta and detector names with ", \\ and newlines that try to inject a series',
        answer=answer,
        up=up,
        lost=lost,
        twice=twice,
        held=stored.status_code == 200 and not err and round_trip and bool(verdicts) and not injected,
    )


def auth(work: Path) -> Row:
    """Writes without the token, with a wrong one, a truncated one, as Basic auth."""
    ledger, c = Ledger(), CollectorProc(work).start()
    tries = [{}, {"authorization": "Bearer nope"}, {"authorization": f"Bearer {TOKEN[:-1]}"}]
    tries.append({"authorization": f"Basic {TOKEN}"})
    body = batch("auth", G1 | 1, range(5))
    try:
        refused = [c.ingest(body, headers=h).status_code for h in tries]
        cmd = httpx.post(f"{c.url}/v1/runs/auth/commands", json={"action": "halt"}, timeout=60).status_code
        real = ledger.post(c, body)
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    return Row(
        attack="auth",
        item="held",
        what="ingest and an operator command without the token, with wrong ones",
        answer=(
            f"{'/'.join(map(str, refused))} for the ingests, {cmd} for the command; "
            f"then with the token {real.status_code} duplicate={real.json().get('duplicate')} (nothing stored before)"
        ),
        up=up,
        lost=lost,
        twice=twice,
        held=set(refused) == {401} and cmd == 401 and real.json().get("duplicate") is False,
    )


def commands_read_no_token(work: Path) -> Row:
    """GET /v1/runs/{run}/commands (what a run's operator commands say) without the token."""
    ledger, c = Ledger(), CollectorProc(work).start()
    try:
        ledger.post(c, batch("cmdr", G1 | 1, range(3)))
        posted = httpx.post(
            f"{c.url}/v1/runs/cmdr/commands", json={"action": "halt", "reason": "secret reason"}, headers=AUTH
        ).status_code
        r = c.get("/v1/runs/cmdr/commands", params={"rank": 0})
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    leaked = r.status_code == 200 and "secret reason" in r.text
    return Row(
        attack="commands_read_no_token",
        item="9",
        what="read a run's operator commands without the token",
        answer=f"{r.status_code}{', the command and its reason returned' if leaked else ''} (the POST was {posted})",
        up=up,
        lost=lost,
        twice=twice,
        held=r.status_code == 401,
    )


def malformed_fields(work: Path) -> Row:
    """Batches with one bad field each; every one must be refused whole, naming the field."""
    ledger, c = Ledger(), CollectorProc(work).start()
    good = batch("mf", G1 | 1, range(3))
    bad: dict[str, dict[str, Any]] = {
        "rank": {**good, "rank": "0"},
        "seq": {**good, "seq": 1.5},
        "reports": {**good, "reports": {"step": 0}},
        "kind": {**good, "events": [{"step": 0, "kind": "boom"}]},
        "step": {**good, "reports": [{**good["reports"][0], "step": -1}]},
        "meta": {**good, "meta": [1]},
        "heartbeat": {**good, "heartbeat": {"time": "now"}},
        "rank'": {**good, "reports": [{**good["reports"][0], "rank": 3}]},
    }
    try:
        answers = {k: c.ingest(b) for k, b in bad.items()}
        real = ledger.post(c, good)
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    named = sum(
        r.status_code == 400 and k.rstrip("'") in r.json().get("error", "") for k, r in answers.items()
    )
    return Row(
        attack="malformed_fields",
        item="held",
        what=f"{len(bad)} batches with one bad field each (types, ranges, unknown kinds, rank mismatch)",
        answer=f"400 naming the field for {named}/{len(bad)}; the good batch {real.status_code}, stored once",
        up=up,
        lost=lost,
        twice=twice,
        held=named == len(bad) and real.json().get("duplicate") is False,
    )


def cardinality(work: Path) -> Row:
    """One report of 50,000 layers, a rank of 10**6, 70 detector names; then a scrape."""
    wide = batch("wide", G1 | 1, [])
    wide["reports"] = [report(0, layers=50_000).to_json()]
    names = [{"step": 1, "kind": schema.EV_VERDICT, "detector": f"det{i}", "value": 1.0} for i in range(70)]
    ledger, c = Ledger(), CollectorProc(work).start()
    try:
        t0 = time.perf_counter()
        layers = c.ingest(wide)
        t_layers = time.perf_counter() - t0
        rank = c.ingest(batch("wide", G1 | 2, [1], rank=10**6))
        dets = c.ingest(batch("wide", G1 | 3, [1], names))
        ctrl = ledger.post(c, batch("wide", G1 | 4, range(5)))
        t0 = time.perf_counter()
        scrape = c.get("/metrics")
        t_scrape = time.perf_counter() - t0
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    limits = [
        r.json().get("limit", {}).get("name") if r.status_code == 400 else r.status_code
        for r in (layers, rank, dets)
    ]
    series = sum(1 for ln in scrape.text.splitlines() if ln and not ln.startswith("#"))
    return Row(
        attack="cardinality",
        item="7",
        what="a report of 50,000 layers, rank 10**6, 70 detector names in one run",
        answer=(
            f"400 naming {', '.join(map(str, limits))} (the 50k-layer one in {ms(t_layers)}); "
            f"/metrics then {series} series in {ms(t_scrape)}"
        ),
        up=up,
        lost=lost,
        twice=twice,
        held=limits == ["max_layers", "max_ranks", "max_detectors"] and ctrl.status_code == 200,
    )
