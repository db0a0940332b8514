"""Adv-GRPO's rewards (rewards/adversarial.py) against numbers computed here: the head's 0.7/0.3 mixture of
CLS and patch logits, its logistic loss, the toy network's tokens, the seeded patch draws, the schedule over 20
epochs (discriminator on 9 of every 10, policy on the 10th), per-prompt positives and per-prompt similarity, the
JSON state round trip, the one-line config errors; and tiny GRPO and NFT runs: an epoch kept for the
discriminator leaves the LoRA weights, the optimizer and the EMA untouched while the head moves and the LR schedule
advances, and a resumed run gives the uninterrupted run's metrics and head."""

import json
import logging
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from flowrl.cli import main
from flowrl.commands.train import recipe_train
from flowrl.config import Config, load_config
from flowrl.recipes.extras import reward_updates
from flowrl.recipes.reward_updates import RewardUpdates
from flowrl.rewards_api import TrainableReward, build_reward
from flowrl.training.metrics import read_metrics
from rewards.adversarial import (
    AdversarialReward, DiscriminatorHead, _decode, feature_tokens, patch_indices, per_prompt_similarity,
    seeded_generator, similarity,
)
from tests.two_processes import TWO_PROCESSES, launch_failure

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
    """A reward on raw colours (pixels of size 1: no patch tokens, so patch_weight 0)."""
    folder = write_references(tmp_path / "refs", [(0.0, 1.0, 0.0), (1.0, 1.0, 0.0)])
    return AdversarialReward(str(folder), features="pixels", feature_kwargs={"size": 1}, device="cpu",
                             patch_weight=0.0, **kwargs)


def gelu(x: float) -> float:
    return 0.5 * x * (1 + math.erf(x / math.sqrt(2)))


def known_head(**kwargs) -> DiscriminatorHead:
    """A head on 2 features with 2 hidden units: h = W1 x + b1, z = w2 . gelu(h) + b2, with
    W1 = [[1, 0], [0, 2]], b1 = (0, -1), w2 = (1, -1), b2 = 0.5."""
    head = DiscriminatorHead(2, hidden=2, lr=1.0, optimizer="sgd", **kwargs)
    with torch.no_grad():
        head.net[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
        head.net[0].bias.copy_(torch.tensor([0.0, -1.0]))
        head.net[2].weight.copy_(torch.tensor([[1.0, -1.0]]))
        head.net[2].bias.fill_(0.5)
    return head


def z_by_hand(x, y) -> float:
    return gelu(x) - gelu(2 * y - 1) + 0.5


# ------------------------------------------------------------------------------------------ the head

def test_the_reward_is_0_7_cls_logit_plus_0_3_mean_patch_logit_on_a_known_head():
    head = known_head()
    # One image, unit tokens: CLS (1, 0), patches p0 = (0, 1), p1 = (0.6, 0.8), p2 = (-1, 0); the draw picks
    # p0, p1, p1, p2 (with replacement).
    tokens = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.6, 0.8], [-1.0, 0.0]]])
    index = torch.tensor([[0, 1, 1, 2]])
    cls, p0, p1, p2 = z_by_hand(1, 0), z_by_hand(0, 1), z_by_hand(0.6, 0.8), z_by_hand(-1, 0)
    expected = 0.7 * cls + 0.3 * (p0 + 2 * p1 + p2) / 4
    assert float(head.reward_logits(tokens, index).detach()) == pytest.approx(expected, abs=1e-6)
    assert float(head.reward_logits(tokens, None).detach()) == pytest.approx(cls, abs=1e-6)  # no patches: the CLS alone
    assert known_head(patch_weight=0.5).reward_logits(tokens, index).detach().item() == pytest.approx(
        0.5 * cls + 0.5 * (p0 + 2 * p1 + p2) / 4, abs=1e-6)


