"""modules of fairseq-alma."""
