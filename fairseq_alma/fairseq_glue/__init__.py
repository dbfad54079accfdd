"""Everything that touches fairseq's own machinery besides the registered components: reading
and deriving fairseq's config (``config.py``), every patch of fairseq's behaviour
(``patches.py``), what only a training process of an LM stream does in fairseq's hooks
(``stream_training.py``), fairseq-side expert parallelism (``expert_parallel.py``), the entry
of a vision stream through ``fairseq-train`` (``vision_entry.py``) and the plugin's
``--user-dir`` (``user_dir.py``).  Nothing outside this folder
and the registered components (``tasks/``, ``models/``, ``criterions/``, ``optim/``) reads
fairseq's config tree or changes fairseq's behaviour (docs/ARCHITECTURE.md).
"""