def test_the_logistic_loss_weighs_the_patch_term_by_0_3():
    head = known_head(l2=0.0)
    pos = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # CLS (1, 0), one patch (0, 1)
    neg = torch.tensor([[[-1.0, 0.0], [0.6, 0.8]]])
    one = torch.zeros(1, 1, dtype=torch.long)
    softplus = lambda v: math.log1p(math.exp(v))  # noqa: E731
    cls = 0.5 * softplus(-z_by_hand(1, 0)) + 0.5 * softplus(z_by_hand(-1, 0))
    patch = 0.5 * softplus(-z_by_hand(0, 1)) + 0.5 * softplus(z_by_hand(0.6, 0.8))
    assert float(head.loss(pos, neg, one, one).detach()) == pytest.approx(cls + 0.3 * patch, abs=1e-6)
    penalised = known_head(l2=0.5)  # l2 / 2 * (|W1|^2 + |w2|^2) = 0.25 * (5 + 2); biases free
    assert float(penalised.loss(pos, neg, one, one).detach()) == pytest.approx(cls + 0.3 * patch + 0.25 * 7, abs=1e-6)


def test_the_head_is_linear_gelu_linear_512_wide_with_pytorch_default_init_from_the_seed():
    head = DiscriminatorHead(8, lr=1e-4)
    first, act, last = head.net
    assert (first.in_features, first.out_features, type(act).__name__, last.out_features) == (8, 512, "GELU", 1)
    assert first.weight.abs().max() <= 8 ** -0.5 and last.weight.abs().max() <= 512 ** -0.5
    again = DiscriminatorHead(8, lr=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(head.net.parameters(), again.net.parameters()))
    other = DiscriminatorHead(8, lr=1e-4, seed=1)
    assert not torch.equal(head.net[0].weight, other.net[0].weight)
    assert head.optimizer.defaults["betas"] == (0.5, 0.999)


def test_toy_tokens_are_the_pooled_feature_then_the_last_layers_positions():
    reward_network = build_reward("adversarial", references=None, features="toy",
                                  feature_kwargs={"width": 16, "num_features": 8}, device="cpu").network
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    tokens = feature_tokens(reward_network, images)
    assert tokens.shape == (3, 1 + 16, 8)  # 32 px after three stride-2 convs: 4 x 4 positions
    assert torch.allclose(tokens[:, 0], reward_network(images), atol=1e-6)
    assert torch.allclose(tokens[:, 1:].mean(dim=1), tokens[:, 0], atol=1e-6)


def test_patch_draws_are_per_image_with_replacement_and_seeded_per_call():
    a = patch_indices(5, 16, seeded_generator(0, 0x5C0E, 3))
    assert a.shape == (5, 16) and int(a.min()) >= 0 and int(a.max()) < 16
    assert torch.equal(a, patch_indices(5, 16, seeded_generator(0, 0x5C0E, 3)))
    assert not torch.equal(a, patch_indices(5, 16, seeded_generator(0, 0x5C0E, 4)))
    assert not torch.equal(a[0], a[1])  # each image its own draw
    assert patch_indices(2, 200, seeded_generator(0)).shape == (2, 64)  # at most 64 draws
    assert patch_indices(2, 0, seeded_generator(0)) is None


def test_scoring_mixes_cls_and_drawn_patches_and_repeats_per_seed_and_call(tmp_path):
    folder = write_references(tmp_path / "refs", [(0.9, 0.1, 0.1)], size=32)
    toy = {"features": "toy", "feature_kwargs": {"width": 16, "num_features": 8}, "device": "cpu", "seed": 5}
    reward, twin = AdversarialReward(str(folder), **toy), AdversarialReward(str(folder), **toy)
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    first = reward(images, list("abcd"), [{}] * 4)["adversarial"]
    tokens = feature_tokens(reward.network, images)
    unit_tokens = tokens / (tokens.norm(dim=-1, keepdim=True) + 1e-6)
    index = patch_indices(4, 16, seeded_generator(5, 0x5C0E, 0))  # call 0 of seed 5
    drawn = torch.stack([unit_tokens[i, 1 + index[i]] for i in range(4)])  # [4, 16, 8]
    expected = 0.7 * reward.head.logits(unit_tokens[:, 0]) + 0.3 * reward.head.logits(drawn).mean(dim=1)
    assert torch.allclose(first, expected, atol=1e-6)
    second = reward(images, list("abcd"), [{}] * 4)["adversarial"]
    assert not torch.equal(first, second) and reward.calls == 2  # call 1 draws other patches
    assert torch.equal(twin(images, list("abcd"), [{}] * 4)["adversarial"], first)
    probability = AdversarialReward(str(folder), output="probability", **toy)
    assert torch.allclose(probability(images, list("abcd"), [{}] * 4)["adversarial"], torch.sigmoid(first))


