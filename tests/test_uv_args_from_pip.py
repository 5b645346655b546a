"""scripts/uv_args_from_pip.py hands uv the index settings pip would use (scripts/bootstrap installs
with uv, which reads neither pip's config files nor PIP_*): the environment over the config files'
install section over their global one, each value of a multi-valued option its own flag."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("uv_args_from_pip", REPO / "scripts" / "uv_args_from_pip.py")
assert spec and spec.loader
uv_from_pip = importlib.util.module_from_spec(spec)
spec.loader.exec_module(uv_from_pip)

LISTED = """\
:env:.find-links='/srv/wheels'
:env:.default-timeout='180'
global.find-links='/old/wheels'
global.extra-index-url='file:///srv/a/simple file:///srv/b/simple'
global.index-url='https://mirror.example/simple'
global.constraint='/etc/pip/constraints.txt'
global.cert='/etc/ssl/ca.pem'
install.index-url='https://install.example/simple'
"""


def test_the_environment_wins_then_the_install_section_then_global() -> None:
    got = uv_from_pip.effective(LISTED)
    assert got["find-links"] == "/srv/wheels"
    assert got["index-url"] == "https://install.example/simple"
    assert got["cert"] == "/etc/ssl/ca.pem" and got["default-timeout"] == "180"


def test_every_extra_index_is_a_flag_and_uv_takes_the_best_match_across_them() -> None:
    args = uv_from_pip.uv_args(uv_from_pip.effective(LISTED))
    assert args == [
        "--index-url", "https://install.example/simple",
        "--extra-index-url", "file:///srv/a/simple",
        "--extra-index-url", "file:///srv/b/simple",
        "--find-links", "/srv/wheels",
        "--constraint", "/etc/pip/constraints.txt",
        "--index-strategy", "unsafe-best-match",
    ]  # fmt: skip


def test_no_pip_config_is_no_flags() -> None:
    assert uv_from_pip.uv_args(uv_from_pip.effective("")) == []
    assert uv_from_pip.uv_args(uv_from_pip.effective("global.timeout='60'\nnot a line\n")) == []


def test_it_reads_this_interpreters_pip_and_refuses_an_unknown_argument() -> None:
    script = str(REPO / "scripts" / "uv_args_from_pip.py")
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, check=True)
    assert r.stdout.split() == uv_from_pip.uv_args(uv_from_pip.effective(listed))
    bad = subprocess.run([sys.executable, script, "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "'--bogus'" in bad.stderr


def test_an_air_gapped_mirror_keeps_pip_off_the_index_and_its_trusted_host() -> None:
    listed = (
        "global.no-index='true'\nglobal.find-links='/srv/wheels'\n"
        "global.trusted-host='mirror.internal other.internal'\n"
    )
    args = uv_from_pip.uv_args(uv_from_pip.effective(listed))
    assert args == [
        "--find-links", "/srv/wheels",
        "--allow-insecure-host", "mirror.internal",
        "--allow-insecure-host", "other.internal",
        "--no-index",
        "--index-strategy", "unsafe-best-match",
    ]  # fmt: skip
    assert "--no-index" not in uv_from_pip.uv_args(uv_from_pip.effective("global.no-index='false'\n"))
