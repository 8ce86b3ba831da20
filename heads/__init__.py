"""Heads stage: the EAGLE-3 head, its checkpoints and export formats."""
