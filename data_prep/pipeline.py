"""The data_prep pipeline: extract -> sentencepiece -> encode -> split -> dictionary -> binarize.

Each step is keyed by exactly what its output depends on (see ``steps.py``), so re-running the
same command reuses everything, and changing e.g. ``--seed`` redoes only the split, the
dictionary and the binaries. ``--workers`` is in no key: it changes speed, never bytes.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import glob
import os
import shutil
from dataclasses import asdict, dataclass

import numpy as np

from fairseq_alma.errors import DataError

from .bpe import SPM_SAMPLE_SEED, encode_documents, train_sentencepiece
from .corpus import discover_sources, extract_documents
from .fileio import PARTIAL_SUFFIX, sha256_file, write_json_atomic
from .manifest import MANIFEST_FORMAT, MANIFEST_NAME
from .split import assign_documents, check_document_count, parse_size, split_names, write_splits
from .steps import StepRunner

PIPELINE_VERSION = 1  # part of every key: bump when a step's output format changes


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


class Pipeline:
    def __init__(self, options: PrepOptions) -> None:
        self.o = options
        self.work = os.path.join(options.out, "work")
        self.runner = StepRunner(options.out, self._withdraw_manifest)
        self.sources = discover_sources(options.inputs)
        self.names = split_names(options.num_megabatches)

    def path(self, rel: str) -> str:
        return os.path.join(self.o.out, rel)

    def _withdraw_manifest(self) -> None:
        """Outputs are about to change: until the new manifest is written, readers see none
        (verify_stream_dir fails naming manifest.json) rather than one that is out of date."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path(MANIFEST_NAME))

    def extract(self, need_outputs: bool = False) -> dict:
        key = {"version": PIPELINE_VERSION,
               "sources": [[s.path, s.bytes, s.mtime_ns] for s in self.sources]}
        return self.runner.ensure(
            "extract", key, ["work/docs.txt"],
            lambda: extract_documents(self.sources, self.path("work/docs.txt")), need_outputs)

    def sentencepiece(self) -> dict:
        o = self.o
        # Before the costly steps; checked again on the encoded documents.
        check_document_count(self.extract()["documents"], o.num_megabatches)
        key = {"version": PIPELINE_VERSION, "docs": self.extract()["sha256"],
               "vocab_size": o.vocab_size, "sample_sentences": o.spm_sample_sentences,
               "threads": o.spm_threads, "byte_fallback": o.byte_fallback,
               "sample_seed": SPM_SAMPLE_SEED}

        def build() -> dict:
            self.extract(need_outputs=True)
            return train_sentencepiece(self.path("work/docs.txt"), o.out, o.vocab_size,
                                       o.spm_sample_sentences, o.spm_threads, o.byte_fallback)
        return self.runner.ensure("sentencepiece", key, ["spm.model", "spm.vocab"], build)

    def _encode_key(self) -> dict:
        return {"version": PIPELINE_VERSION, "docs": self.extract()["sha256"],
                "spm": self.sentencepiece()["sha256"]}

    def encode(self, need_outputs: bool = False) -> dict:
        def build() -> dict:
            self.extract(need_outputs=True)
            return encode_documents(self.path("work/docs.txt"), self.path("spm.model"),
                                    self.path("work/encoded.txt"),
                                    self.path("work/encoded.tokens"), self.o.workers)
        return self.runner.ensure("encode", self._encode_key(),
                                  ["work/encoded.txt", "work/encoded.tokens"], build, need_outputs)

    def _split_key(self) -> dict:
        o = self.o
        return {**self._encode_key(), "seed": o.seed, "num_megabatches": o.num_megabatches,
                "eval_size": o.eval_size, "valid_size": o.valid_size}

    def split(self, need_outputs: bool = False) -> dict:
        texts = {name: f"work/{name}.txt" for name in self.names}

        def build() -> dict:
            self.encode(need_outputs=True)
            tokens = np.fromfile(self.path("work/encoded.tokens"), dtype=np.int64)
            labels, stats = assign_documents(
                tokens, self.o.seed, self.o.num_megabatches, parse_size(self.o.valid_size),
                parse_size(self.o.eval_size))
            write_splits(self.path("work/encoded.txt"), labels, self.names,
                         {name: self.path(rel) for name, rel in texts.items()},
                         self.path("work/train_piece_counts.json"))
            return {"splits": stats}
        return self.runner.ensure("split", self._split_key(),
                                  [*texts.values(), "work/train_piece_counts.json"], build,
                                  need_outputs)

    def dictionary(self) -> dict:
        def build() -> dict:
            from .binarize import build_dictionary  # imports fairseq+torch (~5 s): only if needed
            self.split(need_outputs=True)
            return build_dictionary(self.path("work/train_piece_counts.json"),
                                    self.path("spm.model"), self.path("dict.txt"))
        return self.runner.ensure("dictionary", self._split_key(), ["dict.txt"], build)

    def binarize(self) -> dict[str, dict]:
        expected = self.split()["splits"]
        key = {**self._split_key(), "dict": self.dictionary()["sha256"]}

        def build() -> dict:
            from .binarize import binarize_splits  # imports fairseq+torch (~5 s): only if needed
            self.split(need_outputs=True)
            info = binarize_splits({name: self.path(f"work/{name}.txt") for name in self.names},
                                   self.path("dict.txt"), self.o.out, self.work, self.o.workers)
            for name, split in info.items():
                if split["tokens"] != expected[name]["tokens"]:  # fairseq's count vs ours
                    raise RuntimeError(f"{name}: fairseq binarized {split['tokens']} tokens, "
                                       f"the split counted {expected[name]['tokens']}")
                split["documents"] = expected[name]["documents"]
            return info
        outputs = [f"{name}.{ext}" for name in self.names for ext in ("bin", "idx")]
        return self.runner.ensure("binarize", key, outputs, build)

    def remove_stale_megabatches(self) -> None:
        """Shards of a previous run with a larger B would look like part of this stream."""
        keep = set(self.names)
        for path in glob.glob(self.path("megabatch*.*")) + glob.glob(self.path("work/megabatch*")):
            if os.path.basename(path).split(".")[0] not in keep:
                os.remove(path)


