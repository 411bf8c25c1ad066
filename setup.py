# Metadata lives in pyproject.toml; this file keeps `python setup.py` and old
# tooling working, as the design card asks for a top-level setup.py. It lists
# the packages because the CUDA sources stay in the top-level kernels/ folder
# (the card fixes it) and ship inside the package as nccl_pg/_kernels, where
# nccl_pg/kernels.py looks for them first.
from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["nccl_pg", "nccl_pg.*"]), "nccl_pg._kernels"],
    package_dir={"nccl_pg._kernels": "kernels"},
)
