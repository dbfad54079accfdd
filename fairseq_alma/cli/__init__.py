"""cli of fairseq-alma."""
