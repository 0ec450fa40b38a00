"""What the adapters know of transformers models, which the trainer-agnostic core does not: how a
model's forward computes its loss (`causal_loss`), where its LM head, input embedding and blocks
are and how PEFT wraps them (`handle`), how its loss aligns the head's positions with the labels
(`alignment`). The core imports none of it (tests/test_architecture.py)."""
