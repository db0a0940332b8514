"""RemoteReward against a test double of the reward service (tests/fault_helpers.py: a judge in a thread, on a
free localhost port, that misbehaves on purpose): round trip, batching, groups, NaN passthrough, retries, timeouts,
the total deadline against a trickling server, refused connections, 4xx, and the health check at construction.
The client against the Ray Serve service itself: tests/rewards/test_reward_service.py."""

import inspect
import logging
import math
import socket
import threading
import time

import pytest
import torch

import rewards.remote as remote
from flowrl.rewards_api import build_reward, score
from rewards.remote import RemoteReward, RemoteRewardError, ServiceUnavailable
from rewards.simple import Brightness
from tests.fault_helpers import judge_double as serving
from tests.fault_helpers import trickle_server


def batch(n=5, size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, size, size, generator=g), [f"prompt {i}" for i in range(n)], [{"i": i} for i in range(n)]


def quantised(images):
    """What the server sees after an 8-bit PNG round trip."""
    return (images.clamp(0, 1) * 255).round() / 255


def free_port():
    """A port nothing listens on (bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NanHalf:
    """Scores every other image null/NaN, as a judge that cannot judge some images would."""
    name = "nanhalf"

    def __call__(self, images, prompts, metadata):
        v = torch.tensor([float(m["i"]) for m in metadata])
        v[::2] = math.nan
        return {self.name: v, f"{self.name}/sub": torch.zeros(len(prompts))}


class Raising:
    name = "boom"

    def __call__(self, images, prompts, metadata):
        raise RuntimeError("judge exploded")


def fast(url, **kwargs):
    """A client with tiny backoff so failure tests stay fast."""
    return RemoteReward(url, **{"backoff": 0.01, "max_backoff": 0.02, "timeout": 5.0, **kwargs})


# ------------------------------------------------------------------------------ round trip

def test_round_trip_matches_local_scoring_and_batches():
    images, prompts, metadata = batch(5)
    with serving([Brightness(saturation=True)]) as srv:
        out = fast(srv.url, name="brightness", batch_size=2)(images, prompts, metadata)
        assert srv.hits == 3  # 5 images in chunks of 2
    local = score([Brightness(saturation=True)], quantised(images), prompts, metadata)
    assert list(out) == list(local) == ["brightness", "brightness/saturation"]
    for key in local:
        assert out[key].dtype == torch.float32 and out[key].shape == (5,)
        torch.testing.assert_close(out[key], local[key], atol=1e-6, rtol=0)


def test_keys_are_renamed_into_the_clients_namespace():
    images, prompts, metadata = batch(3)
    with serving(["brightness", NanHalf()]) as srv:
        out = fast(srv.url)(images, prompts, metadata)  # default name "remote", main = first key
        picked = fast(srv.url, name="judge", main_key="nanhalf")(images, prompts, metadata)
        with pytest.raises(RemoteRewardError, match="no main key 'missing'"):
            fast(srv.url, main_key="missing")(images, prompts, metadata)
    assert list(out) == ["remote", "remote/nanhalf", "remote/nanhalf/sub"]
    assert list(picked) == ["judge", "judge/brightness", "judge/sub"]  # main first, then reply order
    torch.testing.assert_close(out["remote"], Brightness()(quantised(images), prompts, metadata)["brightness"])


def test_works_through_build_reward_and_score():
    images, prompts, metadata = batch(4)
    with serving(["brightness"]) as srv:
        reward = build_reward("rewards.remote:RemoteReward", url=srv.url, batch_size=3)
        out = score([reward, Brightness()], images, prompts, metadata)
    assert set(out) == {"remote", "brightness"}
    torch.testing.assert_close(out["remote"], out["brightness"], atol=2 / 255, rtol=0)


@pytest.mark.skipif(inspect.signature(build_reward).parameters["name"].kind is not inspect.Parameter.POSITIONAL_ONLY,
                    reason="a name= kwarg reaches the reward only once build_reward(name, /, **kwargs)")
def test_build_reward_passes_the_remote_name():
    with serving(["brightness"]) as srv:
        reward = build_reward("rewards.remote:RemoteReward", url=srv.url, name="geneval")
        assert list(reward(*batch(2))) == ["geneval"]


def test_jpeg_is_close_on_smooth_images():
    ramp = torch.linspace(0, 1, 32).view(1, 1, 1, 32).expand(2, 3, 32, 32).clone()
    ramp[1] *= 0.5
    with serving(["brightness"]) as srv:
        out = fast(srv.url, image_format="jpeg", jpeg_quality=90)(ramp, ["a", "b"], [{}, {}])
    torch.testing.assert_close(out["remote"], Brightness()(ramp, [], [])["brightness"], atol=0.02, rtol=0)


# ------------------------------------------------------------------------------ NaN

def test_null_scores_come_back_nan():
    images, prompts, metadata = batch(5)
    with serving([NanHalf()]) as srv:
        out = fast(srv.url, name="nanhalf", batch_size=2)(images, prompts, metadata)
    v = out["nanhalf"]
    assert torch.isnan(v).tolist() == [True, False, True, False, True]  # rows 0 of each chunk of 2
    assert v[1].item() == 1.0 and v[3].item() == 3.0
    assert not torch.isnan(out["nanhalf/sub"]).any()


def test_non_finite_images_are_not_sent_and_score_nan():
    images, prompts, metadata = batch(4)
    images[1, 0, 0, 0] = math.nan
    with serving(["brightness"]) as srv:
        out = fast(srv.url, batch_size=8)(images, prompts, metadata)
        empty = fast(srv.url)(torch.full((2, 3, 8, 8), math.nan), ["a", "b"], [{}, {}])
        assert srv.hits == 1  # the all-NaN batch made no request
    assert torch.isnan(out["remote"]).tolist() == [False, True, False, False]
    assert torch.isnan(empty["remote"]).all() and list(empty) == ["remote"]


def test_server_on_error_nan_gives_null_main_and_raise_gives_500():
    images, prompts, metadata = batch(2)
    with serving([Raising()], on_error="nan") as srv:
        assert torch.isnan(fast(srv.url)(images, prompts, metadata)["remote"]).all()
    with serving([Raising()]) as srv:
        with pytest.raises(RemoteRewardError, match="failed after 2 attempts: HTTP 500: .*judge exploded"):
            fast(srv.url, max_retries=2)(images, prompts, metadata)
        assert srv.hits == 2


# ------------------------------------------------------------------------------ failures

def failing_call(reward, error: type[Exception]) -> tuple[str, float]:
    """Score 2 images with ``reward``, which must raise ``error`` -> (its message, the seconds it took)."""
    images, prompts, metadata = batch(2)
    start = time.monotonic()
    with pytest.raises(error) as info:
        reward(images, prompts, metadata)
    return str(info.value), time.monotonic() - start


def test_timeout_is_one_line_and_bounded():
    with serving(["brightness"], delay=1.0) as srv:
        msg, elapsed = failing_call(fast(srv.url, name="geneval", timeout=0.2, max_retries=2), RuntimeError)
        assert srv.hits == 2
    assert "\n" not in msg and "timed out after 2 attempts (timeout=0.2s per socket operation, " in msg
    assert msg.startswith("remote reward 'geneval' at http://127.0.0.1:")
    assert elapsed < 2 * 0.2 + 0.5  # retries x timeout + tiny backoff + slack, not the 1 s delay


@pytest.mark.parametrize("part", ["head", "body"])
def test_a_trickling_server_is_cut_off_by_the_deadline(part):
    """One byte every 0.05 s never trips timeout=1, from the status line on or in the body; the deadline
    ends each attempt at 0.5 s. Without it each attempt lasts the server's give_up (10 s)."""
    with trickle_server(part, interval=0.05, give_up=10.0) as srv:
        reward = RemoteReward(srv.url, name="geneval", timeout=1.0, deadline=0.5, max_retries=2, backoff=0.0)
        msg, elapsed = failing_call(reward, RemoteRewardError)
        assert srv.connections == 2
    assert "\n" not in msg and msg.startswith("remote reward 'geneval' at http://127.0.0.1:")
    assert "timed out after 2 attempts (timeout=1.0s per socket operation, deadline=0.5s per attempt)" in msg
    assert 2 * 0.5 <= elapsed < 2 * 0.5 + 0 + 1.5  # attempts x deadline + backoff + slack for a loaded CPU


