"""pyproject.toml ships every Python package of the source tree (an installed wheel, unlike an
editable install, holds only the listed packages)."""
import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_every_package_folder_is_listed():
    cfg = _config()
    listed = set(cfg["packages"])
    found = set()
    for name, folder in cfg["package-dir"].items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
                found.add(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    assert found, "no packages found under package-dir"
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert listed - found == set(), f"listed packages without __init__.py: {sorted(listed - found)}"
