"""The EAGLE-3 data directory's manifest: what eagle_data.py writes and the trainer reads, one typed reader for both.

manifest.json records the target (identity, path, shape), the feature layers, the seed, the generation settings a
resume must match, and the whole shards written so far.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from specserve.workers.errors import ModelLoadError
from specserve.workers.models.home import specserve_home

FORMAT = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class GenerationSettings:
    """What defines the data (a resume must use the same): shard size, lengths, sampling, generation precision and
    batch (numerics and the sampling streams depend on the batch's rows). fp32 generation by default: on CPUs
    without native bf16 (AVX512-BF16/AMX) bf16 decoded 4x slower (13 vs 51 tok/s at batch 32 on the 2-core dev
    machine), and fp32 answers are exactly the fp32 target's greedy text."""

    shard_sequences: int = 256
    batch: int = 128  # a decode step of 64 rows took 1.6x one of 32 on 2 cores: wide batches pay
    max_question_tokens: int = 64
    max_answer_tokens: int = 256
    greedy_fraction: float = 0.5
    train_question_fraction: float = 0.05
    answer_temperature: float = 0.7
    answer_top_p: float = 0.9
    gen_dtype: str = "float32"
    passage_fraction: float = 0.3  # per question, one more request over its answer (eagle_prompts.PASSAGE_TASKS)


@dataclass(frozen=True)
class ShardInfo:
    file: str
    sequences: int
    tokens: int
    answer_tokens: int


@dataclass
class DataManifest:
    target: str
    target_path: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    feature_layers: list[int]
    seed: int
    settings: GenerationSettings
    shards: list[ShardInfo] = field(default_factory=list)
    format: int = FORMAT

    @property
    def answer_tokens(self) -> int:
        return sum(s.answer_tokens for s in self.shards)

    def to_json(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("settings", "shards")}
        return data | {"shards": [asdict(s) for s in self.shards], "generation": asdict(self.settings)}

    @classmethod
    def from_json(cls, data: dict, source: Path) -> DataManifest:
        try:
            if data["format"] != FORMAT:
                raise ValueError(f"format {data['format']!r}, this specserve reads format {FORMAT}")
            # data written before passage tasks existed had none
            settings = GenerationSettings(**{"passage_fraction": 0.0, **data["generation"]})
            shards = [ShardInfo(**s) for s in data["shards"]]
            plain = {f.name: data[f.name] for f in fields(cls) if f.name not in ("settings", "shards")}
            return cls(**plain, settings=settings, shards=shards)
        except (KeyError, TypeError, ValueError) as err:
            raise ModelLoadError(f"{source} is not an EAGLE-3 data manifest ({err!r})") from err


def default_data_dir(identity: str) -> Path:
    return specserve_home() / "eagle-data" / identity[:16]


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def read_manifest(data_dir: str | Path) -> DataManifest:
    """The manifest of a data directory. Raises ModelLoadError naming the file when it is missing or malformed."""
    path = Path(data_dir) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path} is missing or unreadable ({err}): generate the EAGLE-3 data first") from err
    return DataManifest.from_json(data, path)


def shard_paths(data_dir: str | Path, manifest: DataManifest) -> list[Path]:
    """The manifest's shard files; ModelLoadError when it lists none."""
    if not manifest.shards:
        raise ModelLoadError(f"{Path(data_dir) / MANIFEST} lists no shards: generate the EAGLE-3 data first")
    return [Path(data_dir) / shard.file for shard in manifest.shards]
