"""The README's Quick start as a newcomer runs it: its WebSocket snippet needs nothing beyond what
`pip install -e .` installs, and it runs against a real server; CI runs exactly the README's test command.

(A fresh venv built from the README by hand is the full check; these keep it from drifting.)
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.server import ServerThread

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
QUICK_START = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def snippet() -> str:
    (code,) = blocks(QUICK_START, "python")
    return code


def installed_by_the_server() -> set[str]:
    """Import names of the server's own dependencies (`pip install -e .`, no extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0].replace("-", "_").lower() for dep in project["dependencies"]}


def test_the_websocket_snippet_imports_only_what_the_quick_start_installs() -> None:
    imported = {alias.name.split(".")[0] for node in ast.walk(ast.parse(snippet()))
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(ast.parse(snippet()))
                 if isinstance(node, ast.ImportFrom) and node.module}
    third_party = imported - set(sys.stdlib_module_names)
    assert third_party <= installed_by_the_server(), f"{third_party - installed_by_the_server()} not installed"


def test_the_websocket_snippet_speaks_against_a_real_server(server: ServerThread, tmp_path: Path) -> None:
    code = snippet()
    assert "ws://127.0.0.1:8000/" in code
    script = tmp_path / "hello.py"
    script.write_text(code.replace("ws://127.0.0.1:8000/", f"ws://127.0.0.1:{server.port}/"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert '"type":"session.updated"' in lines[0]
    assert any(line.endswith("bytes of 24 kHz s16le audio") for line in lines)
    assert '"type":"session.done"' in lines[-1]


def test_the_quick_start_serves_on_the_embedded_engine_and_says_it_keeps_the_terminal() -> None:
    install_and_serve = blocks(QUICK_START, "sh")[0].strip()
    assert install_and_serve == ("python3 -m venv .venv && .venv/bin/pip install -e . && "
                                 ".venv/bin/voicewire serve --port 8000 --no-auth")
    assert "keeps the terminal" in QUICK_START and "second terminal" in QUICK_START


def test_the_quick_start_says_which_python_it_needs_before_the_install_command() -> None:
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    minimum = re.fullmatch(r">=\s*(\d+\.\d+)", requires)
    assert minimum, requires
    before_install = QUICK_START.split("```sh", 1)[0]
    assert f"Python {minimum[1]} or newer" in before_install


def test_ci_runs_exactly_the_readme_test_command() -> None:
    tests = README.split("## Tests", 1)[1].split("\n## ", 1)[0]
    (command,) = blocks(tests, "sh")
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == command.strip()
