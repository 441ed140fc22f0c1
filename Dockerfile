# Tandem on a CUDA runtime base. Build:  docker build -t tandem:latest .
# Run:    docker run --gpus all -p 8000:8000 tandem:latest serve --host 0.0.0.0 --device cuda \
#           --model /models/model      (with -v /path/to/checkpoint:/models/model:ro)
# The kernels are compiled for sm_90a (Hopper); the embedded demo model is installed next to
# the binary (/opt/tandem/share/tandem/demo), so `tandem serve` alone serves it on the CPU.
ARG CUDA_VERSION=12.6.3
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS build
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends \
      cmake ninja-build g++ pkg-config git python3 libgtest-dev libgmock-dev libbenchmark-dev \
      libboost-dev nlohmann-json3-dev libpcre2-dev libutf8proc-dev libspdlog-dev libfmt-dev \
      libcli11-dev libgloo-dev libcurl4-openssl-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_TESTS=OFF \
      -DTANDEM_BENCH=OFF && ninja -C build tandem && make install-files PREFIX=/opt/tandem \
      BUILD_DIR=build
# The shared libraries tandem needs beyond the runtime image (not libc, not the CUDA driver).
RUN mkdir -p /opt/tandem/lib && ldd /opt/tandem/bin/tandem | awk '/=> \// {print $3}' | \
      grep -Ev '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*|libcuda)\.so' | \
      xargs -r -I{} cp -L {} /opt/tandem/lib/

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04
COPY --from=build /opt/tandem /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH LD_LIBRARY_PATH=/opt/tandem/lib
RUN useradd --system --uid 10001 tandem
USER tandem
EXPOSE 8000
ENTRYPOINT ["tandem"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
