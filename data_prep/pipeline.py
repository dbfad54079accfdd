"""The data_prep pipeline: extract -> sentencepiece -> encode -> split -> dictionary -> binarize.

With ``--bpe gpt2`` the sentencepiece step is replaced by the user's GPT-2 files (checked up
front, keyed by their sha256); every other step is the same code. ``--from-binarized`` takes
another route (``from_binarized.py``) but shares this module's manifest and the output
directory's checks and lock (``out_dir.py``).

Each step is keyed by exactly what its output depends on (see ``steps.py``), so re-running the
same command reuses everything, and changing e.g. ``--seed`` redoes only the split, the
dictionary and the binaries. ``--workers`` is in no key: it changes speed, never bytes.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import os
import shutil
from dataclasses import asdict
from functools import cached_property
from itertools import pairwise

import numpy as np

from fairseq_alma.errors import DataError
from fairseq_alma.stream.atomic import atomic_output, atomic_write_json
from fairseq_alma.stream.manifest import MANIFEST_FORMAT, MANIFEST_NAME, sha256_file

from .bpe import (
    SPM_SAMPLE_SEED,
    LineEncoder,
    SentencepieceLines,
    encode_documents,
    sentencepiece_vocabulary,
    train_sentencepiece,
)
from .corpus import SourceFile, discover_sources, extract_documents, is_gzip
from .encoded import FORMAT as ENCODED_FORMAT
from .encoded import Encoded, concatenate_parts, read_extra
from .encoded import files as encoded_files
from .fileio import PARTIAL_SUFFIX, aligned_offsets
from .gpt2_bpe import Gpt2Lines, check_gpt2_files, gpt2_vocabulary
from .options import PrepOptions
from .out_dir import check_output_dir, hold_lock, output_dir, stream_inputs
from .repeats import repeats_entry, repeats_key
from .split import (
    ORDERS,
    PERIOD_PREFIX,
    SizeSpec,
    assign_documents,
    check_document_count,
    check_megabatch_bound,
    count_training_pieces,
    parse_size,
    split_names,
)
from .steps import StepRunner

PIPELINE_VERSION = 1  # part of every key: bump when a step's output format changes
ENCODED = "work/encoded"  # prefix of the encoded arrays (encoded.py)
LABELS = "work/split.labels"  # int32 per document: its split's index in split_names
COUNTS = "work/train_piece_counts.json"
SHARDS = "work/shards"  # --num-shards: each shard's encoded arrays, until they are joined


def check_tokenizer_files(options: PrepOptions) -> dict | None:
    """With ``--bpe gpt2``, the checked GPT-2 files (``check_gpt2_files``). Called before
    ``--out`` is touched: a bad file must cost neither an extraction nor a new directory."""
    if options.bpe != "gpt2":
        return None
    return check_gpt2_files(options.gpt2_encoder_json, options.gpt2_vocab_bpe)


class Pipeline:
    def __init__(self, options: PrepOptions, gpt2: dict | None) -> None:
        """``gpt2``: what ``check_tokenizer_files`` returned for ``options``."""
        self.o = options
        self.work = os.path.join(options.out, "work")
        self.runner = StepRunner(options.out, lambda: withdraw_manifest(options.out))
        self.sources = discover_sources(options.inputs)
        self.gpt2 = gpt2

    @cached_property
    def names(self) -> list[str]:
        """Every split, B of them mega-batches: built only once ``check_document_count`` has
        passed (in ``sentencepiece`` or ``_encode_key``), so no B beyond the corpus's
        documents ever sizes a list."""
        return split_names(self.o.num_megabatches, self.o.eval_per_megabatch is not None)

    def path(self, rel: str) -> str:
        return os.path.join(self.o.out, rel)

    def extract(self, need_outputs: bool = False) -> dict:
        key = {"version": PIPELINE_VERSION,
               "sources": [[s.path, s.bytes, s.mtime_ns, s.ctime_ns] for s in self.sources],
               **repeats_key(self.o.keep_duplicates)}
        return self.runner.ensure(
            "extract", key, ["work/docs.txt"],
            lambda: extract_documents(self.sources, self.path("work/docs.txt"),
                                      drop_repeats=not self.o.keep_duplicates), need_outputs)

    def sentencepiece(self) -> dict:
        o = self.o
        # Before the costly steps; checked again on the encoded documents.
        check_document_count(self.extract()["documents"], o.num_megabatches,
                             o.eval_per_megabatch is not None)
        key = {"version": PIPELINE_VERSION, "docs": self.extract()["sha256"],
               "vocab_size": o.vocab_size, "sample_sentences": o.spm_sample_sentences,
               "threads": o.spm_threads, "byte_fallback": o.byte_fallback,
               "sample_seed": SPM_SAMPLE_SEED}

        def build() -> dict:
            self.extract(need_outputs=True)
            return train_sentencepiece(self.path("work/docs.txt"), o.out, o.vocab_size,
                                       o.spm_sample_sentences, o.spm_threads, o.byte_fallback,
                                       before_writing=self.runner.changing_stream)
        # checks_first: a --vocab-size the corpus cannot give is refused before spm.model is
        # replaced, so a refused re-run leaves the finished stream as it was.
        return self.runner.ensure("sentencepiece", key, ["spm.model", "spm.vocab"], build,
                                  checks_first=True)

    def _encode_key(self) -> dict:
        if self.gpt2 is None:
            tokenizer = {"spm": self.sentencepiece()["sha256"]}
        else:
            check_document_count(self.extract()["documents"], self.o.num_megabatches,
                                 self.o.eval_per_megabatch is not None)
            tokenizer = {"gpt2": [self.gpt2["encoder_json_sha256"],
                                  self.gpt2["vocab_bpe_sha256"]]}
        return {"version": PIPELINE_VERSION, "docs": self.extract()["sha256"], **tokenizer,
                "encoded_format": ENCODED_FORMAT}

    def _line_encoder(self) -> LineEncoder:
        if self.gpt2 is None:
            return SentencepieceLines(self.path("spm.model"))
        return Gpt2Lines(self.gpt2["encoder_json"], self.gpt2["vocab_bpe"])

    def vocabulary(self) -> list[str]:
        """Every piece the tokenizer can produce: the dictionary gives each an id."""
        if self.gpt2 is None:
            return sentencepiece_vocabulary(self.path("spm.model"))
        return gpt2_vocabulary(self.gpt2["encoder_json"])

    def symbols(self) -> list[str]:
        """The symbol of every id in the encoded arrays: the tokenizer's, then the extra
        pieces it could not map (``encoded.py``)."""
        return self._line_encoder().piece_table() + read_extra(self.path(ENCODED))

    def encode(self, need_outputs: bool = False) -> dict:
        """The whole corpus's ids: encoded here, or with ``--num-shards N`` joined from N
        shards (each encoded by its own run, e.g. a Slurm array task, or here if missing).
        Either way the same bytes: parts are joined in corpus order."""
        def build() -> dict:
            if self.o.num_shards > 1:
                shards = [self.shard(index) for index in range(self.o.num_shards)]
                return concatenate_parts(shards, self.path(ENCODED),
                                         len(self._line_encoder().piece_table()))
            self.extract(need_outputs=True)
            return encode_documents(self.path("work/docs.txt"), self._line_encoder(),
                                    self.path(ENCODED), self.o.workers)
        return self.runner.ensure("encode", self._encode_key(), encoded_files(ENCODED), build,
                                  need_outputs)

    def shard(self, index: int) -> str:
        """Encode shard ``index`` of ``--num-shards`` (the index-th of N byte ranges of the
        extracted text, cut at document starts) unless done; return its prefix."""
        n = self.o.num_shards
        rel = f"{SHARDS}/{index}-of-{n}"
        prefix = self.path(rel)

        def build() -> dict:
            self.extract(need_outputs=True)
            os.makedirs(self.path(SHARDS), exist_ok=True)
            lock = hold_lock(prefix + ".lock", f"shard {index} of {n} in {self.o.out} is being "
                             "encoded by another alma-data-prep run; wait for it to finish")
            try:
                for leftover in glob.glob(f"{prefix}{PARTIAL_SUFFIX}*"):
                    os.remove(leftover)  # from a killed run of this shard
                start, end = shard_ranges(self.path("work/docs.txt"), n)[index]
                return encode_documents(self.path("work/docs.txt"), self._line_encoder(),
                                        prefix, self.o.workers, start, end)
            finally:
                os.close(lock)
        key = {**self._encode_key(), "shard": index, "num_shards": n}
        self.runner.ensure(f"encode-shard-{index}-of-{n}", key, encoded_files(rel), build)
        return prefix

    def _split_key(self) -> dict:
        o = self.o
        return {**self._encode_key(), "seed": o.seed, "num_megabatches": o.num_megabatches,
                "eval_size": o.eval_size, "valid_size": o.valid_size,
                **order_key(o.order, o.eval_per_megabatch)}

    def split(self, need_outputs: bool = False) -> dict:
        def build() -> dict:
            self.encode(need_outputs=True)
            encoded = Encoded.open(self.path(ENCODED))
            labels, stats = assign_documents(
                encoded.tokens, self.o.seed, self.o.num_megabatches,
                parse_size(self.o.valid_size), parse_size(self.o.eval_size), self.o.order,
                per_megabatch_size(self.o.eval_per_megabatch))
            with atomic_output(self.path(LABELS), "wb") as f:
                labels.tofile(f)
            count_training_pieces(encoded, labels, self.names, self.symbols(),
                                  self.path(COUNTS))
            return {"splits": stats}
        return self.runner.ensure("split", self._split_key(), [LABELS, COUNTS], build,
                                  need_outputs)

    def dictionary(self) -> dict:
        def build() -> dict:
            from .binarize import build_dictionary  # imports fairseq+torch (~5 s): only if needed
            self.split(need_outputs=True)
            return build_dictionary(self.path(COUNTS), self.vocabulary(), self.path("dict.txt"))
        return self.runner.ensure("dictionary", self._split_key(), ["dict.txt"], build)

    def binarize(self) -> dict[str, dict]:
        expected = self.split()["splits"]
        key = {**self._split_key(), "dict": self.dictionary()["sha256"]}

        def build() -> dict:
            from .binarize import binarize_splits  # imports fairseq+torch (~5 s): only if needed
            self.split(need_outputs=True)
            encoded = Encoded.open(self.path(ENCODED))
            labels = np.fromfile(self.path(LABELS), dtype=np.int32)
            info = binarize_splits(encoded, labels, self.names, self.symbols(),
                                   self.path("dict.txt"), self.o.out)
            for name, split in info.items():
                if split["tokens"] != expected[name]["tokens"]:  # the writer's count vs ours
                    raise RuntimeError(f"{name}: binarized {split['tokens']} tokens, "
                                       f"the split counted {expected[name]['tokens']}")
                split["documents"] = expected[name]["documents"]
            return info
        outputs = [f"{name}.{ext}" for name in self.names for ext in ("bin", "idx")]
        return self.runner.ensure("binarize", key, outputs, build)


def check_megabatches_fit(options: PrepOptions) -> None:
    """Refuse, before any work, a ``--num-megabatches`` the INPUT files cannot hold one
    document of each for, from their sizes alone (``check_document_count`` knows the count only
    after the extraction; a B of 10**12 used to end there in a MemoryError)."""
    sources = discover_sources(options.inputs)
    total = sum(s.bytes for s in sources)
    gz = ", a .gz at its largest expansion" if any(is_gzip(s.path) for s in sources) else ""
    holder = f"the INPUT files ({total:,} bytes{gz})"
    check_megabatch_bound(most_documents(sources), options.num_megabatches,
                          options.eval_per_megabatch is not None, holder)


# deflate's largest compression ratio (zlib's technical notes): no .gz expands further.
GZIP_MAX_EXPANSION = 1032


def most_documents(sources: list[SourceFile]) -> int:
    """An upper bound on the documents in ``sources`` from their sizes: a document holds at
    least one byte of text, and a .gz file holds at most 1032 bytes of text per byte."""
    return sum(s.bytes * (GZIP_MAX_EXPANSION if is_gzip(s.path) else 1) for s in sources)


def order_key(order: str, eval_per_megabatch: str | None) -> dict:
    """The split key's entries for ``--order`` and ``--eval-per-megabatch``: present only when
    they differ from the defaults, so streams prepared before these flags existed keep their
    stamps (a re-run reuses them) while any other value redoes the split and what follows."""
    key: dict = {}
    if order != ORDERS[0]:
        key["order"] = order
    if eval_per_megabatch is not None:
        key["eval_per_megabatch"] = eval_per_megabatch
    return key


def per_megabatch_size(eval_per_megabatch: str | None) -> SizeSpec | None:
    return None if eval_per_megabatch is None else parse_size(eval_per_megabatch)


def shard_ranges(docs_path: str, num_shards: int) -> list[tuple[int, int]]:
    """Exactly ``num_shards`` byte ranges of the extracted text, each starting at a document
    start (trailing ones empty when the text has fewer documents than shards)."""
    offsets = aligned_offsets(docs_path, num_shards, at_blank_line=True)
    ranges = list(pairwise(offsets))
    return ranges + [(offsets[-1], offsets[-1])] * (num_shards - len(ranges))


def withdraw_manifest(out_dir: str) -> None:
    """Outputs are about to change: until the new manifest is written, readers see none
    (verify_stream_dir fails naming manifest.json) rather than one that is out of date."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out_dir, MANIFEST_NAME))


