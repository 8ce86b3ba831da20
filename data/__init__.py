"""Data stage: targets, corpora, chat templates and masks, regeneration, draft vocabulary, hidden states."""
