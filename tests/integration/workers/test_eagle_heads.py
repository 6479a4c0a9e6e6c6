"""EAGLE-3 heads on workers: the float16 feature codec (cut, joined, strictly decoded), a head's cache that starts at
a later position, the target's input embedding read alone, a target worker that captures features only for the calls
that ask (in mixed batches), and the gRPC status codes of bad feature calls. The disaggregated generation itself is
in tests/integration/disaggregated/test_eagle.py."""

import asyncio
import contextlib
from pathlib import Path

import grpc
import msgpack
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from specserve.workers.config.request import SamplingParams
from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.errors import InvalidRequestError, ModelLoadError
from specserve.workers.models import packaged_heads
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import ModelRunner
from specserve.workers.service.target_worker import TargetWorker, VerifyCall
from specserve.workers.speculation.codec import encode_features, feature_block
from specserve.workers.speculation.eagle.checkpoint import save_head
from specserve.workers.speculation.eagle.config import resolve_eagle_head
from specserve.workers.speculation.eagle.drafter import EagleDrafter
from specserve.workers.speculation.eagle.loading import load_head_drafter, load_target_embedding
from specserve.workers.speculation.planner.costs import PROFILE_ROWS
from specserve.workers.speculation.planner.goodput import MAX_AUTO_K
from specserve.workers.speculation.planner.tree import MAX_TREE_NODES
from specserve.workers.speculation.target import TargetVerifier
from specserve.workers.speculation.wire_format import FeatureBlock, decode_features
from tests.helpers.eagle_heads import random_head
from tests.helpers.workers import LocalWorkers, save_tiny_llama

LAYERS, HIDDEN = 4, 32  # feature layers (2, 2, 1); 96 values per position
F = 3 * HIDDEN


@pytest.fixture(scope="module")
def target(models_dir):
    path = save_tiny_llama(models_dir / "eagle_workers_target", seed=4, layers=LAYERS, hidden=HIDDEN)
    return load_model(ModelConfig(path=path, device="cpu"))


@pytest.fixture(scope="module")
def head_dir(target, models_dir) -> str:
    head = random_head(target.model.config, 64, seed=1, std=0.3)
    return str(save_head(head, models_dir / "eagle_workers_head", torch.float32))


def block_of(start: int, rows: int, seed: int = 0) -> FeatureBlock:
    return feature_block(start, torch.randn(rows, F, generator=torch.Generator().manual_seed(seed)) * 50)


def test_features_travel_as_float16_and_blocks_cut_and_join_by_position():
    features = torch.randn(5, F, generator=torch.Generator().manual_seed(0)) * 100
    features[0, 0], features[0, 1], features[0, 2] = 1e6, float("nan"), -float("inf")
    block = decode_features(encode_features(7, features), cols=F)
    assert (block.start, block.rows, block.end) == (7, 5, 12)
    want = features.clamp(-65504, 65504).nan_to_num(0.0).half().float()
    assert torch.equal(block.to_tensor(), want)
    assert len(block.data) == 5 * F * 2  # 2 bytes a value: SmolLM2 (3 x 576) ships 3,456 bytes a position
    assert torch.equal(block.since(9).to_tensor(), want[2:]) and block.since(9).start == 9 and block.since(12) is None
    assert torch.equal(block.newest(2 * F * 2 + 1).to_tensor(), want[3:]) and block.newest(1).rows == 1
    later = block_of(10, 4, seed=1)
    joined = block.then(later)
    assert (joined.start, joined.rows) == (7, 7)
    assert torch.equal(joined.to_tensor(), torch.cat([want[:3], later.to_tensor()]))
    assert block.then(block_of(3, 2)).start == 3  # a block from earlier replaces this one
    with pytest.raises(ValueError, match="cannot join"):
        block.then(block_of(13, 1))  # a gap
    assert encode_features(0, torch.zeros(0, F)) == b"" and decode_features(b"") is None


