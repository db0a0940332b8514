"""``import flowrl`` stays light: no reward models, no model libraries."""

import subprocess
import sys


def test_import_flowrl_does_not_pull_reward_or_model_code():
    code = (
        "import sys, flowrl, flowrl.config; "
        "heavy = [m for m in ('rewards', 'open_clip', 'transformers', 'diffusers', 'torch', 'ray') "
        "if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_reward_service_imports_ray_only_when_it_starts():
    code = (
        "import sys, flowrl.cli, flowrl.commands.serve_rewards, flowrl.reward_service.config, "
        "flowrl.reward_service.launch; print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
