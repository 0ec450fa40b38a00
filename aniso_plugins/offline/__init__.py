"""The offline half: `aniso report`, post-processing transforms, the command line."""
