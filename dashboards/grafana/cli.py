"""`moeguard grafana push|export`: write the dashboards' JSON, or upload them with grafana-client.

moeguard grafana export DIR                 write the dashboards' JSON (and datasource.yml)
moeguard grafana push --url URL [--folder NAME]   create/overwrite them in Grafana
                                            (token from GRAFANA_TOKEN; user:pass in URL works too)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from dashboards.grafana.boards import build_all, dashboard_json

GRAFANA_DIR = Path(__file__).resolve().parent  # the committed JSON and provisioning files
TOKEN_ENV = "GRAFANA_TOKEN"


def export(out_dir: str | Path) -> list[Path]:
    """Write every dashboard's JSON, and the provisioning files, to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in build_all():
        p = out / f"{d['uid']}.json"
        p.write_text(dashboard_json(d))
        paths.append(p)
    for extra in ("datasource.yml", "dashboards.yml"):
        src = GRAFANA_DIR / extra
        if src.is_file() and src.resolve() != (out / extra).resolve():
            shutil.copy(src, out / extra)
            paths.append(out / extra)
    return paths


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="grafana_cmd", metavar="ACTION", required=True)
    push = sub.add_parser(
        "push", help="create or overwrite the dashboards in Grafana (token from $GRAFANA_TOKEN)"
    )
    push.add_argument("--url", required=True, help="Grafana base URL, e.g. http://localhost:3000")
    push.add_argument("--folder", help="folder title to put them in (created if missing)")
    exp = sub.add_parser("export", help="write the dashboards' JSON and the provisioning files to DIR")
    exp.add_argument("dir", metavar="DIR")


def push(url: str, *, folder: str | None = None, token: str | None = None) -> list[dict[str, Any]]:
    """Upload every dashboard with overwrite; returns Grafana's answers."""
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(url, credential=token or None)
    folder_uid = None
    if folder:
        existing = [f for f in api.folder.get_all_folders() if f.get("title") == folder]
        folder_uid = existing[0]["uid"] if existing else api.folder.create_folder(folder)["uid"]
    answers = []
    for d in build_all():
        payload: dict[str, Any] = {
            "dashboard": {**d, "id": None},
            "overwrite": True,
            "message": "moeguard grafana push",
        }
        if folder_uid:
            payload["folderUid"] = folder_uid
        answers.append(api.dashboard.update_dashboard(payload))
    return answers


def run(args: argparse.Namespace) -> int:
    if args.grafana_cmd == "export":
        for p in export(args.dir):
            print(p)
        return 0
    from grafana_client.client import GrafanaException

    try:
        answers = push(args.url, folder=args.folder, token=os.environ.get(TOKEN_ENV))
    except GrafanaException as e:
        print(f"moeguard grafana: push to {args.url} failed: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"moeguard grafana: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    for d, a in zip(build_all(), answers, strict=True):
        print(f"{d['title']}: {a.get('status', 'ok')} {a.get('url', '')}".rstrip())
    return 0
