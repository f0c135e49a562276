"""The directory ``monai-cache run`` puts on ``PYTHONPATH``: its ``sitecustomize.py`` turns the switch on in every
Python process of the tree (:mod:`monai_cache.switch`)."""
