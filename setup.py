"""Packaging for modelzoo + trainers (import names: ``modelzoo``, ``trainers``)."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

setup(
    name="modelzoo-trainers-pt",
    version="0.1.0",
    description=(
        "Pretrained ResNeSt, BERT and GNN models with one shared distributed trainer "
        "(LAMB/LANS, Adasum, elastic) on PyTorch"
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["modelzoo", "modelzoo.*", "trainers", "trainers.*"]),
    include_package_data=True,
    package_data={"modelzoo": ["py.typed"], "trainers": ["py.typed"]},
    install_requires=[
        "torch>=2.4",
        "numpy>=1.24",
        "safetensors>=0.4",
        "filelock>=3.12",
        "tqdm>=4.66",
        "Pillow>=10.0",
    ],
    extras_require={
        # scikit-learn: the built-in handwritten-digits data of the example runs.
        "examples": ["scikit-learn>=1.3"],
        "test": [
            "pytest>=8",
            "scikit-learn>=1.3",
            "matplotlib>=3.7",
        ],
        "dev": [
            "ruff>=0.6",
            "pytest>=8",
            "scikit-learn>=1.3",
            "matplotlib>=3.7",
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
