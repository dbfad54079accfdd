"""``--bpe gpt2``: the paper's tokenizer, GPT-2's byte-level BPE, from the user's own files.

Paper §5 uses GPT-2's 50k BPE vocabulary. Nothing is downloaded: the user passes fairseq's
``encoder.json`` and ``vocab.bpe`` and we encode with fairseq's own
``gpt2_bpe_utils.get_encoder``; each token's symbol is its GPT-2 id in decimal, as
``examples/roberta/multiprocessing_bpe_encoder.py`` writes it before ``fairseq-preprocess``. So a
corpus encoded here holds the same symbols as data a user already encoded that way, and our
dictionary (built like the sentencepiece one, over the ids) covers every GPT-2 id.

The files are checked before any work, because fairseq's reader accepts almost anything and
the failure shows up late or never: an empty or garbage ``vocab.bpe`` gives no merges, and the
corpus is then silently encoded byte by byte; a ``vocab.bpe`` without its ``#version`` header
loses its first merge (the reader skips line 1 unseen), one without a final newline its last;
an encoder that lacks a symbol stops fairseq's encoder with a bare ``KeyError`` in the middle of
the corpus. So: both files readable; the encoder a non-empty JSON object of string -> int;
``vocab.bpe`` the ``#version`` line, then at least one merge, one per line, each two symbols,
newline-terminated; and every symbol the BPE works with -- each single byte, each merge's two
parts and its result -- present in the encoder.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from fairseq_alma.errors import DataError
from fairseq_alma.stream.manifest import sha256_file

from .bpe import EncodeLines, flatten

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


def _check_merges(text: str, vocab_bpe: str) -> list[tuple[str, ...]]:
    """The merges of ``vocab.bpe``, refused unless fairseq's reader (``_merges``) would read
    every line of it as one merge of two symbols, and at least one."""
    def refuse(why: str) -> DataError:
        return DataError(f"{VOCAB_FLAG} {vocab_bpe}: {why}; pass fairseq's GPT-2 vocab.bpe "
                         "(a '#version' line, then one merge per line: two symbols)")

    if not text.strip():
        raise refuse("empty")
    if not text.lstrip("\ufeff").startswith("#version"):
        raise refuse("line 1 is not the '#version' header (fairseq's reader skips line 1 "
                     "unread, so a merge there would be lost)")
    if not text.endswith("\n"):
        raise refuse("does not end with a newline, so fairseq's reader would drop its last line")
    merges = _merges(text)
    if not merges:
        raise refuse("holds no merges (the corpus would be encoded byte by byte)")
    for lineno, merge in enumerate(merges, start=2):
        if len(merge) != 2:
            raise refuse(f"line {lineno} is not two symbols")
    return merges


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
    _check_distinct_ids(encoder, encoder_json)
    merges = _check_merges(vocab_text, vocab_bpe)
    # Every symbol the BPE works with: the bytes, each merge's two parts and what it makes.
    needed = dict.fromkeys([*bytes_to_unicode().values(),
                            *(symbol for merge in merges for symbol in (*merge, "".join(merge)))])
    missing = [symbol for symbol in needed if symbol not in encoder]
    if missing:
        raise DataError(f"{ENCODER_FLAG} {encoder_json}: no id for {len(missing)} symbol(s) "
                        f"of the bytes and the merges in {vocab_bpe} (first: {missing[0]!r}); "
                        "pass the encoder.json and vocab.bpe of one GPT-2 BPE")
    return {"encoder_json": os.path.abspath(encoder_json), "vocab_bpe": os.path.abspath(vocab_bpe),
            "encoder_json_sha256": sha256_file(encoder_json),
            "vocab_bpe_sha256": sha256_file(vocab_bpe),
            "vocab_size": len(set(encoder.values())), "merges": len(merges)}


def _check_distinct_ids(encoder: dict, encoder_json: str) -> None:
    """One id per symbol, none negative: two symbols under one id were encoded as one token (every
    "the" became "a" in the stream, which verified, trained and scored without a word)."""
    owner: dict[int, str] = {}
    for symbol, index in encoder.items():
        if index < 0:
            raise DataError(f"{ENCODER_FLAG} {encoder_json}: {symbol!r} has the negative id "
                            f"{index}; pass fairseq's GPT-2 encoder.json")
        if index in owner:
            raise DataError(f"{ENCODER_FLAG} {encoder_json}: id {index} is given to both "
                            f"{owner[index]!r} and {symbol!r} (the stream would make them one "
                            f"token); pass fairseq's GPT-2 encoder.json")
        owner[index] = symbol


def gpt2_vocabulary(encoder_json: str) -> list[str]:
    """Every GPT-2 id, as the decimal symbol the encoded text uses, in id order."""
    with open(encoder_json, encoding="utf-8") as f:
        return [str(i) for i in sorted(set(json.load(f).values()))]