def test_score_shape_and_nan_rows(tmp_path):
    reward = pixel_reward(tmp_path, lr=1.0, steps=3, policy_every=1)
    images = torch.rand(5, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    images[2, 0, 1, 1] = float("nan")
    metrics = reward.update(images, list("abcde"), [{}] * 5)  # the NaN row is left out of the negatives
    assert set(metrics) == {"disc_loss", "disc_accuracy"} and math.isfinite(metrics["disc_loss"])
    scores = reward(images, list("abcde"), [{}] * 5)["adversarial"]
    assert scores.shape == (5,) and math.isnan(scores[2]) and bool(torch.isfinite(scores[torch.arange(5) != 2]).all())
    assert reward.update(torch.full((1, 3, 4, 4), float("nan")), ["a"], [{}]) == {}  # nothing to learn from


def test_state_round_trips_through_json_and_continues_identically(tmp_path):
    folder = write_references(tmp_path / "refs", [(0.9, 0.1, 0.1), (0.1, 0.8, 0.2)], size=8)

    def trained(rounds: int) -> AdversarialReward:
        reward = AdversarialReward(str(folder), features="toy", feature_kwargs={"width": 8, "num_features": 4},
                                   device="cpu", lr=0.05, steps=2, l2=0.01, seed=3, hidden=16)
        for i in range(rounds):
            images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(i))
            reward(images, list("abcd"), [{}] * 4)
            reward.update(images, list("abcd"), [{}] * 4)
        return reward

    full, half = trained(3), trained(2)
    resumed = AdversarialReward(str(folder), features="toy", feature_kwargs={"width": 8, "num_features": 4},
                                device="cpu", lr=0.05, steps=2, l2=0.01, seed=3, hidden=16)
    resumed.load_state_dict(json.loads(json.dumps(half.state_dict())))  # through the trainer state's JSON
    assert (resumed.updates, resumed.calls) == (2, 2)
    assert all(torch.equal(a, b) for a, b in zip(resumed.head.net.parameters(), half.head.net.parameters()))
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(resumed(images, list("abcd"), [{}] * 4)["adversarial"],
                       trained(2)(images, list("abcd"), [{}] * 4)["adversarial"])
    resumed.update(images, list("abcd"), [{}] * 4)
    assert all(torch.equal(a, b) for a, b in zip(resumed.head.net.parameters(), full.head.net.parameters()))


# ------------------------------------------------------------------------------------------ the schedule

def test_over_20_epochs_the_discriminator_trains_on_9_of_10_and_the_policy_on_the_10th(tmp_path):
    reward = pixel_reward(tmp_path, lr=1.0)  # policy_every 10 by default (Adv-GRPO's d_times)
    assert isinstance(reward, TrainableReward)
    assert [e for e in range(20) if reward.policy_updates_on(e)] == [9, 19]
    assert [e for e in range(20) if reward.updates_on(e)] == [e for e in range(20) if e not in (9, 19)]
    assert reward.updates_on(0) and not reward.policy_updates_on(0)  # epoch 0 trains the discriminator
    extra = RewardUpdates({"adversarial": reward})
    assert [e for e in range(20) if extra.updates_policy(e)] == [9, 19]
    joint = pixel_reward(tmp_path, lr=1.0, policy_every=1, update_every=3)  # flowrl's joint schedule
    assert all(joint.policy_updates_on(e) for e in range(20))
    assert [e for e in range(20) if joint.updates_on(e)] == [2, 5, 8, 11, 14, 17]
    alternate = pixel_reward(tmp_path, lr=1.0, policy_every=2)
    assert RewardUpdates({"a": reward, "b": alternate}).updates_policy(19)  # both allow it
    assert not RewardUpdates({"a": reward, "b": alternate}).updates_policy(1)  # one keeps it for itself


# ------------------------------------------------------------------------------------------ references

