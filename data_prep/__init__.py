"""Corpus -> sentencepiece BPE -> ALMA mega-batch shards -> fairseq binaries + manifest.

Console entry points: ``alma-data-prep`` (``data_prep.cli``) and ``alma-demo-corpus``
(``data_prep.demo_corpus``). Training code imports only ``fairseq_alma.stream.manifest``
(``load_manifest``, ``verify_stream_dir``, ``DataError``), which needs neither fairseq nor
sentencepiece.
"""