def _deadline_timers():
    return [t for t in threading.enumerate() if isinstance(t, threading.Timer)]


def test_the_deadline_spares_other_threads_and_leaves_no_timer():
    """A deadline firing in one thread shuts down only its own attempt's sockets: a slower-than-that
    but healthy request in another thread still succeeds, and no timer thread outlives a request."""
    images, prompts, metadata = batch(3)
    results = {}

    def run(key, reward):
        try:
            results[key] = reward(images, prompts, metadata)
        except RemoteRewardError as err:
            results[key] = err

    with trickle_server("body") as slow, serving(["brightness"], delay=0.8) as ok:
        shared = fast(ok.url, deadline=5.0)
        threads = [threading.Thread(target=run, args=("trickle", fast(slow.url, deadline=0.3, max_retries=1)))]
        threads += [threading.Thread(target=run, args=(i, shared)) for i in range(2)]  # one client, two threads
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert isinstance(results["trickle"], RemoteRewardError) and "deadline=0.3s" in str(results["trickle"])
    for i in range(2):
        torch.testing.assert_close(results[i]["remote"], Brightness()(quantised(images), prompts, metadata)
                                   ["brightness"])
    assert not _deadline_timers()


def test_connection_refused_is_one_line_after_max_retries(monkeypatch):
    port = free_port()
    reward = fast(f"http://127.0.0.1:{port}", name="geneval", max_retries=3, check_health=False)
    calls = []
    real_open = reward._opener.open
    monkeypatch.setattr(reward._opener, "open", lambda *a, **k: calls.append(1) or real_open(*a, **k))
    with pytest.raises(RuntimeError) as info:
        reward(*batch(2))
    msg = str(info.value)
    assert len(calls) == 3
    assert "\n" not in msg and "unreachable after 3 attempts: connection refused" in msg
    assert f"is the service running? start it with: flowrl serve-rewards CONFIG port={port}" in msg


