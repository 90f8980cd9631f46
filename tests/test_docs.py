"""The documentation runs as written.

Every fenced block in README.md and docs/*.md whose info string is ``python runnable``
or ``bash runnable`` is run, in document order, one file at a time, against a daemon
this test starts (``TIERSTORE_SOCKET`` names it), in a scratch working directory with
its own home. A block that fails names its file and line. Also: the systemd unit and
the example TOML agree, and docs/store.md's settings table lists every setting.
"""

import os
import pathlib
import re
import subprocess
import sys
import tomllib
from dataclasses import fields

import pytest

from tierstore import Config
from tierstore.config import SECTIONS

ROOT = pathlib.Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"^```(python|bash) runnable[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def runnable_blocks(path: pathlib.Path) -> list[tuple[int, str, str]]:
    """(line, language, code) of each runnable block of ``path``, in order."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)) for m in _BLOCK.finditer(text)]


def test_the_readme_has_runnable_blocks():
    kinds = {lang for _, lang, _ in runnable_blocks(ROOT / "README.md")}
    assert kinds == {"python", "bash"}


@pytest.mark.parametrize("doc", [d for d in DOCS if runnable_blocks(d)], ids=lambda d: d.name)
def test_runnable_blocks_run_as_written(doc, daemon, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    bindir = pathlib.Path(sys.executable).parent  # the `tierstore` console script lives beside this python
    env = {**os.environ, "TIERSTORE_SOCKET": daemon.socket, "HOME": str(home), "XDG_DATA_HOME": str(home / "data"),
           "XDG_CACHE_HOME": str(home / "cache"), "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    for line, lang, code in runnable_blocks(doc):
        cmd = [sys.executable, "-c", code] if lang == "python" else ["bash", "-e", "-o", "pipefail", "-c", code]
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        where = f"{doc.relative_to(ROOT)}:{line} ({lang})"
        assert r.returncode == 0, f"{where} failed with status {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        assert "Traceback" not in r.stderr and "Warning" not in r.stderr, f"{where} printed:\n{r.stderr[-3000:]}"


def test_the_systemd_unit_sets_nothing_behind_the_toml_files_back():
    unit = (ROOT / "daemon" / "tierstore.service").read_text()
    assert not re.search(r"^\s*Environment\s*=.*TIERSTORE_", unit, re.M), "the unit sets a TIERSTORE_* variable"
    exec_start = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1)
    conf = re.search(r"--config (\S+)", exec_start).group(1)
    assert conf == "/etc/tierstore/tierstore.toml" and exec_start.split()[1:3] == ["daemon", "--config"]
    example = ROOT / "docs" / "examples" / "tierstore.toml"
    cfg = Config.load(example, env={})  # every key is a setting
    runtime = re.search(r"^RuntimeDirectory=(\S+)$", unit, re.M).group(1)
    assert cfg.daemon.socket == f"/run/{runtime}/tierstore.sock"
    assert "nvme_dirs" in tomllib.loads(example.read_text())["store"]
    assert f"install -D -m 0644 docs/examples/tierstore.toml {conf}" in (ROOT / "docs" / "daemon.md").read_text()


def test_the_settings_table_lists_every_setting():
    text = (ROOT / "docs" / "store.md").read_text()
    for section, cls in SECTIONS.items():
        table = text[text.index(f"| `[{section}]` setting | default | meaning |"):].split("\n\n")[0]
        listed = [name for row in re.findall(r"^\| ([^|]+) \|", table, re.M)[1:]
                  for name in re.findall(r"`(\w+)`", row)]
        assert sorted(listed) == sorted(f.name for f in fields(cls)), section


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("Install and run the tests:"):].split("```bash\n", 1)[1].split("```", 1)[0]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert block.strip() == ci and " -n " in ci  # the suite runs on parallel workers (pytest-xdist)
