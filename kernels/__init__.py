"""dit_passes.kernels: the Triton and CUTLASS kernels.

This top-level folder is installed as ``dit_passes.kernels`` (pyproject.toml's ``package-dir``; an editable
install maps it too), and is only importable under that name: run ``pip install -e .`` in a source checkout.
"""
if __name__ != "dit_passes.kernels":
    # The repository root is on sys.path (`python -m ...` or a script started there): `import kernels` found
    # this folder instead of the PyPI package `kernels` that transformers imports.
    raise ImportError(f"{__file__} is dit_passes.kernels, found as top-level {__name__!r} because the repository "
                      "root is on sys.path, where it shadows the PyPI package 'kernels': run Python with -P "
                      "(e.g. `python -P -m pytest`) or from another directory", name=__name__)
