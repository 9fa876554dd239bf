"""dit_passes.kernels: the Triton and CUTLASS kernels (this folder is installed under the dit_passes namespace).

When the repository root is on sys.path (a script or a Ray worker started there), ``import kernels`` would find
this folder instead of the PyPI package ``kernels`` that transformers imports. Imported under that top-level
name, this module therefore loads the installed package in its own place: the import system hands back whatever
``sys.modules["kernels"]`` holds once this file has run, so the importer gets the real package (or the usual
ModuleNotFoundError when it is not installed), never these files.
"""
if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None:
        del sys.modules["kernels"]
        raise ModuleNotFoundError("No module named 'kernels' (the folder kernels/ here is dit_passes.kernels)",
                                  name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)
