"""A verify reply's wire form both ways: every field of a VerifyResult survives the trip, and a chain's missing path,
logprobs and prompt logprobs stay missing."""

import dataclasses

from specserve.workers.service.results import VerifyResult
from specserve.workers.service.verify_wire import verify_from_proto, verify_to_proto
from specserve.workers.speculation.logprobs import TokenLogprob


def test_every_field_of_a_verify_result_survives_the_wire():
    # seconds travel as float32: values it holds exactly
    full = VerifyResult(accepted=2, next_token=9, batch_seconds=0.03125, batch_rows=3, batch_tokens=11,
                        queued_seconds=2**-10, batch_forward_seconds=2**-6, features=b"\x01\x02", path=[0, 2],
                        logprobs=[TokenLogprob(-0.5, ((4, -0.5), (7, -1.5))),
                                  TokenLogprob(-0.25, ((9, -0.25), (1, -2.0)))],
                        prompt_logprobs=[TokenLogprob(-3.0, ((5, -1.0),), rank=4)])  # fmt: skip
    message = verify_to_proto(full, bonus=True)
    assert message.bonus and verify_from_proto(message) == full
    chain = VerifyResult(accepted=0, next_token=3)
    back = verify_from_proto(verify_to_proto(chain, bonus=False))
    assert back == dataclasses.replace(chain, path=[])  # a chain's path: [] off the wire
    assert back.logprobs is None and back.prompt_logprobs is None
