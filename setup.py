"""verl-stable: stable RL for (MoE) LLMs as a verl 0.9.1 plugin."""

from setuptools import find_packages, setup

setup(
    name="verl-stable",
    version="0.1.0",
    description=(
        "MiniRL / VESPO losses, routing replay (R2/R3) for HF MoE models in verl's FSDP engine, "
        "stability monitoring, and a CPU runtime for verl 0.9.1"
    ),
    python_requires=">=3.10",
    packages=find_packages(include=["verl_stable", "verl_stable.*"]),
    package_data={"verl_stable": ["recipes/*.yaml", "py.typed"]},
    # torch is deliberately not listed: install the right build (CPU or CUDA) first, see README.
    install_requires=["verl==0.9.1", "pydantic>=2.7,<3"],  # pydantic: the typed config schema (verl_stable.schema)
    extras_require={
        "cpu": ["transformers>=5.9,<5.11", "tokenizers", "matplotlib", "tqdm", "filelock"],
        "test": ["pytest", "pytest-asyncio", "hypothesis"],
    },
    entry_points={
        # `import verl` loads every entry point of this group in the driver, the task runner and every Ray worker.
        "verl.plugins": ["verl_stable = verl_stable.integration.plugin"],
        "console_scripts": ["verl-stable = verl_stable.cli:main"],
    },
)
