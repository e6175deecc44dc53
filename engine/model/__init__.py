"""Models, their loader and attention backends.

Importing the package registers the built-in attention backends.
"""

from engine.model import torch_attention  # noqa: F401  (registers the "torch" backend)
