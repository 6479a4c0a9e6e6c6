"""Packaged EAGLE-3 heads are found by their target's identity; 'eagle' names the packaged one."""

import json

import pytest

from specserve.workers.errors import ModelLoadError
from specserve.workers.models import packaged_heads
from specserve.workers.models.gguf_store import MARKER


def _converted_target(path, digest: str):
    path.mkdir()
    (path / MARKER).write_text(json.dumps({"sha256": digest}))
    return path


def test_the_packaged_head_is_the_one_made_for_the_target(heads_dir, tmp_path):
    ours, other = "a" * 64, "b" * 64
    head = heads_dir / "smol"
    head.mkdir(parents=True)
    (head / "config.json").write_text(json.dumps({"specserve": {"target_identity": ours}}))
    target = _converted_target(tmp_path / "target", ours)
    assert packaged_heads.packaged_head_for(target) == head
    assert packaged_heads.resolve_head("eagle", target) == head
    assert packaged_heads.packaged_head_for(_converted_target(tmp_path / "other", other)) is None
    plain = tmp_path / "plain"
    plain.mkdir()
    assert packaged_heads.packaged_head_for(plain) is None  # no cheap identity: not looked up
    with pytest.raises(ModelLoadError, match="no EAGLE-3 head is packaged"):
        packaged_heads.resolve_head("eagle", plain)
    assert packaged_heads.resolve_head(str(head), plain) == head
    with pytest.raises(ModelLoadError, match="neither 'eagle' nor an EAGLE-3 head directory"):
        packaged_heads.resolve_head(str(tmp_path / "nowhere"), plain)


def test_a_head_drafts_by_default_only_if_its_measured_acceptance_pays(heads_dir, tmp_path):
    digest = "c" * 64
    head = heads_dir / "measured"
    head.mkdir(parents=True)
    target = _converted_target(tmp_path / "target", digest)
    for acceptance, default in ((None, True), ([0.45, 0.3], True), ([0.3, 0.2], True), ([0.2, 0.25], False)):
        (head / "config.json").write_text(
            json.dumps({"specserve": {"target_identity": digest, "acceptance": acceptance}})
        )
        packaged_heads.packaged_heads.cache_clear()
        assert packaged_heads.packaged_head_for(target) == head  # always there to ask for ('eagle')
        assert (packaged_heads.default_head_for(target) == head) is default, acceptance
