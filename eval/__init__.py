"""Evaluation stage: speculative decoder, benchmark, release gate, Hub push."""
