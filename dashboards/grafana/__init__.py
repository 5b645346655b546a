"""Grafana dashboards as code, and `moeguard grafana push|export`.

panels.py   panel and dashboard builders (plain dicts on Grafana's 24-column grid)
boards.py   the three dashboards (run overview, per layer, fleet) from guard/core/schema.py's names
cli.py      `moeguard grafana export DIR` and `push --url URL` (grafana-client)
*.json      boards.py's output, committed; a test keeps them in sync (`python -m dashboards.grafana`)
*.yml       Grafana provisioning: the Prometheus datasource and the dashboards folder
"""
