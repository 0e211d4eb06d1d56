# The commands a newcomer needs: `make train` (the main job: `graphsafe train` with its defaults), `make demo`
# (the embedding-backward demo table) and `make test` (the whole test suite). All install what they need first.
# `make bench` runs the side-by-side benchmarks.
#
# GRAPHSAFE_CUDA=AUTO|ON|OFF (environment or `make ... GRAPHSAFE_CUDA=OFF`): AUTO, the default, builds the CUDA
# backend when nvcc is found; OFF skips its compile (minutes on a small machine without a GPU, where it cannot run).
# It is passed on every build, so a build directory configured with OFF goes back to AUTO when the variable is unset.
PYTHON ?= python3
CPP_BUILD ?= build/cpp
GENERATOR := $(shell command -v ninja >/dev/null 2>&1 && echo "-G Ninja")
CMAKE_ARGS ?=
GRAPHSAFE_CUDA ?= AUTO
CUDA_NOTE = $(if $(filter OFF,$(GRAPHSAFE_CUDA)),CPU backend only (GRAPHSAFE_CUDA=OFF),with CUDA when nvcc is found; GRAPHSAFE_CUDA=OFF skips it)

.PHONY: install test test-cpp test-python train demo bench clean

# pip -v shows the build as it goes (CMake's configure lines, then ninja's [done/total] compile lines); without
# it pip shows a spinner for the whole build. scikit-build-core reads the CMake options from CMAKE_ARGS.
install:
	@echo "==> installing the requirements (requirements-dev.txt: torch 2.11 and the build/test tools; 1-2 min the first time)"
	$(PYTHON) -m pip install -r requirements-dev.txt
	@echo "==> building and installing graphsafe's C++/CUDA core ($(CUDA_NOTE)); about 3 min the first time on 2 cores, most of it the CUDA kernels; later builds reuse build/"
	CMAKE_ARGS="$(CMAKE_ARGS) -DGRAPHSAFE_CUDA=$(GRAPHSAFE_CUDA)" $(PYTHON) -m pip install -v --no-build-isolation --no-deps .

test: test-cpp test-python

test-cpp:
	@echo "==> building the C++ core and its GoogleTest suite in $(CPP_BUILD) ($(CUDA_NOTE))"
	cmake -S . -B $(CPP_BUILD) $(GENERATOR) -DGRAPHSAFE_BUILD_TESTS=ON -DGRAPHSAFE_CUDA=$(GRAPHSAFE_CUDA) $(CMAKE_ARGS)
	cmake --build $(CPP_BUILD)
	@echo "==> running the C++ tests"
	ctest --test-dir $(CPP_BUILD) --output-on-failure

test-python: install
	@echo "==> running the Python tests (CUDA tests skip without a GPU; the summary says why)"
	$(PYTHON) -m pytest -q tests/python

train: install
	@echo "==> graphsafe train"
	$(PYTHON) -m graphsafe train

demo: install
	@echo "==> graphsafe demo"
	$(PYTHON) -m graphsafe demo

bench: install
	@echo "==> graphsafe bench"
	$(PYTHON) -m graphsafe bench

clean:
	rm -rf build
