"""``--bpe gpt2``: the paper's tokenizer, GPT-2's byte-level BPE, from the user's own files.

Paper §5 uses GPT-2's 50k BPE vocabulary. Nothing is downloaded: the user passes fairseq's
``encoder.json`` and ``vocab.bpe`` and we encode with fairseq's own
``gpt2_bpe_utils.get_encoder``; each token's symbol is its GPT-2 id in decimal, as
``examples/roberta/multiprocessing_bpe_encoder.py`` writes it before ``fairseq-preprocess``. So a
corpus encoded here holds the same symbols as data a user already encoded that way, and our
dictionary (built like the sentencepiece one, over the ids) covers every GPT-2 id.

The files are checked before any work: both readable, the encoder a JSON object of string ->
int, and every symbol a merge or a single byte can produce present in it, because fairseq's
encoder would otherwise stop with a bare ``KeyError`` in the middle of the corpus.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from fairseq_alma.errors import DataError

from .bpe import EncodeLines, flatten
from .fileio import sha256_file

ENCODER_FLAG = "--gpt2-encoder-json"
VOCAB_FLAG = "--gpt2-vocab-bpe"


@dataclass(frozen=True)
class Gpt2Lines:
    """A ``bpe.LineEncoder``: GPT-2 ids for each line, via fairseq's encoder. Ids are handed on
    renumbered densely (the n-th smallest GPT-2 id -> n), so arrays over them stay small
    whatever the encoder.json's numbers; ``piece_table`` gives back each one's GPT-2 id as the
    decimal symbol the dictionary holds."""

    encoder_json: str
    vocab_bpe: str

    def load(self) -> EncodeLines:
        from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

        encoder = get_encoder(self.encoder_json, self.vocab_bpe)
        dense = {gpt2_id: k for k, gpt2_id in enumerate(sorted(set(encoder.encoder.values())))}
        encoder.encoder = {symbol: dense[gpt2_id] for symbol, gpt2_id in encoder.encoder.items()}
        return lambda lines, extra: flatten([encoder.encode(line) for line in lines])

    def piece_table(self) -> list[str]:
        return gpt2_vocabulary(self.encoder_json)


def _read(path: str | None, flag: str) -> str:
    if not path:
        raise DataError(f"--bpe gpt2 needs {flag} PATH (fairseq's GPT-2 "
                        f"{'encoder.json' if flag == ENCODER_FLAG else 'vocab.bpe'}); pass it")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise DataError(f"{flag} {path}: cannot read ({reason}); pass fairseq's GPT-2 "
                        "file") from None


def _merges(text: str) -> list[tuple[str, ...]]:
    """The merges as ``get_encoder`` reads them: after the ``#version`` line, before the
    final newline."""
    return [tuple(line.split()) for line in text.split("\n")[1:-1]]


def check_gpt2_files(encoder_json: str | None, vocab_bpe: str | None) -> dict:
    """Validate both files; return what the manifest and the step keys record about them."""
    from fairseq.data.encoders.gpt2_bpe_utils import bytes_to_unicode

    encoder_text, vocab_text = _read(encoder_json, ENCODER_FLAG), _read(vocab_bpe, VOCAB_FLAG)
    try:
        encoder = json.loads(encoder_text)
    except ValueError as exc:
        raise DataError(f"{ENCODER_FLAG} {encoder_json}: not JSON ({exc}); pass fairseq's "
                        "GPT-2 encoder.json") from None
    if not isinstance(encoder, dict) or not encoder or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in encoder.values()):
        raise DataError(f"{ENCODER_FLAG} {encoder_json}: not a JSON object of symbol -> "
                        "integer id; pass fairseq's GPT-2 encoder.json")
    merges = _merges(vocab_text)
    for lineno, merge in enumerate(merges, start=2):
        if len(merge) != 2:
            raise DataError(f"{VOCAB_FLAG} {vocab_bpe}: line {lineno} is not two symbols; "
                            "pass fairseq's GPT-2 vocab.bpe")
    needed = [*bytes_to_unicode().values(), *("".join(m) for m in merges)]
    missing = [symbol for symbol in needed if symbol not in encoder]
    if missing:
        raise DataError(f"{ENCODER_FLAG} {encoder_json}: no id for {len(missing)} symbol(s) "
                        f"the BPE can produce (first: {missing[0]!r}); pass the encoder.json "
                        f"that belongs to {vocab_bpe}")
    return {"encoder_json": os.path.abspath(encoder_json), "vocab_bpe": os.path.abspath(vocab_bpe),
            "encoder_json_sha256": sha256_file(encoder_json),
            "vocab_bpe_sha256": sha256_file(vocab_bpe),
            "vocab_size": len(set(encoder.values())), "merges": len(merges)}


def gpt2_vocabulary(encoder_json: str) -> list[str]:
    """Every GPT-2 id, as the decimal symbol the encoded text uses, in id order."""
    with open(encoder_json, encoding="utf-8") as f:
        return [str(i) for i in sorted(set(json.load(f).values()))]