def test_a_block_over_the_byte_limit_keeps_its_newest_positions():
    features = torch.randn(10, F)
    block = feature_block(4, features, max_bytes=3 * F * 2)
    assert (block.start, block.rows) == (11, 3)
    assert torch.equal(block.to_tensor(), features[7:].half().float())


def _packed(**fields) -> bytes:
    data = {"start": 3, "rows": 2, "cols": F, "data": np.zeros(2 * F, dtype="<f2").tobytes()} | fields
    return msgpack.packb(data, use_bin_type=True)


BAD_FEATURES = [
    (b"\xc1", "is not msgpack"),
    (msgpack.packb([1, 2]), "must be a map"),
    (_packed(extra=1), "must be a map"),
    (_packed(rows="2"), "must be integers"),
    (_packed(rows=True), "must be integers"),
    (_packed(data="text"), "must be integers and data bytes"),
    (_packed(start=-1), "must be >= 0"),
    (_packed(rows=0, data=b""), "must be >= 0"),
    (_packed(cols=F + 1, data=np.zeros(2 * (F + 1), dtype="<f2").tobytes()), "this head reads 96"),
    (_packed(data=b"\x00" * 10), "bytes of data for 2 x 96"),
    (_packed(data=np.full(2 * F, np.inf, dtype="<f2").tobytes()), "not finite"),
]


@pytest.mark.parametrize("data, message", BAD_FEATURES)
def test_malformed_features_are_refused_naming_the_field(data, message):
    with pytest.raises(InvalidRequestError) as e:
        decode_features(data, cols=F)
    assert e.value.field == "features" and message in e.value.message


def test_a_head_restarted_at_a_later_position_drafts_as_rotary_attention_is_relative(target, head_dir):
    """A cache that starts at position s (absolute rotary positions) attends exactly as a fresh cache fed the same
    features and tokens from position 0: RoPE scores depend only on distances. Also after a gap in the features."""
    features = torch.randn(16, F, generator=torch.Generator().manual_seed(2)) * 3
    tokens = list(range(40, 57))  # 17 committed tokens: entries 0..15
    later, fresh = (load_head_drafter(head_dir, target.path) for _ in range(2))
    greedy = SamplingParams()
    later.add_features("r", 0, features[:6])
    assert len(later.propose("r", tokens[:7], 3, greedy).tokens) == 3
    later.add_features("r", 9, features[9:])  # positions 6..8 never came: the head starts again at 9
    restarted = later.propose("r", tokens, 4, greedy).tokens
    assert later.drafting._requests["r"].offset == 9 and later.drafting.length("r") == 16
    fresh.add_features("r", 0, features[9:])
    assert restarted == fresh.propose("r", tokens[9:], 4, greedy).tokens
    later.drafting.rollback("r", 5)  # before its first entry: it holds none, the next entry is position 5's
    assert later.drafting.length("r") == 5 and later.drafting._requests["r"].count == 0


def test_the_target_embedding_is_read_alone_from_single_sharded_and_tied_checkpoints(target, tmp_path):
    want = target.model.get_input_embeddings().weight
    assert torch.equal(load_target_embedding(target.path, torch.float32, torch.device("cpu")), want)
    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, tie_word_embeddings=True)  # fmt: skip
    tied = LlamaForCausalLM(config)
    tied.save_pretrained(tmp_path / "tied", max_shard_size="20KB")  # sharded: an index names the embedding's file
    assert (tmp_path / "tied" / "model.safetensors.index.json").is_file()
    got = load_target_embedding(tmp_path / "tied", torch.float16, torch.device("cpu"))
    assert got.dtype == torch.float16 and torch.equal(got, tied.get_input_embeddings().weight.detach().half())


