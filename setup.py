"""Package discovery for setuptools (everything else is in pyproject.toml).

Every package folder under ``aniso_plugins/`` is found, and every one under ``integrations/``,
which installs as ``aniso_plugins.integrations`` (``[tool.setuptools.package-dir]``): a new
folder needs no entry anywhere. ``tests/test_packaging.py`` checks the built wheel against the tree.
"""

from setuptools import find_packages, setup

ADAPTERS = "aniso_plugins.integrations"

setup(
    packages=[
        *find_packages(include=["aniso_plugins", "aniso_plugins.*"]),
        ADAPTERS,
        *(f"{ADAPTERS}.{name}" for name in find_packages("integrations")),
    ]
)
