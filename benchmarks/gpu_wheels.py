"""The wheels `benchmarks/gpu_check.py --wheels DIR` installs on a GPU machine with no package registry.

    .venv/bin/python benchmarks/gpu_wheels.py             # into outputs/gpu_wheels, for that machine's CPython 3.12.3
    .venv/bin/python benchmarks/gpu_wheels.py --python-version 3.11.7 --dir outputs/gpu_wheels_py311   # to try it here

Downloads the pinned wheels for x86-64 Linux, builds DeepSpeed's (no precompiled ops: they build on first use there)
and this package's, then checks that every requirement of every wheel in DIR is met by another wheel in DIR or by what
that machine already has (MACHINE), that each name comes in one version, and that the bundle fits in 64 MiB, the most
that can be carried there. Prints each wheel's name, version and size; exits non-zero on a failure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).parents[1]
MACHINE_PYTHON = "3.12.3"
LIMIT_MIB = 64
# what trl_opd needs beyond the machine's packages, at the versions this repo's virtualenv resolved; typing-extensions
# and fsspec although the machine has them: pydantic needs typing-extensions>=4.16 and datasets fsspec<=2026.9.0, and
# the machine's versions of those are not known
PINNED = {
    "trl": "1.16.0", "datasets": "5.2.0", "dill": "0.4.1", "multiprocess": "0.70.19", "fsspec": "2026.9.0",
    "math-verify": "0.9.0", "latex2sympy2-extended": "1.11.0", "antlr4-python3-runtime": "4.13.2",
    "hjson": "3.1.0", "pydantic": "2.14.4", "pydantic-core": "2.50.5", "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5", "typing-extensions": "4.16.0",
}
DEEPSPEED = "0.19.8"  # no wheel on the registry: built here from its source, without ops
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# The GPU machine's packages (None: version not known), besides its nvidia-* CUDA 13 libraries, which nothing here needs
MACHINE = {
    "torch": "2.11.0", "transformers": "5.17.0", "accelerate": "1.15.0", "huggingface-hub": "1.33.0",
    "tokenizers": "0.23.2", "safetensors": "0.8.0", "numpy": "2.5.2", **dict.fromkeys("""
    absl-py aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
    charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize
    hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader
    lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib
    mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
    networkx ninja numba numba-cuda numpyro nvidia-ml-py onnx onnxruntime opencv-python-headless optax opt-einsum
    optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
    pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml
    regex requests rich sacrebleu scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
    sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate
    tensorboard tensorstore threadpoolctl tifffile tiktoken timm toolz torchaudio torchdiffeq torch-geometric
    torchmetrics torchvision tqdm treescope triton typer typing-extensions typing-inspect urllib3 uvloop
    wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
    """.split()),
}


def pip(*args: str, env: dict | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env=env)


def build(directory: Path, python_version: str) -> None:
    """The pinned wheels downloaded, DeepSpeed's built once, this package's built afresh."""
    platforms = [flag for name in PLATFORMS for flag in ("--platform", name)]
    pip("download", "--no-deps", "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
        *platforms, "--dest", str(directory), *(f"{name}=={version}" for name, version in PINNED.items()))
    if not list(directory.glob(f"deepspeed-{DEEPSPEED}-*.whl")):
        pip("wheel", "--no-deps", "--no-cache-dir", "--wheel-dir", str(directory), f"deepspeed=={DEEPSPEED}",
            env={**os.environ, "DS_BUILD_OPS": "0"})
    for old in directory.glob("trl_opd-*.whl"):
        old.unlink()
    pip("wheel", "--no-deps", "--wheel-dir", str(directory), str(ROOT))


def metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        return HeaderParser().parsestr(archive.read(name).decode())


def check(directory: Path, python_version: str) -> list[str]:
    """Failures of the bundle in `directory`, after printing its table; requirements met by a machine package of
    unknown version are listed too, as not verified."""
    wheels = sorted(directory.glob("*.whl"))
    meta = {wheel: metadata(wheel) for wheel in wheels}
    carried, failures, unverified = {}, [], []
    for data in meta.values():
        name = canonicalize_name(data["Name"])
        if name in carried:
            failures.append(f"{name}: two versions, {carried[name]} and {data['Version']}")
        carried[name] = data["Version"]
    # the target's markers: `extra == ...` evaluates false, so optional extras are skipped
    environment = {**default_environment(), "python_version": ".".join(python_version.split(".")[:2]),
                   "python_full_version": python_version, "implementation_name": "cpython",
                   "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
                   "os_name": "posix", "platform_machine": "x86_64", "extra": ""}
    print(f"{'wheel':<26} {'version':<12} {'MiB':>6}")
    for wheel, data in meta.items():
        print(f"{data['Name']:<26} {data['Version']:<12} {wheel.stat().st_size / 2**20:>6.2f}")
        if not SpecifierSet(data.get("Requires-Python", "")).contains(environment["python_full_version"]):
            failures.append(f"{data['Name']}: Requires-Python {data['Requires-Python']}")
        for line in data.get_all("Requires-Dist") or []:
            requirement = Requirement(line)
            if requirement.marker and not requirement.marker.evaluate(environment):
                continue
            name = canonicalize_name(requirement.name)
            version = carried.get(name, MACHINE.get(name))
            if name not in carried and name not in MACHINE:
                failures.append(f"{data['Name']} needs {requirement}: neither carried nor on the machine")
            elif version is None:
                if requirement.specifier:
                    unverified.append(f"{data['Name']} needs {requirement} (the machine's version is not known)")
            elif not requirement.specifier.contains(version, prereleases=True):
                where = "carried" if name in carried else "on the machine"
                failures.append(f"{data['Name']} needs {requirement}: {version} {where}")
    total = sum(wheel.stat().st_size for wheel in wheels) / 2**20
    print(f"{'total':<26} {len(wheels):<12} {total:>6.2f}")
    if total > LIMIT_MIB:
        failures.append(f"total {total:.2f} MiB over {LIMIT_MIB} MiB")
    for line in unverified:
        print("not verified:", line)
    return failures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("outputs/gpu_wheels"))
    parser.add_argument("--python-version", default=MACHINE_PYTHON, help="the target's CPython")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    build(args.dir.resolve(), args.python_version)
    failures = check(args.dir, args.python_version)
    for failure in failures:
        print("FAILED:", failure)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
