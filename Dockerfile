# The metalboot manager image: one static binary on a distroless base, running as non-root.
# Both clusterctl providers (infrastructure, bootstrap) run this image; the Deployments select
# the controllers with --controllers.
#
#   docker build -t ghcr.io/metalboot/metalboot:v0.1.0 .

ARG RUST_VERSION=1.95
FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
# musl for a static binary; Debian's iPXE for the network boot programs TFTP serves; Debian's
# ipmitool (with the shared libraries it needs) for IPMI BMCs.
RUN rustup target add x86_64-unknown-linux-musl \
 && apt-get update \
 && apt-get install -y --no-install-recommends musl-tools ipxe ipmitool \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /out/ipmitool/lib \
 && cp /usr/bin/ipmitool /out/ipmitool/ \
 && ldd /usr/bin/ipmitool | awk '/=> \// { print $3 }' | xargs -I{} cp -L {} /out/ipmitool/lib/
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY ipxe ipxe
COPY benches benches
RUN cargo build --release --locked --target x86_64-unknown-linux-musl --bin metalboot \
 && install -D target/x86_64-unknown-linux-musl/release/metalboot /out/metalboot \
 && mkdir -p /out/ipxe \
 && cp /usr/lib/ipxe/undionly.kpxe /usr/lib/ipxe/ipxe.efi /usr/lib/ipxe/snponly.efi /out/ipxe/

# base (glibc) rather than static: ipmitool is a dynamically linked Debian binary.
FROM gcr.io/distroless/base-debian12:nonroot
COPY --from=build /out/metalboot /metalboot
COPY --from=build /out/ipmitool/ipmitool /usr/bin/ipmitool
COPY --from=build /out/ipmitool/lib/ /usr/local/lib/ipmitool/
ENV LD_LIBRARY_PATH=/usr/local/lib/ipmitool
# --tftp-root defaults to /usr/lib/ipxe.
COPY --from=build /out/ipxe/ /usr/lib/ipxe/
# 65532 is distroless' nonroot user (the bootstrap Deployment runs so); the infrastructure
# Deployment runs as root with only NET_BIND_SERVICE, because TFTP binds port 69 and Kubernetes
# gives non-root containers no ambient capabilities.
USER 65532:65532
ENTRYPOINT ["/metalboot"]
