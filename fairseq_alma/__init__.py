"""fairseq-alma: Anytime Learning at Macroscale with Switch Transformers (a fairseq user dir).

Importing the package registers its fairseq components (models, criterions, tasks, LR
schedulers); fairseq's ``--user-dir`` imports it, and our console tools import it directly.
"""

from . import criterions, models, optim, tasks  # noqa: F401  (registration side effects)
