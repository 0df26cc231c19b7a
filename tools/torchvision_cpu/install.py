"""Install leangrad_torchvision_cpu (this folder) into the running Python's site-packages,
with the ``.pth`` file that imports it at start-up. Run by ``make install-dev``."""

from __future__ import annotations

import pathlib
import shutil
import sysconfig

here = pathlib.Path(__file__).parent
site = pathlib.Path(sysconfig.get_paths()["purelib"])
shutil.copy(here / "leangrad_torchvision_cpu.py", site / "leangrad_torchvision_cpu.py")
(site / "leangrad_torchvision_cpu.pth").write_text("import leangrad_torchvision_cpu\n")
print(f"torchvision CPU shim installed in {site}")
