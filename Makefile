install:
	bash scripts/install_cpu.sh

test:
	bash scripts/test.sh

docs:
	NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict --site-dir site

lint:
	.venv/bin/ruff check verl_stable tests benchmarks

.PHONY: install test docs lint
