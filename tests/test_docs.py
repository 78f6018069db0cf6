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
