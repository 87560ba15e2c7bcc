"""Every public function, class, method and property of the public modules has a docstring."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import lightning_elastic


def public_modules() -> list[ModuleType]:
    """The package and its modules whose dotted names have no ``_``-prefixed part
    (``lightning_elastic.testing`` included)."""
    modules: list[ModuleType] = [lightning_elastic]
    for info in pkgutil.walk_packages(lightning_elastic.__path__, "lightning_elastic."):
        if not any(part.startswith("_") for part in info.name.split(".")[1:]):
            modules.append(importlib.import_module(info.name))
    return modules


def _own_class_doc(cls: type) -> str | None:
    """The docstring written in ``cls`` itself: neither a base class's nor the signature a
    dataclass puts in place of a missing one."""
    doc = vars(cls).get("__doc__")
    if not isinstance(doc, str) or doc.startswith(f"{cls.__name__}("):
        return None
    return inspect.cleandoc(doc) or None


def _property_doc(cls: type, name: str, prop: property) -> str | None:
    """The property's docstring, or that of the property it overrides in a base class."""
    if prop.__doc__:
        return prop.__doc__
    for base in cls.__mro__[1:]:
        inherited = vars(base).get(name)
        if isinstance(inherited, property) and inherited.__doc__:
            return inherited.__doc__
    return None


def _undocumented_members(cls: type, qualname: str) -> list[str]:
    """Public methods and properties defined in ``cls`` without a docstring; a method that
    overrides a documented base-class method counts as documented (``inspect.getdoc``)."""
    missing = []
    for name, value in vars(cls).items():
        if name.startswith("_") or inspect.isclass(value):
            continue
        if isinstance(value, property):
            doc = _property_doc(cls, name, value)
        elif callable(getattr(value, "__func__", value)):
            doc = inspect.getdoc(getattr(cls, name))
        else:
            continue  # a plain class attribute
        if not doc:
            missing.append(f"{qualname}.{name}")
    return missing


def undocumented() -> list[str]:
    """Dotted names of the public functions, classes, methods and properties that have no
    docstring, among the objects each public module defines itself (not its imports)."""
    missing = []
    for module in public_modules():
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            qualname = f"{module.__name__}.{name}"
            if inspect.isfunction(obj):
                if not inspect.getdoc(obj):
                    missing.append(qualname)
            elif inspect.isclass(obj):
                if not _own_class_doc(obj):
                    missing.append(qualname)
                missing.extend(_undocumented_members(obj, qualname))
    return missing


def test_every_public_object_has_a_docstring() -> None:
    missing = undocumented()
    assert not missing, f"{len(missing)} public objects without a docstring:\n" + "\n".join(missing)
