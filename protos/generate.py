"""Regenerate the Python stubs of protos/*.proto: `python -m specserve.protos.generate`.

protoc runs over a temporary tree where the files sit at specserve/protos/, so the generated modules import each
other as `specserve.protos.<name>_pb2`, inside this package's namespace."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def generate(out_dir: Path = HERE) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(HERE.glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "specserve" / "protos"
        pkg.mkdir(parents=True)
        for proto in protos:
            shutil.copy(proto, pkg / proto.name)
        include = Path(protoc.__file__).parent / "_proto"
        args = [
            "protoc",
            f"-I{tmp}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
        ]
        args += [f"specserve/protos/{p.name}" for p in protos]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        written = []
        for generated in sorted(pkg.glob("*_pb2*.py*")):
            target = out_dir / generated.name
            shutil.copy(generated, target)
            written.append(target)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(path)
