"""The public API is listed once and documented as it is: docs/api.md names exactly
``lightning_elastic.__all__``, type checkers see every name, every name resolves, every error
and warning class lives in ``errors.py``, and names that left the API still work, with a
warning."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

import lightning_elastic
from lightning_elastic import errors

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_elastic"
API_DOC = ROOT / "docs" / "api.md"

# exception classes outside errors.py that are not the library's errors, and why
NOT_LIBRARY_ERRORS = {
    # the command line's "print one line and exit with this code", never raised to a caller
    "CliError",
    # the test helpers' failure of a worker process: an AssertionError, for pytest to report
    "WorkerFailure",
    "WorkerTimeout",
}


def documented_names() -> list[str]:
    """The first column of every table in docs/api.md: one backticked name per row."""
    return re.findall(r"^\| `([A-Za-z_][A-Za-z0-9_]*)` \|", API_DOC.read_text(), re.MULTILINE)


def test_the_api_page_lists_exactly_the_public_names_once() -> None:
    names = documented_names()
    repeated = sorted({n for n in names if names.count(n) > 1})
    assert not repeated, f"docs/api.md lists these twice: {repeated}"
    assert sorted(names) == sorted(lightning_elastic.__all__), (
        f"only in docs/api.md: {sorted(set(names) - set(lightning_elastic.__all__))}; "
        f"only in __all__: {sorted(set(lightning_elastic.__all__) - set(names))}"
    )


def test_type_checkers_see_every_public_name() -> None:
    """The ``TYPE_CHECKING`` imports of ``__init__.py`` are the same names as ``_EXPORTS``
    (the errors through ``errors.__all__``): a name missing there is ``Any`` to mypy."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    guarded = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    )
    imported: set[str] = set()
    for node in guarded.body:
        assert isinstance(node, ast.ImportFrom)
        for alias in node.names:
            if alias.name == "*":
                assert node.module == "lightning_elastic.errors"
                imported |= set(errors.__all__)
            else:
                imported.add(alias.asname or alias.name)
                assert lightning_elastic._EXPORTS[alias.name] == node.module, alias.name
    assert imported == set(lightning_elastic._EXPORTS)


def test_every_public_name_resolves_to_where_it_is_defined() -> None:
    for name in lightning_elastic.__all__:
        value = getattr(lightning_elastic, name)
        if name != "__version__" and hasattr(value, "__module__"):
            assert value.__module__ == lightning_elastic._EXPORTS[name], name
    assert dir(lightning_elastic) == lightning_elastic.__all__


def _exception_classes(path: Path) -> list[str]:
    """Classes in ``path`` whose base looks like an exception or a warning (by name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = [
            b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases
        ]
        if any(b.endswith(("Error", "Exception", "Warning", "Failure")) for b in bases):
            found.append(node.name)
    return found


def test_every_error_and_warning_class_lives_in_errors_py() -> None:
    """A module's own private control-flow exceptions (a leading underscore, never raised out
    of it) may stay with it; everything else a caller could catch is in errors.py."""
    elsewhere = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in PACKAGE.rglob("*.py")
        if path != PACKAGE / "errors.py"
        for name in _exception_classes(path)
        if not name.startswith("_") and name not in NOT_LIBRARY_ERRORS
    }
    assert not elsewhere, f"move these to lightning_elastic/errors.py: {sorted(elsewhere)}"
    assert "CorruptWhileLoading" in _exception_classes(PACKAGE / "errors.py")  # the test sees


def test_every_public_error_and_warning_is_a_top_level_name() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, (errors.ElasticCheckpointError, Warning)), name
        assert getattr(lightning_elastic, name) is cls


def test_the_old_homes_of_moved_errors_still_export_them() -> None:
    from lightning_elastic.core.load.load import CorruptWhileLoading
    from lightning_elastic.core.load.safe import UnsafeObjectError
    from lightning_elastic.core.tiers.transfer import TransferError, TransferIntegrityError
    from lightning_elastic.lightning.fork_safety import ForkingWorkersWarning

    assert CorruptWhileLoading is errors.CorruptWhileLoading
    assert UnsafeObjectError is errors.UnsafeObjectError
    assert TransferError is errors.TransferError
    assert TransferIntegrityError is errors.TransferIntegrityError
    assert ForkingWorkersWarning is errors.ForkingWorkersWarning


def test_read_jsonl_left_the_api_but_still_works_with_a_deprecation_warning() -> None:
    assert "read_jsonl" not in lightning_elastic.__all__
    with pytest.warns(DeprecationWarning, match="read_jsonl is deprecated"):
        reader = lightning_elastic.read_jsonl
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        import io

        assert list(reader(io.BytesIO(b'{"a": 1}\n{"a": 2}\n'), 1, 2)) == [{"a": 2}]
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = lightning_elastic.no_such_name  # type: ignore[attr-defined]


# modules a user may import besides the top level: the errors, the test helpers, and the
# Lightning adapters for their side effect (docs/resuming.md: load_from_checkpoint in a bare
# process)
PUBLIC_MODULES = (
    "lightning_elastic.errors",
    "lightning_elastic.testing",
    "lightning_elastic.lightning",
)
IMPORT = re.compile(
    r"^\s*(?:from\s+(lightning_elastic[\w.]*)\s+import|import\s+(lightning_elastic[\w.]*))", re.M
)


def test_the_docs_and_examples_import_only_public_modules() -> None:
    """What the documentation teaches stays inside the boundary (docs/architecture.md)."""
    sources = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.py")]
    internal = sorted(
        f"{path.relative_to(ROOT)}: {module}"
        for path in sources
        for match in IMPORT.finditer(path.read_text())
        if (module := match[1] or match[2]) != "lightning_elastic"
        and not any(module == m or module.startswith(m + ".") for m in PUBLIC_MODULES)
    )
    assert not internal, f"import these from lightning_elastic instead: {internal}"