def test_each_prompts_own_references_are_its_positives_and_the_folder_stands_in(tmp_path, caplog):
    folder = write_references(tmp_path / "folder", [(0.0, 0.0, 1.0)])
    own = tmp_path / "own"
    write_references(own / "cat", [(1.0, 0.0, 0.0), (0.8, 0.0, 0.0)])
    write_references(own / "dog", [(0.0, 1.0, 0.0)])
    reward = AdversarialReward(str(folder), reference_root=str(own), features="pixels", feature_kwargs={"size": 1},
                               patch_weight=0.0, device="cpu")
    metadata = [{"reference_images": ["cat/0.png", "cat/1.png"]}] * 4 + [{"reference_images": "dog/0.png"}] * 2 + [{}]
    with caplog.at_level(logging.WARNING, logger="flowrl.rewards"):
        positives = reward.positives(metadata, (1, 1), seeded_generator(0))  # [7, 3, 1, 1]
    reds = sorted(round(float(p[0, 0, 0]), 1) for p in positives[:4])
    assert reds == [0.8, 0.8, 1.0, 1.0]  # the cat's two references, each once per round
    assert bool((positives[:4, 1:] == 0).all())
    assert positives[4:6, :, 0, 0].tolist() == [[0.0, 1.0, 0.0]] * 2 and positives[6, :, 0, 0].tolist() == [0, 0, 1]
    assert "each prompt's metadata 'reference_images', the folder" in caplog.text
    only_folder = reward.positives([{}, {}], (1, 1), seeded_generator(0))
    assert only_folder[:, :, 0, 0].tolist() == [[0.0, 0.0, 1.0]] * 2
    assert "no prompt carries metadata 'reference_images'" in caplog.text
    no_folder = AdversarialReward(None, features="pixels", feature_kwargs={"size": 1}, patch_weight=0.0, device="cpu")
    with pytest.raises(ValueError, match="carry no metadata 'reference_images'") as error:
        no_folder.positives([{}], (1, 1), seeded_generator(0))
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="reference image not found"):
        reward.positives([{"reference_images": ["cat/9.png"]}], (1, 1), seeded_generator(0))


def test_per_prompt_similarity_on_hand_made_features():
    x = torch.tensor([[0.0, 1.0], [-1.0, 0.0]])
    own = [torch.tensor([[1.0, 0.0]]), torch.tensor([[0.6, 0.8], [0.0, -1.0]])]
    # row 0 vs its one reference: cos 0 -> 0.5 (the whole set's max would be 0.8 -> 0.9, via row 1's reference);
    # row 1 vs (0.6, 0.8) and (0, -1): cos -0.6 and 0 -> max 0 -> 0.5, mean -0.3 -> 0.35.
    assert torch.allclose(per_prompt_similarity(x, own, "max"), torch.tensor([0.5, 0.5]))
    assert torch.allclose(per_prompt_similarity(x, own, "mean"), torch.tensor([0.5, 0.35]))
    assert torch.allclose(similarity(x, torch.cat(own), "max"), torch.tensor([0.9, 0.5]))


def test_reference_similarity_compares_each_image_with_its_prompts_references(tmp_path):
    folder = write_references(tmp_path / "refs", [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0)])
    reward = build_reward("reference_similarity", references=str(folder), reference_root=str(folder),
                          features="pixels", feature_kwargs={"size": 1}, device="cpu")
    assert not isinstance(reward, TrainableReward)
    images = colour_images([(1.0, 0.0, 0.0), (1.0, 0.0, 0.0), (1.0, 1.0, 0.0), (0.0, 0.0, 0.0)])
    images = torch.cat([images, torch.full((1, 3, 1, 1), float("nan"))])
    metadata = [{"reference_images": ["0.png"]}, {"reference_images": ["1.png"]}, {}, {}, {}]
    scores = reward(images, list("abcde"), metadata)["reference_similarity"]
    # red vs its own red: 1; red vs its prompt's green: cos 0 -> 0.5 (the folder's max would say 1); yellow with no
    # references of its own: the folder, cos 1/sqrt 2 -> (1 + 0.7071) / 2; black: no direction -> 0.5; NaN: NaN.
    assert torch.allclose(scores[:4], torch.tensor([1.0, 0.5, (1 + 2 ** -0.5) / 2, 0.5]))
    assert math.isnan(scores[4])


# ------------------------------------------------------------------------------------------ config errors

