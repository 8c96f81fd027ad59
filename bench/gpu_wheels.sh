#!/usr/bin/env bash
# DeepSpeed for the GPU machine, as wheels: that machine reaches no package registry, so what
# bench/deepspeed_peer.py needs beyond its image travels in .whl/ (ignored by git, carried by the
# device tool). Run here, where PyPI is reachable:
#
#   bash bench/gpu_wheels.sh [--python-version 3.12] [--dest .whl] [--build-python PYTHON]
#
# - deepspeed: PyPI has only its sdist; it is built here into a pure-Python wheel with every op
#   left to JIT-compile on first use (DS_BUILD_OPS=0), so one wheel serves any Python 3 and any
#   torch. Its setup.py imports torch, so the build needs a Python with torch, setuptools and pip
#   (--build-python, default $BUILD_PYTHON or python3).
# - its dependencies that the GPU machine's image lacks (KINDS.md, "Python packages already there":
#   ninja, psutil, py-cpuinfo, msgpack, einops, packaging, numpy, tqdm, nvidia-ml-py and torch are
#   there): hjson, pydantic with pydantic-core, annotated-types and typing-inspection, and
#   typing-extensions (pydantic 2.14 needs >= 4.16, newer than an image may hold), as binary
#   wheels for the target CPython on manylinux x86_64. One version of each: two stop the install.
#
# On the GPU machine, in the repository root (the device tool's `carry` names .whl):
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# DeepSpeedCPUAdam is then compiled there on first use (ninja and g++ are in the image); where it
# does not build, bench/deepspeed_peer.py falls back to torch.optim.Adam and records why.
set -euo pipefail

DEEPSPEED_VERSION=0.19.8  # supports torch >= 2.0
# name==version of each dependency carried (pydantic 2.14.4 pins pydantic-core 2.50.5)
DEPS=(hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
      typing-extensions==4.16.0)
MAX_MIB=48  # the whole working tree that travels is limited to 64 MiB

PY_VERSION=3.12
DEST=.whl
BUILD_PY=${BUILD_PYTHON:-python3}
while [ $# -gt 0 ]; do
  case $1 in
    --python-version) PY_VERSION=$2; shift 2 ;;
    --dest) DEST=$2; shift 2 ;;
    --build-python) BUILD_PY=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_wheels.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

if ! "$BUILD_PY" -c "import torch, setuptools" 2>/dev/null; then
  echo "gpu_wheels.sh: $BUILD_PY cannot import torch and setuptools; DeepSpeed's setup.py needs both:" \
       "pass --build-python with a Python that has them (e.g. a venv with torch installed)" >&2
  exit 2
fi

mkdir -p "$DEST"
# One version of each: drop what an earlier run left of these packages.
for spec in "deepspeed==$DEEPSPEED_VERSION" "${DEPS[@]}"; do
  name=${spec%%==*}
  rm -f "$DEST/${name//-/_}"-*.whl "$DEST/$name"-*.whl
done

build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
echo "building deepspeed $DEEPSPEED_VERSION (ops left to JIT) with $BUILD_PY"
DS_BUILD_OPS=0 "$BUILD_PY" -m pip wheel -q --no-deps --no-build-isolation --no-binary deepspeed \
  -w "$build" "deepspeed==$DEEPSPEED_VERSION" >"$build/build.log" 2>&1 || { tail -30 "$build/build.log"; exit 1; }
wheel=$(ls "$build"/deepspeed-*.whl)
case $wheel in
  *-py3-none-any.whl) ;;
  *) echo "gpu_wheels.sh: expected a pure-Python deepspeed wheel, got $(basename "$wheel")" >&2; exit 1 ;;
esac
cp "$wheel" "$DEST/"

abi=cp${PY_VERSION//./}
echo "downloading ${DEPS[*]} for CPython $PY_VERSION, manylinux x86_64"
"$BUILD_PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --abi "$abi" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$DEST" "${DEPS[@]}"

echo
echo "wheels in $DEST:"
ls -s --block-size=K -1 "$DEST"/*.whl | sed 's/^/  /'
kib=$(du -ck "$DEST"/*.whl | tail -1 | cut -f1)
echo "total: $((kib / 1024)).$(( (kib % 1024) * 10 / 1024 )) MiB (${kib} KiB)"
if [ "$kib" -gt $((MAX_MIB * 1024)) ]; then
  echo "gpu_wheels.sh: over ${MAX_MIB} MiB: the device tool carries at most 64 MiB with the working tree" >&2
  exit 1
fi
echo
echo "on the GPU machine (carry $DEST), in the repository root:"
echo "  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $DEST/*.whl && export PYTHONPATH=/tmp/site"
