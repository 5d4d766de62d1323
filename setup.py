"""Build hook: compile proto/*.proto into swarmtrain/proto/ with grpcio-tools' bundled protoc."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def compile_protos() -> None:
    from grpc_tools import protoc  # build requirement (see pyproject.toml)

    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto").glob("*.proto"))
    out_dir = ROOT / "swarmtrain" / "proto"
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT / 'proto'}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *[str(ROOT / s) for s in sources],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {sources}")


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        compile_protos()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
