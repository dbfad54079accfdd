"""Language-model side of the stream: fixed-budget batching, evaluation, stage checkpoints."""