def test_backoff_is_exponential_and_capped(monkeypatch):
    sleeps = []
    monkeypatch.setattr(remote.time, "sleep", sleeps.append)
    reward = RemoteReward(f"http://127.0.0.1:{free_port()}", max_retries=4, backoff=1.0, max_backoff=1.5,
                          check_health=False)
    with pytest.raises(RemoteRewardError, match="after 4 attempts"):
        reward(*batch(1))
    assert sleeps == [1.0, 1.5, 1.5]


@pytest.mark.parametrize("status", [503, 429])
def test_retries_then_succeeds_and_each_retry_is_logged(status, caplog):
    with serving(["brightness"], fail_first=2, fail_status=status) as srv:
        reward = fast(srv.url, max_retries=3)
        with caplog.at_level(logging.WARNING, logger="rewards.remote"):
            out = reward(*batch(3))
        assert srv.hits == 3
    assert not torch.isnan(out["remote"]).any()
    said = [r.getMessage() for r in caplog.records if r.name == "rewards.remote"]
    assert reward.retries == 2 and len(said) == 2, said
    assert f"attempt 1 of 3 failed (HTTP {status}: injected failure ({status}))" in said[0]


def test_retries_exhausted_on_5xx():
    with serving(["brightness"], fail_first=10) as srv:
        with pytest.raises(RemoteRewardError, match=r"failed after 2 attempts: HTTP 503: injected failure \(503\)"):
            fast(srv.url, max_retries=2)(*batch(1))
        assert srv.hits == 2


def test_4xx_is_not_retried_and_carries_the_servers_message(monkeypatch):
    with serving(["brightness"], fail_first=10, fail_status=400) as srv:
        with pytest.raises(RemoteRewardError, match=r"rejected the request: HTTP 400: injected failure"):
            fast(srv.url, max_retries=3)(*batch(1))
        assert srv.hits == 1
    monkeypatch.setattr(remote, "WIRE_VERSION", 99)
    with serving(["brightness"]) as srv:  # (its health check would refuse the version first)
        with pytest.raises(RemoteRewardError, match="unsupported wire version 99; this server speaks 1"):
            fast(srv.url, max_retries=3, check_health=False)(*batch(1))
        assert srv.hits == 1


def test_malformed_replies_raise_clear_errors():
    r = RemoteReward("http://127.0.0.1:1", name="j", check_health=False)
    with pytest.raises(RemoteRewardError, match="3 values for 2 images"):
        r._parse({"scores": {"x": [1.0, 2.0, 3.0]}}, 2)
    with pytest.raises(RemoteRewardError, match="non-empty 'scores'"):
        r._parse({"result": []}, 2)
    with pytest.raises(RemoteRewardError, match="other than numbers or null"):
        r._parse({"scores": {"x": [1.0, "high"]}}, 2)
    with pytest.raises(RemoteRewardError, match="collide"):
        r._parse({"scores": {"a": [1.0], "a/x": [1.0], "x": [2.0]}}, 1)
    out = r._parse({"scores": {"x": [1, None], "x/s": [0.5, 0.25]}}, 2)
    assert list(out) == ["j", "j/s"] and math.isnan(out["j"][1].item())


