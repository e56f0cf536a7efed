"""The family sweep: every causal LM family in transformers, built tiny, run on nnrun against plain HF."""
