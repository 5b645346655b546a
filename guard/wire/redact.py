"""No secret from a URL in any log line, for every moeguard process that posts somewhere (the
collector's Alertmanager client, guard/wire/retry.py's failure reasons).

Webhook URLs carry their secret in the path (Slack's /services/T.../B.../<secret>), and httpx logs
every request's full URL at INFO, so under `logging.basicConfig(level=INFO)` the secret would land
in the log. `quiet_http_logs()` keeps httpx quiet, `redact_urls()` cuts URLs in any text down to
scheme://host.
"""

from __future__ import annotations

import logging
import re

# scheme://[userinfo@]host[:port] then path, query, fragment: all but scheme and host go
_URL = re.compile(r"(?i)\b(https?)://(?:[^/\s?#@'\"<>]*@)?([^/\s?#'\"<>]*)[^\s'\"<>]*")


def redact_urls(text: str) -> str:
    """Every http(s) URL in `text` cut down to scheme://host[:port]."""
    return _URL.sub(lambda m: f"{m.group(1)}://{m.group(2)}", text)


def redact_url(url: str) -> str:
    """One URL (maybe malformed) as it may be shown: scheme://host, or what precedes its first '/'."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    host = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0].rsplit("@", 1)[-1]
    return f"{scheme}{sep}{host}" + ("/..." if len(host) < len(rest) else "")


class _RedactURLs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "://" in message:
            record.msg, record.args = redact_urls(message), None
        return True


def quiet_http_logs() -> None:
    """Keep httpx and httpcore at WARNING (their INFO and DEBUG lines name every URL) and redact
    URLs in whatever they still log, should someone turn them back up. Idempotent."""
    for name in ("httpx", "httpcore"):
        logger = logging.getLogger(name)
        if logger.level < logging.WARNING:  # NOTSET included: basicConfig(INFO) would reach it
            logger.setLevel(logging.WARNING)
        if not any(isinstance(f, _RedactURLs) for f in logger.filters):
            logger.addFilter(_RedactURLs())