def test_bad_constructor_arguments():
    for kwargs in ({"url": "localhost:8765"}, {"url": "http://h:1", "image_format": "webp"},
                   {"url": "http://h:1", "max_retries": 0}, {"url": "http://h:1", "name": "a/b"}):
        with pytest.raises(ValueError):
            RemoteReward(**kwargs)
    for deadline in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"^deadline must be finite and > 0 seconds .*got") as info:
            RemoteReward("http://h:1", deadline=deadline)
        assert "\n" not in str(info.value)
    for key, text in (("deadline", "forever"), ("timeout", "ten"), ("batch_size", "many"), ("max_retries", None)):
        with pytest.raises(ValueError, match=rf"^{key} must be a (whole )?number.*got {text!r}") as info:
            RemoteReward("http://h:1", check_health=False, **{key: text})
        assert "\n" not in str(info.value)


def test_deadline_reaches_the_client_through_build_reward():
    """Config `rewards:` kwargs go through build_reward: the deadline arrives, and a bad one is one line."""
    assert build_reward("remote", url="http://h:1", deadline=12, check_health=False).deadline == 12.0
    assert build_reward("remote", url="http://h:1", check_health=False).deadline == remote.DEADLINE == 300.0
    with pytest.raises(ValueError, match="reward 'remote': ValueError: deadline must be finite and > 0") as info:
        build_reward("remote", url="http://h:1", deadline=0)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------ health and groups

def test_health():
    with serving(["brightness", NanHalf()]) as srv:
        assert fast(srv.url + "/").health() == {"status": "ok", "rewards": ["brightness", "nanhalf"],
                                                "version": 1}


def test_a_service_that_is_down_is_one_line_at_construction_within_one_deadline():
    """The health check: max_retries quick tries sharing one deadline; a ServiceUnavailable is a ValueError, so
    build_reward (and a training run) says it in one line before anything is sampled."""
    port = free_port()
    start = time.monotonic()
    with pytest.raises(ServiceUnavailable) as info:
        fast(f"http://127.0.0.1:{port}", name="geneval", max_retries=2)
    assert time.monotonic() - start < 2.0
    msg = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in msg
    assert msg.startswith(f"remote reward 'geneval' at http://127.0.0.1:{port}/health unreachable after 2 attempts")
    assert "flowrl serve-rewards CONFIG" in msg
    with pytest.raises(ValueError, match=r"^reward 'remote': ServiceUnavailable: remote reward 'remote' .*/health "
                                         "unreachable"):
        build_reward("remote", url=f"http://127.0.0.1:{port}", max_retries=1)
    with trickle_server("head", interval=0.05, give_up=5.0) as srv:  # its /health answers; the probe passes
        assert RemoteReward(srv.url, deadline=0.3).deadline == 0.3 and srv.connections == 0


def test_a_health_reply_of_another_wire_version_is_refused(monkeypatch):
    with serving(["brightness"]) as srv:
        monkeypatch.setattr(remote, "WIRE_VERSION", 2)
        with pytest.raises(ServiceUnavailable, match=r"is not ready: its health reply is .*\"version\": 1} \("
                                                     "expected status 'ok' and version 2"):
            fast(srv.url)
        assert srv.hits == 0


def test_a_group_wise_client_sends_each_call_whole_as_one_group():
    images, prompts, metadata = batch(5)
    with serving(["brightness"]) as srv:
        plain = fast(srv.url, batch_size=2)
        assert not getattr(plain, "scores_groups", False)
        plain(images, prompts, metadata)
        assert srv.hits == 3 and "groups" not in srv.last_body
        grouped = fast(srv.url, batch_size=2, groups=True)
        out = grouped(images, prompts, metadata)
        assert grouped.scores_groups is True
        assert srv.hits == 4 and srv.last_body["groups"] == [0] * 5  # one request, never split by batch_size
    torch.testing.assert_close(out["remote"], Brightness()(quantised(images), prompts, metadata)["brightness"])
