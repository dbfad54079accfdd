"""Blocks longer than the run says (or the model takes): refused, never left out of a perplexity.

Why: with ``--sample-break-mode eos``, ``complete`` or ``complete_doc`` fairseq's
``TokenBlockDataset`` makes a line a block of its own (``eos``), or packs whole lines and gives
a line longer than ``--tokens-per-sample`` a block of its own (``complete*``): one long line is
one block longer than the model's positions. fairseq then

- leaves such blocks out of every evaluation, with a warning (``ignore_invalid_inputs``): the
  perplexity printed is of the short lines only, a number that looks right and is not;
- trains on them as they are: the stream's batches are not filtered by size, sinusoidal
  positions stretch, and learned positions end in an ``IndexError`` at the first long batch;
- and the FLOPs count, which takes each token's attention over ``--tokens-per-sample``
  positions at most, under-counts a block longer than that even where the model takes it.

(``--add-bos-token``, which makes every sequence one token longer than its block, is refused
in a stream: ``fairseq_glue/train_flags.STREAM_REFUSED_FLAGS``.)  ``--shorten-method truncate``
or ``random_crop`` cuts the lines of the splits it covers to ``--tokens-per-sample`` first;
``--sample-break-mode none`` (the default) cuts the text into blocks of exactly that length, so
none is longer.

``check_stream_blocks`` reads each split's line lengths from its ``.idx`` (no dataset is
built) before a stream trains; ``check_blocks_fit`` is the same rule for a split already
loaded, where everything is scored (``nll.eval_batches``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import UsageError

# the shortening of fairseq's maybe_shorten_dataset: every line cut to --tokens-per-sample
SHORTENING_METHODS = ("truncate", "random_crop")


def _value(option: Any) -> str:
    return str(getattr(option, "value", option))


def line_lengths_matter(cfg: Any, split: str) -> bool:
    """Whether a line of ``split`` can become a block longer than ``--tokens-per-sample``: not
    with ``--sample-break-mode none``, nor on a split ``--shorten-method`` cuts."""
    if _value(getattr(cfg, "sample_break_mode", "none") or "none") == "none":
        return False
    if _value(getattr(cfg, "shorten_method", "none") or "none") in SHORTENING_METHODS:
        listed = str(getattr(cfg, "shorten_data_split_list", "") or "")
        return bool(listed) and split not in listed.split(",")  # "" cuts every split
    return True


def check_shortening(cfg: Any, splits: list[str]) -> None:
    """``--shorten-data-split-list`` names splits of this stream, and only with a
    ``--shorten-method``: fairseq cuts a split only when its name is listed, so a list of
    fairseq's usual names (``train``, ``test``) cut nothing here (the stream's splits are
    ``megabatch{k}``, ``eval``, ``valid``) and the run trained on uncut lines without a word."""
    listed = [name for name in str(getattr(cfg, "shorten_data_split_list", "") or "").split(",") if name]
    if not listed:
        return
    flag = f"--shorten-data-split-list {cfg.shorten_data_split_list}"
    if _value(getattr(cfg, "shorten_method", "none") or "none") not in SHORTENING_METHODS:
        raise UsageError(f"{flag} does nothing without --shorten-method (truncate or random_crop); "
                         f"add one, or drop {flag}")
    unknown = [name for name in listed if name not in splits]
    if unknown:
        trained = [name for name in splits if name.startswith("megabatch")]
        held_out = [name for name in splits if not name.startswith("megabatch")]
        raise UsageError(f"{flag}: this stream has no split {', '.join(repr(n) for n in unknown)}, so "
                         f"fairseq would cut nothing there; name its splits ({', '.join(held_out)}, "
                         f"{trained[0]}..{trained[-1]}), or give no list to cut every split")


def check_stream_blocks(cfg: Any, data: str, splits: list[str], positions: int) -> None:
    """Refuse a stream run (task config ``cfg``, a model of ``positions``) whose blocks would be
    longer than ``--tokens-per-sample``, naming the first split that holds one (module doc).

    Longer than ``--tokens-per-sample``, not only than the model's positions: the FLOPs count
    takes every block's attention over at most that many positions (``stream/transformer_flops``),
    so a longer block would be trained on and under-counted even where the model takes it.
    Reads only each split's ``.idx``, and only when lines matter."""
    from fairseq.data.indexed_dataset import MMapIndexedDataset, index_file_path

    tokens = int(cfg.tokens_per_sample)
    check_shortening(cfg, splits)
    mode = _value(cfg.sample_break_mode)
    for split in splits:
        if not line_lengths_matter(cfg, split):  # blocks of at most --tokens-per-sample
            continue
        # the index must outlive every use of its sizes: its __del__ unmaps them
        index = MMapIndexedDataset.Index(index_file_path(os.path.join(data, split)))
        longest = int(index.sizes.max()) if len(index.sizes) else 0
        count = int(np.count_nonzero(index.sizes > tokens)) if longest > tokens else 0
        del index
        if count:
            cut = f"add {split} to --shorten-data-split-list" if \
                _value(getattr(cfg, "shorten_method", "none") or "none") in SHORTENING_METHODS \
                else "cut lines with --shorten-method truncate"
            dropped = (f"fairseq would leave those longer than the model's {positions:,} positions out "
                       f"of every perplexity (and fail on them with learned positions), and ") \
                if longest > positions else ""
            raise UsageError(
                f"split {split} of {data}: {count:,} of its lines are longer than --tokens-per-sample "
                f"{tokens} (up to {longest:,} tokens), and --sample-break-mode {mode} makes each such "
                f"line a block of its own: {dropped}the FLOPs count takes blocks of at most {tokens}; "
                f"raise --tokens-per-sample to {longest:,}, {cut}, or "
                f"use --sample-break-mode none")


def blocks_too_long(dataset: Any, indices: Any, positions: Any, what: str) -> tuple[Any, str | None]:
    """(the ``indices`` of ``dataset`` whose blocks fit ``positions``, None), or with a block
    that does not, what fairseq would leave out: "N of the M blocks ``what`` are longer than the
    model's P positions (up to L tokens)" (``what``: "of eval", "to score"). Shared by every scorer (``check_blocks_fit``) and
    fairseq's own scoring commands (``fairseq_glue/patches.install_every_block_scored``)."""
    kept, ignored = dataset.filter_indices_by_size(indices, positions)
    if len(ignored) == 0:
        return kept, None
    longest = max(int(dataset.size(i)) for i in ignored[:10000])
    nothing = " (all of them: nothing would be scored)" if len(kept) == 0 else ""
    return kept, (f"{len(ignored):,} of the {len(ignored) + len(kept):,} blocks {what} are longer "
                  f"than the model's {positions} positions (up to {longest:,} tokens); they would be "
                  f"left out of the perplexity{nothing}")


def check_blocks_fit(dataset: Any, positions: Any, split: str) -> None:
    """Every block of a loaded ``dataset`` fits ``positions``, or one line naming ``split``:
    what fairseq's ``ignore_invalid_inputs`` would silently leave out of the score."""
    _, too_long = blocks_too_long(dataset, np.arange(len(dataset), dtype=np.int64), positions, f"of {split}")
    if too_long is not None:
        raise UsageError(f"{too_long}: score text whose blocks fit (with a --sample-break-mode other "
                         f"than none, a line longer than the model's positions is a block of its own)")
