#!/usr/bin/env bash
# Install Intel oneCCL 2022.2.0 (CPU) into a Python virtualenv, for
# src/mcrdl/backends/ccl_lib.py (the `ccl` backend).
#
#   scripts/install_oneccl.sh VENV
#
# What it does (idempotent; writes nothing outside VENV):
#   1. pip install --no-deps oneccl-cpu==2022.2.0 oneccl-cpu-devel==2022.2.0
#      (--no-deps: oneccl-cpu requires libfabric>=2.6, which no registry has;
#      the binding uses the libfabric 2.5.1 bundled in the `mpich` wheel).
#      The wheels put libccl.so.1 in VENV/lib and oneapi/ccl.h in VENV/include.
#   2. pip download --no-deps oneccl==2022.2.0 (92 MB) into a temporary folder
#      inside VENV, copy only lib/libccl.so.2 (the C API, onecclAllReduce, ...)
#      and lib/libccl_legacy_cpu.so (its CPU plugin) into VENV/lib, checking
#      them against the wheel's RECORD hashes, then delete the download.
#   3. dlopen libfabric (mpich wheel) + libccl.so.2 + the plugin as a check.
# The binaries are Intel's, unmodified (Intel Simplified Software License).
# Needs only the venv's python and pip, and access to PyPI.
set -euo pipefail

VERSION=2022.2.0
if [ $# -ne 1 ]; then
    echo "usage: $0 VENV" >&2
    exit 2
fi
VENV=$(cd "$1" && pwd)
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "install_oneccl: $PY not found (not a virtualenv?)" >&2; exit 2; }
LIB="$VENV/lib"

# Keep pip's cache, temp files and self-check inside VENV (or off).
TMP="$VENV/.oneccl-install-tmp"
export TMPDIR="$TMP" PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
cleanup() { rm -rf "$TMP"; }
trap cleanup EXIT

installed() {  # exit 0 if the named distribution is installed at VERSION
    "$PY" - "$1" "$VERSION" <<'EOF'
import sys
from importlib import metadata
try:
    sys.exit(0 if metadata.version(sys.argv[1]) == sys.argv[2] else 1)
except metadata.PackageNotFoundError:
    sys.exit(1)
EOF
}

check() {  # dlopen everything the binding will; print the oneCCL version
    "$PY" - "$VENV" <<'EOF'
import ctypes, glob, os, sys
venv = sys.argv[1]
fab = (glob.glob(os.path.join(venv, "lib", "mpich", "libfabric.so.1"))
       + glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "mpich*", "**",
                                "libfabric.so.1"), recursive=True))
if not fab:
    sys.exit("install_oneccl: libfabric.so.1 from the `mpich` wheel not found in "
             f"{venv}; oneCCL needs it: {venv}/bin/pip install mpich")
ctypes.CDLL(fab[0], mode=ctypes.RTLD_GLOBAL)
lib = os.path.join(venv, "lib")
ctypes.CDLL(os.path.join(lib, "libccl.so.1"), mode=ctypes.RTLD_GLOBAL)
ccl = ctypes.CDLL(os.path.join(lib, "libccl.so.2"), mode=ctypes.RTLD_GLOBAL)
ctypes.CDLL(os.path.join(lib, "libccl_legacy_cpu.so"), mode=ctypes.RTLD_GLOBAL)
v = ctypes.c_int()
if ccl.onecclGetVersion(ctypes.byref(v)) != 0:
    sys.exit("install_oneccl: onecclGetVersion failed")
print(v.value)
EOF
}

if installed oneccl-cpu && installed oneccl-cpu-devel \
   && [ -f "$LIB/libccl.so.1" ] && [ -f "$LIB/libccl.so.2" ] && [ -f "$LIB/libccl_legacy_cpu.so" ]; then
    ver=$(check)
    echo "oneCCL $VERSION already installed in $VENV (onecclGetVersion=$ver)"
    exit 0
fi

mkdir -p "$TMP"
if ! installed oneccl-cpu || ! installed oneccl-cpu-devel || [ ! -f "$LIB/libccl.so.1" ]; then
    "$PY" -m pip install -q --no-deps --only-binary=:all: --force-reinstall \
        "oneccl-cpu==$VERSION" "oneccl-cpu-devel==$VERSION" >&2
fi

"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$TMP/dl" "oneccl==$VERSION" >&2
"$PY" - "$TMP/dl" "$LIB" "$VERSION" <<'EOF'
import base64, glob, hashlib, os, sys, zipfile
dl, lib, version = sys.argv[1:]
(whl,) = glob.glob(os.path.join(dl, f"oneccl-{version}-*.whl"))
want = ["libccl.so.2", "libccl_legacy_cpu.so"]
with zipfile.ZipFile(whl) as z:
    record = z.read(f"oneccl-{version}.dist-info/RECORD").decode().splitlines()
    hashes = {row.split(",")[0]: row.split(",")[1] for row in record if row.count(",") >= 2}
    for name in want:
        member = f"oneccl-{version}.data/data/lib/{name}"
        data = z.read(member)
        digest = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        if hashes.get(member) != digest:
            sys.exit(f"install_oneccl: {member}: hash mismatch with RECORD")
        tmp = os.path.join(lib, f".{name}.part")
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, os.path.join(lib, name))
EOF
rm -rf "$TMP/dl"

ver=$(check)
echo "oneCCL $VERSION installed in $VENV (onecclGetVersion=$ver; libs in $LIB)"
