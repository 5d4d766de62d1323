"""hivemind's own public-API tests, run against swarmtrain with only their imports renamed.

    python benchmarks/hivemind_api_compat.py [--mirror PATH] [--files test_dht.py ...]
                                             [--keep DIR] [--reasons] [-k EXPR] [--timeout S]

Not part of our test suite: the tests are hivemind's (MIT), so they are never copied into this
repository. This script reads them at run time from a bare git mirror of hivemind
(``--mirror``, default ``/work/.mirror/learning-at-home+hivemind/repo``, ``HEAD``), writes them
into a temporary directory with their ``hivemind`` imports rewritten to swarmtrain's modules
(``MODULE_MAP`` / ``NAME_MAP`` below; nothing else in the test code changes), and runs pytest
on each file in its own process with this interpreter. It prints passed/failed per file and the
total.

The selection (``SELECTED_FILES``, 99 test cases with parametrization counted per case): the
files that exercise hivemind's public classes -- ``DHT``, ``DHTNode``, the DHT schema and record
validators, DHT ids and routing tables, ``DecentralizedAverager``, the ``Optimizer``,
``GradientAverager``, ``TrainingStateAverager``, ``ProgressTracker`` and compression. Left out:
tests of internals that swarmtrain replaces by design (the Go p2p daemon and its bindings,
the p2p servicer, relays, multiaddr parsing, MPFuture and other ``hivemind.utils`` helpers,
the all-reduce runner's and partitioner's private classes, DHT protocol/storage internals,
auth tokens) and of features swarmtrain does not have (Mixture-of-Experts servers, experts,
CLI scripts).

Import rewriting: ``from hivemind.X import A`` becomes ``from swarmtrain.Y import A`` where
``Y = MODULE_MAP[X]`` (or ``NAME_MAP`` when swarmtrain spells the name differently). A name
that swarmtrain does not have becomes a placeholder that raises ``ImportError`` naming the
missing name when the test uses it, so only the tests that use it fail (hivemind's files import
many names that only a few tests use). ``import hivemind.X`` binds ``hivemind`` to ``swarmtrain``.
Renamed: ``DHTNode`` -> ``AsyncioDHTNode`` (hivemind's node is awaited from asyncio, ours is
trio code), ``RSASignatureValidator`` -> ``Ed25519SignatureValidator`` and ``RSAPrivateKey`` ->
``generate_private_key`` (we sign with Ed25519), ``AllreduceException`` -> ``AveragingError``,
``P2PDaemonError`` -> ``P2PError`` (the base of our host's errors; there is no daemon).
Each file runs one test at a time, with ``--timeout`` seconds per test (default 30).
hivemind's helpers in ``tests/test_utils`` are rewritten the same way; hivemind's
``conftest.py`` (MPFuture/RSA key cleanup) is replaced by a small one of ours that reaps child
processes and runs ``@pytest.mark.forked`` tests in a forked child, as pytest-forked does for
hivemind's CI (pytest-forked itself cannot send pytest 9's reports back). The async tests need
``pytest-asyncio``: when this interpreter lacks it, it is installed once with pip into a cache
directory (``~/.cache/swarmtrain-hivemind-compat``) that only these runs put on ``sys.path``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

DEFAULT_MIRROR = "/work/.mirror/learning-at-home+hivemind/repo"

SELECTED_FILES = (
    "test_dht.py",
    "test_dht_node.py",
    "test_dht_schema.py",
    "test_dht_validation.py",
    "test_dht_crypto.py",
    "test_routing.py",
    "test_averaging.py",
    "test_optimizer.py",
    "test_compression.py",
)
HELPER_FILES = ("test_utils/__init__.py", "test_utils/dht_swarms.py", "test_utils/networking.py")

# hivemind module -> the swarmtrain module that exposes the same names.
MODULE_MAP = {
    "hivemind": "swarmtrain",
    "hivemind.averaging": "swarmtrain.averaging",
    "hivemind.averaging.allreduce": "swarmtrain.averaging",
    "hivemind.averaging.control": "swarmtrain.averaging.control",
    "hivemind.averaging.key_manager": "swarmtrain.averaging",
    "hivemind.averaging.load_balancing": "swarmtrain.averaging.load_balancing",
    "hivemind.averaging.partition": "swarmtrain.averaging",
    "hivemind.compression": "swarmtrain.compression",
    "hivemind.compression.adaptive": "swarmtrain.compression",
    "hivemind.compression.quantization": "swarmtrain.compression",
    "hivemind.dht": "swarmtrain.dht",
    "hivemind.dht.crypto": "swarmtrain.dht",
    "hivemind.dht.node": "swarmtrain.dht",
    "hivemind.dht.protocol": "swarmtrain.dht",
    "hivemind.dht.routing": "swarmtrain.dht",
    "hivemind.dht.schema": "swarmtrain.dht",
    "hivemind.dht.validation": "swarmtrain.dht",
    "hivemind.optim": "swarmtrain.optim",
    "hivemind.optim.grad_averager": "swarmtrain.optim",
    "hivemind.optim.optimizer": "swarmtrain.optim",
    "hivemind.optim.power_sgd_averager": "swarmtrain.optim",
    "hivemind.optim.progress_tracker": "swarmtrain.optim",
    "hivemind.optim.state_averager": "swarmtrain.optim.state_averager",
    "hivemind.p2p": "swarmtrain.p2p",
    "hivemind.proto.runtime_pb2": "swarmtrain.compression",
    "hivemind.utils": "swarmtrain.dht",
    "hivemind.utils.crypto": "swarmtrain.p2p",
    "hivemind.utils.streaming": "swarmtrain.compression",
    "hivemind.utils.timed_storage": "swarmtrain.dht",
}
# (hivemind module, name) -> (module, name) where the name is spelled differently here, or comes
# from a library that hivemind vendors (py-multiaddr) or from the standard library.
NAME_MAP = {
    # hivemind's DHTNode is awaited from asyncio; swarmtrain's DHTNode is trio code
    ("hivemind.dht.node", "DHTNode"): ("swarmtrain.dht", "AsyncioDHTNode"),
    ("hivemind.dht", "DHTNode"): ("swarmtrain.dht", "AsyncioDHTNode"),
    # the base class of the errors a failed averaging step raises
    ("hivemind.averaging.partition", "AllreduceException"): (
        "swarmtrain.averaging",
        "AveragingError",
    ),
    # the same validator API (sign_value / validate / strip_value / local_public_key), Ed25519;
    # a new signing key is hivemind's RSAPrivateKey()
    ("hivemind.utils.crypto", "RSAPrivateKey"): ("swarmtrain.dht", "generate_private_key"),
    ("hivemind.dht.crypto", "RSASignatureValidator"): (
        "swarmtrain.dht",
        "Ed25519SignatureValidator",
    ),
    # the base class of the host's errors (hivemind's: of its Go daemon's)
    ("hivemind.p2p", "P2PDaemonError"): ("swarmtrain.p2p", "P2PError"),
    ("hivemind.utils.multiaddr", "Multiaddr"): ("multiaddr", "Multiaddr"),
    ("hivemind.utils.logging", "get_logger"): ("logging", "getLogger"),
    ("hivemind.utils.networking", "LOCALHOST"): ("swarmtrain.p2p", "LOCALHOST"),
}

SUPPORT_MODULE = '''
"""Placeholders for hivemind names that swarmtrain does not have (written by the harness)."""


class MissingName:
    def __init__(self, qualified_name):
        self._qualified_name = qualified_name

    def _fail(self, *args, **kwargs):
        raise ImportError(f"swarmtrain has no equivalent of {self._qualified_name}")

    __call__ = __bool__ = __iter__ = _fail

    def __getattr__(self, attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        self._fail()

    def __mro_entries__(self, bases):
        self._fail()
'''

CONFTEST = '''
"""Written by the harness: run ``forked`` tests in a forked child, reap leftover children."""

import json
import multiprocessing.connection  # noqa: F401  (hivemind imports it; its tests rely on it)
import os
import signal

import psutil
import pytest
from _pytest.runner import runtestprotocol


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if item.get_closest_marker("forked") is None:
        return None
    hook = item.ihook
    hook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child runs the test and sends its reports back as JSON
        os.close(read_end)
        code = 0
        try:
            reports = runtestprotocol(item, nextitem=None, log=False)
            data = [item.config.hook.pytest_report_to_serializable(config=item.config, report=r)
                    for r in reports]
            with os.fdopen(write_end, "w") as pipe:
                json.dump(data, pipe)
        except BaseException:
            code = 3
        os._exit(code)
    os.close(write_end)
    problem = None
    with os.fdopen(read_end) as pipe:
        try:
            payload = pipe.read()
        except BaseException as e:  # pytest-timeout's alarm fires here, in the parent
            os.kill(pid, signal.SIGKILL)
            payload, problem = "", f"{type(e).__name__}: {e}"
    _, status = os.waitpid(pid, 0)
    if payload:
        reports = [item.config.hook.pytest_report_from_serializable(config=item.config, data=d)
                   for d in json.loads(payload)]
    else:
        from _pytest.reports import TestReport

        reports = [TestReport(item.nodeid, item.location, {}, "failed",
                              problem or f"forked test process died (wait status {status})",
                              "call")]
    for report in reports:
        if isinstance(report.longrepr, list):  # a skip's (path, line, reason), made a list by JSON
            report.longrepr = tuple(report.longrepr)
        hook.pytest_runtest_logreport(report=report)
    hook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


@pytest.fixture(autouse=True, scope="session")
def reap_children():
    yield
    children = psutil.Process().children(recursive=True)
    _gone, alive = psutil.wait_procs(children, timeout=1)
    for child in alive:
        child.kill()
'''

PYTEST_INI = """
[pytest]
asyncio_default_fixture_loop_scope = function
timeout = {timeout}
markers =
    forked: run in a forked subprocess (pytest-forked)
