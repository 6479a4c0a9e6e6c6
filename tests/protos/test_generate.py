"""The committed Python stubs are exactly what `python -m specserve.protos.generate` makes from the .proto files."""

from pathlib import Path

import specserve.protos
from specserve.protos.generate import generate


def test_generated_stubs_are_current(tmp_path):
    here = Path(specserve.protos.__file__).parent
    written = generate(tmp_path)
    assert {p.name for p in written} == {"specserve_pb2.py", "specserve_pb2.pyi", "specserve_pb2_grpc.py"}
    for fresh in written:
        committed = here / fresh.name
        assert committed.read_text() == fresh.read_text(), (
            f"{committed} is stale: run `python -m specserve.protos.generate`"
        )


def test_vocabulary_is_used_on_the_wire():
    from specserve.protos import specserve_pb2 as pb

    assert {"accepted", "next_token", "bonus"} <= set(pb.VerifyResponse.DESCRIPTOR.fields_by_name)
    assert {"rounds", "drafted", "accepted", "acceptance_rate", "mean_accepted_length"} == set(
        pb.RequestStats.DESCRIPTOR.fields_by_name
    )
