"""refmath: the equations of Transformers and LLMs as explicit NumPy with hand-derived gradients."""

__version__ = "0.1.0"
