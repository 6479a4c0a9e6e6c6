"""A served model's tokenizer and the facts of its vocabulary and context, loaded once per replica from the target's
directory: the ingress tokenizes prompts with it, a scheduler replica detokenizes what rounds commit."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class ModelTokenizer:
    """tokenizer: the target's (transformers); vocab_size and max_positions: from its text config (max_positions None
    when the config has no bound); max_token_chars: characters of the longest token, a bound on a prompt's length."""

    def __init__(self, target_path: str):
        from transformers import AutoConfig, AutoTokenizer

        self.path = target_path
        self.tokenizer = AutoTokenizer.from_pretrained(target_path, local_files_only=True)
        text_cfg = AutoConfig.from_pretrained(target_path, local_files_only=True).get_text_config()
        self.vocab_size: int = text_cfg.vocab_size
        self.max_positions: int | None = getattr(text_cfg, "max_position_embeddings", None)
        self.max_token_chars = max_token_chars(self.tokenizer)
        log.info("tokenizer of %s loaded: vocabulary %d, context %s", target_path, self.vocab_size, self.max_positions)


def max_token_chars(tokenizer) -> int:
    """Characters of the longest token in the vocabulary (added tokens too): no token spans more of a text."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
