"""models of fairseq-alma."""
