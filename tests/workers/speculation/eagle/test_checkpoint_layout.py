"""EAGLE-3 heads in the community layout: a head as SpecForge exports it loads with every tensor in place and computes
what the community architecture computes; specserve's own heads read back the same; heads for another target, or of
the wrong shape, are refused with the file named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from specserve.workers.errors import InvalidRequestError, ModelLoadError
from specserve.workers.models.identity import target_identity
from specserve.workers.speculation.eagle.checkpoint import load_head, save_head
from specserve.workers.speculation.eagle.config import Eagle3Config
from specserve.workers.speculation.eagle.head import Eagle3Head, ttt_forward, vocab_maps
from tests.helpers.workers import save_tiny_llama

H, HEADS, KV, HD, INTER, V, VD, N = 32, 4, 2, 8, 64, 259, 40, 8  # a tiny target: 8 layers, byte vocabulary


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_targets")
    return save_tiny_llama(root / "a", seed=0, layers=N, hidden=H), save_tiny_llama(
        root / "b", seed=1, layers=N, hidden=H
    )


def community_tensors(seed: int) -> dict[str, torch.Tensor]:
    """A head's tensors by the names, shapes and dtypes SpecForge's export writes (spelled out, not taken from ours)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.2).to(torch.bfloat16)

    kept = torch.sort(torch.randperm(V, generator=g)[:VD]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    return {
        "fc.weight": rand(H, 3 * H),
        "midlayer.input_layernorm.weight": 1 + rand(H),
        "midlayer.hidden_norm.weight": 1 + rand(H),
        "midlayer.self_attn.q_proj.weight": rand(HEADS * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": rand(KV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": rand(KV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": rand(H, HEADS * HD),
        "midlayer.post_attention_layernorm.weight": 1 + rand(H),
        "midlayer.mlp.gate_proj.weight": rand(INTER, H),
        "midlayer.mlp.up_proj.weight": rand(INTER, H),
        "midlayer.mlp.down_proj.weight": rand(H, INTER),
        "norm.weight": 1 + rand(H),
        "lm_head.weight": rand(VD, H),
        "d2t": kept - torch.arange(VD),
        "t2d": t2d,
    }


def community_config(**changes) -> dict:
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "vocab_size": V,
        "draft_vocab_size": VD,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, N // 2 - 1, N - 4]},  # SpecForge's, output layers
    }
    return config | changes


def write_community_head(directory, config: dict, tensors: dict) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


def reference_logits(t: dict, embeds: torch.Tensor, features: torch.Tensor, theta: float, eps: float) -> torch.Tensor:
    """The community head's first drafting step over a sequence, written out from the architecture: features [T, 3H],
    embeds [T, H] (of the tokens one position on) -> logits [T, VD]."""
    t = {k: v.float() for k, v in t.items()}

    def norm(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(x):  # [heads, T, hd]
        freqs = torch.arange(x.shape[1])[:, None].float() / theta ** (torch.arange(0, HD, 2).float() / HD)
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
        return x * cos + torch.cat([-x[..., HD // 2 :], x[..., : HD // 2]], -1) * sin

    p = "midlayer."
    hidden = features @ t["fc.weight"].T
    x = torch.cat([norm(embeds, t[p + "input_layernorm.weight"]), norm(hidden, t[p + "hidden_norm.weight"])], -1)
    q = rope((x @ t[p + "self_attn.q_proj.weight"].T).view(-1, HEADS, HD).transpose(0, 1))
    k = rope((x @ t[p + "self_attn.k_proj.weight"].T).view(-1, KV, HD).transpose(0, 1)).repeat_interleave(2, 0)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(-1, KV, HD).transpose(0, 1).repeat_interleave(2, 0)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(-1, HEADS * HD)
    hidden = hidden + attn @ t[p + "self_attn.o_proj.weight"].T
    mlp_in = norm(hidden, t[p + "post_attention_layernorm.weight"])
    gate, up = F.silu(mlp_in @ t[p + "mlp.gate_proj.weight"].T), mlp_in @ t[p + "mlp.up_proj.weight"].T
    hidden = hidden + (gate * up) @ t[p + "mlp.down_proj.weight"].T
    return norm(hidden, t["norm.weight"]) @ t["lm_head.weight"].T


def test_a_head_exported_by_specforge_loads_and_computes_the_community_architecture(targets, tmp_path):
    tensors = community_tensors(seed=0)
    directory = write_community_head(tmp_path / "head", community_config(), tensors)
    head = load_head(directory, targets[0], target_hidden_size=H, vocab_size=V, target_num_layers=N)
    assert head.state_dict().keys() == tensors.keys()
    for name, tensor in tensors.items():
        loaded = head.state_dict()[name]
        assert loaded.dtype == (tensor.dtype if not tensor.is_floating_point() else torch.float32), name
        assert torch.equal(loaded, tensor.to(loaded.dtype)), name
    assert head.config.feature_layers == (2, N // 2, N - 3)  # SGLang's output ids + 1: the inputs vLLM captures
    assert head.config.target_identity is None

    g = torch.Generator().manual_seed(1)
    features, tokens = torch.randn(1, 12, 3 * H, generator=g) * 3, torch.randint(0, V, (1, 12), generator=g)
    embed = torch.randn(V, H, generator=g)
    with torch.no_grad():
        ours = head.logits(ttt_forward(head, embed, features, [tokens])[0])[0]
    expected = reference_logits(tensors, embed[tokens[0]], features[0], 10000.0, 1e-5)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(head.draft_to_target(torch.arange(VD)), torch.nonzero(tensors["t2d"])[:, 0])


def test_a_head_saved_by_specserve_reads_back_the_same_tensors(targets, tmp_path):
    identity = target_identity(targets[0])
    config = Eagle3Config(H, INTER, HEADS, KV, HD, V, VD, H, feature_layers=(2, 4, 5), target_identity=identity)
    head = Eagle3Head(config)
    head.set_vocab_maps(*vocab_maps(torch.arange(V).flip(0), VD))
    save_head(head, tmp_path / "head")

    saved = json.loads((tmp_path / "head" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLMEagle3"] and saved["num_hidden_layers"] == 1
    assert saved["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: inputs of these layers
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang/SpecForge: outputs
    assert (saved["target_hidden_size"], saved["draft_vocab_size"], saved["vocab_size"]) == (H, VD, V)
    assert saved["tie_word_embeddings"] is False and saved["specserve"]["target_identity"] == identity
    with safe_open(str(tmp_path / "head" / "model.safetensors"), framework="pt") as f:
        dtypes = {name: f.get_tensor(name).dtype for name in f.keys()}
    assert dtypes.pop("d2t") == torch.int64 and dtypes.pop("t2d") == torch.bool
    assert set(dtypes.values()) == {torch.bfloat16} and not any("embed" in name for name in dtypes)

    for target in (targets[0], identity):
        loaded = load_head(tmp_path / "head", target, target_hidden_size=H, vocab_size=V, target_num_layers=N)
        assert loaded.config == config
        for name, tensor in head.state_dict().items():
            expected = tensor.to(torch.bfloat16).float() if tensor.is_floating_point() else tensor
            assert torch.equal(loaded.state_dict()[name], expected), name


def test_a_head_for_another_target_is_refused(targets, tmp_path):
    config = Eagle3Config(H, INTER, HEADS, KV, HD, V, VD, H, target_identity=target_identity(targets[0]))
    save_head(Eagle3Head(config), tmp_path / "head")
    with pytest.raises(ModelLoadError, match=r"config\.json is a head for another target"):
        load_head(tmp_path / "head", targets[1], target_hidden_size=H, vocab_size=V)
    with pytest.raises(ModelLoadError, match="another target"):
        load_head(tmp_path / "head", "0" * 64, target_hidden_size=H, vocab_size=V)


def test_a_head_that_does_not_fit_the_target_is_refused(targets, tmp_path):
    directory = write_community_head(tmp_path / "head", community_config(), community_tensors(seed=0))
    with pytest.raises(ModelLoadError, match=r"config\.json does not fit this target: target_hidden_size 32 != .* 48"):
        load_head(directory, targets[0], target_hidden_size=48, vocab_size=V)
    with pytest.raises(ModelLoadError, match="vocab_size 259 != the target's vocabulary 300"):
        load_head(directory, targets[0], target_hidden_size=H, vocab_size=300)
    with pytest.raises(ModelLoadError, match="feature layers .* beyond the target's 4 layers"):
        load_head(directory, targets[0], target_hidden_size=H, vocab_size=V, target_num_layers=4)

    tensors = community_tensors(seed=0) | {"fc.weight": torch.zeros(H, 2 * H, dtype=torch.bfloat16)}
    directory = write_community_head(tmp_path / "bad_fc", community_config(), tensors)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: fc\.weight has shape \[32, 64\].*\[32, 96\]"):
        load_head(directory, targets[0], target_hidden_size=H, vocab_size=V)


def test_unsupported_or_contradictory_configs_are_refused(targets, tmp_path):
    cases = {
        "eagle1": (community_config(architectures=["LlamaForCausalLMEagle"]), "EAGLE-1/2 heads"),
        "layers": (community_config(eagle_aux_hidden_state_layer_ids=[2, 4, 6]), "feature layer keys disagree"),
        "missing": ({k: v for k, v in community_config().items() if k != "hidden_size"}, "'hidden_size'"),
    }
    for name, (config, message) in cases.items():
        directory = write_community_head(tmp_path / name, config, community_tensors(seed=0))
        with pytest.raises(ModelLoadError, match=message):
            load_head(directory, targets[0], target_hidden_size=H, vocab_size=V)
    tensors = community_tensors(seed=0)
    del tensors["norm.weight"]
    directory = write_community_head(tmp_path / "lacking", community_config(), tensors)
    with pytest.raises(ModelLoadError, match=r"lacks tensors: \['norm\.weight'\]"):
        load_head(directory, targets[0], target_hidden_size=H, vocab_size=V)
    shutil.rmtree(tmp_path / "lacking")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_head(tmp_path / "lacking", targets[0], target_hidden_size=H, vocab_size=V)


def test_vocab_maps_keep_the_most_frequent_ids_in_ascending_order():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 7])
    d2t, t2d = vocab_maps(counts, 4)
    assert (torch.arange(4) + d2t).tolist() == [0, 2, 3, 6]  # 9, 9, 7, 5
    assert torch.nonzero(t2d)[:, 0].tolist() == [0, 2, 3, 6]
    d2t, _ = vocab_maps(counts, 6)  # ties among the unseen: lowest id first
    assert (torch.arange(6) + d2t).tolist() == [0, 1, 2, 3, 4, 6]
    with pytest.raises(InvalidRequestError, match="draft_vocab_size"):
        vocab_maps(counts, 8)
