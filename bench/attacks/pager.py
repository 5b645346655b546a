"""Attacks on `moeguard pager` (issue #13 items 5 and 6): its secrets in logs and files, the cost
of a delivery as the incident book grows, oversized and deeply nested bodies.

The receivers (Slack, PagerDuty, webhooks) are a loopback Receiver; "rows lost" for the pager
is alerts it acknowledged (200) that never reached a receiver.
"""

from __future__ import annotations

import socket
import statistics
import time
from pathlib import Path
from typing import Any

from bench.attacks.kit import Down, PagerProc, Receiver, Row, ms, raw_request, vm_kib, wait_until
from guard.pager.config import ENV_PAGERDUTY_ROUTING_KEY


def alert(run: str, status: str = "firing") -> dict[str, Any]:
    """One Alertmanager alert (RunHalted for `run`)."""
    return {
        "status": status,
        "labels": {"alertname": "RunHalted", "run": run, "severity": "critical"},
        "annotations": {"summary": f"RunHalted in run {run}"},
        "fingerprint": f"RunHalted-{run}",
    }


def payload(*alerts: dict[str, Any]) -> dict[str, Any]:
    return {"version": "4", "externalURL": "http://alertmanager.example:9093", "alerts": list(alerts)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SECRETS = {
    "Slack webhook path": "T0SECRETSLACK/B0SECRETSLACK/xoxSECRETSLACKtoken",
    "webhook path": "SECRETHOOKPATH",
    "webhook query token": "SECRETQUERYTOKEN",
    "dead webhook path": "SECRETDEADPATH",
    "PagerDuty routing key": "R0UTINGSECRETKEY0123",
}


def pager_secret_in_logs(work: Path) -> Row:
    """The pager at --log-level debug delivering to Slack (first try refused: a retry), a webhook
    with a token in its query, a dead webhook and PagerDuty; then every file it wrote is searched."""
    rx = Receiver()
    slack = f"/services/{SECRETS['Slack webhook path']}"
    hook = f"/hook/{SECRETS['webhook path']}?token={SECRETS['webhook query token']}"
    dead = f"http://127.0.0.1:{_free_port()}/x/{SECRETS['dead webhook path']}"
    rx.fail_next(slack, 1)
    p = PagerProc(
        work,
        *("--slack-url", rx.url + slack, "--webhook-url", rx.url + hook, "--webhook-url", dead),
        *("--pagerduty-url", rx.url + "/pd", "--log-level", "debug", "--max-attempts", "2"),
        *("--retry-base", "0.05", "--retry-max-delay", "0.2", "--timeout", "2"),
        env={ENV_PAGERDUTY_ROUTING_KEY: SECRETS["PagerDuty routing key"]},
    )
    try:
        p.start()
        answers = [p.post("/v1/alertmanager", payload(alert("r1"))).status_code]
        delivered = all(rx.wait(lambda path, b, w=want: path == w, 1, 30) for want in (slack, hook, "/pd"))
        wait_until(lambda: p.health()["sinks"]["webhook-1"]["failed"] >= 1, 30, "the dead webhook to fail")
        answers.append(p.post("/v1/alertmanager", payload(alert("r1", "resolved"))).status_code)
        delivered = delivered and rx.wait(lambda path, b: path == slack, 2, 30)
        up = p.alive()
    finally:
        p.stop()
        rx.close()
    files = [f for f in work.rglob("*") if f.is_file()]
    found = sorted(
        {name for name, secret in SECRETS.items() for f in files if secret.encode() in f.read_bytes()}
    )
    debug = " DEBUG " in p.log.read_text(errors="replace")
    return Row(
        attack="pager_secret_in_logs",
        item="5",
        what="the pager at DEBUG with secrets in webhook paths, a query token and the routing key",
        answer=(
            f"{'/'.join(map(str, answers))}, delivered{'' if delivered else ' NOT all'}; secrets in its "
            f"{len(files)} log and state files: {', '.join(found) or 'none'}"
        ),
        up=up,
        lost=0 if delivered else 1,
        held=delivered and not found and debug and answers == [200, 200],
    )


def pager_delivery_scaling(work: Path, probes: int = 20) -> Row:
    """Alert-to-delivery time with 10 and with 1,000 incidents in the book (before the fix the
    whole book was rewritten and fsynced on every delivery: 13 ms at 100, 396 ms at 3,000). Two
    pagers, one per book size, probed in turn, so the machine's load weighs on both alike."""
    sizes = (10, 1000)
    rxs = {n: Receiver() for n in sizes}
    pagers = {n: PagerProc(work / f"book-{n}", "--webhook-url", rxs[n].url + "/hook") for n in sizes}
    took: dict[int, list[float]] = {n: [] for n in sizes}
    try:
        for n in sizes:
            pagers[n].start().post("/v1/alertmanager", payload(*(alert(f"fill-{i}") for i in range(n))))
        for n in sizes:
            rxs[n].wait(lambda path, b: True, n, timeout=300)
        for i in range(probes):
            for n in sizes:
                t0 = time.perf_counter()
                pagers[n].post("/v1/alertmanager", payload(alert(f"probe-{i}")))
                rxs[n].wait(lambda path, b, r=f"probe-{i}": b.get("run") == r, 1, 60)
                took[n].append(time.perf_counter() - t0)
        lost = sum(n + probes - rxs[n].count(lambda path, b: b.get("status") == "firing") for n in sizes)
        up = all(p.alive() for p in pagers.values())
    finally:
        for n in sizes:
            pagers[n].stop()
            rxs[n].close()
    small, big = (statistics.median(took[n]) for n in sizes)
    return Row(
        attack="pager_delivery_scaling",
        item="6",
        what=f"one alert's POST-to-delivery time with 10 vs 1,000 incidents in the book (median of {probes})",
        answer=f"{ms(small)} at 10 incidents, {ms(big)} at 1,000 ({big / small:.2f}x)",
        up=up,
        lost=lost,
        held=big / small < 3 and lost == 0,
    )


def _pieces(chunked: bool) -> Any:
    piece = b'{"alerts":[' + b"0," * (1 << 19)
    for _ in range((200 << 20) // len(piece)):
        yield b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece


def pager_oversized_body(work: Path) -> Row:
    """200 MB to /v1/alertmanager: declared in Content-Length, then streamed chunked."""
    rx = Receiver()
    p = PagerProc(work, "--webhook-url", rx.url + "/hook", "--log-level", "warning")
    head = "POST /v1/alertmanager HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{}\r\n\r\n"
    try:
        p.start()
        peak = vm_kib(p.pid, "VmHWM")
        declared, sent_d = raw_request(
            p.port, head.format("Content-Length: 209715200").encode(), _pieces(False)
        )
        chunked, sent_c = raw_request(
            p.port, head.format("Transfer-Encoding: chunked").encode(), _pieces(True)
        )
        grew = (vm_kib(p.pid, "VmHWM") - peak) / 1024
        real = p.post("/v1/alertmanager", payload(alert("after"))).status_code
        delivered = rx.wait(lambda path, b: b.get("run") == "after", 1, 30)
        up = p.alive()
    finally:
        p.stop()
        rx.close()
    refused = declared.startswith("413") and chunked.startswith("413")
    return Row(
        attack="pager_oversized_body",
        item="6",
        what="200 MB POSTs to the pager: declared, and streamed chunked",
        answer=(
            f"{declared[:3]} before any body byte ({sent_d >> 20} MB sent); chunked {chunked[:3]} after "
            f"{sent_c >> 20} MB; peak RSS +{grew:.0f} MB; then an alert {real}, delivered"
        ),
        up=up,
        lost=0 if delivered else 1,
        held=refused and sent_d == 0 and grew < 64 and real == 200 and delivered,
    )


def pager_deep_nesting(work: Path) -> Row:
    """100,000 nested `[` to /v1/alertmanager; an event whose detail is nested 300 deep."""
    rx = Receiver()
    p = PagerProc(work, "--webhook-url", rx.url + "/hook", "--log-level", "warning")
    detail: dict[str, Any] = {}
    for _ in range(300):
        detail = {"d": detail}
    try:
        p.start()
        am = p.post("/v1/alertmanager", b"[" * 100_000).status_code
        ev = p.post("/v1/events", {"run": "r1", "kind": "halt", "detail": detail}).status_code
        real = p.post("/v1/alertmanager", payload(alert("after"))).status_code
        delivered = rx.wait(lambda path, b: b.get("run") == "after", 1, 30)
        up = p.alive()
    except Down:
        up, am, ev, real, delivered = False, 0, 0, 0, False
    finally:
        p.stop()
        rx.close()
    return Row(
        attack="pager_deep_nesting",
        item="6",
        what="100k nested '[' to /v1/alertmanager, an event detail nested 300 deep",
        answer=f"{am} / {ev}; then an alert {real}, delivered",
        up=up,
        lost=0 if delivered else 1,
        held=am == 400 and ev == 400 and real == 200 and delivered,
    )
