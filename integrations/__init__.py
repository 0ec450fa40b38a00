"""Trainer adapters, one module per trainer: ``aniso_plugins.integrations.hf``,
``aniso_plugins.integrations.lightning``, ``aniso_plugins.integrations.torchtitan``.
Each needs its pip extra (``aniso-plugins[hf]`` etc.) and holds no method math."""