def remove_stale_megabatches(out_dir: str, names: list[str]) -> None:
    """Shards of a previous run with a larger B (or with --eval-per-megabatch when this one
    has none) would look like part of this stream."""
    keep = set(names)
    stale = [pattern for prefix in ("megabatch", PERIOD_PREFIX)
             for pattern in (os.path.join(out_dir, f"{prefix}*.*"),
                             os.path.join(out_dir, "work", f"{prefix}*"))]
    for path in (path for pattern in stale for path in glob.glob(pattern)):
        if os.path.basename(path).split(".")[0] not in keep:
            os.remove(path)


def remove_files(out_dir: str, names: list[str]) -> None:
    """Outputs of another tokenizer used before in this directory, which the manifest would
    not describe."""
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, name))


def prepare_tokenizer(options: PrepOptions) -> None:
    """``--prepare-only``: the extraction and the tokenizer (training sentencepiece, or
    checking the GPT-2 files), which every shard's encoding needs; nothing after them."""
    gpt2 = check_tokenizer_files(options)
    with output_dir(options):
        Pipeline(options, gpt2)._encode_key()


def encode_shard(options: PrepOptions) -> None:
    """``--shard-index K``: encode shard K only. Runs beside the other shards' runs, so it
    takes its shard's lock, not the output directory's, and builds nothing shared: the
    extraction and the tokenizer must be done (``--prepare-only``)."""
    check_output_dir(options)
    first = (f"--shard-index needs the extraction and the tokenizer of this corpus done in "
             f"{options.out}: run the same command with --prepare-only instead of "
             "--shard-index first")
    if not os.path.isdir(os.path.join(options.out, "work")):
        raise DataError(first)
    pipeline = Pipeline(options, check_tokenizer_files(options))
    pipeline.runner.frozen = {"extract": first, "sentencepiece": first}
    pipeline.shard(options.shard_index)


