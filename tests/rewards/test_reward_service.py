"""The reward service on Ray Serve (flowrl/reward_service, `flowrl serve-rewards`): one local Ray instance on CPU
for the module, serving toyeval, brightness and a group-wise probe. The service and the in-process rewards agree on
the same images; a group-wise reward sees whole groups; batching batches; the size cap is a 413 and the client's one
line without a retry; an unknown reward and a GPU the cluster lacks are one line each. Elsewhere: a training run whose
service is down stops at start in one line with no run directory (tests/commands/test_bad_input.py, remote_down);
the client's own fault handling (timeouts, trickling replies, retries) is in test_rewards_remote.py."""

import http.client
import json
import threading
import urllib.request

import pytest
import torch

from flowrl.cli import main
from flowrl.config import ConfigError, from_dict
from flowrl.reward_service.config import ServiceConfig, load_service_config
from flowrl.reward_wire import WIRE_VERSION, encode_image, to_uint8
from flowrl.rewards_api import score
from flowrl.toy.prompts import all_prompts
from flowrl.toy.world import render_batch
from rewards.remote import RemoteReward, RemoteRewardError
from rewards.simple import Brightness
from rewards.toyeval import ToyEval
from tests import REPO
from tests.fault_helpers import free_port

pytest.importorskip("ray.serve")

CAP = 256 * 1024  # the service's max_request_bytes: small, so a test can pass it cheaply
SERVICE = {"max_request_bytes": CAP, "rewards": [
    {"name": "toyeval", "num_cpus": 0, "max_batch_size": 8, "batch_wait_s": 0.05},
    {"name": "brightness", "kwargs": {"saturation": True}, "num_cpus": 0, "max_batch_size": 8, "batch_wait_s": 0.05},
    {"name": "tests.reward_fixtures:GroupProbe", "num_cpus": 0, "max_batch_size": 4},
]}


@pytest.fixture(scope="module")
def service():
    """A local Ray (2 logical CPUs, no dashboard) serving SERVICE on a free port -> its config; shut down after."""
    import ray

    from flowrl.reward_service.launch import patient_local_serve, start_service, worker_env

    cfg = from_dict(ServiceConfig, {**SERVICE, "port": free_port()})
    patient_local_serve()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=worker_env())
    try:
        start_service(cfg)
        yield cfg
    finally:
        ray.shutdown()  # Serve's actors go with it


def toy_batch(n=12, seed=0):
    """Toy-world renders of n grammar prompts with a little noise; the last third is captioned with other rows'
    prompts, so toyeval scores a mix of 1 and 0."""
    items = all_prompts()[::97][:n]
    images, _ = render_batch([spec for _, spec in items], rng=seed)
    noise = torch.randn(images.shape, generator=torch.Generator().manual_seed(seed)) * 0.03
    wrong = n - n // 3
    items = items[:wrong] + items[:n - wrong]
    return (images + noise).clamp(0, 1), [prompt for prompt, _ in items], [spec for _, spec in items]


def quantised(images):
    """What the service sees after the 8-bit PNG round trip."""
    return torch.from_numpy(to_uint8(images)).permute(0, 3, 1, 2).float() / 255


