"""DeepSpeed's own checkpoint tools on ds_tensorshard save folders.

- ``zero_to_fp32.py`` in a save dir: ``--to zero`` conversions hold DeepSpeed's own copy, as a stock save does.
"""

from __future__ import annotations

import os
import stat

from ds_tensorshard.checkpoints import files


# -- zero_to_fp32.py in a save dir -----------------------------------------------------------------------
def _install_script(source: str, target: str) -> None:
    with open(source) as f:
        text = f.read()
    files.write_text_atomic(target, text)
    os.chmod(target, os.stat(target).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def copy_deepspeed_recovery_scripts(save_dir: str) -> None:
    """DeepSpeed's own ``zero_to_fp32.py`` (and ``zero_to_torch.py`` where the release has it) into a save dir
    of stock checkpoints, as DeepSpeed's save does."""
    from deepspeed.utils import zero_to_fp32

    utils = os.path.dirname(os.path.abspath(zero_to_fp32.__file__))
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        if os.path.isfile(os.path.join(utils, script)):
            _install_script(os.path.join(utils, script), os.path.join(save_dir, script))
