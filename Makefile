# metalboot — the commands a newcomer runs. Each target installs what it needs first.
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

.PHONY: all deps os-image deploy-ramdisk control-plane capi sushy replay test soak lab lab-kubeadm lab-down crds deploy lint fmt bench bench-scale release-pgo

all: test

## deps: Debian packages (only the missing ones)
deps:
	@hack/install-deps.sh

## control-plane: build kube-apiserver, etcd and kubectl from source (cached in target/control-plane)
control-plane:
	@hack/control-plane/build.sh

## sushy: the Redfish emulator sushy-tools in a project venv (target/tools/sushy)
sushy: deps
	@hack/sushy-tools.sh

## replay: real-vendor Redfish replies (Dell iDRAC, HPE iLO, …) for the replay suite (target/tools/replay)
replay:
	@hack/redfish-replay.sh

## os-image: the lab's installed OS, a Debian disk image with the real cloud-init (target/lab/os)
os-image: deps control-plane
	@hack/os-image/build.sh

## deploy-ramdisk: kernel + busybox initramfs running `metalboot agent` (target/lab/deploy)
deploy-ramdisk: deps
	@hack/deploy-ramdisk/build.sh

## test: the whole suite against a real control plane and a real Redfish emulator
test: deps control-plane capi sushy replay os-image deploy-ramdisk
	@CARGO=$(CARGO) hack/test.sh

## soak: SIGKILL the manager at random points while five hosts provision (CYCLES=50 for a long run)
CYCLES ?= 50
soak: deps control-plane sushy
	METALBOOT_SOAK_CYCLES=$(CYCLES) $(CARGO) test --test soak -- --nocapture

## lab: start the local lab and leave it running (`make lab-down` stops it). Upstream Cluster API
## core runs the Machines (installed by clusterctl); `make lab LAB_ARGS=--standalone` uses
## metalboot's own controllers instead.
LAB_ARGS ?=
lab: deps control-plane capi
	$(CARGO) run --quiet -- lab up $(LAB_ARGS)

## lab-kubeadm: the lab with kubeadm workers (`metalboot lab up --kubeadm`): upstream core and
## its kubeadm bootstrap provider render the Machines, which join the lab's apiserver with the
## real kubeadm, kubelet and containerd on the lab's Debian.
lab-kubeadm: deps control-plane capi
	$(CARGO) run --quiet -- lab up --kubeadm $(LAB_ARGS)

lab-down:
	$(CARGO) run --quiet -- lab down

## bench: boot-storm benchmark against nginx (not part of make test)
bench:
	hack/bench-boot.sh

## bench-scale: N = 100, 1000, 10000 simulated hosts and Machines on one manager (SCALE_N=… to choose)
bench-scale:
	hack/bench-scale.sh

## release-pgo: a profile-guided release build trained on the scale benchmark (target/pgo/metalboot);
## METALBOOT_BIN=target/pgo/metalboot make bench-scale measures it
release-pgo:
	hack/pgo-build.sh

## crds: regenerate crds/ from the Rust types
crds:
	$(CARGO) run --quiet -- crds --out-dir crds

## deploy: regenerate the clusterctl components from deploy/infrastructure and deploy/bootstrap
deploy: crds control-plane
	hack/render-components.sh infrastructure > deploy/infrastructure-components.yaml
	hack/render-components.sh bootstrap > deploy/bootstrap-components.yaml

## capi: build upstream Cluster API (core, kubeadm bootstrap, clusterctl) from the Go module proxy
capi: control-plane
	@hack/capi/build.sh

lint:
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets -- -D warnings

fmt:
	$(CARGO) fmt
