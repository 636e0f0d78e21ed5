# make test / make demo create or refresh .venv themselves; a second run reinstalls nothing
# unless pyproject.toml changed (the stamp file tracks it).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch is pinned only here, in the set-up step (2.13.0: the version the documented CPU results
# were measured with). The library itself asks for a range (pyproject.toml).
TORCH_PIN := torch==2.13.0
# data: the fsd command's own data directory ($FSD_DATA_DIR, else ~/.cache/fsd/data), where
# MNIST is downloaded on first use; `make demo FSD_DATA_DIR=D` picks another folder and
# FSD_NO_DOWNLOAD=1 forbids the download (the error then names the command to run)
DATA_OPTION := $(if $(FSD_DATA_DIR),--data-dir "$(FSD_DATA_DIR)")

.PHONY: setup test lint docs demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	# the pin again: the extras (Lightning, transformers, accelerate) may not move torch
	$(PY) -m pip install --quiet -e ".[test,lint,docs]" "$(TORCH_PIN)"
	# BackPACK cross-checks fsd.KFAC in tests/test_kfac.py; its own requirements pull a CUDA
	# torch and torchvision, so it comes without them (it runs beside the pinned CPU wheel)
	$(PY) -m pip install --quiet --no-deps backpack-for-pytorch==1.7.1 einops unfoldNd
	touch $(STAMP)

# the suite in parallel: one pytest worker per core (TEST_WORKERS=0: one process), each with
# one torch thread (tests/conftest.py), tests handed to whichever worker is free
TEST_WORKERS ?= auto
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal

# ruff (pyflakes, import order, bugbear, docstrings of public names) and pyright on the sources
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/pyright src

# API reference from the docstrings (docs/api/, not committed); warnings fail the build.
# fsd's __all__ hides its submodules from pdoc, so each is named: the modules at the top
# (src/fsd/*.py) and the sub-packages, whose own modules pdoc then walks.
FSD_MODULES := $(sort $(subst /,.,$(patsubst src/%.py,%,$(filter-out src/fsd/__init__.py,\
	$(wildcard src/fsd/*.py))) $(patsubst src/%/__init__.py,%,$(wildcard src/fsd/*/__init__.py))))
docs: $(STAMP)
	$(PY) -W error -m pdoc --docformat google -o docs/api fsd $(FSD_MODULES)

# Split MNIST, fine-tuning vs the recommended penalty (BGLN-D with the corrected recursion, its
# defaults: the paper's λ, each task's head, rank-64 covariance), one seed, 2 epochs per task,
# one thread each; then one table and one figure of both (docs/continual-learning.md, "make demo").
DEMO_OUT := runs/demo
DEMO_RUN := $(VENV)/bin/fsd cl --benchmark split-mnist --seeds 20 --epochs 2 --threads 1 \
	--no-progress $(DATA_OPTION)
demo: $(STAMP)
	$(DEMO_RUN) --method finetune --out $(DEMO_OUT)/finetune > /dev/null
	$(DEMO_RUN) --method bgln-d-corrected --out $(DEMO_OUT)/bgln-d-corrected > /dev/null
	$(VENV)/bin/fsd cl report $(DEMO_OUT)/finetune $(DEMO_OUT)/bgln-d-corrected \
		--plot $(DEMO_OUT)/comparison.png

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
