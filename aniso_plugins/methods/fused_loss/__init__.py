"""The fused loss: the LM head computes the training cross-entropy chunk by chunk, never the full logits."""
