"""The package list, with the top-level export recipes shipped inside the package.

``export/*.toml`` (the recipes, kept at the top of the repository) are installed as
``ortbatch/recipes/*.toml``, where :func:`ortbatch.export.recipes.bundled_recipe` finds
them in an installed package. Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["ortbatch*"]), "ortbatch.recipes"],
    package_dir={"ortbatch.recipes": "export"},
    package_data={"ortbatch": ["py.typed"], "ortbatch.recipes": ["*.toml"]},
)
