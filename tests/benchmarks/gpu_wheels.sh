#!/usr/bin/env bash
# Wheels for tests/benchmarks/gpu_check.sh: the Python packages runnel needs that the lent GPU machine
# lacks (it has Python 3.12, torch with CUDA, numpy, msgpack, pytest, cloudpickle, psutil, pyyaml, requests,
# aiohttp..., but no Ray, gymnasium, pyzmq or lz4, and it cannot download anything). Run it here, from the
# repository root, before handing the tree to the GPU machine:
#
#     bash tests/benchmarks/gpu_wheels.sh            # fills .whl/ (git-ignored through .git/info/exclude)
#
# then run the check there with `.whl` carried (see gpu_check.sh). The versions are this checkout's
# .venv's (what the suite ran with), as cp312 manylinux x86-64 wheels. Ray's wheel (76 MiB) would not fit
# the 64 MiB the tree may weigh: its ray/jars/ folder (31 MiB of Java support, which Python never loads) is
# left out of the copy made here, and the wheel's RECORD is rewritten to match; everything else is Ray's own.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

# the packages gpu_check.sh needs beyond the machine's (Ray's own needs included: jsonschema and its
# parts; ray.tune's pydantic and its parts; gymnasium's farama-notifications; tensorboardX for the results;
# typing-extensions and packaging newer than the machine's may be, for pydantic and Ray; ale-py for the Pong run)
PKGS="ray gymnasium farama-notifications pyzmq lz4 jsonschema jsonschema-specifications referencing rpds-py
      pydantic pydantic-core annotated-types typing-inspection typing-extensions packaging tensorboardX ale-py"
pins=$("$PY" - $PKGS <<'EOF'
import sys
from importlib import metadata
out = []
for name in sys.argv[1:]:
    try:
        out.append(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        sys.exit(f"gpu_wheels.sh: {name} is not installed in this checkout's environment: run make setup first")
print(" ".join(out))
EOF
)
echo "gpu_wheels.sh: $pins"

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
rm -rf .whl && mkdir .whl

platforms=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 5 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl $pins

"$PY" - <<'EOF'
"""Ray's wheel without ray/jars/: a copy with those members and their RECORD lines left out."""
import glob
import os
import zipfile

[path] = glob.glob(".whl/ray-*.whl")
slim = path + ".slim"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if info.filename.startswith("ray/jars/"):
            continue
        data = src.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True) if not line.startswith(b"ray/jars/"))
        dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
os.replace(slim, path)
EOF

ls -l .whl
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "gpu_wheels.sh: wheels $((total / 1048576)) MiB + tracked files $((tree / 1048576)) MiB (the GPU machine takes at most 64 MiB in all)"
if [ $((total + tree)) -ge $((62 * 1048576)) ]; then
    echo "gpu_wheels.sh: FAIL: too large to travel" >&2
    exit 1
fi
