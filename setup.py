"""Generate the gRPC stubs from protos/ at build and install time (also editable installs).

The stubs are not committed: `protos/draftmesh/v1/*.proto` is the only contract, and the
generated `draftmesh.v1` modules always match the pinned grpcio-tools/protobuf.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
PROTO_ROOT = ROOT / "protos"


def generate_stubs() -> None:
    from grpc_tools import protoc  # a build requirement (pyproject [build-system])

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "draftmesh" / "v1").glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={PROTO_ROOT}",
            f"--pyi_out={PROTO_ROOT}", f"--grpc_python_out={PROTO_ROOT}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    for pkg in (PROTO_ROOT / "draftmesh", PROTO_ROOT / "draftmesh" / "v1"):
        (pkg / "__init__.py").touch()


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
