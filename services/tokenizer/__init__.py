"""The tokenizer service: text to token ids with each model version's own tokenizer."""
