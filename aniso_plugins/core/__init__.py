"""The core: configuration, hook contract, plugin manager, session, model handle, targets, state."""