"""

PLUGINS = ("pytest-asyncio==1.5.0",)
PIP = (sys.executable, "-m", "pip", "install", "--quiet", "--no-deps")
PYTEST = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider")


def _has_name(module: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def _import_lines(node: ast.ImportFrom | ast.Import) -> list[str]:
    if isinstance(node, ast.Import):
        lines = []
        for alias in node.names:
            if not alias.name.startswith("hivemind"):
                lines.append(
                    f"import {alias.name}" + (f" as {alias.asname}" if alias.asname else "")
                )
                continue
            target = MODULE_MAP.get(alias.name, "swarmtrain")
            if alias.asname:
                lines.append(f"import {target} as {alias.asname}")
            else:
                lines += [f"import {target}", "import swarmtrain as hivemind"]
        return lines
    lines = []
    for alias in node.names:
        bound = alias.asname or alias.name
        module, name = NAME_MAP.get((node.module, alias.name), (None, alias.name))
        if module is None:
            module = MODULE_MAP.get(node.module)
        if module is not None and _has_name(module, name):
            lines.append(f"from {module} import {name} as {bound}")
        else:
            lines.append(f"{bound} = _hm_missing({node.module + '.' + alias.name!r})")
    return ["from _hivemind_compat_support import MissingName as _hm_missing", *lines]


def rewrite_imports(source: str) -> str:
    """Replace every ``hivemind`` import statement in ``source``; nothing else changes."""
    tree = ast.parse(source)
    lines = source.splitlines()
    edits = []
    for node in ast.walk(tree):
        is_ours = (
            isinstance(node, ast.ImportFrom)
            and node.module is not None
            and node.module.split(".")[0] == "hivemind"
        ) or (
            isinstance(node, ast.Import)
            and any(alias.name.split(".")[0] == "hivemind" for alias in node.names)
        )
        if is_ours:
            edits.append(node)
    for node in sorted(edits, key=lambda n: n.lineno, reverse=True):
        indent = lines[node.lineno - 1][: node.col_offset]
        replacement = [indent + line for line in _import_lines(node)]
        lines[node.lineno - 1 : node.end_lineno] = replacement
    return "\n".join(lines) + "\n"


def extract(mirror: str, files: list[str], dest: Path, timeout: float) -> None:
    archive = subprocess.run(
        ["git", "-C", mirror, "archive", "HEAD", "tests"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for name in [*files, *HELPER_FILES]:
            try:
                member = tar.extractfile(f"tests/{name}")
            except KeyError:
                continue
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(rewrite_imports(member.read().decode()))
    (dest / "_hivemind_compat_support.py").write_text(SUPPORT_MODULE.lstrip())
    (dest / "conftest.py").write_text(CONFTEST.lstrip())
    (dest / "pytest.ini").write_text(textwrap.dedent(PYTEST_INI).lstrip().format(timeout=timeout))


def plugin_path() -> str | None:
    """A directory with pytest-asyncio, unless this interpreter has it."""
    try:
        import pytest_asyncio  # noqa: F401

        return None
    except ImportError:
        pass
    cache = Path.home() / ".cache" / "swarmtrain-hivemind-compat" / "plugins"
    if not (cache / "pytest_asyncio").exists():
        subprocess.run(
            [*PIP, "--target", str(cache), *PLUGINS],
            check=True,
        )
    return str(cache)


def collect(workdir: Path, name: str, extra: list[str], env: dict) -> list[str]:
    """The test ids pytest collects from ``name`` (parametrized cases one by one)."""
    listing = subprocess.run(
        [*PYTEST, name, "--collect-only", *extra],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
    ).stdout
    return [line.split("::", 1)[1] for line in listing.splitlines() if "::" in line]


def run_file(workdir: Path, name: str, extra: list[str], env: dict) -> dict:
    report = workdir / f"{name}.xml"
    expected = collect(workdir, name, extra, env)
    subprocess.run(
        [*PYTEST, name, f"--junitxml={report}", "-o", "junit_family=xunit1", *extra],
        cwd=workdir,
        env=env,
        stdout=subprocess.DEVNULL if "--show-output" not in extra else None,
        stderr=subprocess.STDOUT,
    )
    results = {"passed": 0, "failed": 0, "skipped": 0, "reasons": []}
    cases = list(ET.parse(report).getroot().iter("testcase")) if report.exists() else []
    reported = {case.get("name") for case in cases}
    for test_id in expected:
        if test_id not in reported:  # the session died before this test reported
            results["failed"] += 1
            results["reasons"].append((test_id, "no result (the pytest session ended early)"))
    for case in cases:
        if case.get("name") not in expected and expected:
            continue  # the "internal error" pseudo-case of a crashed session
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if case.find("skipped") is not None:
            results["skipped"] += 1
        elif problem is not None:
            results["failed"] += 1
            message = (problem.get("message") or "").strip().splitlines()
            results["reasons"].append((case.get("name"), message[0][:160] if message else ""))
        else:
            results["passed"] += 1
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirror", default=DEFAULT_MIRROR, help="bare git mirror of hivemind")
    parser.add_argument("--files", nargs="*", default=list(SELECTED_FILES))
    parser.add_argument("--keep", help="write the rewritten tests here and keep them")
    parser.add_argument("--reasons", action="store_true", help="print each failure's message")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument(
        "--timeout", type=float, default=30, help="seconds per test (pytest-timeout; default 30)"
    )
    args = parser.parse_args()

    repo_root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo_root))  # rewrite against this checkout's swarmtrain
    env = dict(os.environ)
    paths = [str(repo_root), plugin_path()]
    env["PYTHONPATH"] = os.pathsep.join(p for p in [*paths, env.get("PYTHONPATH")] if p)
    extra = ["-k", args.keyword] if args.keyword else []

    with tempfile.TemporaryDirectory(prefix="hivemind-compat-") as tmp:
        workdir = Path(args.keep or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        extract(args.mirror, args.files, workdir, args.timeout)
        totals = {"passed": 0, "failed": 0, "skipped": 0}
        print(f"{'file':<26} {'passed':>6} {'failed':>6} {'skipped':>7}")
        for name in args.files:
            results = run_file(workdir, name, extra, env)
            for key in totals:
                totals[key] += results[key]
            print(
                f"{name:<26} {results['passed']:>6} {results['failed']:>6} {results['skipped']:>7}"
            )
            if args.reasons:
                for case, message in results["reasons"]:
                    print(f"    {case}: {message}")
            sys.stdout.flush()
        cases = sum(totals.values())
        print(f"{'total':<26} {totals['passed']:>6} {totals['failed']:>6} {totals['skipped']:>7}")
        print(f"passed {totals['passed']} of {cases}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
