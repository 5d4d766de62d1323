"""The README promises two commands, and CI must run exactly the test one; the commands and
the code the READMEs show use options and keywords that exist."""

import ast
import importlib.util
import inspect
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands():
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```bash\n")[1:]
    return [block.split("```")[0].strip() for block in blocks]


def test_readme_has_the_two_commands_and_ci_runs_the_test_one():
    commands = readme_commands()
    demo = [c for c in commands if "swarmtrain demo" in c]
    tests = [c for c in commands if "pytest" in c]
    assert len(demo) == 1 and len(tests) == 1
    test_command = tests[0].split("&& ", 2)[-1]  # after creating and activating the venv
    ci_script = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci_script


def code_blocks(path: Path, language: str = "") -> list[str]:
    text = path.read_text()
    return [block.split("```")[0] for block in text.split(f"```{language}\n")[1:]]


QUICKSTART = "examples/quickstart/train.py"


def documented_commands() -> list[tuple[Path, list[str]]]:
    """Every ``swarmtrain ...`` and ``python examples/quickstart/...`` line of the READMEs' code
    blocks (a ``# `` comment prefix and trailing comments dropped)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "examples").glob("*/README.md"))]:
        for block in code_blocks(path):
            for line in block.splitlines():
                line = line.strip().removeprefix("# ").split(" #")[0].strip()
                if line.startswith(("swarmtrain ", f"python {QUICKSTART}")):
                    found.append((path, shlex.split(line)))
    return found


def test_readme_commands_use_options_that_exist():
    from swarmtrain.cli.main import build_parser

    spec = importlib.util.spec_from_file_location(
        "quickstart", ROOT / "examples/quickstart/train.py"
    )
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    commands = documented_commands()
    assert any("--initial_peers" in words for _, words in commands)  # the join step is shown
    for path, words in commands:
        parser = build_parser() if words[0] == "swarmtrain" else quickstart.build_parser()
        args = words[1:] if words[0] == "swarmtrain" else words[2:]
        try:
            parser.parse_args(args)
        except SystemExit as e:
            raise AssertionError(f"{path.name}: {' '.join(words)} does not parse") from e


def test_readme_walks_through_the_optimizer_with_valid_keywords():
    import swarmtrain

    blocks = code_blocks(ROOT / "README.md", "python")
    walkthrough = [b for b in blocks if "swarmtrain.Optimizer(" in b]
    assert walkthrough, "the README shows no swarmtrain.Optimizer loop"
    assert "initial_peers" in walkthrough[0] and "load_state_from_peers()" in walkthrough[0]
    accepted = {
        "Optimizer": set(inspect.signature(swarmtrain.Optimizer).parameters),
        "DiLoCoOptimizer": set(inspect.signature(swarmtrain.DiLoCoOptimizer).parameters),
    }
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                names = accepted.get(node.func.attr)
                if names is not None:
                    unknown = {k.arg for k in node.keywords} - names
                    assert not unknown, f"swarmtrain.{node.func.attr} has no {unknown}"