@pytest.mark.parametrize("name", ["adversarial", "reference_similarity"])
def test_a_missing_or_empty_references_folder_is_one_line(tmp_path, name):
    for folder, message in ((tmp_path / "nowhere", "is not a directory"), (tmp_path / "empty", "holds no images")):
        if folder.name == "empty":
            folder.mkdir()
        with pytest.raises(ValueError, match=message) as error:
            build_reward(name, references=str(folder), device="cpu")
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"features": "pixels", "feature_kwargs": {"size": 1}}, "give no patch tokens"),
    ({"policy_every": 10, "update_every": 2}, "needs policy_every: 1"),
    ({"output": "odds"}, "output must be one of"),
    ({"policy_every": 0}, "must be >= 1"),
])
def test_bad_settings_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        build_reward("adversarial", device="cpu", **kwargs)
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------------------------------ runs

def smoke_run(run_dir, references, *overrides, schedule: str = "policy_every: 2") -> list[dict]:
    rewards = ("rewards=[{name: adversarial, kwargs: {references: '" + str(references) + "', " + schedule + ", "
               "lr: 0.05, steps: 2, hidden: 32}}]")
    clip = [] if "recipe=nft" in overrides else ["train.clip_range=0.2"]
    cfg = load_config(Config, SMOKE, [f"run_dir={run_dir}", "log.progress=false", "log.eval_every=0",
                                      "log.report_prompts=0", "train.learning_rate=1e-2", "train.checkpoint_every=1",
                                      rewards, *clip, *overrides])
    recipe_train(cfg.recipe)(cfg)
    return read_metrics(run_dir)


def trainer_state(run_dir, epoch: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{epoch:06d}" / "trainer_state.json").read_text())


def lora_b(run_dir, epoch: int, file: str = "lora.safetensors") -> list[torch.Tensor]:
    tensors = load_file(run_dir / "checkpoints" / f"step_{epoch:06d}" / file)
    return [t for name, t in sorted(tensors.items()) if "lora_B" in name]


@pytest.mark.parametrize("recipe", ["grpo", "nft"])
def test_a_discriminator_epoch_leaves_the_lora_alone_and_a_resume_matches(tmp_path, recipe):
    """policy_every 2: epoch 0 trains only the head, epoch 1 only the policy, epoch 2 only the head. The LoRA's B
    matrices start at zero (gaussian init), so after epoch 0 they are still zero and the optimizer holds no state,
    while the head has moved and the LR schedule stands where two optimizer steps would have left it."""
    references = write_references(tmp_path / "refs", [(0.9, 0.1, 0.1), (0.8, 0.2, 0.1), (0.7, 0.1, 0.2)], size=8)
    extra = [f"recipe={recipe}"] if recipe == "nft" else []
    full = smoke_run(tmp_path / "full", references, "train.epochs=3", *extra)
    assert [r["policy/updated"] for r in full] == [0.0, 1.0, 0.0]
    assert ["reward/adversarial/disc_loss" in r for r in full] == [True, False, True]
    assert all(not bool(b.any()) for b in lora_b(tmp_path / "full", 0))  # the skipped update left B at zero
    assert any(bool(b.any()) for b in lora_b(tmp_path / "full", 1))  # the policy epoch moved it
    optimizer = torch.load(tmp_path / "full" / "checkpoints" / "step_000000" / "optimizer.pt", weights_only=True)
    assert optimizer["state"] == {}
    state0 = trainer_state(tmp_path / "full", 0)
    steps = load_config(Config, SMOKE).train.optimizer_steps_per_epoch
    assert state0["lr_scheduler"]["last_epoch"] == steps  # the schedule moved past the epoch's planned steps
    head0 = state0["reward_updates"]["adversarial"]
    assert head0["updates"] == 1 and head0["calls"] > 0
    fresh = build_reward("adversarial", references=str(references), lr=0.05, steps=2, hidden=32, device="cpu")
    assert head0["head"]["params"] != fresh.head.state_dict()["params"]  # the head moved
    assert trainer_state(tmp_path / "full", 1)["reward_updates"]["adversarial"]["head"] == head0["head"]  # it rested

    smoke_run(tmp_path / "split", references, "train.epochs=2", *extra)
    split = smoke_run(tmp_path / "split", references, "train.epochs=3", "train.resume=latest", *extra)
    strip = lambda records: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]  # noqa: E731
    assert strip(split) == strip(full)
    assert (trainer_state(tmp_path / "split", 2)["reward_updates"]
            == trainer_state(tmp_path / "full", 2)["reward_updates"])


