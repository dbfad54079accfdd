"""``alma-data-prep``: raw text -> BPE -> B mega-batches + eval + valid -> fairseq binaries.

Paper §5: the language-modeling stream is B=4 training mega-batches and one evaluation
mega-batch of about equal size, plus a ~0.5M-word validation set, over a 50k BPE vocabulary.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from fairseq_alma.console import OneLineArgumentParser, run_console
from fairseq_alma.errors import DataError, no_room_named
from fairseq_alma.text_table import format_table

from .out_dir import check_output_dir
from .pipeline import (
    PrepOptions,
    check_megabatches_fit,
    encode_shard,
    prepare,
    prepare_tokenizer,
)
from .split import ORDERS, parse_size

DESCRIPTION = """\
Prepare an ALMA language-modeling stream (paper §5) from raw text.

INPUT files are UTF-8 text, plain or .gz; directories are searched recursively (sorted order,
hidden entries skipped). A DOCUMENT is a block of non-empty lines; one or more blank lines end
it. Documents are the unit of shuffling and splitting; whitespace inside a line is collapsed.
A document that repeats an earlier one exactly is dropped (--keep-duplicates keeps it).

Steps: train a sentencepiece BPE model; encode every document (--workers processes); shuffle
documents with --seed; carve, in this order, the validation set (--valid-size), the evaluation
mega-batch (--eval-size) and B training mega-batches of equal token count from the rest (each
within one document of rest/B; documents keep corpus order inside a split); binarize every split
(the bytes fairseq's binarizer writes) with ONE dictionary (pieces seen in the training
mega-batches, by frequency, plus the rest of the BPE vocabulary). Sizes count BPE tokens as
fairseq stores them, one end-of-line token per line and one blank-line separator per document
included. --order given cuts the mega-batches from the corpus in input order instead (period
k+1 in mega-batch k); --eval-per-megabatch holds a slice of every mega-batch out as evalmb{k}.

Output in --out: manifest.json, dict.txt, spm.model, spm.vocab, megabatch0..B-1.bin/.idx,
eval.bin/.idx, valid.bin/.idx (and evalmb0..B-1.bin/.idx with --eval-per-megabatch; fairseq
mmap format); intermediate files under work/. Running the same command again reuses finished
steps; changed flags redo only what depends on them. A DIR that holds another stream (its
manifest.json lists other inputs) is refused unless --clean is given; one that holds files that
are no stream is refused.

