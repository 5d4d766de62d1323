"""The README promises two commands; CI must run exactly the test one."""

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
