"""What the documentation promises a newcomer, checked against the code: the parallelism
page's ``--mesh`` table names every mesh axis, ``--help`` names every form ``--resume`` takes,
every link between the pages resolves, and the README stays a short front page whose feature
table, commands, exit codes and run-directory contract match the code."""

import re
from pathlib import Path

from jaxdist.layout.mesh import MESH_AXES
from jaxdist.train import build_arg_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PARALLEL = ROOT / "jaxdist" / "parallel" / "README.md"
# The pages beside the code, one per concern, each linked from the README's feature table.
PAGES = [ROOT / "jaxdist" / concern / "README.md" for concern in ("parallel", "training", "data", "cluster", "inspect", "plan", "hf")]
DOCS = [README, ROOT / "configs" / "README.md", ROOT / "experiments" / "README.md", ROOT / "tests" / "README.md", *PAGES]


def test_the_mesh_table_names_every_axis():
    table = [line for line in PARALLEL.read_text().splitlines() if line.startswith("| `data=2,fsdp=2,tensor=2` |")]
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
        prog = module.removesuffix(".__main__").removeprefix("jaxdist.")
        assert own.startswith(f"usage: python -m jaxdist.{prog}"), own[:80]
        # the same flags; the usage names the command as typed (argparse wraps it to that name's width)
        one = _help(jaxdist_main, [name, "--help"])
        assert one.split() == own.replace(f"python -m jaxdist.{prog}", f"jaxdist {prog}").split(), name


def test_the_console_script_and_python_m_agree(tmp_path):
    import importlib.metadata
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
    assert proc.returncode == 2 and proc.stderr.startswith("jaxdist: error: unknown command 'trian' (did you mean train? "), proc.stderr
    proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, f"jaxdist {importlib.metadata.version('jaxdist')}\n"), proc.stderr
    proc = subprocess.run([script, "zzz"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "did you mean" not in proc.stderr, proc.stderr


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


# -- links and the README's shape ----------------------------------------------------------


def _prose(text: str) -> list[str]:
    """The lines of a markdown file outside fenced code blocks, inline code spans removed."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return lines


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for a file's headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated heading numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    anchors = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(path: Path) -> list[str]:
    """Every relative link target of a markdown file (web addresses left out)."""
    targets = []
    for line in _prose(path.read_text()):
        targets += [t for t in re.findall(r"\]\(([^)\s]+)\)", line) if not re.match(r"[a-z]+:", t)]
    return targets


def _broken(path: Path, target: str) -> str | None:
    file, _, anchor = target.partition("#")
    resolved = (path.parent / file).resolve() if file else path
    if not resolved.exists():
        return f"{path.relative_to(ROOT)}: {target} (no such file)"
    if anchor and (resolved.is_dir() or resolved.suffix != ".md" or anchor not in _anchors(resolved)):
        return f"{path.relative_to(ROOT)}: {target} (no heading #{anchor})"
    return None


def test_every_relative_link_in_the_documentation_resolves():
    """Each page's links to files and to sections (``page.md#heading``) land somewhere."""
    assert all(page.exists() for page in DOCS), [str(p) for p in DOCS if not p.exists()]
    broken = [b for page in DOCS for target in _links(page) if (b := _broken(page, target))]
    assert not broken, broken


def test_the_anchor_rule_is_githubs():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "p.md"
        page.write_text("# Experts (MoE)\n## `scaling.py` — strategies x devices\n```\n# not a heading\n```\n## Tests\n## Tests\n")
        assert _anchors(page) == {"experts-moe", "scalingpy--strategies-x-devices", "tests", "tests-1"}


def test_the_readme_is_a_short_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines: move the detail to a page beside its code"


def _section(text: str, heading: str) -> str:
    """A '## heading' section of a markdown file, up to the next '## '."""
    after = text.split(f"\n## {heading}\n", 1)[1]
    return after.split("\n## ", 1)[0]


def test_the_feature_table_links_a_page_for_every_concern():
    rows = [line for line in _section(README.read_text(), "Features").splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows, "README.md has no feature table"
    linked = set()
    for row in rows:
        targets = re.findall(r"\]\(([^)\s]+)\)", row)
        assert targets, f"a feature without its page: {row}"
        for target in targets:
            assert _broken(README, target) is None, _broken(README, target)
            linked.add((ROOT / target.partition("#")[0]).resolve())
    missing = [str(page.relative_to(ROOT)) for page in PAGES if page.resolve() not in linked]
    assert not missing, missing


def test_the_quick_start_keeps_its_two_commands():
    """The contract: one command sets up and runs the main job, one sets up and runs the tests."""
    text = README.read_text()
    assert "\n```bash\npython -m pip install -e . && python -m jaxdist.train\n```\n" in text
    assert '\n```bash\npython -m pip install -e ".[dev]" && bash .ci/run\n```\n' in text


def test_the_readme_lists_every_command_both_ways():
    from jaxdist.__main__ import COMMANDS

    section = _section(README.read_text(), "Commands")
    for name, (module, _) in COMMANDS.items():
        row = [line for line in section.splitlines() if line.startswith(f"| `jaxdist {name}`")]
        assert len(row) == 1, name
        assert f"`python -m {module.removesuffix('.__main__')}`" in row[0], row[0]
        assert re.search(r"\]\((jaxdist/\w+/README\.md)(#[\w-]+)?\)", row[0]), f"{name}: no page"


def test_the_readme_states_every_exit_code():
    from jaxdist import errors

    section = _section(README.read_text(), "Exit codes")
    stated = {int(code) for code in re.findall(r"^\| `(\d+)` \|", section, re.M)}
    codes = {value for name, value in vars(errors).items() if name.startswith("EXIT_") and isinstance(value, int)}
    assert codes <= stated, codes - stated


def test_the_readme_states_the_run_directory_contract():
    section = _section(README.read_text(), "The run directory")
    for name in ("config.yaml", "metrics.jsonl", "checkpoints/", "tensorboard/"):
        assert f"`{name}" in section, name
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s", "data_wait_s", "mfu", "eval_loss"):
        assert f"`{key}`" in section, key
    for key in ("moe_aux_loss", "moe_load_max", "moe_dropped_fraction", "joules_per_token", "power_w"):
        assert f"`{key}`" in section, key


def test_the_user_documentation_carries_no_development_history():
    """Pages say what is; what an earlier version did belongs to the commit history."""
    pattern = re.compile(r"\bwave \d|\bissue \d+|\bused to\b|\bno longer\b|\bthe old spelling\b|\bearlier template\b", re.I)
    found = [
        f"{page.relative_to(ROOT)}: {line.strip()}"
        for page in [README, ROOT / "tests" / "README.md", *PAGES]
        for line in _prose(page.read_text())
        if pattern.search(line)
    ]
    assert not found, found
