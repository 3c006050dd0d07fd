"""Generate the gRPC stubs from protos/ at build and install time (also editable installs), and
build the native kernels of the target's forward.

The stubs are not committed: `protos/draftmesh/v1/*.proto` is the only contract, and the
generated `draftmesh.v1` modules always match the pinned grpcio-tools/protobuf.

The kernels (`core/csrc/`: the packed GEMM of `draftmesh.packed_linear`, the tree attention of
`draftmesh.tree_attention`, the decoder ops of `draftmesh.direct_decoder`) make one plain shared library loaded with ctypes, built once per
instruction set; each build is optional, so a machine without a C++ compiler, or another
architecture, installs fine and its forward keeps torch's `F.linear` and SDPA.
"""

from pathlib import Path

from setuptools import Extension, setup
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


KERNEL_FLAGS = ["-O3", "-fopenmp", "-mfma", "-ffp-contract=fast"]
KERNEL_BUILDS = {  # instruction set: flags, and the kernel's vector width / vectors per block / rows per tile
    "avx512": (["-mavx512f"], 16, 3, 8),
    "avx2": (["-mavx2"], 8, 2, 6),
}


def kernel_extensions() -> list[Extension]:
    return [
        Extension(
            f"draftmesh._packed_gemm_{isa}",
            sources=["core/csrc/packed_gemm.cpp", "core/csrc/tree_attention.cpp", "core/csrc/decoder_ops.cpp"],
            depends=["core/csrc/vec_math.h"],
            language="c++",
            extra_compile_args=[*KERNEL_FLAGS, *flags, f"-DVW={vw}", f"-DNV={nv}", f"-DMRMAX={mr}"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
        for isa, (flags, vw, nv, mr) in KERNEL_BUILDS.items()
    ]


setup(cmdclass={"build_py": BuildPyWithStubs}, ext_modules=kernel_extensions())
