"""The merge rules atoll ships, one file each. Every module here is imported, and each
registers its rule (`sums.register`): a new rule is one new file (and its test)."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.endswith("_test"):
        importlib.import_module(f"{__name__}.{_module.name}")
