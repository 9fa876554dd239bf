"""The graph passes users put in ``compile_dit(model, passes=[...])``."""
from .cleanup import Cleanup

__all__ = ["Cleanup"]
