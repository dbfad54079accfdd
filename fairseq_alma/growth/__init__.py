"""growth of fairseq-alma."""
