"""Adv-GRPO's rewards (rewards/adversarial.py): the discriminator's update on a 2-image batch against a hand
computation, its score's range, shape and NaN rows, its JSON state round trip, the reference similarity on
hand-made features, the bad references folders, and a tiny GRPO run (and NFT run) that trains the head every
epoch and resumes to the same head and metrics as the uninterrupted run."""

import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from PIL import Image

from flowrl.commands.train import recipe_train
from flowrl.config import Config, load_config
from flowrl.recipes.extras import reward_updates
from flowrl.rewards_api import TrainableReward, build_reward
from flowrl.training.metrics import read_metrics
from rewards.adversarial import AdversarialReward, DiscriminatorHead, similarity

SMOKE = "configs/smoke/sd3_tiny.yaml"


def colour_images(colours) -> torch.Tensor:
    """[N, 3, 1, 1] images of the given RGB colours (pixels features of size 1 are the colours themselves)."""
    return torch.tensor(colours, dtype=torch.float32)[:, :, None, None]


def write_references(folder, colours, size: int = 1):
    folder.mkdir(parents=True, exist_ok=True)
    for i, colour in enumerate(colours):
        Image.new("RGB", (size, size), tuple(round(255 * c) for c in colour)).save(folder / f"{i}.png")
    return folder


def pixel_reward(tmp_path, **kwargs) -> AdversarialReward:
    # References (0, 1, 0) and (1, 1, 0): mean (0.5, 1, 0), std (0.5, 1, 1) (a constant feature's std is 1),
    # so they standardise to (-1, 0, 0) and (1, 0, 0).
    folder = write_references(tmp_path / "refs", [(0.0, 1.0, 0.0), (1.0, 1.0, 0.0)])
    return AdversarialReward(str(folder), features="pixels", feature_kwargs={"size": 1}, device="cpu", **kwargs)


def test_one_sgd_step_on_a_two_image_batch_by_hand(tmp_path):
    reward = pixel_reward(tmp_path, lr=2.0, optimizer="sgd")
    assert isinstance(reward, TrainableReward)
    assert torch.equal(reward.mean, torch.tensor([0.5, 1.0, 0.0]))
    assert torch.equal(reward.std, torch.tensor([0.5, 1.0, 1.0]))
    # Negatives (0.5, 0.5, 0.25) and (1, 1, 1) standardise to n1 = (0, -0.5, 0.25) and n2 = (1, 0, 1); both
    # references are drawn (2 of 2). At w = 0, b = 0 every z is 0, the loss is log 2, and
    # d loss / d z = 1/2 * 1/2 * (sigmoid(0) - 1) = -1/8 for each positive, 1/2 * 1/2 * sigmoid(0) = 1/8 for each
    # negative: grad w = (n1 + n2 - r1 - r2) / 8 = (1, -0.5, 1.25) / 8 = (0.125, -0.0625, 0.15625), grad b = 0.
    # SGD with lr 2: w = (-0.25, 0.125, -0.3125), b = 0.
    metrics = reward.update(colour_images([(0.5, 0.5, 0.25), (1.0, 1.0, 1.0)]), ["a", "b"], [{}, {}])
    assert metrics == {"disc_loss": pytest.approx(math.log(2)), "disc_accuracy": 0.0}  # z = 0: neither side right
    assert torch.allclose(reward.head.weight.detach(), torch.tensor([-0.25, 0.125, -0.3125]))
    assert float(reward.head.bias.detach()) == 0.0 and reward.updates == 1
    # Scores after the step: z(n1) = 0.125 * -0.5 - 0.3125 * 0.25 = -0.140625, z(n2) = -0.25 - 0.3125 = -0.5625.
    scores = reward(colour_images([(0.5, 0.5, 0.25), (1.0, 1.0, 1.0)]), ["a", "b"], [{}, {}])["adversarial"]
    assert torch.allclose(scores, torch.sigmoid(torch.tensor([-0.140625, -0.5625])))
    assert scores.shape == (2,) and bool(((scores > 0) & (scores < 1)).all())


def test_the_first_adam_step_moves_each_weight_by_lr_against_its_gradient_sign(tmp_path):
    # Adam's first step with betas (0.5, 0.999): m_hat = g, v_hat = g^2, so w -= lr * g / (|g| + eps): the
    # gradient above, (0.125, -0.0625, 0.15625), gives w = (-0.1, 0.1, -0.1); b's gradient is 0, so b stays 0.
    reward = pixel_reward(tmp_path, lr=0.1)
    reward.update(colour_images([(0.5, 0.5, 0.25), (1.0, 1.0, 1.0)]), ["a", "b"], [{}, {}])
    assert torch.allclose(reward.head.weight.detach(), torch.tensor([-0.1, 0.1, -0.1]), atol=1e-6)
    assert float(reward.head.bias.detach()) == 0.0


