"""The quickstart's install commands, run as written in a truly empty virtual environment.

The new environment has nothing but what `python -m venv` puts there (pip, setuptools): no
system site packages, nothing linked from the environment running the tests. Packages come from
the package registry as on a user's machine; only the torch line is pointed at the torch build
this machine caches (``TORCH_SPEC``, as in scripts/setup.sh), because the CPU index the quickstart
names is not reachable from CI. Then a 2-rank job (the demo: interrupted, checkpointed,
relaunched, resumed) runs from that environment, outside the checkout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO

# Not part of a checkout as a user clones it.
_NOT_IN_A_CHECKOUT = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info",
                                            ".pytest_cache", "build", "dist", "demo-workdir")
# What `python -m venv` installs by itself.
_VENV_SEED = {"pip", "setuptools"}


def install_commands() -> str:
    """The shell blocks of the quickstart's "Install" section, as written."""
    text = (REPO / "docs" / "quickstart.md").read_text()
    section = re.search(r"## 1\. Install\n(.*?)\n## ", text, re.S).group(1)
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert blocks, "the install section has no ```bash block"
    return "\n".join(blocks)


def with_cached_torch(commands: str) -> str:
    """The commands with the quickstart's torch line installing this machine's cached build."""
    spec = os.environ.get("TORCH_SPEC") or f"torch=={torch.__version__.split('+')[0]}"
    out, n = re.subn(r"^pip install torch\b.*$", f"pip install '{spec}'", commands, flags=re.M)
    assert n == 1, f"expected one `pip install torch` line in the quickstart:\n{commands}"
    return out


def user_env(venv: Path) -> dict[str, str]:
    """A shell with the venv activated and nothing of the test's Python environment."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "KR_"))}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


@pytest.mark.slow
def test_the_quickstart_installs_into_an_empty_venv_and_runs_a_two_rank_job(tmp_path):
    checkout = tmp_path / "kempner_resilience"
    shutil.copytree(REPO, checkout, ignore=_NOT_IN_A_CHECKOUT, symlinks=True)
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300)
    env = user_env(venv)
    vpy = venv / "bin" / "python"

    seeded = subprocess.run([str(vpy), "-m", "pip", "list", "--format=json"], env=env,
                            capture_output=True, text=True, check=True, timeout=120)
    assert {p["name"].lower() for p in json.loads(seeded.stdout)} <= _VENV_SEED
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()

    proc = subprocess.run(["bash", "-euxo", "pipefail", "-c",
                           with_cached_torch(install_commands())], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "78" in proc.stdout and "CONFIG" in proc.stdout  # `kempner-resilience exit-codes`

    job_dir = tmp_path / "job"  # a training job runs elsewhere, not in the checkout
    job_dir.mkdir()
    where = subprocess.run([str(vpy), "-c", "import kempner_resilience; "
                            "print(kempner_resilience.__file__)"], cwd=job_dir, env=env,
                           capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()) == checkout / "kempner_resilience" / "__init__.py"

    demo = subprocess.run(["kempner-resilience", "demo", "--ranks", "2", "--steps", "12",
                           "--interrupt-at", "6", "--every-steps", "4", "--workdir",
                           str(job_dir / "demo")], cwd=job_dir, env=env, capture_output=True,
                          text=True, timeout=300)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "bitwise IDENTICAL" in demo.stdout
