"""The quickstart's install commands, run as written in a fresh virtual environment.

Offline and quick: the new environment sees the packages of the one running the tests (torch,
PyYAML, submitit, setuptools) the way `--system-site-packages` would show a system's, without
this package; pip is told to use no index. So `pip install torch ...` finds torch installed and
`pip install -e .` builds and installs the checkout itself, as on a user's machine.
"""

from __future__ import annotations

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


def install_commands() -> str:
    """The shell blocks of the quickstart's "Install" section, as written."""
    text = (REPO / "docs" / "quickstart.md").read_text()
    section = re.search(r"## 1\. Install\n(.*?)\n## ", text, re.S).group(1)
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert blocks, "the install section has no ```bash block"
    return "\n".join(blocks)


def system_site(tmp_path: Path) -> Path:
    """A stand-in for a system site-packages: this environment's packages, minus ours."""
    ours = Path(torch.__file__).resolve().parents[1]
    site = tmp_path / "system-site"
    site.mkdir()
    for entry in ours.iterdir():
        if entry.name.startswith(("kempner_resilience", "__editable__", "pip")):
            continue
        (site / entry.name).symlink_to(entry)
    return site


@pytest.mark.slow
def test_the_quickstart_install_commands_work_as_written_in_a_fresh_venv(tmp_path):
    checkout = tmp_path / "kempner_resilience"
    shutil.copytree(REPO, checkout, ignore=_NOT_IN_A_CHECKOUT, symlinks=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    vpy = venv / "bin" / "python"
    purelib = subprocess.run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_path("
                              "'purelib'))"], capture_output=True, text=True, check=True).stdout
    (Path(purelib.strip()) / "system-site.pth").write_text(f"{system_site(tmp_path)}\n")

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               # pip's inverted switch: "0" means --no-build-isolation (build with the
               # environment's setuptools instead of downloading one).
               PIP_NO_BUILD_ISOLATION="0")
    # The venv's own old setuptools would shadow the newer one torch needs.
    subprocess.run([str(vpy), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], env=env,
                   check=True, capture_output=True, timeout=120)

    proc = subprocess.run(["bash", "-euxo", "pipefail", "-c", install_commands()], cwd=checkout,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "78" in proc.stdout and "CONFIG" in proc.stdout  # `kempner-resilience exit-codes`

    job_dir = tmp_path / "job"  # a training job runs elsewhere, not in the checkout
    job_dir.mkdir()
    where = subprocess.run([str(vpy), "-c", "import kempner_resilience, torch; "
                            "print(kempner_resilience.__file__)"], cwd=job_dir, env=env,
                           capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()) == checkout / "kempner_resilience" / "__init__.py"
