"""The README's vLLM launch lines are what the tests run: the server's environment and flags
(``VLLM_PLUGINS=deltasync``, the credential file, no dev mode) and the agent's flags, parsed from the README and
compared with the test launchers, so neither can drift from the other."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from deltasync.cli import _parser
from deltasync.testing.launchers import VllmServerProcess
from tests.integration.helpers import sidecar_command

README = (Path(__file__).parents[2] / "README.md").read_text()


def _commands(section: str) -> list[list[str]]:
    """The console commands of the first block after ``section``: continuations joined, optional ``[...]`` and
    comments dropped, the prompt (``$`` or ``host$``) removed."""
    block = re.search(r"```console\n(.*?)```", README[README.index(section) :], re.S).group(1)  # type: ignore[union-attr]
    text = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in text.splitlines():
        line = re.sub(r"\[[^]]*\]", "", re.sub(r"^\w*\$ ", "", line)).split(" #")[0]
        out.append(shlex.split(line))
    return out


def test_the_readme_server_line_is_the_tests_server(tmp_path: Path) -> None:
    commands = _commands("**A vLLM server and the sidecar agent**")
    exports = dict(w.split("=", 1) for c in commands if c[:1] == ["export"] for w in c[1:])
    [server] = [c for c in commands if "vllm.entrypoints.openai.api_server" in c]
    env = dict(w.split("=", 1) for w in server[: server.index("python")])
    args = server[server.index("vllm.entrypoints.openai.api_server") + 1 :]
    launcher = VllmServerProcess(tmp_path / "model", log=tmp_path / "vllm.log")
    assert env == {"VLLM_PLUGINS": "deltasync"} and launcher.environment()["VLLM_PLUGINS"] == "deltasync"
    assert set(exports) == {"DELTASYNC_ENGINE_TOKEN_FILE"} and "DELTASYNC_ENGINE_TOKEN_FILE" in launcher.environment()
    cmd = launcher.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--weight-transfer-config", "--worker-extension-cls"):
        assert cmd[cmd.index(flag) + 1] == args[args.index(flag) + 1], flag
    assert "VLLM_SERVER_DEV_MODE=1" not in README  # no dev mode anywhere: the guard's plugin attaches the routes


def test_the_readme_agent_line_is_the_tests_sidecar(tmp_path: Path) -> None:
    [agent] = [c for c in _commands("**A vLLM server and the sidecar agent**") if "agent" in c and "deltasync" in c]
    readme_flags = {w for w in agent[agent.index("agent") + 1 :] if w.startswith("--")}
    sidecar = sidecar_command("http://127.0.0.1:1", "http://127.0.0.1:2", tmp_path, tmp_path)
    assert sidecar[1:4] == ["-m", "deltasync.cli", "agent"]
    test_flags = {w for w in sidecar if w.startswith("--")}
    shared = {"--vllm-url", "--coordinator", "--store", "--agent-id"}
    assert shared <= readme_flags and shared <= test_flags
    sub = next(a for a in _parser()._actions if getattr(a, "choices", None) and "agent" in a.choices)
    known = {o for a in sub.choices["agent"]._actions for o in a.option_strings}  # type: ignore[union-attr]
    assert readme_flags | test_flags <= known, (readme_flags | test_flags) - known
