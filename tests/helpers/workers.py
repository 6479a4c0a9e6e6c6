"""Tiny random-weight Llama models with real tokenizers, made from configs: for tests and smoke runs only."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = {"<unk>": 0, "<s>": 1, "</s>": 2}
TINY_WORDS = ["a", "b", "c", "d", "e"]  # with the specials: an 8-token vocabulary


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: every UTF-8 byte is one token (259 ids with the specials)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = dict(SPECIALS) | {c: i + len(SPECIALS) for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def tiny_vocab_tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace-separated words from an 8-token vocabulary, for distribution tests."""
    vocab = dict(SPECIALS) | {w: i + len(SPECIALS) for i, w in enumerate(TINY_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def save_tiny_llama(
    path: str | Path,
    seed: int,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_pad: int = 0,
    tiny_vocab: bool = False,
    init_range: float = 0.2,
    max_positions: int = 512,
) -> str:
    """Save a random-init Llama causal LM + tokenizer at `path` in Hugging Face format; returns the path.

    init_range is larger than Llama's default so logits are peaked: greedy argmaxes then have clear margins and
    random pairs still disagree often.
    """
    path = Path(path)
    tokenizer = tiny_vocab_tokenizer() if tiny_vocab else byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer) + vocab_pad,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=init_range,
        bos_token_id=SPECIALS["<s>"],
        eos_token_id=SPECIALS["</s>"],
        pad_token_id=SPECIALS["<unk>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def save_perturbed_copy(source: str | Path, path: str | Path, noise: float, seed: int) -> str:
    """Copy a saved model with Gaussian noise added to every weight: a draft that agrees with its source on
    some tokens and not others, so accepted, recovered and bonus tokens all occur."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(path)
    return str(path)


CHATTY_LAYERS = 8  # the chatty target's layers: EAGLE-3 feature layers 2, 4, 5


def save_chatty_target(path: str | Path) -> str:
    """A tiny random Llama with a ChatML template whose samples are mostly ASCII letters and end with EOS now and then
    (a constant residual component, read by the head rows of letters and EOS): it writes short 'questions'."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers.gguf_files import CHATML_TEMPLATE

    save_tiny_llama(path, seed=3, layers=CHATTY_LAYERS, hidden=32)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.chat_template = CHATML_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    letters = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) in list("abcdefghijklmnopqrstuvwxyz ")]
    broken = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[letters, 0] = 1.5
        model.lm_head.weight[broken, 0] = -1.5
        model.lm_head.weight[tokenizer.eos_token_id, 0] = 1.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


class LocalWorkers:
    """Draft and target workers for tests, each behind its own real gRPC server on a free localhost port.

    `async with LocalWorkers(target, [draft, ...], n_targets) as w:` gives w.draft_addresses and w.target_addresses
    (name -> host:port) and the plain worker objects, so a test can make a worker forget a request or stop a server.
    eagle_head: an EAGLE-3 head directory: the target workers capture its features and `eagle_drafts` draft workers
    draft with it (after those of `drafts`).
    """

    def __init__(self, target, drafts, n_targets: int = 1, target_capacity: int = 100_000, batching=None,
                 eagle_head: str | None = None, eagle_drafts: int = 1, prefix_caching: bool = True):  # fmt: skip
        from specserve.workers.config.settings import BatchingConfig, KVCacheConfig, ModelConfig
        from specserve.workers.service.assembly import WorkerSpec, build_worker

        batching = batching or BatchingConfig()
        built = {}
        for i, draft in enumerate(drafts):
            spec = WorkerSpec("draft", ModelConfig(path=draft.path), batching=batching, vocab_size=target.vocab_size)
            built[f"draft-{i}"] = build_worker(spec, loaded=draft)
        for i in range(len(drafts), len(drafts) + eagle_drafts) if eagle_head else ():
            spec = WorkerSpec("draft", ModelConfig(path=target.path, device=target.device.type), batching=batching,
                              eagle_head=eagle_head)  # fmt: skip
            built[f"draft-{i}"] = build_worker(spec)
        spec = WorkerSpec(
            "target", ModelConfig(path=target.path),
            KVCacheConfig(capacity_tokens=target_capacity, prefix_caching=prefix_caching), batching,
            eagle_head=eagle_head,
        )  # fmt: skip
        for i in range(n_targets):
            built[f"target-{i}"] = build_worker(spec, loaded=target)
        self.built = built
        self.drafts = {n: b.worker for n, b in built.items() if b.spec.role == "draft"}
        self.targets = {n: b.worker for n, b in built.items() if b.spec.role == "target"}
        self.servicers = {n: b.servicer for n, b in built.items()}
        self.servers = {}

    async def __aenter__(self):
        from specserve.workers.service.assembly import start_worker_server

        self.addresses = {}
        for name, built in self.built.items():
            self.servers[name], port = await start_worker_server(built)
            self.addresses[name] = f"127.0.0.1:{port}"
        return self

    @property
    def draft_addresses(self) -> dict[str, str]:
        return {n: a for n, a in self.addresses.items() if n.startswith("draft")}

    @property
    def target_addresses(self) -> dict[str, str]:
        return {n: a for n, a in self.addresses.items() if n.startswith("target")}

    async def stop(self, name: str) -> None:
        await self.servers[name].stop(grace=None)

    async def __aexit__(self, *exc):
        for server in self.servers.values():
            await server.stop(grace=1)
        for servicer in self.servicers.values():
            servicer.close()


def tensor_parallel_logits(rank: int, rendezvous, path: str, rows: list, results, device: str = "cpu") -> None:
    """One rank of a test: shard the model, run `rows` (ForwardRows) through the mirrored runner, rank 0 puts the
    logits and whether its runner took the lean forward path in `results` (a multiprocessing queue). On one GPU both
    ranks share it over gloo (tensor_parallel.backend_for)."""
    import torch.distributed as dist

    from specserve.workers.config.settings import KVCacheConfig, ModelConfig
    from specserve.workers.runtime.runner import ModelRunner
    from specserve.workers.service.tensor_parallel import TensorParallelRunner, follow, init_rank, load_sharded

    init_rank(rank, rendezvous, device)
    # a set capacity: ranks are processes of their own, where a GPU's default budget (0.9 of it each) cannot hold
    runner = ModelRunner(load_sharded(ModelConfig(path=path, device=device)), KVCacheConfig(capacity_tokens=4096))
    try:
        if rank == 0:
            tp = TensorParallelRunner(runner)
            first = tp.logits_for_batch(rows[:1])  # cache the first row, then a ragged batch on top of it
            out = tp.logits_for_batch(rows[1:])
            results.put(([t.tolist() for t in first + out], runner.lean))
            tp.shutdown()
        else:
            follow(runner)
    finally:
        dist.destroy_process_group()


def load_pair(tiny_target: str, models_dir, device: str, name: str):
    """The tiny target and a draft perturbed from it (agreeing on some tokens only), loaded: (target, draft)."""
    from specserve.workers.config.settings import ModelConfig
    from specserve.workers.runtime.loading import load_model

    draft_path = save_perturbed_copy(tiny_target, Path(models_dir) / name, 0.05, seed=9)
    return load_model(ModelConfig(path=tiny_target, device=device)), load_model(
        ModelConfig(path=draft_path, device=device)
    )
