"""criterions of fairseq-alma."""
