"""colozoo: pre-parallelized transformers."""
