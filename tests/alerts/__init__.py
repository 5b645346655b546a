"""Tests for alerts/ (Prometheus rules, promtool unit tests, Alertmanager config) and playbooks/."""
