"""flowrl's one in-place weight write (flowrl/core/sharded.py: write_weights, weights_swapped), which the EMA's eval
weights, full fine-tuning's base reference and the held-out guard's restore all use: a swap puts the values in and
gives both sides back bit for bit, a load leaves its values as they were, the foreach and one-at-a-time paths write
the same, autograd's saved weights see their own values again after a swap, and an FSDP2 root parameter gathered
whole against a sharded store gets the whole value and its own back."""

import pytest
import torch

from flowrl.core.sharded import weights_swapped, write_weights


def tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, generator=generator), torch.randn(5, generator=generator)]


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_a_swap_puts_the_values_in_and_gives_both_sides_back_bit_for_bit(one_at_a_time):
    params = [torch.nn.Parameter(t) for t in tensors(0)]
    store = tensors(1)
    live_before, store_before = [p.detach().clone() for p in params], [t.clone() for t in store]
    with weights_swapped(params, store, one_at_a_time=one_at_a_time):
        assert all(torch.equal(p, v) for p, v in zip(params, store_before))  # the values are live
        assert all(torch.equal(t, v) for t, v in zip(store, live_before))  # the live weights wait in the store
    assert all(torch.equal(p, v) for p, v in zip(params, live_before))
    assert all(torch.equal(t, v) for t, v in zip(store, store_before))


def test_a_load_writes_the_values_and_leaves_them_as_they_were():
    params = [torch.nn.Parameter(t) for t in tensors(0)]
    values = tensors(1)
    kept = write_weights(params, values, exchange=False)
    assert kept == [None, None]
    assert all(torch.equal(p, v) for p, v in zip(params, tensors(1)))
    assert all(torch.equal(v, w) for v, w in zip(values, tensors(1)))


def test_the_saved_weights_of_a_forward_see_their_own_values_after_a_swap():
    """A forward with the live weights, a swap in between (an EMA eval, a KL reference), then its backward: the
    writes go through .data, so autograd neither refuses the backward nor uses the swapped-in values."""
    weight = torch.nn.Parameter(torch.tensor([2.0, -1.0]))
    x = torch.tensor([3.0, 5.0], requires_grad=True)
    loss = (weight * x).sum()
    with weights_swapped([weight], [torch.tensor([7.0, 7.0])]):
        pass
    loss.backward()
    assert torch.equal(x.grad, torch.tensor([2.0, -1.0]))  # d loss / d x is the live weight, not 7


def test_a_gathered_root_parameter_against_a_sharded_store_gets_the_whole_value_and_its_own_back(tmp_path):
    """FSDP2 keeps the root module's parameters gathered (plain tensors) between a forward and its backward, while
    their base copy is a DTensor shard: the swap all-gathers the shard in and keeps the live value aside."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        base = tensors(1)
        store = [distribute_tensor(t.clone(), mesh, [Shard(0)]) for t in base]
        params = [torch.nn.Parameter(t) for t in tensors(0)]
        with weights_swapped(params, store):
            assert all(torch.equal(p, v) for p, v in zip(params, base))
        assert all(torch.equal(p, v) for p, v in zip(params, tensors(0)))
        assert all(torch.equal(t.full_tensor(), v) for t, v in zip(store, base))  # the shard never changed
    finally:
        dist.destroy_process_group()
