"""The written-out rollout against the diffusers pipelines, window and tree structure, determinism."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from flowrl.models import build_policy
from flowrl.models.tiny import TINY_T5_MAX_LENGTH
from flowrl.sampling import RolloutSettings, StepPlan, rollout, sde_step
from flowrl.core.seeding import generators

PROMPTS = ["a red circle", "two blue squares"]


@pytest.fixture(scope="module")
def sd3():
    return build_policy("sd3", "tiny", seed=0)


@pytest.fixture(scope="module")
def flux():
    return build_policy("flux", "tiny", seed=0)


@pytest.mark.parametrize("family, guidance", [("sd3", 4.5), ("sd3", 1.0), ("flux", 3.5)])
def test_ode_rollout_reproduces_the_diffusers_pipeline(family, guidance, request):
    policy = request.getfixturevalue(family)
    seeds = [11, 12, 13, 14]
    steps = 4
    traj = rollout(policy, PROMPTS, RolloutSettings(num_steps=steps, guidance_scale=guidance, noise_level=0.0),
                   group_size=2, seeds=seeds)
    reference = policy.pipeline(
        prompt=[p for p in PROMPTS for _ in range(2)], num_inference_steps=steps, guidance_scale=guidance,
        height=policy.height, width=policy.width, generator=generators(seeds), output_type="pt",
        max_sequence_length=TINY_T5_MAX_LENGTH,
    ).images
    torch.testing.assert_close(traj.images, reference, rtol=0, atol=1e-5)


def test_rollout_shapes_and_recorded_log_probs(sd3):
    traj = rollout(sd3, PROMPTS, RolloutSettings(num_steps=4, guidance_scale=4.5, noise_level=0.7), group_size=3,
                   seeds=list(range(6)), metadata=[{"a": 1}, {"b": 2}])
    c, h, w = sd3.latent_shape(1)[1:]
    assert traj.latents.shape == (6, 5, c, h, w)
    assert traj.log_probs.shape == (6, 4) and torch.isfinite(traj.log_probs).all()
    assert traj.images.shape == (6, 3, sd3.height, sd3.width)
    assert traj.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert traj.row_metadata[4] == {"b": 2}
    # Recomputing each transition's log-prob from the stored latents gives the recorded value exactly.
    for k in range(4):
        cond = traj.cond.select(traj.prompt_ids)
        v = sd3.velocity(traj.latents[:, k], traj.sigmas[k], cond, 4.5)
        again = sde_step(v, traj.latents[:, k], traj.sigmas[k], traj.sigmas[k + 1], noise_level=0.7,
                         prev_sample=traj.latents[:, k + 1])
        assert torch.equal(again.log_prob, traj.log_probs[:, k])


def test_rollout_is_deterministic_per_row(sd3):
    settings = RolloutSettings(num_steps=3, guidance_scale=4.5, noise_level=0.7)
    both = rollout(sd3, PROMPTS, settings, group_size=2, seeds=[5, 6, 7, 8])
    again = rollout(sd3, PROMPTS, settings, group_size=2, seeds=[5, 6, 7, 8])
    assert torch.equal(both.final_latents, again.final_latents)  # bit-identical rerun
    # A row's sample does not depend on its batch-mates. The GEMM kernel, hence the rounding, follows the batch
    # shape and the CPU: latents (|x| <= ~5) agree to 1e-4, while another row's sample differs by ~1.
    second_only = rollout(sd3, PROMPTS[1:], settings, group_size=2, seeds=[7, 8])
    torch.testing.assert_close(both.final_latents[2:], second_only.final_latents, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(both.final_latents[0], both.final_latents[1])


def test_same_noise_in_group_shares_initial_noise_only(sd3):
    traj = rollout(sd3, PROMPTS,
                   RolloutSettings(num_steps=3, guidance_scale=4.5, noise_level=0.7, same_noise_in_group=True),
                   group_size=2, seeds=[1, 2, 3, 4])
    assert torch.equal(traj.latents[0, 0], traj.latents[1, 0])
    assert not torch.equal(traj.latents[0, 0], traj.latents[2, 0])
    assert not torch.equal(traj.latents[0, 1], traj.latents[1, 1])  # SDE noise still differs


def test_window_rollout_is_ode_outside_the_window(sd3):
    steps, seeds = 6, [3, 4]
    plan = StepPlan(steps, sde_start=2, sde_size=2)
    settings = RolloutSettings(num_steps=steps, guidance_scale=4.5, noise_level=0.7, plan=plan)
    window = rollout(sd3, PROMPTS[:1], settings, group_size=2, seeds=seeds)
    assert window.latents.shape[1] == 3 and window.log_probs.shape[1] == 2
    assert window.step_indices.tolist() == [2, 3]
    # Replay the ODE prefix by hand: the window's first stored state is bit-identical to it.
    cond = sd3.encode(PROMPTS[:1]).select([0, 0])
    sigmas = sd3.sigmas(steps)
    x = sd3.init_noise(2, generator=generators(seeds))
    for i in range(2):
        x = sde_step(sd3.velocity(x, sigmas[i], cond, 4.5), x, sigmas[i], sigmas[i + 1], noise_level=0.0,
                     kind="ode").prev_sample
    assert torch.equal(window.latents[:, 0], x)
    # ...and the suffix after the window is plain ODE from the window's last state.
    x = window.latents[:, -1]
    for i in range(4, steps):
        x = sde_step(sd3.velocity(x, sigmas[i], cond, 4.5), x, sigmas[i], sigmas[i + 1], noise_level=0.0,
                     kind="ode").prev_sample
    assert torch.equal(window.final_latents, x)


def test_tree_leaves_share_their_ancestors_exactly(sd3):
    plan = StepPlan(4, branch_steps=(1, 2), branch_factor=2)
    traj = rollout(sd3, PROMPTS[:1], RolloutSettings(num_steps=4, guidance_scale=4.5, noise_level=0.7, plan=plan),
                   group_size=4, seeds=[9])
    assert traj.num_rows == 4
    lat = traj.latents  # [4, 5, C, h, w]
    # Before step 1 every leaf carries the root's states; step 0's output is shared by all four.
    for row in range(1, 4):
        assert torch.equal(lat[row, :2], lat[0, :2])
    # After branching at step 1, leaves {0,1} and {2,3} form two subtrees sharing step 1's output.
    assert torch.equal(lat[1, 2], lat[0, 2]) and torch.equal(lat[3, 2], lat[2, 2])
    assert not torch.equal(lat[0, 2], lat[2, 2])
    # After the second branch all leaves differ.
    assert len({tuple(lat[r, 3].flatten()[:4].tolist()) for r in range(4)}) == 4
    # Edge ids: one edge at step 0, two at step 1, four at steps 2 and 3; each trained once.
    assert [len(set(traj.edge_ids[:, k].tolist())) for k in range(4)] == [1, 2, 4, 4]
    assert traj.first_visit_mask().sum(dim=0).tolist() == [1, 2, 4, 4]
    assert traj.parent.tolist() == [-1, 0, 0, 2]
    # Shared transitions carry identical recorded log-probs.
    assert torch.equal(traj.log_probs[:, 0], traj.log_probs[0, 0].expand(4))


def test_bad_rollout_arguments_are_rejected(sd3):
    with pytest.raises(ValueError, match="root seeds"):
        rollout(sd3, PROMPTS, RolloutSettings(num_steps=3, guidance_scale=1.0, noise_level=0.7), group_size=2,
                seeds=[1])
    with pytest.raises(ValueError, match="multiple"):
        rollout(sd3, PROMPTS, RolloutSettings(num_steps=3, guidance_scale=1.0, noise_level=0.7,
                                              plan=StepPlan(3, branch_steps=(0,), branch_factor=2)),
                group_size=3, seeds=[1, 2])


def test_policy_loads_a_local_pipeline_directory_with_the_real_loader(tmp_path, sd3):
    sd3.pipeline.save_pretrained(tmp_path / "pipe")
    loaded = build_policy("sd3", str(tmp_path / "pipe"), dtype="float32", max_sequence_length=TINY_T5_MAX_LENGTH)
    assert loaded.dtype == torch.float32 and loaded.height == sd3.height
    ode, rows = RolloutSettings(num_steps=2, guidance_scale=4.5, noise_level=0.0), dict(group_size=1, seeds=[3])
    assert torch.equal(rollout(loaded, PROMPTS[:1], ode, **rows).images, rollout(sd3, PROMPTS[:1], ode, **rows).images)
    with pytest.raises(FileNotFoundError, match="could not load StableDiffusion3Pipeline") as error:
        build_policy("sd3", str(tmp_path / "missing"))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("chunk, guidance, plan", [
    (2, 4.5, StepPlan(4)),  # half a group at a time
    (4, 4.5, StepPlan(4)),  # one whole group at a time
    (1, 1.0, StepPlan(4)),  # one row at a time, no CFG
    (2, 4.5, StepPlan(4, sde_start=1, sde_size=2, branch_steps=(1,), branch_factor=2)),  # a tree, a root per chunk
])
def test_chunked_rollout_equals_one_call(sd3, chunk, guidance, plan):
    from flowrl.sampling import chunked_rollout

    settings = RolloutSettings(num_steps=4, guidance_scale=guidance, noise_level=0.7, plan=plan)
    rows = dict(group_size=4, seeds=list(range(100, 100 + 2 * 4 // plan.leaves_per_root)))
    whole = rollout(sd3, PROMPTS, settings, **rows)
    chunked = chunked_rollout(sd3, PROMPTS, settings, chunk=chunk, **rows)
    for name in ("prompt_ids", "group_ids", "parent", "seeds"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name
    assert chunked.prompts == whole.prompts and chunked.num_rows == 8
    assert torch.equal(chunked.cond.prompt_embeds, whole.cond.prompt_embeds)
    # The same noise row for row. CPU GEMM kernels are chosen by batch shape and machine, so other shapes round
    # differently: a tolerance, never bit equality, across shapes. The latents (|x| <= ~5) and images carry the
    # velocity's rounding through the steps (measured <= 3e-6 here, more on other CPUs): 1e-4. The log-probs
    # (|log p| <= ~4) divide latent rounding by the small late-step stds: relative 1e-5. A wrong seed or noise row
    # moves the latents by ~5 and the log-probs by >= 1e-2, far outside both.
    for name, rtol, atol in (("latents", 1e-4, 1e-4), ("log_probs", 1e-5, 1e-5), ("final_latents", 1e-4, 1e-4),
                             ("images", 1e-4, 1e-4)):
        torch.testing.assert_close(getattr(chunked, name), getattr(whole, name), rtol=rtol, atol=atol, msg=name)
    with pytest.raises(ValueError, match="multiple or a divisor"):
        chunked_rollout(sd3, PROMPTS, settings, chunk=3, **rows)