def prepare(options: PrepOptions, command: str) -> dict:
    """Run (or resume) the whole pipeline into ``options.out``; return the manifest."""
    gpt2 = check_tokenizer_files(options)
    with output_dir(options):
        pipeline = Pipeline(options, gpt2)
        if pipeline.gpt2 is None:
            tokenizer = {"sentencepiece": _sentencepiece_entry(pipeline.sentencepiece(), options)}
        else:
            tokenizer = {"tokenizer": {"kind": "gpt2", **pipeline.gpt2}}
        pipeline.encode()  # in pipeline order, for readable progress; each builds only if stale
        pipeline.split()
        dict_info = pipeline.dictionary()
        binarized = pipeline.binarize()
        splits = {name: binarized[name] for name in [*pipeline.names[2:], "eval", "valid"]}
        remove_stale_megabatches(options.out, pipeline.names)
        # Text the encode and split steps wrote before they worked on ids (encoded.py).
        remove_files(options.out, ["work/encoded.txt", *(f"work/{n}.txt" for n in pipeline.names)])
        if pipeline.gpt2 is not None:
            remove_files(options.out, ["spm.model", "spm.vocab"])
        manifest = stream_manifest(options, splits, dict_info, tokenizer, pipeline.sources,
                                   pipeline.runner.seconds, command,
                                   repeats_entry(pipeline.extract()))
        atomic_write_json(os.path.join(options.out, MANIFEST_NAME), manifest)
        if options.clean:
            shutil.rmtree(pipeline.work)
        return manifest


