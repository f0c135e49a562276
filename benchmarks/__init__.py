"""monai_cache's benchmarks: ``python -m benchmarks <suite>`` (see ``__main__.py``). Beside the package, not in it."""
