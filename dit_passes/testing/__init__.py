"""Test helpers for dit_passes: a CPU multi-rank harness (:func:`run_ranks`)."""

from dit_passes.testing.multiproc import RankFailedError, RankTimeoutError, run_ranks

__all__ = ["RankFailedError", "RankTimeoutError", "run_ranks"]
