"""The postprocess service: logits to labels and scores, embeddings to unit vectors."""
