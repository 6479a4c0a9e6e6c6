"""The service tests' models: the tiny target and its draft, loaded once a module on the session's device."""

import pytest

from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model


@pytest.fixture(scope="module")
def models(tiny_target, tiny_draft, device):
    return load_model(ModelConfig(path=tiny_target, device=device)), load_model(
        ModelConfig(path=tiny_draft, device=device)
    )
