"""Runs a script with ``monai.data.CacheDataset`` being monai_cache's: ``python use_monai_cache.py script.py ARGS``.

A stand-in, for the tests, until ``monai-cache run --`` does this for a whole process tree (issue 25): the test that
uses it selects monai_cache in this one place.
"""

import runpy
import sys

import monai.data
import monai.data.dataset

import monai_cache

monai.data.CacheDataset = monai.data.dataset.CacheDataset = monai_cache.CacheDataset
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
