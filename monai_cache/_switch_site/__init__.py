"""The directory ``monai-cache run`` puts on ``PYTHONPATH``: its ``sitecustomize.py`` turns the switch on in every
Python process of the tree where ``monai_cache_switch.pth`` (installed with the package) has not already
(:mod:`monai_cache.switch`)."""
