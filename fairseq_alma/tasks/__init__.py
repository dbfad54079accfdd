"""tasks of fairseq-alma."""
