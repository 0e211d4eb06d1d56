# The commands a newcomer needs: `make train` (the main job: `graphsafe train` with its defaults), `make demo`
# (the embedding-backward demo table) and `make test` (the whole test suite). All install what they need first.
# `make bench` runs the side-by-side benchmarks.
PYTHON ?= python3
CPP_BUILD ?= build/cpp
GENERATOR := $(shell command -v ninja >/dev/null 2>&1 && echo "-G Ninja")
CMAKE_ARGS ?=

.PHONY: install test test-cpp test-python train demo bench clean

install:
	$(PYTHON) -m pip install -q -r requirements-dev.txt
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps .

test: test-cpp test-python

test-cpp:
	cmake -S . -B $(CPP_BUILD) $(GENERATOR) -DGRAPHSAFE_BUILD_TESTS=ON $(CMAKE_ARGS)
	cmake --build $(CPP_BUILD)
	ctest --test-dir $(CPP_BUILD) --output-on-failure

test-python: install
	$(PYTHON) -m pytest -q tests/python

train: install
	$(PYTHON) -m graphsafe train

demo: install
	$(PYTHON) -m graphsafe demo

bench: install
	$(PYTHON) -m graphsafe bench

clean:
	rm -rf build
