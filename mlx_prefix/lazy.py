"""A package's `__init__` that names what the package offers without importing it.

The engine's sub-packages import each other's modules; re-exporting names eagerly from
their `__init__` would tie those imports into cycles and make a light import (the
server's `engine.keys`) load the whole engine. `exports` gives the package a module
`__getattr__` (PEP 562) that imports a name's module the first time it is asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """`__getattr__` for `package`: each of `names` (name -> its module, relative to
    the package) imported on first use."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{names[name]}"), name)

    return __getattr__
