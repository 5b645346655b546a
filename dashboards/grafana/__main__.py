"""Regenerate the committed dashboard JSON beside this file: `python -m dashboards.grafana`."""

from dashboards.grafana.cli import GRAFANA_DIR, export

for path in export(GRAFANA_DIR):
    print(path)
