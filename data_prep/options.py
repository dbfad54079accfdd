"""What one ``alma-data-prep`` run is asked to do, as one typed value.

Its own file because both the pipeline and the output-directory checks (``out_dir``) read it,
and the pipeline uses those checks: the options sit below both.
"""

from __future__ import annotations

from dataclasses import dataclass

from .split import ORDERS


@dataclass(frozen=True)
class PrepOptions:
    inputs: list[str]
    out: str
    vocab_size: int = 50000
    spm_sample_sentences: int = 1_000_000
    spm_threads: int = 4
    byte_fallback: bool = True
    workers: int = 1
    seed: int = 1
    num_megabatches: int = 4
    eval_size: str = "megabatch"
    valid_size: str = "0.5M"
    clean: bool = False
    bpe: str = "sentencepiece"
    gpt2_encoder_json: str | None = None
    gpt2_vocab_bpe: str | None = None
    from_binarized: str | None = None
    num_shards: int = 1
    shard_index: int | None = None
    prepare_only: bool = False
    order: str = ORDERS[0]
    eval_per_megabatch: str | None = None
    keep_duplicates: bool = False
