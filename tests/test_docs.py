"""What the documentation promises a newcomer, checked against the code: the README's
``--mesh`` table names every mesh axis, and ``--help`` names every form ``--resume`` takes."""

import re
from pathlib import Path

from jaxdist.layout.mesh import MESH_AXES
from jaxdist.train import build_arg_parser

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_mesh_table_names_every_axis():
    table = [line for line in README.read_text().splitlines() if line.startswith("| `data=2,fsdp=2,tensor=2` |")]
    assert len(table) == 1
    named = set(re.findall(r"`(\w+)`", table[0].split("|")[2]))
    assert set(MESH_AXES) <= named, set(MESH_AXES) - named


def test_train_help_names_every_resume_form_and_the_config_printer():
    text = " ".join(build_arg_parser().format_help().split())
    for form in ("auto", "never", "STEP", "PATH", "params:STEP"):
        assert form in text.split("--resume", 1)[1], form
    assert "--print-config" in text and "--log-level" in text


def _help(main, argv) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(argv)
    return out.getvalue()


def test_one_command_runs_each_cli_with_its_own_arguments():
    import importlib

    from jaxdist.__main__ import COMMANDS
    from jaxdist.__main__ import main as jaxdist_main

    for name, (module, _) in COMMANDS.items():
        own = _help(importlib.import_module(module).main, ["--help"])
        assert own and _help(jaxdist_main, [name, "--help"]) == own, name


def test_the_console_script_and_python_m_agree(tmp_path):
    import shutil
    import subprocess
    import sys

    script = shutil.which("jaxdist")
    assert script, "the jaxdist console script is not installed (pip install -e .)"
    for cmd in (
        [script, "train", "--print-config", "--steps", "3"],
        [sys.executable, "-m", "jaxdist", "train", "--print-config", "--steps", "3"],
    ):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0 and "  steps: 3\n" in proc.stdout, proc.stderr
    proc = subprocess.run([script, "trian"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("jaxdist: error: unknown command 'trian'"), proc.stderr


def test_every_config_key_is_documented_and_configs_readme_is_current():
    """configs/README.md is generated from config.py's field documentation: a key without a
    line, or a README older than the fields, fails here (regenerate: python tests/config_reference.py > configs/README.md)."""
    from jaxdist.config import keys

    from config_reference import readme_markdown

    undocumented = [key for key, field in keys().items() if not field.metadata.get("doc")]
    assert not undocumented, undocumented
    written = (README.parent / "configs" / "README.md").read_text()
    assert written == readme_markdown(), "configs/README.md is stale: python tests/config_reference.py > configs/README.md"
    for key in keys():
        assert f"| `{key}` |" in written, key
