"""Imported before MONAI by the scripts the tests start many times (ranks, tasks, nodes): MONAI as a plain
``pip install monai`` gives it, with torch and numpy only.

``import monai`` imports every subpackage, and they import the optional packages they find (ignite for its enums,
scipy, matplotlib, tensorboard, requests): 2 of the 4.5 s of CPU an interpreter spends importing MONAI here, where the
test extras installed them all. None of these scripts uses them, and MONAI without them is a configuration it
supports (its ``optional_import`` sees them missing). Hiding them halves what each started process costs the suite,
which starts dozens (tests/test_slurm_cache.py alone 26 tasks). The scripts that stand for a user's own job under
the switch (segresnet_train.py, the notebook, the bundles, the documented examples) import what is installed.
"""

import sys

OPTIONAL = ("ignite", "scipy", "matplotlib", "tensorboard", "requests")

for _name in OPTIONAL:
    if _name not in sys.modules:
        sys.modules[_name] = None  # type: ignore[assignment]  # `import name` raises ModuleNotFoundError
