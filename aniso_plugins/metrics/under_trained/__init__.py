"""Under-trained tokens: head rows that look like those of tokens the training never predicted."""
