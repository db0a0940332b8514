"""How the tests launch two CPU processes under accelerate: DDP over gloo (:data:`TWO_PROCESSES`) or a config file
such as FSDP2's (:func:`launch_with`).

Every launch asks for a free rendezvous port (``--main_process_port 0``, torch's rendezvous picks one): the suite
runs on two pytest-xdist workers, and two such tests at accelerate's default port 29500 at once would let one
test's rank join the other's process group."""

import sys

ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0"]
TWO_PROCESSES = [*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                 "--dynamo_backend", "no"]


def launch_with(*arguments: str) -> list[str]:
    """accelerate's launcher with ``arguments`` (e.g. ``--config_file FILE``) and a free port."""
    return [*ACCELERATE, *arguments]


def launch_failure(stderr: str) -> str:
    """What a failed launch's assertion shows: the lines where a rank said what went wrong (flowrl's one-line
    ``error:``, an exception's last line), then the tail. torchrun's own traceback of the child that exited
    fills the last 2000 characters otherwise, and hides which rank failed and why."""
    said = [line for line in stderr.splitlines() if " error: " in line or line.startswith(("[rank", "Traceback"))
            or line.split(":")[0].endswith(("Error", "Exception"))]
    return "\n".join([*said[-25:], "--- the last lines ---", stderr[-1500:]])