def test_l2_penalises_the_weights_not_the_bias():
    head = DiscriminatorHead(2, lr=1.0, optimizer="sgd", l2=0.5)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([2.0, 0.0]))
        head.bias.fill_(1.0)
    x = torch.zeros(1, 2)  # z = b = 1 on both sides: loss = (softplus(-1) + softplus(1)) / 2 + 0.25 * 4
    assert float(head.loss(x, x).detach()) == pytest.approx((math.log1p(math.exp(-1)) + math.log1p(math.exp(1))) / 2 + 1.0)


def test_score_range_shape_and_nan_rows(tmp_path):
    reward = pixel_reward(tmp_path, lr=1.0, steps=3)
    images = torch.rand(5, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(reward(images, list("abcde"), [{}] * 5)["adversarial"], torch.full((5,), 0.5))  # w = 0
    images[2, 0, 1, 1] = float("nan")
    metrics = reward.update(images, list("abcde"), [{}] * 5)  # the NaN row is left out of the negatives
    assert set(metrics) == {"disc_loss", "disc_accuracy"} and math.isfinite(metrics["disc_loss"])
    scores = reward(images, list("abcde"), [{}] * 5)["adversarial"]
    assert scores.shape == (5,) and math.isnan(scores[2])
    finite = scores[torch.arange(5) != 2]
    assert bool(((finite >= 0) & (finite <= 1)).all())
    assert reward.update(torch.full((1, 3, 4, 4), float("nan")), ["a"], [{}]) == {}  # nothing to learn from


def test_state_round_trips_through_json_and_continues_identically(tmp_path):
    def trained(steps: int) -> AdversarialReward:
        reward = pixel_reward(tmp_path, lr=0.05, steps=2, l2=0.01, seed=3)
        for i in range(steps):
            reward.update(torch.rand(4, 3, 2, 2, generator=torch.Generator().manual_seed(i)), list("abcd"), [{}] * 4)
        return reward

    full, half = trained(3), trained(2)
    resumed = pixel_reward(tmp_path, lr=0.05, steps=2, l2=0.01, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(half.state_dict())))  # through the trainer state's JSON
    assert torch.equal(resumed.head.weight, half.head.weight) and resumed.updates == 2
    resumed.update(torch.rand(4, 3, 2, 2, generator=torch.Generator().manual_seed(2)), list("abcd"), [{}] * 4)
    assert torch.equal(resumed.head.weight, full.head.weight) and torch.equal(resumed.head.bias, full.head.bias)


def test_reference_similarity_on_hand_made_features(tmp_path):
    unit_refs = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    x = torch.tensor([[0.0, 1.0], [-1.0, 0.0]])
    # cosines: (0, 0.8) and (-1, -0.6): max 0.8 -> 0.9 and -0.6 -> 0.2; mean 0.4 -> 0.7 and -0.8 -> 0.1.
    assert torch.allclose(similarity(x, unit_refs, "max"), torch.tensor([0.9, 0.2]))
    assert torch.allclose(similarity(x, unit_refs, "mean"), torch.tensor([0.7, 0.1]))
    folder = write_references(tmp_path / "refs", [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0)])
    reward = build_reward("reference_similarity", references=str(folder), features="pixels",
                          feature_kwargs={"size": 1}, device="cpu")
    images = colour_images([(1.0, 1.0, 0.0), (0.0, 0.0, 1.0), (1.0, 0.0, 0.0), (0.0, 0.0, 0.0)])
    images = torch.cat([images, torch.full((1, 3, 1, 1), float("nan"))])
    scores = reward(images, list("abcde"), [{}] * 5)["reference_similarity"]
    # (1, 1, 0): cos 1/sqrt 2 to both -> (1 + 0.7071) / 2; (0, 0, 1): cos 0 -> 0.5; (1, 0, 0): 1; black: no
    # direction, cos 0 -> 0.5; the NaN image: NaN.
    assert torch.allclose(scores[:4], torch.tensor([(1 + 2 ** -0.5) / 2, 0.5, 1.0, 0.5]))
    assert math.isnan(scores[4]) and not isinstance(reward, TrainableReward)


@pytest.mark.parametrize("name", ["adversarial", "reference_similarity"])
def test_a_missing_or_empty_references_folder_is_one_line(tmp_path, name):
    for folder, message in ((tmp_path / "nowhere", "is not a directory"), (tmp_path / "empty", "holds no images")):
        if folder.name == "empty":
            folder.mkdir()
        with pytest.raises(ValueError, match=message) as error:
            build_reward(name, references=str(folder), device="cpu")
        assert "\n" not in str(error.value)


# ------------------------------------------------------------------------------------------ runs

def smoke_run(run_dir, references, *overrides) -> list[dict]:
    rewards = ("rewards=[{name: adversarial, kwargs: {references: '" + str(references) + "', update_every: 1, "
               "lr: 0.05, steps: 2}}]")
    clip = [] if "recipe=nft" in overrides else ["train.clip_range=0.2"]
    cfg = load_config(Config, SMOKE, [f"run_dir={run_dir}", "log.progress=false", "log.eval_every=0",
                                      "log.report_prompts=0", "train.learning_rate=1e-2", "train.checkpoint_every=1",
                                      rewards, *clip, *overrides])
    recipe_train(cfg.recipe)(cfg)
    return read_metrics(run_dir)


