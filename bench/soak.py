"""Soak benchmark: one pipeline with ``enable_cache`` serving a seeded stream of mixed requests, each output checked
against the same request run alone in a fresh process; resident memory, lowered graphs and latency per request.
The code is :mod:`dit_passes.soak` (also ``dit-passes soak``); this script runs it.

    python -P bench/soak.py --threads 1                                  # CPU, digits DiT: bench/results/soak_cpu.*
    python -P bench/soak.py --quick                                      # a 24-request smoke run of the same path
    python -P bench/soak.py --device cuda --model flux-dev-size          # GPU: bench/results/soak_gpu.*
"""
import sys

from dit_passes.soak import main

if __name__ == "__main__":
    sys.exit(main())
