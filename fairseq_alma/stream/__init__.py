"""The ALMA protocol pieces that need no fairseq (paper §3, §3.1): stage schedule, mega-batch
partition, stream metrics (CER, Mem, Comp, average perplexity), analytic LM FLOPs, the
``stream.jsonl`` records and atomic writes.

Nothing is imported here: ``import fairseq_alma`` must stay cheap, and ``partition`` pulls in
numpy.  Import the submodule you need, e.g. ``from fairseq_alma.stream.schedule import
build_schedule``.
"""