def head_state(run_dir) -> dict:
    checkpoints = sorted((run_dir / "checkpoints").glob("*"))
    state = json.loads((checkpoints[-1] / "trainer_state.json").read_text())
    return state["reward_updates"]["adversarial"]


@pytest.mark.parametrize("recipe", ["grpo", "nft"])
def test_a_run_trains_the_head_and_resumes_to_the_same_head_and_metrics(tmp_path, recipe):
    references = write_references(tmp_path / "refs", [(0.9, 0.1, 0.1), (0.8, 0.2, 0.1), (0.7, 0.1, 0.2)], size=8)
    extra = [f"recipe={recipe}"] if recipe == "nft" else []
    full = smoke_run(tmp_path / "full", references, "train.epochs=3", *extra)
    smoke_run(tmp_path / "split", references, "train.epochs=2", *extra)
    split = smoke_run(tmp_path / "split", references, "train.epochs=3", "train.resume=latest", *extra)
    strip = lambda records: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]  # noqa: E731
    assert strip(split) == strip(full)
    assert [r["reward/adversarial/disc_loss"] for r in full][0] == pytest.approx(math.log(2))  # w = 0 at first
    assert all("reward/adversarial/disc_accuracy" in r for r in full)
    state = head_state(tmp_path / "full")
    assert state == head_state(tmp_path / "split") and state["updates"] == 3
    assert any(v != 0 for v in state["head"]["weight"]["values"])  # the head moved


def test_the_extra_is_built_only_for_trainable_rewards(tmp_path):
    class Run:
        rewards = [build_reward("brightness")]

    assert reward_updates(Run()) is None
    Run.rewards.append(pixel_reward(tmp_path, lr=1.0))
    assert list(reward_updates(Run()).rewards) == ["adversarial"]


def test_the_shipped_toy_config_scores_toy_renders(tmp_path):
    from flowrl.rewards_api import build_rewards, score
    from tools.toy_artifacts import make_toy_artifacts

    path = "configs/toy/grpo_adversarial.yaml"
    cfg = load_config(Config, path)
    assert [(r.name, r.weight) for r in cfg.rewards] == [("toy_proxy", 1.0), ("adversarial", 1.0), ("toyeval", 0.0)]
    references = cfg.rewards[1].kwargs["references"]
    assert references == "runs/toy_artifacts/clean"
    assert "python -m tools.toy_artifacts runs/toy_artifacts --n 1000" in open(path).read()  # the header makes them
    make_toy_artifacts(tmp_path / "toy", n=4)
    cfg.rewards[1].kwargs["references"] = str(tmp_path / "toy" / "clean")
    rewards, weights = build_rewards(cfg.rewards, torch.device("cpu"))
    assert weights == {"toy_proxy": 1.0, "adversarial": 1.0, "toyeval": 0.0}
    out = score(rewards, torch.rand(2, 3, 32, 32), ["a red circle", "a red circle"], [{}, {}])
    assert torch.equal(out["adversarial"], torch.full((2,), 0.5))  # the head starts at zero
    metrics = rewards[1].update(torch.rand(4, 3, 32, 32), ["a red circle"] * 4, [{}] * 4)
    assert metrics["disc_loss"] == pytest.approx(math.log(2))
    assert float(rewards[1](torch.rand(2, 3, 32, 32), ["a"] * 2, [{}] * 2)["adversarial"].std()) > 0


@pytest.mark.slow
def test_two_processes_train_the_same_head_as_one(tmp_path):
    """Under ``accelerate launch`` every process updates its copy of the head on the images of all processes, so
    the head two processes checkpoint is the head one process trains on the same global batch."""
    import subprocess
    import sys

    from tests import REPO

    references = write_references(tmp_path / "refs", [(0.9, 0.1, 0.1), (0.8, 0.2, 0.1), (0.7, 0.1, 0.2)], size=8)
    rewards = ("rewards=[{name: adversarial, kwargs: {references: '" + str(references) + "', update_every: 1, "
               "lr: 0.05, steps: 2}}]")
    common = [SMOKE, "train.epochs=2", "log.progress=false", "log.eval_every=0", "log.report_prompts=0",
              "train.learning_rate=1e-2", "train.clip_range=0.2", "train.checkpoint_every=1", rewards]
    two = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for launcher, name, batch in ((two, "two", "sampling.prompts_per_batch=2"),
                                  ([sys.executable], "one", "sampling.prompts_per_batch=4")):
        result = subprocess.run([*launcher, "-m", "flowrl", "train", *common, batch, f"run_dir={tmp_path / name}"],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
    one, two_state = head_state(tmp_path / "one"), head_state(tmp_path / "two")
    assert one["updates"] == two_state["updates"] == 2
    for part in ("weight", "bias"):
        a, b = (torch.tensor(state["head"][part]["values"]) for state in (one, two_state))
        assert a.abs().sum() > 0 and torch.allclose(a, b, rtol=1e-3, atol=1e-5), part
    losses = [[r["reward/adversarial/disc_loss"] for r in read_metrics(tmp_path / n)] for n in ("one", "two")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)