def post(url, payload):
    request = urllib.request.Request(url + "/score", data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def test_ray_workers_import_this_checkout(service):
    import ray

    import flowrl

    @ray.remote(num_cpus=0)
    def where():
        import flowrl

        return flowrl.__file__

    assert ray.get(where.remote()) == flowrl.__file__


def test_health_lists_the_rewards(service):
    reply = RemoteReward(service.url).health()
    assert reply == {"status": "ok", "rewards": ["toyeval", "brightness", "group_probe"], "version": WIRE_VERSION,
                     "max_request_bytes": CAP}


def test_the_service_and_the_in_process_rewards_agree_on_the_same_images(service):
    images, prompts, metadata = toy_batch()
    out = RemoteReward(service.url, name="toyeval", batch_size=5)(images, prompts, metadata)
    local = score([ToyEval(), Brightness(saturation=True)], quantised(images), prompts, metadata)
    assert 0 < local["toyeval"].sum() < len(prompts)  # a mix of passes and failures, not a constant
    for key, values in local.items():
        remote_key = key if key.startswith("toyeval") else f"toyeval/{key}"
        torch.testing.assert_close(out[remote_key], values, atol=1e-6, rtol=0, equal_nan=True, msg=key)


def test_a_group_wise_reward_is_called_once_per_whole_group(service):
    images, _, _ = toy_batch(6)
    encoded = [encode_image(a) for a in to_uint8(images)]
    base = {"version": WIRE_VERSION, "images": encoded, "metadata": [None] * 6}
    explicit = post(service.url, {**base, "prompts": list("abcdef"), "groups": [5, 5, 5, 9, 9, 7]})["scores"]
    assert explicit["group_probe"] == [3, 3, 3, 2, 2, 1]  # each call held exactly its group's rows
    assert explicit["group_probe/prompts"] == [3, 3, 3, 2, 2, 1]
    by_prompt = post(service.url, {**base, "prompts": list("xxyxyz")})["scores"]  # no "groups": by prompt text
    assert by_prompt["group_probe"] == [3, 3, 2, 3, 2, 1] and by_prompt["group_probe/prompts"] == [1] * 6
    grouped = RemoteReward(service.url, name="group_probe", batch_size=2, groups=True)  # one call = one group
    assert grouped(images, list("abcdef"), [{}] * 6)["group_probe"].tolist() == [6.0] * 6


def test_batching_gathers_the_images_of_concurrent_requests(service):
    from ray import serve

    from flowrl.reward_service.launch import APP_NAME

    scorer = serve.get_deployment_handle("brightness", app_name=APP_NAME)
    before = scorer.batch_sizes.remote().result()
    images, prompts, metadata = toy_batch(6)
    client = RemoteReward(service.url, name="brightness", batch_size=6)
    threads = [threading.Thread(target=client, args=(images, prompts, metadata)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    after = scorer.batch_sizes.remote().result()
    new = {size: after[size] - before.get(size, 0) for size in after if after[size] > before.get(size, 0)}
    assert sum(size * count for size, count in new.items()) == 4 * 6  # every image scored once
    assert max(new) > 1 and max(new) <= 8, new  # batched, never past max_batch_size


def test_a_request_over_the_size_cap_is_413_and_one_client_line_without_a_retry(service):
    conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=30)
    conn.putrequest("POST", "/score")
    conn.putheader("Content-Length", str(10 ** 9))  # refused from the header alone: nothing is sent or read
    conn.endheaders()
    reply = conn.getresponse()
    message = json.loads(reply.read())["error"]
    conn.close()
    assert reply.status == 413 and "\n" not in message
    assert f"the request body of {10 ** 9} bytes is over this service's max_request_bytes={CAP}" in message
    noise = torch.rand(80, 3, 32, 32, generator=torch.Generator().manual_seed(0))  # ~0.35 MB of PNGs
    prompts, metadata = ["noise"] * 80, [{}] * 80
    blind = RemoteReward(service.url, batch_size=80, check_health=False, backoff=0.0)  # does not know the cap
    with pytest.raises(RemoteRewardError, match=r"rejected the request: HTTP 413: the request body of \d+ bytes is "
                                                f"over this service's max_request_bytes={CAP}"):
        blind(noise, prompts, metadata)
    told = RemoteReward(service.url, batch_size=80, backoff=0.0)  # its /health gave the cap: refused before sending
    with pytest.raises(RemoteRewardError, match=rf"would send \d+ bytes for 80 images, over the service's "
                                                rf"max_request_bytes={CAP} \(from its /health\)"):
        told(noise, prompts, metadata)
    assert blind.retries == told.retries == 0


# ------------------------------------------------------------------------------ one line each

def run_cli(argv, capsys):
    code = main(argv)
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert code == 2 and len(errors) == 1, errors
    return errors[0]


def test_an_unknown_reward_is_one_line_before_ray_starts(monkeypatch, capsys):
    import flowrl.reward_service.launch as launch

    monkeypatch.setattr(launch, "connect", lambda address: pytest.fail("Ray was started"))
    line = run_cli(["serve-rewards", str(REPO / "configs/serve/toy_cpu.yaml"), "rewards=[{name: toyevall}]"], capsys)
    assert line.startswith("flowrl serve-rewards: error: unknown reward 'toyevall'; did you mean 'toyeval'?")


def test_a_misnamed_reward_kwarg_and_a_port_in_use_are_one_line_before_ray_starts(monkeypatch, capsys):
    """Both were Ray tracebacks: the replicas' (printed before the error line) and Serve's "Failed to bind"."""
    import socket

    import flowrl.reward_service.launch as launch

    monkeypatch.setattr(launch, "connect", lambda address: pytest.fail("Ray was started"))
    config = str(REPO / "configs/serve/toy_cpu.yaml")
    line = run_cli(["serve-rewards", config, "rewards=[{name: toyeval, kwargs: {strickt: true}}]"], capsys)
    assert "reward 'toyeval' got unexpected keyword argument 'strickt'" in line, line
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = run_cli(["serve-rewards", config, f"port={port}"], capsys)
    assert line.startswith(f"flowrl serve-rewards: error: port {port} on 127.0.0.1 is not free"), line


@pytest.mark.parametrize("rewards, message", [
    ("[{name: brightness, replicas: 2, num_gpus: 1}]",
     "deployment 'brightness' asks for 2 GPUs (2 replica(s) x num_gpus 1) and the Ray cluster has 0; set its "
     "num_gpus: 0 to score on CPUs, or start the service on a cluster with GPUs (ray start --head --num-gpus N, then "
     "--address auto)"),
    ("[{name: toyeval, replicas: 2, num_cpus: 1}, {name: brightness, num_cpus: 0.5}]",
     "the deployments ask for 2.5 CPUs (toyeval 2 x 1, brightness 1 x 0.5) and the Ray cluster has 2; lower replicas "
     "or num_cpus (fractions are allowed), or add nodes to the cluster"),
], ids=["gpu", "cpu"])
def test_deployments_asking_for_more_than_the_cluster_has_are_one_line(service, capsys, rewards, message):
    line = run_cli(["serve-rewards", str(REPO / "configs/serve/toy_cpu.yaml"), f"rewards={rewards}"], capsys)
    assert line == f"flowrl serve-rewards: error: {message}"


# ------------------------------------------------------------------------------ config

@pytest.mark.parametrize("path", sorted((REPO / "configs" / "serve").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_service_config_loads(path):
    cfg = load_service_config(path)
    assert cfg.rewards and all(spec.replicas >= 1 for spec in cfg.rewards)


@pytest.mark.parametrize("override, words", [
    ("rewards=[{name: toyeval, replica: 2}]", "unknown config key 'rewards[0].replica' (did you mean "
                                               "'rewards[0].replicas'?)"),
    ("rewards=[{name: toyeval, max_batch_size: 0}]", "config key 'rewards[0].max_batch_size': must be >= 1"),
    ("rewards=[{name: toyeval}, {name: toyeval}]", "config key 'rewards': names a reward twice"),
    ("port=http", "config key 'port': expected int"),
])
def test_a_bad_service_config_is_one_line_naming_the_key(override, words):
    with pytest.raises(ConfigError) as info:
        load_service_config(REPO / "configs/serve/toy_cpu.yaml", [override])
    assert words in str(info.value) and "\n" not in str(info.value)


def test_a_ray_address_where_nothing_answers_is_one_line_without_waiting_on_ray():
    from flowrl.reward_service.launch import ServiceError, check_reachable

    port = free_port()
    with pytest.raises(ServiceError, match=rf"^cannot join the Ray cluster at address '127.0.0.1:{port}': nothing "
                                           rf"answers there .*; start its head with `ray start --head --port {port}`"):
        check_reachable(f"127.0.0.1:{port}")
    for address in (None, "auto", "ray://head:10001"):  # Ray's to resolve
        check_reachable(address)


def test_a_replica_that_cannot_build_its_reward_reports_the_error_instead_of_raising():
    """A bad kwarg value fails in the replica's constructor; raised there, Serve prints the replica's traceback and
    retries before the launcher says anything. Kept, the launcher reads it through describe() and stops in one line
    (flowrl.reward_service.launch.start_service)."""
    from flowrl.reward_service.deployments import RewardScorer

    scorer = RewardScorer("remote", {"url": "http://h:1", "deadline": "forever", "check_health": False}, 8, 0.01,
                          "raise")
    described = scorer.describe()
    assert described == {"error": "reward 'remote': ValueError: deadline must be a number (seconds where it is a "
                                  "time), got 'forever'"}
    scorer.check_health()  # no restart loop: the launcher reports it and shuts the service down
    assert RewardScorer("toyeval", {}, 8, 0.01, "raise").describe() == {"name": "toyeval", "scores_groups": False}
