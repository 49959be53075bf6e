"""The one packaging fact pyproject.toml cannot state: the repository's top-level ``configs/`` and
``tools/`` (where users and the docs look) ship inside the package as ``mmssl.configs`` and
``mmssl.tools``, so a plain ``pip install`` carries every recipe, model JSON and tool.
``[tool.setuptools.packages.find]`` finds only folders named as their package; a ``package_dir``
mapping needs the package list here, where ``find_packages`` keeps it complete as ``mmssl/`` grows.
Metadata and package data stay in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["mmssl", "mmssl.*"]), "mmssl.configs", "mmssl.tools"],
    package_dir={"mmssl.configs": "configs", "mmssl.tools": "tools"},
)
