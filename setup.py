# Metadata lives in pyproject.toml; this file keeps `python setup.py` and old
# tooling working, as the design card asks for a top-level setup.py.
from setuptools import setup

setup()
