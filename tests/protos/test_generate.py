"""The committed Python stubs are exactly what `python -m specserve.protos.generate` makes from the .proto files, but
for the versions protoc stamps them with (those of the grpcio-tools that made them); and the package asks for
runtimes at least that new, which the stubs check at import."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

import specserve.protos
from specserve.protos.generate import generate

HERE = Path(specserve.protos.__file__).parent
GRPC_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '([^']+)'$", re.M)
PROTOBUF_STAMP = re.compile(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),", re.S)
PROTOBUF_COMMENT = re.compile(r"^# Protobuf Python Version: .*$", re.M)


def _unstamped(text: str) -> str:
    """The stub without its version stamps: a newer grpcio-tools (1.85.1 -> 1.85.4 on the package index, the same
    .proto) makes the same code with a newer stamp."""
    text = GRPC_STAMP.sub("GRPC_GENERATED_VERSION = ...", text)
    text = PROTOBUF_COMMENT.sub("# Protobuf Python Version: ...", text)
    return PROTOBUF_STAMP.sub("ValidateProtobufRuntimeVersion(...,", text)


def test_generated_stubs_are_current(tmp_path):
    written = generate(tmp_path)
    assert {p.name for p in written} == {"specserve_pb2.py", "specserve_pb2.pyi", "specserve_pb2_grpc.py"}
    for fresh in written:
        committed = HERE / fresh.name
        assert _unstamped(committed.read_text()) == _unstamped(fresh.read_text()), (
            f"{committed} is stale: run `python -m specserve.protos.generate`"
        )


def test_the_package_asks_for_the_runtimes_its_stubs_check_for():
    project = tomllib.loads((HERE.parent / "pyproject.toml").read_text())["project"]
    floors = {}
    for line in project["dependencies"]:
        req = Requirement(line)
        floors[req.name] = min((Version(s.version) for s in req.specifier if s.operator == ">="), default=None)
    grpc_stamp = Version(GRPC_STAMP.search((HERE / "specserve_pb2_grpc.py").read_text())[1])
    protobuf_stamp = Version(".".join(PROTOBUF_STAMP.search((HERE / "specserve_pb2.py").read_text()).groups()))
    assert floors["grpcio"] is not None and floors["grpcio"] >= grpc_stamp, (floors["grpcio"], grpc_stamp)
    assert floors["protobuf"] is not None and floors["protobuf"] >= protobuf_stamp, (floors["protobuf"], protobuf_stamp)
    assert _unstamped(f"GRPC_GENERATED_VERSION = '{grpc_stamp}'\n") == "GRPC_GENERATED_VERSION = ...\n"


def test_vocabulary_is_used_on_the_wire():
    from specserve.protos import specserve_pb2 as pb

    assert {"accepted", "next_token", "bonus"} <= set(pb.VerifyResponse.DESCRIPTOR.fields_by_name)
    assert {"rounds", "drafted", "accepted", "acceptance_rate", "mean_accepted_length"} == set(
        pb.RequestStats.DESCRIPTOR.fields_by_name
    )