def _check_output_dir(options: PrepOptions) -> None:
    out = os.path.realpath(options.out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise DataError(f"--out {options.out}: exists and is not a directory")
    for given in options.inputs:
        real = os.path.realpath(given)
        if os.path.isdir(real) and os.path.commonpath([real, out]) == real:
            raise DataError(f"--out {options.out} lies inside input directory {given}; "
                                "a re-run would read its own outputs -- choose another --out")


def _lock(out_dir: str) -> int:
    fd = os.open(os.path.join(out_dir, ".lock"), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataError(f"--out {out_dir} is in use by another alma-data-prep run; wait "
                            "for it to finish") from None
    return fd


def prepare(options: PrepOptions, command: str) -> dict:
    """Run (or resume) the whole pipeline into ``options.out``; return the manifest."""
    _check_output_dir(options)
    os.makedirs(os.path.join(options.out, "work"), exist_ok=True)
    lock = _lock(options.out)
    try:
        for leftover in (glob.glob(os.path.join(options.out, f"*{PARTIAL_SUFFIX}*"))
                         + glob.glob(os.path.join(options.out, "work", f"*{PARTIAL_SUFFIX}*"))):
            os.remove(leftover)  # from a killed run; its step has no stamp and will rerun
        pipeline = Pipeline(options)
        spm_info = pipeline.sentencepiece()
        pipeline.encode()  # in pipeline order, for readable progress; each builds only if stale
        pipeline.split()
        dict_info = pipeline.dictionary()
        binarized = pipeline.binarize()
        splits = {name: binarized[name] for name in [*pipeline.names[2:], "eval", "valid"]}
        pipeline.remove_stale_megabatches()
        manifest = _manifest(pipeline, spm_info, dict_info, splits, command)
        write_json_atomic(os.path.join(options.out, MANIFEST_NAME), manifest)
        if options.clean:
            shutil.rmtree(pipeline.work)
        return manifest
    finally:
        os.close(lock)


def _shard_facts(pipeline: Pipeline, name: str, info: dict) -> dict:
    """Size and sha256 of a split's .bin/.idx (the binarize step hashes what it writes; shards
    binarized before it did are hashed here)."""
    facts = {}
    for ext in ("bin", "idx"):
        path = pipeline.path(f"{name}.{ext}")
        facts[f"{ext}_bytes"] = os.path.getsize(path)
        facts[f"{ext}_sha256"] = info.get(f"{ext}_sha256") or sha256_file(path)
    return facts


def _manifest(pipeline: Pipeline, spm_info: dict, dict_info: dict, splits: dict,
              command: str) -> dict:
    o = pipeline.o
    return {
        "format": MANIFEST_FORMAT, "kind": "lm",
        "num_megabatches": o.num_megabatches, "seed": o.seed,
        "splits": {name: {"tokens": info["tokens"], "documents": info["documents"],
                          "lines": info["lines"], "unk_tokens": info["unk_tokens"],
                          **_shard_facts(pipeline, name, info)}
                   for name, info in splits.items()},
        "dictionary": {"file": "dict.txt", "sha256": dict_info["sha256"],
                       "size": dict_info["size"]},
        "sentencepiece": {"model": "spm.model", "vocab": "spm.vocab",
                          "sha256": spm_info["sha256"], "vocab_size": spm_info["vocab_size"],
                          "model_type": "bpe", "byte_fallback": o.byte_fallback},
        "sources": [{"path": s.path, "bytes": s.bytes} for s in pipeline.sources],
        "options": asdict(o),
        "step_seconds": {k: round(v, 3) for k, v in pipeline.runner.seconds.items()},
        "command": command,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
