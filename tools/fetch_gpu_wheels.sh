#!/usr/bin/env bash
# Fills .whl/ with the wheels tools/gpu_check.sh installs on a GPU machine without network (Python 3.12, x86-64):
# the packages k3train needs to train that such a machine lacks. Run it here, on a machine with PyPI, from anywhere:
#
#   bash tools/fetch_gpu_wheels.sh          # then carry .whl to the GPU machine along with the repository
#
# What k3train imports on the way to a tiny_cpu run (builtin corpus, byte tokenizer, local logging):
#   hydra-core, omegaconf, antlr4-python3-runtime   configuration (k3train.config, the command line)
#   torchtitan and what its LR scheduler module imports: spmd-types, tyro, docstring-parser, typeguard
#   torchao (train.float8, train.qat, the MXFP4 export): no dependencies; one abi3 wheel (cp310-abi3,
#     manylinux_2_28) for any Python from 3.10, about 3.4 MB. Its C extensions are optional: float8 training runs
#     through torch._scaled_mm and the MX formats through plain tensor ops
#   fla-core and einops (model.kernels=fla, checked by the compile part's kda_choices item)
#   datasets, dill, multiprocess: the built-in corpus is tokenized by `Dataset.map` on its first build (pyarrow,
#     pandas, xxhash, fsspec, huggingface-hub, httpx are on the machine already)
# torch, triton, numpy, PyYAML, packaging, typing-extensions, tqdm, tokenizers, tiktoken, tensorboard and matplotlib
# are on the machine already. wandb (only for logging.wandb=true) is imported lazily, where used, and is not fetched.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
DEST=.whl

WHEELS=(
  hydra-core==1.3.8
  omegaconf==2.3.1
  torchtitan==0.3.0
  spmd-types==0.2.3
  tyro==1.0.17
  docstring-parser==0.18.0
  typeguard==4.6.1
  torchao==0.18.0  # the version pyproject.toml pins (its MX API is a prototype)
  fla-core==0.6.0  # model.kernels=fla (the kernel module of flash-linear-attention), pure Python
  einops==0.8.2    # fla-core's one dependency
  datasets==4.7.0  # the version the CPU environment resolves
  dill==0.4.0
  multiprocess==0.70.18
)
SDISTS=(antlr4-python3-runtime==4.9.3)  # published as a source archive only: built into a wheel here (pure Python)

mkdir -p "$DEST"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for spec in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "$spec"
done
for spec in "${SDISTS[@]}"; do
  "$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$DEST" "$spec"
done
# .whl/ is in .gitignore: never committed, carried to the device machine by name.
# One version of each package (two stop the install there): keep the newest file per name.
"$PY" - "$DEST" <<'EOF'
import collections, pathlib, sys
files = collections.defaultdict(list)
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.whl"), key=lambda p: p.stat().st_mtime):
    files[f.name.split("-")[0].lower().replace("_", "-")].append(f)
for name, fs in sorted(files.items()):
    for old in fs[:-1]:
        print(f"removing an older {name}: {old.name}")
        old.unlink()
EOF
ls -l "$DEST"
du -sh "$DEST"