def test_the_extra_is_built_only_for_trainable_rewards(tmp_path):
    class Run:
        rewards = [build_reward("brightness")]

    assert reward_updates(Run()) is None
    Run.rewards.append(pixel_reward(tmp_path, lr=1.0))
    assert list(reward_updates(Run()).rewards) == ["adversarial"]


def test_the_shipped_configs(tmp_path):
    from flowrl.rewards_api import build_rewards, score
    from tools.toy_artifacts import make_toy_artifacts

    path = "configs/toy/grpo_adversarial.yaml"
    cfg = load_config(Config, path)
    assert [(r.name, r.weight) for r in cfg.rewards] == [("toy_proxy", 1.0), ("adversarial", 1.0), ("toyeval", 0.0)]
    assert cfg.rewards[1].kwargs["references"] == "runs/toy_artifacts/clean"
    assert "python -m tools.toy_artifacts runs/toy_artifacts --n 1000" in open(path).read()  # the header makes them
    make_toy_artifacts(tmp_path / "toy", n=4)
    cfg.rewards[1].kwargs["references"] = str(tmp_path / "toy" / "clean")
    rewards, weights = build_rewards(cfg.rewards, torch.device("cpu"))
    assert weights == {"toy_proxy": 1.0, "adversarial": 1.0, "toyeval": 0.0}
    adversarial = rewards[1]
    assert adversarial.policy_updates_on(0) and adversarial.updates_on(0)  # joint, so the comparison is fair
    out = score(rewards, torch.rand(2, 3, 32, 32), ["a red circle", "a red circle"], [{}, {}])
    assert bool(((out["adversarial"] > 0) & (out["adversarial"] < 1)).all())  # output: probability
    metrics = adversarial.update(torch.rand(4, 3, 32, 32), ["a red circle"] * 4, [{}] * 4)
    assert set(metrics) == {"disc_loss", "disc_accuracy"}
    sd35 = load_config(Config, "configs/sd35_medium/grpo_adversarial.yaml").rewards[0]
    assert sd35.name == "adversarial" and sd35.kwargs["policy_every"] == 10  # Adv-GRPO's d_times, the default
    assert (sd35.kwargs["output"], sd35.kwargs["patch_weight"], sd35.kwargs["hidden"]) == ("logit", 0.3, 512)


@pytest.mark.slow
def test_two_processes_train_the_same_head_as_one(tmp_path):
    """Under ``accelerate launch`` every process updates its copy of the head on the images of all processes, so
    the head two processes checkpoint is the head one process trains on the same global batch. Without patch
    tokens (patch_weight 0): each process draws its scoring patches for its own rows, so with them the two runs'
    rewards, and so their policies, would part."""
    import subprocess

    from tests import REPO

    references = write_references(tmp_path / "refs", [(0.9, 0.1, 0.1), (0.8, 0.2, 0.1), (0.7, 0.1, 0.2)], size=8)
    rewards = ("rewards=[{name: adversarial, kwargs: {references: '" + str(references) + "', policy_every: 1, "
               "patch_weight: 0.0, lr: 0.05, steps: 2, hidden: 32}}]")
    common = [SMOKE, "train.epochs=2", "log.progress=false", "log.eval_every=0", "log.report_prompts=0",
              "train.learning_rate=1e-2", "train.clip_range=0.2", "train.checkpoint_every=1", rewards]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*TWO_PROCESSES, "-m", "flowrl", "train", *common, "sampling.prompts_per_batch=2",
                             f"run_dir={tmp_path / 'two'}"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, launch_failure(result.stderr)
    assert main(["train", *common, "sampling.prompts_per_batch=4", f"run_dir={tmp_path / 'one'}"]) == 0
    one, two_state = (trainer_state(tmp_path / n, 1)["reward_updates"]["adversarial"] for n in ("one", "two"))
    assert one["updates"] == two_state["updates"] == 2
    for name in one["head"]["params"]:
        a, b = (_decode(state["head"]["params"][name]) for state in (one, two_state))
        assert a.abs().sum() > 0 and torch.allclose(a, b, rtol=1e-3, atol=1e-5), name
    losses = [[r["reward/adversarial/disc_loss"] for r in read_metrics(tmp_path / n)] for n in ("one", "two")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)
