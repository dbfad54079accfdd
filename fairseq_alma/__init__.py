"""fairseq-alma: Anytime Learning at Macroscale with Switch Transformers (a fairseq user dir)."""