def test_head_directories_are_told_from_draft_models_and_eagle_names_the_packaged_head(target, head_dir, monkeypatch):
    assert resolve_eagle_head(head_dir) == head_dir
    for name in (target.path, "ngram", "none", None, "smollm2-135m-instruct"):
        assert resolve_eagle_head(name, target.path) is None
    with pytest.raises(ModelLoadError, match="no EAGLE-3 head is packaged"):
        resolve_eagle_head("eagle", target.path)
    packaged = {target.path: Path(head_dir)}
    monkeypatch.setattr(packaged_heads, "packaged_head_for", packaged.get)
    assert resolve_eagle_head("eagle", target.path) == head_dir
    with pytest.raises(ModelLoadError, match="resolve it with the target"):
        resolve_eagle_head("eagle")


def test_a_head_draft_worker_loads_no_target_model(target, head_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded the target"))
    drafter = load_head_drafter(head_dir, target.path)
    assert isinstance(drafter, EagleDrafter) and drafter.feature_layers == (2, 2, 1) and drafter.feature_size == F
    assert torch.equal(drafter.drafting.embed_weight, target.model.get_input_embeddings().weight)


def test_a_target_worker_batches_rows_that_want_features_with_rows_that_do_not(target):
    """Each row gets what it would alone; features only for the rows that ask, of the positions it committed; no
    hidden states are kept when no row of the batch asks."""
    runner = ModelRunner(target, KVCacheConfig())
    runner.capture_features((2, 2, 1))
    worker = TargetWorker(TargetVerifier(runner), target.path)
    captured = []
    forward = runner.forward_mixed
    runner.forward_mixed = lambda chains, trees, capture=False: (
        captured.append(capture) or forward(chains, trees, capture)
    )
    greedy = SamplingParams()
    prompts = {"a": list(range(3, 12)), "b": list(range(20, 26)), "c": list(range(30, 40))}

    def calls(want):
        return [VerifyCall(r, len(p), p, [5, 6], None, greedy, want_features=want[r]) for r, p in prompts.items()]

    mixed = worker.verify_batch(calls({"a": True, "b": False, "c": True}))
    assert captured == [True] and [bool(r.features) for r in mixed] == [True, False, True]
    for r in ("a", "b", "c"):
        worker.release(r)
    plain = worker.verify_batch(calls(dict.fromkeys(prompts, False)))
    assert captured == [True, False] and not any(r.features for r in plain)
    assert [(r.accepted, r.next_token) for r in mixed] == [(r.accepted, r.next_token) for r in plain]
    block = decode_features(mixed[0].features, cols=F)
    assert (block.start, block.end) == (0, len(prompts["a"]) + mixed[0].accepted)  # the bonus/recovered one excluded


def test_want_features_on_a_target_without_a_head_is_refused(target):
    worker = TargetWorker(TargetVerifier(ModelRunner(target, KVCacheConfig())), target.path)
    (result,) = worker.verify_batch([VerifyCall("a", 3, [5, 6, 7], [], None, SamplingParams(), want_features=True)])
    assert isinstance(result, InvalidRequestError) and result.field == "want_features"


def _propose(features: bytes, committed_len: int = 10, request_id: str = "r") -> pb.ProposeRequest:
    return pb.ProposeRequest(request_id=request_id, committed_len=committed_len, new_tokens=list(range(3, 13)), k=2,
                             features=features)  # fmt: skip


@contextlib.asynccontextmanager
async def worker_stubs(w: LocalWorkers):
    """Stubs of a LocalWorkers' head draft worker (draft-1), draft model worker (draft-0) and target worker."""
    async with (
        grpc.aio.insecure_channel(w.draft_addresses["draft-1"]) as head_channel,
        grpc.aio.insecure_channel(w.draft_addresses["draft-0"]) as model_channel,
        grpc.aio.insecure_channel(w.target_addresses["target-0"]) as target_channel,
    ):
        yield (pb_grpc.DraftWorkerStub(head_channel), pb_grpc.DraftWorkerStub(model_channel),
               pb_grpc.TargetWorkerStub(target_channel))  # fmt: skip


def test_bad_feature_calls_get_invalid_argument_naming_the_field_and_workers_keep_serving(target, head_dir):
    good = block_of(0, 9).encode()  # positions 0..8 of 10 committed tokens
    cases = [
        (_propose(b""), "features", "needs the target's features"),
        (_propose(b"\x93not msgpack"), "features", "is not msgpack"),
        (_propose(block_of(0, 8).encode()), "features", "need them up to position 8"),
        (_propose(feature_block(0, torch.zeros(9, F + 3)).encode()), "features", "this head reads 96"),
    ]

    async def main():
        async with LocalWorkers(target, [target], eagle_head=head_dir) as w:
            async with worker_stubs(w) as (head, model, verifier):
                errors = []
                for message, _, _ in cases:
                    errors.append(await _error(head.Propose(message, timeout=10)))
                errors.append(await _error(model.Propose(_propose(good), timeout=10)))
                ok = await head.Propose(_propose(good), timeout=10)
                verified = await verifier.Verify(
                    pb.VerifyRequest(request_id="v", committed_len=4, new_tokens=[5, 6, 7, 8], want_features=True),
                    timeout=10,
                )
                return errors, ok, verified

    errors, ok, verified = asyncio.run(main())
    expected = [*cases, (None, "features", "drafts with a model: it takes no features")]
    for error, (_, field, text) in zip(errors, expected, strict=True):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and f"invalid {field}" in error.details(), error
        assert text in error.details()
    assert len(ok.drafted) == 2 and ok.vocab_size == target.vocab_size
    block = decode_features(verified.features, cols=F)
    assert (block.start, block.rows) == (0, 4)  # the bonus token's position (4) comes with the next call


def test_want_features_on_a_target_served_without_a_head_is_invalid_argument(target):
    async def main():
        async with LocalWorkers(target, []) as w:
            async with grpc.aio.insecure_channel(w.target_addresses["target-0"]) as channel:
                stub = pb_grpc.TargetWorkerStub(channel)
                message = pb.VerifyRequest(request_id="v", committed_len=2, new_tokens=[5, 6], want_features=True)
                return await _error(stub.Verify(message, timeout=10))

    error = asyncio.run(main())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "invalid want_features" in error.details()


async def _error(call) -> grpc.aio.AioRpcError:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e
    raise AssertionError("the call succeeded")


def test_workers_measure_and_report_their_costs_only_when_asked(target, head_dir):
    """Health with want_costs: a target worker's verify seconds for widths up to a k='auto' tree's, a head's draft
    worker its cost per call and per drafted token (a draft model's worker: none); measured once, then reported
    again."""

    async def main():
        async with LocalWorkers(target, [target], eagle_head=head_dir) as w:
            async with worker_stubs(w) as (head, model, verifier):
                plain = await verifier.Health(pb.HealthRequest(), timeout=10)
                asked = [await stub.Health(pb.HealthRequest(want_costs=True), timeout=60) for stub in (verifier,
                         verifier, model, head)]  # fmt: skip
                return plain, asked, w.targets["target-0"].verify_costs()

    plain, (verify, again, model, head), measured = asyncio.run(main())
    assert plain.healthy and not plain.verify_seconds_by_width and plain.draft_step_seconds == 0
    assert len(verify.verify_seconds_by_width) == max(MAX_AUTO_K, MAX_TREE_NODES) + 1
    assert all(t > 0 for t in verify.verify_seconds_by_width)
    assert list(again.verify_seconds_by_width) == list(verify.verify_seconds_by_width) == list(measured.verify_s)
    assert list(verify.verify_profile_rows) == [r for r in PROFILE_ROWS if r > 1]  # batches the planner weighs
    assert len(verify.verify_seconds_by_rows) == len(verify.verify_profile_rows) * (MAX_AUTO_K + 1)
    assert all(t > 0 for t in verify.verify_seconds_by_rows) and not plain.verify_seconds_by_rows
    # a draft model's worker measures one cached step a drafted token; a head's a fixed cost and a step
    assert model.draft_fixed_seconds == 0 and model.draft_step_seconds > 0 and not model.verify_seconds_by_width
    assert head.draft_step_seconds > 0 and head.draft_fixed_seconds >= 0 and head.healthy
