"""`moeguard pager`'s settings: one validated dataclass, and the names of the secrets it reads
from the environment (never from flags that show in `ps`, Slack's URL excepted)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from guard.core.tomlconf import check, check_choice
from guard.wire.redact import redact_url
from guard.wire.retry import RetryPolicy

ENV_PAGERDUTY_ROUTING_KEY = "MOEGUARD_PAGERDUTY_ROUTING_KEY"
ENV_SLACK_WEBHOOK_URL = "MOEGUARD_SLACK_WEBHOOK_URL"  # used when --slack-url is not given
ENV_PAGER_TOKEN = "MOEGUARD_PAGER_TOKEN"  # if set, POSTs need "Authorization: Bearer <token>"
PAGERDUTY_EVENTS_URL = "https://events.pagerduty.com/v2/enqueue"
PD_SEVERITIES = ("info", "warning", "error", "critical")  # rising
MAX_BODY_BYTES = 16 << 20  # one Alertmanager group of 1000 ranks is ~2 MB
# A delivery that has not landed within this long gives the sink's worker to the next incident;
# the reconcile loop re-drives it. The default attempts and waits fit well inside it.
RETRY_DEADLINE_S = 120.0
DELIVERY_RETRY = RetryPolicy(
    max_attempts=5, base_s=1.0, max_delay_s=30.0, timeout_s=10.0, deadline_s=RETRY_DEADLINE_S
)


@dataclass(kw_only=True, slots=True)
class Receivers:
    """Where pages go. Secrets (the routing key, and webhook URLs, which carry theirs in the
    path) stay out of repr."""

    pagerduty_url: str = PAGERDUTY_EVENTS_URL
    routing_key: str | None = field(default=None, repr=False)  # env only; PagerDuty is off without it
    slack_url: str | None = field(default=None, repr=False)
    webhook_urls: tuple[str, ...] = field(default=(), repr=False)
    runbook_base: str = ""  # makes repo-relative runbook links (playbooks/X.md) absolute
    page_severity: str = "critical"  # PagerDuty gets this severity and above

    def __post_init__(self) -> None:
        check_choice("page_severity", self.page_severity, PD_SEVERITIES)
        for key, url in [
            ("pagerduty_url", self.pagerduty_url),
            ("slack_url", self.slack_url),
            *(("webhook_url", u) for u in self.webhook_urls),
        ]:
            check(
                url is None or url.startswith(("http://", "https://")),
                key,
                redact_url(url) if url else url,
                "must be an http(s) URL",
            )


@dataclass(kw_only=True, slots=True)
class PagerConfig:
    host: str = "127.0.0.1"
    port: int = 9095
    token: str | None = field(default=None, repr=False)  # env only
    max_body_bytes: int = MAX_BODY_BYTES
    state: Path | None = None  # the incident book's snapshot (and its journal beside it)
    event_ttl_s: float = 3600.0  # an event-only incident is forgotten (not resolved) after this
    reconcile_s: float = 60.0
    receivers: Receivers = field(default_factory=Receivers)
    retry: RetryPolicy = DELIVERY_RETRY

    def __post_init__(self) -> None:
        check(0 <= self.port < 65536, "port", self.port, "must be in 0..65535")
        check(self.event_ttl_s > 0, "event_ttl", self.event_ttl_s, "must be > 0")
        check(self.reconcile_s > 0, "reconcile_interval", self.reconcile_s, "must be > 0")
        check(self.max_body_bytes > 0, "max_body_bytes", self.max_body_bytes, "must be > 0")
