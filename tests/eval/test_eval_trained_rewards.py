"""``flowrl eval`` scores a reward that trains during a run (Adv-GRPO's discriminator) by the state the run saved in
its checkpoint, the same head for every checkpoint, and leaves it out, with one line, where no checkpoint holds it:
built from the config alone it is an untrained head."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from safetensors.torch import save_file

from flowrl.eval.checkpoints import EvalCheckpoint
from flowrl.eval.runner import with_trained_states
from flowrl.rewards_api import build_reward
from rewards.adversarial import AdversarialReward
from tests.rewards.test_rewards_adversarial import write_references


def discriminator(references) -> AdversarialReward:
    return AdversarialReward(str(references), features="toy", feature_kwargs={"width": 8, "num_features": 4},
                             device="cpu", lr=0.05, steps=2, seed=3, hidden=16)


def head(reward: AdversarialReward) -> list[torch.Tensor]:
    return [p.detach().clone() for p in reward.head.net.parameters()]


def test_a_trained_reward_is_scored_by_its_runs_saved_head_or_left_out(tmp_path, capsys):
    references = write_references(tmp_path / "refs", [(0.9, 0.1, 0.1), (0.1, 0.8, 0.2)], size=8)
    trained = discriminator(references)
    for i in range(2):
        images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(i))
        trained(images, list("abcd"), [{}] * 4)
        trained.update(images, list("abcd"), [{}] * 4)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    save_file({"x": torch.zeros(1)}, str(checkpoint / "lora.safetensors"))
    (checkpoint / "trainer_state.json").write_text(json.dumps(
        {"step": 2, "reward_updates": {"adversarial": trained.state_dict()}}))
    brightness = build_reward("brightness")

    for spec in (tmp_path / "run" / "lora", checkpoint):  # the run's export (its latest checkpoint), the checkpoint
        fresh = discriminator(references)
        assert not all(torch.equal(a, b) for a, b in zip(head(fresh), head(trained)))
        kept, used = with_trained_states([fresh, brightness], [EvalCheckpoint("base"), EvalCheckpoint("run", spec)])
        assert kept == [fresh, brightness] and used == {"adversarial": str(checkpoint)}
        assert all(torch.equal(a, b) for a, b in zip(head(fresh), head(trained)))
        assert (fresh.updates, fresh.calls) == (trained.updates, trained.calls)

    lora = tmp_path / "plain.safetensors"  # a LoRA file alone holds no reward state
    kept, used = with_trained_states([discriminator(references), brightness],
                                     [EvalCheckpoint("base"), EvalCheckpoint("plain", lora)])
    assert kept == [brightness] and used == {"adversarial": None}
    assert "reward adversarial: left out" in capsys.readouterr().out
    assert with_trained_states([brightness], [EvalCheckpoint("base")]) == ([brightness], {})