def _sentencepiece_entry(spm_info: dict, options: PrepOptions) -> dict:
    return {"model": "spm.model", "vocab": "spm.vocab", "sha256": spm_info["sha256"],
            "vocab_size": spm_info["vocab_size"], "model_type": "bpe",
            "byte_fallback": options.byte_fallback}


def _shard_facts(out_dir: str, name: str, info: dict) -> dict:
    """Size and sha256 of a split's .bin/.idx (the binarize step hashes what it writes; shards
    binarized before it did are hashed here)."""
    facts = {}
    for ext in ("bin", "idx"):
        path = os.path.join(out_dir, f"{name}.{ext}")
        facts[f"{ext}_bytes"] = os.path.getsize(path)
        facts[f"{ext}_sha256"] = info.get(f"{ext}_sha256") or sha256_file(path)
    return facts


def stream_manifest(options: PrepOptions, splits: dict, dict_info: dict, tokenizer: dict,
                    sources: list[SourceFile], step_seconds: dict[str, float],
                    command: str, repeats: dict) -> dict:
    """The manifest of either route; ``tokenizer`` is ``{"sentencepiece": ...}`` (the entry
    manifests have always had) or ``{"tokenizer": {"kind": ...}}``; ``repeats``: the
    documents that repeated an earlier one, and whether they were dropped (``repeats.py``)."""
    o = options
    return {
        "format": MANIFEST_FORMAT, "kind": "lm",
        "num_megabatches": o.num_megabatches, "seed": o.seed, "order": o.order,
        "eval_per_megabatch": o.eval_per_megabatch,
        "repeated_documents": repeats,
        "splits": {name: {"tokens": info["tokens"], "documents": info["documents"],
                          "lines": info["lines"], "unk_tokens": info["unk_tokens"],
                          **_shard_facts(o.out, name, info)}
                   for name, info in splits.items()},
        "dictionary": {"file": "dict.txt", "sha256": dict_info["sha256"],
                       "size": dict_info["size"]},
        **tokenizer,
        "inputs": stream_inputs(o),
        "sources": [{"path": s.path, "bytes": s.bytes} for s in sources],
        "options": asdict(o),
        "step_seconds": {k: round(v, 3) for k, v in step_seconds.items()},
        "command": command,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
