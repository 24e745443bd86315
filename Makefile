install:
	bash scripts/install_cpu.sh

test:
	bash scripts/test.sh

lint:
	.venv/bin/ruff check verl_stable tests benchmarks

.PHONY: install test lint
