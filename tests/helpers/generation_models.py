"""A copy of a tiny model with a generation_config.json of sampling defaults (and, optionally, a chat template), for
the tests of the model's defaults (cluster/serve/generation_defaults.py) and of chat_template_kwargs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# A ChatML template that, as Qwen3's, writes an empty think block when enable_thinking is false.
THINKING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)
# The sampling defaults of the served "compat" model (tests/integration/tiny_app/)
COMPAT_DEFAULTS = {"temperature": 0.7, "top_k": 5, "repetition_penalty": 1.3}


def save_with_defaults(source: str, path: str | Path, defaults: dict, chat_template: str | None = None) -> str:
    """`source` copied to `path`, its generation_config.json given `defaults` (its own keys kept)."""
    path = Path(path)
    shutil.copytree(source, path, dirs_exist_ok=True)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **defaults}))
    if chat_template is not None:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        tokenizer_config["chat_template"] = chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return str(path)
