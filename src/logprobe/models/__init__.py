"""Model families. Each returns final hidden states [T, H] for a packed batch, never logits."""