--bpe gpt2 encodes with GPT-2's byte-level BPE (the paper's) from your own encoder.json and
vocab.bpe instead of training sentencepiece (no spm.* files): tokens are GPT-2 ids, as fairseq's
multiprocessing_bpe_encoder.py writes them for the (whitespace-collapsed) lines.
--from-binarized DATA_BIN skips text altogether: it cuts the train split of an existing
fairseq-preprocess output (dict.txt, train.bin/.idx; empty lines separate documents) into the
same seeded splits, keeping its dictionary and token ids. manifest.json records the tokenizer.
"""


def _size(text: str) -> str:
    try:
        parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _at_least(minimum: int):
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return check


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="alma-data-prep", description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    d = PrepOptions(inputs=[], out="")
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="text file (.gz allowed) or directory of them")
    p.add_argument("--out", metavar="DIR", help="output directory (required to prepare)")
    p.add_argument("--bpe", choices=["sentencepiece", "gpt2"], default=None,
                   help="tokenizer: train a sentencepiece BPE on the corpus, or GPT-2's BPE "
                   "from --gpt2-encoder-json and --gpt2-vocab-bpe (default: sentencepiece)")
    p.add_argument("--gpt2-encoder-json", metavar="PATH",
                   help="fairseq's GPT-2 encoder.json (with --bpe gpt2; nothing is downloaded)")
    p.add_argument("--gpt2-vocab-bpe", metavar="PATH",
                   help="fairseq's GPT-2 vocab.bpe (with --bpe gpt2)")
    p.add_argument("--from-binarized", metavar="DATA_BIN",
                   help="instead of INPUT text: a fairseq-preprocess --destdir whose dict.txt "
                   "and train split (train.bin/.idx, then train1, train2, ... if present) are cut "
                   "into the stream at its empty-line document boundaries; the dictionary and "
                   "token ids are kept")
    p.add_argument("--verify", metavar="DIR", help="check a prepared stream instead: the "
                   "dictionary and every shard against the sha256 in DIR/manifest.json (reads "
                   "every shard once), and count the held-out documents that a training "
                   "mega-batch also holds; prints what was checked, or one line naming the bad "
                   "file")
    p.add_argument("--vocab-size", type=_at_least(1), default=d.vocab_size,
                   help=f"BPE vocabulary size (default: {d.vocab_size}, as in the paper)")
    p.add_argument("--spm-sample-sentences", type=_at_least(0), default=d.spm_sample_sentences,
                   metavar="N", help="train the BPE model on N randomly sampled lines "
                   f"(default: {d.spm_sample_sentences:,}; 0 = all lines)")
    p.add_argument("--spm-threads", type=_at_least(1), default=d.spm_threads,
                   help=f"sentencepiece training threads (default: {d.spm_threads}); the model "
                   "depends on it, so it is separate from --workers")
    p.add_argument("--byte-fallback", action=argparse.BooleanOptionalAction,
                   default=d.byte_fallback,
                   help="spell characters outside the vocabulary as UTF-8 byte pieces, like "
                   "GPT-2's byte-level BPE that the paper used, so no split contains <unk> "
                   "(default: on; costs 256 vocabulary entries)")
    p.add_argument("--workers", type=_at_least(1), default=d.workers,
                   help=f"processes for encoding and binarization (default: {d.workers}); "
                   "outputs do not depend on it")
    p.add_argument("--seed", type=_at_least(0), default=d.seed,
                   help=f"seed of the document shuffle that decides the split (default: {d.seed})")
    p.add_argument("--num-megabatches", "-B", type=_at_least(1), default=d.num_megabatches,
                   metavar="B", help=f"training mega-batches (default: {d.num_megabatches})")
    p.add_argument("--eval-size", type=_size, default=d.eval_size,
                   help="evaluation mega-batch size: a fraction of all tokens (0.2), a token "
                   "count (500000, 500k, 0.5M) or 'megabatch' = as large as one training "
                   f"mega-batch, as in the paper (default: {d.eval_size})")
    p.add_argument("--valid-size", type=_size, default=d.valid_size,
                   help="validation set size, fraction or token count as --eval-size "
                   f"(default: {d.valid_size}; the paper held out ~0.5M words)")
    p.add_argument("--order", choices=ORDERS, default=d.order,
                   help="which documents form mega-batch k: 'shuffle' = a seeded random share "
                   "of the corpus, as in the paper; 'given' = the corpus in input order (INPUTs "
                   "as listed, directories in sorted order, e.g. files named by date), so that "
                   "mega-batch k holds period k+1 of a stream that drifts -- valid and eval "
                   "are still the seeded sample of the whole corpus that 'shuffle' holds out "
                   f"(default: {d.order})")
    p.add_argument("--keep-duplicates", action="store_true",
                   help="keep documents that repeat an earlier one exactly (same text once "
                   "whitespace is collapsed; same token ids with --from-binarized). By default "
                   "every later copy is dropped before the split, so that no text is both "
                   "trained on and evaluated on; the count is logged and recorded in "
                   "manifest.json (repeated_documents)")
    p.add_argument("--eval-per-megabatch", type=_size, default=d.eval_per_megabatch,
                   metavar="SIZE",
                   help="also hold out SIZE of every mega-batch k (whole documents, seeded; a "
                   "fraction of that mega-batch, 0.1, or a token count, 50k) as the split "
                   "evalmb{k}, never trained on, which alma-score --matrix scores every stage "
                   "on (default: none)")
    p.add_argument("--clean", action="store_true",
                   help="delete the intermediate files in DIR/work at the end (a later run "
                   "with other split flags then re-encodes the corpus); also lets --out DIR "
                   "replace a stream prepared there from other inputs, which is refused "
                   "without it")
    s = p.add_argument_group(
        "corpora beyond one node", "--slurm-shards N submits three Slurm jobs: extraction and "
        "tokenizer training (the command with --prepare-only), an array of N tasks each "
        "encoding one shard (--shard-index K), and the merge (the command with --num-shards "
        "N: split, dictionary, binaries, manifest), each waiting for the one before "
        "(afterok). The result is byte-identical to running the command without these flags; "
        "the steps can also be run by hand in that order.")
    s.add_argument("--slurm-shards", type=_at_least(1), metavar="N",
                   help="submit the preparation as Slurm jobs with N encoding shards, print the "
                   "job ids and return; job scripts and logs go to DIR/slurm/")
    s.add_argument("--profile", metavar="NAME",
                   help="resource profile of those jobs: slurm/profiles/NAME.yaml or a path "
                   "(default: local-cpu)")
    s.add_argument("--dry-run", action="store_true",
                   help="with --slurm-shards: write the job scripts and print the sbatch "
                   "commands, submit nothing")
    s.add_argument("--num-shards", type=_at_least(1), default=d.num_shards, metavar="N",
                   help="encode the corpus as N shards (byte ranges of the extracted text), "
                   "each kept until joined: shards encoded by --shard-index runs are reused, "
                   "missing ones are encoded here (default: 1; outputs do not depend on it)")
    s.add_argument("--shard-index", type=_at_least(0), metavar="K",
                   help="only encode shard K (0-based) of --num-shards and stop; needs the "
                   "--prepare-only run done; runs beside other shards' runs")
    s.add_argument("--prepare-only", action="store_true",
                   help="only extract the text and train the tokenizer (what every shard "
                   "needs), then stop")
    return p


def _verify(data_dir: str) -> None:
    from fairseq_alma.stream.manifest import has_shard_checksums, verify_stream_dir

    from .overlap import held_out_overlap, overlap_lines

    manifest = verify_stream_dir(data_dir, hashes=True)
    files = 2 * len(manifest["splits"]) + 1
    what = "sizes and sha256" if has_shard_checksums(manifest) else \
        "sizes only (this manifest predates shard checksums: re-run alma-data-prep to add them)"
    print(f"{data_dir}: {files} files match manifest.json ({what})")
    for line in overlap_lines(data_dir, held_out_overlap(data_dir, manifest)):
        print(line)


def _run(args: argparse.Namespace, command: str, argv: list[str]) -> None:
    if args.verify:
        if args.inputs or args.out:
            raise DataError("--verify DIR checks a prepared stream: give no INPUT or --out with it")
        return _verify(args.verify)
    _check_tokenizer_flags(args)
    if args.from_binarized and args.inputs:
        raise DataError("--from-binarized DATA_BIN replaces INPUT text: give one or the other")
    if not (args.inputs or args.from_binarized) or not args.out:
        raise DataError("give INPUT files and --out DIR to prepare a stream (or --verify DIR to "
                        "check one)")
    del args.verify
    slurm = _take_slurm_flags(args)
    valid, eval_size = parse_size(args.valid_size), parse_size(args.eval_size)
    if valid.fraction is None and valid.tokens is None:
        raise DataError("--valid-size cannot be 'megabatch'; give a fraction or a token "
                            "count")
    if (valid.fraction or 0) + (eval_size.fraction or 0) >= 1:
        raise DataError(f"--valid-size {args.valid_size} and --eval-size {args.eval_size} "
                            "leave nothing for the training mega-batches; lower them")
    if args.eval_per_megabatch is not None:
        per = parse_size(args.eval_per_megabatch)
        if per.fraction is None and per.tokens is None:
            raise DataError("--eval-per-megabatch cannot be 'megabatch' (it is a slice of one); "
                            "give a fraction of each mega-batch (0.1) or a token count (50k)")
    options = PrepOptions(**vars(args))
    if not options.from_binarized:  # its own bound is in prepare_from_binarized
        check_megabatches_fit(options)
    if slurm is not None:
        from .slurm_jobs import submit_jobs

        check_output_dir(options)  # before the job scripts go into DIR/slurm
        option_strings = [o for action in build_parser()._actions for o in action.option_strings]
        return submit_jobs(argv, option_strings, options.out, *slurm)
    if options.from_binarized:
        from .from_binarized import prepare_from_binarized

        manifest = prepare_from_binarized(options, command)
    elif options.prepare_only:
        prepare_tokenizer(options)
        print(f"{options.out}: text extracted and tokenizer ready; next: the same command with "
              f"--shard-index K for every K < {options.num_shards}, then with neither flag")
        return None
    elif options.shard_index is not None:
        encode_shard(options)
        print(f"{options.out}: shard {options.shard_index} of {options.num_shards} encoded")
        return None
    else:
        manifest = prepare(options, command)
    print(format_summary(manifest))


def _take_slurm_flags(args: argparse.Namespace) -> tuple[int, str, bool] | None:
    """Check the sharding flags together; remove the Slurm ones from ``args``; return
    (shards, profile, dry run) when --slurm-shards asks to submit jobs."""
    shards, profile, dry_run = args.slurm_shards, args.profile, args.dry_run
    del args.slurm_shards, args.profile, args.dry_run
    if args.from_binarized and (shards or args.num_shards > 1 or args.shard_index is not None
                                or args.prepare_only):
        raise DataError("--from-binarized reads tokens already made: it has no encoding to "
                        "shard; drop --slurm-shards / --num-shards / --shard-index / "
                        "--prepare-only")
    if shards is not None:
        for flag, given in (("--num-shards", args.num_shards > 1),
                            ("--shard-index", args.shard_index is not None),
                            ("--prepare-only", args.prepare_only)):
            if given:
                raise DataError(f"--slurm-shards runs {flag} steps itself; drop {flag}")
        return shards, profile or "local-cpu", dry_run
    for flag, given in (("--profile", profile is not None), ("--dry-run", dry_run)):
        if given:
            raise DataError(f"{flag} is for --slurm-shards N; add it or drop {flag}")
    if args.shard_index is not None:
        if args.prepare_only:
            raise DataError("--prepare-only and --shard-index are two different steps; give "
                            "one")
        if args.shard_index >= args.num_shards:
            raise DataError(f"--shard-index {args.shard_index} needs --num-shards above it "
                            f"(got --num-shards {args.num_shards}); shards count from 0")
    return None


_SPM_FLAGS = {"vocab_size": "--vocab-size", "spm_sample_sentences": "--spm-sample-sentences",
              "spm_threads": "--spm-threads", "byte_fallback": "--byte-fallback"}


def _check_tokenizer_flags(args: argparse.Namespace) -> None:
    """GPT-2 files only with --bpe gpt2; no tokenizer at all with --from-binarized."""
    gpt2_files = [flag for flag, value in (("--gpt2-encoder-json", args.gpt2_encoder_json),
                                           ("--gpt2-vocab-bpe", args.gpt2_vocab_bpe)) if value]
    if args.from_binarized and (args.bpe or gpt2_files):
        raise DataError(f"--from-binarized reads tokens already made: drop "
                        f"{' and '.join(['--bpe'] * bool(args.bpe) + gpt2_files)}")
    if gpt2_files and args.bpe != "gpt2":
        raise DataError(f"{gpt2_files[0]} is for --bpe gpt2; add --bpe gpt2 or drop it")
    if args.from_binarized or args.bpe == "gpt2":
        # A sentencepiece flag that would silently do nothing is refused (its default passes).
        d = PrepOptions(inputs=[], out="")
        for field, flag in _SPM_FLAGS.items():
            if getattr(args, field) != getattr(d, field):
                route = "--from-binarized" if args.from_binarized else "--bpe gpt2"
                raise DataError(f"{flag} trains sentencepiece, which {route} does not; drop it")
    args.bpe = args.bpe or "sentencepiece"


def format_summary(manifest: dict) -> str:
    """The table printed at the end: split, documents, tokens, MB of binaries."""
    rows, totals = [], [0, 0, 0]
    for name, split in manifest["splits"].items():
        size = split["bin_bytes"] + split["idx_bytes"]
        rows.append([name, f"{split['documents']:,}", f"{split['tokens']:,}", f"{size / 1e6:.2f}"])
        totals = [totals[0] + split["documents"], totals[1] + split["tokens"], totals[2] + size]
    rows.append(["total", f"{totals[0]:,}", f"{totals[1]:,}", f"{totals[2] / 1e6:.2f}"])
    lines = format_table(["split", "documents", "tokens", "MB"], rows).rstrip("\n").splitlines()
    dictionary = manifest["dictionary"]
    lines.append(f"dictionary: {dictionary['size']:,} symbols; {_tokenizer_summary(manifest)}")
    return "\n".join(lines)


def _tokenizer_summary(manifest: dict) -> str:
    if "sentencepiece" in manifest:
        return f"sentencepiece vocabulary: {manifest['sentencepiece']['vocab_size']:,}"
    tokenizer = manifest["tokenizer"]
    if tokenizer["kind"] == "gpt2":
        return f"GPT-2 BPE vocabulary: {tokenizer['vocab_size']:,}"
    return f"tokens and dictionary from {tokenizer['source']}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["alma-data-prep", *argv])
    parser = build_parser()
    args = parser.parse_args(argv)
    return run_console(parser.prog, lambda: _registered_run(args, command, argv))


def _registered_run(args: argparse.Namespace, command: str, argv: list[str]) -> None:
    """Import fairseq (its data modules binarize) only now: ``--help`` and a bad flag answer
    without the seconds it takes (``fairseq_alma.FAIRSEQ_FREE_TOOLS``)."""
    from fairseq_alma import register

    register()
    with no_room_named(f"--out {args.out}"):
        return _run(args, command, argv)


if __name__ == "__main__":
    sys.exit(main())
