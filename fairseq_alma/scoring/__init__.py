"""Scoring stage checkpoints of ALMA streams: the library under ``alma-score`` (paper §6.2).

One responsibility per file:
  request.py   ``ScoreRequest``: what to score and how, checked when it is made
  flags.py     alma-score's options (``SCORE_FLAGS``), shared with ``alma-sweep score``
  runs.py      ``StreamRun``: a run directory read and checked for scoring; Ens members
  rules.py     the single / Ens / gEns rules: who predicts at each arrival, and what it costs
  series.py    the checkpoints scored and turned into one Table 2 series per predictor
  old_runs.py  runs written by fairseq-alma before 0.3 (no initialised-model checkpoint)
  score.py     ``score(request, world)``: the whole scoring of one request
  outputs.py   the table, JSON, CSV and figure of scored series

Nothing here reads an ``argparse.Namespace``; ``cli/score.py`` turns its flags into a request.
"""

# The logger every module here writes to: alma-score's log lines have always carried this name
# (``| fairseq_alma.cli.score | scoring ...``), and Slurm logs are searched for it.
LOGGER_NAME = "fairseq_alma.cli.score"
