"""The three model-path services (tokenizer, inference, postprocess), one folder each."""
